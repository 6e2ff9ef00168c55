"""The trainer's side of control advice: the LR scale recovers after a healthy stretch and is
checkpointable; a silent sidecar hands the advice to the local detector and takes it back."""
from __future__ import annotations

from dpcc_megatron.config import MonitorConfig
from dpcc_megatron.monitor.alerts import ControlPolicy
from dpcc_megatron.train.control import MonitorControl, SidecarAdvice


def test_lr_scale_cuts_recovers_and_round_trips():
    c = MonitorControl(MonitorConfig(reduce_lr_factor=0.5, lr_recovery_iterations=3))
    c.apply(("reduce_lr", 0.5, None))
    c.apply(("reduce_lr", 0.5, None))
    assert c.lr_scale == 0.25
    for _ in range(2):
        c.apply(None)
    assert c.lr_scale == 0.25  # not yet: 2 healthy iterations of 3
    restored = MonitorControl(MonitorConfig(reduce_lr_factor=0.5, lr_recovery_iterations=3))
    restored.load_state_dict(c.state_dict())
    for ctl in (c, restored):  # a resumed run recovers at the same iteration
        ctl.apply(None)
        assert ctl.lr_scale == 0.5 and ctl.recoveries == 1
    for _ in range(10):
        c.apply(None)
    assert c.lr_scale == 1.0  # never above 1
    permanent = MonitorControl(MonitorConfig(lr_recovery_iterations=0))
    permanent.apply(("reduce_lr", 0.5, None))
    for _ in range(50):
        permanent.apply(None)
    assert permanent.lr_scale == 0.5


class _Sidecar:
    def __init__(self, answers):
        self.answers, self.waits = list(answers), []

    def wait_delivered(self, iteration, timeout):
        self.waits.append(timeout)
        return self.answers.pop(0)

    def poll_control(self):
        return "sidecar-advice"


def test_a_silent_sidecar_hands_advice_to_the_local_detector_and_takes_it_back():
    logs = []
    s = SidecarAdvice(MonitorConfig(advice_wait_s=2.0, sidecar_down_after=2), log=logs.append)
    side = _Sidecar([True, False, False, False, True])
    got = [s.answer(side, i, local=f"local-{i}") for i in range(5)]
    assert got == ["sidecar-advice", "local-1", "local-2", "local-3", "sidecar-advice"]
    assert side.waits == [2.0, 2.0, 2.0, 0.0, 0.0]  # once down, no more waiting
    assert s.fallbacks == 3 and not s.down
    assert any("unresponsive" in m for m in logs) and any("answers again" in m for m in logs)


def test_monitor_off_means_no_advice_unless_control_is_explicit():
    assert MonitorConfig(enabled=False).control_active is False
    assert MonitorConfig(enabled=False, control_enabled=True).control_active is True
    assert MonitorConfig().control_active is True
    assert ControlPolicy(MonitorConfig(enabled=False)).enabled is False


def test_retention_keeps_a_checkpoint_every_rollback_target_can_reach():
    from dpcc_megatron.monitor.alerts import rollback_target
    from dpcc_megatron.train.control import retention_target

    cfg = MonitorConfig()
    w = 3  # the detector's evidence window
    for last_at_save in range(0, 12):
        keep = retention_target(last_at_save, w, cfg)
        # the next record (at most last_at_save + 1 ... any later alert) with any window of <= w records
        for it in range(last_at_save + 1, last_at_save + 6):
            for n in range(1, w + 1):
                window = [[i, 0.0] for i in range(it - n + 1, it + 1)]
                for last_at_alert in range(last_at_save, it):
                    target = rollback_target(last_at_alert, window)
                    assert (0 if target is None else target) >= keep, (last_at_save, it, n, last_at_alert)
    assert retention_target(None, w, cfg) == 0  # before any healthy iteration: the start
    assert retention_target(None, w, MonitorConfig(rollback_to_start=False)) is None
    assert retention_target(7, w, MonitorConfig(rollback_before_evidence=False)) == 7



def test_act_on_chooses_which_advice_the_trainer_carries_out_and_is_validated():
    import pytest

    from dpcc_megatron.config import ConfigError, load_config

    acts = {mode: [MonitorConfig(act_on=mode).acts_on(a) for a in ("reduce_lr", "rollback", "checkpoint_and_pause")]
            for mode in ("all", "confirmed", "none")}
    assert acts == {"all": [True, True, True], "confirmed": [False, True, True], "none": [False, False, False]}
    assert not MonitorConfig(enabled=False).acts_on("rollback")  # control off: nothing, whatever act_on says
    assert not MonitorConfig().acts_on("none")
    with pytest.raises(ConfigError, match="monitor.act_on"):
        load_config(overrides=["monitor.act_on=sometimes"])


def _exchange(act_on, confirmed, tmp_path, capsys):
    """MonitorExchange.exchange on rank 0 with a detector that raises one alert; returns (advice, the run's
    checkpoints, its exchange, log)."""
    from types import SimpleNamespace

    from dpcc_megatron.config import load_config
    from dpcc_megatron.monitor.alerts import Alert
    from dpcc_megatron.train.checkpoints import Checkpoints
    from dpcc_megatron.train.monitor_exchange import MonitorExchange

    class Detector:
        last_healthy_iteration = 4

        def update(self, record):
            return [Alert(rule="kl_drift", severity="critical", iteration=record["iteration"], message="KL high",
                          metric="kl_step_max", window=[[5, 3.0]], confirmed=confirmed)]

    cfg = load_config(overrides=[f"monitor.act_on={act_on}", "monitor.enabled=false",
                                 "monitor.control_enabled=true", f"checkpoint.dir={tmp_path}"])
    exchange = MonitorExchange(cfg, 0, 1, {}, Detector())
    advice = exchange.exchange({"iteration": 5})
    return advice, Checkpoints(SimpleNamespace(cfg=cfg)), exchange, capsys.readouterr().out


def test_advice_not_acted_on_is_logged_and_never_reaches_the_loop(tmp_path, capsys):
    advice, ckpt, exchange, out = _exchange("all", False, tmp_path, capsys)
    assert advice == ("reduce_lr", 0.5, None) and ckpt.can_roll_back()
    advice, ckpt, exchange, out = _exchange("confirmed", False, tmp_path, capsys)
    assert advice is None and "not acted on (monitor.act_on: confirmed): reduce_lr" in out
    advice, ckpt, exchange, out = _exchange("confirmed", True, tmp_path, capsys)
    assert advice[0] == "rollback" and advice[2] == 4 and ckpt.can_roll_back()
    advice, ckpt, exchange, out = _exchange("none", True, tmp_path, capsys)
    assert advice is None and "not acted on (monitor.act_on: none): rollback" in out
    assert "ALERT critical kl_drift" in out and len(exchange.alerts) == 1  # the alert itself is reported as ever
    assert not ckpt.can_roll_back()  # no start checkpoint, no retention for a rollback that cannot come
