"""The mixture-of-experts testbed of benchmarks/stability/moe-routing-replay.md: its grid builds valid jobs
with routing replay off and on, a tiny run of it with replay on records the expert-load fields the
report reads, and the pre-registered reading (moe_replay.py) counts pairs and verdicts as written."""
import json

import pytest

from benchmarks.stability.grid import AGGRESSIVE_LR, GRIDS, SAFE_LR, build_config, run_overrides
from benchmarks.stability.measures import moe_measures
from benchmarks.stability.moe_replay import REPLAY, arm, claims, compare, main


def _job(method, sets=None):
    from dataclasses import replace

    from dpcc_megatron.config import JobConfig
    from dpcc_megatron.config.base import from_dict

    grid = replace(GRIDS["moe-addition"], sets=dict(sets or {}))
    return from_dict(JobConfig, build_config(run_overrides(grid, method, AGGRESSIVE_LR, grid.seeds[0])))


@pytest.mark.parametrize("method", ["grpo", "dpcc"])
def test_the_moe_grid_builds_with_replay_off_and_on(method):
    dense = _job(method).model
    off, on = _job(method), _job(method, REPLAY)
    assert off.model.num_moe_experts == 4 and off.model.moe_router_topk == 2
    # as many active MLP weights per token as the dense testbed's MLP
    assert off.model.moe_router_topk * off.model.moe_ffn_hidden_size == dense.ffn_hidden_size == 256
    assert (off.rollout.routing_replay, on.rollout.routing_replay) == (False, True)
    assert off.loss.name == on.loss.name == method
    assert GRIDS["moe-addition"].seeds == tuple(range(1201, 1217))  # the pre-registered held-out seeds


def test_moe_measures_summarise_expert_load_and_skip_dense_runs():
    recs = [{"moe_load_entropy": 0.9, "moe_load_max_over_mean": 1.5},
            {"moe_load_entropy": 0.7, "moe_load_max_over_mean": 2.5}, {"moe_load_entropy": float("nan")}]
    out = moe_measures(recs)
    assert out["moe_load_entropy_mean"] == pytest.approx(0.8) and out["moe_load_entropy_min"] == 0.7
    assert out["moe_load_max_over_mean_mean"] == pytest.approx(2.0)
    assert moe_measures([{"entropy": 1.0}]) == {}


def _r(method, lr, seed, collapsed=False, after=0.5, before=0.4, replay=False):
    return {"method": arm(method, replay), "lr": lr, "seed": seed, "collapsed": collapsed, "reward_after": after,
            "reward_before": before, "kl_max": 0.1, "moe_load_entropy_mean": 0.9}


def _grid(replay_saves=6):
    """16 seeds: GRPO collapses at the aggressive LR in every seed without replay, and in all but
    ``replay_saves`` with it; DPCC in none; at the safe LR replay ends 0.01 lower."""
    runs = []
    for s in range(1, 17):
        for rp in (False, True):
            runs += [_r("grpo", AGGRESSIVE_LR, s, collapsed=not (rp and s <= replay_saves), after=0.1, replay=rp),
                     _r("dpcc", AGGRESSIVE_LR, s, after=0.3, replay=rp),
                     _r("grpo", SAFE_LR, s, after=0.5 - 0.01 * rp + 0.001 * (s % 3), replay=rp),
                     _r("dpcc", SAFE_LR, s, after=0.5 - 0.01 * rp + 0.001 * (s % 2), replay=rp)]
    runs.append(_r("dpcc", AGGRESSIVE_LR, 99, replay=True))  # no partner without replay: left out
    return runs


def test_paired_comparisons_count_complete_pairs_only():
    c = compare(_grid(), arm("dpcc", True), arm("dpcc", False), AGGRESSIVE_LR)
    assert c["pairs"] == 16 and c["collapses"] == (0, 0)
    c = compare(_grid(), arm("grpo", True), arm("grpo", False), AGGRESSIVE_LR)
    assert (c["only_a"], c["only_b"], c["collapses"]) == (0, 6, (10, 16))
    assert c["p_collapse"] == pytest.approx(2 / 64)


@pytest.mark.parametrize("saves, verdict", [(6, "holds"), (5, "not shown")])  # 0 vs 5: p = 0.0625
def test_the_replay_claim_needs_an_exact_paired_p_below_005(saves, verdict):
    lines = claims(_grid(saves), AGGRESSIVE_LR, SAFE_LR)
    assert len(lines) == 6
    assert lines[0].startswith("- Replay lowers `grpo`") and lines[0].endswith(f"**{verdict}**.")
    assert lines[1].endswith("**not shown**.")  # DPCC never collapses: nothing to lower
    assert lines[2].endswith("**holds**.") and "0/16 vs 16/16" in lines[2]  # replay off: DPCC vs GRPO
    assert lines[4].endswith("**shown**.") and "-0.010" in lines[4]  # the safe-LR margin is -0.02


def test_the_reading_prints_from_a_runner_folder(tmp_path, capsys):
    (tmp_path / "results").mkdir()
    for i, r in enumerate(_grid()):
        method, _, rest = r["method"].partition("[")
        row = dict(r, method=method, **({"set": dict(REPLAY)} if rest else {}))
        (tmp_path / "results" / f"{i}.json").write_text(json.dumps(row))
    assert main(["--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "129 runs" in text and "| 0.002 | grpo | on | 16 | 10/16 = 62%" in text
    assert "`grpo[rollout.routing_replay=True]` vs `grpo`" in text


@pytest.mark.slow
def test_a_tiny_moe_run_with_replay_records_the_expert_load(tmp_path):
    """Two iterations of the testbed's job from random weights, replay on: the trainer records the expert
    load and the router's load-balancing loss every iteration, and the judge turns them into measures."""
    from benchmarks.stability.run import judge, run_config, train_once

    over = {**run_overrides(GRIDS["moe-addition"], "dpcc", AGGRESSIVE_LR, 1201), **REPLAY,
            "train.iterations": 2, "eval.samples": 1}
    cfg = run_config(over, tmp_path / "run", tmp_path / "none")
    del cfg["checkpoint"]["load"]  # random weights: no warm-start needed to record routing
    rc, wall, tail = train_once(cfg, tmp_path / "run", timeout_s=300)
    assert rc == 0, tail
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len(records) == 2
    for rec in records:
        assert 0.0 < rec["moe_load_entropy"] <= 1.0 and rec["moe_load_max_over_mean"] >= 1.0
        assert rec["moe_load_balancing_loss"] > 0 and rec["moe_dropped_tokens"] == 0
        assert {"moe_load_entropy_l0", "moe_load_entropy_l1"} <= set(rec)
    result = judge({"exit_code": rc}, tmp_path / "run", target=0.4, wall=wall)
    assert result["iterations"] == 2 and 0.0 < result["moe_load_entropy_min"] <= result["moe_load_entropy_mean"]


def test_the_committed_reading_regenerates_from_its_export():
    """Every line of moe-routing-replay.md's held-out reading comes back from its committed export, and the
    export holds the pre-registered grid: 4 arms x 2 LRs x seeds 1201-1216."""
    from pathlib import Path

    from benchmarks.stability.analyze import load_results
    from benchmarks.stability.moe_replay import report

    stability = Path(__file__).resolve().parents[2] / "benchmarks" / "stability"
    results, failed = load_results(stability / "moe-routing-replay.jsonl.xz")
    assert not failed and len(results) == 128
    assert {r["seed"] for r in results} == set(GRIDS["moe-addition"].seeds)
    assert {(r["method"], r["lr"]) for r in results} == {(arm(m, rp), lr) for m in ("grpo", "dpcc")
                                                         for rp in (False, True) for lr in (SAFE_LR, AGGRESSIVE_LR)}
    text = (stability / "moe-routing-replay.md").read_text()
    lines = [line for line in report(results, AGGRESSIVE_LR, SAFE_LR) if line.strip()]
    assert len(lines) > 20 and [line for line in lines if line not in text] == []
