"""What a test run may not do: leave the checkout changed. Tests write only to temporary directories.

:func:`snapshot` records every file and folder under the checkout (size and modification time), except
what Python and pytest themselves keep there: ``.git``, virtual environments, ``__pycache__`` and
``.pytest_cache``. ``tests/conftest.py`` takes one when the session starts and compares it with another
when the session ends; any difference fails the run and names the paths.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

# Kept by git, Python's import system and pytest's cache plugin, not by any test.
SKIPPED_NAMES = frozenset({".git", "__pycache__", ".pytest_cache"})

Entry = tuple  # (kind, size, mtime_ns); kind "dir" or "file"


def snapshot(root: Path, skip: Iterable[Path] = ()) -> dict[str, Entry]:
    """Relative path -> (kind, size, mtime_ns) for everything under ``root``, less the skipped parts
    and any folder holding a ``pyvenv.cfg`` (a virtual environment, e.g. the Makefile's ``.venv``)."""
    root = Path(root)
    skipped = {os.path.realpath(p) for p in skip}
    out: dict[str, Entry] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        keep = []
        for d in dirnames:
            full = os.path.join(dirpath, d)
            if d in SKIPPED_NAMES or os.path.realpath(full) in skipped or os.path.exists(
                    os.path.join(full, "pyvenv.cfg")):
                continue
            keep.append(d)
            out[os.path.relpath(full, root) + "/"] = ("dir", 0, 0)
        dirnames[:] = keep
        for name in filenames:
            if name in SKIPPED_NAMES:
                continue
            full = os.path.join(dirpath, name)
            try:
                st = os.lstat(full)
            except FileNotFoundError:  # removed while we walked
                continue
            out[os.path.relpath(full, root)] = ("file", st.st_size, st.st_mtime_ns)
    return out


def changes(before: dict[str, Entry], after: dict[str, Entry]) -> list[str]:
    """Sorted lines ``added PATH`` / ``removed PATH`` / ``modified PATH``; empty when nothing changed."""
    lines = [f"added {p}" for p in after.keys() - before.keys()]
    lines += [f"removed {p}" for p in before.keys() - after.keys()]
    lines += [f"modified {p}" for p in before.keys() & after.keys() if before[p] != after[p] and before[p][0] == "file"]
    return sorted(lines, key=lambda line: line.split(" ", 1)[1])
