"""``math``: final-answer correctness with equivalence (``1/2 == 0.5 == \\frac{1}{2}``, ``2x+2 == 2(x+1)``).

The answer is taken from the last ``\\boxed{}``, else from ``#### x``, else it is
the last number in the response. Plain numbers (integers, decimals, ``a/b``)
are compared exactly with :class:`fractions.Fraction` and never touch sympy, so
the synthetic addition task costs microseconds per sample. Everything else is
normalised from LaTeX, checked against a token whitelist (sympy's parser
evaluates Python, so nothing else may reach it), size-capped so huge powers
cannot stall the trainer, and compared by expansion plus numeric probing.
"""
from __future__ import annotations

import functools
import random
import re
from fractions import Fraction
from typing import Optional

from ..registry import register_checker

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+"
_LAST_NUMBER_RE = re.compile(_NUMBER)
_PLAIN_NUMBER_RE = re.compile(rf"\s*\$?\s*({_NUMBER})\s*(\\?%)?\s*\.?\s*")
_HASHES_RE = re.compile(r"####\s*(.+)")
_MAX_EXPR_CHARS = 200


def _boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} / \\fbox{...} (balanced braces)."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        m = re.match(r"\\boxed\s+(\S+)", text[start:])  # \boxed 5
        return m.group(1) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


def extract_answer(text: str, last_number: bool = True) -> Optional[str]:
    """The final answer of ``text``: \\boxed{} > ``#### x`` > last number (if ``last_number``)."""
    text = text.replace("\u2212", "-")  # unicode minus
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    hashes = _HASHES_RE.findall(text)
    if hashes:
        return hashes[-1].strip()
    if last_number:
        nums = _LAST_NUMBER_RE.findall(text)
        if nums:
            return nums[-1].strip()
    return None


def _plain_number(s: str) -> Optional[Fraction]:
    m = _PLAIN_NUMBER_RE.fullmatch(s)
    if not m:
        return None
    value = Fraction(m.group(1).replace(",", "").replace(" ", ""))
    return value / 100 if m.group(2) else value


_LATEX_SUBS = [
    (re.compile(r"\\(?:left|right|displaystyle|,|;|!|quad|qquad)"), ""),
    (re.compile(r"\\text\{[^{}]*\}|\\mathrm\{[^{}]*\}|\^\{?\\circ\}?|\\%|%|\\\$|\$"), ""),
    (re.compile(r"\\[dt]frac"), r"\\frac"),
    (re.compile(r"\\(?:cdot|times)"), "*"),
    (re.compile(r"\\div"), "/"),
]
_FRAC_RE = re.compile(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_SHORT_RE = re.compile(r"\\frac\s*(\d)\s*(\d)")
_SQRT_RE = re.compile(r"\\sqrt\s*\{([^{}]*)\}")
_FUNCS = {"sqrt", "sin", "cos", "tan", "log", "ln", "exp", "pi"}
_IDENT_RE = re.compile(r"[A-Za-z]+")
_ALLOWED_RE = re.compile(r"[0-9A-Za-z+\-*/^().,\s]*")
_ATTRIBUTE_RE = re.compile(r"[A-Za-z)]\s*\.|\.\s*[A-Za-z(]")  # "." only inside numbers: no attribute access


def _latex_to_plain(s: str) -> Optional[str]:
    """LaTeX-ish answer -> whitelisted infix string, or None if it has anything else."""
    s = s.strip().rstrip(".")
    m = re.fullmatch(r"[A-Za-z]\s*=\s*(.+)", s)  # "x = 3" -> "3"
    if m:
        s = m.group(1)
    for pattern, repl in _LATEX_SUBS:
        s = pattern.sub(repl, s)
    for _ in range(5):  # nested fractions / roots, innermost first
        s2 = _SQRT_RE.sub(r"sqrt(\1)", _FRAC_RE.sub(r"((\1)/(\2))", _FRAC_SHORT_RE.sub(r"((\1)/(\2))", s)))
        if s2 == s:
            break
        s = s2
    s = s.replace("\\pi", " pi ").replace("{", "(").replace("}", ")").replace("\\", " ")
    if len(s) > _MAX_EXPR_CHARS or not _ALLOWED_RE.fullmatch(s) or _ATTRIBUTE_RE.search(s):
        return None
    # Unknown multi-letter words become products of single-letter symbols ("xy" -> "x*y").
    return _IDENT_RE.sub(lambda w: w.group(0) if w.group(0) in _FUNCS else "*".join(w.group(0)), s)


@functools.lru_cache(maxsize=4096)
def _sympy_expr(plain: str):
    import sympy
    from sympy.parsing.sympy_parser import (convert_xor, implicit_multiplication_application, parse_expr,
                                            standard_transformations)

    transforms = standard_transformations + (implicit_multiplication_application, convert_xor)
    local = {"ln": sympy.log, "pi": sympy.pi}
    raw = parse_expr(plain, local_dict=local, transformations=transforms, evaluate=False)
    for node in sympy.preorder_traversal(raw):  # refuse 9^9^9 and friends before evaluating
        if isinstance(node, sympy.Pow):
            exp = node.exp
            if exp.has(sympy.Pow) or (exp.is_Number and abs(float(exp)) > 64):
                raise ValueError(f"power too large in {plain!r}")
    return parse_expr(plain, local_dict=local, transformations=transforms)


def _split_top_level(s: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in s:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def _sympy_equal(a: str, b: str) -> bool:
    ea, eb = _sympy_expr(a), _sympy_expr(b)
    if isinstance(ea, tuple) or isinstance(eb, tuple):
        return isinstance(ea, tuple) and isinstance(eb, tuple) and len(ea) == len(eb) and all(
            _expr_equal(x, y) for x, y in zip(ea, eb))
    return _expr_equal(ea, eb)


def _expr_equal(ea, eb) -> bool:
    import sympy

    diff = ea - eb
    if diff == 0 or sympy.expand(diff) == 0:
        return True
    symbols = sorted(diff.free_symbols, key=str)
    rng = random.Random(0)  # deterministic probes: the same pair always gets the same verdict
    for _ in range(4):
        point = {s: sympy.Float(rng.uniform(0.5, 2.5)) for s in symbols}
        try:
            val = complex(diff.evalf(subs=point))
            scale = max(1.0, abs(complex(ea.evalf(subs=point))))
        except (TypeError, ValueError, ZeroDivisionError):
            return False
        if abs(val) > 1e-8 * scale:
            return False
    return True


def answers_equal(pred: str, ref: str) -> bool:
    """Whether two final answers are mathematically equal (never raises on bad input)."""
    pred, ref = pred.replace("\u2212", "-"), ref.replace("\u2212", "-")
    if pred.strip() == ref.strip():
        return True
    pa, pb = _plain_number(pred), _plain_number(ref)
    if pa is not None and pb is not None:
        return pa == pb
    a, b = _latex_to_plain(pred), _latex_to_plain(ref)
    if a is None or b is None or not a.strip() or not b.strip():
        return False
    if a.replace(" ", "") == b.replace(" ", ""):
        return True
    try:
        return _sympy_equal(a, b)
    except Exception:  # unparsable or refused: not equal
        return False


@register_checker("math")
def check_math(sample, ctx, *, last_number: bool = True) -> Optional[float]:
    """1 if the response's final answer equals ``sample.answer`` (None when there is no reference)."""
    if sample.answer is None:
        return None
    ref = extract_answer(sample.answer, last_number=False) or sample.answer.strip()
    pred = extract_answer(sample.response, last_number=last_number)
    if pred is None:
        return 0.0
    return 1.0 if answers_equal(pred, ref) else 0.0
