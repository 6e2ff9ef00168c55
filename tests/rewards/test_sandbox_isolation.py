"""Start-up checks of the sandbox: refuse without isolation (naming reward.sandbox.isolation), warn on
`none`, and the reward.sandbox keys' validation."""
import logging

import pytest

from dpcc_megatron.config import ConfigError, load_config
from dpcc_megatron.config.reward import RewardConfig, SandboxConfig
from dpcc_megatron.rewards import DualTrackReward
from dpcc_megatron.rewards import sandbox as sandbox_pkg
from dpcc_megatron.rewards.sandbox import SandboxLimits, build_sandbox, isolation

from .conftest import S

ADD = "def add(a, b):\n    return a + b\n"


@pytest.fixture
def no_tools(monkeypatch, tmp_path):
    """A host where neither bwrap nor unshare can be found."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sandbox_pkg, "_BUILT", {})
    isolation.probe.cache_clear()
    yield
    isolation.probe.cache_clear()


def test_auto_finds_isolation_here():
    mode = isolation.resolve("auto")
    assert mode in ("bwrap", "namespaces")
    assert mode == isolation.auto_order()[0]  # both work here: auto takes its first choice


def test_auto_prefers_namespaces_where_the_pid_namespace_bounds_threads():
    assert isolation.pid_namespace_bounds_threads("6.14.0") and isolation.pid_namespace_bounds_threads("6.18.44-x")
    assert not isolation.pid_namespace_bounds_threads("6.13.9") and not isolation.pid_namespace_bounds_threads("5.15.0")
    assert isolation.probe("namespaces") == ""  # util-linux unshare and user namespaces work on this host


def test_refuses_without_isolation_and_names_the_key(no_tools):
    for mode in ("auto", "bwrap", "namespaces"):
        with pytest.raises(ConfigError, match="reward.sandbox.isolation") as e:
            build_sandbox(SandboxLimits(isolation=mode))
        assert "isolation: none" in str(e.value)
    with pytest.raises(ConfigError, match="apt-get install -y bubblewrap"):
        build_sandbox(SandboxLimits(isolation="bwrap"))


def test_a_job_with_code_rewards_stops_and_one_without_does_not(no_tools):
    cfg = RewardConfig(sandbox=SandboxConfig(timeout_s=5, memory_mb=512))
    with DualTrackReward(cfg) as reward:
        reward.base_layer.check_sandbox({"math", "addition"})  # no code task in the data: fine
        with pytest.raises(ConfigError, match="reward.sandbox.isolation"):
            reward.base_layer.check_sandbox({"math", "code"})
        with pytest.raises(ConfigError, match="reward.sandbox.isolation"):  # and at the first code run
            reward.score([S("```python\n" + ADD + "```", task="code", tests="assert add(1, 2) == 3\n")])


def test_none_runs_and_warns_at_every_start(no_tools, caplog):
    cfg = RewardConfig(sandbox=SandboxConfig(timeout_s=10, memory_mb=512, isolation="none"))
    for _ in range(2):
        sandbox_pkg._BUILT.clear()
        with caplog.at_level(logging.WARNING), DualTrackReward(cfg) as reward:
            reward.base_layer.check_sandbox({"code"})
            result = reward.score([S("```python\n" + ADD + "```", task="code", tests="assert add(1, 2) == 3\n")])
        assert result.checker_scores["code"] == [1.0]
    assert sum("reward.sandbox.isolation is none" in r.getMessage() for r in caplog.records) == 2


def test_seccomp_filter_is_well_formed():
    program = isolation.seccomp_program()
    if program is None:
        pytest.skip("the seccomp filter is built for x86-64 only")
    assert len(program) % 8 == 0 and len(program) // 8 < 4096


@pytest.mark.parametrize("override,msg", [
    ("reward.sandbox.isolation=docker", "reward.sandbox.isolation must be one of"),
    ("reward.sandbox.backend=remote", "reward.sandbox.remote.url must be set when backend is remote"),
    ("reward.sandbox.backend=k8s", "reward.sandbox.backend must be one of"),
    ("reward.sandbox.scratch_mb=0", "reward.sandbox.scratch_mb must be >= 1"),
    ("reward.sandbox.remote.url=sandbox:8080", "reward.sandbox.remote.url must be an http(s) URL"),
    ("reward.sandbox.remote.max_in_flight=0", "reward.sandbox.remote.max_in_flight must be >= 1"),
    ("reward.sandbox.remote.max_failures=0", "reward.sandbox.remote.max_failures must be >= 1"),
    ("reward.sandbox.remote.retries=-1", "reward.sandbox.remote.retries must be >= 0"),
    ("reward.sandbox.remote.max_queue=-1", "reward.sandbox.remote.max_queue must be >= 0"),
    ("reward.sandbox.remote.request_timeout_s=0", "reward.sandbox.remote.request_timeout_s must be > 0"),
])
def test_sandbox_keys_are_validated(override, msg):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert msg in str(e.value)


def test_sandbox_keys_reach_the_limits():
    cfg = load_config(overrides=["reward.sandbox.isolation=namespaces", "reward.sandbox.scratch_mb=8",
                                 "reward.sandbox.backend=remote", "reward.sandbox.remote.url=http://sb:8080",
                                 "reward.sandbox.remote.max_queue=3"]).reward.sandbox
    limits = SandboxLimits.from_config(cfg)
    assert (limits.isolation, limits.scratch_mb, limits.backend) == ("namespaces", 8, "remote")
    assert (limits.remote.url, limits.remote.max_queue) == ("http://sb:8080", 3)


def test_a_sandbox_that_fails_to_start_is_a_counted_skip(monkeypatch):
    cfg = RewardConfig(sandbox=SandboxConfig(timeout_s=10, memory_mb=512, scratch_mb=7))  # its own sandbox
    build_sandbox(SandboxLimits.from_config(cfg.sandbox))  # isolation found; then its launcher breaks
    real = isolation.command
    monkeypatch.setattr(isolation, "command", lambda mode, *a: [real(mode, *a)[0], "--no-such-option"])
    with DualTrackReward(cfg) as reward:
        result = reward.score([S("```python\n" + ADD + "```", task="code", tests="assert add(1, 2) == 3\n")])
    assert result.checker_scores["code"] == [None] and result.metrics["reward/checker_skips"] == 1.0
    assert "did not start" in result.messages[0]


def test_the_namespaces_mode_runs_a_python_whose_environment_is_under_tmp():
    """The sandbox root's tmpfs must not hide the runtime it binds (a checkout and its venv under /tmp)."""
    import shutil
    import subprocess
    import sys
    import tempfile

    d = tempfile.mkdtemp(dir="/tmp", prefix="dpcc-sandbox-venv-")
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", d + "/venv"], check=True, timeout=120)
        assert isolation.probe("namespaces", d + "/venv/bin/python") == ""
    finally:
        shutil.rmtree(d, ignore_errors=True)
