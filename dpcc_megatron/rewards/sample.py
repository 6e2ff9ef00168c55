"""The unit the reward layer scores: one prompt/response pair plus its task fields.

``group_id`` ties the samples of one GRPO group together (the advanced track
compares them with each other). It defaults to the prompt text, so samples of
the same prompt form a group; the trainer can pass any hashable id (e.g. the
prompt index in the batch). The older-policy buffer is keyed by prompt text,
not by ``group_id``, so per-batch ids never mix different prompts across steps.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional, Sequence


class SampleError(ValueError):
    """An input record cannot be turned into a :class:`Sample`."""


@dataclass
class Sample:
    """One response to score."""

    prompt: str
    response: str
    task: str = "text"
    answer: Optional[str] = None
    """Reference answer (math: any form sympy understands, GSM8K `#### x` and `\\boxed{}` included)."""
    tests: Optional[str] = None
    """Python source run after the code (e.g. asserts)."""
    schema: Optional[dict] = None
    """JSON Schema the response must satisfy."""
    pattern: Optional[str] = None
    """Regex the response must match (the `format` checker's per-sample pattern)."""
    language: Optional[str] = None
    """Expected language/script (`en`, `zh`, `latin`, `cjk`, ...); None infers it from the prompt."""
    group_id: Optional[Hashable] = None
    response_ids: Optional[Sequence[int]] = None
    """Response token ids; lengths and n-grams use them when present."""
    meta: dict = field(default_factory=dict)
    """Any other fields of the input record (kept for the CLI's output)."""

    def __post_init__(self) -> None:
        if self.response_ids is not None:  # tensors/arrays -> ints: hashable n-grams, JSON-able state
            ids = self.response_ids.tolist() if hasattr(self.response_ids, "tolist") else self.response_ids
            self.response_ids = [int(t) for t in ids]

    @property
    def group_key(self) -> Hashable:
        return self.prompt if self.group_id is None else self.group_id

    @classmethod
    def from_dict(cls, record: Any, where: str = "sample") -> "Sample":
        """Build from a JSON record; ``where`` (e.g. ``file.jsonl:3``) prefixes errors."""
        if not isinstance(record, dict):
            raise SampleError(f"{where}: expected a JSON object, got {type(record).__name__}")
        for key in ("prompt", "response"):
            if not isinstance(record.get(key), str):
                raise SampleError(f"{where}: field {key!r} must be a string, got {record.get(key)!r:.60}")
        known = {f.name for f in dataclasses.fields(cls)} - {"meta"}
        kwargs = {k: v for k, v in record.items() if k in known}
        for key in ("task", "tests", "pattern", "language"):
            if kwargs.get(key) is not None and not isinstance(kwargs[key], str):
                raise SampleError(f"{where}: field {key!r} must be a string, got {kwargs[key]!r:.60}")
        if kwargs.get("answer") is not None and not isinstance(kwargs["answer"], str):
            if isinstance(kwargs["answer"], (int, float)) and not isinstance(kwargs["answer"], bool):
                kwargs["answer"] = str(kwargs["answer"])
            else:
                raise SampleError(f"{where}: field 'answer' must be a string or number, got {kwargs['answer']!r:.60}")
        if kwargs.get("schema") is not None and not isinstance(kwargs["schema"], (dict, bool)):
            raise SampleError(f"{where}: field 'schema' must be a JSON object, got {kwargs['schema']!r:.60}")
        gid = kwargs.get("group_id")
        if gid is not None and not isinstance(gid, (str, int)):
            raise SampleError(f"{where}: field 'group_id' must be a string or integer, got {gid!r:.60}")
        ids = kwargs.get("response_ids")
        if ids is not None and not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
            raise SampleError(f"{where}: field 'response_ids' must be a list of integers")
        if kwargs.get("task") is None:
            kwargs.pop("task", None)
        meta = {k: v for k, v in record.items() if k not in known}
        return cls(**kwargs, meta=meta)

    def to_dict(self) -> dict:
        """JSON-able form (inverse of :meth:`from_dict`; used by state_dict and the CLI)."""
        out = dict(self.meta)
        for f in dataclasses.fields(self):
            if f.name == "meta":
                continue
            value = getattr(self, f.name)
            if value is None:
                continue
            out[f.name] = value
        return out
