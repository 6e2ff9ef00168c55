"""The code paths that differ between megatron-core releases, and which one the installed release takes.

The package detects features, never version strings; these tests pin, per release, which branch is
live, so each CI leg proves it runs the branch it is there for: `make test` (megatron-core 0.16.1)
the old ones, `make test-latest` (0.19.x) the new ones (docs/install.md). A release that moves a
branch fails here first, naming it, instead of somewhere deep in a multi-rank test.
"""
import functools
import inspect
from importlib.metadata import version

import pytest
from packaging.version import Version

from dpcc_megatron.megatron.norms import spec_nodes

MCORE = Version(version("megatron-core"))
NEW = MCORE >= Version("0.17")  # 0.17 needs Python >= 3.12: only the make test-latest leg has it


def _partials(obj):
    return [node for node in spec_nodes(obj) if isinstance(node, functools.partial)]


def test_supported_release():
    assert Version("0.16.1") <= MCORE < Version("0.20"), f"megatron-core {MCORE} is outside the tested range"


def test_async_checkpoint_writer_is_megatron_cores_own_on_every_release():
    from dpcc_megatron.megatron.checkpoint import _async_save_kwargs, async_save_unsupported

    assert async_save_unsupported() is None  # 0.16.1-0.19.x can all save asynchronously
    kw = _async_save_kwargs()
    assert kw["async_sharded_save"] is True
    if NEW:  # 0.17+ default to the Resiliency Extension's writer ("nvrx"); we ask for "mcore"
        assert kw["async_strategy"] == "mcore"
    else:  # 0.16 has one writer and no argument to choose it
        assert "async_strategy" not in kw


def test_sequence_parallel_norm_swap_reaches_into_the_specs_partials():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from dpcc_megatron.megatron.norms import SequenceParallelTorchNorm, _swap, uses_torch_norm

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    # 0.17+ build the MLP submodule as a functools.partial; 0.16 as plain ModuleSpecs
    assert bool(_partials(spec)) == NEW
    assert uses_torch_norm(spec)
    swapped = _swap(spec, WrappedTorchNorm, SequenceParallelTorchNorm)
    assert not uses_torch_norm(swapped), "a WrappedTorchNorm survived the swap"
    for p in _partials(swapped):  # every partial is still callable with its own keywords
        assert callable(p.func)


def test_ddp_gradient_sync_asks_for_the_current_stream_from_0_17():
    """0.17+'s ``start_grad_sync`` waits on CUDA-graph events on ``torch.cuda.current_stream()``:
    the CPU layer redirects it (tests/megatron/test_policy_step.py's TP2 update runs it there)."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    source = inspect.getsource(_ParamAndGradBucketGroup.start_grad_sync)
    assert ("torch.cuda.current_stream()" in source) == NEW


@pytest.mark.multirank
def test_cpu_layer_stream_stand_in_accepts_what_megatron_calls_on_it():
    from dpcc_megatron.testing import run_multirank

    assert run_multirank(_streams, 1, timeout=300) == [True]


def _streams(rank, world):
    import torch

    s = torch.cuda.current_stream()
    s.wait_event(None)
    s.wait_stream(torch.cuda.default_stream())
    s.record_event()
    return isinstance(s, torch.cpu.Stream) and not torch.cuda.is_available()
