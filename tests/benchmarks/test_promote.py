"""The held-out decision that lets a candidate replace the default (benchmarks/stability/promote.py)."""
import pytest

from benchmarks.stability.promote import decide, table, summarise_testbed


def _r(method, lr, seed, collapsed=False, before=0.4, after=0.5):
    return {"method": method, "lr": lr, "seed": seed, "collapsed": collapsed, "reward_before": before,
            "reward_after": after}


def _bed(cand_safe=0.5, cand_collapses=0, inc_collapses=2, cand_below=0):
    runs = []
    for s in range(1, 5):
        runs += [_r("grpo", 2e-4, s), _r("dpcc", 2e-4, s), _r("new", 2e-4, s, after=cand_safe),
                 _r("grpo", 2e-3, s, collapsed=True, after=0.1), _r("dpcc", 2e-3, s, collapsed=s <= inc_collapses),
                 _r("new", 2e-3, s, collapsed=s <= cand_collapses, after=0.3 if s <= cand_below else 0.5)]
    runs.append(_r("new", 2e-3, 9))  # a seed the others lack is left out
    return runs


def test_a_candidate_better_everywhere_replaces_the_default():
    rows = {"one": summarise_testbed(_bed(), "new", "dpcc"), "two": summarise_testbed(_bed(), "new", "dpcc")}
    assert rows["one"]["seeds"] == 4 and rows["one"]["candidate_runs"] == 8
    assert (rows["one"]["candidate_collapses"], rows["one"]["incumbent_collapses"], rows["one"]["baseline_collapses"]) \
        == (0, 2, 4)
    lines, ok = decide(rows, {}, {"one"})
    assert ok and len(lines) == 7 and all(line.endswith("| yes |") for line in lines)
    assert "| one | 4 | 0 / 2 / 4 | 0 vs 4 (0.12) | not met |" in "\n".join(table(rows))  # 4 pairs cannot give p < 0.05


@pytest.mark.parametrize("bed, fails", [
    (dict(cand_safe=0.47), ["safe-LR Δ vs GRPO ≥ -0.02"]),  # -0.03 at the safe LR
    (dict(cand_collapses=3), ["fewer than the incumbent's", "no more than the incumbent's"]),
    (dict(cand_collapses=2), ["fewer than the incumbent's"]),
    (dict(cand_below=3, inc_collapses=2), ["runs ending below start"]),
])
def test_each_condition_can_keep_the_default(bed, fails):
    lines, ok = decide({"one": summarise_testbed(_bed(**bed), "new", "dpcc")}, {}, {"one"})
    failed = [line for line in lines if line.endswith("| **no** |")]
    assert not ok and len(failed) == len(fails) and all(f in line for f, line in zip(fails, failed))


def test_a_testbed_margin_and_missing_runs():
    rows = {"deep": summarise_testbed(_bed(cand_safe=0.475), "new", "dpcc")}
    assert not decide(rows, {}, set())[1]
    assert decide(rows, {"deep": -0.03}, set())[1]
    with pytest.raises(ValueError, match="no \\(lr, seed\\) finished"):
        summarise_testbed([_r("new", 2e-4, 1), _r("grpo", 2e-4, 1)], "new", "dpcc")


def test_the_committed_decision_reads_again_from_the_multi_part_export(capsys):
    """The decision that made the current default (benchmarks/stability/latched-recovery.md), re-read from
    the testbeds' parts of its one export (FILE#PART)."""
    from pathlib import Path

    from benchmarks.stability.promote import main

    export = Path(__file__).resolve().parents[2] / "benchmarks" / "stability" / "latched-recovery.jsonl.xz"
    assert main(["--candidate", "dpcc[loss.dpcc.lr_scale_init=0.25,loss.dpcc.lr_scale_max_raise=1.25]",
                 *[a for bed, part in (("onestep", "onestep"), ("addition", "addition"), ("sorting", "sorting3"),
                                       ("deep", "deep")) for a in ("--testbed", f"{bed}={export}#{part}")],
                 "--margin", "deep=-0.03", "--fewer-collapses-on", "onestep"]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("decision: the candidate replaces the default")
    assert all(f"| {bed} |" in out for bed in ("onestep", "addition", "sorting", "deep"))
