"""The remote backend against a SandboxFusion stand-in on 127.0.0.1 (tests/rewards/fake_sandbox_fusion.py):
same verdicts as the local backend, retries, a bounded queue, counted skips and a stop after N failures."""
import threading

import pytest

from dpcc_megatron.config.reward import RemoteSandboxConfig, RewardConfig, SandboxConfig
from dpcc_megatron.rewards import DualTrackReward
from dpcc_megatron.rewards.sandbox import SandboxLimits, SandboxStop, SandboxUnavailable, build_sandbox

from .conftest import S
from .fake_sandbox_fusion import FakeSandboxFusion

ADD = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(2, 2) == 4\n"


def _remote(url, **kw) -> SandboxLimits:
    settings = dict(url=url, request_timeout_s=10.0, retries=1, max_in_flight=2, max_queue=8, max_failures=3)
    settings.update(kw)
    return SandboxLimits(timeout_s=10.0, memory_mb=512, backend="remote", remote=RemoteSandboxConfig(**settings))


@pytest.fixture
def service():
    with FakeSandboxFusion() as s:
        yield s


def test_verdicts_match_the_local_backend(service):
    remote, local = build_sandbox(_remote(service.url)), build_sandbox(SandboxLimits(timeout_s=10.0, memory_mb=512))
    cases = [(ADD, TESTS, False), (ADD.replace("+", "-"), TESTS, True),
             ("class E:\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n    return E()\n", TESTS, False),
             ("import sys\ndef add(a, b):\n    sys._getframe(1).f_locals['report'](3, 3)\n", TESTS, False),
             ("class S:\n    def __init__(self):\n        self.v = []\n    def push(self, x):\n        self.v.append(x)\n"
              "    def top(self):\n        return self.v[-1]\n",
              "s = S()\ns.push(1)\nassert s.top() == 1\ns.push(2)\nassert s.top() == 2\n", False)]
    for code, tests, partial in cases:
        got, want = remote.run_tests(code, tests, partial), local.run_tests(code, tests, partial)
        assert (got["passed"], got["total"]) == (want["passed"], want["total"]), (code, got, want)
    assert remote.run_tests(ADD, TESTS)["passed"] == 3
    req = service.requests[-1]  # SandboxFusion's RunCodeRequest fields
    assert req["language"] == "python" and req["run_timeout"] == 10.0 and req["memory_limit_MB"] == 512
    assert set(req) >= {"code", "stdin", "compile_timeout", "files", "fetch_files"}
    # independent asserts need two rounds (the solution, then all three calls at once), not one per call
    before = len(service.requests)
    remote.run_tests(ADD, TESTS)
    assert len(service.requests) - before == 2


def test_timeout_on_the_service_is_a_timeout(service):
    limits = _remote(service.url)
    limits = SandboxLimits(timeout_s=1.0, memory_mb=512, backend="remote", remote=limits.remote)
    verdict = build_sandbox(limits).run_tests("import time\ntime.sleep(30)\n", TESTS)
    assert verdict["timed_out"] and verdict["passed"] == 0


def test_failures_are_retried_then_skipped_and_counted_then_stop(service):
    sandbox = build_sandbox(_remote(service.url, max_failures=2))
    service.fail_next = 1  # one HTTP 500, then the retry succeeds
    assert sandbox.run_tests(ADD, TESTS)["passed"] == 3
    assert sandbox.counts["retries"] == 1 and sandbox.failures_in_a_row == 0
    service.sandbox_error_next = 2  # SandboxError twice: both tries of one run fail -> a skip
    with pytest.raises(SandboxUnavailable):
        sandbox.run_tests(ADD, TESTS)
    service.fail_next = 2
    with pytest.raises(SandboxStop, match="max_failures 2"):  # the second failed run in a row stops
        sandbox.run_tests(ADD, TESTS)


def test_unreachable_service_skips_are_counted_by_the_reward(service):
    cfg = RewardConfig(sandbox=SandboxConfig(timeout_s=5, memory_mb=512, workers=2, backend="remote",
                                             remote=RemoteSandboxConfig(url="http://127.0.0.1:9", retries=0,
                                                                        request_timeout_s=2, max_failures=10)))
    samples = [S(ADD, task="code", tests=TESTS, prompt=f"q{i}") for i in range(3)]
    with DualTrackReward(cfg) as reward:
        result = reward.score(samples)
    assert result.checker_scores["code"] == [None] * 3  # never a silent score
    assert result.metrics["reward/checker_skips"] == 3.0
    cfg.sandbox.remote.max_failures = 2
    with DualTrackReward(cfg) as reward, pytest.raises(SandboxStop):
        reward.score(samples)


def test_the_queue_is_bounded(service):
    service.delay_s = 0.5
    sandbox = build_sandbox(_remote(service.url, max_in_flight=1, max_queue=1, max_failures=100))
    results = []

    def run():
        try:
            results.append(sandbox.run_tests(ADD, "assert add(1, 2) == 3\n")["passed"])
        except SandboxUnavailable as e:
            results.append(str(e))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert service.max_in_flight == 1
    assert sum(r == 1 for r in results) >= 2 and any("queue full" in str(r) for r in results)
    assert sandbox.counts["queue_full"] >= 1
