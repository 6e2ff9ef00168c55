"""`dpcc-megatron reward`: score a JSONL of samples offline with the dual-track reward.

Each input line is a JSON object with `prompt`, `response` and task fields
(`task`, `answer`, `tests`, `schema`, `pattern`, `language`, `group_id`). Without
`--config` the built-in checkers of each line's `task` apply. Lines with the same
`group_id` (default: the same prompt) form a group for the advanced track. Each
output line is the input plus `base`, `advanced`, `total` and `checkers`
(each checker's score; penalties are reported as the penalty).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="job YAML; only its `reward` section is used")
    parser.add_argument("--input", required=True, help="samples JSONL")
    parser.add_argument("--out", required=True, help="scored JSONL to write")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. reward.judge.temperature=0.5 (repeatable)")
    parser.add_argument("--metrics", help="also write the batch metrics as JSON here")


def main(args: argparse.Namespace) -> int:
    from ..config import ConfigError, load_config
    from ..rewards import DualTrackReward, SampleError, read_samples

    try:
        cfg = load_config(args.config, args.overrides).reward
        samples = read_samples(args.input)
        reward = DualTrackReward(cfg)
    except (ConfigError, SampleError, FileNotFoundError) as e:
        print(f"dpcc-megatron reward: error: {e}", file=sys.stderr)
        return 2
    with reward:
        result = reward.score(samples, update=False)  # offline: weights stay at their configured start
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for sample, rec in zip(samples, result.records()):
            f.write(json.dumps({**sample.to_dict(), **rec}, ensure_ascii=False) + "\n")
    if args.metrics:
        Path(args.metrics).write_text(json.dumps(result.metrics, indent=2, sort_keys=True) + "\n")

    m = result.metrics
    groups = int(result.group_index.max()) + 1 if samples else 0
    print(f"scored {len(samples)} samples in {groups} groups -> {out}")
    print(f"  mean base {m['reward/base_mean']:.4f}  advanced {m['reward/advanced_mean']:.4f}  "
          f"total {m['reward/total_mean']:.4f}  (weights {result.weights['base']:.2f}/{result.weights['advanced']:.2f})")
    print(f"  zero-variance groups {m['reward/zero_var_group_frac']:.2%}  "
          f"checker errors {int(m['reward/checker_errors'])}  timeouts {int(m['reward/checker_timeouts'])}"
          + (f"  judge errors {int(m['reward/judge_errors'])}" if m["reward/judge_errors"] else ""))
    for key in ("base", "advanced", "total"):
        if f"reward/label_agreement_{key}" in m:
            print(f"  agreement with labelled set ({key}): {m[f'reward/label_agreement_{key}']:.4f}")
    for msg in result.messages:
        print(f"  warning: {msg}", file=sys.stderr)
    return 0
