"""Vocab-parallel log-prob, entropy and KL equal a full-softmax reference, values and gradients."""
import pytest
import torch

from dpcc_megatron.megatron.vocab_parallel import TokenStats, vocab_parallel_token_stats
from dpcc_megatron.testing import run_multirank

V, V_PAD, S, B = 50, 64, 5, 3  # V=50 padded to 64: every TP size below has padding in its last shard
BOUNDARY_IDS = [0, 15, 16, 31, 32, 47, 48, 49]  # first/last columns of the shards at TP=2 and TP=4
TOL = 1e-5


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(S, B, V_PAD, generator=g) * 3
    ref = logits + torch.randn(S, B, V_PAD, generator=g)  # a nearby reference policy
    targets = torch.randint(0, V, (S * B,), generator=g)
    targets[:len(BOUNDARY_IDS)] = torch.tensor(BOUNDARY_IDS)
    weights = {k: torch.randn(S, B, generator=g) for k in ("logprobs", "entropy", "ref_kl")}
    return logits, ref, targets.view(S, B), weights


def _reference(logits, ref, targets, vocab_size, weights):
    """Full-softmax values on the unpadded vocabulary (fp64) and their gradients w.r.t. the padded logits."""
    z = logits.double().requires_grad_()
    lp = z[..., :vocab_size].log_softmax(-1)
    p = lp.exp()
    lq = ref.double()[..., :vocab_size].log_softmax(-1)
    out = {"logprobs": lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1),
           "entropy": -(p * lp).sum(-1), "ref_kl": (p * (lp - lq)).sum(-1)}
    grads = {k: torch.autograd.grad(v, z, weights[k], retain_graph=True)[0] for k, v in out.items()}
    return {k: v.detach() for k, v in out.items()}, grads


def _op(z, targets, group, weights, **kw):
    """Run the op on a shard; return its outputs and the shard gradient of each output separately."""
    z = z.detach().requires_grad_()
    st = vocab_parallel_token_stats(z, targets, group=group, **kw)
    out = {k: getattr(st, k) for k in ("logprobs", "entropy", "ref_kl") if getattr(st, k) is not None}
    grads = {k: torch.autograd.grad(v, z, weights[k], retain_graph=True)[0] for k, v in out.items()}
    return {"out": {k: v.detach() for k, v in out.items()}, "grads": grads,
            "nonfinite": st.nonfinite, "mask": st.nonfinite_mask}


def _cases(logits, ref):
    bad = logits.clone()
    bad[1, 2, 48] = float("nan")  # in the last shard at TP=2 and TP=4
    bad[3, 0, 5] = float("inf")   # in the first shard
    return {  # name: (logits, ref_logits, op kwargs)
        "fp32": (logits, ref, dict(vocab_size=V, chunk_size=4)),
        "bf16": (logits.bfloat16(), ref.bfloat16(), dict(vocab_size=V, chunk_size=7)),
        # vocab_size=30: whole shards are padding at TP=2 and TP=4
        "all_padding_shard": (logits, ref, dict(vocab_size=30, chunk_size=1024)),
        "logprobs_only": (logits, None, dict(vocab_size=V, chunk_size=6, with_entropy=False)),
        "nonfinite": (bad, ref, dict(vocab_size=V, chunk_size=4)),
    }


def _rank(rank, world, logits, ref, targets, weights):
    """Run every case at TP=1, 2 and 4 inside one 4-rank world (one spawn instead of three).

    TP=2 uses the groups {0,1} and {2,3}, TP=1 a singleton group per rank, so the op must use
    its rank within the group, not the global rank.
    """
    import torch.distributed as dist

    groups = {1: [[r] for r in range(world)], 2: [[0, 1], [2, 3]], 4: [list(range(world))]}
    results = {}
    for tp, members in groups.items():
        handles = [dist.new_group(m) for m in members]  # collective: every rank creates every group
        index = next(i for i, m in enumerate(members) if rank in m)
        group, tp_rank = handles[index], members[index].index(rank)
        cols = slice(tp_rank * V_PAD // tp, (tp_rank + 1) * V_PAD // tp)
        results[tp] = {"group": index, "cases": {}}
        for name, (z, r, kw) in _cases(logits, ref).items():
            results[tp]["cases"][name] = _op(
                z[..., cols], targets.remainder(kw["vocab_size"]), group, weights,
                ref_logits=None if r is None else r[..., cols], **kw)
    return results


@pytest.mark.multirank
def test_matches_full_softmax_reference_at_tp_1_2_4():
    logits, ref, targets, weights = _inputs()
    per_rank = run_multirank(_rank, 4, args=(logits, ref, targets, weights), timeout=240)
    for name, (z, r, kw) in _cases(logits, ref).items():
        t = targets.remainder(kw["vocab_size"])
        r_full = (ref if r is None else r).float()
        want, want_grads = _reference(z.float(), r_full, t, kw["vocab_size"], weights)
        mask = torch.zeros(S, B, dtype=torch.bool)
        if name == "nonfinite":
            mask[1, 2] = mask[3, 0] = True
            want, want_grads = _reference(logits, ref, t, V, weights)  # clean logits for the others
        for tp in (1, 2, 4):
            for group in range(4 // tp):
                ranks = [res[tp]["cases"][name] for res in per_rank if res[tp]["group"] == group]
                assert len(ranks) == tp
                _check(f"{name} tp={tp} group={group}", ranks, z.dtype, r is None, mask, want,
                       want_grads, kw["vocab_size"])


def _check(label, ranks, dtype, no_ref, mask, want, want_grads, vocab_size):
    for res in ranks:  # every TP rank sees the same values and the same non-finite verdict
        assert int(res["nonfinite"]) == int(mask.sum()) and torch.equal(res["mask"], mask), label
        for k, v in res["out"].items():
            assert torch.equal(v[mask], torch.zeros_like(v[mask])), f"{label} {k}: bad token not zeroed"
    keys = ["logprobs"] if no_ref else ["logprobs", "entropy", "ref_kl"]
    assert sorted(ranks[0]["out"]) == sorted(keys), label
    for k in keys:
        for rank, res in enumerate(ranks):
            err = (res["out"][k].double() - want[k])[~mask].abs().max().item()
            assert err < TOL, f"{label} rank={rank} {k}: max error {err:.2e}"
        assert all(res["grads"][k].dtype == dtype for res in ranks), f"{label} {k}: grad dtype"
        grad = torch.cat([res["grads"][k] for res in ranks], -1).double()  # shards in TP-rank order
        assert grad.shape == (S, B, V_PAD)
        assert torch.isfinite(grad).all(), f"{label} {k}: non-finite gradient"
        assert not grad[mask].any(), f"{label} {k}: gradient on a bad token"
        assert not grad[..., vocab_size:].any(), f"{label} {k}: padding columns got gradient"
        diff = (grad - want_grads[k])[~mask].abs()
        bound = TOL + (8e-3 * want_grads[k][~mask].abs() if dtype == torch.bfloat16 else 0)
        assert (diff <= bound).all(), f"{label} {k} grad: max error {diff.max().item():.2e}"


# ---- single process, no torch.distributed ----

def test_no_distributed_fp16_noncontiguous_and_chunking():
    logits, ref, targets, weights = _inputs(seed=1)
    # [b, s, V] transposed to Megatron's [s, b, V]: a non-contiguous view, as a model may hand over.
    z = logits.transpose(0, 1).contiguous().transpose(0, 1).half()
    assert not z.is_contiguous()
    want, want_grads = _reference(z.float(), ref.half().float(), targets, V, weights)
    runs = [_op(z, targets, None, weights, vocab_size=V, ref_logits=ref.half(), chunk_size=c)
            for c in (1, 4, 10_000)]
    for res in runs:
        for k in ("logprobs", "entropy", "ref_kl"):
            assert (res["out"][k].double() - want[k]).abs().max() < TOL, k
            g = res["grads"][k]
            assert g.dtype == torch.float16 and g.shape == z.shape
            assert (g.double() - want_grads[k]).abs().max() < 2e-3, k  # fp16 rounding of the grad
    for k in ("logprobs", "entropy", "ref_kl"):  # chunking changes nothing
        assert torch.allclose(runs[0]["out"][k], runs[2]["out"][k], atol=1e-6)
        assert torch.allclose(runs[0]["grads"][k].float(), runs[2]["grads"][k].float(), atol=1e-3)


def test_kl_to_itself_is_zero_and_ref_gets_no_grad():
    logits, _, targets, _ = _inputs(seed=2)
    z = logits.requires_grad_()
    ref = logits.detach().clone().requires_grad_()
    st = vocab_parallel_token_stats(z, targets, vocab_size=V, ref_logits=ref)
    assert torch.equal(st.ref_kl, torch.zeros(S, B))
    (st.logprobs.sum() + st.ref_kl.sum()).backward()
    assert ref.grad is None and z.grad is not None


def test_partial_outputs_backward_and_no_grad():
    logits, ref, targets, weights = _inputs(seed=3)
    want, want_grads = _reference(logits, ref, targets, V, weights)
    z = logits.clone().requires_grad_()
    st = vocab_parallel_token_stats(z, targets, vocab_size=V, ref_logits=ref)
    (st.entropy * weights["entropy"]).sum().backward()  # logprobs and KL unused
    assert (z.grad.double() - want_grads["entropy"]).abs().max() < TOL
    with torch.no_grad():  # old/reference log-prob passes
        st = vocab_parallel_token_stats(logits, targets, vocab_size=V, with_entropy=False)
    assert st.entropy is None and st.ref_kl is None and not st.logprobs.requires_grad
    assert (st.logprobs.double() - want["logprobs"]).abs().max() < TOL


def test_neg_inf_padding_is_not_nonfinite():
    logits, ref, targets, weights = _inputs(seed=4)
    z = logits.clone()
    z[..., V:] = float("-inf")  # callers often mask padding this way themselves
    res = _op(z, targets, None, weights, vocab_size=V, ref_logits=ref)
    want, _ = _reference(logits, ref, targets, V, weights)
    assert int(res["nonfinite"]) == 0
    assert (res["out"]["entropy"].double() - want["entropy"]).abs().max() < TOL


@pytest.mark.parametrize("where,value", [("logits", float("-inf")), ("ref", float("nan")),
                                         ("ref", float("inf")), ("logits", float("nan"))])
def test_nonfinite_tokens_are_counted_zeroed_and_get_no_grad(where, value):
    logits, ref, targets, weights = _inputs(seed=5)
    z, r = logits.clone(), ref.clone()
    (z if where == "logits" else r)[2, 1, 7] = value
    res = _op(z, targets, None, weights, vocab_size=V, ref_logits=r)
    assert int(res["nonfinite"]) == 1 and res["mask"][2, 1] and res["mask"].sum() == 1
    for k, v in res["out"].items():
        assert torch.isfinite(v).all() and v[2, 1] == 0, k
        g = res["grads"][k]
        assert torch.isfinite(g).all() and not g[2, 1].any(), k


def test_bad_input_errors():
    logits, ref, targets, _ = _inputs()
    f = vocab_parallel_token_stats
    with pytest.raises(ValueError, match=r"targets shape \(3, 5\).*\(5, 3, 64\)"):
        f(logits, targets.T, vocab_size=V)
    with pytest.raises(ValueError, match=r"ref_logits shape \(5, 3, 63\)"):
        f(logits, targets, vocab_size=V, ref_logits=ref[..., :63])
    with pytest.raises(ValueError, match=r"logits must be \[s, b, V/tp\]; got shape \(15, 64\)"):
        f(logits.view(-1, V_PAD), targets.view(-1), vocab_size=V)
    too_big, negative = targets.clone(), targets.clone()
    too_big[4, 2], negative[0, 1] = V, -1  # V is a padding column's id
    with pytest.raises(ValueError, match=r"targets must be token ids in \[0, 50\).*max 50"):
        f(logits, too_big, vocab_size=V)
    with pytest.raises(ValueError, match=r"min -1"):
        f(logits, negative, vocab_size=V)
    with pytest.raises(ValueError, match="vocab_size=65"):
        f(logits, targets, vocab_size=65)
    with pytest.raises(ValueError, match="integer token ids"):
        f(logits, targets.float(), vocab_size=V)
    with pytest.raises(ValueError, match="floating point"):
        f(logits.long(), targets, vocab_size=V)
    with pytest.raises(ValueError, match="chunk_size"):
        f(logits, targets, vocab_size=V, chunk_size=0)
    st = f(logits, targets)  # vocab_size defaults to the full (unpadded) width
    assert isinstance(st, TokenStats) and st.logprobs.shape == (S, B)
