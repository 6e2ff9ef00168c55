"""The trainer and the planner refuse batch layouts Megatron's interleaved schedule cannot run,
naming the keys to change; layouts it can run pass both."""
import pytest

from dpcc_megatron.config import ConfigError, load_config
from dpcc_megatron.launch.plan import PlanOptions, plan_layout
from dpcc_megatron.train.setup import check_batch_layout


def _cfg(**over):
    base = {"model.num_layers": 8, "parallel.pipeline_model_parallel_size": 2,
            "parallel.virtual_pipeline_model_parallel_size": 2, "rollout.prompts_per_iteration": 4,
            "rollout.group_size": 4, "train.mini_batch_size": 8, "train.micro_batch_size": 4}
    base.update(over)
    return load_config(overrides=[f"{k}={v}" for k, v in base.items()])


def test_micro_batch_count_not_a_multiple_of_pp_is_refused_with_the_keys():
    cfg = _cfg(**{"parallel.pipeline_model_parallel_size": 4, "model.num_layers": 16})  # 8 / 4 = 2 micro-batches
    with pytest.raises(ValueError) as e:
        check_batch_layout(cfg, dp=1)
    msg = str(e.value)
    assert "train.mini_batch_size" in msg and "train.micro_batch_size" in msg
    assert "parallel.pipeline_model_parallel_size=4" in msg and "= 2" in msg
    plan = plan_layout(cfg, PlanOptions(gpus=4))
    assert not plan.fits and any("interleaved schedule" in p and "train.micro_batch_size" in p for p in plan.problems)


def test_the_same_layout_with_enough_micro_batches_passes_both():
    cfg = _cfg(**{"parallel.pipeline_model_parallel_size": 4, "model.num_layers": 16, "train.micro_batch_size": 2})
    check_batch_layout(cfg, dp=1)
    assert not any("interleaved" in p for p in plan_layout(cfg, PlanOptions(gpus=4)).problems)
    # without interleaving the same count is fine: the plain 1F1B schedule takes any number
    plain = _cfg(**{"parallel.pipeline_model_parallel_size": 4, "model.num_layers": 16,
                    "parallel.virtual_pipeline_model_parallel_size": "null"})
    check_batch_layout(plain, dp=1)


def test_layers_must_split_into_equal_virtual_chunks():
    with pytest.raises(ValueError, match=r"model.num_layers=6 is not divisible by "
                                         r"parallel.pipeline_model_parallel_size=2 x "
                                         r"parallel.virtual_pipeline_model_parallel_size=2"):
        check_batch_layout(_cfg(**{"model.num_layers": 6}), dp=1)


def test_virtual_pipeline_needs_a_pipeline():
    with pytest.raises(ConfigError, match="virtual_pipeline_model_parallel_size"):
        _cfg(**{"parallel.pipeline_model_parallel_size": 1})
