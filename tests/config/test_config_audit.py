"""A mechanical guard against settings that are accepted and then ignored.

Every config section names, in its docstring, the code that consumes it (``Read by: path, ...``,
files or folders of the package). Every leaf key of the section must be read there: as an
attribute (``.key``) or by name (``"key"``). A new key that nothing in those places reads fails
here, and so does a section that does not say who reads it.
"""
from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from dpcc_megatron.config import JobConfig

ROOT = Path(__file__).resolve().parents[2]


def _sections(cls=JobConfig, seen=None) -> list[type]:
    """Every dataclass reachable from the root, including those inside lists and dicts."""
    seen = [] if seen is None else seen
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        for sub in _dataclasses_in(hints[f.name]):
            if sub not in seen:
                seen.append(sub)
                _sections(sub, seen)
    return seen


def _dataclasses_in(tp) -> list[type]:
    if dataclasses.is_dataclass(tp):
        return [tp]
    return [d for arg in typing.get_args(tp) for d in _dataclasses_in(arg)]


def _reader_names(cls) -> list[str]:
    """The paths after 'Read by:' (the docstring's last sentence, which may wrap over lines)."""
    doc = cls.__doc__ or ""
    assert "Read by:" in doc, f"{cls.__name__}'s docstring must name the code that reads it ('Read by: ...')"
    text = " ".join(doc.split("Read by:", 1)[1].split()).rstrip(".")
    names = [n.strip() for n in text.split(",")]
    assert all(n.startswith("dpcc_megatron/") for n in names), f"{cls.__name__}: bad 'Read by' list {names}"
    return names


def _readers(cls) -> list[Path]:
    paths = [ROOT / n for n in _reader_names(cls)]
    for p in paths:
        assert p.exists(), f"{cls.__name__}: 'Read by' names {p.relative_to(ROOT)}, which does not exist"
        assert "config" not in p.relative_to(ROOT).parts, f"{cls.__name__}: validation is not a reader"
    return paths


def _source(paths: list[Path]) -> str:
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*.py")))]
    return "\n".join(f.read_text() for f in files)


@pytest.mark.parametrize("section", _sections(), ids=lambda c: c.__name__)
def test_every_key_is_read_by_the_code_its_section_names(section):
    text = _source(_readers(section))
    hints = typing.get_type_hints(section)
    unread = [f.name for f in dataclasses.fields(section)
              if not _dataclasses_in(hints[f.name])  # nested sections are checked on their own
              and not re.search(rf"\.{f.name}\b|[\"']{f.name}[\"']", text)]
    assert not unread, f"{section.__name__}: {unread} are accepted but never read by {_reader_names(section)}"


def test_the_audit_catches_an_unread_key():
    @dataclasses.dataclass
    class Probe:
        """A section with one key nobody reads.

        Read by: dpcc_megatron/algo/controller.py.
        """

        tau0: float = 2.0
        surely_nobody_reads_this_key: int = 0

    with pytest.raises(AssertionError, match="surely_nobody_reads_this_key"):
        test_every_key_is_read_by_the_code_its_section_names(Probe)
