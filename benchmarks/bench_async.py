"""Asynchronous rollouts: iteration time with rollout.max_staleness 0 (synchronous) and 1, same job.

    python benchmarks/bench_async.py [--engine vllm --iterations 6 --pin]
    python benchmarks/bench_async.py --tiny          # the Megatron engine, a tiny job, seconds

The same RL job (model, prompts, seeds, G, lengths, optimizer) runs with k = 0 and k = 1 in one gloo
rank, ``--repeats`` times each, interleaved with the order alternating (the machine's load moves
under other work). Reported per k, as the median over its runs: the mean wall time of the iterations after the first
(the first includes warm-up, and at k = 1 it samples synchronously: nothing was requested before it),
the rollout engine's refit time (the mean ``time_refit_s`` over the iterations, 0 in those that
refitted nothing), the final staleness and behaviour KL; and
``async_over_sync_time`` = mean iteration time at k = 1 / at k = 0 (below 1: the overlap pays).

What to expect. With the vLLM engine (its own process) the k = 1 generation of iteration i + 1
runs while iteration i trains, so the iteration takes about max(generate, train) instead of their
sum. On this 2-core CPU both share the cores unless ``--pin`` gives the vLLM engine core 1 and the
trainer core 0 (then each phase runs on one core, and the overlap is visible but both phases are
slower than with two cores each). With the Megatron engine (decoding with the training weights)
k = 1 samples from a weight snapshot at the start of the next iteration: no overlap, and the ratio is
about 1 plus the snapshot copies. On GPUs with a separate engine (NeMo-RL's one-step off-policy
GRPO, verl's fully async trainer) the iteration time approaches max(generation, training) + refit;
when the two phases are balanced that is close to half, NeMo-RL reports 111 s -> 64 s per step.

Ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

JOB = {
    "model.num_layers": 2, "model.hidden_size": 128, "model.ffn_hidden_size": 256, "model.num_attention_heads": 4,
    "model.num_query_groups": 2, "model.vocab_size": 128, "model.make_vocab_size_divisible_by": 32,
    "model.max_seq_len": 64, "data.synthetic_digits": 1, "rollout.group_size": 8, "rollout.prompts_per_iteration": 8,
    "rollout.max_new_tokens": 16, "train.mini_batch_size": 32, "train.micro_batch_size": 8,
    "train.warmup_sft_steps": 0, "optim.lr": 1e-4, "monitor.enabled": False, "eval.max_prompts": 4,
    "parallel.use_distributed_optimizer": False, "parallel.tensor_model_parallel_size": 1,
}
TINY = {"model.hidden_size": 32, "model.ffn_hidden_size": 64, "model.max_seq_len": 32, "rollout.group_size": 4,
        "rollout.prompts_per_iteration": 2, "rollout.max_new_tokens": 3, "train.mini_batch_size": 8,
        "train.micro_batch_size": 4, "eval.max_prompts": 2}


def _one(k: int, args: dict, out: str) -> dict:
    from megatron.core import parallel_state as ps

    from dpcc_megatron.config import load_config
    from dpcc_megatron.train.trainer import train

    over = {**JOB, **(TINY if args["tiny"] else {}), "rollout.engine": args["engine"],
            "train.iterations": args["iterations"], "rollout.max_staleness": k, "train.output_dir": out}
    cfg = load_config(overrides=[f"{key}={v}" for key, v in over.items()])
    t0 = time.time()
    train(cfg)
    wall = time.time() - t0
    ps.destroy_model_parallel()
    records = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    return {"iteration_s": statistics.mean(r["seconds"] for r in records[1:]),
            "refit_s": statistics.mean(r["time_refit_s"] for r in records), "run_s": wall,
            "staleness_last": records[-1].get("staleness_max", 0.0),
            "kl_behaviour_last": records[-1].get("kl_behaviour"), "reward_last": records[-1]["reward_mean"]}


def _rank(rank, world, args, out_dir):
    if args["pin"]:  # the trainer on core 0; the vLLM engine core binds to core 1 (VLLM_CPU_OMP_THREADS_BIND)
        os.sched_setaffinity(0, {0})
    runs = {0: [], 1: []}
    for r in range(args["repeats"]):  # k = 0 and k = 1 side by side, the order alternating
        for k in ((0, 1) if r % 2 == 0 else (1, 0)):
            runs[k].append(_one(k, args, f"{out_dir}/r{r}k{k}"))
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=["megatron", "vllm"], default="megatron")
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--pin", action="store_true", help="trainer on core 0, the vLLM engine on core 1")
    p.add_argument("--repeats", type=int, default=2, help="runs per k, interleaved (the median is reported)")
    p.add_argument("--tiny", action="store_true", help="tiny job, 2 iterations, Megatron engine, 1 repeat (CI)")
    a = p.parse_args()
    if a.tiny:
        a.engine, a.iterations, a.repeats = "megatron", 2, 1
    if a.iterations < 2:
        p.error("--iterations must be >= 2 (the first iteration is warm-up)")
    env = {"OMP_NUM_THREADS": "1"} if a.pin else {}
    if a.pin:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "1"
        os.environ.update(env)
    from dpcc_megatron.testing import run_multirank

    args = {"engine": a.engine, "iterations": a.iterations, "pin": a.pin, "tiny": a.tiny, "repeats": a.repeats}
    with tempfile.TemporaryDirectory(prefix="bench-async-") as out:
        (runs,) = run_multirank(_rank, 1, args=(args, out), timeout=3600, env=env)

    def median_run(rs):
        t = statistics.median(r["iteration_s"] for r in rs)
        return {**min(rs, key=lambda r: abs(r["iteration_s"] - t)), "iteration_s": t,
                "all": [round(r["iteration_s"], 3) for r in rs]}

    sync, asyn = median_run(runs[0]), median_run(runs[1])
    ratio = asyn["iteration_s"] / sync["iteration_s"]
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    print(f"engine {a.engine}, {a.iterations} iterations x {a.repeats} runs per k (interleaved), pin {a.pin}, "
          f"1 gloo rank, CPU ({os.cpu_count()} cores, load average {load:.1f})")
    print(f"{'':>6} {'iter s':>9} {'refit s':>9} {'staleness':>10} {'kl_behaviour':>13}  runs (iter s)")
    for k, r in ((0, sync), (1, asyn)):
        kl = r["kl_behaviour_last"]
        print(f"{'k=' + str(k):>6} {r['iteration_s']:9.3f} {r['refit_s']:9.3f} {r['staleness_last']:10.1f} "
              f"{'-' if kl is None else f'{kl:.2e}':>13}  {r['all']}")
    print(f"async_over_sync_time {ratio:.3f}")
    print(json.dumps({"bench": "async", "engine": a.engine, "iterations": a.iterations, "repeats": a.repeats,
                      "pin": a.pin, "tiny": a.tiny, "load_average": round(load, 1),
                      "sync_iteration_s": round(sync["iteration_s"], 4),
                      "async_iteration_s": round(asyn["iteration_s"], 4),
                      "async_over_sync_time": round(ratio, 4),
                      "async_staleness": asyn["staleness_last"], "async_kl_behaviour": asyn["kl_behaviour_last"]}))


if __name__ == "__main__":
    main()
