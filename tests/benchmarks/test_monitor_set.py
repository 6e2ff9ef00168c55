"""The monitor's labelled set (benchmarks/monitor): the labelling rule, the split, and
`monitor evaluate --labelled` on the committed streams."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.monitor.labels import label_stream
from benchmarks.monitor.make_set import FAMILIES, HELDOUT_SEEDS, TESTBED, split_of, stability_runs, trim, write_set
from dpcc_megatron.monitor.evaluate import read_labels

ROOT = Path(__file__).resolve().parents[2]
LABELLED = ROOT / "benchmarks" / "monitor" / "labelled"
#: Committed parts made from stability-runner folders (each read once as held out, or development only).
GRID_SETS = ("labelled-grids", "labelled-onestep", "labelled-deep")
KEYS = ("recall", "precision", "median_lead_iterations", "healthy_critical", "warnings_per_100_healthy")


def _stream(rewards, entropies):
    return [{"iteration": i, "reward_base_mean": r, "reward_mean": r, "entropy": e}
            for i, (r, e) in enumerate(zip(rewards, entropies))]


def test_split_is_fixed_by_seed_and_trim_keeps_the_detector_fields():
    # held-out parts already read (41-42 ... 49-50) are development seeds now
    assert ([split_of(s) for s in (1, 2, 7, 24, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52)]
            == ["dev"] * 14 + ["heldout"] * 2)
    # every family in both parts
    assert all(set(f.seeds) - set(HELDOUT_SEEDS) and set(f.seeds) >= set(HELDOUT_SEEDS) for f in FAMILIES)
    rec = {"iteration": 3, "entropy": 0.123456789, "kl_step_max": 0.5, "tokens_per_s": 1.0, "pg_loss": None,
           "kl_estimator": "k3", "optimizer_steps": 1}
    assert trim([rec]) == [{"iteration": 3, "entropy": 0.12346, "kl_step_max": 0.5, "kl_estimator": "k3",
                            "optimizer_steps": 1}]


def _relabel_matches(x):
    records = [json.loads(line) for line in x["path"].read_text().splitlines() if line.strip()]
    # the rule, re-applied to the committed stream and its greedy rewards
    again = label_stream(records, x["stop_reason"], greedy=(x["greedy_before"], x["greedy_after"]))
    assert (again["label"], again["onset"], again["direction"]) == (x["label"], x["onset"], x["direction"]), x["stream"]
    return records


def test_committed_set_matches_its_split_rule_and_labels():
    labels = read_labels(LABELLED)
    assert len(labels) >= 30
    for x in labels:  # seeds 45-46, the fourth round's held-out part, joined dev once read
        assert x["split"] == split_of(x["seed"]) == "dev", x["stream"]
        _relabel_matches(x)
    assert any(x["label"] == "collapse" for x in labels) and any(x["label"] == "healthy" for x in labels)
    assert any(x["direction"] == "high" for x in labels)


@pytest.mark.parametrize("name", GRID_SETS)
def test_committed_grid_sets_match_their_labels_and_steps(name):
    labels = read_labels(LABELLED.parent / name)
    assert len(labels) >= 100 and {x["label"] for x in labels} == {"collapse", "healthy", "degraded"}
    for x in labels:
        records = _relabel_matches(x)
        steps = int(x["family"].split("-")[2].removesuffix("step"))  # grid-<task><digits>-<N>step[-<L>layer]
        assert all(r["optimizer_steps"] == steps for r in records), x["stream"]


#: The fresh held-out parts of the fifth, sixth and seventh calibrations: folder, the families' seeds, the grids' seeds
#: (none of which an earlier part used).
HELDOUT_PARTS = [("labelled-fifth", (47, 48), set(range(701, 713)) | set(range(801, 807))),
                 ("labelled-sixth", (49, 50), set(range(713, 725)) | set(range(807, 813))),
                 ("labelled-seventh", HELDOUT_SEEDS, set(range(725, 737)) | set(range(813, 819)))]


@pytest.mark.parametrize("folder, family_seeds, grid_seeds", HELDOUT_PARTS, ids=[p[0] for p in HELDOUT_PARTS])
def test_committed_heldout_parts_match_their_labels_and_seeds(folder, family_seeds, grid_seeds):
    labels = read_labels(LABELLED.parent / folder)
    assert {x["split"] for x in labels} == {"heldout"} and len(labels) == 184
    fams = {x["family"] for x in labels}
    assert {f.name for f in FAMILIES} < fams and {"grid-addition1-1step", "grid-sorting3-2step-4layer"} < fams
    for x in labels:
        records = _relabel_matches(x)
        assert x["seed"] in (family_seeds if x["family"] in {f.name for f in FAMILIES} else grid_seeds), x["stream"]
        if folder == "labelled-seventh":  # trained with an evaluation every iteration and the diversity field
            assert all("eval_reward_greedy" in r and "answer_distinct_frac" in r for r in records), x["stream"]


#: The eighth calibration's part (runs with a reference model): its seeds per family, dev and held out.
EIGHTH_SEEDS = {"grid-addition1-1step-ref": (set(range(737, 745)), set(range(745, 757))),
                "grid-addition1-2step-ref": (set(range(917, 921)), set(range(921, 929))),
                "grid-sorting3-2step-4layer-ref": (set(range(819, 823)), set(range(823, 829)))}


def test_committed_eighth_part_has_a_reference_model_and_its_seeds():
    labels = read_labels(LABELLED.parent / "labelled-eighth")
    assert len(labels) == 378 and {x["family"] for x in labels} == set(EIGHTH_SEEDS)
    for x in labels:
        dev, heldout = EIGHTH_SEEDS[x["family"]]
        assert x["seed"] in (dev if x["split"] == "dev" else heldout), x["stream"]
        records = _relabel_matches(x)
        steps = int(x["family"].split("-")[2].removesuffix("step"))
        assert all(r["optimizer_steps"] == steps and "eval_reward_greedy" in r for r in records), x["stream"]
        # trained with a reference model: every record carries the KL to it (k3: >= 0); a one-step iteration 0
        # reads it in its only step's forward, before any update, so it is 0 there
        assert all(math.isfinite(r["kl_ref"]) and r["kl_ref"] >= 0 for r in records), x["stream"]
        assert steps != 1 or records[0]["kl_ref"] == 0.0, x["stream"]
    assert sum(x["split"] == "heldout" for x in labels) == 234


def _fake_run(folder: Path, name: str, rewards, entropies, greedy=(0.3, 0.3)):
    run = folder / "runs" / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _stream(rewards, entropies)))
    (run / "train_summary.json").write_text(json.dumps({"stop_reason": "completed", "reward_before": greedy[0],
                                                         "reward_after": greedy[1]}))


def test_stability_runs_join_the_set_with_their_testbed_checked(tmp_path):
    stab = tmp_path / "small"
    _fake_run(stab, "grpo__lr0.002__s9", [0.4] * 10 + [0.02] * 10, [0.8] * 20)
    _fake_run(stab, "dpcc__lr0.0002__s51", [0.3] * 20, [0.8] * 20)
    _fake_run(stab, "dpcc__lr0.002__s51", [0.3] * 20, [0.8] * 20, greedy=(0.3, 0.2))
    (stab / "runs" / "not-a-run").mkdir()
    (stab / "manifest.json").write_text(json.dumps({"testbed": TESTBED.extra}))
    assert [r[:3] for r in stability_runs(stab)] == [("dpcc", 0.0002, 51), ("dpcc", 0.002, 51), ("grpo", 0.002, 9)]
    labels = write_set(tmp_path / "set", tmp_path / "out", families=(), stability=[stab])
    got = {(x["family"], x["method"], x["seed"], x["split"], x["label"]) for x in labels}
    assert got == {("stab-grid", "grpo", 9, "dev", "collapse"), ("stab-grid", "dpcc", 51, "heldout", "healthy"),
                   ("stab-grid", "dpcc", 51, "heldout", "degraded")}
    assert len(read_labels(tmp_path / "out")) == 3  # a valid labelled set
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["set.tar.xz"]  # labels and streams in one file
    (tmp_path / "loose" / "streams").mkdir(parents=True)  # loose streams there would hide the packed ones
    with pytest.raises(SystemExit, match="loose files"):
        write_set(tmp_path / "set", tmp_path / "loose", families=(), stability=[stab])
    # another testbed (the 4-layer grid) is refused, not mixed in
    (stab / "manifest.json").write_text(json.dumps({"testbed": {**TESTBED.extra, "model.num_layers": 4}}))
    with pytest.raises(SystemExit, match="testbed"):
        stability_runs(stab)


def test_eval_fields_join_the_record_of_their_iteration(tmp_path):
    from benchmarks.monitor.make_set import read_evals, with_evals

    assert read_evals(tmp_path) == {}  # a run without evaluations
    (tmp_path / "eval.jsonl").write_text(
        json.dumps({"iteration": 0, "kind": "eval", "reward_greedy": 0.25, "reward_sampled": 0.123456789}) + "\n"
        + json.dumps({"iteration": 2, "kind": "eval", "reward_greedy": 0.5, "pass_at_1": None}) + "\n")
    evals = read_evals(tmp_path)
    assert evals == {0: {"eval_reward_greedy": 0.25, "eval_reward_sampled": 0.12346}, 2: {"eval_reward_greedy": 0.5}}
    got = with_evals([{"iteration": i, "entropy": 1.0} for i in range(3)], evals)
    assert got == [{"iteration": 0, "entropy": 1.0, "eval_reward_greedy": 0.25, "eval_reward_sampled": 0.12346},
                   {"iteration": 1, "entropy": 1.0}, {"iteration": 2, "entropy": 1.0, "eval_reward_greedy": 0.5}]


def test_heldout_grids_of_other_testbeds_join_as_held_out_with_their_family(tmp_path):
    from benchmarks.stability.grid import testbed

    sort1 = tmp_path / "sorting"
    _fake_run(sort1, "grpo__lr0.002__s301", [0.4] * 10 + [0.02] * 10, [0.8] * 20)
    _fake_run(sort1, "dpcc-kt-strict__lr0.0002__s301", [0.3] * 20, [0.8] * 20)
    model = {k: v for k, v in TESTBED.extra.items() if k.startswith("model.")}
    (sort1 / "manifest.json").write_text(json.dumps({"testbed": {**model, **testbed("sorting", 3, 1)}}))
    with pytest.raises(SystemExit, match="testbed"):  # not this set's testbed: refused as a stab-grid folder
        stability_runs(sort1)
    labels = write_set(tmp_path / "set", tmp_path / "out", families=(), heldout_grids=[sort1])
    got = {(x["family"], x["method"], x["seed"], x["split"], x["label"]) for x in labels}
    assert got == {("grid-sorting3-1step", "grpo", 301, "heldout", "collapse"),
                   ("grid-sorting3-1step", "dpcc-kt-strict", 301, "heldout", "healthy")}
    assert {x["stream"] for x in read_labels(tmp_path / "out")} == {
        "streams/grid-sorting3-1step__grpo__lr0.002__s301.jsonl",
        "streams/grid-sorting3-1step__dpcc-kt-strict__lr0.0002__s301.jsonl"}
    # the records of runs made before the trainer wrote optimizer_steps get the testbed's
    for x in read_labels(tmp_path / "out"):
        assert {json.loads(line)["optimizer_steps"] for line in x["path"].read_text().splitlines()} == {1}
    # another model joins under a family that names its layers; dev grids take the dev split
    (sort1 / "manifest.json").write_text(json.dumps({"testbed": testbed("sorting", 3, 2),
                                                      "warm_start": {"model": {"num_layers": 4}},
                                                      "commands": ["python -m benchmarks.stability.run --grid deep"]}))
    labels = write_set(tmp_path / "set", tmp_path / "out2", families=(), dev_grids=[sort1])
    assert {(x["family"], x["split"], x["source"]) for x in labels} == {
        ("grid-sorting3-2step-4layer", "dev", "benchmarks/stability/run.py --grid deep (grid-sorting3-2step-4layer)")}
    # runs trained with a reference model (--set loss.ref_kl_coef=...) are their own family
    manifest = json.loads((sort1 / "manifest.json").read_text())
    for sets, family in (([{"loss.ref_kl_coef": 0.01, "eval.interval": 1}], "grid-sorting3-2step-4layer-ref"),
                         ([{"loss.ref_kl_coef": 0.0}], "grid-sorting3-2step-4layer"), ([{}], "grid-sorting3-2step-4layer"),
                         ([{"loss.ref_kl_coef": None}], "grid-sorting3-2step-4layer")):
        (sort1 / "manifest.json").write_text(json.dumps({**manifest, "sets": sets}))
        labels = write_set(tmp_path / "set", tmp_path / "out3", families=(), dev_grids=[sort1])
        assert {x["family"] for x in labels} == {family}, sets


def _evaluate(folder, split):
    proc = subprocess.run([sys.executable, "-m", "dpcc_megatron.cli", "monitor", "evaluate", "--labelled",
                           str(folder), "--split", split], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(proc.stdout.strip().splitlines()[-1])


def test_evaluate_command_on_a_committed_subset(tmp_path):
    grids = LABELLED.parent / "labelled-grids"  # a part read once as held out
    labels = read_labels(grids)  # the committed set is one set.tar.xz: its streams are written out loose here
    pick = ([x for x in labels if x["split"] == "heldout" and x["label"] == "collapse"][:2]
            + [x for x in labels if x["split"] == "heldout" and x["label"] == "healthy"][:2])
    (tmp_path / "streams").mkdir()
    for x in pick:
        (tmp_path / x["stream"]).write_text(x["path"].read_text())
    (tmp_path / "labels.jsonl").write_text("".join(json.dumps({k: v for k, v in x.items() if k != "path"}) + "\n"
                                                   for x in pick))
    table, scores = _evaluate(tmp_path, "heldout")
    for key in KEYS:
        assert key in scores, key
    assert scores["streams"] == 4 and scores["collapsed"] == 2 and scores["healthy"] == 2
    assert 0.0 <= scores["recall"] <= 1.0 and isinstance(scores["healthy_critical"], int)
    assert isinstance(scores["warnings_per_100_healthy"], float)
    assert all(x["stream"][-40:] in table for x in pick)  # one row per stream
    with pytest.raises(AssertionError):
        _evaluate(tmp_path, "dev")  # no dev streams in this subset: an error, not empty scores


#: The detector values of the fourth and the fifth calibration (the defaults their readings were made with).
FOURTH = {"kl_critical_threshold": 1.0, "kl_sustained_window": 3, "kl_one_step_factor": 1.0, "reward_drop_fraction": None}
FIFTH = {"kl_critical_threshold": 0.5, "kl_sustained_window": 2, "kl_one_step_factor": 3.0, "reward_drop_fraction": None}
SIXTH = {**FIFTH, "reward_drop_fraction": 0.5, "reward_drop_patience": 1, "reward_drop_window": 3,
         "reward_drop_confirm": None}
SEVENTH = {**SIXTH, "reward_drop_confirm": "eval", "reward_drop_eval_field": "eval_reward_greedy",
           "reward_drop_eval_fraction": 0.3, "reward_drop_eval_max_age": 10}
EIGHTH = {**SEVENTH, "kl_ref_threshold": 1.0, "kl_ref_critical_threshold": None}


def _reported_readings() -> list[dict]:
    """The JSON score lines quoted in benchmarks/monitor/RESULTS.md."""
    text = (LABELLED.parent / "RESULTS.md").read_text()
    return [json.loads(line.strip()) for line in text.splitlines() if line.strip().startswith('{"streams": ')]


def test_committed_readings_reproduce(tmp_path):
    """Every held-out reading RESULTS.md quotes comes back from the committed streams and the detector
    values it was made with: the report cannot drift from the data or the code."""
    import dataclasses

    from dpcc_megatron.config.monitor import MonitorConfig
    from dpcc_megatron.monitor.evaluate import evaluate

    reported = _reported_readings()
    # (folder, detector values, split, seeds): seeds 45-46 were read as held out, then filed under dev
    eighth = LABELLED.parent / "labelled-eighth"
    readings = [(eighth, EIGHTH, "heldout", None),
                (eighth, {**EIGHTH, "kl_ref_threshold": None}, "heldout", None),
                (LABELLED.parent / "labelled-seventh", SEVENTH, "heldout", None),
                (LABELLED.parent / "labelled-seventh", SIXTH, "heldout", None),
                (LABELLED.parent / "labelled-sixth", SIXTH, "heldout", None),
                (LABELLED.parent / "labelled-sixth", FIFTH, "heldout", None),
                (LABELLED.parent / "labelled-fifth", FIFTH, "heldout", None),
                (LABELLED.parent / "labelled-grids", FOURTH, "heldout", None),
                (LABELLED.parent / "labelled-onestep", FOURTH, "heldout", None),
                (LABELLED, FOURTH, None, {45, 46})]
    from benchmarks.monitor.thin_evals import thin_folder

    thin_folder(LABELLED.parent / "labelled-seventh", tmp_path / "every5", 5)  # the every-5 information reading
    readings.append((tmp_path / "every5", SEVENTH, "heldout", None))
    for every in (5, 1000):  # the eighth's: evaluations every 5 iterations, and only the start's
        thin_folder(eighth, tmp_path / f"eighth{every}", every)
        readings.append((tmp_path / f"eighth{every}", EIGHTH, "heldout", None))
    for folder, values, split, seeds in readings:
        cfg = dataclasses.replace(MonitorConfig(), **values)
        _, scores = evaluate(folder, cfg, split, seeds)
        assert scores in reported, (folder.name, scores)
    # the shipped defaults are the eighth calibration's choice (the seventh's with the kl_ref thresholds)
    assert all(getattr(MonitorConfig(), k) == v for k, v in EIGHTH.items())
    # and the readings differ: a score line that matched anything would not be a check
    assert len({json.dumps(r, sort_keys=True) for r in reported}) == len(reported) >= 13


def test_quietest_warning_is_the_smallest_value_within_the_budget_on_streams_with_the_field():
    from benchmarks.monitor.calibrate import quietest_warning

    def stream(refs, with_ref=True):
        return [{"iteration": i, "entropy": 1.0, "kl_old_new": 0.01, "kl_step_max": 0.01, "reward_mean": 0.3,
                 "reward_std": 0.2, "zero_var_frac": 0.0, "optimizer_steps": 2,
                 **({"kl_ref": v} if with_ref else {})} for i, v in enumerate(refs)]

    # one healthy stream whose kl_ref sits at 0.4 for 10 iterations, one at 0.1; and one without the field
    streams = [("a", "healthy", stream([0.4] * 10)), ("b", "healthy", stream([0.1] * 10)),
               ("c", "healthy", stream([9.0] * 10, with_ref=False))]
    # 0.25 warns at iteration 2 of stream a and again after the cooldown (10): 1 warning per 20 iterations
    chosen, scores = quietest_warning(streams, {}, values=(0.25, 0.5), budget=1.0)
    assert chosen == 0.5 and scores[0.25]["warnings_per_100_healthy"] == 5.0
    assert scores[0.5]["warnings_per_100_healthy"] == 0.0 and scores[0.5]["streams"] == 2  # c carries no kl_ref
    assert quietest_warning(streams, {}, values=(0.25,), budget=1.0)[0] is None  # none within the budget
    assert quietest_warning(streams, {}, values=(0.25, 0.5), budget=5.0)[0] == 0.25


def test_first_alarms_counts_each_alarmed_stream_once_by_its_first_confirmed_critical():
    from benchmarks.monitor.first_alarms import first_alarms

    def stream(kl0):
        return [{"iteration": i, "entropy": 1.0, "kl_old_new": kl0 if i == 0 else 0.01,
                 "kl_step_max": kl0 if i == 0 else 0.01, "reward_mean": 0.3, "reward_std": 0.2,
                 "zero_var_frac": 0.0, "optimizer_steps": 2} for i in range(8)]

    streams = [("a", "healthy", stream(0.01)), ("b", "healthy", stream(3.0)), ("c", "collapse", stream(3.0))]
    from dpcc_megatron.config.monitor import MonitorConfig

    counts = first_alarms(streams, MonitorConfig())
    assert counts["streams"] == {"healthy": 2, "collapse": 1}
    assert counts["healthy"] == {("kl_drift", "iteration <= 1", 2): 1}
    assert counts["collapse"] == {("kl_drift", "iteration <= 1", 2): 1}


def test_thin_evals_keeps_evaluations_every_n_iterations(tmp_path):
    from benchmarks.monitor.calibrate import load_streams
    from benchmarks.monitor.thin_evals import thin_folder

    src = tmp_path / "src"
    (src / "streams").mkdir(parents=True)
    recs = [{"iteration": i, "reward_mean": 0.3, "eval_reward_greedy": 0.2 + i / 100} for i in range(7)]
    (src / "streams" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (src / "labels.jsonl").write_text(json.dumps({"stream": "streams/a.jsonl", "label": "healthy", "split": "dev"}) + "\n")
    assert thin_folder(src, tmp_path / "dest", 5) == 1
    (dest,) = read_labels(tmp_path / "dest")  # written packed: one set.tar.xz, labels kept
    assert [p.name for p in (tmp_path / "dest").iterdir()] == ["set.tar.xz"]
    assert {k: dest[k] for k in ("stream", "label", "split")} == {"stream": "streams/a.jsonl", "label": "healthy",
                                                                  "split": "dev"}
    got = [json.loads(x) for x in dest["path"].read_text().splitlines()]
    assert [i for i, r in enumerate(got) if "eval_reward_greedy" in r] == [0, 5]
    assert all(r["reward_mean"] == 0.3 for r in got)
    # calibrate's --eval-every reads the same thinning, and 1 keeps everything
    ((_, _, thinned),) = load_streams(read=[str(src)], eval_every=5)
    assert [i for i, r in enumerate(thinned) if "eval_reward_greedy" in r] == [0, 5]
    ((_, _, whole),) = load_streams(read=[str(src)])
    assert [r["eval_reward_greedy"] for r in whole] == [r["eval_reward_greedy"] for r in recs]
    with pytest.raises(ValueError, match="--every"):
        thin_folder(src, tmp_path / "d2", 0)


def test_early_eval_falls_counts_early_alarms_whose_evaluation_fell():
    from benchmarks.monitor.first_alarms import early_eval_falls
    from dpcc_megatron.config.monitor import MonitorConfig

    def stream(kl0, evals):
        return [{"iteration": i, "entropy": 0.8, "kl_step_max": kl0 if i == 0 else 0.01, "reward_base_mean": 0.3,
                 "optimizer_steps": 2, "eval_reward_greedy": e} for i, e in enumerate(evals)]

    streams = [("a", "healthy", stream(2.0, [0.4, 0.2, 0.3, 0.4, 0.4])),  # runaway, evaluation halved
               ("b", "healthy", stream(2.0, [0.4, 0.38, 0.4, 0.4, 0.4])),  # runaway, evaluation held
               ("c", "collapse", stream(0.01, [0.4, 0.1, 0.1, 0.1, 0.1])),  # no early alarm: not counted
               ("d", "collapse", stream(2.0, [0.4, 0.4, None, 0.1, 0.1]))]  # not evaluated every iteration
    assert early_eval_falls(streams, MonitorConfig(), 0.2) == {"healthy": (2, 1)}
