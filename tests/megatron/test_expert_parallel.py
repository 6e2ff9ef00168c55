"""A policy update of a mixture-of-experts model (Qwen3-MoE shape: QK layernorm, 4 experts, top-2,
load-balancing and z-loss on) at EP=2 (experts split over two data-parallel ranks, all-to-all
dispatch) and at TP2 x EP2 (experts split over the two TP ranks, sequence parallel, all-gather
dispatch) equals one rank on the full batch: same loss, same gradients, same MoE record fields.

Gradients are read back from one Adam step with lr = eps = 1e3 (see test_policy_step.py). The
data-parallel split keeps the reference's micro-batches whole (rows 0-3 on rank 0, 4-7 on rank 1,
two rows per micro-batch), because the load-balancing loss is per micro-batch and not additive.
"""
import math
import re

import pytest
import torch

from dpcc_megatron.testing import run_multirank
from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config

pytestmark = pytest.mark.multirank

B, L, VOCAB, EXPERTS = 8, 13, 200, 4  # L - 1 = 12 targets: no sequence-parallel padding at TP=2
_EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$")
RECORD_KEYS = ("moe_load_balancing_loss", "moe_z_loss", "moe_load_entropy", "moe_load_max_over_mean",
               "moe_load_entropy_l0", "moe_load_max_over_mean_l3", "moe_dropped_tokens")


def _job(tp, ep, dispatcher):
    """The job, through the config loader (so the cross-section EP checks run too)."""
    from dpcc_megatron.config import JobConfig, from_dict, to_dict

    model = to_dict(tiny_model_config(num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=32,
                                      qk_layernorm=True, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001))
    par = to_dict(parallel_config(tp, 1, expert_model_parallel_size=ep, sequence_parallel=tp > 1,
                                  expert_tensor_parallel_size=1 if tp > 1 else None,
                                  moe_token_dispatcher_type=dispatcher))
    return from_dict(JobConfig, {"model": model, "parallel": par, "loss": {"name": "grpo"},
                                 "optim": {"name": "adam", "lr": 1e3, "adam_eps": 1e3, "clip_grad": 0.0},
                                 "train": {"mini_batch_size": B, "micro_batch_size": 2}})


def _data():
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (B, L), generator=g)
    mask = torch.zeros(B, L - 1, dtype=torch.bool)
    for i in range(B):
        mask[i, 2 + i % 3: 6 + i % 5] = True
    return tokens, mask, torch.randn(B, generator=g)


def _experts_global(named: dict, ep_rank: int, local: int) -> dict:
    """Rename local expert indices to global ones (EP rank r holds experts r*local .. r*local+local-1)."""
    out = {}
    for name, t in named.items():
        m = _EXPERT.match(name)
        out[f"{m.group(1)}{ep_rank * local + int(m.group(2))}{m.group(3)}" if m else name] = t
    return out


def _perturbed(lp):
    return lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(3))


def _optimizer(chunks, cfg):
    from dpcc_megatron.megatron.optimizer import build_optimizer, build_scheduler

    optimizer = build_optimizer(chunks, cfg.optim, cfg.parallel, cfg.precision)
    return optimizer, build_scheduler(optimizer, cfg.optim, total_steps=10)


def _update_rank(rank, world, tp, ep, dispatcher, state, old_lp):
    from megatron.core import parallel_state as ps

    from dpcc_megatron.algo import DPCCController
    from dpcc_megatron.megatron.optimizer import build_training_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.policy_step import RLBatch, compute_logprobs
    from dpcc_megatron.megatron.reshard import _tp_slice, local_named_tensors
    from dpcc_megatron.train.update import policy_update

    cfg = _job(tp, ep, dispatcher)
    init_model_parallel(cfg.parallel, seed=5)
    torch.manual_seed(5)
    ep_rank, local = ps.get_expert_model_parallel_rank(), EXPERTS // ep
    tp_rank = ps.get_tensor_model_parallel_rank()

    def load(chunks):
        for c in chunks:
            for name, p in c.named_parameters():
                key = _experts_global({name: None}, ep_rank, local).popitem()[0]
                value = state[key] if ".local_experts." in name else _tp_slice(state[key], p, name, c, tp_rank, tp)
                with torch.no_grad():
                    p.copy_(value)

    chunks = build_training_model(cfg.model, cfg.parallel, cfg.precision, load if state else None)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = slice(dp_rank * B // dp, (dp_rank + 1) * B // dp)
    tokens, mask, adv = _data()
    batch = RLBatch(tokens=tokens[rows], mask=mask[rows], advantages=adv[rows])
    # pi_old: the reference measures pi_theta and perturbs it; the others take the reference's rows
    old = old_lp[rows] if old_lp is not None else _perturbed(
        compute_logprobs(chunks, batch, micro_batch_size=2, vocab_size=VOCAB, dp_size=dp)[0])
    batch.old_logprobs = old
    optimizer, scheduler = _optimizer(chunks, cfg)
    before = _experts_global(local_named_tensors(chunks), ep_rank, local)
    res = policy_update(chunks, optimizer, scheduler, DPCCController(cfg.loss.dpcc, total_steps=10), batch, cfg,
                        dp_size=dp, dp_group=ps.get_data_parallel_group(),
                        pp_group=ps.get_pipeline_model_parallel_group(), vocab_size=VOCAB)
    after = _experts_global(local_named_tensors(chunks), ep_rank, local)
    grads = {k: before[k] - after[k] for k in before}
    out = {"loss": res.metrics["pg_loss"], "grads": grads, "skipped": res.skipped, "before": before,
           "old": old, "metrics": res.metrics, "tp_rank": tp_rank}
    if state is None:  # the reference also counts what a capacity factor of 0.5 drops
        out["capacity"] = _capacity_drops(cfg, batch)
    return out


def _capacity_drops(cfg, batch):
    import dataclasses

    from megatron.core import parallel_state as ps

    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.megatron.moe import moe_metrics, router_stats
    from dpcc_megatron.megatron.policy_step import compute_logprobs

    model = build_gpt_model(dataclasses.replace(cfg.model, moe_expert_capacity_factor=0.5), cfg.parallel)
    with router_stats([model]) as stats:
        compute_logprobs([model], batch, micro_batch_size=2, vocab_size=VOCAB, dp_size=1)
    return moe_metrics(stats, dp_group=ps.get_data_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
                       num_micro_batches=4)


@pytest.fixture(scope="module")
def reference():
    (res,) = run_multirank(_update_rank, 1, args=(1, 1, "alltoall", None, None), timeout=300)
    assert not res["skipped"]
    return res


@pytest.mark.parametrize("tp,ep,dispatcher", [(1, 2, "alltoall"), (2, 2, "allgather")], ids=["ep2", "tp2ep2"])
def test_update_matches_single_rank(reference, tp, ep, dispatcher):
    results = run_multirank(_update_rank, 2, args=(tp, ep, dispatcher, reference["before"], reference["old"]),
                            timeout=300)
    ref_grads = reference["grads"]
    experts = [k for k in ref_grads if ".local_experts." in k]
    assert len(experts) == 4 * EXPERTS * 2 and any(ref_grads[k].abs().max() > 1e-4 for k in experts)
    router = [k for k in ref_grads if k.endswith("mlp.router.weight")]
    assert router and all(ref_grads[k].abs().max() > 0 for k in router)
    seen = set()
    for res in results:
        assert not res["skipped"]
        assert abs(res["loss"] - reference["loss"]) < 1e-5
        for key, g in res["grads"].items():
            want = ref_grads[key]
            if g.shape != want.shape:  # a TP-sharded dense weight: compare this rank's slice
                dim = next(d for d in range(g.dim()) if g.shape[d] != want.shape[d])
                want = torch.chunk(want, tp, dim=dim)[res["tp_rank"]]
            torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-4, msg=lambda m: f"{key}: {m}")
        seen |= {k for k in res["grads"] if ".local_experts." in k}
        for key in RECORD_KEYS:
            assert res["metrics"][key] == pytest.approx(reference["metrics"][key], abs=1e-5), key
    assert seen == set(experts), "the two ranks hold all experts between them"


def test_record_fields_are_consistent(reference):
    m = reference["metrics"]
    assert m["moe_load_balancing_loss"] >= 1.0 - 1e-6  # Switch loss: 1 at perfect balance, more otherwise
    assert m["moe_z_loss"] > 0 and m["moe_dropped_tokens"] == 0.0  # dropless by default
    assert 0.0 < m["moe_load_entropy"] <= 1.0 and 1.0 <= m["moe_load_max_over_mean"] <= EXPERTS
    assert m["moe_load_entropy"] == min(m[f"moe_load_entropy_l{i}"] for i in range(4))


def test_capacity_factor_drops_are_counted(reference):
    m = reference["capacity"]
    assigned = 4 * B * (L - 1) * 2  # layers x tokens x top-k
    # capacity 0.5: each expert keeps at most half its even share, so at least half is dropped
    assert m["moe_dropped_tokens"] >= assigned / 2 and m["moe_dropped_frac"] == pytest.approx(
        m["moe_dropped_tokens"] / assigned)
    from importlib.metadata import version

    if tuple(int(x) for x in version("megatron-core").split(".")[:2]) < (0, 17):
        assert "moe_z_loss" not in m  # no backward pass: 0.16 computes no auxiliary loss
    else:  # 0.17+ track the router's losses in forward-only passes too
        assert math.isfinite(m["moe_z_loss"]) and m["moe_z_loss"] >= 0


def test_load_summary():
    from dpcc_megatron.megatron.moe import load_summary

    s = load_summary(torch.tensor([[5.0, 5.0, 5.0, 5.0], [20.0, 0.0, 0.0, 0.0]], dtype=torch.float64))
    assert s["max_over_mean"].tolist() == pytest.approx([1.0, 4.0])
    assert s["entropy"].tolist() == pytest.approx([1.0, 0.0])
