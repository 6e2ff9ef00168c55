"""Who am I in the job? Rank, world size and local rank under srun, torchrun or mpirun.

    info = discover_ranks()          # reads os.environ
    export_torch_env(info)           # RANK, WORLD_SIZE, ... for init_process_group("env://")

Precedence follows who started the process: torchrun (RANK/WORLD_SIZE) and mpirun
spawn their own processes, possibly inside a Slurm step, so they win over Slurm's
variables; srun comes next; a plain ``python`` is rank 0 of 1. When torchrun runs one
process per Slurm task, both launchers describe the same processes and must agree.
Every inconsistency is a :class:`LaunchError` that names the variables, so a bad
launch fails at once instead of hanging in a rendezvous.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Mapping, MutableMapping, Optional

DEFAULT_MASTER_PORT = 29500
# Variables whose presence says an MPI launcher started this process.
_MPI_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


class LaunchError(RuntimeError):
    """The launcher environment is missing, malformed or contradictory."""


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job, as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str
    """srun | torchrun | mpi | single"""


def _int(env: Mapping[str, str], name: str, default: Optional[int] = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise LaunchError(f"{name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{name} must be an integer, got {raw!r}") from None


def parse_tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed per-node task counts: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise LaunchError(f"cannot parse Slurm tasks-per-node {spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def first_host(nodelist: str) -> str:
    """First host of a Slurm hostlist (``"gpu[07-09,12],cpu1"`` -> ``"gpu07"``), without scontrol."""
    first, depth = [], 0
    for ch in nodelist.strip():
        if ch == "," and depth == 0:
            break
        depth += (ch == "[") - (ch == "]")
        first.append(ch)
    expr = "".join(first)

    def pick(m: re.Match) -> str:
        return re.split(r"[,-]", m.group(1))[0]

    host = re.sub(r"\[([^\]]*)\]", pick, expr)
    if not host or "[" in host or "]" in host:
        raise LaunchError(f"cannot parse Slurm nodelist {nodelist!r}")
    return host


def scontrol_first_host(nodelist: str, timeout: float = 10.0) -> str:
    """Head of ``scontrol show hostnames NODELIST``; the pure parser when scontrol is absent."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                 text=True, timeout=timeout, check=True).stdout.split()
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError):
            pass  # the parser below handles every list Slurm prints
    return first_host(nodelist)


def _slurm_port(env: Mapping[str, str]) -> int:
    # Every rank derives the same port from the job id, so no exchange is needed;
    # the range keeps clear of ephemeral ports and of torchrun's 29500.
    if env.get("MASTER_PORT"):
        return _int(env, "MASTER_PORT")
    job = env.get("SLURM_JOB_ID", "")
    return 20000 + int(job) % 10000 if job.isdigit() else DEFAULT_MASTER_PORT


def _from_torchrun(env: Mapping[str, str]) -> Optional[RankInfo]:
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    for name in ("RANK", "WORLD_SIZE"):
        if name not in env:
            other = "WORLD_SIZE" if name == "RANK" else "RANK"
            raise LaunchError(f"{other} is set but {name} is not: set both (torchrun sets RANK, "
                              "WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)")
    world = _int(env, "WORLD_SIZE")
    local_rank = _int(env, "LOCAL_RANK", 0 if world == 1 else None)
    return RankInfo(rank=_int(env, "RANK"), world_size=world, local_rank=local_rank,
                    local_world_size=_int(env, "LOCAL_WORLD_SIZE", world),
                    master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
                    master_port=_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT), launcher="torchrun")


def _from_mpi(env: Mapping[str, str], mpi: Any) -> Optional[RankInfo]:
    if not any(k in env for k in _MPI_MARKERS):
        return None
    if mpi is None:
        try:
            from mpi4py import MPI as mpi  # optional: pip install 'dpcc-megatron[mpi]'
        except ImportError:
            mpi = None
    port = _int(env, "MASTER_PORT", DEFAULT_MASTER_PORT)
    if mpi is not None:
        comm = mpi.COMM_WORLD
        rank, world = comm.Get_rank(), comm.Get_size()
        node = comm.Split_type(mpi.COMM_TYPE_SHARED)
        addr = env.get("MASTER_ADDR") or comm.bcast(_hostname() if rank == 0 else None, root=0)
        return RankInfo(rank, world, node.Get_rank(), node.Get_size(), addr, port, "mpi")
    # Without mpi4py, the launcher's own variables still give the ranks, but nobody can
    # tell the others where rank 0 runs.
    if "MASTER_ADDR" not in env:
        raise LaunchError("started by an MPI launcher without mpi4py: set MASTER_ADDR to rank 0's "
                          "host, or install mpi4py (pip install 'dpcc-megatron[mpi]')")
    if "OMPI_COMM_WORLD_SIZE" in env:
        names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE")
    elif "PMI_SIZE" in env:
        names = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    else:
        raise LaunchError("started by an MPI launcher whose variables this build cannot read "
                          f"({', '.join(k for k in _MPI_MARKERS if k in env)}): install mpi4py")
    rank, world, local, local_world = (_int(env, n) for n in names)
    return RankInfo(rank, world, local, local_world, env["MASTER_ADDR"], port, "mpi")


def _hostname() -> str:
    import socket

    return socket.gethostname()


def _in_slurm_step(env: Mapping[str, str]) -> bool:
    # The batch script itself also has SLURM_PROCID=0; only srun steps carry a step id.
    return "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env)


def _from_slurm(env: Mapping[str, str], hostnames: Callable[[str], str]) -> RankInfo:
    world = _int(env, "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS")
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if spec:
        counts = parse_tasks_per_node(spec)
        node = _int(env, "SLURM_NODEID", 0)
        if len(set(counts)) == 1:
            local_world = counts[0]
        elif 0 <= node < len(counts):
            local_world = counts[node]
        else:
            raise LaunchError(f"SLURM_NODEID={node} is outside SLURM_STEP_TASKS_PER_NODE={spec!r}")
    else:
        local_world = _int(env, "SLURM_NTASKS_PER_NODE", world)
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise LaunchError("srun step without MASTER_ADDR, SLURM_STEP_NODELIST or SLURM_JOB_NODELIST")
        addr = hostnames(nodelist)
    return RankInfo(rank=_int(env, "SLURM_PROCID"), world_size=world, local_rank=_int(env, "SLURM_LOCALID"),
                    local_world_size=local_world, master_addr=addr, master_port=_slurm_port(env),
                    launcher="srun")


def _check(info: RankInfo) -> RankInfo:
    src = info.launcher
    if info.world_size < 1:
        raise LaunchError(f"{src}: world size must be >= 1, got {info.world_size}")
    if not 0 <= info.rank < info.world_size:
        raise LaunchError(f"{src}: rank {info.rank} is outside [0, world size {info.world_size})")
    if not 1 <= info.local_world_size <= info.world_size:
        raise LaunchError(f"{src}: local world size {info.local_world_size} must be in "
                          f"[1, world size {info.world_size}]")
    if not 0 <= info.local_rank < info.local_world_size:
        raise LaunchError(f"{src}: local rank {info.local_rank} is outside "
                          f"[0, local world size {info.local_world_size})")
    if not 0 < info.master_port < 65536:
        raise LaunchError(f"{src}: master port must be in [1, 65535], got {info.master_port}")
    if not info.master_addr:
        raise LaunchError(f"{src}: empty master address")
    return info


def _agree(launched: RankInfo, slurm: RankInfo) -> None:
    """torchrun inside an srun step: one process per task, or nproc_per_node per task."""
    if launched.world_size == slurm.world_size:
        if (launched.rank, launched.local_rank) != (slurm.rank, slurm.local_rank):
            raise LaunchError(
                f"torchrun and Slurm disagree: RANK={launched.rank} LOCAL_RANK={launched.local_rank} "
                f"but SLURM_PROCID={slurm.rank} SLURM_LOCALID={slurm.local_rank}")
    elif launched.world_size != slurm.world_size * launched.local_world_size:
        raise LaunchError(
            f"torchrun and Slurm disagree: WORLD_SIZE={launched.world_size} is neither the Slurm "
            f"task count ({slurm.world_size}) nor tasks x LOCAL_WORLD_SIZE "
            f"({slurm.world_size} x {launched.local_world_size})")


def discover_ranks(env: Optional[Mapping[str, str]] = None, *, mpi: Any = None,
                   hostnames: Callable[[str], str] = scontrol_first_host) -> RankInfo:
    """Read the launcher's environment (default ``os.environ``) into a checked :class:`RankInfo`.

    ``mpi`` stands in for the ``mpi4py.MPI`` module (tests); ``hostnames`` maps a Slurm
    nodelist to its first host (default: ``scontrol show hostnames``, then a parser).
    """
    env = os.environ if env is None else env
    slurm = _check(_from_slurm(env, hostnames)) if _in_slurm_step(env) else None
    launched = _from_torchrun(env)
    if launched is not None:
        _check(launched)
        if slurm is not None:
            _agree(launched, slurm)
        return launched
    # MPI ranks win without a cross-check: under mpirun, Slurm's variables describe
    # mpirun's per-node daemons, not the ranks.
    launched = _from_mpi(env, mpi)
    if launched is not None:
        return _check(launched)
    if slurm is not None:
        return slurm
    ntasks = env.get("SLURM_NTASKS", "1")
    if "SLURM_JOB_ID" in env and ntasks.isdigit() and int(ntasks) > 1:
        raise LaunchError(f"inside Slurm job {env['SLURM_JOB_ID']} with SLURM_NTASKS={ntasks} but not in an "
                          "srun step: start the ranks with srun (see slurm/train_dpcc.sbatch)")
    return _check(RankInfo(0, 1, 0, 1, env.get("MASTER_ADDR") or "127.0.0.1",
                           _int(env, "MASTER_PORT", DEFAULT_MASTER_PORT), "single"))


def export_torch_env(info: RankInfo, env: Optional[MutableMapping[str, str]] = None) -> dict[str, str]:
    """Set the variables ``init_process_group(init_method="env://")`` reads; returns what was set."""
    env = os.environ if env is None else env
    values = {"RANK": info.rank, "WORLD_SIZE": info.world_size, "LOCAL_RANK": info.local_rank,
              "LOCAL_WORLD_SIZE": info.local_world_size, "MASTER_ADDR": info.master_addr,
              "MASTER_PORT": info.master_port}
    out = {k: str(v) for k, v in values.items()}
    env.update(out)
    return out


def device_index(local_rank: int, device_count: int) -> int:
    """The CUDA device of a rank: ``local_rank % device_count``.

    Launchers that start more ranks on a node than it has visible GPUs (``CUDA_VISIBLE_DEVICES``
    narrowed to one GPU per task by srun's ``--gpus-per-task`` or a site prolog, MPI with a
    per-rank device list) give local ranks beyond the visible count; without the modulo
    ``torch.cuda.set_device`` fails with "invalid device ordinal"."""
    if device_count < 1:
        raise LaunchError(f"no CUDA device is visible (device count {device_count}) for local rank {local_rank}")
    if local_rank < 0:
        raise LaunchError(f"local rank must be >= 0, got {local_rank}")
    return local_rank % device_count
