"""Group-relative advantages against plain loops."""
from __future__ import annotations

import math
import statistics

import pytest
import torch

from dpcc_megatron.algo import group_advantages


def _loop(rewards, G, mode, eps=1e-6):
    out = []
    for i in range(0, len(rewards), G):
        g = rewards[i:i + G]
        if max(g) == min(g):
            out += [0.0] * G
            continue
        mean = sum(g) / G
        std = statistics.stdev(g) if mode == "grpo" else None
        out += [(r - mean) / (std + eps) if mode == "grpo" else r - mean for r in g]
    return out


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo"])
def test_matches_loop(mode):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (24,), generator=g).double() + torch.rand(24, generator=g, dtype=torch.float64) * (torch.arange(24) >= 8)
    adv, metrics = group_advantages(rewards, 4, mode)
    assert adv.tolist() == pytest.approx(_loop(rewards.tolist(), 4, mode), rel=1e-12, abs=1e-15)
    assert float(metrics["num_groups"]) == 6


def test_zero_variance_groups_are_exactly_zero_and_counted():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 0.0, 0.7, 0.7, 0.7, 0.7])
    for mode in ("grpo", "dr_grpo"):
        adv, metrics = group_advantages(rewards, 4, mode)
        assert adv[:4].tolist() == [0.0] * 4 and adv[8:].tolist() == [0.0] * 4  # exactly, no round-off / eps
        assert torch.all(adv[4:8] != 0)
        assert float(metrics["zero_variance_groups"]) == 2
        assert float(metrics["zero_variance_frac"]) == pytest.approx(2 / 3)


def test_grpo_scale_and_sum():
    adv, _ = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, "grpo", eps=0.0)
    assert float(adv.sum()) == pytest.approx(0.0, abs=1e-6)
    assert float(adv.std()) == pytest.approx(1.0)  # unbiased std, like the normaliser
    dr, _ = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, "dr_grpo")
    assert dr.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_per_component_normalisation():
    # Component 0 has a huge spread, component 1 a tiny one.
    r = torch.tensor([[100.0, 0.0], [0.0, 0.01], [50.0, 0.02], [25.0, 0.0]], dtype=torch.float64)
    w = [0.5, 2.0]
    adv, _ = group_advantages(r, 4, "grpo", per_component=True, weights=w)
    c0 = _loop(r[:, 0].tolist(), 4, "grpo")
    c1 = _loop(r[:, 1].tolist(), 4, "grpo")
    assert adv.tolist() == pytest.approx([0.5 * a + 2.0 * b for a, b in zip(c0, c1)], rel=1e-12)
    combined, _ = group_advantages(r, 4, "grpo", per_component=False, weights=w)
    assert combined.tolist() == pytest.approx(_loop((r[:, 0] * 0.5 + r[:, 1] * 2.0).tolist(), 4, "grpo"), rel=1e-12)
    assert not torch.allclose(adv, combined)


def test_per_component_zero_variance_needs_every_component_constant():
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0], [2.0, 2.0], [2.0, 2.0]])
    adv, metrics = group_advantages(r, 2, "dr_grpo", per_component=True)
    assert adv[:2].tolist() == pytest.approx([-0.5, 0.5]) and adv[2:].tolist() == [0.0, 0.0]
    assert float(metrics["zero_variance_groups"]) == 1


def test_group_size_one_and_errors():
    adv, metrics = group_advantages(torch.tensor([1.0, 2.0]), 1)
    assert adv.tolist() == [0.0, 0.0] and float(metrics["zero_variance_groups"]) == 2
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="weights"):
        group_advantages(torch.zeros(4, 2), 2, weights=[1.0])
    with pytest.raises(ValueError, match="mode"):
        group_advantages(torch.zeros(4), 2, "ppo")


def test_metrics_are_finite_detached_scalars():
    _, metrics = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), 2)
    assert all(v.dim() == 0 and not v.requires_grad and math.isfinite(float(v)) for v in metrics.values())
    assert float(metrics["reward_mean"]) == pytest.approx(0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_advantages():
    r = torch.rand(16, 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    cpu, _ = group_advantages(r, 4, per_component=True, weights=[1.0, 0.5])
    gpu, metrics = group_advantages(r.cuda(), 4, per_component=True, weights=[1.0, 0.5])
    torch.testing.assert_close(gpu.cpu(), cpu)
    assert all(v.is_cuda for v in metrics.values())
