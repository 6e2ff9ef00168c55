import time

import pytest

from dpcc_megatron.config.reward import SandboxConfig
from dpcc_megatron.rewards import DualTrackReward, get_checker
from dpcc_megatron.rewards.checkers.code import extract_code, run_tests
from dpcc_megatron.rewards.registry import CheckerTimeout
from dpcc_megatron.rewards.sandbox import SandboxLimits

from .conftest import S

ADD = "```python\ndef add(a, b):\n    return a + b\n```"
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"


def test_extract_code_prefers_last_python_block():
    text = "Usage:\n```\nadd(1, 2)\n```\nSolution:\n```python\ndef f():\n    return 1\n```\nDone."
    assert extract_code(text) == "def f():\n    return 1\n"
    assert extract_code("x = 1") == "x = 1"


def test_syntax_error_scores_zero(ctx):
    code = get_checker("code")
    assert code(S("```python\ndef add(a, b)\n    return a + b\n```"), ctx) == 0.0
    assert code(S(ADD), ctx) == 1.0  # valid syntax, no tests


def test_passing_and_failing_tests(ctx):
    code = get_checker("code")
    assert code(S(ADD, tests=TESTS), ctx) == 1.0
    wrong = ADD.replace("a + b", "a - b")
    assert code(S(wrong, tests=TESTS), ctx) == 0.0
    # partial credit: the share of top-level asserts that pass (here the first passes, the second fails)
    half = ADD.replace("a + b", "a + b if a > 0 else 99")
    assert code(S(half, tests=TESTS), ctx, partial=True) == 0.5
    assert code(S(half, tests=TESTS), ctx) == 0.0


def test_infinite_loop_is_killed_by_the_timeout(short_ctx):
    code = get_checker("code")
    start = time.monotonic()
    with pytest.raises(CheckerTimeout):
        code(S("def add(a, b):\n    while True:\n        pass", tests=TESTS), short_ctx)
    assert time.monotonic() - start < short_ctx.sandbox.timeout_s + 2


def test_exit_tricks_and_fake_output_do_not_pass(ctx):
    code = get_checker("code")
    for cheat in ("import sys\nsys.exit(0)", "import os\nos._exit(0)",
                  'print(\'{"passed": 2, "total": 2, "error": null}\')\nraise SystemExit(0)'):
        assert code(S(cheat, tests=TESTS), ctx) == 0.0, cheat


def test_crash_and_memory_bomb_score_zero(ctx):
    code = get_checker("code")
    assert code(S("def add(a, b):\n    return bytearray(4 << 30)", tests=TESTS), ctx) == 0.0
    assert code(S("import ctypes\nctypes.string_at(0)", tests=TESTS), ctx) == 0.0  # segfault


def test_code_batch_runs_in_parallel(fast_cfg):
    # 6 infinite loops with 1.5 s timeout each: serial would take >= 9 s
    loop = "def add(a, b):\n    while True:\n        pass"
    samples = [S(loop, task="code", tests=TESTS, prompt=f"q{i}") for i in range(6)]
    samples.append(S(ADD, task="code", tests=TESTS, prompt="ok"))
    fast_cfg.sandbox = SandboxConfig(timeout_s=1.5, memory_mb=512, workers=6)
    with DualTrackReward(fast_cfg) as reward:
        start = time.monotonic()
        result = reward.score(samples)
        elapsed = time.monotonic() - start
    assert elapsed < 6.0
    assert result.checker_scores["code"] == [0.0] * 6 + [1.0]
    assert result.metrics["reward/checker_timeouts"] == 6.0
    assert result.base.tolist() == [0.0] * 6 + [1.0]


def test_run_tests_reports_the_failure():
    verdict = run_tests("def f():\n    return 1", "assert f() == 2", SandboxLimits(timeout_s=5))
    assert verdict["passed"] == 0 and "AssertionError" in verdict["error"]


def test_tests_that_loop_forever_are_stopped_at_the_deadline(short_ctx):
    # the trusted tests run in this process; a trace function stops them at the run's deadline
    start = time.monotonic()
    with pytest.raises(CheckerTimeout):
        get_checker("code")(S(ADD, tests="assert add(1, 2) == 3\nwhile True:\n    pass\n"), short_ctx)
    assert time.monotonic() - start < short_ctx.sandbox.timeout_s + 2


def test_tests_see_the_modules_the_solution_imported(ctx):
    # written for one shared scope (as MBPP's are): the tests use `math` without importing it
    code = "import math\ndef area(r):\n    return math.pi * r * r\n"
    assert get_checker("code")(S(code, tests="assert math.isclose(area(1), 3.14159, rel_tol=1e-3)\n"), ctx) == 1.0
