"""The update step's bookkeeping without a model: the Dr. GRPO budget, the schedule on skipped
steps, and the monitor advice fallback."""
from __future__ import annotations

import pytest
import torch

import dpcc_megatron.train.update as update
from dpcc_megatron.algo import get_policy_loss
from dpcc_megatron.config import JobConfig, load_config
from dpcc_megatron.megatron.policy_step import RLBatch, global_normalizer


def _batch(prompt_len: int, response_lens=(3, 1, 2)) -> RLBatch:
    L = prompt_len + max(response_lens)
    mask = torch.zeros(len(response_lens), L - 1, dtype=torch.bool)
    for i, n in enumerate(response_lens):
        mask[i, prompt_len - 1:prompt_len - 1 + n] = True
    return RLBatch(tokens=torch.zeros(len(response_lens), L, dtype=torch.long), mask=mask)


def test_dr_grpo_divides_by_the_generation_budget_not_the_padded_length():
    loss = get_policy_loss("dr_grpo")
    values = []
    for prompt_len in (2, 9):  # same responses, longer prompts: more padding
        b = _batch(prompt_len)
        norm = global_normalizer(b, None, max_len=4)
        assert norm.max_len == 4 and norm.num_rows == 3
        lp = torch.full(b.mask.shape, -1.0)
        adv = torch.tensor([1.0, -1.0, 0.5])
        value, _ = loss(lp, lp.detach(), adv, b.mask, normalizer=norm)
        values.append(float(value))
        # sum over tokens of -A * r (r = 1) / (B * budget)
        assert float(value) == pytest.approx(-(3 * 1.0 + 1 * -1.0 + 2 * 0.5) / (3 * 4))
    assert values[0] == values[1]
    assert global_normalizer(_batch(9), None).max_len == 11  # without a budget: the padded length
    with pytest.raises(ValueError, match="generation budget"):
        global_normalizer(_batch(2), None, max_len=2)


class _Opt:
    def __init__(self, ok: bool):
        self.ok, self.param_groups = ok, [{"lr": 1.0}]

    def step(self):
        return self.ok, 1.0, None


class _Sched:
    num_steps = 0

    def step(self, n):
        self.num_steps += n


class _Scaler:
    scale, min_scale = torch.tensor(1024.0), torch.tensor(1.0)


@pytest.mark.parametrize("ok", [True, False])
def test_the_lr_schedule_moves_only_on_applied_steps(monkeypatch, ok):
    monkeypatch.setattr(update, "grad_scaler", lambda opt: _Scaler())  # fp16: the optimizer finds overflows
    sched = _Sched()
    skipped, _, _, overflow = update._optimizer_step([], _Opt(ok), sched, 1.0)
    assert skipped is (not ok) and overflow is (not ok)
    assert sched.num_steps == (1 if ok else 0)


# -- monitor advice: deterministic point, logged fallback --------------------------------------------
class _Detector:
    last_healthy_iteration = 4

    def update(self, record):
        from dpcc_megatron.monitor.alerts import Alert

        return [Alert(rule="kl_drift", severity="critical", iteration=5, message="injected", metric="kl_old_new",
                      window=[[5, 0.9]], confirmed=False)]


class _SlowSidecar:
    def __init__(self, delivered: bool):
        self.delivered, self.sent = delivered, []

    def send(self, record):
        self.sent.append(record["iteration"])

    def wait_delivered(self, iteration, timeout):
        return self.delivered

    def poll_control(self):
        return None  # the sidecar saw nothing to advise


def _exchange(monitor, wait: float):
    from dpcc_megatron.train.monitor_exchange import MonitorExchange

    cfg = load_config(overrides=[f"monitor.advice_wait_s={wait}"])
    return MonitorExchange(cfg, 0, 1, {"advice_fallbacks": 0}, _Detector(), monitor)


def test_monitor_advice_falls_back_to_the_local_detector_when_the_sidecar_is_late(capsys):
    ex = _exchange(_SlowSidecar(delivered=False), wait=0.1)
    advice = ex.exchange({"iteration": 5})
    assert advice is not None and advice[0] == "reduce_lr"  # the local detector's kl_drift advice
    assert ex.counters["advice_fallbacks"] == 1 and ex.monitor.sent == [5]
    assert "monitor.advice_wait_s" in capsys.readouterr().out


def test_monitor_advice_comes_from_the_sidecar_once_it_acknowledged():
    ex = _exchange(_SlowSidecar(delivered=True), wait=0.1)
    assert ex.exchange({"iteration": 5}) is None  # the sidecar's answer (none) wins
    assert ex.counters["advice_fallbacks"] == 0
