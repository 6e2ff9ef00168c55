"""Rollout generation with Megatron-Core: KV cache, vocab shards, TP/PP layouts against one rank."""
import pytest
import torch

from dpcc_megatron.testing import run_multirank
from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config

pytestmark = pytest.mark.multirank

VOCAB = 250  # Megatron pads it to 256 at TP=1 and TP=2: six padding columns
NEW = 10
BASE = [[(7 * i + 3 * j) % 240 + 5 for j in range(n)] for i, n in enumerate((3, 9, 5, 6, 4, 7))]
PROMPTS = [p for p in BASE for _ in range(2)]  # groups of G=2
SAMPLING = dict(temperature=0.9, top_k=40, top_p=0.95, batch_size=5)
# init std 0.1 (not 0.02) makes the random model's logits peaked enough that greedy has no near-ties.
MODEL = dict(vocab_size=VOCAB, init_method_std=0.1)


def _build(tp, pp, vpp=None, state=None, sp=False):
    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.reshard import load_full_state_dict

    par = parallel_config(tp, pp, virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sp)
    init_model_parallel(par, seed=7)
    torch.manual_seed(7)
    chunks = [build_gpt_model(tiny_model_config(**MODEL), par, vp_stage=v if vpp else None)
              for v in range(vpp or 1)]
    if state is not None:
        load_full_state_dict(chunks, state)
    return chunks


def _generate(chunks, **kw):
    from megatron.core import parallel_state as ps

    from dpcc_megatron.megatron.generate import generate

    seed = kw.pop("seed", None)
    args = dict(max_new_tokens=NEW, eos_id=None, pad_id=0, vocab_size=VOCAB, temperature=0.0,
                tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
                generator=None if seed is None else torch.Generator().manual_seed(seed))
    args.update(kw)
    return generate(chunks, PROMPTS, **args)


def _full_logprobs(model, rollout, **sampling):
    """Log-probs of the generated tokens from one uncached forward over the whole sequences."""
    from dpcc_megatron.rollout import process_logits

    tokens = rollout.tokens
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    model.eval()
    with torch.no_grad():
        logits = model(tokens, pos, None, runtime_gather_output=True)[:, :-1, :VOCAB].float()
    target = tokens[:, 1:, None]
    policy = torch.log_softmax(logits, -1).gather(-1, target)[..., 0]
    processed = torch.log_softmax(process_logits(logits, sampling["temperature"], sampling["top_k"],
                                                 sampling["top_p"]), -1).gather(-1, target)[..., 0]
    return policy, processed


def _reference(model):
    """Single-rank runs of the whole model (rank 0 of a DP-only layout)."""
    out = {"errors": []}
    for bad in (dict(max_new_tokens=60), dict(vocab_size=300)):
        try:
            _generate(model, **bad)
        except ValueError as e:
            out["errors"].append(str(e))
    out["greedy"] = _generate(model)
    out["still_training"] = model.training
    out["greedy_nocache"] = _generate(model, use_kv_cache=False)
    out["eos"] = _generate(model, eos_id=out["greedy"].responses()[0][3], batch_size=5)
    out["eos_nocache"] = _generate(model, eos_id=out["greedy"].responses()[0][3], batch_size=5, use_kv_cache=False)
    out["sampled"] = _generate(model, seed=11, **SAMPLING)
    out["sampled_again"] = _generate(model, seed=11, **SAMPLING)
    out["sampled_other_seed"] = _generate(model, seed=12, **SAMPLING)
    out["top1"] = _generate(model, seed=11, temperature=1.0, top_k=1)
    out["full_logprobs"] = _full_logprobs(model, out["sampled"], **SAMPLING)
    out["flat"] = _generate(model, seed=13, temperature=50.0, max_new_tokens=32)
    return out


def _all_rank(rank, world, layouts):
    """One launch for everything (starting ranks costs more than generating): the TP=1/PP=1
    reference on rank 0, then every layout on all ranks, from the same canonical weights."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from dpcc_megatron.megatron.reshard import load_full_state_dict, local_named_tensors

    model, = _build(1, 1)  # seeded: the same weights on every rank
    state = local_named_tensors([model])
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        state[key] = state[key][:VOCAB]  # canonical form: unpadded vocabulary
    load_full_state_dict([model], state)  # padding rows zero, as every layout loads them
    ref = _reference(model) if rank == 0 else None
    eos = [ref["greedy"].responses()[0][3] if rank == 0 else None]
    dist.broadcast_object_list(eos, src=0)
    ps.destroy_model_parallel()

    out = {"ref": ref, "eos_id": eos[0], "layouts": {}}
    for name, (tp, pp, vpp, sp) in layouts.items():
        chunks = _build(tp, pp, vpp, state, sp)
        out["layouts"][name] = (_generate(chunks), _generate(chunks, seed=11, **SAMPLING),
                                _generate(chunks, eos_id=eos[0], batch_size=5))
        if sp:  # real Megatron modules: SP was switched off to generate, and is back on afterwards
            out["sp_restored"] = (all(c.config.sequence_parallel for c in chunks), sorted(
                {type(m).__name__ for c in chunks for m in c.modules()
                 if getattr(m, "sequence_parallel", None) is True or getattr(m, "reduce_scatter_embeddings", None)}))
        ps.destroy_model_parallel()
    return out


LAYOUTS = {"tp2": (2, 1, None, False), "pp2": (1, 2, None, False), "pp2_vpp2": (1, 2, 2, False),
           "tp2_pp2": (2, 2, None, False), "tp2_pp2_vpp2_sp": (2, 2, 2, True)}


@pytest.fixture(scope="module")
def runs():
    return run_multirank(_all_rank, 4, args=(LAYOUTS,), timeout=600)


@pytest.fixture(scope="module")
def ref(runs):
    return dict(runs[0]["ref"], eos_id=runs[0]["eos_id"])


def test_kv_cache_equals_full_recompute(ref):
    assert torch.equal(ref["greedy"].tokens, ref["greedy_nocache"].tokens)
    torch.testing.assert_close(ref["greedy"].policy_logprobs, ref["greedy_nocache"].policy_logprobs,
                               atol=1e-5, rtol=0)
    assert len({tuple(r) for r in ref["greedy"].responses()}) >= 4  # distinct prompts, distinct outputs


def test_generation_restores_the_mode_and_rejects_what_the_model_cannot_do(ref):
    assert ref["still_training"]
    too_long, too_wide = ref["errors"]
    assert "longest prompt + max_new_tokens = 69 exceeds the model's max_sequence_length 64" in too_long
    assert "vocab_size 300 exceeds the model's padded vocabulary 256" in too_wide


def test_eos_stops_each_sequence(ref):
    eos, greedy, stopped = ref["eos_id"], ref["greedy"].responses(), ref["eos"]
    assert torch.equal(stopped.tokens, ref["eos_nocache"].tokens)  # also with finished rows dropped
    n_stopped = 0
    for full, cut, by_eos in zip(greedy, stopped.responses(), stopped.stopped_by_eos.tolist()):
        expected = full[:full.index(eos) + 1] if eos in full else full
        assert cut == expected
        assert by_eos == (eos in full)
        n_stopped += by_eos
    assert 0 < n_stopped < len(PROMPTS)


def test_sampler_logprobs_match_a_full_forward(ref):
    r = ref["sampled"]
    policy, processed = ref["full_logprobs"]
    mask = r.response_mask[:, 1:].bool()
    assert mask.sum() == NEW * len(PROMPTS)
    torch.testing.assert_close(r.policy_logprobs[:, 1:][mask], policy[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(r.sampler_logprobs[:, 1:][mask], processed[mask], atol=1e-5, rtol=0)
    assert not torch.equal(r.tokens, ref["greedy"].tokens)


def test_sampling_is_deterministic_given_the_seed(ref):
    assert torch.equal(ref["sampled"].tokens, ref["sampled_again"].tokens)
    assert torch.equal(ref["sampled"].sampler_logprobs, ref["sampled_again"].sampler_logprobs)
    assert not torch.equal(ref["sampled"].tokens, ref["sampled_other_seed"].tokens)


def test_top_k_1_is_greedy(ref):
    assert torch.equal(ref["top1"].tokens, ref["greedy"].tokens)
    assert torch.equal(ref["top1"].sampler_logprobs, torch.zeros_like(ref["top1"].sampler_logprobs))


def test_padding_columns_are_never_sampled(ref):
    # At temperature 50 the 256 columns are near-uniform: if the 6 padding columns (logit 0) took
    # part, about 2% of these 384 draws would land on them.
    drawn = ref["flat"].tokens[ref["flat"].response_mask.bool()]
    assert drawn.numel() == 32 * len(PROMPTS)
    assert int(drawn.max()) < VOCAB
    assert int(drawn.max()) >= VOCAB - 10 and len(drawn.unique()) > 150  # the draws really cover the vocabulary


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_match_one_rank(ref, runs, layout):
    for rank, run in enumerate(runs):
        greedy, sampled, eos = run["layouts"][layout]
        where = f"{layout}, rank {rank}"
        assert torch.equal(greedy.tokens, ref["greedy"].tokens), where
        torch.testing.assert_close(greedy.policy_logprobs, ref["greedy"].policy_logprobs, atol=1e-5, rtol=0,
                                   msg=where)
        assert torch.equal(eos.tokens, ref["eos"].tokens), where
        # Every rank holds the same sample, and it is the single-rank sample for the same seed.
        assert torch.equal(sampled.tokens, ref["sampled"].tokens), where
        torch.testing.assert_close(sampled.sampler_logprobs, ref["sampled"].sampler_logprobs, atol=1e-5, rtol=0,
                                   msg=where)


def test_sequence_parallel_is_restored_on_real_modules(runs):
    for run in runs:
        on, modules = run["sp_restored"]
        assert on
        # the column/row-parallel linears cache the flag (the embedding reads config.sequence_parallel)
        assert {"ColumnParallelLinear", "RowParallelLinear"} <= set(modules), modules


def test_generation_mode_switches_off_and_restores_sequence_parallel():
    # The switch itself, on a stand-in (the layouts above check real SP modules end to end).
    from types import SimpleNamespace

    from dpcc_megatron.megatron.generate import _generation_mode

    class Chunk(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config, self.linear, self.embedding = config, torch.nn.Linear(2, 2), torch.nn.Module()
            self.linear.sequence_parallel = True
            self.embedding.reduce_scatter_embeddings = True
            self.embedding.sequence_parallel = False
            self.input_tensor = "stale"

        def set_input_tensor(self, t):
            self.input_tensor = t

    config = SimpleNamespace(sequence_parallel=True)
    chunks = [Chunk(config), Chunk(config)]
    with _generation_mode(chunks):
        assert not config.sequence_parallel and not torch.is_grad_enabled()
        for c in chunks:
            assert not c.training and not c.linear.sequence_parallel and not c.embedding.reduce_scatter_embeddings
    assert config.sequence_parallel and torch.is_grad_enabled()
    for c in chunks:
        assert c.training and c.linear.sequence_parallel and c.embedding.reduce_scatter_embeddings
        assert c.embedding.sequence_parallel is False and c.input_tensor is None
