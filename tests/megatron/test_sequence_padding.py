"""Sequence padding for sequence parallelism (and FP8): the multiple, the padded batch, and that
the padding is invisible to every registered loss and its metrics."""
import pytest
import torch

from dpcc_megatron.algo import LossNormalizer
from dpcc_megatron.algo.registry import list_policy_losses
from dpcc_megatron.config import LossConfig
from dpcc_megatron.megatron.policy_step import RLBatch, padded_length, policy_loss_fn, sequence_multiple


@pytest.mark.parametrize("tp,sp,fp8,expected", [(1, False, False, 1), (2, False, False, 1), (2, True, False, 2),
                                               (8, True, False, 8), (1, False, True, 16), (2, True, True, 16),
                                               (32, True, True, 32), (3, True, True, 48)])
def test_sequence_multiple(tp, sp, fp8, expected):
    assert sequence_multiple(tp, sp, fp8) == expected


def test_padded_length():
    assert [padded_length(n, 8) for n in (1, 8, 9, 16)] == [8, 8, 16, 16]
    assert padded_length(11, 1) == 11


def _batch(n=4, L=12, per_token_adv=False):
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(n, L - 1, dtype=torch.bool)
    for i in range(n):
        mask[i, 2 + i:L - 1 - i % 2] = True
    return RLBatch(tokens=torch.randint(1, 50, (n, L), generator=g), mask=mask,
                   old_logprobs=-torch.rand(n, L - 1, generator=g),
                   advantages=torch.randn(n, L - 1, generator=g) if per_token_adv else torch.randn(n, generator=g),
                   ref_logprobs=-torch.rand(n, L - 1, generator=g), sampler_logprobs=-torch.rand(n, L - 1, generator=g))


def test_pad_targets_pads_every_per_token_field_and_masks_the_tail():
    b = _batch(per_token_adv=True)
    p = b.pad_targets(16, pad_id=0)
    assert p.tokens.shape == (4, 17) and torch.equal(p.tokens[:, :12], b.tokens) and (p.tokens[:, 12:] == 0).all()
    for name in ("mask", "old_logprobs", "ref_logprobs", "sampler_logprobs", "advantages"):
        a, q = getattr(b, name), getattr(p, name)
        assert q.shape == (4, 16) and torch.equal(q[:, :11], a), name
    assert not p.mask[:, 11:].any()
    assert p.pad_targets(16) is p
    assert torch.equal(_batch().pad_targets(16).advantages, _batch().advantages)  # per-sequence: unchanged
    with pytest.raises(ValueError):
        b.pad_targets(8)


@pytest.mark.parametrize("name", list_policy_losses())
def test_padding_is_invisible_to_every_loss_and_metric(name):
    b = _batch()
    cfg = LossConfig(name=name, ref_kl_coef=0.1)
    norm = LossNormalizer.from_mask(b.mask)  # computed before padding, as policy_update does
    fn = policy_loss_fn(cfg, norm, tis_cap=2.0)
    g = torch.Generator().manual_seed(1)
    lp = -torch.rand(b.mask.shape, generator=g)
    ent = torch.rand(b.mask.shape, generator=g)
    loss, metrics = fn(lp, ent, b)
    # the padded tail holds garbage the model produced for padding tokens: it must not count
    pad = b.pad_targets(16)
    lp_pad = torch.cat([lp, -5 * torch.rand(4, 5, generator=g)], 1)
    ent_pad = torch.cat([ent, 9 * torch.rand(4, 5, generator=g)], 1)
    loss_pad, metrics_pad = fn(lp_pad, ent_pad, pad)
    torch.testing.assert_close(loss_pad, loss, atol=1e-7, rtol=0)
    assert set(metrics_pad) == set(metrics)
    for k in metrics:
        torch.testing.assert_close(torch.as_tensor(metrics_pad[k]).float(), torch.as_tensor(metrics[k]).float(),
                                   atol=1e-6, rtol=0, msg=lambda m: f"{name} {k}: {m}")
