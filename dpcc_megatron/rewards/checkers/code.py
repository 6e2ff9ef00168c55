"""``code``: Python code extracted from the response, syntax-checked, unit tests run in the sandbox.

Score: 0 for a syntax error; 1 for valid syntax when the sample has no tests;
with tests, 1 if the code and all tests run without an exception (or, with
``partial``, the share of top-level test statements that pass). A timeout or
crash scores 0. The run never happens in the trainer process.

The harness reads a random nonce from stdin before running the solution and
reports its verdict on a private copy of stdout prefixed with that nonce, with
the solution's own stdout sent to /dev/null. ``sys.exit(0)``, ``os._exit`` or
printing a fake verdict therefore fail. This guards against cheap reward hacks,
not against code that deliberately inspects the harness's frames.
"""
from __future__ import annotations

import ast
import json
import re
import secrets
from typing import Optional

from ..registry import CheckerTimeout, register_checker
from ..sandbox import SandboxLimits, run_python

_FENCE_RE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)

_HARNESS = r'''
import ast, json, os, sys

def _main():
    nonce = sys.stdin.readline().strip()
    chan = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # the solution's prints go nowhere; only the harness writes to `chan`

    def report(passed, total, error=None):
        chan.write(nonce + json.dumps({"passed": passed, "total": total, "error": error}) + "\n")
        chan.flush()
        os._exit(0)

    def describe(e):
        return (type(e).__name__ + ": " + str(e))[:300]

    with open("solution.py", encoding="utf-8") as f:
        solution = f.read()
    with open("tests.py", encoding="utf-8") as f:
        tests = f.read()
    partial = os.path.exists("partial")
    try:
        test_tree = ast.parse(tests)
    except SyntaxError as e:
        report(0, 1, "tests: " + describe(e))
    checks = [isinstance(s, (ast.Assert, ast.Expr)) for s in test_tree.body]
    total = max(1, sum(checks))
    scope = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(solution, "solution.py", "exec"), scope)
    except BaseException as e:  # SystemExit included: exiting early is a failure
        report(0, total, "solution: " + describe(e))
    if not partial:
        try:
            exec(compile(test_tree, "tests.py", "exec"), scope)
        except BaseException as e:
            report(0, total, "tests: " + describe(e))
        report(total, total)
    passed, first_error = 0, None
    for stmt, is_check in zip(test_tree.body, checks):
        try:
            exec(compile(ast.Module(body=[stmt], type_ignores=[]), "tests.py", "exec"), scope)
            passed += is_check
        except BaseException as e:
            first_error = first_error or "tests line %d: %s" % (stmt.lineno, describe(e))
    report(passed, total, first_error)

_main()
'''


def extract_code(text: str) -> str:
    """The last ```python block, else the last fenced block, else the whole response."""
    blocks = _FENCE_RE.findall(text)
    if not blocks:
        return text
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    return (python or [body for _, body in blocks])[-1]


def run_tests(code: str, tests: str, limits: SandboxLimits, partial: bool = False) -> dict:
    """Run ``code`` then ``tests`` in the sandbox; returns passed/total/error/timed_out."""
    nonce = secrets.token_hex(16)
    files = {"solution.py": code, "tests.py": tests}
    if partial:
        files["partial"] = ""
    result = run_python(_HARNESS, limits, stdin=nonce + "\n", files=files)
    for line in result.stdout.splitlines():
        if line.startswith(nonce):
            verdict = json.loads(line[len(nonce):])
            verdict["timed_out"] = False
            return verdict
    error = "timeout" if result.timed_out else f"crashed (exit {result.returncode}): {result.stderr[-300:]}"
    return {"passed": 0, "total": 1, "error": error, "timed_out": result.timed_out}


@register_checker("code", sandboxed=True)
def check_code(sample, ctx, *, run: bool = True, partial: bool = False) -> Optional[float]:
    """Syntax via ``ast.parse``; the sample's ``tests`` (if any, and ``run``) in the sandbox."""
    code = extract_code(sample.response)
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):  # ValueError: null bytes
        return 0.0
    if not run or not sample.tests:
        return 1.0
    verdict = run_tests(code, sample.tests, ctx.sandbox, partial=partial)
    if verdict["timed_out"]:
        raise CheckerTimeout(f"code tests exceeded {ctx.sandbox.timeout_s:g}s")
    return verdict["passed"] / verdict["total"]
