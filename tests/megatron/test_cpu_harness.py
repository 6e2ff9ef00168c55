"""The CPU execution layer is real: TP/PP runs of Megatron-Core match a single rank."""
import pytest
import torch

from dpcc_megatron.testing import run_multirank
from dpcc_megatron.testing.tiny import parallel_config, random_tokens, tiny_model_config

pytestmark = pytest.mark.multirank

SEQ, BATCH, MICRO = 16, 4, 2


def _setup(tp, pp, full_state=None):
    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.reshard import load_full_state_dict

    par = parallel_config(tp, pp)
    init_model_parallel(par, seed=7)
    torch.manual_seed(7)
    model = build_gpt_model(tiny_model_config(), par)
    if full_state is not None:
        load_full_state_dict([model], full_state)
    return model


def _logits_rank(rank, world, tp, full_state, tokens):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from dpcc_megatron.megatron.reshard import local_named_tensors

    model = _setup(tp, 1, full_state)
    model.eval()
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        logits = model(tokens, pos, attention_mask=None)  # [b, s, V/tp]
        logits = gather_from_tensor_model_parallel_region(logits)
    state = local_named_tensors([model]) if ps.get_tensor_model_parallel_world_size() == 1 else None
    return logits, state


def _train_step_rank(rank, world, tp, pp, full_state, tokens):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from dpcc_megatron.megatron.reshard import local_named_tensors, shard_like

    model = _setup(tp, pp, full_state)
    n_micro = BATCH // MICRO
    total_tokens = tokens[:, 1:].numel()
    micro = [tokens[i * MICRO:(i + 1) * MICRO] for i in range(n_micro)]
    it = iter(micro)

    def forward_step(data_iterator, m):
        x = next(data_iterator)
        inp, labels = x[:, :-1], x[:, 1:]
        pos = torch.arange(inp.shape[1]).unsqueeze(0).expand_as(inp)
        out = m(inp, pos, attention_mask=None, labels=labels)  # per-token CE [b, s] on the last stage

        def loss_func(per_token):
            contribution = per_token.sum() / total_tokens
            # The schedule divides by the number of micro-batches; undo it so the sum is exact.
            return contribution * n_micro, {"loss": contribution.detach()}

        return out, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=it, model=[model], num_microbatches=n_micro,
        seq_length=SEQ - 1, micro_batch_size=MICRO, forward_only=False)
    loss = sum(float(d["loss"]) for d in losses) if losses else None
    grads = local_named_tensors([model], grads=True)
    expected = shard_like([model], full_state["__grads__"], ps.get_tensor_model_parallel_rank(),
                          ps.get_tensor_model_parallel_world_size()) if "__grads__" in full_state else None
    return loss, grads, expected


@pytest.fixture(scope="module")
def reference():
    tokens = random_tokens(BATCH, SEQ, 256, seed=3)
    (logits, state), = run_multirank(_logits_rank, 1, args=(1, None, tokens))
    (loss, grads, _), = run_multirank(_train_step_rank, 1, args=(1, 1, state, tokens))
    state = dict(state)
    state["__grads__"] = grads
    return tokens, logits, state, loss


def test_tp2_logits_match_tp1(reference):
    tokens, ref_logits, state, _ = reference
    results = run_multirank(_logits_rank, 2, args=(2, state, tokens))
    for logits, _ in results:
        assert logits.shape == ref_logits.shape
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)])
def test_train_step_matches_single_rank(reference, tp, pp):
    tokens, _, state, ref_loss = reference
    results = run_multirank(_train_step_rank, tp * pp, args=(tp, pp, state, tokens), timeout=240)
    losses = [r[0] for r in results if r[0] is not None]
    assert losses, "the last pipeline stage reported no loss"
    for loss in losses:
        assert abs(loss - ref_loss) < 1e-5
    checked = 0
    for _, grads, expected in results:
        assert set(grads) == set(expected)
        for name, g in grads.items():
            torch.testing.assert_close(g, expected[name], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
            checked += 1
    assert checked > 10
