"""One rank of ``convert verify``: ``python -m torch.distributed.run ... -m dpcc_megatron.convert.verify_worker``."""
from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dpcc_megatron.convert.verify_worker")
    p.add_argument("--mcore", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=None)
    p.add_argument("--params-dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--transformer-engine", action="store_true")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    from ..megatron.parallel import init_distributed
    from .verify import mcore_logits

    if not torch.cuda.is_available():
        from ..testing import enable_cpu_megatron

        enable_cpu_megatron()
    init_distributed()
    try:
        tokens = torch.load(args.tokens, weights_only=True)
        logits = mcore_logits(args.mcore, tokens, args.tp, args.pp, args.params_dtype, args.transformer_engine,
                              ep=args.ep, etp=args.etp)
        if logits is not None:
            tmp = f"{args.out}.tmp-{os.getpid()}"
            torch.save(logits, tmp)
            os.replace(tmp, args.out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
