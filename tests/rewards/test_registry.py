import pytest

from dpcc_megatron.config.base import ConfigError
from dpcc_megatron.config.reward import CheckerSpec, RewardConfig
from dpcc_megatron.rewards import DualTrackReward, get_checker, list_checkers, register_checker, unregister_checker

from .conftest import S


def test_builtins_are_registered():
    assert {"math", "code", "json", "format", "language", "overlong", "repetition", "exact", "sequence"} <= set(
        list_checkers())
    assert get_checker("code").sandboxed and not get_checker("math").sandboxed
    assert get_checker("overlong").kind == "penalty"


def test_duplicate_names_are_refused():
    @register_checker("test_dup_name")
    def one(sample, ctx):
        return 1.0

    try:
        with pytest.raises(ValueError, match="already registered"):
            @register_checker("test_dup_name")
            def two(sample, ctx):
                return 0.0
        assert get_checker("test_dup_name").fn is one
        with pytest.raises(ValueError):
            register_checker("math")(lambda s, c: 1.0)
    finally:
        unregister_checker("test_dup_name")
    with pytest.raises(KeyError, match="unknown checker"):
        get_checker("test_dup_name")


def test_custom_checker_in_config_and_error_handling():
    calls = []

    @register_checker("test_shouty")
    def shouty(sample, ctx, *, min_caps=1):
        calls.append(sample.response)
        if sample.response == "boom":
            raise RuntimeError("checker bug")
        if sample.response == "nan":
            return float("nan")
        return 1.0 if sum(c.isupper() for c in sample.response) >= min_caps else 0.0

    try:
        cfg = RewardConfig(tasks={"shout": [CheckerSpec("test_shouty", params={"min_caps": 2})]})
        with DualTrackReward(cfg) as reward:
            res = reward.score([S("HI", task="shout"), S("Hi", task="shout"), S("boom", task="shout"),
                                S("nan", task="shout")])
        assert res.checker_scores["test_shouty"] == [1.0, 0.0, 0.0, 0.0]
        assert res.base.tolist() == [1.0, 0.0, 0.0, 0.0]
        assert res.metrics["reward/checker_errors"] == 2.0  # the raise and the NaN
        assert any("checker bug" in m for m in res.messages)
        assert len(calls) == 4
    finally:
        unregister_checker("test_shouty")


def test_unknown_checker_in_config_is_a_config_error():
    cfg = RewardConfig(tasks={"mytask": [CheckerSpec("no_such_checker")]})
    with pytest.raises(ConfigError, match=r"reward\.tasks\.mytask\[0\]\.name.*no_such_checker"):
        DualTrackReward(cfg)


def test_unknown_task_is_an_error_unless_a_fallback_is_configured():
    with DualTrackReward() as reward:
        with pytest.raises(ValueError, match=r"no checkers for task 'poetry'.*reward\.fallback_task"):
            reward.score([S("An English sentence.", task="poetry", prompt="Write in English.")])
    with DualTrackReward(RewardConfig(fallback_task="text")) as reward:
        res = reward.score([S("An English sentence.", task="poetry", prompt="Write in English.")])
    assert res.metrics["reward/unknown_task"] == 1.0
    assert res.checker_scores["language"] == [1.0]
