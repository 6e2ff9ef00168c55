"""The multi-rank launcher reports failures with tracebacks and never hangs."""
import time

import pytest
import torch

from dpcc_megatron.testing import RankFailure, run_multirank

pytestmark = pytest.mark.multirank


def _allreduce(rank, world):
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t)


def _rank1_raises(rank, world):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("deliberate failure on rank one")
    dist.barrier()  # rank 0 would wait here forever without the launcher's cleanup


def _sleeps(rank, world):
    time.sleep(600)


def test_results_come_back_from_every_rank():
    assert run_multirank(_allreduce, 2) == [3.0, 3.0]


def test_failing_rank_fails_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="deliberate failure on rank one") as info:
        run_multirank(_rank1_raises, 2, timeout=600)
    assert "rank 1 raised" in str(info.value)
    # Rank 0 would sit in its barrier until the 600 s deadline; the launcher stops it ~10 s
    # after rank 1 fails (the margin covers slow process start-up on a loaded machine).
    assert time.monotonic() - start < 240


def test_hung_rank_is_killed_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="timed out"):
        run_multirank(_sleeps, 2, timeout=8)
    assert time.monotonic() - start < 30
