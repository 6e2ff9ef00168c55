"""Code-sandbox benchmark: code runs per second with and without isolation, on the same samples.

    python benchmarks/bench_sandbox.py [--rounds 5] [--copies 4] [--workers 2] [--tiny]

Each run is one code-checker verdict as the reward layer makes it: a fresh sandbox process, the
solution loaded, the trusted tests calling it over the plain-data channel. The sample set (fixed,
below) mixes honest, wrong and crashing solutions of a few small tasks. Every mode available here
(``none``, ``namespaces``, ``bwrap``) scores the same batch, ``workers`` runs at a time, and the
modes alternate round by round so that load from other processes falls on all of them alike; the
figure per mode is the median over rounds. CPU ms per run (this process and its reaped
descendants, user + system; not for bwrap, whose processes in its PID namespace are not reaped
into that figure) does not depend on the load from others as wall time does. The verdicts of every mode must agree. Ends with one
JSON line; ``--tiny`` (one round of 6 samples, no warm-up: a few seconds) is what CI runs.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpcc_megatron.config.base import ConfigError  # noqa: E402
from dpcc_megatron.rewards.sandbox import SandboxLimits, build_sandbox  # noqa: E402

TASKS = {  # name: (honest solution, wrong solution, tests)
    "add": ("def add(a, b):\n    return a + b\n", "def add(a, b):\n    return a - b\n",
            "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(10, 5) == 15\n"),
    "fib": ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
            "def fib(n):\n    return n\n",
            "assert fib(0) == 0\nassert fib(10) == 55\nassert [fib(i) for i in range(6)] == [0, 1, 1, 2, 3, 5]\n"),
    "sort": ("def sort_list(xs):\n    return sorted(xs)\n", "def sort_list(xs):\n    return xs\n",
             "assert sort_list([3, 1, 2]) == [1, 2, 3]\nassert sort_list([]) == []\n"),
    "words": ("def count_words(s):\n    out = {}\n    for w in s.split():\n        out[w] = out.get(w, 0) + 1\n"
              "    return out\n", "def count_words(s):\n    return {w: 1 for w in s.split()}\n",
              "assert count_words('a b a') == {'a': 2, 'b': 1}\nassert count_words('') == {}\n"),
}


def samples() -> list[tuple[str, str]]:
    """Per task: the honest solution, a wrong one, and one that raises while loading."""
    out = []
    for right, wrong, tests in TASKS.values():
        out += [(right, tests), (wrong, tests), ("raise ValueError('no')\n", tests)]
    return out


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and of its reaped descendants."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_batch(sandbox, batch, workers: int) -> tuple[float, float, list[int]]:
    """Wall seconds, CPU seconds and the passed asserts of each sample."""
    start, cpu = time.perf_counter(), _cpu_s()
    with ThreadPoolExecutor(workers) as pool:
        verdicts = list(pool.map(lambda s: sandbox.run_tests(s[0], s[1]), batch))
    return time.perf_counter() - start, _cpu_s() - cpu, [v["passed"] for v in verdicts]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--copies", type=int, default=4, help="copies of the 12-sample set per round")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    batch = samples() * args.copies
    if args.tiny:
        args.rounds, batch = 1, samples()[:6]  # two tasks: honest, wrong, crashing
    modes = {}
    for mode in ("none", "namespaces", "bwrap"):
        try:
            modes[mode] = build_sandbox(SandboxLimits(timeout_s=30.0, memory_mb=512, isolation=mode))
        except ConfigError as e:
            print(f"{mode}: not available here ({e})")
    for sandbox in modes.values() if not args.tiny else ():  # warm-up: first-run costs out of the timing
        run_batch(sandbox, batch[:4], args.workers)
    times = {m: [] for m in modes}
    cpu = {m: [] for m in modes}
    passed = {}
    for _ in range(args.rounds):
        for mode, sandbox in modes.items():
            dt, dcpu, got = run_batch(sandbox, batch, args.workers)
            times[mode].append(dt)
            cpu[mode].append(dcpu)
            passed.setdefault(mode, got)
            if got != passed[mode]:
                raise SystemExit(f"{mode}: verdicts changed between rounds")
    reference = passed["none"]
    agree = {m: p == reference for m, p in passed.items()}
    rate = {m: len(batch) / statistics.median(t) for m, t in times.items()}
    # bubblewrap's processes inside its PID namespace are not reaped into our children's usage: no CPU figure
    cpu_ms = {m: 1e3 * statistics.median(c) / len(batch) for m, c in cpu.items() if m != "bwrap"}
    print(f"{len(batch)} runs per round, {args.rounds} rounds, {args.workers} workers; median round")
    print(f"{'mode':<12}{'runs/s':>10}{'x none':>10}{'CPU ms/run':>12}{'x none':>10}{'verdicts':>10}")
    for m in modes:
        c = (f"{cpu_ms[m]:>12.1f}{cpu_ms[m] / cpu_ms['none']:>10.2f}" if m in cpu_ms else f"{'-':>12}{'-':>10}")
        print(f"{m:<12}{rate[m]:>10.1f}{rate[m] / rate['none']:>10.2f}{c}{'same' if agree[m] else 'DIFFER':>10}")
    result = {"bench": "sandbox", "runs_per_round": len(batch), "rounds": args.rounds, "workers": args.workers,
              "runs_per_s": {m: round(r, 2) for m, r in rate.items()},
              "ratio_to_none": {m: round(r / rate["none"], 3) for m, r in rate.items()},
              "cpu_ms_per_run": {m: round(c, 1) for m, c in cpu_ms.items()},
              "verdicts_agree": all(agree.values()), "passed_total": sum(reference), "tiny": args.tiny}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
