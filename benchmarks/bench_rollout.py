"""Rollout throughput: the Megatron engine against the colocated vLLM engine, side by side, CPU.

    python benchmarks/bench_rollout.py [--prompts 8 --group 8 --new 32]

For each model size (tiny: 2 layers x hidden 128; large: 8 layers x hidden 512), the same weights,
prompts, G, max tokens and sampling (temperature 1, no stop token, so every response has the
full length) go through both engines, after one warm-up call each. Reported: tokens/s of each
(response tokens / wall time of one generate call, median of --repeats), the vLLM refit time
(gather from the Megatron shards + copy into shared memory + in-place reload + prefix-cache reset)
and its ratio to vLLM's rollout time, and ``refit_peak_extra_over_model`` (the largest extra bytes the rank
held during a streamed refit, over the model's bytes). One gloo rank (world 1); vLLM's engine core runs in
its own spawned process.
Ends with one JSON line: ``vllm_over_megatron_tokens_per_s`` and ``refit_over_rollout_time``
at the large size. Targets: >= 3x, <= 0.10.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {
    "tiny": dict(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                 vocab_size=256, make_vocab_size_divisible_by=128, max_seq_len=128),
    "large": dict(num_layers=8, hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8, num_query_groups=4,
                  vocab_size=4096, make_vocab_size_divisible_by=128, max_seq_len=128),
}


def _bench(rank, world, args, out_dir):
    from megatron.core import parallel_state as ps

    from dpcc_megatron.config import ModelConfig
    from dpcc_megatron.megatron.megatron_engine import MegatronEngine
    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.rollout.engine import Sampling
    from dpcc_megatron.testing.tiny import parallel_config
    from dpcc_megatron.train.engines import build_vllm_engine

    torch.set_num_threads(args.threads)
    par = parallel_config(1, 1)
    init_model_parallel(par, seed=0)
    results = {}
    for size, spec in ((s, SIZES[s]) for s in args.sizes):
        cfg = ModelConfig(**spec, init_method_std=0.05)
        torch.manual_seed(0)
        chunks = [build_gpt_model(cfg, par)]
        vocab = cfg.vocab_size
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
        batch = [p for p in prompts for _ in range(args.group)]
        sampling = Sampling(max_new_tokens=args.new, temperature=1.0, seed=3)
        groups = dict(tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group())
        meg = MegatronEngine(chunks, vocab_size=vocab, pad_id=0, batch_size=len(batch), **groups)
        t0 = time.time()
        eng = build_vllm_engine(chunks, cfg, "fp32", vocab_size=vocab, eos_id=None, host=True,
                                mp_group=ps.get_model_parallel_group(), **groups)
        start_s = time.time() - t0
        try:
            meg.generate(batch, sampling)  # warm-up
            eng.update_weights(chunks)
            eng.generate(batch, sampling)  # warm-up
            m_times, v_times, refits, parts, tokens = [], [], [], [], None
            for rep in range(args.repeats):  # interleaved
                t0 = time.time()
                m = meg.generate(batch, sampling)
                m_times.append(time.time() - t0)
                with torch.no_grad():  # a training step's worth of change, so the refit moves real weights
                    for p in chunks[0].parameters():
                        p.mul_(1.0 + 1e-4)
                eng.update_weights(chunks)
                refits.append(eng.last_refit_s)
                parts.append(eng.last_refit_parts)
                t0 = time.time()
                v = eng.generate(batch, sampling)
                v_times.append(time.time() - t0)
                tokens = (sum(map(len, m.responses)), sum(map(len, v.responses)))
        finally:
            eng.close()
        mt, vt, rt = statistics.median(m_times), statistics.median(v_times), statistics.median(refits)
        params = sum(p.numel() for p in chunks[0].parameters())
        results[size] = {"params": params, "sequences": len(batch), "megatron_tokens": tokens[0],
                         "vllm_tokens": tokens[1], "megatron_s": round(mt, 3), "vllm_s": round(vt, 3),
                         "megatron_tokens_per_s": round(tokens[0] / mt, 1), "vllm_tokens_per_s": round(tokens[1] / vt, 1),
                         "vllm_over_megatron_tokens_per_s": round((tokens[1] / vt) / (tokens[0] / mt), 3),
                         "refit_s": round(rt, 4), "refit_over_rollout_time": round(rt / vt, 4),
                         "refit_peak_extra_over_model": round(eng.last_refit_peak_bytes / (4 * params), 4),
                         "vllm_start_s": round(start_s, 1),
                         "refit_parts_s": {k: round(statistics.median(p[k] for p in parts), 4) for k in parts[0]}}
        del chunks, meg, eng
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1,
                    help="Megatron engine threads (vLLM's CPU backend binds its worker to one core)")
    ap.add_argument("--tiny", action="store_true",
                    help="the tiny size only, 2 x 2 sequences of 4 tokens, one repeat: checks the script runs")
    args = ap.parse_args()
    args.sizes = ("tiny",) if args.tiny else tuple(SIZES)
    if args.tiny:
        args.prompts, args.group, args.new, args.repeats = 2, 2, 4, 1
    from dpcc_megatron.testing import run_multirank

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as d:
        res = run_multirank(_bench, 1, args=(args, d), timeout=1800)[0]
    print(f"{'size':6} {'params':>10} {'megatron tok/s':>15} {'vllm tok/s':>11} {'vllm/megatron':>14} "
          f"{'refit s':>8} {'refit/rollout':>14} {'refit peak/model':>16} {'vllm start s':>13}")
    for size, r in res.items():
        print(f"{size:6} {r['params']:>10} {r['megatron_tokens_per_s']:>15} {r['vllm_tokens_per_s']:>11} "
              f"{r['vllm_over_megatron_tokens_per_s']:>14} {r['refit_s']:>8} {r['refit_over_rollout_time']:>14} "
              f"{str(r['refit_peak_extra_over_model']):>16} {r['vllm_start_s']:>13}")
    big = res[args.sizes[-1]]  # the large size; the tiny one under --tiny
    print(json.dumps({"vllm_over_megatron_tokens_per_s": big["vllm_over_megatron_tokens_per_s"],
                      "refit_over_rollout_time": big["refit_over_rollout_time"], "load_avg_1m_at_start": round(load, 1),
                      "prompts": args.prompts, "group": args.group, "max_new_tokens": args.new, "sizes": res}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
