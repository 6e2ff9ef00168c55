"""Rank discovery under srun, torchrun, mpirun and a plain python, from synthetic environments."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from dpcc_megatron.launch.ranks import (
    LaunchError, RankInfo, discover_ranks, export_torch_env, first_host, parse_tasks_per_node,
)


def _no_scontrol(nodelist: str) -> str:
    return first_host(nodelist)


def srun_env(procid=0, localid=0, ntasks=16, per_node="8(x2)", nodeid=0, **extra) -> dict:
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid),
           "SLURM_LOCALID": str(localid), "SLURM_NTASKS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks),
           "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_NODEID": str(nodeid),
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_NODELIST": "gpu[07-08]"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def test_single_process_default():
    assert discover_ranks({}) == RankInfo(0, 1, 0, 1, "127.0.0.1", 29500, "single")


def test_srun_reads_slurm_variables_and_derives_master():
    info = discover_ranks(srun_env(procid=9, localid=1, nodeid=1), hostnames=_no_scontrol)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (9, 16, 1, 8)
    assert info.master_addr == "gpu07" and info.launcher == "srun"
    assert info.master_port == 20000 + 4242 % 10000  # same on every rank, derived from the job id


def test_srun_prefers_the_master_the_sbatch_exported():
    info = discover_ranks(srun_env(MASTER_ADDR="head0", MASTER_PORT=31000), hostnames=_no_scontrol)
    assert (info.master_addr, info.master_port) == ("head0", 31000)


def test_srun_uneven_tasks_per_node_indexes_by_node():
    env = srun_env(procid=4, localid=0, ntasks=5, per_node="2(x2),1", nodeid=2)
    assert discover_ranks(env, hostnames=_no_scontrol).local_world_size == 1


def test_batch_shell_with_many_tasks_is_told_to_use_srun():
    env = srun_env()
    del env["SLURM_STEP_ID"]  # the batch script itself: SLURM_PROCID=0 but no step
    with pytest.raises(LaunchError, match="srun"):
        discover_ranks(env)


def test_torchrun():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "n0", "MASTER_PORT": "29400"}
    assert discover_ranks(env) == RankInfo(3, 4, 1, 2, "n0", 29400, "torchrun")


def test_torchrun_one_process_per_node_inside_srun_is_accepted():
    env = srun_env(procid=1, localid=0, ntasks=2, per_node="1(x2)", nodeid=1)
    env.update(RANK="13", WORLD_SIZE="16", LOCAL_RANK="5", LOCAL_WORLD_SIZE="8", MASTER_ADDR="gpu07")
    info = discover_ranks(env, hostnames=_no_scontrol)
    assert (info.rank, info.world_size, info.launcher) == (13, 16, "torchrun")


@pytest.mark.parametrize("change, match", [
    ({"RANK": "5"}, "disagree: RANK=5"),                 # same world, different rank
    ({"WORLD_SIZE": "12", "RANK": "2"}, "neither the Slurm task count"),
])
def test_torchrun_and_slurm_disagreeing_is_an_error(change, match):
    env = srun_env(procid=2, localid=2, ntasks=16)
    env.update(RANK="2", WORLD_SIZE="16", LOCAL_RANK="2", LOCAL_WORLD_SIZE="8")
    env.update(change)
    with pytest.raises(LaunchError, match=match):
        discover_ranks(env, hostnames=_no_scontrol)


@pytest.mark.parametrize("env, match", [
    ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
    ({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, "rank 4 is outside"),
    ({"RANK": "x", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, "RANK must be an integer"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, "LOCAL_RANK is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "local rank 2"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "master port"),
])
def test_malformed_torchrun_environment(env, match):
    with pytest.raises(LaunchError, match=match):
        discover_ranks(env)


def test_srun_rank_beyond_task_count():
    with pytest.raises(LaunchError, match="rank 16 is outside"):
        discover_ranks(srun_env(procid=16), hostnames=_no_scontrol)


class FakeComm:
    def __init__(self, rank, size, local_rank, local_size, host="mpi0"):
        self.rank, self.size, self.local, self.host = rank, size, (local_rank, local_size), host

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Split_type(self, kind):
        assert kind == "shared"
        return SimpleNamespace(Get_rank=lambda: self.local[0], Get_size=lambda: self.local[1])

    def bcast(self, value, root=0):
        return self.host  # rank 0's hostname reaches everyone


def test_mpi_through_mpi4py_wins_over_slurm_daemon_variables():
    mpi = SimpleNamespace(COMM_WORLD=FakeComm(5, 8, 1, 4), COMM_TYPE_SHARED="shared")
    env = srun_env(procid=1, localid=0, ntasks=2, per_node="1(x2)", nodeid=1)  # mpirun's per-node daemons
    env["OMPI_COMM_WORLD_SIZE"] = "8"
    assert discover_ranks(env, mpi=mpi, hostnames=_no_scontrol) == RankInfo(5, 8, 1, 4, "mpi0", 29500, "mpi")


def test_mpi_without_mpi4py_reads_launcher_variables_and_needs_master(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "mpi4py", None)  # `from mpi4py import MPI` raises ImportError
    ompi = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        discover_ranks(ompi)
    assert discover_ranks({**ompi, "MASTER_ADDR": "head"}) == RankInfo(3, 4, 1, 2, "head", 29500, "mpi")
    mpich = {"PMI_SIZE": "2", "PMI_RANK": "1", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "h"}
    assert discover_ranks(mpich) == RankInfo(1, 2, 1, 2, "h", 29500, "mpi")
    with pytest.raises(LaunchError, match="install mpi4py"):
        discover_ranks({"PMIX_RANK": "0", "MASTER_ADDR": "h"})


@pytest.mark.parametrize("spec, counts", [("8", [8]), ("8(x4)", [8] * 4), ("2(x2),1", [2, 2, 1]),
                                          ("4,3(x2)", [4, 3, 3])])
def test_parse_tasks_per_node(spec, counts):
    assert parse_tasks_per_node(spec) == counts


def test_parse_tasks_per_node_rejects_garbage():
    with pytest.raises(LaunchError, match="tasks-per-node"):
        parse_tasks_per_node("8(y2)")


@pytest.mark.parametrize("nodelist, host", [("vm", "vm"), ("gpu[07-09,12],cpu1", "gpu07"),
                                            ("a1,b[2-3]", "a1"), ("rack[3-4]-n[001-008]", "rack3-n001"),
                                            ("n[5,1-3]", "n5")])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_first_host_rejects_unbalanced_brackets():
    with pytest.raises(LaunchError, match="nodelist"):
        first_host("gpu[01-")


def test_export_torch_env_round_trips_through_discovery():
    info = RankInfo(3, 8, 3, 4, "head", 31234, "srun")
    env: dict = {}
    assert export_torch_env(info, env) == {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3",
                                           "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "head",
                                           "MASTER_PORT": "31234"}
    again = discover_ranks(env)
    assert (again.rank, again.world_size, again.local_rank, again.local_world_size,
            again.master_addr, again.master_port) == (3, 8, 3, 4, "head", 31234)


def test_export_then_discover_inside_srun_stays_consistent():
    # The trainer exports torch variables into its own srun environment; discovering again must agree.
    env = srun_env(procid=9, localid=1, nodeid=1)
    info = discover_ranks(env, hostnames=_no_scontrol)
    export_torch_env(info, env)
    assert discover_ranks(env, hostnames=_no_scontrol).rank == 9


@pytest.mark.parametrize("local_rank, count, index", [(0, 8, 0), (7, 8, 7), (1, 1, 0), (5, 4, 1), (3, 2, 1)])
def test_device_index_wraps_local_ranks_over_the_visible_devices(local_rank, count, index):
    from dpcc_megatron.launch.ranks import device_index

    assert device_index(local_rank, count) == index


def test_device_index_refuses_no_device_and_negative_ranks():
    from dpcc_megatron.launch.ranks import LaunchError, device_index

    with pytest.raises(LaunchError, match="no CUDA device"):
        device_index(0, 0)
    with pytest.raises(LaunchError, match="local rank"):
        device_index(-1, 8)
