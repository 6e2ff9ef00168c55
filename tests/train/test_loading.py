"""What the trainer says while it loads a checkpoint, and how it treats a checkpoint.dir holding
another run (train/loading.py, megatron/checkpoint.py remove_interrupted_saves)."""
import json
import time

from dpcc_megatron.config import load_config, to_dict
from dpcc_megatron.megatron.checkpoint import remove_interrupted_saves, wait_for_deletions
from dpcc_megatron.train.loading import (describe_checkpoint, identity_problems, job_layout, loading,
                                         run_identity)


def _training_ckpt(path, iteration=12, **state):
    path.mkdir(parents=True)
    layout = {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 2,
              "virtual_pipeline_model_parallel_size": 5, "data_parallel_size": 4, "use_distributed_optimizer": True}
    (path / "trainer_state.json").write_text(json.dumps({"iteration": iteration, "layout": layout, **state}))
    (path / "__0_0.distcp").write_bytes(b"x" * 1024)
    return path


def test_a_load_is_announced_with_both_layouts_reports_progress_and_its_time(tmp_path):
    ck = _training_ckpt(tmp_path / "iter_0000012")
    said = describe_checkpoint(ck)
    assert said.startswith("training checkpoint of iteration 12, saved at TP8 PP2 VPP5 DP4, distributed optimizer")
    cfg = load_config(overrides=["parallel.tensor_model_parallel_size=2", "parallel.use_distributed_optimizer=false"])
    assert job_layout(cfg, 1) == "TP2 PP1 DP1, no distributed optimizer"
    lines = []
    with loading("resuming from", ck, said, job_layout(cfg, 1), lines.append, interval_s=0.05):
        time.sleep(0.3)
    assert lines[0] == f"[dpcc] resuming from {ck}: {said}; this job: TP2 PP1 DP1, no distributed optimizer"
    progress = [m for m in lines if m.startswith(f"[dpcc] still loading {ck} (")]
    assert len(progress) >= 2 and "this rank has read" in progress[0]
    assert lines[-1].startswith(f"[dpcc] loaded {ck} in ")
    quiet = []
    with loading("resuming from", ck, said, "", None):  # other ranks
        pass
    assert quiet == []


def test_a_converted_checkpoint_names_its_source(tmp_path):
    import yaml

    (tmp_path / "mc").mkdir()
    (tmp_path / "mc" / "dpcc_model.yaml").write_text(yaml.safe_dump(
        {"format": "dpcc-mcore/1", "dtype": "bf16", "model": {},
         "source": {"type": "huggingface", "architecture": "LlamaForCausalLM", "path": "/models/l31",
                    "converted_for": {"tp": 8, "pp": 2}}}))
    said = describe_checkpoint(tmp_path / "mc")
    assert said.startswith("converted checkpoint of LlamaForCausalLM from /models/l31, stored bf16, written for "
                           "TP8 PP2 (any layout loads it)")


def test_unrelated_and_later_runs_are_refused_other_settings_noted():
    cfg = load_config(overrides=["train.iterations=20", "checkpoint.load=/ck/a"])
    same = {"iteration": 10, "run": run_identity(cfg)}
    assert identity_problems(same, cfg) == ([], [])
    assert identity_problems({"iteration": 20}, cfg) == ([], [])  # a finished run resumed again; no record: no check
    other = load_config(overrides=["model.hidden_size=128", "model.ffn_hidden_size=256"])
    errors, _ = identity_problems({"iteration": 3, "run": run_identity(other)}, cfg)
    assert len(errors) == 1 and errors[0].startswith("it holds an unrelated run: its model config (fingerprint ")
    errors, _ = identity_problems({"iteration": 30, "run": run_identity(cfg)}, cfg)
    assert errors == ["it holds a later run: iteration 30, past this run's train.iterations=20 (raise "
                      "train.iterations to go on)"]
    moved = dict(run_identity(cfg), init="/ck/b", seed=7)
    errors, notes = identity_problems({"iteration": 5, "run": moved}, cfg)
    assert errors == [] and notes == ["the checkpoint's run had checkpoint.load='/ck/b', this config has '/ck/a'",
                                      f"the checkpoint's run had train.seed=7, this config has {cfg.train.seed}"]
    assert run_identity(cfg)["model_fingerprint"] != run_identity(other)["model_fingerprint"]
    assert to_dict(cfg.model) == to_dict(load_config(overrides=["train.iterations=20"]).model)


def test_saves_left_half_written_are_removed_at_start(tmp_path):
    ck = tmp_path / "ck"
    _training_ckpt(ck / "iter_0000004", 4)
    (ck / ".tmp_iter_0000006").mkdir()
    (ck / ".tmp_iter_0000006" / "__0_0.distcp").write_bytes(b"partial")
    (ck / ".trash_iter_0000002.123").mkdir()
    assert remove_interrupted_saves(ck) == [".tmp_iter_0000006"]
    wait_for_deletions(timeout=30)
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000004"]
    assert remove_interrupted_saves(tmp_path / "absent") == []


def test_announce_resolves_a_checkpoint_root_and_stays_quiet_off_rank_0(tmp_path, capsys):
    from dpcc_megatron.train.loading import announce

    root = tmp_path / "ck"
    it = _training_ckpt(root / "iter_0000007", 7)
    (it / "metadata.json").write_text("{}")
    (root / "latest").write_text("iter_0000007\n")
    cfg = load_config()
    with announce("loading checkpoint.load", root, cfg, 2, rank=0):
        pass
    with announce("loading checkpoint.load", root, cfg, 2, rank=1):
        pass
    with announce("loading checkpoint.load", tmp_path / "absent", cfg, 2, rank=0):  # the load reports it
        pass
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"[dpcc] loading checkpoint.load {it}: training checkpoint of iteration 7")
    assert out[1].startswith(f"[dpcc] loaded {it} in ")
    assert out[2].startswith(f"[dpcc] loading checkpoint.load {tmp_path / 'absent'}: Megatron-Core checkpoint")
    assert len(out) == 4


def _ctx(overrides):
    from types import SimpleNamespace

    from dpcc_megatron.train.checkpoints import Checkpoints

    ckpt = object.__new__(Checkpoints)
    ckpt.ctx = SimpleNamespace(cfg=load_config(overrides=overrides), rank=0)
    return ckpt


def test_starting_into_a_directory_of_another_run_says_so(tmp_path, capsys):
    import pytest

    from dpcc_megatron.megatron.checkpoint import CheckpointError

    ck = tmp_path / "ck"
    _training_ckpt(ck / "iter_0000030", 30)
    (ck / "latest").write_text("iter_0000030\n")
    (ck / ".tmp_iter_0000031").mkdir()
    _ctx([f"checkpoint.dir={ck}", "checkpoint.resume=never"])._sweep_checkpoint_dir()
    out = capsys.readouterr().out
    assert f"[dpcc] removed {ck / '.tmp_iter_0000031'}: a save that never finished" in out
    assert (f"[dpcc] WARNING: {ck} holds another run's checkpoints (latest: iteration 30); checkpoint.resume=never "
            "starts afresh, and this run's saves replace `latest` and retire those checkpoints") in out
    with pytest.raises(CheckpointError, match=r"cannot be resumed by this run: its latest checkpoint iter_0000030 it "
                                              r"holds a later run: iteration 30, past this run's train.iterations=20"):
        _ctx([f"checkpoint.dir={ck}", "train.iterations=20"])._check_same_run(ck / "iter_0000030")
    wait_for_deletions(timeout=30)
