import pytest

from dpcc_megatron.config import ConfigError, load_config
from dpcc_megatron.config.reward import default_task_checkers


def _load(tmp_path, text, overrides=()):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return load_config(path, overrides).reward


def test_defaults():
    cfg = load_config().reward
    assert (cfg.base_weight, cfg.advanced_weight) == (0.4, 0.6)
    assert cfg.judge.kind == "deterministic" and not cfg.dynamic.enabled and cfg.eval_set is None
    defaults = default_task_checkers()
    assert {"math", "addition", "sorting", "code", "json", "text"} <= set(defaults)
    assert [s.name for s in defaults["addition"]] == ["math", "format"]
    assert [s.name for s in defaults["sorting"]] == ["sequence", "format"]


def test_yaml_section_with_tasks(tmp_path):
    cfg = _load(tmp_path, """
reward:
  base_weight: 0.3
  advanced_weight: 0.7
  normalize: group
  tasks:
    addition:
      - {name: math}
      - {name: format, weight: 0.2, params: {pattern: '\\d+', fullmatch: true}}
  penalties: {max_length: 16, overlong_buffer: 4}
  judge: {kind: hf_rm, path: /models/rm}
  dynamic: {enabled: true, min_base_weight: 0.1}
""")
    assert cfg.base_weight == 0.3 and cfg.normalize == "group"
    assert cfg.tasks["addition"][1].params == {"pattern": "\\d+", "fullmatch": True}
    assert cfg.tasks["addition"][1].weight == 0.2
    assert cfg.penalties.max_length == 16 and cfg.judge.path == "/models/rm"


@pytest.mark.parametrize("override,msg", [
    ("reward.base_weight=1.5", "reward.base_weight must be in [0, 1], got 1.5"),
    ("reward.base_weight=0.5", "reward.advanced_weight must equal 1 - base_weight = 0.5, got 0.6"),
    ("reward.judge.kind=hf_rm", "reward.judge.path must name a local model directory"),
    ("reward.judge.kind=gpt4", "reward.judge.kind must be one of 'deterministic', 'hf_rm', got 'gpt4'"),
    ("reward.normalize=rank", "reward.normalize must be one of"),
    ("reward.dynamic.max_base_weight=0.1", "reward.dynamic.max_base_weight must be in [min_base_weight=0.2, 1]"),
    ("reward.sandbox.timeout_s=0", "reward.sandbox.timeout_s must be > 0"),
    ("reward.penalties.overlong_buffer=50", "reward.penalties.overlong_buffer must be in [0, max_length=0]"),
    ("reward.tasks={math: [{name: math, weight: -1}]}", "reward.tasks.math[0].weight must be >= 0, got -1.0"),
    ("reward.tasks={math: [{name: math, wieght: 1}]}", "unknown key reward.tasks.math[0].wieght"),
    ("reward.tasks={math: [{name: math}, {name: math}]}", "reward.tasks.math reports checker 'math' twice"),
    ("reward.buffer_size=-1", "reward.buffer_size must be >= 0"),
])
def test_errors_name_the_key(override, msg):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert msg in str(e.value)
