"""CPU execution layer and multi-rank launcher, for tests, the CPU demo and CPU benchmarks.

Nothing here runs on GPUs, and nothing here is switched on by importing the package:
call :func:`enable_cpu_megatron` explicitly.
"""
from .cpu_layer import cpu_megatron_enabled, cpu_threads, enable_cpu_megatron
from .multirank import RankFailure, run_multirank

__all__ = ["RankFailure", "cpu_megatron_enabled", "cpu_threads", "enable_cpu_megatron", "run_multirank"]
