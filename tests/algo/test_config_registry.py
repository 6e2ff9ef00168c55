"""The loss config section, the loss registry and the layer's import hygiene."""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import dpcc_megatron.algo as algo
from dpcc_megatron.algo import TokenTerms, get_policy_loss, list_policy_losses, register_policy_loss
from dpcc_megatron.algo.registry import _REGISTRY
from dpcc_megatron.config import ConfigError, JobConfig, LossConfig, from_dict, load_config
from dpcc_megatron.config.algo import POLICY_LOSSES, DPCCConfig

from .helpers import grad_of, make_batch

ALGO_DIR = pathlib.Path(algo.__file__).parent


def test_defaults():
    cfg = LossConfig()
    assert cfg.name == "dpcc" and cfg.clip_eps == 0.2 and cfg.clip_eps_high == 0.28 and cfg.dual_clip_c is None
    assert (cfg.gspo_eps_low, cfg.gspo_eps_high, cfg.cispo_eps_high) == (3e-4, 4e-4, 0.28)
    assert cfg.dpcc.preset == "calibrated" and cfg.dpcc.early_phase_fraction == 0.2 and cfg.dpcc.kl_estimator == "k3"
    from_dict(LossConfig, {})  # validates


@pytest.mark.parametrize("preset", ["calibrated", "paper"])
def test_dpcc_presets_fill_unset_fields_only(preset):
    from dpcc_megatron.config.algo import DPCC_PRESETS

    cfg = from_dict(LossConfig, {"dpcc": {"preset": preset}}).dpcc
    assert {k: getattr(cfg, k) for k in DPCC_PRESETS[preset]} == DPCC_PRESETS[preset]
    # the calibrated preset's LR rule is the KL-target one, without the early LR warm-up; the paper's is the step rule
    assert (cfg.drift_lr_rule, cfg.early_lr_warmup) == {"calibrated": ("kl_target", False),
                                                         "paper": ("step", False)}[preset]
    explicit = from_dict(LossConfig, {"dpcc": {"preset": preset, "tau0": 1.7, "truncation": "clip"}}).dpcc
    assert explicit.tau0 == 1.7 and explicit.truncation == "clip"  # an explicit value wins over the preset
    assert explicit.alpha == DPCC_PRESETS[preset]["alpha"]


def test_paper_preset_is_the_literal_specification():
    cfg = from_dict(LossConfig, {"dpcc": {"preset": "paper"}}).dpcc
    assert (cfg.tau0, cfg.alpha, cfg.tau_min, cfg.early_tau, cfg.drift_score) == (2.0, 5.0, 1.1, 1.2, "kl")
    assert (cfg.truncation, cfg.skip_fresh_kl, cfg.early_lr_warmup, cfg.drift_probe) == ("clip", False, False, False)
    assert cfg.drift_lr_rule == "step"  # the document's min(1, 0.5 / (d - theta + 1)), one step at a time


@pytest.mark.parametrize("data,message", [
    ({"loss": {"dpcc": {"tau_min": 0.9}}}, "loss.dpcc.tau_min must be > 1, got 0.9"),
    ({"loss": {"dpcc": {"tau_min": 2.5}}}, "loss.dpcc.tau_min must be <= tau0=1.28, got 2.5"),
    ({"loss": {"dpcc": {"early_tau": 3.0}}}, "loss.dpcc.early_tau must be in [tau_min=1.05, tau0=1.28], got 3.0"),
    ({"loss": {"dpcc": {"kl_ema_decay": 1.0}}}, "loss.dpcc.kl_ema_decay must be in [0, 1), got 1.0"),
    ({"loss": {"dpcc": {"alpha": "big"}}}, "loss.dpcc.alpha must be a number, got 'big'"),
    ({"loss": {"dpcc": {"kl_estimator": "k4"}}}, "loss.dpcc.kl_estimator must be one of"),
    ({"loss": {"dpcc": {"bogus": 1}}}, "unknown key loss.dpcc.bogus"),
    ({"loss": {"dpcc": {"preset": "ppo"}}}, "loss.dpcc.preset must be one of"),
    ({"loss": {"dpcc": {"truncation": "drop"}}}, "loss.dpcc.truncation must be one of"),
    ({"loss": {"dpcc": {"decay_power": 0}}}, "loss.dpcc.decay_power must be > 0, got 0"),
    ({"loss": {"dpcc": {"drift_lr_rule": "kl_target", "drift_probe": False}}},
     "loss.dpcc.drift_lr_rule kl_target reads the drift probe's KL"),
    ({"loss": {"dpcc": {"drift_lr_rule": "pid"}}}, "loss.dpcc.drift_lr_rule must be one of"),
    ({"loss": {"dpcc": {"lr_scale_min": 0}}}, "loss.dpcc.lr_scale_min must be in (0, 1], got 0"),
    ({"loss": {"dpcc": {"drift_lr_rule": "kl_target", "lr_scale_init": 0.01}}},
     "loss.dpcc.lr_scale_init must be in [lr_scale_min=0.05, 1], got 0.01"),
    ({"loss": {"dpcc": {"preset": "paper", "lr_scale_init": 0.5}}},
     "loss.dpcc.lr_scale_init is read only by drift_lr_rule: kl_target"),
    ({"loss": {"dpcc": {"kl_target_gain": -1}}}, "loss.dpcc.kl_target_gain must be > 0, got -1"),
    ({"loss": {"dpcc": {"lr_scale_max_raise": 1.0}}}, "loss.dpcc.lr_scale_max_raise must be > 1, got 1.0"),
    ({"loss": {"dpcc": {"preset": "paper", "lr_scale_max_raise": 1.5}}},
     "loss.dpcc.lr_scale_max_raise is read only by drift_lr_rule: kl_target"),
    ({"loss": {"name": "ppo"}}, "loss.name must be one of"),
    ({"loss": {"dual_clip_c": 0.5}}, "loss.dual_clip_c must be > 1 or null, got 0.5"),
    ({"loss": {"clip_eps": 1.5}}, "loss.clip_eps must be in (0, 1), got 1.5"),
    ({"loss": {"advantage": "ppo"}}, "loss.advantage must be one of"),
    ({"loss": {"ref_kl_coef": -1}}, "loss.ref_kl_coef must be >= 0, got -1.0"),
])
def test_errors_name_the_key(data, message):
    with pytest.raises(ConfigError) as err:
        from_dict(JobConfig, data)
    assert str(err.value).startswith(message)


def test_yaml_round_trip(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("loss:\n  name: gspo\n  ref_kl_coef: 0.01\n  dpcc:\n    alpha: 1e-1\n    total_steps: 100\n")
    cfg = load_config(path, overrides=["loss.dpcc.drift_threshold=0.1"])
    assert cfg.loss.name == "gspo" and cfg.loss.ref_kl_coef == 0.01
    assert cfg.loss.dpcc == DPCCConfig(alpha=0.1, total_steps=100, drift_threshold=0.1)


def test_registry_holds_exactly_the_configurable_losses():
    assert tuple(list_policy_losses()[:len(POLICY_LOSSES)]) == POLICY_LOSSES
    with pytest.raises(KeyError, match="registered: "):
        get_policy_loss("ppo")


def test_duplicate_name_is_refused_and_custom_losses_get_the_wrapper():
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("grpo", aggregation="token_mean")(lambda x, cfg: None)
    with pytest.raises(ValueError, match="unknown aggregation"):
        register_policy_loss("x", aggregation="mean")

    @register_policy_loss("test_reinforce", aggregation="token_mean")
    def reinforce(x, cfg):
        none = torch.zeros_like(x.mask)
        return TokenTerms(loss=-x.advantages * x.logprobs, below=none, above=none, active=x.mask)

    try:
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("test_reinforce", aggregation="token_mean")(reinforce)
        lp, old, adv, mask = make_batch(50)
        loss, metrics, grad = grad_of(get_policy_loss("test_reinforce"), lp, old, adv, mask)
        n = mask.sum()
        expected = torch.where(mask, -adv[:, None].expand_as(lp) / n, torch.zeros(()))
        torch.testing.assert_close(grad, expected)
        assert float(metrics["utilisation"]) == 1.0
    finally:
        del _REGISTRY["test_reinforce"]


def _imports(path: pathlib.Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            mods.add(node.module)
    return mods


def test_algo_layer_imports_only_torch_stdlib_and_config():
    import sys
    allowed_roots = {"torch", "dpcc_megatron"} | set(sys.stdlib_module_names)
    for path in ALGO_DIR.glob("*.py"):
        for mod in _imports(path):
            assert mod.split(".")[0] in allowed_roots, f"{path.name} imports {mod}"
            if mod.startswith("dpcc_megatron"):
                assert mod.startswith("dpcc_megatron.config"), f"{path.name} imports {mod}"


def test_config_section_imports_only_stdlib():
    import sys
    import dpcc_megatron.config.algo as section
    for mod in _imports(pathlib.Path(section.__file__)):
        assert mod.split(".")[0] in sys.stdlib_module_names, mod
