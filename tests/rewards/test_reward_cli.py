import json
import subprocess
import sys
from pathlib import Path

from dpcc_megatron.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]

LINES = [
    {"prompt": "12+34=", "response": "46", "task": "addition", "answer": "46"},
    {"prompt": "12+34=", "response": "47", "task": "addition", "answer": "46"},
    {"prompt": "What is half of one?", "response": r"It is \boxed{\frac{1}{2}}", "task": "math", "answer": "0.5"},
    {"prompt": "What is half of one?", "response": "#### 2", "task": "math", "answer": "0.5"},
    {"prompt": "Write add(a, b).", "response": "```python\ndef add(a, b):\n    return a + b\n```", "task": "code",
     "tests": "assert add(2, 3) == 5", "id": "keep-me"},
    {"prompt": "Write add(a, b).", "response": "def add(a, b) return a+b", "task": "code",
     "tests": "assert add(2, 3) == 5"},
    {"prompt": "Give a person as JSON.", "response": '{"name": "Ada"}', "task": "json",
     "schema": {"type": "object", "required": ["name"]}},
    {"prompt": "Explain photosynthesis.", "response": "Photosynthesis 是 the 过程 by which 植物 convert 光", "task": "text"},
]


def test_cli_round_trip(tmp_path):
    inp, out, metrics = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "metrics.json"
    inp.write_text("\n".join(json.dumps(x) for x in LINES) + "\n")
    cfg = tmp_path / "job.yaml"
    cfg.write_text("reward:\n  sandbox: {timeout_s: 5}\n")
    proc = subprocess.run([sys.executable, "-m", "dpcc_megatron.cli", "reward", "--config", str(cfg),
                           "--input", str(inp), "--out", str(out), "--metrics", str(metrics)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "scored 8 samples in 5 groups" in proc.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 8
    for src, row in zip(LINES, rows):
        assert {k: row[k] for k in src} == src  # input fields are kept
        assert all(0 <= row[k] <= 1 for k in ("base", "advanced", "total"))
        assert abs(row["total"] - (0.4 * row["base"] + 0.6 * row["advanced"])) < 1e-6
    assert rows[0]["checkers"]["math"] == 1.0 and rows[1]["checkers"]["math"] == 0.0
    assert rows[0]["advanced"] > rows[1]["advanced"]
    assert rows[2]["checkers"]["math"] == 1.0 and rows[3]["checkers"]["math"] == 0.0
    assert rows[4]["checkers"]["code"] == 1.0 and rows[5]["checkers"]["code"] == 0.0
    assert rows[6]["checkers"]["json"] == 1.0
    assert rows[7]["checkers"]["language"] < 0.3
    assert "repetition" in rows[0]["checkers"]  # penalties are reported too
    assert json.loads(metrics.read_text())["reward/checker_errors"] == 0.0


def test_cli_malformed_input_names_the_line(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(LINES[0]) + "\n" + '{"prompt": "x", "response": 3}\n')
    rc = cli_main(["reward", "--input", str(inp), "--out", str(tmp_path / "o.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and f"{inp}:2" in err and "'response' must be a string" in err
    inp.write_text("not json\n")
    assert cli_main(["reward", "--input", str(inp), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert f"{inp}:1: invalid JSON" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_bad_eval_set_and_config(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(LINES[0]) + "\n")
    ev = tmp_path / "eval.jsonl"
    ev.write_text(json.dumps({**LINES[0], "label": "good"}) + "\n")
    rc = cli_main(["reward", "--input", str(inp), "--out", str(tmp_path / "o.jsonl"),
                   "--set", f"reward.eval_set={ev}"])
    assert rc == 2 and f"{ev}:1: field 'label'" in capsys.readouterr().err
    rc = cli_main(["reward", "--input", str(inp), "--out", str(tmp_path / "o.jsonl"), "--set", "reward.base_weight=2"])
    assert rc == 2 and "reward.base_weight must be in [0, 1]" in capsys.readouterr().err
