"""The multi-rank launcher reports failures with tracebacks and never hangs."""
import os
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


def _reports_what_it_was_given(rank, world):
    import os

    import dpcc_megatron.testing.multirank as launcher

    leaked = getattr(launcher, "_set_by_an_earlier_rank", False)
    launcher._set_by_an_earlier_rank = True  # module state a later launch's ranks must not see
    print(f"rank {rank} speaking", flush=True)
    return os.environ.get("DPCC_MULTIRANK_PROBE"), os.path.realpath(os.getcwd()), leaked


def test_every_launch_starts_fresh_ranks_with_the_callers_environment_directory_and_output(tmp_path, monkeypatch,
                                                                                       capfd):
    """Ranks are forked from a server that imported torch once: each launch must still behave like a
    fresh spawn, seeing the caller's current environment, working directory and stdout."""
    monkeypatch.chdir(tmp_path)
    for value in ("first", "second"):
        monkeypatch.setenv("DPCC_MULTIRANK_PROBE", value)
        results = run_multirank(_reports_what_it_was_given, 2)
        assert results == [(value, os.path.realpath(tmp_path), False)] * 2, results
        out = capfd.readouterr().out
        assert "rank 0 speaking" in out and "rank 1 speaking" in out, out


def _returns_at_once(rank, world):
    return rank


def test_ranks_that_return_at_once_never_break_a_slower_peers_connect():
    """A rank whose function returns at once closes its connections; before every rank had
    connected, that failed a peer's init ('Gloo connectFullMesh failed' in 2 of 40 launches)."""
    for attempt in range(20):
        assert run_multirank(_returns_at_once, 2, timeout=120) == [0, 1], attempt
