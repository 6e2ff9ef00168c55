"""The labelling rule (dpcc_megatron/monitor/labels.py): a written rule on the reward and entropy curves that
labels the monitor's labelled sets and judges the stability benchmark's and the demo's runs."""
from dpcc_megatron.monitor.labels import label_stream


def _stream(rewards, entropies):
    return [{"iteration": i, "reward_base_mean": r, "reward_mean": r, "entropy": e}
            for i, (r, e) in enumerate(zip(rewards, entropies))]


def test_labelling_rule_on_curves():
    # learning: reward rises, entropy falls far below the band -> healthy (a mastered task)
    learn = label_stream(_stream([0.3 + 0.02 * i for i in range(30)], [0.8 - 0.025 * i for i in range(30)]))
    assert learn["label"] == "healthy" and learn["onset"] is None and learn["entropy_exit"] is not None
    # reward falls to a tenth from iteration 10 and stays: collapse; trailing mean halves at 11, and the
    # entropy left the band at 10 with the reward below the start (the entropy clause): onset 10
    down = label_stream(_stream([0.4] * 10 + [0.04] * 10, [0.8] * 10 + [0.1] * 10))
    assert (down["label"], down["onset"], down["direction"], down["instant"]) == ("collapse", 10, "low", False)
    assert down["halves"] == 11
    assert down["entropy_exit"] == 10 and down["entropy_band"] == [0.32, 1.6]
    # the entropy climbs instead: same onset, high direction
    up = label_stream(_stream([0.4] * 10 + [0.04] * 10, [0.8] * 10 + [3.0] * 10))
    assert up["label"] == "collapse" and up["direction"] == "high"
    # the first update destroys the policy: an instant collapse
    assert label_stream(_stream([0.4] + [0.02] * 9, [0.8] * 10))["instant"] is True
    # a dip the run recovers from, or a fall in its last iterations, is no collapse
    assert label_stream(_stream([0.4] * 5 + [0.05] * 4 + [0.4] * 6, [0.8] * 15))["label"] == "healthy"
    assert label_stream(_stream([0.4] * 10 + [0.05] * 3, [0.8] * 13))["label"] == "healthy"


def test_degraded_clause_reads_the_greedy_reward_before_and_after():
    flat = _stream([0.3] * 20, [0.8] * 20)
    # no collapse by the curves; the held-out greedy reward fell: degraded (neither a collapse nor healthy)
    assert label_stream(flat, greedy=(0.35, 0.30))["label"] == "degraded"
    assert label_stream(flat, greedy=(0.30, 0.30))["label"] == "healthy"  # ended where it started
    assert label_stream(flat, greedy=(0.30, 0.45))["label"] == "healthy"
    # without the greedy reward (or with a non-finite one) there is no degraded verdict
    assert label_stream(flat)["label"] == "healthy"
    assert label_stream(flat, greedy=(0.35, float("nan")))["label"] == "healthy"
    # a collapse stays a collapse whatever the greedy reward did
    down = _stream([0.4] * 10 + [0.04] * 10, [0.8] * 10 + [0.1] * 10)
    assert label_stream(down, greedy=(0.3, 0.5))["label"] == "collapse"


def test_entropy_clause_of_the_labelling_rule():
    # entropy leaves the band (0.4 x 0.8 = 0.32) for 5 iterations from 6 with the reward no better than
    # at the start, and the reward never halves: a collapse read on the entropy curve, onset 6
    flat = label_stream(_stream([0.3] * 20, [0.8] * 6 + [0.2] * 14))
    assert (flat["label"], flat["onset"], flat["halves"], flat["entropy_collapse"], flat["direction"]) == (
        "collapse", 6, None, 6, "low")
    # four iterations out of the band are not enough; nor is a stretch in which the reward rose (mastering)
    assert label_stream(_stream([0.3] * 20, [0.8] * 6 + [0.2] * 4 + [0.8] * 10))["label"] == "healthy"
    assert label_stream(_stream([0.3] * 6 + [0.6] * 14, [0.8] * 6 + [0.2] * 14))["label"] == "healthy"
    # above the band (random output) counts alike
    assert label_stream(_stream([0.3] * 20, [0.8] * 6 + [2.0] * 14))["direction"] == "high"
    # the earlier of the two clauses is the onset
    both = label_stream(_stream([0.3] * 10 + [0.02] * 10, [0.8] * 4 + [0.2] * 16))
    assert (both["onset"], both["halves"], both["entropy_collapse"]) == (4, 11, 4)
    # a trainer stopped on non-finite steps
    nf = label_stream(_stream([0.4] * 6, [0.8] * 5 + [float("nan")]), stop_reason="stopped: 5 consecutive non-finite")
    assert nf["label"] == "collapse" and nf["onset"] == 5
