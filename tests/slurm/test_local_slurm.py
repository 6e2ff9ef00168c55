"""The local cluster itself: a two-task job runs and srun numbers its tasks."""
from __future__ import annotations

import pytest

from dpcc_megatron.launch.ranks import discover_ranks

pytestmark = pytest.mark.slurm


def test_two_task_job_prints_both_procids(slurm, tmp_path):
    script = tmp_path / "hello.sbatch"
    script.write_text("#!/bin/bash\nsrun bash -c 'echo procid=$SLURM_PROCID step=${SLURM_STEP_ID:-none}'\n")
    out = tmp_path / "hello.out"
    job = slurm.sbatch(["--ntasks=2", f"--output={out}", str(script)])
    info = slurm.wait(job, timeout=60)
    assert info["JobState"] == "COMPLETED", info
    lines = sorted(out.read_text().split())
    assert [x for x in lines if x.startswith("procid=")] == ["procid=0", "procid=1"]
    assert "step=none" not in lines  # srun tasks carry a step id; discover_ranks relies on it


def test_discover_ranks_inside_srun(slurm, tmp_path):
    """The real srun environment, read by the function the trainer calls."""
    import json
    import sys

    script = tmp_path / "ranks.sbatch"
    dump = tmp_path / "env-%t.json"
    script.write_text("#!/bin/bash\nsrun --output=" + str(dump) + " " + sys.executable
                      + " -c 'import json, os; print(json.dumps(dict(os.environ)))'\n")
    job = slurm.sbatch(["--nodes=1", "--ntasks-per-node=2", f"--output={tmp_path / 'r.out'}", str(script)])
    assert slurm.wait(job, timeout=60)["JobState"] == "COMPLETED"
    infos = [discover_ranks(json.loads((tmp_path / f"env-{t}.json").read_text())) for t in (0, 1)]
    assert [(i.rank, i.world_size, i.local_rank, i.local_world_size, i.launcher) for i in infos] == [
        (0, 2, 0, 2, "srun"), (1, 2, 1, 2, "srun")]
    assert infos[0].master_addr == infos[1].master_addr != ""
    assert infos[0].master_port == infos[1].master_port == 20000 + job % 10000
