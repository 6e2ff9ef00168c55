"""Every policy loss against the plain-Python reference, in value and gradient, plus edge cases."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dpcc_megatron.algo import get_policy_loss, sample_utilisation
from dpcc_megatron.config.algo import DPCCConfig, LossConfig

from . import reference as ref
from .helpers import LOSSES, grad_of, make_batch


def _check_against_reference(name, lp, old, adv, mask, config=None, **ref_kwargs):
    loss, metrics, grad = grad_of(get_policy_loss(name), lp, old, adv, mask, config)
    value, ref_grad = ref.reference(name, lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), **ref_kwargs)
    assert math.isfinite(float(loss))
    assert float(loss) == pytest.approx(value, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=grad.dtype), rtol=1e-9, atol=1e-12)
    assert float(metrics["pg_loss"]) == pytest.approx(value, rel=1e-10, abs=1e-12)
    return loss, metrics, grad


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference(name, per_token_adv, seed):
    # gspo's clip range is 1e-4 wide: use small log-ratios so both branches occur.
    spread = 0.0005 if name == "gspo" else 0.4
    lp, old, adv, mask = make_batch(seed, per_token_adv=per_token_adv, spread=spread)
    _, metrics, grad = _check_against_reference(name, lp, old, adv, mask)
    assert torch.all(grad[~mask] == 0)


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo"])
def test_dual_clip_matches_reference(name):
    lp, old, adv, mask = make_batch(3, spread=1.5)
    cfg = LossConfig(dual_clip_c=3.0)
    _check_against_reference(name, lp, old, adv, mask, cfg, dual_c=3.0)
    # The cap must actually bind somewhere in this batch, or the test proves nothing.
    plain, _ = get_policy_loss(name)(lp, old, adv, mask)
    capped, _ = get_policy_loss(name)(lp, old, adv, mask, cfg)
    assert float(capped) < float(plain)


@pytest.mark.parametrize("name", LOSSES)
def test_nondefault_params_are_used(name):
    lp, old, adv, mask = make_batch(4, spread=0.0005 if name == "gspo" else 0.5)
    cfg = LossConfig(clip_eps=0.1, clip_eps_low=0.15, clip_eps_high=0.4, gspo_eps_low=1e-4, gspo_eps_high=2e-4,
                     cispo_eps_high=0.1, dpcc=DPCCConfig(tau=1.3, decay_power=3.0))
    _check_against_reference(name, lp, old, adv, mask, cfg, clip_eps=0.1, eps_low=0.15, eps_high=0.4,
                             gspo_low=1e-4, gspo_high=2e-4, cispo_high=0.1, tau=1.3, decay_power=3.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_dpcc_paper_truncation_matches_reference(seed):
    lp, old, adv, mask = make_batch(seed, per_token_adv=True, spread=1.0)
    cfg = LossConfig(dpcc=DPCCConfig(preset="paper"))
    _check_against_reference("dpcc", lp, old, adv, mask, cfg, tau=2.0, truncation="clip")


def test_dpcc_decay_brakes_only_the_drifting_side():
    """Beyond tau the drifting token's weight falls below the boundary value; the restoring one keeps it."""
    lp = torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0, -1.0, 1.0, 1.0]], dtype=torch.float64)  # r = e, e, 1/e, 1/e
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)  # drift, restore, drift, restore
    mask = torch.ones(1, 4, dtype=torch.bool)
    w = {}
    for trunc in ("clip", "decay"):
        _, _, g = grad_of(get_policy_loss("dpcc"), lp.detach(), old, adv, mask,
                          LossConfig(dpcc=DPCCConfig(tau=1.5, truncation=trunc)))
        w[trunc] = (-g * 4 / adv)[0].tolist()  # per-token weight: grad = -A * w / n
    assert w["clip"] == pytest.approx([1.5, 1.5, 1 / 1.5, 1 / 1.5])
    k = math.exp(-2.0 * (1.0 - math.log(1.5)))
    assert w["decay"] == pytest.approx([1.5 * k, 1.5, k / 1.5, 1 / 1.5])


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_reference_gradient_is_the_derivative_of_the_surrogate(name):
    """Finite differences of the reference value validate the reference's derivative formulas."""
    lp, old, adv, mask = make_batch(5, B=3, T=4, spread=0.0005 if name == "gspo" else 0.4)
    L, O, A, M = lp.tolist(), old.tolist(), adv.tolist(), mask.tolist()
    if name == "gspo":
        f = lambda x: ref.gspo_sequence_value(x, O, A, M, 1 - 3e-4, 1 + 4e-4)  # noqa: E731
    else:
        f = lambda x: ref.reference(name, x, O, A, M)[0]  # noqa: E731
    _, analytic = ref.reference(name, L, O, A, M)
    h = 1e-7
    for b in range(3):
        for t in range(4):
            up = [row[:] for row in L]
            dn = [row[:] for row in L]
            up[b][t] += h
            dn[b][t] -= h
            assert (f(up) - f(dn)) / (2 * h) == pytest.approx(analytic[b][t], abs=1e-6)


@pytest.mark.parametrize("name", LOSSES)
def test_all_masked_rows(name):
    lp, old, adv, mask = make_batch(6)
    mask[1] = False
    mask[4] = False
    _, metrics, grad = _check_against_reference(name, lp, old, adv, mask)
    assert torch.all(grad[1] == 0) and torch.all(grad[4] == 0)
    assert float(metrics["num_seqs"]) == 4


@pytest.mark.parametrize("name", LOSSES)
def test_fully_masked_batch_is_zero_and_finite(name):
    lp, old, adv, mask = make_batch(7)
    mask[:] = False
    loss, metrics, grad = grad_of(get_policy_loss(name), lp, old, adv, mask)
    assert float(loss) == 0.0
    assert torch.all(grad == 0)
    assert all(math.isfinite(float(v)) for v in metrics.values())
    assert float(metrics["ratio_min"]) == 1.0 and float(metrics["num_tokens"]) == 0


@pytest.mark.parametrize("name", LOSSES)
def test_zero_advantages_give_zero_loss_and_gradient(name):
    lp, old, adv, mask = make_batch(8)
    adv = torch.zeros_like(adv)
    loss, metrics, grad = grad_of(get_policy_loss(name), lp, old, adv, mask)
    assert float(loss) == 0.0
    assert torch.all(grad == 0)
    assert float(metrics["num_adv_tokens"]) == 0 and float(metrics["utilisation"]) == 1.0


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_extreme_log_ratio_is_finite(name, sign):
    lp, old, adv, mask = make_batch(9, per_token_adv=True)
    lp = old + sign * 100.0
    lp[0, 0] = old[0, 0] + 0.1  # one ordinary token
    loss, metrics, grad = _check_against_reference(name, lp, old, adv, mask)
    assert torch.isfinite(grad).all()
    assert all(math.isfinite(float(v)) for v in metrics.values())
    assert float(metrics["ratio_max"]) <= math.exp(20) * (1 + 1e-12)


@pytest.mark.parametrize("name", LOSSES)
def test_single_token(name):
    lp = torch.tensor([[-1.0]], dtype=torch.float64)
    old = torch.tensor([[-1.0001]], dtype=torch.float64)  # inside even gspo's clip range
    adv = torch.tensor([0.7], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, _, grad = _check_against_reference(name, lp, old, adv, mask)
    assert float(loss) != 0 and float(grad[0, 0]) != 0


@pytest.mark.parametrize("name", LOSSES)
def test_seq_and_token_advantages_agree_when_constant_per_row(name):
    lp, old, adv, mask = make_batch(10, spread=0.0005 if name == "gspo" else 0.4)
    fn = get_policy_loss(name)
    l1, _, g1 = grad_of(fn, lp, old, adv, mask)
    l2, _, g2 = grad_of(fn, lp, old, adv[:, None].expand(-1, lp.shape[1]).clone(), mask)
    assert float(l1) == pytest.approx(float(l2), rel=1e-12)
    torch.testing.assert_close(g1, g2)


@pytest.mark.parametrize("name", LOSSES)
def test_masked_positions_are_ignored_even_if_garbage(name):
    lp, old, adv, mask = make_batch(11, per_token_adv=True)
    fn = get_policy_loss(name)
    l1, m1, g1 = grad_of(fn, lp, old, adv, mask)
    lp2, old2, adv2 = lp.clone(), old.clone(), adv.clone()
    lp2[~mask] = float("nan")
    old2[~mask] = float("-inf")
    adv2[~mask] = float("inf")
    l2, m2, g2 = grad_of(fn, lp2, old2, adv2, mask)
    assert float(l1) == float(l2)
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)
    assert {k: float(v) for k, v in m1.items()} == {k: float(v) for k, v in m2.items()}


@pytest.mark.parametrize("name", LOSSES)
def test_low_precision_input_computes_in_fp32(name):
    lp, old, adv, mask = make_batch(12, dtype=torch.float32)
    loss32, _, g32 = grad_of(get_policy_loss(name), lp, old, adv, mask)
    loss16, _, g16 = grad_of(get_policy_loss(name), lp.bfloat16(), old.bfloat16(), adv, mask)
    assert loss16.dtype == torch.float32 and g16.dtype == torch.bfloat16
    assert torch.isfinite(loss16) and torch.isfinite(g16.float()).all()


@pytest.mark.parametrize("name", LOSSES)
def test_metrics_are_detached_scalars_with_exact_values(name):
    lp, old, adv, mask = make_batch(13, spread=0.6)
    _, metrics, _ = grad_of(get_policy_loss(name), lp, old, adv, mask)
    for key, v in metrics.items():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad, key
    ratios = [math.exp(a - b) for row_l, row_o, row_m in zip(lp.tolist(), old.tolist(), mask.tolist())
              for a, b, m in zip(row_l, row_o, row_m) if m]
    log_r = [math.log(r) for r in ratios]
    assert float(metrics["num_tokens"]) == len(ratios)
    assert float(metrics["ratio_mean"]) == pytest.approx(sum(ratios) / len(ratios), rel=1e-6)
    assert float(metrics["ratio_min"]) == pytest.approx(min(ratios), rel=1e-6)
    assert float(metrics["ratio_max"]) == pytest.approx(max(ratios), rel=1e-6)
    assert float(metrics["kl_k1"]) == pytest.approx(-sum(log_r) / len(ratios), rel=1e-5, abs=1e-9)
    assert float(metrics["kl_k2"]) == pytest.approx(sum(0.5 * x * x for x in log_r) / len(ratios), rel=1e-5)
    assert float(metrics["kl_k3"]) == pytest.approx(sum(r - 1 - x for r, x in zip(ratios, log_r)) / len(ratios), rel=1e-5)


@pytest.mark.parametrize("name,bounds", [("grpo", (0.8, 1.2)), ("dapo", (0.8, 1.28)), ("dr_grpo", (0.8, 1.2)),
                                         ("cispo", (0.0, 1.28)), ("dpcc", (1 / 1.28, 1.28))])
def test_clip_fractions(name, bounds):
    lp, old, adv, mask = make_batch(14, spread=0.8)
    _, metrics, _ = grad_of(get_policy_loss(name), lp, old, adv, mask)
    r = torch.exp(lp - old)[mask]
    assert float(metrics["clip_frac_low"]) == pytest.approx(float((r < bounds[0]).double().mean()))
    assert float(metrics["clip_frac_high"]) == pytest.approx(float((r > bounds[1]).double().mean()))
    assert 0 < float(metrics["clip_frac_high"]) < 1


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("seed", [15, 16])
def test_utilisation_metric_matches_autograd(name, seed):
    lp, old, adv, mask = make_batch(seed, per_token_adv=True, spread=0.0005 if name == "gspo" else 1.0)
    lp[0, 0] = old[0, 0] + 50  # beyond the log-ratio clamp
    lp[1, 0] = old[1, 0] - 50
    adv[2, :3] = 0.0
    cfg = LossConfig(dual_clip_c=2.0)
    _, metrics, _ = grad_of(get_policy_loss(name), lp, old, adv, mask, cfg)
    measured = sample_utilisation(name, lp, old, adv, mask, cfg)
    assert float(metrics["utilisation"]) == pytest.approx(measured, abs=1e-6)  # fp32 metric


def test_dpcc_drops_nothing_where_hard_clipping_does():
    lp, old, adv, mask = make_batch(17, per_token_adv=True, spread=1.5)
    lp[0, 0] = old[0, 0] + 100
    for name in ("grpo", "dapo", "dr_grpo"):
        assert sample_utilisation(name, lp, old, adv, mask) < 0.9
    assert sample_utilisation("dpcc", lp, old, adv, mask) == 1.0
    assert sample_utilisation("dpcc", lp, old, adv, mask, LossConfig(dpcc=DPCCConfig(tau=1.05))) == 1.0


def test_dpcc_inside_the_trust_region_has_the_ppo_gradient():
    """With every ratio inside [1/tau, tau] and inside the PPO clip, dpcc and dapo have the same gradient."""
    lp, old, adv, mask = make_batch(18, spread=0.05)
    _, _, g_dpcc = grad_of(get_policy_loss("dpcc"), lp, old, adv, mask)
    _, _, g_dapo = grad_of(get_policy_loss("dapo"), lp, old, adv, mask)
    torch.testing.assert_close(g_dpcc, g_dapo)


def test_dpcc_uses_tau_from_config():
    lp, old, adv, mask = make_batch(19, spread=1.0)
    base = LossConfig()
    loss_default, m_default = get_policy_loss("dpcc")(lp, old, adv, mask)
    loss_tau0, _ = get_policy_loss("dpcc")(lp, old, adv, mask, dataclasses.replace(base, dpcc=DPCCConfig(tau=1.28)))
    loss_tight, m_tight = get_policy_loss("dpcc")(lp, old, adv, mask, dataclasses.replace(base, dpcc=DPCCConfig(tau=1.1)))
    assert float(m_default["tau"]) == pytest.approx(1.28) and float(m_tight["tau"]) == pytest.approx(1.1)
    assert float(loss_default) == float(loss_tau0) != float(loss_tight)
    with pytest.raises(ValueError, match="tau must be > 1"):
        get_policy_loss("dpcc")(lp, old, adv, mask, LossConfig(dpcc=DPCCConfig(tau=1.0)))


def test_bad_shapes_are_refused():
    lp, old, adv, mask = make_batch(20)
    fn = get_policy_loss("grpo")
    with pytest.raises(ValueError, match="advantages"):
        fn(lp, old, adv[:-1], mask)
    with pytest.raises(ValueError, match="old_logprobs"):
        fn(lp, old[:, :-1], adv, mask)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        fn(lp[0], old[0], adv, mask[0])


def test_mask_may_be_float():
    lp, old, adv, mask = make_batch(21)
    fn = get_policy_loss("dapo")
    l_bool, _ = fn(lp, old, adv, mask)
    l_float, _ = fn(lp, old, adv, mask.double())
    assert float(l_bool) == float(l_float)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", LOSSES)
def test_cuda_matches_cpu(name):
    lp, old, adv, mask = make_batch(22, per_token_adv=True)
    cfg = LossConfig(ref_kl_coef=0.1)
    ref_lp = old - 0.1
    loss_cpu, m_cpu, g_cpu = grad_of(get_policy_loss(name), lp, old, adv, mask, cfg, ref_logprobs=ref_lp)
    dev = [t.cuda() for t in (lp, old, adv, mask, ref_lp)]
    loss_gpu, m_gpu, g_gpu = grad_of(get_policy_loss(name), *dev[:4], cfg, ref_logprobs=dev[4])
    assert float(loss_gpu) == pytest.approx(float(loss_cpu), rel=1e-9)
    torch.testing.assert_close(g_gpu.cpu(), g_cpu)
    assert {k: float(v) for k, v in m_gpu.items()} == pytest.approx({k: float(v) for k, v in m_cpu.items()}, rel=1e-5)
