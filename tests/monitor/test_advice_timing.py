"""Advice is answered at a deterministic point: after iteration i's record is acknowledged,
the advice it caused is pending before iteration i+1 (issue: reproducible runs)."""
from __future__ import annotations

import time

from dpcc_megatron.monitor.client import MonitorClient

from .helpers import KL_WARNING_ONLY, fast_cfg
from .test_sidecar_e2e import _record


def test_advice_caused_by_a_record_is_pending_once_it_is_delivered(tmp_path, sidecars):
    # The background control poll is made rare, so only the ingest answer can bring the advice.
    cfg = fast_cfg(control_poll_interval_s=60.0, **KL_WARNING_ONLY)
    h = sidecars(tmp_path / "m.sqlite", cfg=cfg)
    client = MonitorClient.from_config(cfg, address=h.address, token=h.token, run_id="timing",
                                       output_dir=str(tmp_path))
    try:
        got = {}
        for i in range(14):
            assert client.send(_record(i))
            assert client.wait_delivered(i, timeout=10.0), i
            advice = client.poll_control()
            if advice is not None:
                got[i] = advice
        # kl_old_new is 0.95 at 10, 11, 12 and kl_window is 3: the alert is raised by record 12
        assert list(got) == [12] and got[12].action == "reduce_lr"
    finally:
        client.close(2.0)


def test_wait_delivered_times_out_when_the_sidecar_is_down(tmp_path):
    cfg = fast_cfg()
    client = MonitorClient.from_config(cfg, address="127.0.0.1:9", token="x", run_id="down",
                                       output_dir=str(tmp_path))
    try:
        assert client.send({"iteration": 0, "entropy": 1.0})
        t0 = time.monotonic()
        assert client.wait_delivered(0, timeout=0.5) is False
        assert 0.4 <= time.monotonic() - t0 < 5.0
    finally:
        client.close(0.5)
    assert MonitorClient(None).wait_delivered(0, timeout=1.0) is False  # disabled client: never waits
