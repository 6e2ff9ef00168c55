"""The eval loop's pieces: the unbiased pass@k estimator, held-out prompt selection, the report panel."""
import itertools
import json
import math

import pytest

from dpcc_megatron.config import load_config
from dpcc_megatron.train.evaluate import ks_for, load_eval_prompts, pass_at_k


def test_pass_at_k_equals_the_mean_over_all_k_subsets():
    for n in range(1, 7):
        for c in range(n + 1):
            outcomes = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                exact = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
    assert pass_at_k(200, 3, 1) == pytest.approx(3 / 200)
    assert pass_at_k(10, 1, 5) == pytest.approx(1 - math.comb(9, 5) / math.comb(10, 5))
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    assert ks_for(1) == [1] and ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6]


def test_held_out_prompts(tmp_path):
    synth = load_eval_prompts(load_config())
    train = load_eval_prompts(load_config(overrides=["eval.max_prompts=0"]))
    assert len(synth) == 64 and len(train) == 64 and synth[0].text == train[0].text
    from dpcc_megatron.data.prompts import synthetic_prompts

    training = {p.text for p in synthetic_prompts("addition", 2, 64, seed=1234)}
    assert any(p.text not in training for p in synth)  # its own seed, not the first training prompts
    held = tmp_path / "test.jsonl"
    held.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"x #### {i}"}) + "\n" for i in range(5)))
    got = load_eval_prompts(load_config(overrides=[f"eval.data={held}", "eval.max_prompts=3"]))
    assert [p.fields["answer"] for p in got] == ["0", "1", "2"]
    # a training file without eval.data: no evaluation (never the training prompts)
    assert load_eval_prompts(load_config(overrides=[f"data.prompts={held}"])) == []


def test_eval_config_is_validated():
    from dpcc_megatron.config import ConfigError

    with pytest.raises(ConfigError, match=r"eval.greedy is false and eval.samples is 0"):
        load_config(overrides=["eval.greedy=false"])
    with pytest.raises(ConfigError, match=r"eval.samples must be >= 0"):
        load_config(overrides=["eval.samples=-1"])
    with pytest.raises(ConfigError, match=r"eval.data must be a .jsonl or .parquet file"):
        load_config(overrides=["eval.data=held.csv"])


def test_report_plots_eval_reward_over_iterations(tmp_path):
    from dpcc_megatron.monitor import report

    train = [{"iteration": i, "reward_mean": 0.1 * i, "entropy": 1.0} for i in range(6)]
    evals = [{"iteration": i, "kind": "eval", "reward_greedy": 0.2 + 0.1 * i, "pass_at_1": 0.1 * i}
             for i in (0, 3, 6)]
    assert [len(s) for s in report._segments(train + evals, "eval")] == [3]
    assert [len(s) for s in report._segments(train + evals)] == [6]  # eval records stay out of train panels
    assert any(key == "eval" for _, _, key in report.PANELS)
    with_eval = report.render_figure_png(train + evals)
    assert with_eval != report.render_figure_png(train)


def test_the_next_record_takes_each_evaluation_once():
    from types import SimpleNamespace

    from dpcc_megatron.config import load_config
    from dpcc_megatron.train.evaluate import Evaluator

    ctx = SimpleNamespace(cfg=load_config(), eval_prompts=["p"], rank=1, loggers=None, exchange=None)
    ev = Evaluator(ctx)
    assert ev.record_fields(0) == {}  # nothing evaluated yet
    ev._publish(3, {"reward_greedy": 0.5, "pass_at_1": 0.25, "response_len_greedy": 2.0, "prompts": 4}, 0.1)
    assert ev.record_fields(2) == {}  # another iteration's weights: not this record's (and consumed)
    assert ev.record_fields(3) == {}
    ev._publish(3, {"reward_greedy": 0.5, "pass_at_1": 0.25, "response_len_greedy": 2.0, "prompts": 4}, 0.1)
    assert ev.record_fields(3) == {"eval_reward_greedy": 0.5, "eval_pass_at_1": 0.25}
    assert ev.record_fields(3) == {}  # once
