"""Penalty checkers (return a penalty in [0, 1]; the base layer subtracts weight * penalty).

``overlong``: DAPO's soft overlong punishment: 0 up to ``max_length - buffer``
tokens, rising linearly to 1 at ``max_length`` and staying 1 beyond it.
``repetition``: share of repeated n-grams above a tolerated ``threshold``,
rescaled to [0, 1], so a degenerate loop gets the full penalty.
Lengths and n-grams use ``response_ids`` when the trainer passes them.
"""
from __future__ import annotations

from typing import Optional

from ..registry import register_checker
from ..text import repeated_ngram_share, response_tokens


def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    if max_length <= 0:
        return 0.0
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length >= max_length or buffer == 0:
        return 1.0
    return (length - start) / buffer


@register_checker("overlong", kind="penalty")
def check_overlong(sample, ctx, *, max_length: int = 0, buffer: int = 0) -> Optional[float]:
    if max_length <= 0:
        return None
    return overlong_penalty(len(response_tokens(sample.response, sample.response_ids)), max_length, buffer)


@register_checker("repetition", kind="penalty")
def check_repetition(sample, ctx, *, n: int = 4, threshold: float = 0.2) -> Optional[float]:
    if n <= 0:
        return None
    share = repeated_ngram_share(response_tokens(sample.response, sample.response_ids), n)
    return max(0.0, share - threshold) / (1.0 - threshold)
