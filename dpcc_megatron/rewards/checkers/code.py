"""``code``: Python code extracted from the response, syntax-checked, unit tests run against it.

Score: 0 for a syntax error; 1 for valid syntax when the sample has no tests;
with tests, 1 if the code loads and every top-level test statement runs without
an exception (or, with ``partial``, the share of top-level asserts / expressions
that pass). A timeout raises :class:`CheckerTimeout`; a failure of the sandbox
itself (not of the code) raises :class:`CheckerSkipped`: both are counted.

The code runs in the isolated sandbox (:mod:`dpcc_megatron.rewards.sandbox`);
the tests run in the trusted process and call the code over a plain-data
channel, so the code under test cannot forge its verdict (docs/sandbox.md).
"""
from __future__ import annotations

import ast
import re
from typing import Optional

from ..registry import CheckerSkipped, CheckerTimeout, register_checker
from ..sandbox import SandboxLimits, SandboxUnavailable, build_sandbox

_FENCE_RE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last ```python block, else the last fenced block, else the whole response."""
    blocks = _FENCE_RE.findall(text)
    if not blocks:
        return text
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    return (python or [body for _, body in blocks])[-1]


def run_tests(code: str, tests: str, sandbox, partial: bool = False) -> dict:
    """Run ``tests`` against ``code``; ``sandbox`` is a backend or :class:`SandboxLimits`.
    Returns ``{passed, total, error, timed_out}``."""
    if isinstance(sandbox, SandboxLimits):
        sandbox = build_sandbox(sandbox)
    return sandbox.run_tests(code, tests, partial=partial)


@register_checker("code", sandboxed=True)
def check_code(sample, ctx, *, run: bool = True, partial: bool = False) -> Optional[float]:
    """Syntax via ``ast.parse``; the sample's ``tests`` (if any, and ``run``) against the sandboxed code."""
    code = extract_code(sample.response)
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):  # ValueError: null bytes
        return 0.0
    if not run or not sample.tests:
        return 1.0
    try:
        verdict = run_tests(code, sample.tests, ctx.sandbox, partial=partial)
    except SandboxUnavailable as e:
        raise CheckerSkipped(str(e)) from None
    if verdict["timed_out"]:
        raise CheckerTimeout(f"code tests exceeded the sandbox time limit ({verdict['error']})")
    return verdict["passed"] / verdict["total"]
