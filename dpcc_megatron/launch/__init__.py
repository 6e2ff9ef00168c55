"""Launch edge: rank discovery under srun/torchrun/mpirun and the per-GPU memory planner.

Nothing here imports torch or Megatron: the planner runs on a login node, and rank
discovery runs before ``torch.distributed`` is initialised.
"""
from .ranks import LaunchError, RankInfo, discover_ranks, export_torch_env

__all__ = ["LaunchError", "RankInfo", "discover_ranks", "export_torch_env"]
