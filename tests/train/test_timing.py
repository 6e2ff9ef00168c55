"""Phase timings and peak memory in the iteration record (train/timing.py)."""
import pytest

from dpcc_megatron.train.logging import ConsoleLogger
from dpcc_megatron.train.timing import PhaseTimer, console_fields


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class _Engine:
    def __init__(self, refits, last):
        self.refits, self.last_refit_s = refits, last


def test_phases_accumulate_refit_is_taken_out_of_rollout_and_fields_reset():
    clock = _Clock()
    timer = PhaseTimer(clock=clock)
    engine = _Engine(refits=3, last=0.5)
    timer.start_iteration(engine)
    with timer.phase("rollout"):
        engine.refits, engine.last_refit_s = 4, 1.5  # the engine refitted inside the rollout
        clock.t += 4.0
    for name, dt in (("logprobs_old", 1.0), ("logprobs_ref", 0.25), ("eval", 2.0)):
        with timer.phase(name):
            clock.t += dt
    timer.start("update")
    clock.t += 3.0
    timer.stop("update")
    with timer.phase("checkpoint"):
        clock.t += 0.5
    with timer.phase("checkpoint"):
        clock.t += 0.5
    got = timer.record_fields(engine, world_max=False)
    assert got["time_rollout_s"] == pytest.approx(2.5) and got["time_refit_s"] == 1.5
    assert got["time_logprobs_s"] == pytest.approx(1.25) and got["time_logprobs_ref_s"] == 0.25
    assert (got["time_update_s"], got["time_checkpoint_s"], got["time_eval_s"]) == (3.0, 1.0, 2.0)
    assert got["peak_device_memory_gib"] is None  # no CUDA here: said, not guessed
    assert got["host_peak_rss_gib"] > 0.01
    # next iteration: no refit ran (the counter did not move), the seconds start from zero
    timer.start_iteration(engine)
    with timer.phase("rollout"):
        clock.t += 1.0
    nxt = timer.record_fields(engine, world_max=False)
    assert (nxt["time_rollout_s"], nxt["time_refit_s"], nxt["time_update_s"]) == (1.0, 0.0, 0.0)


def test_an_engine_without_a_refit_counter_reports_its_last_refit_and_misuse_raises():
    timer = PhaseTimer(clock=_Clock())
    timer.start_iteration(object())
    assert timer.refit_seconds(type("E", (), {"last_refit_s": 0.0})()) == 0.0
    with pytest.raises(KeyError, match="unknown phase"):
        timer.start("sleeping")
    with pytest.raises(RuntimeError, match="was not started"):
        timer.stop("update")
    timer.start("update")
    with pytest.raises(RuntimeError, match="already open"):
        timer.start("update")


def test_console_line_carries_the_phases_and_says_na_without_a_device_figure(capsys):
    r = {"time_rollout_s": 12.34, "time_refit_s": 0.0, "time_logprobs_s": 2.0, "time_update_s": 30.0,
         "time_checkpoint_s": 0.0, "time_eval_s": 5.0, "peak_device_memory_gib": None}
    assert console_fields(r) == ("time rollout/refit/logprobs/update/ckpt/eval (s): 12.3/0.0/2.0/30.0/0.0/5.0 | "
                                 "peak mem: n/a")
    assert console_fields({**r, "peak_device_memory_gib": 61.25}).endswith("peak mem: 61.2 GiB")

    class Ctx:
        rank, records, loggers = 0, [], None
        cfg = type("C", (), {"train": type("T", (), {"iterations": 2, "log_interval": 1})()})()

    rec = {"iteration": 0, "consumed_samples": 8, "reward_mean": 0.5, "kl_estimator": "k3", "kl_old_new": 0.0,
           "tau": 0.2, "lr": 1e-6, "lr_factor": 1.0, "grad_norm": 1.0, "clip_frac": 0.0,
           "sample_utilization": 1.0, "seconds": 50.0, "tokens_per_s": 100.0, **r}
    ConsoleLogger(Ctx()).line(rec)
    assert "time rollout/refit/logprobs/update/ckpt/eval (s): 12.3/" in capsys.readouterr().out
