"""End to end on real-looking data: a local HF tokenizer with a chat template and several EOS ids,
chat-format GSM8K-style lines (verl layout), the warm-start on their gold solutions, held-out
evaluation with greedy reward and pass@k, 2 iterations."""
import json
from pathlib import Path

import pytest

from dpcc_megatron.testing import run_multirank

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


def write_gsm8k_chat(path: Path, n: int, seed: int) -> Path:
    import random

    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            a, b = rng.randrange(10), rng.randrange(10)
            f.write(json.dumps({
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "system", "content": "Answer briefly."},
                           {"role": "user", "content": f"What is {a} plus {b}?"}],
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"index": i, "answer": f"{a}+{b}={a + b} #### {a + b}"},
            }) + "\n")
    return path


def _cfg(out: Path, tok: str, train: str, held_out: str, **overrides):
    from dpcc_megatron.config import load_config

    base = {
        "model.num_layers": 2, "model.hidden_size": 32, "model.ffn_hidden_size": 64, "model.num_attention_heads": 4,
        "model.num_query_groups": 2, "model.make_vocab_size_divisible_by": 32, "model.max_seq_len": 96,
        "data.tokenizer": tok, "data.prompts": train, "data.max_prompt_len": 64, "eval.data": held_out,
        "eval.interval": 1, "eval.samples": 2, "eval.max_prompts": 4,
        "rollout.group_size": 2, "rollout.prompts_per_iteration": 2, "rollout.max_new_tokens": 6,
        "train.mini_batch_size": 4, "train.micro_batch_size": 2, "train.iterations": 2, "train.warmup_sft_steps": 2,
        "optim.lr": 1e-3, "train.output_dir": str(out), "monitor.enabled": False,
        "parallel.use_distributed_optimizer": False,
    }
    base.update(overrides)
    return load_config(overrides=[f"{k}={v}" for k, v in base.items()])


def _run_rank(rank, world, out, tok, train, held_out, overrides):
    import dpcc_megatron.train.trainer as trainer

    captured = {}
    real_setup = trainer.setup_run

    def setup(cfg):
        ctx = real_setup(cfg)
        captured["ctx"] = ctx
        return ctx

    trainer.setup_run = setup
    real_sft = trainer.sft_batch
    batches = []

    def spy(ctx, step):
        b = real_sft(ctx, step)
        batches.append(b)
        return b

    trainer.sft_batch = spy
    summary = trainer.train(_cfg(Path(out), tok, train, held_out, **overrides))
    ctx = captured["ctx"]
    first = batches[0]
    row = first.tokens[0][: int(first.mask[0].nonzero().max()) + 2].tolist()
    from dpcc_megatron.megatron.generate import unwrap

    return {"summary": summary, "vocab": ctx.cfg.model.vocab_size, "padded": unwrap(ctx.chunks[-1]).vocab_size, "stop_ids": sorted(ctx.tokenizer.stop_ids),
            "sft_row": ctx.tokenizer.tok.decode(row), "prompts": len(ctx.dataset.prompts),
            "eval_prompts": len(ctx.eval_prompts)}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from dpcc_megatron.testing.hf_tokenizer import build_chat_tokenizer

    root = tmp_path_factory.mktemp("data")
    tok = build_chat_tokenizer(root / "tok")
    return str(tok), str(write_gsm8k_chat(root / "train.jsonl", 16, 0)), str(write_gsm8k_chat(root / "test.jsonl", 4, 1))


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_chat_gsm8k_train_with_eval(tmp_path, data, tp, pp):
    tok, train, held_out = data
    over = {"parallel.tensor_model_parallel_size": tp, "parallel.pipeline_model_parallel_size": pp}
    results = run_multirank(_run_rank, tp * pp, args=(str(tmp_path), tok, train, held_out, over), timeout=400)
    r = results[0]
    s = r["summary"]
    assert s["stop_reason"] == "completed" and s["iterations"] == 2
    assert r["vocab"] == 270  # model.vocab_size left out: the tokenizer's size,
    assert r["padded"] == (288 if tp == 1 else 320)  # padded to a multiple of 32 x TP as Megatron does
    assert r["stop_ids"] == [2, 4, 5]  # <|endoftext|> plus generation_config's <|im_end|>, <|eot|>
    assert (r["prompts"], r["eval_prompts"]) == (16, 4)
    # the warm-start trains on the data's own gold solution, in the chat template's assistant turn
    assert r["sft_row"].startswith("<|bos|><|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhat is ")
    assert "<|im_start|>assistant\n" in r["sft_row"] and " #### " in r["sft_row"]
    assert r["sft_row"].endswith("<|im_end|>")
    ev = s["eval"]
    assert ev["iteration"] == 2 and ev["prompts"] == 4
    for key in ("reward_greedy", "accuracy_greedy", "pass_at_1", "pass_at_2", "reward_sampled"):
        assert 0.0 <= ev[key] <= 1.0, key
    assert ev["pass_at_2"] >= ev["pass_at_1"]
    assert s["reward_after"] == ev["reward_greedy"] and s["reward_before"] is not None
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [e["iteration"] for e in evals] == [0, 1, 2]  # start, eval.interval=1, end
    assert all(e["kind"] == "eval" for e in evals)
    for other in results[1:]:  # every rank computed the same metrics
        assert other["summary"]["eval"] == ev
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [rec["iteration"] for rec in records] == [0, 1]
    # each record carries the evaluation of the weights it sampled with (start, then eval.interval 1)
    for rec, e in zip(records, evals):
        assert {k: rec[f"eval_{k}"] for k in ("reward_greedy", "accuracy_greedy", "reward_sampled", "pass_at_1")} \
            == {k: e[k] for k in ("reward_greedy", "accuracy_greedy", "reward_sampled", "pass_at_1")}
