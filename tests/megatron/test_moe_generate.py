"""The Megatron engine on a mixture-of-experts model (Qwen3-MoE shape: QK layernorm, 4 experts, top-2):
KV-cached generation at EP2 (experts split over two data-parallel replicas, all-to-all dispatch) and at
TP2 x EP2 (experts split over the TP ranks) gives the single-rank model's greedy tokens, and the routing
it records per decode step (routing replay's sampler routing) is the single rank's.

At EP2 the two replicas generate different prompts (different counts, lengths and stop steps), so their
MoE layers exchange tokens for different numbers of forwards: the replica that finishes first runs dummy
forwards until its peer is done (counted here), instead of leaving the peer's all-to-all waiting.
"""
import re

import pytest
import torch

from dpcc_megatron.testing import run_multirank
from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config

pytestmark = pytest.mark.multirank

VOCAB, NEW, EXPERTS = 250, 8, 4
BASE = [[(7 * i + 3 * j) % 240 + 5 for j in range(n)] for i, n in enumerate((3, 9, 5, 6, 4, 7))]
PROMPTS = [p for p in BASE for _ in range(2)]
# init std 0.1: peaked logits, so greedy has no near-ties
MODEL = dict(vocab_size=VOCAB, init_method_std=0.1, num_moe_experts=EXPERTS, moe_router_topk=2,
             moe_ffn_hidden_size=32, qk_layernorm=True)
_EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$")
# EP2: which prompts each replica generates (rank 1 fewer, and in another KV-cache batch size)
SHARES = {0: (list(range(0, 12)), 5), 1: (list(range(3, 8)), 2)}


def _par(tp, ep):
    return parallel_config(tp, 1, expert_model_parallel_size=ep, sequence_parallel=tp > 1,
                           expert_tensor_parallel_size=1 if tp > 1 else None,
                           moe_token_dispatcher_type="alltoall" if tp == 1 else "allgather")


def load_moe_state(chunks, state: dict) -> None:
    """Copy the single-rank (canonical, global expert indices) ``state`` into this rank's EP/TP shards."""
    from megatron.core import parallel_state as ps

    from dpcc_megatron.megatron.reshard import _tp_slice

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    etp, etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    for c in chunks:
        local = c.config.num_moe_experts // c.config.expert_model_parallel_size
        for name, p in c.named_parameters():
            m = _EXPERT.match(name)
            if m:  # under its global index; split over the expert TP group (fc1: gate and up halves each)
                value = state[f"{m.group(1)}{ep_rank * local + int(m.group(2))}{m.group(3)}"]
                if etp > 1:
                    dim = p.partition_dim
                    halves = torch.chunk(value, 2, dim=dim) if name.endswith("linear_fc1.weight") else (value,)
                    value = torch.cat([torch.chunk(h, etp, dim=dim)[etp_rank] for h in halves], dim=dim)
            else:
                value = _tp_slice(state[name], p, name, c, tp_rank, tp)
            with torch.no_grad():
                p.copy_(value)


def _generate(chunks, prompts, batch_size, eos, cache=True):
    from megatron.core import parallel_state as ps

    from dpcc_megatron.megatron.generate import generate

    return generate(chunks, prompts, max_new_tokens=NEW, eos_id=eos, pad_id=0, vocab_size=VOCAB, temperature=0.0,
                    tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
                    batch_size=batch_size, record_routing=True, use_kv_cache=cache)


def _rank(rank, world, tp, ep, state, eos):
    from dpcc_megatron.megatron import generate as generate_mod
    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.reshard import local_named_tensors

    par = _par(tp, ep)
    init_model_parallel(par, seed=7)
    torch.manual_seed(7)
    model = build_gpt_model(tiny_model_config(**MODEL), par)
    if state is not None:
        load_moe_state([model], state)
    drained = []
    real_drain = generate_mod._drain
    generate_mod._drain = lambda *a: drained.append(real_drain(*a)) or drained[-1]
    idx, batch_size = SHARES[rank] if tp == 1 and ep > 1 else (list(range(len(PROMPTS))), 5)
    out = _generate([model], [PROMPTS[i] for i in idx], batch_size, eos)
    res = {"idx": idx, "responses": out.responses(), "routing": out.routing, "drained": drained,
           "lens": (out.prompt_lens + out.response_lens).tolist()}
    if state is None:
        res["state"] = local_named_tensors([model])
    if world == 1:
        res["nocache"] = _generate([model], PROMPTS, None, eos, cache=False)
    return res


@pytest.fixture(scope="module")
def reference():
    (first,) = run_multirank(_rank, 1, args=(1, 1, None, None), timeout=300)
    eos = first["responses"][0][3]  # some rows stop early, at different steps
    (res,) = run_multirank(_rank, 1, args=(1, 1, first["state"], eos), timeout=300)
    res["eos"], res["state"] = eos, first["state"]
    return res


def _inputs(routing, lens, i):
    """Row i's routing of the positions it fed (all but its last token)."""
    return routing[i, :lens[i] - 1]


def test_single_rank_routing_is_recorded_per_decode_step(reference):
    """The KV-cached decode records each token's experts once, as it feeds it: the same as recomputing the
    whole prefix every step (no cache), on every fed position."""
    r = reference
    assert r["routing"].shape[2:] == (4, 2) and r["routing"].dtype == torch.int16
    assert r["nocache"].responses() == r["responses"]
    assert any(len(x) < NEW for x in r["responses"]) and any(len(x) == NEW for x in r["responses"])
    agree = [(_inputs(r["routing"], r["lens"], i) == _inputs(r["nocache"].routing, r["lens"], i)).all(-1)
             for i in range(len(PROMPTS))]
    frac = float(torch.cat([a.flatten() for a in agree]).float().mean())
    assert frac > 0.99, frac
    assert all((x[..., 0] != x[..., 1]).all() for x in (_inputs(r["routing"], r["lens"], i) for i in range(4)))


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2)], ids=["ep2", "tp2ep2"])
def test_moe_generation_matches_single_rank(reference, tp, ep):
    results = run_multirank(_rank, 2, args=(tp, ep, reference["state"], reference["eos"]), timeout=300)
    for res in results:
        want = [reference["responses"][i] for i in res["idx"]]
        assert res["responses"] == want
        for j, i in enumerate(res["idx"]):
            mine = _inputs(res["routing"], res["lens"], j)
            ref = _inputs(reference["routing"], reference["lens"], i)
            assert float((mine == ref).all(-1).float().mean()) > 0.99, (i, mine, ref)
    if tp == 1:
        # different work on the two replicas: the one done first ran dummy forwards for its peer
        assert results[0]["drained"] == [0] and results[1]["drained"][0] > 0
    else:
        assert all(r["drained"] == [] for r in results)  # the expert group is the TP group: no lock-step
