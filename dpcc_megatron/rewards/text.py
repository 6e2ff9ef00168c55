"""Cheap text features shared by checkers and the deterministic judge."""
from __future__ import annotations

import re
from typing import Optional, Sequence

# CJK ideographs, kana, hangul: one token per character (no spaces between words).
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_TOKEN_RE = re.compile(rf"[{_CJK}]|[^\W{_CJK}]+|[^\w\s]")


def word_tokens(text: str) -> list[str]:
    """Words, numbers, punctuation marks and single CJK characters."""
    return _TOKEN_RE.findall(text)


def response_tokens(response: str, response_ids: Optional[Sequence[int]]) -> Sequence:
    """Token ids when the trainer passed them, else word tokens."""
    return response_ids if response_ids is not None else word_tokens(response)


def repeated_ngram_share(tokens: Sequence, n: int) -> float:
    """Share of n-grams that repeat an earlier one: 0 for fresh text, -> 1 for a loop."""
    total = len(tokens) - n + 1
    if n <= 0 or total <= 1:
        return 0.0
    seen = {tuple(tokens[i:i + n]) for i in range(total)}
    return 1.0 - len(seen) / total
