"""`dpcc-megatron convert`: Hugging Face <-> Megatron-Core checkpoints, Megatron-Core -> NeMo 2, and a
logit parity check.

    dpcc-megatron convert hf-to-mcore --hf DIR --out DIR [--tp N --pp M] [--dtype bf16|fp16|fp32] [--overwrite]
    dpcc-megatron convert mcore-to-hf --mcore DIR --out DIR [--dtype ...] [--max-shard-size 4GB] [--hf-config F]
        [--tokenizer DIR] [--overwrite]
    dpcc-megatron convert mcore-to-nemo --mcore DIR --out DIR [--dtype ...] [--hf-config F] [--tokenizer DIR] [--overwrite]
    dpcc-megatron convert verify --hf DIR --mcore DIR|NEMO_DIR [--tp N --pp M --ep E --etp T] [--atol X] [--params-dtype D]
        [--memory-only]

Conversion runs on CPU (GPUs are hidden from it) and holds about one layer in memory. NeMo 2
checkpoints need no conversion to train from: `checkpoint.load` reads them directly.
Exports of a training checkpoint write the source model's config.json, tokenizer and
generation_config.json when the run started from a converted checkpoint (the trainer carries them in
every checkpoint); the output names, as "missing:" lines and in its JSON, whatever it had to do without.
`verify` starts TP*PP ranks (more where the expert grid EP x expert-TP needs them) itself and ends with one JSON line; it exits 1 above tolerance. Both
models run in the checkpoint's own dtype unless --params-dtype says otherwise, and the host memory
that needs is printed before anything loads (--memory-only prints just that).
"""
from __future__ import annotations

import argparse
import json
import re
import sys

_DTYPES = ["fp32", "bf16", "fp16"]


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GB, 500MB)")
    unit = (m.group(2) or "").upper().replace("I", "").rstrip("B")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(unit or " "))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    p = sub.add_parser("hf-to-mcore", help="Hugging Face directory -> Megatron-Core distributed checkpoint")
    p.add_argument("--hf", required=True, metavar="DIR", help="HF model directory (config.json + weights)")
    p.add_argument("--out", required=True, metavar="DIR", help="output checkpoint directory")
    p.add_argument("--tp", type=int, default=1, help="TP the checkpoint is meant for (checked now; any TP loads it)")
    p.add_argument("--pp", type=int, default=1, help="PP the checkpoint is meant for (checked now; any PP loads it)")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size it is meant for (checked now; any EP loads it)")
    p.add_argument("--dtype", choices=_DTYPES, default=None, help="stored dtype (default: the checkpoint's)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("mcore-to-hf", help="Megatron-Core checkpoint -> Hugging Face safetensors directory")
    p.add_argument("--mcore", required=True, metavar="DIR",
                   help="converted checkpoint, a training checkpoint iter_*/ or its root (follows `latest`)")
    p.add_argument("--out", required=True, metavar="DIR", help="output HF directory")
    p.add_argument("--dtype", choices=_DTYPES, default=None, help="saved dtype (default: the checkpoint's)")
    p.add_argument("--max-shard-size", type=_size, default=_size("4GB"), metavar="SIZE",
                   help="largest safetensors shard (default 4GB)")
    p.add_argument("--hf-config", default=None, metavar="config.json",
                   help="config.json to write (default: the one the checkpoint carries, else generated)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="copy tokenizer files from here (default: the checkpoint's tokenizer/)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("mcore-to-nemo", help="Megatron-Core checkpoint -> NeMo 2 checkpoint (context/ + weights/)")
    p.add_argument("--mcore", required=True, metavar="DIR",
                   help="converted checkpoint, a training checkpoint iter_*/ or its root (follows `latest`)")
    p.add_argument("--out", required=True, metavar="DIR", help="output NeMo 2 checkpoint directory")
    p.add_argument("--hf-config", default=None, metavar="config.json",
                   help="source model's config.json to keep beside the tokenizer (default: the checkpoint's)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="copy tokenizer files from here to context/nemo_tokenizer (default: the checkpoint's tokenizer/)")
    p.add_argument("--dtype", choices=_DTYPES, default=None, help="saved dtype (default: the checkpoint's)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("verify", help="compare HF and Megatron logits on the same tokens")
    p.add_argument("--hf", required=True, metavar="DIR")
    p.add_argument("--mcore", required=True, metavar="DIR",
                   help="a Megatron-Core checkpoint, or a NeMo 2 checkpoint (a directory with context/ and weights/)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE models)")
    p.add_argument("--etp", type=int, default=None, help="tensor parallel size inside each expert (default: --tp)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--atol", type=float, default=None,
                   help="fail above this max |logit diff| or |log-prob diff| (default 1e-3 at fp32, 0.5 bf16, 0.25 fp16)")
    p.add_argument("--params-dtype", choices=_DTYPES, default=None,
                   help="precision of both models (default: the dtype the Megatron checkpoint stores)")
    p.add_argument("--memory-only", action="store_true",
                   help="print the host memory verify needs (an estimate) as one JSON line, run nothing")
    p.add_argument("--transformer-engine", action="store_true", help="build the Megatron model with the TE spec (GPU)")
    p.add_argument("--hf-device", default="cpu", help="device for the HF reference forward")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are killed")


def main(args: argparse.Namespace) -> int:
    from ..convert.runtime import hide_cuda

    if args.action in ("hf-to-mcore", "mcore-to-hf", "mcore-to-nemo"):
        hide_cuda()  # before torch touches CUDA: conversion is a CPU job
    from ..convert.errors import ConversionError

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        if args.action == "hf-to-mcore":
            from ..convert.hf_to_mcore import hf_to_mcore

            summary = hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype,
                                  overwrite=args.overwrite, progress=not args.no_progress, log=log)
            print(json.dumps(summary, sort_keys=True))
            return 0
        if args.action == "mcore-to-hf":
            from ..convert.mcore_to_hf import mcore_to_hf

            summary = mcore_to_hf(args.mcore, args.out, dtype=args.dtype, overwrite=args.overwrite,
                                  max_shard_bytes=args.max_shard_size, hf_config=args.hf_config,
                                  tokenizer=args.tokenizer, progress=not args.no_progress, log=log)
            print(json.dumps(summary, sort_keys=True))
            return 0
        if args.action == "mcore-to-nemo":
            from ..convert.mcore_to_nemo import mcore_to_nemo

            summary = mcore_to_nemo(args.mcore, args.out, dtype=args.dtype, overwrite=args.overwrite,
                                    progress=not args.no_progress, log=log, hf_config=args.hf_config,
                                    tokenizer=args.tokenizer)
            print(json.dumps(summary, sort_keys=True))
            return 0
        from ..convert.verify import format_report, verify

        report = verify(args.hf, args.mcore, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, batch=args.batch, seq_len=args.seq_len,
                        seed=args.seed, atol=args.atol, params_dtype=args.params_dtype,
                        transformer_engine=args.transformer_engine, hf_device=args.hf_device,
                        timeout=args.timeout, log=log, memory_only=args.memory_only)
        if args.memory_only:
            print(json.dumps({**report, "gib": round(report["bytes"] / float(1 << 30), 2)}, sort_keys=True))
            return 0
        print(format_report(report), flush=True)
        return 0 if report["ok"] else 1
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
