"""Failures end a run cleanly: an engine that fails on one rank, during the rollouts or during an
evaluation, saves a checkpoint and stops every rank (nothing waits in a collective); the records and the
summary are written and everything is closed on every exit path (train/finish.py)."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from dpcc_megatron.testing import run_multirank

from .test_train_e2e import _cfg


def _failing_rank(rank, world, out, during):
    """DP2 on the CPU Megatron engine; rank 1's engine fails at its second call of that kind: the rollouts
    of iteration 1, or the evaluation after iteration 0 (the first greedy call is the one before RL)."""
    import dpcc_megatron.train.trainer as trainer
    from dpcc_megatron.rollout.engine import EngineFailure

    real_setup = trainer.setup_run
    held = {}

    def setup(cfg):
        ctx = real_setup(cfg)
        eng, real_generate, calls = ctx.engine, ctx.engine.generate, []

        def generate(prompt_ids, sampling):
            if sampling.greedy == (during == "an evaluation"):
                calls.append(1)
                if rank == 1 and len(calls) == 2:
                    raise EngineFailure("injected: the engine process died")
            return real_generate(prompt_ids, sampling)

        eng.generate = generate
        real_close = eng.close
        eng.close = lambda: held.setdefault("engine_closed", True) and real_close()
        held["ctx"] = ctx
        return ctx

    trainer.setup_run = setup
    over = {"train.iterations": 3, "eval.interval": 1, "checkpoint.dir": f"{out}/ck", "checkpoint.save_interval": 0}
    try:
        trainer.train(_cfg(Path(out), **over))
    except EngineFailure as e:
        return {"error": str(e), "kind": type(e).__name__, "closed": held.get("engine_closed", False)}
    return {"error": None}


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("during", ["rollouts", "an evaluation"])
def test_an_engine_failing_on_one_rank_saves_a_checkpoint_and_stops_every_rank(tmp_path, capfd, during):
    results = run_multirank(_failing_rank, 2, args=(str(tmp_path), during), timeout=300)
    for r in results:
        assert r["error"] and "injected: the engine process died" in r["error"], r
        assert r["closed"]  # finish ran on the failure path: the engine is closed
    assert results[1]["error"] == "injected: the engine process died"  # the failing rank raises its own error
    assert results[0]["error"] == "the rollout engine failed on rank 1: EngineFailure: injected: the engine process died"
    said = capfd.readouterr().out
    for rank in (0, 1):
        assert f"[dpcc] rank {rank}: stopping: the rollout engine failed during {during}" in said
    done = 1  # iteration 0 completed, iteration 1 not
    ck = tmp_path / "ck"
    assert (ck / "latest").read_text().strip() == f"iter_{done:07d}"
    assert json.loads((ck / f"iter_{done:07d}" / "trainer_state.json").read_text())["iteration"] == done
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["stop_kind"] == "failed" and "injected" in summary["stop_reason"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(done))
    evals = [r["iteration"] for r in map(json.loads, (tmp_path / "eval.jsonl").read_text().splitlines())]
    assert evals == list(range(done + 1 if during == "rollouts" else done))  # before RL, then after each iteration


def _setup_failing_rank(rank, world, out):
    """The experiment loggers fail to start, after the rollout engine did."""
    import dpcc_megatron.train.loggers as loggers
    import dpcc_megatron.train.setup as setup

    closed, real_build = [], setup.build_rollout_engine

    def build(ctx):
        engine = real_build(ctx)
        real_close = engine.close
        engine.close = lambda: closed.append("engine") or real_close()
        return engine

    def no_loggers(*a, **k):
        raise OSError("the logging directory is read-only")

    setup.build_rollout_engine, loggers.ExperimentLoggers = build, no_loggers
    try:
        setup.setup_run(_cfg(Path(out)))
    except OSError as e:
        return str(e), closed
    return None, closed


@pytest.mark.multirank
@pytest.mark.slow
def test_a_set_up_that_fails_after_the_engine_started_closes_it(tmp_path):
    (error, closed), = run_multirank(_setup_failing_rank, 1, args=(str(tmp_path),), timeout=300)
    assert error == "the logging directory is read-only" and closed == ["engine"]


class _Part:
    def __init__(self, log, name, fail=False):
        self.log, self.name, self.fail = log, name, fail

    def close(self):
        self.log.append(self.name)
        if self.fail:
            raise OSError(f"{self.name} cannot close")


def test_finish_closes_every_part_even_when_one_fails(tmp_path, capsys):
    from dpcc_megatron.train.finish import finish

    log = []
    ctx = SimpleNamespace(rank=0, records=[{"iteration": 0}], out_dir=tmp_path, evaluator=None,
                          exchange=_Part(log, "monitor", fail=True), loggers=_Part(log, "loggers"),
                          weights=_Part(log, "engine", fail=True), reward=_Part(log, "reward"))
    with pytest.raises(OSError, match="monitor cannot close"):  # the first failure, after every step ran
        finish(ctx, {"stop_reason": "completed"})
    assert log == ["monitor", "loggers", "engine", "reward"]
    assert json.loads((tmp_path / "train_summary.json").read_text())["records"] == 1
    out = capsys.readouterr().out
    assert "closing the monitor failed: OSError" in out and "closing the rollout engine failed: OSError" in out
