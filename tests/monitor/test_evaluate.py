"""`monitor evaluate`: the detector scored on labelled streams (synthetic, with known outcomes)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dpcc_megatron.config import MonitorConfig
from dpcc_megatron.monitor.evaluate import (PACK, LabelError, evaluate, half_reward_iteration, read_labels, score,
                                            StreamResult, write_pack)


def _healthy(n=30):
    # learning: reward rises, entropy falls gently, KL small
    return [{"iteration": i, "reward_mean": 0.3 + 0.02 * i, "reward_std": 0.3, "entropy": 2.0 - 0.01 * i,
             "kl_old_new": 0.01, "grad_norm": 1.0} for i in range(n)]


def _entropy_collapse(n=30, start=10):
    # entropy leaves the band upward from `start` (high-entropy collapse); reward halves 6 iterations later
    out = []
    for i in range(n):
        bad = i >= start
        out.append({"iteration": i, "reward_mean": 0.6 if i < start + 6 else 0.1, "reward_std": 0.3,
                    "entropy": 5.0 if bad else 2.0, "kl_old_new": 0.01, "grad_norm": 1.0})
    return out


def _write(tmp_path, streams):
    labels = []
    for name, (records, label, split) in streams.items():
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
        labels.append({"stream": f"{name}.jsonl", "label": label, "split": split})
    (tmp_path / "labels.jsonl").write_text("\n".join(json.dumps(x) for x in labels) + "\n")
    return tmp_path


def test_half_reward_iteration():
    # read on the trailing 3-iteration mean: 0.6, 0.6, 0.1 -> 0.43 (not yet half of 0.6); 0.6, 0.1, 0.1 -> 0.27
    assert half_reward_iteration(_entropy_collapse()) == 17
    assert half_reward_iteration(_healthy()) is None
    r = lambda xs: [{"iteration": i, "reward_base_mean": x, "reward_mean": 1.0} for i, x in enumerate(xs)]  # noqa: E731
    assert half_reward_iteration(r([0.4, 0.4, 0.4] + [0.0] * 6)) == 4  # the rule track is read
    # a dip the run recovers from is not a halving, nor a fall in the last two iterations
    assert half_reward_iteration(r([0.4, 0.4, 0.4, 0.0, 0.0, 0.0, 0.4, 0.4, 0.4])) is None
    assert half_reward_iteration(r([0.4] * 6 + [0.0] * 5)) is None  # 4 of the last 5 below: under 5
    assert half_reward_iteration(r([0.4] * 6 + [0.0] * 6)) == 7
    assert half_reward_iteration(r([0.4] * 6 + [0.0, 0.0]), min_tail=1) == 7


def test_scores_a_detected_collapse_and_a_quiet_healthy_run(tmp_path):
    folder = _write(tmp_path, {"c1": (_entropy_collapse(), "collapse", "heldout"), "h1": (_healthy(), "healthy", "heldout"),
                               "dev": (_entropy_collapse(start=3), "collapse", "dev")})
    cfg = MonitorConfig(entropy_band=(1.5, 2.5), collapse_confirm_steps=3)
    results, s = evaluate(folder, cfg)
    assert [r.name for r in results] == ["c1.jsonl", "h1.jsonl"]  # held-out only
    c1 = results[0]
    assert c1.first_confirmed is not None and c1.first_confirmed <= 16 and c1.detected and c1.lead >= 1
    assert s["recall"] == 1.0 and s["precision"] == 1.0 and s["healthy_critical"] == 0
    assert s["median_lead_iterations"] == c1.lead
    # a detector whose band is too wide to see it, and that does not read the reward level, misses it
    _, blind = evaluate(folder, MonitorConfig(entropy_band=(0.5, 9.0), entropy_jump=100.0, reward_drop_fraction=None))
    assert blind["recall"] == 0.0


def test_score_counts_false_alarms_and_warnings():
    res = [StreamResult("a", "collapse", 20, 5, 10, 0, 1), StreamResult("b", "collapse", 20, None, 8, 2, 0),
           StreamResult("c", "healthy", 50, 7, None, 1, 2), StreamResult("d", "healthy", 50, None, None, 3, 0)]
    s = score(res)
    assert s["recall"] == 0.5 and s["precision"] == 0.5 and s["healthy_critical"] == 2
    assert s["warnings_per_100_healthy"] == pytest.approx(4.0) and s["median_lead_iterations"] == 5
    # a degraded stream's alarm is neither a false alarm nor a detection; its warnings are not healthy ones
    s2 = score(res + [StreamResult("e", "degraded", 50, 3, None, 9, 4), StreamResult("f", "degraded", 50, None, None, 0, 0)])
    assert (s2["degraded"], s2["degraded_alarmed"]) == (2, 1)
    assert s2["healthy_critical"] == 2 and s2["recall"] == 0.5
    assert s2["warnings_per_100_healthy"] == pytest.approx(4.0)


def test_late_alarm_does_not_count_as_detection():
    late = StreamResult("x", "collapse", 30, 20, 16, 0, 1)
    assert not late.detected and late.lead == -4


def test_bad_labels_name_the_file_and_line(tmp_path):
    (tmp_path / "labels.jsonl").write_text('{"stream": "nope.jsonl", "label": "collapse", "split": "dev"}\n')
    with pytest.raises(LabelError, match=r"labels.jsonl:1: stream 'nope.jsonl' is not a file"):
        evaluate(tmp_path, MonitorConfig(), None)
    (tmp_path / "labels.jsonl").write_text('{"stream": "x", "label": "broken", "split": "dev"}\n')
    with pytest.raises(LabelError, match="label must be one of"):
        evaluate(tmp_path, MonitorConfig(), None)


def test_a_set_packed_in_one_archive_scores_as_the_loose_one(tmp_path):
    (tmp_path / "loose").mkdir()
    loose = _write(tmp_path / "loose", {"c1": (_entropy_collapse(), "collapse", "heldout"),
                                        "h1": (_healthy(), "healthy", "heldout")})
    packed = tmp_path / "packed"
    packed.mkdir()
    labels = read_labels(loose)
    members = {x["stream"]: x["path"].read_text() for x in labels}
    write_pack(packed / PACK, members, [{k: v for k, v in x.items() if k != "path"} for x in labels])
    assert [p.name for p in packed.iterdir()] == [PACK]  # the whole set in one file
    cfg = MonitorConfig(entropy_band=(1.5, 2.5), collapse_confirm_steps=3)
    assert evaluate(packed, cfg) == evaluate(loose, cfg)
    got = read_labels(packed)
    assert [str(x["path"]) for x in got] == [f"{packed / PACK}:c1.jsonl", f"{packed / PACK}:h1.jsonl"]
    # the same set gives the same bytes (sorted members, fixed times), so a rewrite leaves git clean
    first = (packed / PACK).read_bytes()
    write_pack(packed / PACK, dict(reversed(members.items())), [{k: v for k, v in x.items() if k != "path"}
                                                                for x in labels])
    assert (packed / PACK).read_bytes() == first
    # a loose labels.jsonl is read before the archive's; one naming a stream the archive lacks names the file
    (packed / "labels.jsonl").write_text('{"stream": "h9.jsonl", "label": "healthy", "split": "dev"}\n')
    with pytest.raises(LabelError, match=r"labels.jsonl:1: stream 'h9.jsonl' is not a file .* nor a member of its"):
        read_labels(packed)
    (packed / "labels.jsonl").unlink()
    write_pack(packed / PACK, members)  # an archive without labels.jsonl is no set
    with pytest.raises(LabelError, match="not found"):
        read_labels(packed)
    (packed / PACK).write_bytes(b"not xz")
    with pytest.raises(LabelError, match="not a readable tar.xz archive"):
        read_labels(packed)


def test_cli_prints_the_table_and_one_json_line(tmp_path):
    long = "stab-grid__dpcc-paper__lr0.0002__s10_and_a_name_longer_than_the_column"
    folder = _write(tmp_path, {"c1": (_entropy_collapse(), "collapse", "heldout"), long: (_healthy(), "healthy", "heldout")})
    out = subprocess.run([sys.executable, "-m", "dpcc_megatron.cli", "monitor", "evaluate", "--labelled", str(folder)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert any(line.split()[0].endswith(long + ".jsonl") for line in out.stdout.splitlines()[1:-1])  # whole names
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"recall", "healthy_critical", "warnings_per_100_healthy", "median_lead_iterations"} <= set(last)
    bad = subprocess.run([sys.executable, "-m", "dpcc_megatron.cli", "monitor", "evaluate", "--labelled",
                          str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "labels.jsonl" in bad.stderr


def test_seeds_and_family_filters_pick_the_streams_of_one_part(tmp_path):
    folder = _write(tmp_path, {"c1": (_entropy_collapse(), "collapse", "heldout"), "h1": (_healthy(), "healthy", "heldout"),
                               "h2": (_healthy(), "healthy", "heldout")})
    extra = {"c1.jsonl": {"seed": 7, "family": "grid-addition1-1step"}, "h1.jsonl": {"seed": 7, "family": "learn"},
             "h2.jsonl": {"seed": 8, "family": "grid-addition1-2step"}}
    lines = [json.loads(line) for line in (folder / "labels.jsonl").read_text().splitlines()]
    (folder / "labels.jsonl").write_text("\n".join(json.dumps({**x, **extra[x["stream"]]}) for x in lines) + "\n")
    cfg = MonitorConfig(entropy_band=(1.5, 2.5))
    names = lambda **kw: [r.name for r in evaluate(folder, cfg, **kw)[0]]  # noqa: E731
    assert names() == ["c1.jsonl", "h1.jsonl", "h2.jsonl"]
    assert names(seeds={7}) == ["c1.jsonl", "h1.jsonl"]
    assert names(families=["grid-addition1"]) == ["c1.jsonl", "h2.jsonl"]
    assert names(seeds={7}, families=["grid-", "learn"]) == ["c1.jsonl", "h1.jsonl"]
    with pytest.raises(LabelError, match=r"no streams in split 'heldout', seeds \[9\]"):
        evaluate(folder, cfg, seeds={9})
    cli = [sys.executable, "-m", "dpcc_megatron.cli", "monitor", "evaluate", "--labelled", str(folder)]
    out = subprocess.run(cli + ["--seeds", "8", "--family", "grid-"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["streams"] == 1 and "h2.jsonl" in out.stdout
    bad = subprocess.run(cli + ["--seeds", "8,x"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--seeds: a comma list of integers" in bad.stderr
