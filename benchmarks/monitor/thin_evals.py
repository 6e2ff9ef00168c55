"""Copy a labelled folder keeping the held-out evaluation fields only every N iterations.

    python -m benchmarks.monitor.thin_evals SRC DEST --every 5
    dpcc-megatron monitor evaluate --labelled DEST --split heldout

The streams of ``benchmarks/monitor/labelled-seventh/`` were evaluated every iteration. A user who
evaluates every N iterations (``eval.interval`` N) gives the detector the ``eval_*`` fields on one
record in N: this writes DEST as the detector would see such a run (``calibrate.thin_evals``), with
SRC's labels unchanged.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dpcc_megatron.monitor.evaluate import PACK, read_labels, write_pack

from .calibrate import thin_evals


def thin_folder(src: Path, dest: Path, every: int) -> int:
    """Write DEST/set.tar.xz from SRC (loose or packed), with SRC's labels; returns the number of streams."""
    if every < 1:
        raise ValueError(f"--every must be >= 1, got {every}")
    streams, labels = {}, []
    for x in read_labels(src):
        records = [json.loads(line) for line in x["path"].read_text().splitlines() if line.strip()]
        streams[x["stream"]] = "".join(json.dumps(thin_evals(r, every)) + "\n" for r in records)
        labels.append({k: v for k, v in x.items() if k != "path"})
    dest.mkdir(parents=True, exist_ok=True)
    write_pack(dest / PACK, streams, labels)
    return len(streams)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path)
    p.add_argument("dest", type=Path)
    p.add_argument("--every", type=int, required=True, metavar="N")
    args = p.parse_args(argv)
    if args.dest.resolve() == args.src.resolve():
        p.error("DEST must differ from SRC")
    try:
        n = thin_folder(args.src, args.dest, args.every)
    except ValueError as e:
        p.error(str(e))
    print(f"[thin-evals] {n} streams written to {args.dest} with evaluations every {args.every} iterations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
