"""The sequence-parallel torch norm and its swap into Megatron's local spec (the multi-rank
parity at TP2 x PP2 x VPP2 with SP is in test_policy_step.py)."""
import functools
from types import SimpleNamespace

import pytest
import torch

from dpcc_megatron.megatron.norms import SequenceParallelTorchNorm, _swap, uses_torch_norm


def _cfg(norm="RMSNorm", sp=True):
    return SimpleNamespace(normalization=norm, sequence_parallel=sp, layernorm_zero_centered_gamma=False)


@pytest.mark.parametrize("norm,cls", [("RMSNorm", torch.nn.RMSNorm), ("LayerNorm", torch.nn.LayerNorm)])
def test_weights_are_marked_only_under_sequence_parallelism(norm, cls):
    on = SequenceParallelTorchNorm(config=_cfg(norm), hidden_size=8, eps=1e-6)
    assert isinstance(on, cls) and on.eps == 1e-6
    params = list(on.parameters())
    assert params and all(getattr(p, "sequence_parallel", False) for p in params)
    off = SequenceParallelTorchNorm(config=_cfg(norm, sp=False), hidden_size=8)
    assert not any(getattr(p, "sequence_parallel", False) for p in off.parameters())
    x = torch.randn(3, 8)
    torch.testing.assert_close(on(x), cls(8, eps=1e-6)(x))  # the forward is torch's own


def test_unsupported_normalization_names_the_key():
    with pytest.raises(ValueError, match="model.normalization"):
        SequenceParallelTorchNorm(config=_cfg("L2Norm"), hidden_size=8)


def test_swap_reaches_every_norm_of_the_local_spec_and_partials():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)
    assert uses_torch_norm(spec)
    swapped = _swap(spec, WrappedTorchNorm, SequenceParallelTorchNorm)
    assert not uses_torch_norm(swapped) and uses_torch_norm(spec)  # the original is left alone
    assert swapped.submodules.input_layernorm is SequenceParallelTorchNorm
    assert swapped.submodules.self_attention.submodules.q_layernorm is SequenceParallelTorchNorm
    built = functools.partial(dict, norm=WrappedTorchNorm, rest=[1, WrappedTorchNorm])  # newer specs use partials
    out = _swap(built, WrappedTorchNorm, SequenceParallelTorchNorm)
    assert out.keywords["norm"] is SequenceParallelTorchNorm and out.keywords["rest"][1] is SequenceParallelTorchNorm
