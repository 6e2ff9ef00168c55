"""Initialise and tear down Megatron's parallel state from the config."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..config import ParallelConfig


def init_distributed(backend: str = "auto", timeout_minutes: int = 30) -> None:
    """Join the default process group from the launcher's env (RANK, WORLD_SIZE, MASTER_*)."""
    import datetime

    if dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        from ..launch.ranks import device_index

        torch.cuda.set_device(device_index(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()))
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))


def data_parallel_size(parallel: ParallelConfig, world_size: int) -> int:
    mp = parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size
    if world_size % mp:
        raise ValueError(f"world size {world_size} is not divisible by tensor_model_parallel_size * "
                         f"pipeline_model_parallel_size = {mp}")
    return world_size // mp


def expert_parallel_kwargs(parallel: ParallelConfig, world_size: int) -> dict:
    """initialize_model_parallel's expert arguments; refuses a world the expert grid does not fit."""
    ep = parallel.expert_model_parallel_size
    if ep == 1 and parallel.expert_tensor_parallel_size is None:
        return {}
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    etp = parallel.expert_tensor_parallel_size or tp
    per_stage = world_size // pp  # TP x DP ranks of one pipeline stage, regrouped as ETP x EP x EDP
    if per_stage % (ep * etp):
        raise ValueError(f"parallel.expert_model_parallel_size={ep} x expert_tensor_parallel_size={etp} must "
                         f"divide the {per_stage} ranks of a pipeline stage (tensor x data parallel)")
    return {"expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp}


def init_model_parallel(parallel: ParallelConfig, seed: int = 1234) -> None:
    """Create TP/PP/DP groups and seed Megatron's model-parallel RNG tracker."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    data_parallel_size(parallel, dist.get_world_size())
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        distributed_timeout_minutes=parallel.distributed_timeout_minutes,
        **expert_parallel_kwargs(parallel, dist.get_world_size()),
    )
    model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
