"""The stability analysis's staleness axis (`rollout.max_staleness`): the trend test, the tables by k, and the
report that reads each method across k (benchmarks/stability/async-staleness.md)."""
import math
import statistics
from pathlib import Path

import pytest

from benchmarks.stability.analyze import (base_method, cochran_armitage, staleness_of, staleness_rows,
                                          staleness_section, write_export, write_report)


def _ca_reference(counts, totals, scores):
    """Chi-square for trend = N r^2, r the Pearson correlation of score and outcome over the individual runs."""
    xs, ys = [], []
    for c, n, s in zip(counts, totals, scores):
        xs += [s] * n
        ys += [1] * c + [0] * (n - c)
    r = statistics.correlation(xs, ys)
    return math.copysign(math.sqrt(len(xs) * r * r), r)


@pytest.mark.parametrize("counts", [(0, 2, 6), (3, 3, 4), (9, 4, 1), (1, 0, 0)])
def test_the_trend_test_matches_the_correlation_form(counts):
    z, p = cochran_armitage(counts, (16, 16, 16), (0, 1, 2))
    assert z == pytest.approx(_ca_reference(counts, (16, 16, 16), (0, 1, 2)), rel=1e-9)
    assert p == pytest.approx(0.5 * math.erfc(z / math.sqrt(2)))
    assert (p < 0.5) == (z > 0)


def test_the_trend_test_without_variance_finds_no_rise():
    assert cochran_armitage((0, 0, 0), (16, 16, 16), (0, 1, 2))[1] == 1.0
    assert cochran_armitage((16, 16), (16, 16), (0, 1))[1] == 1.0
    assert cochran_armitage((), (), ())[1] == 1.0
    z, p = cochran_armitage((0, 4, 12), (16, 16, 16), (0, 1, 2))
    assert z > 3 and p < 1e-3  # a clear rise is found


def _run(method, k, lr, seed, collapsed, reward_after=0.3, stale=None, **extra):
    sets = {"rollout.max_staleness": k}
    row = {"method": method, "set": sets, "overrides": {"loss.name": method, **sets, "optim.lr": lr},
           "lr": lr, "seed": seed, "collapsed": collapsed, "collapse_rule": "reward_halved" if collapsed else None,
           "reward_before": 0.25, "reward_after": reward_after, "reward_base_curve": [0.2, 0.3, 0.3, 0.25],
           "reward_base_last5": 0.27, "entropy_curve": [1.0, 1.0, 0.9, 0.9], "iters_to_target": None,
           "token_utilisation": 1.0, "signal_share": 0.8, "effective_utilisation": 0.8, "wall_s": 10.0, **extra}
    if k:
        row.update(staleness_mean=k * 0.9 if stale is None else stale, kl_behaviour_mean=0.01 * k)
    return row


def _grid():
    """grpo collapses more with k at the higher LRs; dpcc never; one grpo k=2 run was never stale."""
    rows = []
    for seed in (1, 2, 3, 4):
        for k in (0, 1, 2):
            for lr in (2e-4, 1e-3, 2e-3):
                grpo_collapse = lr > 2e-4 and seed <= k * 2  # k=0: none; k=1: seeds 1-2; k=2: seeds 1-4
                rows.append(_run("grpo", k, lr, seed, grpo_collapse, reward_after=0.3 - 0.05 * k,
                                 stale=0.0 if (k, lr, seed) == (2, 2e-4, 4) else None))
                rows.append(_run("dpcc", k, lr, seed, False, reward_after=0.3 + 0.01 * seed))
    return rows


def test_runs_are_grouped_by_method_and_k():
    r = _run("dpcc[rollout.max_staleness=2]", 2, 1e-3, 1, False)
    assert staleness_of(r) == 2 and base_method(r) == "dpcc"
    r["set"]["loss.dpcc.alpha"] = 9  # another development override stays part of the method
    assert base_method(r) == "dpcc[loss.dpcc.alpha=9]"
    assert staleness_of({"overrides": {}}) == 0  # a synchronous run from a grid without the axis


def test_staleness_rows_count_collapses_per_k_and_test_the_trend():
    rows = {r["method"]: r for r in staleness_rows(_grid(), [1e-3, 2e-3])}
    grpo, dpcc = rows["grpo"], rows["dpcc"]
    assert [(c["k"], c["collapses"], c["n"], c["safe_collapses"], c["safe_n"]) for c in grpo["cells"]] == [
        (0, 0, 8, 0, 4), (1, 4, 8, 0, 4), (2, 8, 8, 0, 4)]
    assert grpo["z"] > 0 and grpo["p_rise"] < 0.001
    assert (grpo["only_last"], grpo["only_first"], grpo["k_last"], grpo["k_first"]) == (8, 0, 2, 0)
    assert grpo["p_paired"] == pytest.approx(2 / 2 ** 8)
    assert [c["not_stale"] for c in grpo["cells"]] == [0, 0, 1]
    assert dpcc["p_rise"] == 1.0 and math.isnan(dpcc["z"]) and [c["collapses"] for c in dpcc["cells"]] == [0, 0, 0]
    assert statistics.fmean(dpcc["cells"][2]["staleness"]) == pytest.approx(1.8)


def test_the_staleness_section_reports_trend_and_paired_reward_differences():
    text = "\n".join(staleness_section(_grid()))
    assert "| grpo | 0/8, 4/8, 8/8 |" in text and "| dpcc | 0/8, 0/8, 0/8 | – | 1 |" in text
    # grpo's final reward falls by 0.05 per k on every seed: the paired difference is exact, its CI of width 0
    assert "| 0.002 | grpo | 2 | 4 | 0.200 ± 0.000 | -0.100 (-0.100 to -0.100, n=4) |" in text
    assert "| 0.002 | dpcc | 0 | 4 | 0.325 ± 0.013 | – |" in text


def test_a_staleness_grids_report_reads_methods_across_k_from_its_export(tmp_path):
    rows = _grid()
    rows[0]["entropy_curve"] = [1.0, None, 0.9, 0.9]  # an all-padding iteration logs no entropy: the plot skips it
    export = write_export(tmp_path / "s.jsonl.xz", rows)
    text = write_report(export, tmp_path / "r" / "RESULTS.md").read_text()
    assert "## Collapse by staleness k" in text and "## Final greedy reward by staleness k" in text
    assert "## Paired comparison with GRPO" not in text  # no plain `grpo`: every method is read across its k
    assert "| 0.002 | grpo[rollout.max_staleness=2] | 4 | 4/4 = 100%" in text  # the usual table, per variant


def test_the_committed_staleness_reports_tables_come_back_from_its_export(tmp_path):
    from benchmarks.stability.analyze import load_results

    stability = Path(__file__).resolve().parents[2] / "benchmarks" / "stability"
    results, failed = load_results(stability / "async-staleness.jsonl.xz")
    assert len(results) == 216 and failed == []
    report = stability / "async-staleness.md"
    text = report.read_text()
    tables = [line for line in staleness_section(results) if line.startswith("|")]
    assert len(tables) > 40
    missing = [line for line in tables if line not in text]
    assert missing == []
