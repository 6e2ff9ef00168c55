"""Print a pip constraints file that pins every distribution installed in this Python at its
installed version (``name==version``, one per line, sorted by name).

A container's own packages (torch, Transformer Engine, apex, flash-attn, NCCL bindings, ...) are
thereby fixed: ``PIP_CONSTRAINT=<this file> pip install ...`` may add packages but never replaces,
upgrades or downgrades one of them; a requirement that cannot be met with the pinned versions fails
the install, naming the package, instead of pulling a second torch.

    python containers/pin_installed.py > /etc/pip/container-constraints.txt
    python containers/pin_installed.py --check /etc/pip/container-constraints.txt   # nothing changed?

Standard library only (runs in any Python >= 3.8).
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    """{canonical name: version} of every distribution on sys.path (the first one found wins, as
    for imports)."""
    out: dict[str, str] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"] if dist.metadata else None
        if not name or not dist.version:
            continue
        out.setdefault(_canonical(name), dist.version)
    return out


def constraints(pins: dict[str, str], exclude=()) -> str:
    skip = {_canonical(n) for n in exclude}
    return "".join(f"{n}=={v}\n" for n, v in sorted(pins.items()) if n not in skip)


def changed(path: str) -> list[str]:
    """Pinned distributions whose installed version differs from the file (or that are gone)."""
    now = installed()
    diffs = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name, _, version = line.partition("==")
            got = now.get(_canonical(name))
            if got != version:
                diffs.append(f"{name}: pinned {version}, installed {got or 'nothing'}")
    return diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exclude", action="append", default=[],
                    help="leave this distribution unpinned (repeatable), e.g. one being upgraded on purpose")
    ap.add_argument("--check", metavar="FILE", help="exit 1, listing them, if pinned distributions changed")
    args = ap.parse_args(argv)
    if args.check:
        diffs = changed(args.check)
        for d in diffs:
            print(f"pin_installed: {d}", file=sys.stderr)
        return 1 if diffs else 0
    sys.stdout.write(constraints(installed(), args.exclude))
    return 0


if __name__ == "__main__":
    sys.exit(main())
