"""The development selection rule of benchmarks/stability/select_dev.py on made-up results."""
from __future__ import annotations

from benchmarks.stability.select_dev import candidate_rows, select, table


def _run(method, lr, seed, after, collapsed=False, before=0.3):
    return {"method": method, "lr": lr, "seed": seed, "reward_after": after, "reward_before": before,
            "collapsed": collapsed}


def _bed(a_after, b_after, c_after, b_collapses=0):
    runs = []
    for seed in (1, 2, 3, 4):
        runs += [_run("grpo", 2e-4, seed, 0.40), _run("grpo", 2e-3, seed, 0.10, collapsed=True)]
        runs += [_run("a", 2e-4, seed, a_after), _run("a", 2e-3, seed, 0.30)]
        runs += [_run("b", 2e-4, seed, b_after), _run("b", 2e-3, seed, 0.35, collapsed=seed <= b_collapses)]
        runs += [_run("c", 2e-4, seed, c_after), _run("c", 2e-3, seed, 0.36)]
    return runs


def test_rule_needs_few_collapses_and_a_safe_lr_guard_then_takes_the_best_mean():
    beds = {"x": _bed(0.39, 0.39, 0.30), "y": _bed(0.39, 0.39, 0.30)}
    rows = candidate_rows(beds, {"a": "a", "b": "b", "c": "c"}, "grpo", 2e-4)
    got = select(rows, 2e-4, 0.25, -0.03, 0.01)
    eligible = {r["name"]: r["eligible"] for r in rows}
    # c is 0.10 below GRPO at the safe LR: not eligible, however well it does at 2e-3
    assert eligible == {"a": True, "b": True, "c": False}
    # a: mean (-0.01 + 0.20) / 2 = 0.095; b: (-0.01 + 0.25) / 2 = 0.12, more than 0.01 above a
    assert got["chosen"]["name"] == "b" and [r["name"] for r in got["tied"]] == ["b"]
    assert rows[0]["collapses"] == 0 and rows[0]["baseline_collapses"] == 8 and rows[0]["pairs"] == 16


def test_collapses_above_a_quarter_of_the_baseline_make_a_candidate_ineligible():
    beds = {"x": _bed(0.39, 0.39, 0.39, b_collapses=3)}  # b: 3 of GRPO's 4 at 2e-3 > a quarter
    rows = candidate_rows(beds, {"a": "a", "b": "b"}, "grpo", 2e-4)
    got = select(rows, 2e-4, 0.25, -0.03, 0.01)
    assert [r["eligible"] for r in rows] == [True, False] and got["chosen"]["name"] == "a"


def test_ties_go_to_fewer_runs_below_start_then_to_the_first_listed():
    runs = [_run("grpo", 2e-4, 1, 0.40), _run("grpo", 2e-3, 1, 0.10, collapsed=True)]
    runs += [_run("a", 2e-4, 1, 0.40), _run("a", 2e-3, 1, 0.305)]   # mean +0.1025
    runs += [_run("c", 2e-4, 1, 0.39), _run("c", 2e-3, 1, 0.31)]    # mean +0.10: tied with a
    runs += [_run("d", 2e-4, 1, 0.41), _run("d", 2e-3, 1, 0.29)]    # mean +0.10, tied, but ends below start
    beds = {"x": runs}
    rows = candidate_rows(beds, {"a": "a", "c": "c"}, "grpo", 2e-4)
    assert select(rows, 2e-4, 0.25, -0.03, 0.01)["chosen"]["name"] == "a"  # equal below-start: first listed
    rows = candidate_rows(beds, {"c": "c", "a": "a"}, "grpo", 2e-4)
    assert select(rows, 2e-4, 0.25, -0.03, 0.01)["chosen"]["name"] == "c"
    rows = candidate_rows(beds, {"d": "d", "a": "a"}, "grpo", 2e-4)
    got = select(rows, 2e-4, 0.25, -0.03, 0.01)
    assert got["chosen"]["name"] == "a" and {r["name"] for r in got["tied"]} == {"a", "d"}
    lines = table(rows, 2e-4)
    assert lines[0].startswith("| candidate") and len(lines) == 4 and "1/2" in lines[2]


def test_nothing_eligible_leaves_no_choice():
    rows = candidate_rows({"x": _bed(0.2, 0.2, 0.2)}, {"a": "a"}, "grpo", 2e-4)
    assert select(rows, 2e-4, 0.25, -0.03, 0.01) == {"chosen": None, "tied": []}


def test_a_testbed_given_as_a_part_of_a_multi_part_export_is_named_by_its_part(tmp_path, capsys):
    from benchmarks.stability.analyze import write_export
    from benchmarks.stability.select_dev import main

    rows = [{**r, "part": bed, "reward_base_curve": [0.1]} for bed in ("alpha", "beta")
            for r in _bed(0.40, 0.45, 0.41)]
    path = write_export(tmp_path / "dev.jsonl.xz", rows)
    assert main(["--out", f"{path}#alpha", "--out", f"{path}#beta", "--candidate", "a=a", "--candidate", "b=b"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "Δ alpha 0.0002" in head and "Δ beta 0.0002" in head and "jsonl" not in head
