"""MonitorConfig loads from YAML, validates with key-path errors."""
from __future__ import annotations

import pytest

from dpcc_megatron.config import ConfigError, load_config
from dpcc_megatron.config.monitor import MonitorConfig, parse_hostport


def test_defaults_are_the_dpcc_values():
    cfg = load_config().monitor
    assert isinstance(cfg, MonitorConfig)
    assert cfg.kl_threshold == 0.8 and cfg.kl_window == 3 and cfg.entropy_jump_window == 3
    assert cfg.listen.startswith("127.0.0.1:")


def test_yaml_sets_band_and_kl(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("monitor:\n  entropy_band: [3.5, 5.0]\n  kl_threshold: 0.5\n  kl_window: 4\n")
    cfg = load_config(p).monitor
    assert cfg.entropy_band == (3.5, 5.0) and cfg.kl_threshold == 0.5 and cfg.kl_window == 4


@pytest.mark.parametrize("override, message", [
    ("monitor.kl_window=0", "monitor.kl_window must be >= 1, got 0"),
    ("monitor.entropy_band=[5.0, 3.5]", "monitor.entropy_band must be [low, high]"),
    ("monitor.listen=localhost", "monitor.listen must be HOST:PORT"),
    ("monitor.reduce_lr_factor=1.5", "monitor.reduce_lr_factor must be in (0, 1)"),
    ("monitor.webhook_url=ftp://x", "monitor.webhook_url must be an http:// or https:// URL"),
    ("monitor.repetition_threshold=0", "monitor.repetition_threshold must be in (0, 1]"),
    ("monitor.max_rollbacks=0", "monitor.max_rollbacks must be >= 1, got 0"),
    ("monitor.kl_ref_critical_threshold=0", "monitor.kl_ref_critical_threshold must be > 0 or null"),
    ("monitor.kl_ref_threshold=-1", "monitor.kl_ref_threshold must be > 0 or null"),
    ("monitor.no_such_key=1", "unknown key monitor.no_such_key"),
])
def test_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert message in str(e.value)


def test_parse_hostport():
    assert parse_hostport("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_hostport("[::1]:9400") == ("::1", 9400)
    for bad in ("127.0.0.1", ":80", "h:99999", "h:x"):
        with pytest.raises(ValueError):
            parse_hostport(bad)
