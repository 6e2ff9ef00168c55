"""Reading samples and the labelled eval set from JSONL, with errors that name file and line."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator

from .sample import Sample, SampleError


def _records(path: str | Path, what: str) -> Iterator[tuple[str, dict]]:
    p = Path(path)
    if not p.is_file():
        raise SampleError(f"{what} not found: {p}")
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise SampleError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            yield where, record


def read_samples(path: str | Path) -> list[Sample]:
    """One :class:`Sample` per non-empty line."""
    return [Sample.from_dict(r, where) for where, r in _records(path, "input file")]


def read_eval_set(path: str | Path) -> tuple[list[Sample], list[float]]:
    """Samples plus their human ``label`` (a number in [0, 1]; higher is better)."""
    samples, labels = [], []
    for where, record in _records(path, "reward.eval_set file"):
        sample = Sample.from_dict(record, where)
        label = record.get("label")
        if isinstance(label, bool) or not isinstance(label, (int, float)) or not math.isfinite(label) \
                or not 0 <= label <= 1:
            raise SampleError(f"{where}: field 'label' must be a number in [0, 1], got {label!r:.60}")
        samples.append(sample)
        labels.append(float(label))
    if not samples:
        raise SampleError(f"reward.eval_set file {path} has no samples")
    return samples, labels
