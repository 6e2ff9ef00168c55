"""The sample is decided once per TP group: only TP rank 0 of the last stage draws (TP2, CPU gloo)."""
import pytest
import torch

from dpcc_megatron.testing import run_multirank
from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config

pytestmark = pytest.mark.multirank

VOCAB = 250
PROMPTS = [[5, 9, 13], [7, 8], [20, 21, 22, 23]] * 2


def _tp2(rank, world):
    from megatron.core import parallel_state as ps

    from dpcc_megatron.megatron.generate import generate, model_device, rollout_generator
    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.megatron.parallel import init_model_parallel

    par = parallel_config(2, 1)
    init_model_parallel(par, seed=7)
    torch.manual_seed(7)
    model = build_gpt_model(tiny_model_config(vocab_size=VOCAB, init_method_std=0.1), par)
    gen = rollout_generator([model], seed=11)
    before = gen.get_state().clone()
    out = generate([model], PROMPTS, max_new_tokens=6, eos_id=None, pad_id=0, vocab_size=VOCAB,
                   temperature=1.0, generator=gen, tp_group=ps.get_tensor_model_parallel_group(),
                   pp_group=ps.get_pipeline_model_parallel_group())
    return {"tp_rank": ps.get_tensor_model_parallel_rank(), "consumed": not torch.equal(before, gen.get_state()),
            "tokens": out.tokens, "policy_lp": out.policy_logprobs, "gen_device": str(gen.device),
            "model_device": str(model_device([model]))}


def test_only_tp_rank_0_draws_and_every_rank_gets_its_sample():
    r0, r1 = run_multirank(_tp2, 2, timeout=240)
    assert (r0["tp_rank"], r1["tp_rank"]) == (0, 1)
    assert r0["consumed"] and not r1["consumed"]  # rank 1's generator was never touched
    assert torch.equal(r0["tokens"], r1["tokens"])
    assert torch.equal(r0["policy_lp"], r1["policy_lp"])  # the sampler's log-probs are shared too
    assert r0["gen_device"] == r0["model_device"] == "cpu"
