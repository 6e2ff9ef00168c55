"""Our vocab-parallel token stats vs the naive full-softmax path: peak extra memory and time.

    python benchmarks/bench_logprobs.py [--tokens 4096] [--vocab 32000] [--rounds 2]
                                        [--repeats 3] [--threads 1] [--chunk-size 1024] [--tiny]

Both variants compute per-token log-prob of the target and entropy from bf16 logits
[tokens, 1, vocab] (TP=1, CPU) and back-propagate a random per-token weighting of both:

* ours:  ``vocab_parallel_token_stats(logits, targets)`` (chunked fp32, custom backward);
* naive: ``logits.float()`` -> ``log_softmax`` -> ``gather``, entropy ``-(exp(logp) * logp).sum``,
  autograd backward.

Memory method: torch's CPU allocator keeps no statistics and ``tracemalloc`` cannot see it,
so each variant runs in a fresh subprocess and we read the kernel's resident-set high-water
mark. After a warm-up step, the child records its resident set (inputs included), resets the
high-water mark by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0), runs one
forward + backward and reads ``VmHWM`` from ``/proc/self/status``: peak extra memory =
VmHWM - baseline, i.e. the most memory touched at once by the step beyond what existed
before, the bf16 logits gradient included for both variants. The children run with
``MALLOC_MMAP_THRESHOLD_=1MiB``, so every buffer of 1 MiB or more is mmapped and returned to
the kernel when freed: nothing the warm-up freed sits in the heap to be reused unseen.
Pages are counted only once written, which is the memory really used.

Timing: median of ``--repeats`` forward + backward steps per child after the warm-up; the
children alternate (ours, naive, ours, naive, ...) for ``--rounds`` rounds so that load from
other processes on the machine hits both alike, and the best round per variant is kept.

Prints both variants side by side, a check that they agree, and one JSON line with
``peak_mem_ratio`` and ``time_ratio`` (ours / naive). Targets: <= 0.5 and <= 1.0.
``--tiny``: 256 tokens x vocabulary 4096, one round of one repeat (checks the script runs; the
figures are not a measurement).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("ours", "naive")


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _child(args) -> None:
    import torch

    from dpcc_megatron.megatron.vocab_parallel import vocab_parallel_token_stats

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    n, vocab = args.tokens, args.vocab
    logits = (torch.randn(n, 1, vocab, generator=g) * 2).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (n, 1), generator=g)
    w_lp, w_ent = torch.randn(n, 1, generator=g), torch.randn(n, 1, generator=g)

    def step():
        logits.grad = None
        if args.child == "ours":
            st = vocab_parallel_token_stats(logits, targets, chunk_size=args.chunk_size)
            lp, ent = st.logprobs, st.entropy
        else:
            logp = torch.log_softmax(logits.float(), -1)
            lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            ent = -(logp.exp() * logp).sum(-1)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        return lp.detach(), ent.detach()

    step()  # warm-up: lazy initialisation is not part of the step's memory
    logits.grad = None  # the step's own gradient counts as extra memory
    base = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    lp, ent = step()
    peak_extra = (_rss_kib("VmHWM") - base) * 1024
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    grad = logits.grad.float()
    print(json.dumps({"peak_extra_bytes": peak_extra, "time_s": statistics.median(times),
                      "logprobs": lp[:256, 0].tolist(), "entropy": ent[:256, 0].tolist(),
                      "grad": grad[:4, 0, :64].flatten().tolist(), "grad_l1": grad.abs().sum().item()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier ratios)")
    ap.add_argument("--chunk-size", type=int, default=1024, help="our op's chunk_size (its default: 1024)")
    ap.add_argument("--tiny", action="store_true", help="a few seconds: checks the script runs, measures nothing")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args)
    if args.tiny:
        args.tokens, args.vocab, args.rounds, args.repeats = 256, 4096, 1, 1

    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    # Every allocation >= 1 MiB is mmapped and unmapped on free: nothing a step frees stays in
    # the heap, where a warm-up's buffers would hide inside the baseline.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    for _ in range(args.rounds):
        for v in VARIANTS:
            cmd = [sys.executable, __file__, "--child", v, "--tokens", str(args.tokens), "--vocab",
                   str(args.vocab), "--repeats", str(args.repeats), "--threads", str(args.threads),
                   "--chunk-size", str(args.chunk_size)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            runs[v].append(json.loads(out.strip().splitlines()[-1]))
    best = {v: min(r["time_s"] for r in runs[v]) for v in VARIANTS}
    peak = {v: max(r["peak_extra_bytes"] for r in runs[v]) for v in VARIANTS}
    ours, naive = runs["ours"][0], runs["naive"][0]

    print(f"log-prob + entropy, forward+backward, bf16 logits [{args.tokens}, {args.vocab}], TP=1, "
          f"CPU, {args.threads} thread(s), chunk_size {args.chunk_size}; best of {args.rounds} "
          f"rounds x median of {args.repeats}")
    print(f"{'variant':<8}{'peak extra MiB':>16}{'time ms':>10}")
    for v in VARIANTS:
        print(f"{v:<8}{peak[v] / 2**20:>16.1f}{best[v] * 1e3:>10.1f}")
    mem_ratio, time_ratio = peak["ours"] / peak["naive"], best["ours"] / best["naive"]
    print(f"{'ratio':<8}{mem_ratio:>16.3f}{time_ratio:>10.3f}   (ours / naive; targets <= 0.5, <= 1.0)")
    diff = {k: max(abs(x - y) for x, y in zip(ours[k], naive[k])) for k in ("logprobs", "entropy", "grad")}
    print(f"agreement (first tokens): max |d logprob| {diff['logprobs']:.1e}, max |d entropy| "
          f"{diff['entropy']:.1e}, max |d grad| {diff['grad']:.1e}; grad L1 {ours['grad_l1']:.3f} "
          f"vs {naive['grad_l1']:.3f}")
    print(json.dumps({"peak_mem_ratio": round(mem_ratio, 3), "time_ratio": round(time_ratio, 3)}))


if __name__ == "__main__":
    main()
