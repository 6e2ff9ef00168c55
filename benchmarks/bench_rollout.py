"""Rollouts and refits at TP2: the Megatron engine against the colocated vLLM engine, side by side, CPU.

    python benchmarks/bench_rollout.py [--prompts 64 --group 8 --new 64 --dtype auto --bucket-mb 16]

Two gloo ranks hold the trainer at TP2; one vLLM engine with two tensor-parallel workers (vLLM TP2, the
engine at the training layout: worker w on rank w's core) serves them, refit from the TP2 shards in
buckets of ``--bucket-mb`` through shared memory.

* **Refit, three model sizes** (small 4 x 256, medium 8 x 512, large 16 x 1024; vocabulary 4096–8192):
  the refit's wall time (median of ``--refits`` refits, each after every weight moved) and
  ``refit_peak_extra_over_model``: the largest extra bytes any one rank held during a refit (its
  stream's meter: the bucket buffer, one gathered layer and its HF copies), over the model's bytes in the
  serving dtype.
* **Rollout, medium size (8 layers x 512 hidden)**: the same weights, prompts, G, max tokens and
  sampling (temperature 1, no stop token, so every response has the full length) through both engines
  at TP2, after a short warm-up call each; tokens/s = response tokens / wall time of one generate call
  over the whole batch (64 prompts x G=8 x 64 new tokens by default; median of ``--repeats``).
  ``refit_over_rollout_time`` = the medium size's refit over vLLM's rollout time.

Both engines run in ``--dtype`` (auto: bf16 where the CPU has native bf16, ``torch.ops.mkldnn.
_is_mkldnn_bf16_supported()``, else fp32). Ends with one JSON line carrying
``vllm_over_megatron_tokens_per_s``, ``refit_over_rollout_time`` and per size ``refit_s`` and
``refit_peak_extra_over_model``, plus the load average before and after. Targets:
``refit_peak_extra_over_model`` <= 0.25 on the largest size and falling as the model grows;
refit <= 10% of a rollout; vLLM TP2 >= 2x the Megatron engine's tokens/s.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {
    "tiny": dict(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                 vocab_size=256, make_vocab_size_divisible_by=128, max_seq_len=128),
    "small": dict(num_layers=4, hidden_size=256, ffn_hidden_size=704, num_attention_heads=4, num_query_groups=2,
                  vocab_size=4096, make_vocab_size_divisible_by=128, max_seq_len=128),
    "medium": dict(num_layers=8, hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8, num_query_groups=4,
                   vocab_size=4096, make_vocab_size_divisible_by=128, max_seq_len=128),
    "large": dict(num_layers=16, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=16, num_query_groups=8,
                  vocab_size=8192, make_vocab_size_divisible_by=128, max_seq_len=128),
}
ROLLOUT_SIZE = "medium"
"""The size whose rollouts are timed (8 layers x 512 hidden)."""


def _max_over_ranks(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _bench(rank, world, args):
    from megatron.core import parallel_state as ps

    from dpcc_megatron.config import ModelConfig, PrecisionConfig
    from dpcc_megatron.megatron.megatron_engine import MegatronEngine
    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.rollout.engine import Sampling
    from dpcc_megatron.testing.tiny import parallel_config
    from dpcc_megatron.train.engines import build_vllm_engine

    torch.set_num_threads(args.threads)
    par = parallel_config(world, 1)
    init_model_parallel(par, seed=0)
    precision = PrecisionConfig(params_dtype=args.dtype)
    groups = dict(tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group())
    results = {}
    for size in args.sizes:
        cfg = ModelConfig(**SIZES[size], init_method_std=0.05)
        torch.manual_seed(0)
        chunks = [build_gpt_model(cfg, par, precision)]
        vocab = cfg.vocab_size
        t0 = time.time()
        eng = build_vllm_engine(chunks, cfg, args.dtype, vocab_size=vocab, eos_id=None, host=rank == 0,
                                mp_group=ps.get_model_parallel_group(), workers=world, bucket_mb=args.bucket_mb,
                                **groups)
        start_s = time.time() - t0
        plan = eng.stream.plan(chunks)
        model_bytes = sum(nb for b in plan for *_, nb in b.entries)
        params = sum(int(torch.Size(shape).numel()) for b in plan for _, shape, *_ in b.entries)
        r = {"params": params, "model_mb": round(model_bytes / 2**20, 1), "buckets": len(plan),
             "vllm_start_s": round(start_s, 1)}
        try:
            refits, peaks, parts = [], [], []
            for i in range(args.refits + 1):  # the first refit loads the engine's first weights: not timed
                with torch.no_grad():  # a training step's worth of change: every weight moves
                    for p in chunks[0].parameters():
                        p.mul_(1.0 + 1e-3)
                eng.update_weights(chunks)
                if i:
                    refits.append(eng.last_refit_s)
                    peaks.append(_max_over_ranks(eng.last_refit_peak_bytes))
                    parts.append(eng.last_refit_parts)
            r["refit_s"] = round(statistics.median(refits), 4)
            r["refit_peak_extra_over_model"] = round(max(peaks) / model_bytes, 4)
            r["refit_parts_s"] = {k: round(statistics.median(p[k] for p in parts), 4) for k in parts[0]}
            if size == args.rollout_size:
                g = torch.Generator().manual_seed(1)
                prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
                           for _ in range(args.prompts)]
                batch = [p for p in prompts for _ in range(args.group)]
                sampling = Sampling(max_new_tokens=args.new, temperature=1.0, seed=3)
                warm = Sampling(max_new_tokens=2, temperature=1.0, seed=3)
                meg = MegatronEngine(chunks, vocab_size=vocab, pad_id=0, batch_size=len(batch), **groups)
                meg.generate(batch[: args.group], warm)
                eng.generate(batch[: args.group], warm)
                m_times, v_times, tokens = [], [], None
                for rep in range(args.repeats):  # interleaved
                    t0 = time.time()
                    m = meg.generate(batch, sampling)
                    m_times.append(time.time() - t0)
                    t0 = time.time()
                    v = eng.generate(batch, sampling)
                    v_times.append(time.time() - t0)
                    tokens = (sum(map(len, m.responses)), sum(map(len, v.responses)))
                mt, vt = statistics.median(m_times), statistics.median(v_times)
                r.update({"sequences": len(batch), "megatron_tokens": tokens[0], "vllm_tokens": tokens[1],
                          "megatron_s": [round(x, 2) for x in m_times], "vllm_s": [round(x, 2) for x in v_times],
                          "megatron_tokens_per_s": round(tokens[0] / mt, 1),
                          "vllm_tokens_per_s": round(tokens[1] / vt, 1),
                          "vllm_over_megatron_tokens_per_s": round((tokens[1] / vt) / (tokens[0] / mt), 3),
                          "refit_over_rollout_time": round(r["refit_s"] / vt, 4)})
                del meg
        finally:
            eng.close()
        results[size] = r
        del chunks, eng
    return results


def _dtype(requested: str) -> str:
    if requested != "auto":
        return requested
    return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1, help="timed rollouts per engine (interleaved)")
    ap.add_argument("--refits", type=int, default=3, help="timed refits per size")
    ap.add_argument("--bucket-mb", type=float, default=16.0, help="rollout.vllm.refit_bucket_mb")
    ap.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                    help="both engines' dtype (auto: bf16 where the CPU has native bf16)")
    ap.add_argument("--sizes", default="small,medium,large", help="comma-separated, of " + ", ".join(SIZES))
    ap.add_argument("--threads", type=int, default=1,
                    help="threads per trainer rank (vLLM's CPU workers are bound to one core each)")
    ap.add_argument("--tiny", action="store_true",
                    help="the tiny size only, 2 x 2 sequences of 4 tokens, one refit: checks the script runs")
    args = ap.parse_args()
    args.sizes = ("tiny",) if args.tiny else tuple(args.sizes.split(","))
    args.rollout_size = "tiny" if args.tiny else ROLLOUT_SIZE
    if args.tiny:
        args.prompts, args.group, args.new, args.repeats, args.refits, args.bucket_mb = 2, 2, 4, 1, 1, 0.125
    unknown = [s for s in args.sizes if s not in SIZES]
    if unknown or args.rollout_size not in args.sizes:
        ap.error(f"--sizes: unknown {unknown} or without {args.rollout_size!r} (the size whose rollouts are timed)")
    args.dtype = _dtype(args.dtype)
    from dpcc_megatron.testing import run_multirank

    load_before = os.getloadavg()
    res = run_multirank(_bench, 2, args=(args,), timeout=3600)[0]
    load_after = os.getloadavg()
    print(f"dtype {args.dtype}; trainer TP2, vLLM TP2; buckets of {args.bucket_mb} MiB; load average (1, 5, 15 min) "
          f"before {tuple(round(x, 1) for x in load_before)}, after {tuple(round(x, 1) for x in load_after)}")
    print(f"{'size':7} {'params':>11} {'model MiB':>10} {'buckets':>8} {'refit s':>8} {'refit peak/model':>17} "
          f"{'vllm start s':>13}")
    for size, r in res.items():
        print(f"{size:7} {r['params']:>11} {r['model_mb']:>10} {r['buckets']:>8} {r['refit_s']:>8} "
              f"{r['refit_peak_extra_over_model']:>17} {r['vllm_start_s']:>13}")
    ro = res[args.rollout_size]
    print(f"rollout at {args.rollout_size}: {ro['sequences']} sequences ({args.prompts} prompts x G={args.group}) x "
          f"{args.new} new tokens: Megatron {ro['megatron_tokens_per_s']} tok/s ({ro['megatron_s']} s), vLLM "
          f"{ro['vllm_tokens_per_s']} tok/s ({ro['vllm_s']} s): vLLM / Megatron {ro['vllm_over_megatron_tokens_per_s']}; "
          f"refit / vLLM rollout {ro['refit_over_rollout_time']}")
    print(json.dumps({"vllm_over_megatron_tokens_per_s": ro["vllm_over_megatron_tokens_per_s"],
                      "refit_over_rollout_time": ro["refit_over_rollout_time"],
                      "refit_peak_extra_over_model": {s: r["refit_peak_extra_over_model"] for s, r in res.items()},
                      "refit_s": {s: r["refit_s"] for s, r in res.items()}, "dtype": args.dtype, "tp": 2,
                      "bucket_mb": args.bucket_mb, "load_avg_before": [round(x, 2) for x in load_before],
                      "load_avg_after": [round(x, 2) for x in load_after], "prompts": args.prompts,
                      "group": args.group, "max_new_tokens": args.new, "sizes": res}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
