"""The refit gather: HF tensors -> Megatron shards at TP/PP -> gather_hf_weights gives them back exactly."""
import pytest
import torch

from dpcc_megatron.testing import run_multirank

pytestmark = pytest.mark.multirank

VOCAB = 250  # padded to 256 by Megatron: the padding rows must not come back


def _to_local(canonical: str) -> str:
    return (canonical.replace(".self_attention.linear_qkv.layer_norm_", ".input_layernorm.")
            .replace(".mlp.linear_fc1.layer_norm_", ".pre_mlp_layernorm."))


def _roundtrip(rank, world, tp, pp, overrides):
    from megatron.core import parallel_state as ps

    from dpcc_megatron.convert.layout import all_hf_shapes, iter_hf_to_canonical, units
    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.reshard import load_full_state_dict
    from dpcc_megatron.megatron.weight_export import gather_hf_weights
    from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config

    cfg = tiny_model_config(**overrides)
    served = tiny_model_config(**dict(overrides, vocab_size=VOCAB))
    g = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=g) for n, s in all_hf_shapes(served)}
    full = {}
    for u in units(served):
        for name, blocks in iter_hf_to_canonical(served, u, hf.__getitem__):
            full[_to_local(name)] = torch.cat(blocks, 0)
    par = parallel_config(tp, pp)
    init_model_parallel(par, seed=1)
    chunks = [build_gpt_model(cfg, par)]
    load_full_state_dict(chunks, full)
    pairs = gather_hf_weights(chunks, cfg, vocab_size=VOCAB, dtype=torch.float32,
                              tp_group=ps.get_tensor_model_parallel_group(),
                              pp_group=ps.get_pipeline_model_parallel_group())
    if pairs is None:
        return None
    return {"names": [n for n, _ in pairs], "expected": list(hf),
            "gap": max(float((t - hf[n]).abs().max()) for n, t in pairs)}


@pytest.mark.parametrize("tp,pp,overrides", [
    (2, 1, dict(num_layers=2, swiglu=True)),
    (1, 2, dict(num_layers=4, swiglu=True, tie_embeddings=True)),
], ids=["tp2", "pp2-tied"])
def test_gather_returns_the_hf_tensors(tp, pp, overrides):
    results = run_multirank(_roundtrip, tp * pp, args=(tp, pp, overrides), timeout=240)
    assert results[1] is None  # only the model-parallel group's rank 0 holds the gathered weights
    r = results[0]
    assert r["names"] == r["expected"]  # every tensor, in file order, padded vocabulary rows dropped
    assert r["gap"] == 0.0


# -- the streamed refit of a mixture-of-experts model at expert parallelism -------------------------------
MOE = dict(num_layers=2, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, qk_layernorm=True,
           vocab_size=256)


def _moe_stream_rank(rank, world, tp, ep, state, etp=None, pp=1, layers=2):
    """Every bucket of the HF weight stream, as this rank holds it once the stream yields it (what it would
    hand its vLLM worker), and the order of the stream's collectives on this rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.reshard import load_full_state_dict, local_named_tensors, shard_like
    from dpcc_megatron.megatron.weight_export import HFWeightStream, gather_hf_weights
    from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config
    from tests.megatron.test_moe_generate import load_moe_state

    par = parallel_config(tp, pp, expert_model_parallel_size=ep, sequence_parallel=tp > 1,
                          expert_tensor_parallel_size=etp or (1 if tp > 1 else None),
                          moe_token_dispatcher_type="alltoall" if tp == 1 else "allgather")
    init_model_parallel(par, seed=3)
    torch.manual_seed(3)
    cfg = tiny_model_config(**dict(MOE, num_layers=layers))
    chunks = [build_gpt_model(cfg, par)]
    out = {}
    if state is not None:
        load_full_state_dict(chunks, state)  # experts from this rank's EP share, split over expert TP
        mine = local_named_tensors(chunks)
        sliced = shard_like(chunks, state, ps.get_tensor_model_parallel_rank(),
                            ps.get_tensor_model_parallel_world_size())
        out["shard_like_agrees"] = list(sliced) == list(mine) and all(
            torch.equal(sliced[n], t) for n, t in mine.items())
        if pp == 1:  # the test helper that slices experts by hand puts the same values in every parameter
            loaded = local_named_tensors(chunks)
            load_moe_state(chunks, state)
            out["loader_agrees"] = all(torch.equal(loaded[n], t) for n, t in local_named_tensors(chunks).items())
    if ep == 1:  # the whole-model gather (no EP): experts gathered over the expert TP group
        pairs = gather_hf_weights(chunks, cfg, vocab_size=VOCAB, dtype=torch.float32,
                                  tp_group=ps.get_tensor_model_parallel_group(),
                                  pp_group=ps.get_pipeline_model_parallel_group())
        out["whole"] = None if pairs is None else dict(pairs)
    stream = HFWeightStream(cfg, vocab_size=VOCAB, dtype=torch.float32, bucket_bytes=64 * 1024,
                            tp_group=ps.get_tensor_model_parallel_group(),
                            pp_group=ps.get_pipeline_model_parallel_group())
    calls = []  # (collective, group's ranks, source) in the order this rank enters them
    real = {f: getattr(dist, f) for f in ("broadcast", "all_gather")}

    def recording(f):
        def call(*args, group=None, src=None, **kw):
            calls.append((f, tuple(dist.get_process_group_ranks(group)), src))
            return real[f](*args, group=group, **kw) if src is None else real[f](*args, src=src, group=group, **kw)
        return call

    plan = stream.plan(chunks)
    buf = torch.full((max(b.nbytes for b in plan),), 7, dtype=torch.uint8)
    out.update({"buckets": [], "entries": [b.entries for b in plan], "state": local_named_tensors(chunks)})
    for f in real:
        setattr(dist, f, recording(f))
    try:
        for bucket in stream.stream(chunks, lambda b: buf):
            out["buckets"].append({n: buf[off:off + nb].view(torch.float32).view(shape).clone()
                                   for n, shape, off, nb in bucket.entries})
    finally:
        for f, fn in real.items():
            setattr(dist, f, fn)
    out["calls"] = calls
    out["ep_group"] = tuple(dist.get_process_group_ranks(ps.get_expert_model_parallel_group()))
    out["dp_rank"] = ps.get_data_parallel_rank()
    return out


def _same_order_within_each_group(results) -> None:
    """Every group's members enter its collectives in the same order, with the same source: no rank waits
    in one collective while a peer waits in another (the stream cannot hang or mis-pair broadcasts)."""
    groups = {g for r in results for _, g, _ in r["calls"]}
    for g in groups:
        seqs = [[(f, s) for f, gg, s in results[rank]["calls"] if gg == g] for rank in g]
        assert all(s == seqs[0] for s in seqs), g


def _assert_every_rank_holds_the_reference(results, ref) -> None:
    for res in results:  # every rank holds every expert, whichever rank trains it
        assert res["entries"] == ref["entries"]
        assert len(res["buckets"]) == len(ref["buckets"])
        for got, want in zip(res["buckets"], ref["buckets"]):
            for name, t in want.items():
                assert torch.equal(got[name], t), name


@pytest.fixture(scope="module")
def moe_reference():
    return {layers: run_multirank(_moe_stream_rank, 1, args=(1, 1, None, None, 1, layers), timeout=240)[0]
            for layers in (2, 4)}


@pytest.mark.parametrize("tp,ep,etp", [(1, 2, None), (2, 2, None), (2, 1, 2), (2, 1, 1)],
                         ids=["ep2", "tp2ep2", "tp2etp2", "tp2etp1"])
def test_moe_stream_gathers_every_expert_from_its_rank(tp, ep, etp, moe_reference):
    ref = moe_reference[2]
    experts = [n for b in ref["entries"] for n, *_ in b if ".experts." in n]
    assert len(experts) == 2 * 4 * 3  # layers x experts x (gate, up, down), HF per-expert names
    for b in ref["entries"]:  # a layer's experts (vLLM's fused MoE module) never span two buckets
        layers = {n.split(".")[2] for n, *_ in b if ".experts." in n}
        assert all(sum(f"layers.{i}.mlp.experts.{e}." in n for n, *_ in b for e in range(4)) == 12 for i in layers)
    results = run_multirank(_moe_stream_rank, 2, args=(tp, ep, ref["state"], etp), timeout=240)
    assert all(r["loader_agrees"] for r in results)  # load_full_state_dict: experts by EP rank and expert TP
    assert all(r["shard_like_agrees"] for r in results)
    _assert_every_rank_holds_the_reference(results, ref)
    _same_order_within_each_group(results)
    if ep == 1:  # the whole-model gather gives the same tensors (at expert TP 1 the experts are not TP-split)
        want = {n: t for b in ref["buckets"] for n, t in b.items()}
        whole = results[0]["whole"]
        assert results[1]["whole"] is None and list(whole) == list(want)
        assert all(torch.equal(whole[n], t) for n, t in want.items())


@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 4), (1, 2, 2)], ids=["tp2dp2ep4", "pp2dp2ep2"])
def test_moe_stream_with_the_expert_group_across_replicas(tp, pp, ep, moe_reference):
    """4 ranks, two data-parallel replicas of several ranks each (each feeding a vLLM worker of a multi-worker
    engine), the expert-parallel group spanning both replicas: TP2 x DP2 with EP4 (the expert group holds
    both TP ranks of both replicas, as in examples/qwen3_235b_a22b.yaml's TP4 x PP2, EP64) and PP2 x DP2 with
    EP2 (each stage's expert group joins the two replicas; buckets go over the pipeline after the expert
    broadcasts). Every rank ends with the single-rank stream's bytes, bucket by bucket."""
    ref = moe_reference[2 * pp]
    results = run_multirank(_moe_stream_rank, 4, args=(tp, ep, ref["state"], 1 if tp > 1 else None, pp, 2 * pp),
                            timeout=240)
    assert all(r["shard_like_agrees"] for r in results)
    _assert_every_rank_holds_the_reference(results, ref)
    _same_order_within_each_group(results)
    for r in results:  # the expert group joins both replicas, and the experts travelled over it
        assert len(r["ep_group"]) == ep and {results[g]["dp_rank"] for g in r["ep_group"]} == {0, 1}
        assert any(f == "broadcast" and g == r["ep_group"] for f, g, _ in r["calls"])


def test_moe_bucket_plan_names():
    from dpcc_megatron.megatron.weight_export import Bucket, expert_runs, module_of, unit_of_hf

    assert module_of("model.layers.2.mlp.experts.7.down_proj.weight") == "model.layers.2.mlp.experts"
    assert module_of("model.layers.0.block_sparse_moe.experts.1.w3.weight") == "model.layers.0.block_sparse_moe.experts"
    assert module_of("model.layers.0.block_sparse_moe.gate.weight") == "model.layers.0.block_sparse_moe.gate"
    assert unit_of_hf("model.layers.3.block_sparse_moe.experts.5.w1.weight") == (3, 5)
    assert unit_of_hf("model.layers.3.mlp.gate.weight") == 3
    entries = (("model.layers.0.mlp.gate.weight", (4, 8), 0, 128),
               *((f"model.layers.0.mlp.experts.{e}.down_proj.weight", (8, 4), 128 + 192 * e, 128) for e in range(4)))
    assert expert_runs(Bucket(0, 0, entries, 1000), 2) == [(0, 128, 448), (1, 512, 832)]
    assert expert_runs(Bucket(0, 0, entries, 1000), 0) == []
