"""Exit status of `dpcc-megatron train`, so that a scheduler sees how a run ended.

* 0: completed; stopped by a signal (SIGUSR1/SIGTERM/SIGINT) after checkpointing; stopped by
  ``train.exit_interval``.
* 1: failed: an exception, or stopped after ``train.max_consecutive_skips`` non-finite steps.
* 2: bad arguments or config.
* 3: paused by the monitor's advice (a confirmed collapse with no checkpoint to roll back to):
  checkpointed, needs a person. Slurm reports FAILED, not COMPLETED; the batch script does not
  requeue.
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PAUSED = 3

# summary["stop_kind"] -> status
_BY_KIND = {"completed": EXIT_OK, "signal": EXIT_OK, "exit_interval": EXIT_OK, "paused": EXIT_PAUSED,
            "nonfinite": EXIT_FAILED}


def exit_code(summary: dict) -> int:
    """The process status for a finished ``train()`` summary (an unknown kind counts as a failure)."""
    return _BY_KIND.get(summary.get("stop_kind"), EXIT_FAILED)
