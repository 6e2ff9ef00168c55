"""How a run ended reaches the scheduler: `dpcc-megatron train` returns a distinct status when paused."""
import pytest

from dpcc_megatron.train.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_PAUSED, exit_code


@pytest.mark.parametrize("kind, code", [("completed", EXIT_OK), ("signal", EXIT_OK), ("exit_interval", EXIT_OK),
                                        ("paused", EXIT_PAUSED), ("nonfinite", EXIT_FAILED), (None, EXIT_FAILED)])
def test_exit_code_per_stop_kind(kind, code):
    assert exit_code({"stop_kind": kind}) == code


def test_paused_is_distinct_from_success_and_usage_errors():
    assert EXIT_PAUSED not in (0, 1, 2)


@pytest.mark.parametrize("kind, code", [("paused", 3), ("completed", 0), ("nonfinite", 1)])
def test_train_cli_returns_the_status(monkeypatch, kind, code):
    import dpcc_megatron.train.trainer as trainer
    from dpcc_megatron.cli import main

    seen = {}
    monkeypatch.setattr(trainer, "train", lambda cfg: seen.setdefault("cfg", cfg) and {"stop_kind": kind})
    assert main(["train", "--config", "examples/tiny_cpu.yaml", "--set", "train.iterations=1"]) == code
    assert seen["cfg"].train.iterations == 1


def test_train_cli_bad_config_is_usage_error(capsys):
    from dpcc_megatron.cli import main

    assert main(["train", "--config", "examples/tiny_cpu.yaml", "--set", "checkpoint.async_save=maybe"]) == 2
    assert "checkpoint.async_save" in capsys.readouterr().err
