"""`dpcc-megatron` console entry point.

Subcommands live in :mod:`dpcc_megatron.commands`; each module exposes
``add_arguments(parser)`` and ``main(args) -> int``. They are imported only when
invoked, so ``dpcc-megatron --help`` stays fast and never imports torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Order is the order shown by --help.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("dpcc_megatron.commands.demo", "the CPU demo: warm-start + DPCC RL at TP=2 with the monitor sidecar"),
    "train": ("dpcc_megatron.commands.train", "run DPCC RL training on every rank (torchrun, srun, mpirun)"),
    "monitor": ("dpcc_megatron.commands.monitor", "metrics sidecar: serve, replay a metric stream, report"),
    "reward": ("dpcc_megatron.commands.reward", "score samples offline with the dual-track reward"),
    "plan": ("dpcc_megatron.commands.plan", "estimate per-GPU memory for a layout; --search proposes layouts"),
    "convert": ("dpcc_megatron.commands.convert", "convert checkpoints: hf-to-mcore, mcore-to-hf, mcore-to-nemo, verify"),
}


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="dpcc-megatron",
        description="DPCC: dynamic policy calibration for stable RL post-training on Megatron-Core.",
    )
    parser.add_argument("--version", action="version", version=f"dpcc-megatron {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv or ["--help"])
        return 2
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    sub = argparse.ArgumentParser(prog=f"dpcc-megatron {name}", description=COMMANDS[name][1])
    module.add_arguments(sub)
    args = sub.parse_args(argv[1:])
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
