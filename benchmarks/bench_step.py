"""One RL update step (forward + backward + optimizer) of a tiny GPT on CPU at TP=1:
`dpcc` against `grpo`, interleaved in one run so both see the same machine state, and the
calibrated preset's drift probe (one forward-only micro-batch after an iteration's steps).

    python benchmarks/bench_step.py [--steps 20] [--tiny]

Target: DPCC overhead <= 3% (dpcc_over_grpo <= 1.03). The probe runs once per iteration; its
cost is printed against one step (the worst case: one optimizer step per iteration).
Ends with one JSON line. ``--tiny``: 8 sequences of 32 tokens, one timed round (checks the script
runs; the figures are not a measurement).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _rank(rank, world, steps, B=32, L=64):
    from megatron.core import parallel_state as ps

    from dpcc_megatron.algo import DPCCController
    from dpcc_megatron.config import JobConfig, OptimizerConfig, TrainConfig
    from dpcc_megatron.megatron.optimizer import build_optimizer, build_scheduler, build_training_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.policy_step import RLBatch
    from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config
    from dpcc_megatron.train.update import policy_update, probe_drift

    V = 256
    cfg = JobConfig(model=tiny_model_config(hidden_size=128, ffn_hidden_size=512, max_seq_len=L),
                    parallel=parallel_config(1, 1), optim=OptimizerConfig(lr=1e-5),
                    train=TrainConfig(mini_batch_size=B, micro_batch_size=min(8, B)))
    init_model_parallel(cfg.parallel, seed=0)
    chunks = build_training_model(cfg.model, cfg.parallel, cfg.precision)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (B, L), generator=g)
    mask = torch.zeros(B, L - 1, dtype=torch.bool)
    mask[:, 16:] = True
    cfg.rollout.max_new_tokens = int(mask.sum(1).max())  # the generation budget covers these responses
    batch = RLBatch(tokens=tokens, mask=mask, old_logprobs=-5.5 + 0.1 * torch.randn(B, L - 1, generator=g),
                    advantages=torch.randn(B, generator=g))
    optimizer = build_optimizer(chunks, cfg.optim, cfg.parallel, cfg.precision)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps=10 * steps)
    times = {"grpo": [], "dpcc": [], "probe": []}
    probe_batch = batch.select(torch.arange(cfg.train.micro_batch_size))
    ctl = DPCCController(cfg.loss.dpcc, total_steps=10 * steps)
    groups = dict(dp_size=1, dp_group=ps.get_data_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
                  vocab_size=V)
    for i in range(steps + 2):
        for name in ("grpo", "dpcc") if i % 2 == 0 else ("dpcc", "grpo"):
            cfg.loss.name = name
            t0 = time.perf_counter()
            policy_update(chunks, optimizer, scheduler, ctl, batch, cfg, **groups)
            if i >= 2:  # the first rounds warm up allocators and caches
                times[name].append(time.perf_counter() - t0)
        cfg.loss.name = "dpcc"
        t0 = time.perf_counter()
        probe_drift(chunks, ctl, probe_batch, cfg, **groups)
        if i >= 2:
            times["probe"].append(time.perf_counter() - t0)
    return times


def main() -> None:
    from dpcc_megatron.testing import run_multirank

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="a few seconds: checks the script runs, measures nothing")
    args = parser.parse_args()
    shape = (8, 32) if args.tiny else (32, 64)
    if args.tiny:
        args.steps = 1
    (times,), = [run_multirank(_rank, 1, args=(args.steps, *shape), timeout=1800)]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{'loss':6s} {'median s/step':>14s} {'min':>8s}")
    for k in ("grpo", "dpcc"):
        print(f"{k:6s} {med[k]:14.4f} {min(times[k]):8.4f}")
    ratio = med["dpcc"] / med["grpo"]
    probe = med["probe"] / med["dpcc"]
    print(f"dpcc / grpo step time: {ratio:.3f} (target <= 1.03)")
    print(f"drift probe / dpcc step time: {probe:.3f} (once per iteration; with K steps per iteration "
          f"the overhead is this / K)")
    print(json.dumps({"dpcc_over_grpo": round(ratio, 4), "grpo_s_per_step": round(med["grpo"], 5),
                      "dpcc_s_per_step": round(med["dpcc"], 5), "probe_over_step": round(probe, 4),
                      "steps": args.steps}))


if __name__ == "__main__":
    main()
