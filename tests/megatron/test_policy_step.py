"""One policy update (DPCC and GRPO) at TP=2, PP=2, TP2xPP2, DP=2 with the distributed
optimizer, and TP2xPP2 with virtual pipeline 2 (interleaved 1F1B) and sequence parallelism,
equals one rank on the full batch: same loss, same parameter gradients.

Gradients are read back from one optimizer step: Adam's first step moves each weight by
lr * g / (|g| + eps), which with lr = eps = 1e3 is g to first order (the distributed optimizer
only supports Adam). Both sides take the same step, so the check covers the schedule, the
normaliser, DDP's reduction and the (distributed) optimizer."""
import pytest
import torch

from dpcc_megatron.testing import run_multirank
from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config

pytestmark = pytest.mark.multirank

B, L, VOCAB = 8, 12, 200  # VOCAB < model vocab (256): padded columns must never count
LOSSES = ("dpcc", "grpo")


def _job(tp, pp, dist_opt, vpp=None, sp=False):
    from dpcc_megatron.config import JobConfig, OptimizerConfig, TrainConfig

    par = parallel_config(tp, pp, use_distributed_optimizer=dist_opt, virtual_pipeline_model_parallel_size=vpp,
                          sequence_parallel=sp)
    cfg = JobConfig(model=tiny_model_config(), parallel=par,
                    optim=OptimizerConfig(name="adam", lr=1e3, adam_eps=1e3, clip_grad=0.0),
                    train=TrainConfig(mini_batch_size=B, micro_batch_size=2))
    cfg.loss.dpcc.early_phase_fraction = 0.0
    cfg.loss.dpcc.early_relax_fraction = 0.0
    return cfg


def _data():
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (B, L), generator=g)
    mask = torch.zeros(B, L - 1, dtype=torch.bool)
    for i in range(B):
        start = 3 + i % 3
        mask[i, start:start + 2 + i % 6] = True
    mask[5] = False  # an all-masked row
    adv = torch.randn(B, generator=g)
    adv[2] = 0.0
    return tokens, mask, adv, g


def _update_rank(rank, world, tp, pp, dist_opt, full_state, old_lp, rows_of, ref_grads=None, vpp=None, sp=False,
                 budget=0):
    from megatron.core import parallel_state as ps

    from dpcc_megatron.algo import DPCCController
    from dpcc_megatron.megatron.optimizer import build_optimizer, build_scheduler, build_training_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.policy_step import RLBatch, compute_logprobs
    from dpcc_megatron.megatron.reshard import load_full_state_dict, local_named_tensors, shard_like
    from dpcc_megatron.train.update import policy_update

    results = {}
    tokens, mask, adv, _ = _data()
    for name in LOSSES:
        cfg = _job(tp, pp, dist_opt, vpp, sp)
        cfg.loss.name = name
        cfg.train.max_tokens_per_micro_batch = budget
        init_model_parallel(cfg.parallel, seed=5)
        torch.manual_seed(5)
        chunks = build_training_model(cfg.model, cfg.parallel, cfg.precision,
                                      (lambda c: load_full_state_dict(c, full_state)) if full_state else None)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        rows = rows_of(dp_rank, dp)
        batch = RLBatch(tokens=tokens[rows], mask=mask[rows], advantages=adv[rows])
        if old_lp is None:  # the reference run measures pi_theta and perturbs it into pi_old
            lp, _ = compute_logprobs(chunks, batch, micro_batch_size=2, vocab_size=VOCAB, dp_size=dp)
            old = lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(3))
        else:
            old = old_lp[rows]
        batch.old_logprobs = old
        optimizer = build_optimizer(chunks, cfg.optim, cfg.parallel, cfg.precision)
        scheduler = build_scheduler(optimizer, cfg.optim, total_steps=10)
        ctl = DPCCController(cfg.loss.dpcc, total_steps=10)
        before = local_named_tensors(chunks)
        res = policy_update(chunks, optimizer, scheduler, ctl, batch, cfg, dp_size=dp,
                            dp_group=ps.get_data_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
                            vocab_size=VOCAB)
        after = local_named_tensors(chunks)
        grads = {k: before[k] - after[k] for k in before}
        expected = None
        if ref_grads is not None:
            expected = shard_like(chunks, ref_grads[name], ps.get_tensor_model_parallel_rank(),
                                  ps.get_tensor_model_parallel_world_size())
        results[name] = (res.metrics["pg_loss"], grads, res.skipped,
                         before if full_state is None else expected, old if full_state is None else None)
        results["layout"] = (len(chunks), bool(chunks[0].config.sequence_parallel))
        ps.destroy_model_parallel()
    return results


def _all_rows(dp_rank, dp):
    return slice(None)


def _dp_rows(dp_rank, dp):
    return torch.arange(B)[dp_rank::dp]


@pytest.fixture(scope="module")
def reference():
    (res,), = [run_multirank(_update_rank, 1, args=(1, 1, False, None, None, _all_rows))]
    state = res["dpcc"][3]
    old = res["dpcc"][4]
    return state, old, res


@pytest.mark.parametrize("tp,pp,dp,dist_opt,vpp,sp", [
    (2, 1, 1, False, None, False), (1, 2, 1, False, None, False), (2, 2, 1, False, None, False),
    (1, 1, 2, True, None, False),
    # interleaved 1F1B (one layer per virtual chunk) with sequence parallelism; L-1 = 11 targets are
    # padded to 12 for SP, so the padding must stay invisible to the loss and the gradients
    (2, 2, 1, False, 2, True)], ids=["tp2", "pp2", "tp2pp2", "dp2", "tp2pp2vpp2sp"])
def test_update_matches_single_rank(reference, tp, pp, dp, dist_opt, vpp, sp):
    state, old, ref = reference
    rows = _dp_rows if dp > 1 else _all_rows
    ref_grads = {name: ref[name][1] for name in LOSSES}
    results = run_multirank(_update_rank, tp * pp * dp,
                            args=(tp, pp, dist_opt, state, old, rows, ref_grads, vpp, sp), timeout=300)
    for rank_res in results:  # the layout really ran: one chunk per virtual stage, SP on
        assert rank_res["layout"] == (vpp or 1, sp)
    for name in LOSSES:
        ref_loss, ref_grads, ref_skipped, _, _ = ref[name]
        assert not ref_skipped
        assert any(g.abs().max() > 1e-4 for g in ref_grads.values()), "reference update moved nothing"
        for rank_res in results:
            loss, grads, skipped, expected, _ = rank_res[name]
            assert not skipped
            assert abs(loss - ref_loss) < 1e-5, f"{name}: loss {loss} vs {ref_loss}"
            assert set(grads) == set(expected)
            for key, g in grads.items():
                torch.testing.assert_close(g, expected[key], atol=1e-5, rtol=1e-4,
                                           msg=lambda m: f"{name} {key}: {m}")



@pytest.mark.parametrize("tp,pp,dp,dist_opt,sp", [(2, 1, 1, False, False), (2, 1, 1, False, True),
                                                 (1, 2, 1, False, False), (1, 1, 2, True, False)])
def test_token_budget_micro_batches_match_the_padded_single_rank(reference, tp, pp, dp, dist_opt, sp):
    """train.max_tokens_per_micro_batch: rows sorted and packed into micro-batches of different
    shapes (variable sequence lengths through the pipeline; each padded on its own to the TP multiple
    under sequence parallelism) give the padded path's loss and gradients."""
    from dpcc_megatron.megatron.policy_step import RLBatch, micro_batches

    tokens, mask, adv, _ = _data()
    parts, _ = micro_batches(RLBatch(tokens=tokens, mask=mask, advantages=adv), 2, 2 * L)
    assert len({mb.tokens.shape for mb in parts}) > 1  # the budget really gives micro-batches of several shapes
    state, old, ref = reference
    rows = _dp_rows if dp > 1 else _all_rows
    ref_grads = {name: ref[name][1] for name in LOSSES}
    results = run_multirank(_update_rank, tp * pp * dp,
                            args=(tp, pp, dist_opt, state, old, rows, ref_grads, None, sp, 2 * L), timeout=300)
    for name in LOSSES:
        ref_loss = ref[name][0]
        for loss, grads, skipped, expected, _ in (r[name] for r in results):
            assert not skipped and abs(loss - ref_loss) < 1e-5, f"{name}: loss {loss} vs {ref_loss}"
            for key, g in grads.items():
                torch.testing.assert_close(g, expected[key], atol=1e-5, rtol=1e-4,
                                           msg=lambda m: f"{name} {key}: {m}")
