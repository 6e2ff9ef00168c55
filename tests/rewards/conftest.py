"""Shared helpers for the reward-layer tests."""
from __future__ import annotations

import pytest

from dpcc_megatron.config.reward import RewardConfig, SandboxConfig
from dpcc_megatron.rewards import Sample
from dpcc_megatron.rewards.registry import CheckContext
from dpcc_megatron.rewards.sandbox import SandboxLimits


@pytest.fixture
def ctx() -> CheckContext:
    """A sandbox whose timeout a correct program never meets, even on a loaded 2-core machine (a test
    of the timeout itself uses :func:`short_ctx`)."""
    return CheckContext(sandbox=SandboxLimits(timeout_s=20.0, memory_mb=512))


@pytest.fixture
def short_ctx() -> CheckContext:
    """A 1.5 s sandbox timeout, for the tests that run into it on purpose."""
    return CheckContext(sandbox=SandboxLimits(timeout_s=1.5, memory_mb=512))


@pytest.fixture
def fast_cfg() -> RewardConfig:
    """Defaults with a short sandbox timeout."""
    return RewardConfig(sandbox=SandboxConfig(timeout_s=1.5, memory_mb=512, workers=4))


def S(response: str, **kw) -> Sample:
    kw.setdefault("prompt", "p")
    return Sample(response=response, **kw)
