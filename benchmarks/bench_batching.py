"""One RL update step with pad-to-max micro-batches against token-budget micro-batches
(`train.max_tokens_per_micro_batch`), interleaved in one run on the same weights, CPU, TP=1.

    python benchmarks/bench_batching.py [--steps 8] [--tiny]

The batch: 64 sequences, a 32-token prompt each, and response lengths drawn from a
log-normal distribution (median 48 tokens, sigma 0.9), capped at 480: a long tail like that
of reasoning traces, where a few responses run to the cap and most are short. The padded
path pads every micro-batch of 8 rows to the batch's longest sequence; the budget path sorts
rows by length and packs them under a budget of 8 x the longest sequence (the same peak
micro-batch size), each micro-batch padded only to its own longest row.

Padding waste = padded positions / all positions fed to the model. Target:
budget_over_padded_time <= 0.67 (>= 1.5x faster). Ends with one JSON line. ``--tiny``: 16
sequences, responses capped at 48 tokens, one timed step (checks the script runs; the figures are
not a measurement).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

B, PROMPT, CAP, V = 64, 32, 480, 256
TINY_B, TINY_CAP = 16, 48


def _batch(rows, cap):
    from dpcc_megatron.megatron.policy_step import RLBatch

    g = torch.Generator().manual_seed(0)
    lengths = torch.exp(torch.log(torch.tensor(48.0)) + 0.9 * torch.randn(rows, generator=g)).round().clamp(4, cap).long()
    L = PROMPT + int(lengths.max())
    tokens = torch.randint(0, V, (rows, L), generator=g)
    mask = torch.zeros(rows, L - 1, dtype=torch.bool)
    for i, n in enumerate(lengths.tolist()):
        mask[i, PROMPT - 1:PROMPT - 1 + n] = True
    batch = RLBatch(tokens=tokens, mask=mask, old_logprobs=-5.5 + 0.1 * torch.randn(rows, L - 1, generator=g),
                    advantages=torch.randn(rows, generator=g))
    return batch, lengths


def _waste(parts) -> float:
    fed = sum(mb.tokens.shape[0] * mb.tokens.shape[1] for mb in parts)
    from dpcc_megatron.megatron.batching import used_lengths

    used = sum(int(used_lengths(mb.mask).sum()) for mb in parts)
    return 1.0 - used / fed


def _rank(rank, world, steps, rows=B, cap=CAP):
    from megatron.core import parallel_state as ps

    from dpcc_megatron.algo import DPCCController
    from dpcc_megatron.config import JobConfig, OptimizerConfig, TrainConfig
    from dpcc_megatron.megatron.optimizer import build_optimizer, build_scheduler, build_training_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.policy_step import micro_batches
    from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config
    from dpcc_megatron.train.update import policy_update

    batch, lengths = _batch(rows, cap)
    L = batch.tokens.shape[1]
    budget = 8 * L
    cfg = JobConfig(model=tiny_model_config(hidden_size=128, ffn_hidden_size=512, max_seq_len=L),
                    parallel=parallel_config(1, 1), optim=OptimizerConfig(lr=1e-6),
                    train=TrainConfig(mini_batch_size=rows, micro_batch_size=8))
    cfg.rollout.max_new_tokens = cap
    init_model_parallel(cfg.parallel, seed=0)
    chunks = build_training_model(cfg.model, cfg.parallel, cfg.precision)
    optimizer = build_optimizer(chunks, cfg.optim, cfg.parallel, cfg.precision)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps=10 * steps)
    ctl = DPCCController(cfg.loss.dpcc, total_steps=10 * steps)
    groups = dict(dp_size=1, dp_group=ps.get_data_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
                  vocab_size=V)
    modes = {"padded": 0, "budget": budget}
    waste = {k: _waste(micro_batches(batch, 8, b)[0]) for k, b in modes.items()}
    n_micro = {k: len(micro_batches(batch, 8, b)[0]) for k, b in modes.items()}
    times = {k: [] for k in modes}
    for i in range(steps + 1):
        for name in ("padded", "budget") if i % 2 == 0 else ("budget", "padded"):
            cfg.train.max_tokens_per_micro_batch = modes[name]
            t0 = time.perf_counter()
            policy_update(chunks, optimizer, scheduler, ctl, batch, cfg, **groups)
            if i >= 1:  # the first round warms up allocators
                times[name].append(time.perf_counter() - t0)
    return {"times": times, "waste": waste, "n_micro": n_micro, "lengths": lengths.tolist(), "L": L,
            "budget": budget}


def main() -> None:
    from dpcc_megatron.testing import run_multirank

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tiny", action="store_true", help="a few seconds: checks the script runs, measures nothing")
    args = parser.parse_args()
    rows, cap = (TINY_B, TINY_CAP) if args.tiny else (B, CAP)
    if args.tiny:
        args.steps = 1
    (res,), = [run_multirank(_rank, 1, args=(args.steps, rows, cap), timeout=3600)]
    lengths = sorted(res["lengths"])
    print(f"batch: {rows} sequences, prompt {PROMPT}, response lengths median {lengths[rows // 2]}, "
          f"p90 {lengths[int(0.9 * rows)]}, max {lengths[-1]} (log-normal, sigma 0.9, cap {cap}); "
          f"padded length {res['L']}, budget {res['budget']} tokens")
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    print(f"{'mode':8s} {'micro-batches':>14s} {'padding waste':>14s} {'median s/step':>14s} {'min':>8s}")
    for k in ("padded", "budget"):
        print(f"{k:8s} {res['n_micro'][k]:14d} {res['waste'][k]:14.3f} {med[k]:14.3f} {min(res['times'][k]):8.3f}")
    ratio = med["budget"] / med["padded"]
    print(f"budget / padded step time: {ratio:.3f} (target <= 0.67)")
    print(json.dumps({"budget_over_padded_time": round(ratio, 4), "padding_waste_padded": round(res["waste"]["padded"], 4),
                      "padding_waste_budget": round(res["waste"]["budget"], 4),
                      "padded_s_per_step": round(med["padded"], 4), "budget_s_per_step": round(med["budget"], 4),
                      "steps": args.steps}))


if __name__ == "__main__":
    main()
