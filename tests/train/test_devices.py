"""Schedule outputs meet masks and rewards on one device (the host)."""
import torch

from dpcc_megatron.train.devices import to_host


def test_to_host_detaches_to_cpu_fp32_and_keeps_none():
    x = torch.ones(2, 3, dtype=torch.bfloat16, requires_grad=True) * 2
    y = to_host(x)
    assert y.device.type == "cpu" and y.dtype == torch.float32 and not y.requires_grad
    assert torch.equal(y, torch.full((2, 3), 2.0))
    assert to_host(None) is None


def test_logprob_stats_moves_masks_to_the_outputs_device():
    from types import SimpleNamespace

    from dpcc_megatron.train.metrics import logprob_stats

    mask = torch.tensor([[False, True, True], [True, True, False]])
    old_lp = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -0.5, 0.0]], dtype=torch.float64)
    entropy = torch.tensor([[9.0, 1.0, 3.0], [2.0, 2.0, 9.0]])
    rollouts = SimpleNamespace(sampler_logprob_matrix=lambda m: torch.where(m, -1.0, 0.0))
    out = logprob_stats(SimpleNamespace(mask=mask), rollouts, old_lp, entropy)
    assert abs(out["entropy"] - 2.0) < 1e-6  # masked mean: (1 + 3 + 2 + 2) / 4
    assert abs(out["mismatch_max_abs"] - 1.0) < 1e-6
