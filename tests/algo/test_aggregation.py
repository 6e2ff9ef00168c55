"""Exact distributed normalisation: micro-batch contributions sum to the full-batch loss."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dpcc_megatron.algo import (AGGREGATIONS, LossNormalizer, aggregate, combine_metrics, get_policy_loss,
                                global_counts_needed)
from dpcc_megatron.config.algo import LossConfig

from .helpers import LOSSES, make_batch

CHUNKS = [(0, 5), (5, 7), (7, 16)]  # three uneven row chunks of a 16-row batch


def _batch(name, per_token_adv):
    lp, old, adv, mask = make_batch(30, B=16, T=11, per_token_adv=per_token_adv,
                                    spread=0.0005 if name == "gspo" else 0.5)
    mask[6] = False  # an all-masked row inside a chunk
    mask[7:, 9:] = False  # the last chunk's tail is padding: it is trimmed below
    return lp, old, adv, mask


def _trim(t, stop):
    return t[:, :stop] if t.dim() == 2 else t


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("with_ref_kl", [False, True])
def test_chunk_contributions_sum_to_full_batch(name, per_token_adv, with_ref_kl):
    lp, old, adv, mask = _batch(name, per_token_adv)
    ref_lp = old + 0.1 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1), dtype=old.dtype)
    cfg = LossConfig(ref_kl_coef=0.3 if with_ref_kl else 0.0)
    fn = get_policy_loss(name)
    T = lp.shape[1]

    full_lp = lp.detach().clone().requires_grad_(True)
    full_loss, full_metrics = fn(full_lp, old, adv, mask, cfg, ref_logprobs=ref_lp)
    full_loss.backward()

    parts = [LossNormalizer.from_mask(mask[a:b]) for a, b in CHUNKS]
    assert LossNormalizer.combine(parts) == LossNormalizer.from_mask(mask)
    normalizer = LossNormalizer.from_mask(mask)

    chunk_lp = lp.detach().clone().requires_grad_(True)
    total = 0.0
    chunk_metrics = []
    for i, (a, b) in enumerate(CHUNKS):
        stop = 9 if i == 2 else T  # micro-batches may be padded to different lengths
        loss, metrics = fn(_trim(chunk_lp[a:b], stop), _trim(old[a:b], stop), _trim(adv[a:b], stop),
                           _trim(mask[a:b], stop), cfg, normalizer=normalizer, ref_logprobs=_trim(ref_lp[a:b], stop))
        total = total + loss
        chunk_metrics.append(metrics)
    total.backward()

    assert float(total) == pytest.approx(float(full_loss), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(chunk_lp.grad, full_lp.grad, rtol=1e-6, atol=1e-12)

    combined = combine_metrics(chunk_metrics)
    assert set(combined) == set(full_metrics)
    for key, value in full_metrics.items():
        assert combined[key] == pytest.approx(float(value), rel=1e-5, abs=1e-7), key


def test_global_counts_needed_matches_aggregation():
    assert global_counts_needed("grpo") == ("num_seqs",)
    assert global_counts_needed("dapo") == ("num_tokens",)
    assert global_counts_needed("dr_grpo") == ("num_rows", "max_len")
    assert global_counts_needed("gspo") == ("num_seqs",)
    assert global_counts_needed("cispo") == ("num_tokens",)
    assert global_counts_needed("dpcc") == ("num_tokens",)
    assert get_policy_loss("dr_grpo").counts_needed == ("num_rows", "max_len")


def test_missing_global_count_is_an_error():
    lp, old, adv, mask = make_batch(31)
    with pytest.raises(ValueError, match="num_seqs"):
        get_policy_loss("grpo")(lp, old, adv, mask, normalizer=LossNormalizer(num_tokens=10))
    with pytest.raises(ValueError, match="max_len"):
        get_policy_loss("dr_grpo")(lp, old, adv, mask, normalizer=LossNormalizer(num_rows=6))


def test_from_mask_counts():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.bool)
    assert LossNormalizer.from_mask(mask) == LossNormalizer(num_tokens=3, num_seqs=2, num_rows=3, max_len=3)
    combined = LossNormalizer.combine([LossNormalizer.from_mask(mask), LossNormalizer(1, 1, 1, 7)])
    assert combined == LossNormalizer(num_tokens=4, num_seqs=3, num_rows=4, max_len=7)
    assert LossNormalizer.combine([LossNormalizer(num_tokens=2), LossNormalizer(num_tokens=3)]).num_seqs is None


def test_aggregate_by_hand():
    terms = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.bool)
    assert float(aggregate(terms, mask, "token_mean")) == pytest.approx((1 + 2 + 7) / 3)
    assert float(aggregate(terms, mask, "seq_mean_token_mean")) == pytest.approx((1.5 + 7) / 2)
    assert float(aggregate(terms, mask, "seq_mean")) == pytest.approx((1.5 + 7) / 2)
    assert float(aggregate(terms, mask, "token_sum_norm")) == pytest.approx(10 / 9)
    norm = LossNormalizer(num_tokens=20, num_seqs=4, num_rows=5, max_len=4)
    assert float(aggregate(terms, mask, "token_mean", norm)) == pytest.approx(10 / 20)
    assert float(aggregate(terms, mask, "seq_mean_token_mean", norm)) == pytest.approx(8.5 / 4)
    assert float(aggregate(terms, mask, "token_sum_norm", norm)) == pytest.approx(10 / 20)
    assert set(AGGREGATIONS) == {"token_mean", "seq_mean_token_mean", "seq_mean", "token_sum_norm"}
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(terms, mask, "mean")


def test_combine_metrics_rules():
    a = {"ratio_mean": 2.0, "ratio_min": 0.5, "ratio_max": 3.0, "num_tokens": 1.0, "pg_loss": 0.25,
         "utilisation": 1.0, "num_adv_tokens": 1.0}
    b = {"ratio_mean": 1.0, "ratio_min": 0.9, "ratio_max": 1.5, "num_tokens": 3.0, "pg_loss": 0.5,
         "utilisation": 0.5, "num_adv_tokens": 2.0}
    empty = {"ratio_mean": 0.0, "ratio_min": 1.0, "ratio_max": 1.0, "num_tokens": 0.0, "pg_loss": 0.0,
             "utilisation": 1.0, "num_adv_tokens": 0.0}
    out = combine_metrics([a, b, empty])
    assert out == {"ratio_mean": pytest.approx(5 / 4), "ratio_min": 0.5, "ratio_max": 3.0, "num_tokens": 4.0,
                   "pg_loss": 0.75, "utilisation": pytest.approx(2 / 3), "num_adv_tokens": 3.0}
    assert combine_metrics([empty])["ratio_min"] == 1.0
    with pytest.raises(KeyError, match="my_metric"):
        combine_metrics([{"my_metric": 1.0}])
    assert combine_metrics([{"my_metric": 1.0}, {"my_metric": 2.0}], {"my_metric": ("max", None)}) == {"my_metric": 2.0}


def test_empty_micro_batch_contributes_nothing():
    lp, old, adv, mask = make_batch(32)
    normalizer = LossNormalizer.from_mask(mask)
    empty = torch.zeros_like(mask)
    for name in LOSSES:
        leaf = lp.detach().clone().requires_grad_(True)
        loss, _ = get_policy_loss(name)(leaf, old, adv, empty, normalizer=dataclasses.replace(normalizer))
        loss.backward()
        assert float(loss) == 0.0 and torch.all(leaf.grad == 0)
