"""The supervised warm-start uses the configured data's gold responses, or refuses; never another task."""
import json
from types import SimpleNamespace

import pytest

from dpcc_megatron.config import load_config
from dpcc_megatron.data.formats import load_prompts
from dpcc_megatron.data.prompts import PromptDataset
from dpcc_megatron.data.tokenizer import CharTokenizer
from dpcc_megatron.train.sft import check_gold, sft_batch


def _ctx(cfg, prompts):
    return SimpleNamespace(cfg=cfg, dp=1, dp_rank=0, tokenizer=CharTokenizer(), counters={"prompts_truncated": 0,
                           "sft_truncated": 0}, dataset=PromptDataset(prompts, seed=0))


def _decode_rows(batch, tok):
    rows = []
    for toks, mask in zip(batch.tokens, batch.mask):
        idx = mask.nonzero().flatten()
        prompt = toks[: int(idx[0]) + 1].tolist()
        response = toks[int(idx[0]) + 1: int(idx[-1]) + 2].tolist()
        rows.append(("".join(tok.itos[i] for i in prompt), response))
    return rows


def test_warm_start_trains_on_the_files_gold_answers(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i}*2=?", "answer": f"{i}*2={2 * i} #### {2 * i}"}) + "\n"
                            for i in range(5)))
    cfg = load_config(overrides=[f"data.prompts={path}", "train.warmup_sft_steps=2", "train.mini_batch_size=8",
                                 "train.micro_batch_size=8", "data.chat_template=false"])
    prompts = load_prompts(path)
    check_gold(cfg, prompts)
    tok = CharTokenizer()
    rows = _decode_rows(sft_batch(_ctx(cfg, prompts), 0), tok)
    assert len(rows) == 8
    for prompt, response in rows:
        i = int(prompt.split("*")[0])
        assert prompt == f"{i}*2=?"  # a prompt of the file, not the synthetic addition task
        assert response == tok.encode(f"{i}*2={2 * i} #### {2 * i}") + [tok.eos_id]


def test_warm_start_without_gold_is_refused_with_the_record_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a", "task": "text"}) + "\n")
    cfg = load_config(overrides=[f"data.prompts={path}", "train.warmup_sft_steps=3"])
    with pytest.raises(ValueError, match=r"train.warmup_sft_steps=3 needs gold responses.*p\.jsonl:1"):
        check_gold(cfg, load_prompts(path))
    check_gold(load_config(overrides=["train.warmup_sft_steps=3"]), [])  # synthetic task: its answers


def test_long_gold_is_truncated_and_counted(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "x" * 80 + " #### 1"}) + "\n")
    cfg = load_config(overrides=[f"data.prompts={path}", "model.max_seq_len=32", "train.mini_batch_size=8",
                                 "train.micro_batch_size=8", "data.chat_template=false"])
    ctx = _ctx(cfg, load_prompts(path))
    batch = sft_batch(ctx, 0)
    assert batch.tokens.shape[1] == 32 and ctx.counters["sft_truncated"] == 8


def test_run_setup_refuses_bad_data_before_the_model_is_built(tmp_path):
    """setup_run's data step: the old plain layout without `task`, unknown tasks, and the warm-start."""
    from dpcc_megatron.data.formats import DataError
    from dpcc_megatron.rewards import DualTrackReward
    from dpcc_megatron.train.setup import load_data

    def load(lines, *over):
        path = tmp_path / "p.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))
        cfg = load_config(overrides=[f"data.prompts={path}", *over])
        return load_data(cfg, set(DualTrackReward(cfg.reward).base_layer.tasks))

    with pytest.raises(DataError, match=r"p\.jsonl:1: the record has no task type"):
        load([{"prompt": "1+1=", "answer": "2"}])
    prompts, held_out = load([{"prompt": "1+1=", "answer": "2"}], "data.default_task=math")
    assert prompts[0].fields["task"] == "math" and held_out == []  # no eval.data: no evaluation
    with pytest.raises(DataError, match=r"p\.jsonl:2: task 'poem' has no reward checkers"):
        load([{"prompt": "a", "task": "text"}, {"prompt": "b", "task": "poem"}])
    assert load([{"prompt": "b", "task": "poem"}], "reward.fallback_task=text")[0][0].fields["task"] == "poem"
    with pytest.raises(ValueError, match=r"warmup_sft_steps=2 needs gold responses.*p\.jsonl:1"):
        load([{"prompt": "a", "task": "text"}], "train.warmup_sft_steps=2")
