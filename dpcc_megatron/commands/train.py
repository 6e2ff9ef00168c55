"""`dpcc-megatron train --config CONFIG.yaml [--set key=value ...]`: run on every rank
(torchrun, srun, mpirun or the demo's local launcher)."""
from __future__ import annotations

import json
import sys


def add_arguments(parser) -> None:
    parser.add_argument("--config", required=True, help="job YAML (see examples/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key, e.g. --set optim.lr=1e-6 (repeatable)")


def check_machine(cfg) -> None:
    """Refuse, naming the key, an explicit `true` for a speed setting this machine cannot run
    (before any rank initialises; `auto` never fails)."""
    from ..megatron.performance import release_memory_enabled, resolve

    resolve(cfg.parallel)
    release_memory_enabled(cfg.train.release_memory_between_phases)


def main(args) -> int:
    from ..config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
        check_machine(cfg)
    except ConfigError as e:
        print(f"dpcc-megatron train: {e}", file=sys.stderr)
        return 2  # EXIT_USAGE
    from ..train.exit_codes import exit_code
    from ..train.trainer import train

    summary = train(cfg)
    return exit_code(summary)  # 0 done/signal/exit_interval, 1 failed, 3 paused by the monitor
