"""Dataset adapters: each layout in JSONL and Parquet, auto detection, errors with file and line,
no silent task fallback."""
import json

import pytest

from dpcc_megatron.data.formats import DataError, check_tasks, detect_format, load_prompts

GSM8K = {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"}
MATH = {"problem": "Compute $\\frac{1}{2}+\\frac{1}{4}$.", "solution": "We get $\\boxed{\\frac{3}{4}}$."}
VERL = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "What is 2+2?"}],
        "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {"answer": "2+2=4 #### 4"}}
CODE = {"prompt": "def add(a, b):\n", "canonical_solution": "    return a + b\n", "entry_point": "add",
        "test": "def check(f):\n    assert f(1, 2) == 3\n"}
PLAIN = {"prompt": "Say hi in JSON.", "task": "json", "schema": {"type": "object"}, "response": "{\"hi\": 1}"}
LAYOUTS = {"gsm8k": GSM8K, "math": MATH, "verl": VERL, "code": CODE, "plain": PLAIN}


def _write(tmp_path, rows, suffix=".jsonl", name="d"):
    path = tmp_path / f"{name}{suffix}"
    if suffix == ".parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _check(name, p):
    if name == "gsm8k":
        assert (p.text, p.fields["task"], p.fields["answer"]) == (GSM8K["question"], "math", "7")
        assert p.gold == GSM8K["answer"] and p.messages is None
    elif name == "math":
        assert (p.fields["task"], p.fields["answer"], p.gold) == ("math", "\\frac{3}{4}", MATH["solution"])
    elif name == "verl":
        assert p.messages == VERL["prompt"] and p.text == "What is 2+2?" and p.chat_input == VERL["prompt"]
        assert (p.fields["task"], p.fields["answer"], p.gold) == ("math", "4", "2+2=4 #### 4")
    elif name == "code":
        assert p.fields["task"] == "code" and p.fields["tests"].rstrip().endswith("check(add)")
        assert p.gold == CODE["prompt"] + CODE["canonical_solution"]
    elif name == "plain":
        assert (p.fields["task"], p.fields["schema"], p.gold) == ("json", {"type": "object"}, "{\"hi\": 1}")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_each_layout_explicit_and_auto(tmp_path, name, suffix):
    path = _write(tmp_path, [LAYOUTS[name]] * 2, suffix)
    for fmt in (name, "auto"):
        prompts = load_prompts(path, fmt)
        assert len(prompts) == 2
        _check(name, prompts[0])
        assert prompts[1].source == (f"{path}:2" if suffix == ".jsonl" else f"{path}:row 2")


def test_auto_detects_per_record_and_mixed_files_work(tmp_path):
    assert [detect_format(r) for r in (GSM8K, MATH, VERL, CODE, PLAIN, {"x": 1})] == \
        ["gsm8k", "math", "verl", "code", "plain", None]
    prompts = load_prompts(_write(tmp_path, [GSM8K, VERL, MATH]))
    assert [p.fields["task"] for p in prompts] == ["math", "math", "math"]
    with pytest.raises(DataError, match=r"d\.jsonl:2: cannot tell the layout.*data\.format"):
        load_prompts(_write(tmp_path, [GSM8K, {"foo": "bar"}]))


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_line_the_format_cannot_read_names_file_and_line(tmp_path, suffix):
    bad_gsm8k = {"question": "q", "answer": "no hashes here"}
    with pytest.raises(DataError, match=r"d\.(jsonl:3|parquet:row 3): GSM8K 'answer' must end with '####"):
        load_prompts(_write(tmp_path, [GSM8K, GSM8K, bad_gsm8k], suffix), "gsm8k")
    with pytest.raises(DataError, match=r":2: MATH format needs an 'answer' or a 'solution' with \\boxed"):
        load_prompts(_write(tmp_path, [MATH, {"problem": "p", "solution": "no box"}]), "math")
    with pytest.raises(DataError, match=r":1: verl format needs 'reward_model'"):
        load_prompts(_write(tmp_path, [{"prompt": "x", "data_source": "openai/gsm8k"}]), "verl")
    with pytest.raises(DataError, match=r":1: prompt\[0\] must be an object with string 'role' and 'content'"):
        load_prompts(_write(tmp_path, [{"prompt": [{"role": "user"}], "task": "math"}]), "plain")
    with pytest.raises(DataError, match=r":1: the last message of 'prompt' must have role 'user'"):
        load_prompts(_write(tmp_path, [{"prompt": [{"role": "assistant", "content": "x"}], "task": "math"}]))
    with pytest.raises(DataError, match=r":1: needs a non-empty string field 'question'"):
        load_prompts(_write(tmp_path, [MATH]), "gsm8k")
    with pytest.raises(DataError, match=r":1: code format needs tests"):
        load_prompts(_write(tmp_path, [{"prompt": "write f"}]), "code")
    with pytest.raises(DataError, match=r"must be a \.jsonl or \.parquet file"):
        load_prompts(_write(tmp_path, [GSM8K], ".csv"))
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="broken.parquet: not a readable Parquet file"):
        load_prompts(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="holds no records"):
        load_prompts(empty)


def test_missing_task_is_an_error_unless_a_default_task_is_configured(tmp_path):
    path = _write(tmp_path, [{"prompt": "1+1=", "answer": "2", "task": "math"}, {"prompt": "2+2=", "answer": "4"}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: the record has no task type.*data\.default_task"):
        load_prompts(path, "plain")
    prompts = load_prompts(path, "plain", default_task="math")
    assert [p.fields["task"] for p in prompts] == ["math", "math"]  # a record's own task wins
    unknown_source = _write(tmp_path, [{**VERL, "data_source": "my/poems"}], name="v")
    with pytest.raises(DataError, match=r"v\.jsonl:1: cannot tell the task from data_source 'my/poems'"):
        load_prompts(unknown_source)
    assert load_prompts(unknown_source, default_task="math")[0].fields["task"] == "math"


def test_tasks_without_checkers_are_refused_unless_reward_fallback_task(tmp_path):
    prompts = load_prompts(_write(tmp_path, [PLAIN, {"prompt": "p", "task": "poetry"}]))
    with pytest.raises(DataError, match=r"d\.jsonl:2: task 'poetry' has no reward checkers.*reward\.fallback_task"):
        check_tasks(prompts, {"math", "json", "text"}, None)
    check_tasks(prompts, {"math", "json", "text"}, "text")  # configured fallback: accepted
    check_tasks(prompts, {"json", "poetry"}, None)


def test_plain_gold_and_none(tmp_path):
    prompts = load_prompts(_write(tmp_path, [{"prompt": "1+1=", "task": "math", "answer": 2},
                                             {"prompt": "hi", "task": "text"}]))
    assert prompts[0].fields["answer"] == "2" and prompts[0].gold == "2"
    assert prompts[1].gold is None
