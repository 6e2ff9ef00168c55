"""How good is the collapse detector? Replay labelled metric streams and score it.

A labelled set is a folder with ``labels.jsonl``, one object per stream::

    {"stream": "runs/grpo__lr0.002__s3.jsonl", "label": "collapse", "split": "heldout",
     "onset": 12, "direction": "low", "source": "benchmarks/stability"}

``stream`` is a metrics.jsonl file (one record per iteration, as the trainer writes it),
relative to the folder; ``label`` is ``collapse``, ``healthy`` or ``degraded`` (a run that did
not collapse but ended worse than it started: neither a miss nor a false alarm); ``split`` is ``dev`` or
``heldout`` (tune on dev, report held-out); ``onset`` (collapse only) is the iteration the
collapse began, by the labeller's definition; ``direction`` (``high``/``low``) and ``source``
are informational.

A set of many streams may be kept as one compressed file instead: the folder's ``set.tar.xz``
(:data:`PACK`, written by :func:`write_pack`), whose members are ``labels.jsonl`` and the streams
under the names the labels give. A loose ``labels.jsonl`` or stream file in the folder is read
before a member of the same name.

Each stream is replayed through a fresh :class:`CollapseDetector`. The scores:

* **recall**: collapsed streams with a confirmed critical alert no later than the iteration
  from which the reward has halved for good (:func:`half_reward_iteration`: read on the trailing
  3-iteration mean; the stream's end when it never does), over all collapsed streams;
* **precision**: those detections over all streams with a confirmed critical alert;
* **lead**: iterations from the first confirmed critical alert to that half-reward iteration
  (collapsed streams whose reward halves); the median is reported;
* **healthy_critical**: confirmed critical alerts on healthy streams (``healthy_alarmed``: the
  healthy streams with at least one);
* **warnings_per_100_healthy**: warnings (any non-confirmed alert) per 100 healthy iterations;
* **degraded_alarmed**: degraded streams with a confirmed critical alert (informational: advising an
  LR cut on a run that is sinking is not a false alarm, and missing it is not a missed collapse).

The reward read is the rule track (``reward_base_mean``) when the stream has it, else
``reward_mean``. Stdlib only (the sidecar side of the package never imports torch).
"""
from __future__ import annotations

import io
import json
import math
import statistics
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .detector import CollapseDetector
from .records import RecordError, normalize_record

LABELS = ("collapse", "healthy", "degraded")
SPLITS = ("dev", "heldout")


class LabelError(ValueError):
    """A malformed labelled set (the message names the file and line)."""


#: A labelled set as one file: an xz-compressed tar of ``labels.jsonl`` and the streams it names.
PACK = "set.tar.xz"
LABELS_FILE = "labels.jsonl"


@dataclass(frozen=True)
class PackedStream:
    """One stream read from a labelled set's :data:`PACK` (``read_text`` as a path's)."""

    archive: Path
    member: str
    data: bytes = field(repr=False)

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.data.decode(encoding)

    def __str__(self) -> str:
        return f"{self.archive}:{self.member}"


def read_pack(archive: str | Path) -> dict[str, bytes]:
    """Member name -> bytes of every file in a :data:`PACK` archive."""
    try:
        with tarfile.open(archive, "r:xz") as tar:
            return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    except (tarfile.TarError, OSError, EOFError) as e:
        raise LabelError(f"{archive}: not a readable tar.xz archive: {e}") from None


def write_pack(archive: str | Path, streams: dict[str, str], labels: Optional[list[dict]] = None) -> Path:
    """Write ``streams`` (member name -> text), and ``labels`` as its ``labels.jsonl``, as a :data:`PACK`
    archive, members sorted by name with a fixed time and owner, so the same set gives the same bytes.
    Written to a temporary name first."""
    streams = dict(streams)
    if labels is not None:
        streams[LABELS_FILE] = "".join(json.dumps(x) + "\n" for x in labels)
    archive = Path(archive)
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:xz", preset=9) as tar:
        for name in sorted(streams):
            data = streams[name].encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(archive)
    return archive


@dataclass
class StreamResult:
    name: str
    label: str
    iterations: int
    first_confirmed: Optional[int]
    half_reward: Optional[int]
    warnings: int
    criticals: int
    rules: list = field(default_factory=list)

    @property
    def detected(self) -> bool:
        if self.first_confirmed is None:
            return False
        return self.half_reward is None or self.first_confirmed <= self.half_reward

    @property
    def lead(self) -> Optional[int]:
        if self.first_confirmed is None or self.half_reward is None:
            return None
        return self.half_reward - self.first_confirmed


def _reward(rec: dict) -> Optional[float]:
    v = rec.get("reward_base_mean", rec.get("reward_mean"))
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


#: Iterations in the trailing mean of the reward that "halving" is read on.
SMOOTH = 3
#: A halving must have at least this many iterations (counting its first) to the end of the stream, so
#: a noisy reward that dips in the last few iterations of a run is not a collapse.
MIN_TAIL = 5


def smoothed_reward(records: list[dict], window: int = SMOOTH) -> list[Optional[float]]:
    """Trailing mean of the (rule-track) reward over the last ``window`` iterations (fewer at the start)."""
    vals = [_reward(r) for r in records]
    out: list[Optional[float]] = []
    for i in range(len(vals)):
        chunk = [v for v in vals[max(0, i - window + 1): i + 1] if v is not None]
        out.append(sum(chunk) / len(chunk) if chunk else None)
    return out


def half_reward_iteration(records: list[dict], window: int = SMOOTH, min_tail: int = MIN_TAIL) -> Optional[int]:
    """The iteration from which the reward has halved for good (None: it never does).

    Read on the trailing ``window``-iteration mean m_t of the rule-track reward, with B_t the best
    m so far: the first t, at least ``min_tail`` iterations before the end of the stream, with
    m_t < 0.5 * B_t whose rewards from t to the end also average below 0.5 * B_t. A single bad
    batch of a noisy reward is not a halving, a dip the run recovers from is not one either, and
    one lucky batch after the fall does not undo it.
    """
    m = smoothed_reward(records, window)
    vals = [_reward(r) for r in records]
    best = None
    for t, v in enumerate(m):
        if v is None:
            continue
        best = v if best is None else max(best, v)
        if len(records) - t < min_tail or best <= 0 or v >= 0.5 * best:
            continue
        rest = [x for x in vals[t:] if x is not None]
        if rest and sum(rest) / len(rest) < 0.5 * best:
            return int(records[t]["iteration"])
    return None


def read_labels(folder: str | Path) -> list[dict]:
    folder = Path(folder)
    path = folder / LABELS_FILE
    packed = read_pack(folder / PACK) if (folder / PACK).is_file() else {}
    if path.is_file():
        text = path.read_text(encoding="utf-8")
    elif LABELS_FILE in packed:
        path, text = f"{folder / PACK}:{LABELS_FILE}", packed[LABELS_FILE].decode("utf-8")
    else:
        raise LabelError(f"{path}: not found (a labelled set is a folder with labels.jsonl, loose or in its {PACK})")
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise LabelError(f"{where}: invalid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise LabelError(f"{where}: each line must be an object")
        if obj.get("label") not in LABELS:
            raise LabelError(f"{where}: label must be one of {', '.join(LABELS)}, got {obj.get('label')!r}")
        if obj.get("split") not in SPLITS:
            raise LabelError(f"{where}: split must be one of {', '.join(SPLITS)}, got {obj.get('split')!r}")
        name = str(obj.get("stream") or "")
        stream = folder / name
        if name and stream.is_file():
            out.append(dict(obj, path=stream))
        elif name in packed:
            out.append(dict(obj, path=PackedStream(folder / PACK, name, packed[name])))
        else:
            raise LabelError(f"{where}: stream {obj.get('stream')!r} is not a file in {folder}"
                             + (f" nor a member of its {PACK}" if packed else ""))
    if not out:
        raise LabelError(f"{path}: no streams")
    return out


def read_stream(path: "Path | PackedStream") -> list[dict]:
    recs = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise LabelError(f"{path}:{lineno}: invalid JSON: {e}") from None
        try:
            rec = normalize_record(rec)
        except RecordError as e:
            raise LabelError(f"{path}:{lineno}: {e}") from None
        if rec["kind"] == "train":
            recs.append(rec)
    return recs


def replay(records: list[dict], cfg: Any, name: str = "", label: str = "") -> StreamResult:
    det = CollapseDetector(cfg, run_id=name or "stream")
    first, warnings, criticals, rules = None, 0, 0, []
    for rec in records:
        for alert in det.update(rec):
            rules.append(alert.rule)
            if alert.confirmed and alert.severity == "critical":
                criticals += 1
                if first is None:
                    first = alert.iteration
            else:
                warnings += 1
    return StreamResult(name, label, len(records), first, half_reward_iteration(records), warnings, criticals,
                        sorted(set(rules)))


def score(results: list[StreamResult]) -> dict:
    collapsed = [r for r in results if r.label == "collapse"]
    healthy = [r for r in results if r.label == "healthy"]
    degraded = [r for r in results if r.label == "degraded"]
    alarmed = [r for r in results if r.first_confirmed is not None]
    hits = [r for r in collapsed if r.detected]
    leads = [r.lead for r in hits if r.lead is not None]
    healthy_iters = sum(r.iterations for r in healthy)
    return {
        "streams": len(results), "collapsed": len(collapsed), "healthy": len(healthy),
        "recall": len(hits) / len(collapsed) if collapsed else None,
        "precision": len(hits) / len(alarmed) if alarmed else None,
        "median_lead_iterations": statistics.median(leads) if leads else None,
        "healthy_critical": sum(r.criticals for r in healthy),
        "healthy_alarmed": sum(r.criticals > 0 for r in healthy),
        "warnings_per_100_healthy": 100.0 * sum(r.warnings for r in healthy) / healthy_iters if healthy_iters else None,
        "degraded": len(degraded), "degraded_alarmed": sum(r.criticals > 0 for r in degraded),
    }


def labelled_streams(folder: str | Path, split: Optional[str] = "heldout", seeds: Optional[set] = None,
                     families: Optional[list] = None) -> list[tuple[str, str, list[dict]]]:
    """(stream name, label, records) of every stream of ``split`` (None: all) in a labelled set; with
    ``seeds``, only streams whose label's ``seed`` is one of them; with ``families``, only streams whose
    label's ``family`` starts with one of those prefixes."""
    labels = [x for x in read_labels(folder) if (split is None or x["split"] == split)
              and (seeds is None or x.get("seed") in seeds)
              and (families is None or any(str(x.get("family", "")).startswith(f) for f in families))]
    if not labels:
        what = [f"split {split!r}"] + ([f"seeds {sorted(seeds)}"] if seeds is not None else []) + \
            ([f"families {list(families)}"] if families is not None else [])
        raise LabelError(f"{folder}: no streams in {', '.join(what)}")
    return [(str(x["stream"]), x["label"], read_stream(x["path"])) for x in labels]


def evaluate(folder: str | Path, cfg: Any, split: Optional[str] = "heldout", seeds: Optional[set] = None,
             families: Optional[list] = None) -> tuple[list[StreamResult], dict]:
    results = [replay(records, cfg, name, label)
               for name, label, records in labelled_streams(folder, split, seeds, families)]
    return results, score(results)
