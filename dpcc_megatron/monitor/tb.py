"""TensorBoard event writer that does not import torch or tensorflow.

Uses tensorboard's own ``EventFileWriter`` and protos; one event directory per run.
"""
from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Mapping, Optional

from .records import numeric_fields

_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")

# Field -> TensorBoard tag (grouped panels); other fields go under "other/".
TAG_GROUPS = {
    "entropy": "policy", "entropy_frac": "policy", "kl_old_new": "policy", "kl_ref": "policy",
    "mismatch_kl": "policy", "grad_norm": "policy", "tau": "dpcc", "lr": "dpcc", "lr_factor": "dpcc",
    "clip_frac": "dpcc", "repetition_rate": "quality", "longest_repeat": "quality",
    "language_consistency": "quality", "perplexity": "quality", "reward_mean": "reward",
    "reward_std": "reward", "reward_agreement": "reward", "sample_utilization": "efficiency",
    "zero_var_frac": "efficiency", "steps_taken": "efficiency", "steps_skipped": "efficiency",
    "seconds": "time", "tokens_per_s": "time", "peak_device_memory_gib": "memory", "host_peak_rss_gib": "memory",
}
TAG_GROUPS.update({f"time_{p}_s": "time" for p in ("rollout", "refit", "logprobs", "logprobs_old", "logprobs_ref",
                                                    "update", "checkpoint", "eval")})


class TensorBoardWriter:
    def __init__(self, logdir: str | Path):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self._cls = EventFileWriter
        self.logdir = Path(logdir)
        self._writers: dict[str, object] = {}

    def _writer(self, run_id: str):
        w = self._writers.get(run_id)
        if w is None:
            d = self.logdir / _SAFE.sub("_", run_id)
            d.mkdir(parents=True, exist_ok=True)
            w = self._writers[run_id] = self._cls(str(d), max_queue_size=1000, flush_secs=5)
        return w

    def write_record(self, rec: Mapping, numeric: Optional[dict] = None) -> None:
        S = self._summary_pb2.Summary
        values = []
        kind = rec.get("kind", "train")
        for name, v in (numeric if numeric is not None else numeric_fields(rec)).items():
            if not math.isfinite(v):
                continue
            tag = f"{TAG_GROUPS.get(name, 'other')}/{name}"
            if kind != "train":
                tag = f"{kind}/{tag}"
            values.append(S.Value(tag=tag, simple_value=v))
        if values:
            ev = self._event_pb2.Event(wall_time=float(rec.get("time") or time.time()), step=int(rec["iteration"]),
                                       summary=S(value=values))
            self._writer(rec.get("run_id", "default")).add_event(ev)

    def write_alert(self, alert) -> None:
        S = self._summary_pb2.Summary
        ev = self._event_pb2.Event(wall_time=time.time(), step=int(alert.iteration), summary=S(value=[
            S.Value(tag=f"alerts/{alert.rule}", simple_value=2.0 if alert.severity == "critical" else 1.0)]))
        self._writer(alert.run_id).add_event(ev)

    def flush(self) -> None:
        for w in self._writers.values():
            w.flush()

    def close(self) -> None:
        for w in self._writers.values():
            w.close()
        self._writers.clear()
