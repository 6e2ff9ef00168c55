"""Let Megatron-Core 0.16-0.19 run on CPU under gloo (tests, CPU demo, CPU benchmarks only).

Megatron-Core assumes CUDA in a handful of places that are not about compute.
This layer redirects exactly these, and nothing else:

1. ``torch.cuda.current_device()`` returns the CPU device; ``torch.cuda.synchronize``
   is a no-op (the schedules and p2p code allocate on "the current device").
2. CUDA RNG state: ``megatron.core.tensor_parallel.random._get_cuda_rng_state`` /
   ``_set_cuda_rng_state`` and ``torch.cuda.get_rng_state`` / ``set_rng_state`` /
   ``manual_seed`` use the CPU generator (Megatron's RNG tracker forks these).
3. Tensor factories called with ``device="cuda"`` are sent to the CPU by a
   ``TorchFunctionMode`` that rewrites the ``device`` keyword (schedules.py's
   ``torch.zeros(..., device="cuda")``, the p2p shape exchange).
4. ``Tensor.type()`` with no argument reports ``torch.cuda.FloatTensor`` and the like
   for CPU tensors: Megatron's optimizers check these strings.
5. ``Tensor.cuda()`` / ``Module.cuda()`` return self.
6. ``torch.cuda.current_stream()`` / ``default_stream()`` return torch's CPU stream stand-in
   (``torch.cpu.Stream``: ``wait_stream``, ``wait_event``, ``record_event`` are no-ops).
   megatron-core >= 0.17's DDP ``start_grad_sync`` asks for the current stream on every gradient
   sync (to wait for CUDA-graph replay events); 0.16 does not.

Sequence parallelism needs no redirect: gloo runs the ``reduce_scatter_tensor`` and
``all_gather_into_tensor`` that Megatron's SP regions use (torch 2.13); the SP-capable norm
lives with the model builder (:mod:`dpcc_megatron.megatron.norms`).

It is switched on explicitly with :func:`enable_cpu_megatron` and refuses to run
when CUDA is available, so it can never leak into a GPU job.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False
_MODE: TorchFunctionMode | None = None


def _cpu_if_cuda(device):
    if device is None:
        return None
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, int):  # a bare CUDA ordinal
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device=`` on any torch call from CUDA to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if func in (torch.Tensor.to,) and args and len(args) > 1 and isinstance(args[1], (str, torch.device)):
            args = (args[0], _cpu_if_cuda(args[1]), *args[2:])
        return func(*args, **kwargs)


_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def cpu_threads(local_world_size: int, env: Optional[Mapping[str, str]] = None,
                cpu_count: Optional[int] = None) -> int:
    """Intra-op threads for one CPU rank: ``OMP_NUM_THREADS`` when it is set to a positive integer,
    else the cores shared evenly among the node's ranks (at least 1).

    An explicit ``OMP_NUM_THREADS`` wins because the caller knows what else shares the cores: two
    single-rank runs side by side (the stability runner's ``--jobs 2``) each asking for every core
    oversubscribe them, and OpenMP's spinning barriers then slow both several-fold. A malformed value
    is refused, naming the variable, instead of silently falling back."""
    env = os.environ if env is None else env
    raw = env.get("OMP_NUM_THREADS", "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"OMP_NUM_THREADS must be a positive integer, got {raw!r}")
        return n
    cores = os.cpu_count() if cpu_count is None else cpu_count
    return max(1, (cores or 1) // max(1, local_world_size))


def cpu_megatron_enabled() -> bool:
    return _ENABLED


def enable_cpu_megatron() -> None:
    """Install the redirects (idempotent). Raises if a CUDA device is present."""
    global _ENABLED, _MODE
    if _ENABLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("the CPU execution layer must not run where CUDA is available")

    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: torch.cpu.current_stream()
    torch.cuda.default_stream = lambda *a, **k: torch.cpu.current_stream()
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # Seed the CPU generator directly: torch.manual_seed itself calls torch.cuda.manual_seed_all.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))

    from megatron.core.tensor_parallel import random as mrandom

    def _get_state(device=None, clone=False, graph_safe=False):
        return torch.get_rng_state()

    def _set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = _get_state
    mrandom._set_cuda_rng_state = _set_state

    original_type = torch.Tensor.type

    def _type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return _TYPE_NAMES.get(self.dtype, original_type(self))
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = _type
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self

    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _enable_cpu_moe_alltoall()
    _ENABLED = True


def _enable_cpu_moe_alltoall() -> None:
    """Megatron's all-to-all MoE token dispatcher on CPU (the all-gather one needs nothing).

    Its split sizes are copied device-to-host on a side CUDA stream, and only CUDA tensors are
    turned into the host arrays ``all_to_all_single`` takes. On CPU there is nothing to copy: the
    splits become arrays in place, at the point the GPU path copies them, and no stream is made."""
    try:
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as A2A
    except ImportError:  # pragma: no cover - a megatron-core without MoE
        return

    def _splits_to_host(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name, None)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    A2A.cuda_dtoh_stream = object()  # set, so the constructor makes no torch.cuda.Stream
    A2A._maybe_dtoh_and_synchronize = _splits_to_host
