"""The end of a run, on every exit path: records and summary written (rank 0), the monitor client, the
loggers, the rollout engine and the reward's resources closed (:func:`close` alone after a set-up that
failed). Each step runs even when an earlier one fails; the first failure is raised after all of them ran."""
from __future__ import annotations

import json


def finish(ctx, summary: dict) -> None:
    """Write the records, the evaluations and the summary (rank 0), then :func:`close`."""
    _run_all(([("writing the records", lambda: _write_outputs(ctx, summary))] if ctx.rank == 0 else []) + _closing(ctx))


def close(ctx) -> None:
    """Close the monitor client, the loggers, the rollout engine and the reward's resources (what exists)."""
    _run_all(_closing(ctx))


def _closing(ctx) -> list:
    steps = []
    if ctx.exchange is not None:
        steps.append(("closing the monitor", ctx.exchange.close))
    if ctx.loggers is not None:
        steps.append(("closing the loggers", ctx.loggers.close))
    if ctx.weights is not None:
        steps.append(("closing the rollout engine", ctx.weights.close))
    close_reward = getattr(ctx.reward, "close", None)
    if close_reward:
        steps.append(("closing the reward", close_reward))
    return steps


def _run_all(steps: list) -> None:
    first = None
    for name, step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001 - the remaining steps still run
            print(f"[dpcc] finishing the run: {name} failed: {type(e).__name__}: {e}", flush=True)
            first = first or e
    if first is not None:
        raise first


def _write_outputs(ctx, summary: dict) -> None:
    summary["records"] = len(ctx.records)
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    with open(ctx.out_dir / "metrics.jsonl", "w") as f:
        for r in ctx.records:
            f.write(json.dumps(r) + "\n")
    (ctx.out_dir / "train_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if ctx.evaluator is not None:
        with open(ctx.out_dir / "eval.jsonl", "w") as f:
            for r in ctx.evaluator.records:
                f.write(json.dumps(r) + "\n")
