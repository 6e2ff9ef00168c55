"""Cheap per-iteration output-quality metrics, computed in the trainer.

The sidecar never imports this module. Pure-python functions take lists (token ids,
strings, floats); the ``*_torch`` variants take tensors and import torch lazily.

- :func:`repetition_stats` / :func:`batch_repetition` / :func:`repetition_stats_torch`:
  repeated 3-/4-gram share (``repetition_rate``) and the longest repeated run
  (``longest_repeat``).
- :func:`language_consistency`: share of letters in the dominant (or expected) script.
- :func:`perplexity` / :func:`perplexity_torch`: from per-token log-probs and a mask.
- :func:`entropy_fraction`, :func:`token_entropy_torch`: exact token entropy and its
  fraction of ln|V|.
- :func:`group_distinct_fraction`: the in-group answer diversity (``answer_distinct_frac``).
- :func:`response_metrics`: all of the above in one record-ready dict.

Definitions. For one sequence and n-gram size n with N >= 1 n-grams, the repeated
n-gram share is ``1 - distinct/N``. ``repetition_rate`` of a sequence is the mean of its
3- and 4-gram shares (sizes it is too short for are left out; sequences shorter than
3 tokens are skipped); a batch's is the mean over its sequences. ``longest_repeat``
is the longest span made of >= 2 consecutive copies of a unit of at most
``max_period`` tokens (a partial last copy counts), 0 when there is none; a batch's is
the max over its sequences. ``"0000000000"`` has repetition_rate 0.866 and
longest_repeat 10.
"""
from __future__ import annotations

import math
import unicodedata
from functools import lru_cache
from typing import Any, Iterable, Optional, Sequence

NGRAM_SIZES = (3, 4)
MAX_PERIOD = 8


# --------------------------------------------------------------------------- repetition
def ngram_repeat_share(tokens: Sequence, n: int) -> Optional[float]:
    """``1 - distinct/total`` over the sequence's n-grams; None when it has fewer than n tokens."""
    total = len(tokens) - n + 1
    if total <= 0:
        return None
    distinct = len({tuple(tokens[i:i + n]) for i in range(total)})
    return 1.0 - distinct / total


def longest_repeat(tokens: Sequence, max_period: int = MAX_PERIOD) -> int:
    """Longest span of >= 2 consecutive copies of a unit of <= ``max_period`` tokens (0 if none)."""
    best = 0
    L = len(tokens)
    for p in range(1, min(max_period, L // 2) + 1):
        run = 0
        for i in range(p, L):
            if tokens[i] == tokens[i - p]:
                run += 1
                if run >= p and run + p > best:
                    best = run + p
            else:
                run = 0
    return best


def repetition_stats(tokens: Sequence, ns: Sequence[int] = NGRAM_SIZES, max_period: int = MAX_PERIOD) -> dict:
    """Per-sequence stats: ``rep_<n>gram`` for each n, ``repetition_rate``, ``longest_repeat``.

    ``tokens`` is a list of token ids or a string (characters are the tokens)."""
    out: dict[str, Any] = {}
    shares = []
    for n in ns:
        s = ngram_repeat_share(tokens, n)
        out[f"rep_{n}gram"] = s
        if s is not None:
            shares.append(s)
    out["repetition_rate"] = sum(shares) / len(shares) if shares else None
    out["longest_repeat"] = longest_repeat(tokens, max_period)
    return out


def batch_repetition(seqs: Iterable[Sequence], ns: Sequence[int] = NGRAM_SIZES,
                     max_period: int = MAX_PERIOD, max_seqs: Optional[int] = None) -> dict:
    """Batch ``repetition_rate`` (mean over sequences long enough) and ``longest_repeat`` (max).

    Pure python costs ~1 us per token and period; for large batches pass ``max_seqs`` (an
    evenly spaced subset is scored) or use :func:`repetition_stats_torch`."""
    if max_seqs is not None:
        seqs = list(seqs)
        if len(seqs) > max_seqs:
            step = len(seqs) / max_seqs
            seqs = [seqs[int(i * step)] for i in range(max_seqs)]
    rates, longest, counted = [], 0, 0
    per_n: dict[int, list] = {n: [] for n in ns}
    for seq in seqs:
        st = repetition_stats(seq, ns, max_period)
        counted += 1
        longest = max(longest, st["longest_repeat"])
        if st["repetition_rate"] is not None:
            rates.append(st["repetition_rate"])
        for n in ns:
            if st[f"rep_{n}gram"] is not None:
                per_n[n].append(st[f"rep_{n}gram"])
    out = {"repetition_rate": sum(rates) / len(rates) if rates else 0.0, "longest_repeat": longest}
    for n in ns:
        out[f"rep_{n}gram"] = sum(per_n[n]) / len(per_n[n]) if per_n[n] else 0.0
    return out


def repetition_stats_torch(tokens: Any, mask: Any = None, ns: Sequence[int] = NGRAM_SIZES,
                           max_period: int = MAX_PERIOD) -> dict:
    """Vectorised :func:`batch_repetition` for a ``[B, T]`` integer tensor and optional
    ``[B, T]`` bool mask of valid tokens (n-grams use only fully valid windows). n-grams are
    hashed into int64 (wrap-around multiply-add), so a collision is possible but negligible."""
    import torch

    x = tokens.long()
    if x.dim() == 1:
        x = x.unsqueeze(0)
        mask = None if mask is None else mask.unsqueeze(0)
    B, T = x.shape
    valid = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.to(torch.bool)
    sentinel = torch.iinfo(torch.int64).min
    out: dict[str, Any] = {}
    rate_sum = torch.zeros(B, dtype=torch.float64, device=x.device)
    rate_cnt = torch.zeros(B, dtype=torch.float64, device=x.device)
    for n in ns:
        if T < n:
            out[f"rep_{n}gram"] = 0.0
            continue
        L = T - n + 1
        h = torch.zeros(B, L, dtype=torch.int64, device=x.device)
        ok = torch.ones(B, L, dtype=torch.bool, device=x.device)
        for k in range(n):
            h = h * 1000003 + x[:, k:k + L] + 1
            ok &= valid[:, k:k + L]
        total = ok.sum(1)
        h = torch.where(ok, h, torch.full_like(h, sentinel))
        s = h.sort(dim=1).values
        distinct = 1 + (s[:, 1:] != s[:, :-1]).sum(1)
        distinct = distinct - (~ok).any(1).long()
        has = total > 0
        share = torch.where(has, 1.0 - distinct.double() / total.clamp(min=1).double(),
                            torch.zeros_like(total, dtype=torch.float64))
        rate_sum += share
        rate_cnt += has.double()
        out[f"rep_{n}gram"] = float(share[has].mean()) if bool(has.any()) else 0.0
    rows = rate_cnt > 0
    out["repetition_rate"] = float((rate_sum[rows] / rate_cnt[rows]).mean()) if bool(rows.any()) else 0.0
    best = torch.zeros(B, dtype=torch.long, device=x.device)
    for p in range(1, min(max_period, T // 2) + 1):
        e = (x[:, p:] == x[:, :-p]) & valid[:, p:] & valid[:, :-p]
        idx = torch.arange(e.shape[1], device=x.device).expand_as(e)
        last_false = torch.where(~e, idx, torch.full_like(idx, -1)).cummax(dim=1).values
        run = (idx - last_false).max(dim=1).values
        best = torch.maximum(best, torch.where(run >= p, run + p, torch.zeros_like(run)))
    out["longest_repeat"] = int(best.max()) if B else 0
    return out


# --------------------------------------------------------------------------- language
_SCRIPT_PREFIXES = (
    ("LATIN", "latin"), ("CYRILLIC", "cyrillic"), ("GREEK", "greek"), ("ARABIC", "arabic"),
    ("HEBREW", "hebrew"), ("DEVANAGARI", "devanagari"), ("THAI", "thai"), ("HANGUL", "hangul"),
    ("HIRAGANA", "hiragana"), ("KATAKANA", "katakana"), ("CJK", "han"), ("BENGALI", "bengali"),
    ("TAMIL", "tamil"), ("ARMENIAN", "armenian"), ("GEORGIAN", "georgian"), ("ETHIOPIC", "ethiopic"),
)


@lru_cache(maxsize=65536)
def char_script(ch: str) -> Optional[str]:
    """Script of a letter (``latin``, ``cyrillic``, ``han``, ...); None for non-letters."""
    if ch.isascii():
        return "latin" if ch.isalpha() else None
    if not ch.isalpha():
        return None
    name = unicodedata.name(ch, "")
    for prefix, script in _SCRIPT_PREFIXES:
        if name.startswith(prefix):
            return script
    return "other"


def script_counts(text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for ch in text:
        s = char_script(ch)
        if s is not None:
            counts[s] = counts.get(s, 0) + 1
    return counts


def language_consistency(texts: Iterable[str], expected: Optional[str | Sequence[str]] = None) -> float:
    """Mean over texts of the share of letters in the expected script(s).

    ``expected`` is a script name or several (Japanese: ``("han", "hiragana", "katakana")``);
    None takes the batch's dominant script. Texts without letters are skipped; 1.0 if none has any."""
    per_text = [script_counts(t) for t in texts]
    if expected is None:
        total: dict[str, int] = {}
        for c in per_text:
            for k, v in c.items():
                total[k] = total.get(k, 0) + v
        if not total:
            return 1.0
        allowed = {max(total, key=total.get)}
    else:
        allowed = {expected} if isinstance(expected, str) else set(expected)
    shares = []
    for c in per_text:
        n = sum(c.values())
        if n:
            shares.append(sum(v for k, v in c.items() if k in allowed) / n)
    return sum(shares) / len(shares) if shares else 1.0


# --------------------------------------------------------------------------- perplexity / entropy
_MAX_LOG_PPL = 700.0  # exp(700) is finite; keeps a diverged policy reporting a huge number, not inf


def perplexity(logprobs: Sequence, mask: Optional[Sequence] = None) -> float:
    """``exp(-mean log p)`` over masked tokens. ``logprobs``: a flat list or a list of
    per-sequence lists; ``mask`` the same shape (truthy = counted). NaN if nothing is counted."""
    total, count = 0.0, 0
    rows = logprobs if logprobs and isinstance(logprobs[0], (list, tuple)) else [logprobs]
    mrows = None if mask is None else (mask if rows is logprobs else [mask])
    for r, row in enumerate(rows):
        mrow = None if mrows is None else mrows[r]
        for i, lp in enumerate(row):
            if mrow is None or mrow[i]:
                total += lp
                count += 1
    if count == 0:
        return math.nan
    return math.exp(min(-total / count, _MAX_LOG_PPL))


def perplexity_torch(logprobs: Any, mask: Any = None) -> float:
    """Tensor variant of :func:`perplexity` (any shape; ``mask`` broadcastable, bool or 0/1)."""
    import torch

    lp = logprobs.detach().double()
    m = torch.ones_like(lp) if mask is None else mask.to(lp.dtype)
    n = float(m.sum())
    if n == 0:
        return math.nan
    nll = float(-(lp * m).sum()) / n
    return math.exp(min(nll, _MAX_LOG_PPL))


def entropy_fraction(entropy: float, vocab_size: int) -> float:
    """Token entropy as a fraction of its maximum ln|V|."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    return float(entropy) / math.log(vocab_size)


def token_entropy_torch(logits: Any, mask: Any = None) -> float:
    """Mean exact entropy (nats) of the softmax over the last dim, over masked positions."""
    import torch

    with torch.no_grad():
        logp = torch.log_softmax(logits.float(), dim=-1)
        ent = -(logp.exp() * logp).sum(-1)
        if mask is None:
            return float(ent.mean())
        m = mask.to(ent.dtype)
        n = float(m.sum())
        return float((ent * m).sum()) / n if n else math.nan


def group_distinct_fraction(seqs: Sequence[Sequence], group_size: int) -> Optional[float]:
    """In-group answer diversity: the mean over groups of ``distinct answers / group_size``.

    ``seqs`` holds whole groups, ``group_size`` consecutive answers each (token-id lists or
    strings). 1.0 when every answer of every group differs; ``1/group_size`` when each group
    gave one answer ``group_size`` times (a template, or a mastered prompt). None for no groups."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    seqs = list(seqs)
    if len(seqs) % group_size:
        raise ValueError(f"{len(seqs)} answers are not whole groups of {group_size}")
    if not seqs:
        return None
    groups = [seqs[i:i + group_size] for i in range(0, len(seqs), group_size)]
    return sum(len({tuple(a) for a in g}) for g in groups) / (len(groups) * group_size)


def response_metrics(token_seqs: Optional[Iterable[Sequence]] = None, texts: Optional[Iterable[str]] = None,
                     logprobs: Optional[Sequence] = None, mask: Optional[Sequence] = None,
                     expected_script: Optional[str | Sequence[str]] = None, entropy: Optional[float] = None,
                     vocab_size: Optional[int] = None) -> dict:
    """Record-ready dict of whatever of the output-quality metrics the inputs allow:
    ``repetition_rate``/``longest_repeat`` (from token ids, else from texts),
    ``language_consistency`` (texts), ``perplexity`` (logprobs), ``entropy_frac``."""
    out: dict[str, Any] = {}
    texts = list(texts) if texts is not None else None
    seqs = token_seqs if token_seqs is not None else texts
    if seqs is not None:
        rep = batch_repetition(seqs)
        out["repetition_rate"] = rep["repetition_rate"]
        out["longest_repeat"] = rep["longest_repeat"]
    if texts is not None:
        out["language_consistency"] = language_consistency(texts, expected_script)
    if logprobs is not None:
        out["perplexity"] = perplexity(logprobs, mask)
    if entropy is not None:
        out["entropy"] = float(entropy)
        if vocab_size is not None:
            out["entropy_frac"] = entropy_fraction(entropy, vocab_size)
    return out
