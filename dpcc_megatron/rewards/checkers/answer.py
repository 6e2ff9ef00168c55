"""``exact`` (normalised string match) and ``sequence`` (ordered list match, e.g. the sorting task)."""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

from ..registry import register_checker
from .math import extract_answer

_INT_RE = re.compile(r"-?\d+(?:\.\d+)?")
_SPLIT_RE = re.compile(r"[\s,;]+")


def _final_region(text: str) -> str:
    """\\boxed{} / ``#### x`` when present, else the last non-empty line."""
    found = extract_answer(text, last_number=False)
    if found is not None:
        return found
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


@register_checker("exact")
def check_exact(sample, ctx, *, case_sensitive: bool = False, extract: bool = True) -> Optional[float]:
    """1 if the (extracted) response equals ``sample.answer`` up to whitespace, a final period and case."""
    if sample.answer is None:
        return None

    def norm(s: str) -> str:
        s = " ".join(s.split()).rstrip(".").strip()
        return s if case_sensitive else s.casefold()

    pred = _final_region(sample.response) if extract else sample.response
    return 1.0 if norm(pred) == norm(_final_region(sample.answer)) else 0.0


def _items(text: str, numeric: bool) -> list[str]:
    if numeric:
        return _INT_RE.findall(text)
    return [t for t in _SPLIT_RE.split(text.strip()) if t]


@register_checker("sequence")
def check_sequence(sample, ctx, *, partial: bool = False) -> Optional[float]:
    """1 if the response lists the answer's items in order (numbers or separator-split tokens).

    With ``partial`` the score is the share of positions that match (over the longer list).
    """
    if sample.answer is None:
        return None
    ref_text = _final_region(sample.answer)
    numeric = bool(_INT_RE.fullmatch(_SPLIT_RE.sub("", ref_text.replace("-", ""))) or not ref_text)
    ref = _items(ref_text, numeric)
    pred = _items(_final_region(sample.response), numeric)
    if numeric:
        ref, pred = [Fraction(x) for x in ref], [Fraction(x) for x in pred]
    if pred == ref:
        return 1.0
    if not partial or not ref:
        return 0.0
    hits = sum(a == b for a, b in zip(pred, ref))
    return hits / max(len(pred), len(ref))
