"""Experiment loggers: TensorBoard by default, wandb optional (offline, no network), never required."""
import sys
import time
from pathlib import Path

import pytest

from dpcc_megatron.config import load_config
from dpcc_megatron.train.loggers import ExperimentLoggers


def _tb_scalars(logdir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_by_default_and_nothing_else(tmp_path):
    cfg = load_config()
    assert cfg.logger.tensorboard and not cfg.logger.wandb
    log = ExperimentLoggers(cfg, tmp_path)
    assert log.wandb_run is None
    log.log({"train/reward_mean": 0.5, "eval/pass_at_1": 0.25, "text": "x", "bad": float("nan")}, 3)
    log.close()
    got = _tb_scalars(tmp_path / "tensorboard")
    assert got == {"train/reward_mean": [(3, 0.5)], "eval/pass_at_1": [(3, 0.25)]}
    off = ExperimentLoggers(load_config(overrides=["logger.tensorboard=false"]), tmp_path / "off")
    assert off.tb is None and not (tmp_path / "off" / "tensorboard").exists()


def test_wandb_offline_writes_a_run_without_network(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = load_config(overrides=["logger.wandb=true", "logger.tensorboard=false", "logger.wandb_name=unit",
                                 f"logger.wandb_dir={tmp_path / 'w'}"])
    assert cfg.logger.wandb_mode == "offline"
    log = ExperimentLoggers(cfg, tmp_path, run_config={"optim": {"lr": 0.1}})
    run_dir = Path(log.wandb_run.dir).parent
    for step in range(3):
        log.log({"train/reward_mean": 0.1 * step, "eval/reward_greedy": 0.2}, step)
    log.close()
    assert run_dir.name.startswith("offline-run-") and run_dir.parent.parent == tmp_path / "w"
    (record_file,) = run_dir.glob("run-*.wandb")
    wandb.teardown()  # stop the wandb-core service, which writes the run file asynchronously
    deadline = time.time() + 60
    while True:  # protobuf records: keys and JSON values appear verbatim
        data = record_file.read_bytes()
        if data.count(b"train/reward_mean") >= 3 or time.time() > deadline:
            break
        time.sleep(0.5)
    assert data.count(b"train/reward_mean") >= 3 and b"eval/reward_greedy" in data
    assert b"0.1" in data and b"optim" in data
    assert wandb.run is None  # finished


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    cfg = load_config(overrides=["logger.wandb=true", "logger.tensorboard=false"])
    with pytest.raises(RuntimeError, match=r"logger.wandb is true but wandb is not installed"):
        ExperimentLoggers(cfg, tmp_path)
