"""`dpcc-megatron train --config CONFIG.yaml [--set key=value ...]`: run on every rank
(torchrun, srun, mpirun or the demo's local launcher)."""
from __future__ import annotations

import json
import sys


def add_arguments(parser) -> None:
    parser.add_argument("--config", required=True, help="job YAML (see examples/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key, e.g. --set optim.lr=1e-6 (repeatable)")


def main(args) -> int:
    from ..config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"dpcc-megatron train: {e}", file=sys.stderr)
        return 2  # EXIT_USAGE
    from ..train.exit_codes import exit_code
    from ..train.trainer import train

    summary = train(cfg)
    return exit_code(summary)  # 0 done/signal/exit_interval, 1 failed, 3 paused by the monitor
