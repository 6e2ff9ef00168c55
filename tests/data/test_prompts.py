import pytest

from dpcc_megatron.data.formats import DataError, load_prompts
from dpcc_megatron.data.prompts import PromptDataset, synthetic_prompts
from dpcc_megatron.data.tokenizer import CharTokenizer


def test_malformed_prompts_file_names_file_and_line(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "1+1=", "answer": "2", "task": "math"}\n{"prompt": 3, "task": "math"}\n')
    with pytest.raises(DataError, match=r"p\.jsonl:2"):
        load_prompts(p)
    p.write_text('{"prompt": "1+1=", "task": "math"}\nnot json\n')
    with pytest.raises(DataError, match=r"p\.jsonl:2: not valid JSON"):
        load_prompts(p)
    with pytest.raises(DataError, match="missing.jsonl"):
        load_prompts(tmp_path / "missing.jsonl")


def test_synthetic_tasks_carry_correct_answers():
    for p in synthetic_prompts("addition", 2, 20, seed=1):
        a, b = p.text[:-1].split("+")
        assert p.fields["answer"] == str(int(a) + int(b))
    for p in synthetic_prompts("sorting", 4, 20, seed=1):
        xs = p.text[len("sort:"):-1].split(",")
        assert p.fields["answer"] == ",".join(sorted(xs))


def test_dataset_position_resumes_exactly():
    prompts = synthetic_prompts("addition", 2, 10, seed=0)
    a = PromptDataset(prompts, seed=3)
    a.next_batch(7)
    state = a.state_dict()
    rest = [p.text for p in a.next_batch(9)]
    b = PromptDataset(prompts, seed=3)
    b.load_state_dict(state)
    assert [p.text for p in b.next_batch(9)] == rest


def test_char_tokenizer_round_trip_and_unknown_chars():
    tok = CharTokenizer()
    ids = tok.encode("12+34=46")
    assert tok.decode(ids + [tok.eos_id, 5]) == "12+34=46"
    with pytest.raises(ValueError, match="not in the built-in"):
        tok.encode("€")
