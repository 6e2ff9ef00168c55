"""`dpcc-megatron plan`: per-GPU memory of a layout, term by term; `--search` ranks the feasible ones.

    dpcc-megatron plan --config examples/llama3_70b.yaml --gpus 64
    dpcc-megatron plan --config examples/llama3_70b.yaml --gpus 64 --tp 1 --pp 1
    dpcc-megatron plan --config examples/llama3_70b.yaml --gpus 64 --search

The last line of output is one JSON object with at least ``fits`` and ``peak_gib_per_gpu``.
Exit status: 0 fits, 1 does not fit in memory (or no layout does), 2 the layout or the
config is invalid. Never imports torch: it runs on a login node.
"""
from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="job YAML (see examples/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key, as for `train` (repeatable)")
    parser.add_argument("--gpus", type=int, default=None, help="world size (default: TP x PP x CP, one replica)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    parser.add_argument("--gpu-mem-gib", type=float, default=80.0, help="memory per GPU in GiB (default 80)")
    parser.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: the config's)")
    parser.add_argument("--pp", type=int, default=None, help="pipeline parallel size (default: the config's)")
    parser.add_argument("--vpp", type=int, default=None,
                        help="virtual pipeline chunks per stage, 0 for none (default: the config's)")
    parser.add_argument("--cp", type=int, default=1, help="context parallel size (default 1)")
    parser.add_argument("--ep", type=int, default=None,
                        help="expert parallel size (default: the config's parallel.expert_model_parallel_size)")
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default=None,
                        help="activation recompute (default: parallel.recompute_granularity if set, else none)")
    parser.add_argument("--micro-batch", type=int, default=None, help="default: train.micro_batch_size")
    parser.add_argument("--sequence-parallel", choices=["on", "off"], default=None,
                        help="default: parallel.sequence_parallel")
    parser.add_argument("--reserve-gib", type=float, default=4.0,
                        help="per-GPU allowance for CUDA context, NCCL/cuBLAS workspaces, fragmentation (default 4)")
    parser.add_argument("--logits-chunk", type=int, default=1024,
                        help="tokens per fp32 chunk of the vocab-parallel log-prob op (default 1024)")
    parser.add_argument("--search", action="store_true", help="propose feasible layouts ranked by modelled throughput")
    parser.add_argument("--top", type=int, default=10, help="layouts shown by --search (default 10)")
    g = parser.add_argument_group("throughput model (see docs/launch.md)")
    g.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 TFLOP/s per GPU (default 989)")
    g.add_argument("--mfu-ceiling", type=float, default=0.6, help="fraction of peak big GEMMs reach (default 0.6)")
    g.add_argument("--hbm-gbps", type=float, default=3350.0, help="HBM GB/s per GPU (default 3350, H100)")
    g.add_argument("--nvlink-gbps", type=float, default=450.0, help="intra-node GB/s per GPU (default 450)")
    g.add_argument("--network-gbps", type=float, default=50.0, help="inter-node GB/s per GPU (default 50)")


def _options(args):
    from ..launch.plan import PlanOptions
    from ..launch.throughput import Hardware

    for name in ("gpus", "tp", "pp", "gpus_per_node", "micro_batch", "top", "logits_chunk"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.vpp is not None and args.vpp < 0:
        raise ValueError(f"--vpp must be >= 0, got {args.vpp}")
    if args.cp < 1:
        raise ValueError(f"--cp must be >= 1, got {args.cp}")
    for name in ("gpu_mem_gib", "peak_tflops", "hbm_gbps", "nvlink_gbps", "network_gbps"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if not 0 < args.mfu_ceiling <= 1:
        raise ValueError(f"--mfu-ceiling must be in (0, 1], got {args.mfu_ceiling}")
    if args.reserve_gib < 0:
        raise ValueError(f"--reserve-gib must be >= 0, got {args.reserve_gib}")
    hw = Hardware(gpu_mem_gib=args.gpu_mem_gib, gpus_per_node=args.gpus_per_node, peak_tflops=args.peak_tflops,
                  mfu_ceiling=args.mfu_ceiling, hbm_gbps=args.hbm_gbps, intra_node_gbps=args.nvlink_gbps, inter_node_gbps=args.network_gbps)
    sp = None if args.sequence_parallel is None else args.sequence_parallel == "on"
    return PlanOptions(gpus=args.gpus, tp=args.tp, pp=args.pp, vpp=args.vpp, cp=args.cp, ep=args.ep,
                       recompute=args.recompute,
                       micro_batch=args.micro_batch, sequence_parallel=sp, reserve_gib=args.reserve_gib,
                       logits_chunk=args.logits_chunk, hardware=hw)


def main(args: argparse.Namespace) -> int:
    from ..config import ConfigError, load_config
    from ..launch.plan import format_plan, plan_layout, search_layouts

    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.model.vocab_size is None:  # taken from data.tokenizer, as the trainer does
            from ..data.tokenizer import resolve_vocab_size

            cfg = resolve_vocab_size(cfg)
        opts = _options(args)
    except (ConfigError, ValueError) as e:
        print(f"dpcc-megatron plan: {e}", file=sys.stderr)
        print(json.dumps({"fits": False, "peak_gib_per_gpu": None, "problems": [str(e)]}))
        return 2
    if not args.search:
        plan = plan_layout(cfg, opts)
        print(format_plan(plan, f"plan for {args.config}"))
        print(json.dumps(plan.summary()))
        return 0 if plan.fits else (2 if plan.problems else 1)

    try:
        plans = search_layouts(cfg, opts)
    except ValueError as e:
        print(f"dpcc-megatron plan: {e}", file=sys.stderr)
        print(json.dumps({"fits": False, "peak_gib_per_gpu": None, "problems": [str(e)]}))
        return 2
    feasible = [p for p in plans if p.fits]
    print(f"search for {args.config}: {len(plans)} valid layouts on {opts.gpus} GPUs, {len(feasible)} fit in "
          f"{opts.hardware.gpu_mem_gib:g} GiB; ranked by modelled RL-iteration throughput")
    shown = feasible[:args.top] or plans[:args.top]
    if not feasible:
        print("no layout fits; the smallest footprints are:")
    print(f"{'rank':>4} {'TP':>3} {'PP':>3} {'VPP':>4} {'DP':>4} {'recompute':>10} {'peak GiB':>9} "
          f"{'bubble':>7} {'step s':>7} {'rollout s':>9} {'tok/s/GPU':>10}")
    for i, p in enumerate(shown, 1):
        L, t = p.layout, p.time
        print(f"{i:>4} {L.tp:>3} {L.pp:>3} {L.vpp or '-':>4} {L.dp:>4} {p.work.recompute:>10} {p.peak_gib:>9.1f} "
              f"{100 * t.step.bubble:>6.1f}% {t.step.total_s:>7.2f} {t.rollout_s:>9.0f} "
              f"{p.tokens_per_s_per_gpu:>10.0f}")
    if shown:
        print()
        print(format_plan(shown[0], "best:" if feasible else "smallest footprint:"))
    best = shown[0] if shown else None
    out = {"fits": bool(feasible), "peak_gib_per_gpu": round(best.peak_gib, 2) if best else None,
           "valid_layouts": len(plans), "feasible_layouts": len(feasible),
           "best": best.summary() if best else None,
           "layouts": [p.summary() for p in shown]}
    print(json.dumps(out))
    return 0 if feasible else 1
