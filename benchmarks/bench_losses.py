"""Time every registered policy loss, forward + backward, on [64, 4096] tokens on the CPU.

    python benchmarks/bench_losses.py [--batch 64] [--tokens 4096] [--repeats 15] [--threads 1] [--tiny]

Losses run round-robin (so drift in machine load hits all of them alike); the
median is reported with its ratio to grpo. The last line is one JSON object
{"<name>_over_grpo": ratio, ...}. Target: dpcc <= 1.3x grpo. ``--tiny``: [4, 64] tokens, 2 repeats
(a check that the script runs, not a measurement).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dpcc_megatron.algo import get_policy_loss
from dpcc_megatron.config.algo import POLICY_LOSSES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier ratios)")
    ap.add_argument("--tiny", action="store_true", help="a few seconds: checks the script runs, measures nothing")
    args = ap.parse_args()
    if args.tiny:
        args.batch, args.tokens, args.repeats, args.warmup = 4, 64, 2, 1
    torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(0)
    B, T = args.batch, args.tokens
    old = -torch.rand(B, T, generator=g) * 3
    base_lp = old + torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, generator=g)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]

    def run(name: str) -> float:
        lp = base_lp.clone().requires_grad_(True)
        start = time.perf_counter()
        loss, _ = get_policy_loss(name)(lp, old, adv, mask)
        loss.backward()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in POLICY_LOSSES}
    for i in range(args.warmup + args.repeats):
        for name in POLICY_LOSSES:
            t = run(name)
            if i >= args.warmup:
                times[name].append(t)

    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"policy losses, forward+backward on [{B}, {T}] (fp32, CPU, {args.threads} thread(s), "
          f"median of {args.repeats})")
    print(f"{'loss':<10}{'ms':>10}{'x grpo':>10}")
    for name in POLICY_LOSSES:
        print(f"{name:<10}{med[name] * 1e3:>10.2f}{med[name] / med['grpo']:>10.2f}")
    print(json.dumps({f"{name}_over_grpo": round(med[name] / med["grpo"], 3) for name in POLICY_LOSSES}))


if __name__ == "__main__":
    main()
