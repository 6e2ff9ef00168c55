"""Preemption: a signal stops the run after a checkpoint (asynchronous here) and skips the final
greedy evaluation; a run paused by the monitor exits with its own status."""
import os
import signal
from pathlib import Path

import pytest

from dpcc_megatron.testing import run_multirank

from .test_train_e2e import _cfg


def _signalled_rank(rank, world, out, overrides):
    import dpcc_megatron.train.trainer as trainer

    evals = []
    real_eval = trainer.evaluate_greedy
    trainer.evaluate_greedy = lambda ctx: evals.append(1) or real_eval(ctx)
    real_record = trainer.build_record

    def record(ctx, iteration, *a, **k):
        if iteration == 0 and rank == 1:  # one rank is told; every rank must stop
            os.kill(os.getpid(), signal.SIGUSR1)
        return real_record(ctx, iteration, *a, **k)

    trainer.build_record = record
    summary = trainer.train(_cfg(Path(out), **overrides))
    return summary, len(evals)


@pytest.mark.multirank
@pytest.mark.slow
def test_signal_checkpoints_asynchronously_and_skips_the_final_eval(tmp_path):
    from dpcc_megatron.train.exit_codes import exit_code

    ck = tmp_path / "ck"
    over = {"train.iterations": 3, "checkpoint.dir": str(ck), "checkpoint.async_save": True,
            "parallel.tensor_model_parallel_size": 2}
    for summary, evals in run_multirank(_signalled_rank, 2, args=(str(tmp_path), over), timeout=420):
        assert summary["stop_kind"] == "signal" and summary["iterations"] == 1
        assert "SIGUSR1" in summary["stop_reason"] or "another rank" in summary["stop_reason"]
        assert evals == 1  # the evaluation before RL only
        assert summary["reward_after"] is None and summary["final_eval"].startswith("skipped: stopped by")
        assert exit_code(summary) == 0
    # The asynchronous save was finalised before train() returned.
    assert (ck / "latest").read_text().strip() == "iter_0000001"
    assert (ck / "iter_0000001" / "trainer_state.json").is_file() and not list(ck.glob(".tmp_*"))
