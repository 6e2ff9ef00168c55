import torch
from hypothesis import given, settings, strategies as st

from dpcc_megatron.rewards import DeterministicJudge, Sample
from dpcc_megatron.rewards.contrastive import OlderPolicyBuffer, advanced_scores, group_index, win_rates


class TableJudge:
    """Utility looked up from the response text (lets tests choose exact utilities)."""

    def __init__(self, table):
        self.table = table

    def utilities(self, samples, base):
        return torch.tensor([self.table[s.response] for s in samples], dtype=torch.float64)


def _group(responses, prompt="q", gid=None):
    return [Sample(prompt=prompt, response=r, group_id=gid) for r in responses]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=1, max_size=9), st.randoms(use_true_random=False))
def test_win_rates_in_unit_interval_and_permutation_invariant(us, rnd):
    u = torch.tensor(us, dtype=torch.float64)
    w = win_rates(u)
    assert ((w >= 0) & (w <= 1)).all()
    perm = list(range(len(us)))
    rnd.shuffle(perm)
    assert torch.allclose(win_rates(u[perm]), w[perm], atol=1e-12)
    # the win rates of a group average to 1/2: every comparison is shared by two members
    if len(us) > 1:
        assert abs(float(w.mean()) - 0.5) < 1e-9


def test_ties_get_equal_scores_and_order_is_respected():
    w = win_rates(torch.tensor([1.0, 1.0, 3.0, -2.0], dtype=torch.float64))
    assert w[0] == w[1]
    assert w[2] > w[0] > w[3]
    assert torch.equal(win_rates(torch.tensor([2.0, 2.0, 2.0])), torch.full((3,), 0.5))
    assert win_rates(torch.tensor([7.0])).item() == 0.5  # nobody to compare against


def test_advanced_scores_are_per_group_and_order_invariant():
    judge = TableJudge({"a": 2.0, "b": 0.0, "c": 1.0, "d": 1.0})
    samples = _group(["a", "b", "c"], "q1") + _group(["d", "d"], "q2")
    adv = advanced_scores(samples, [0.0] * 5, judge, None)
    assert adv[3] == adv[4] == 0.5  # group q2 is a tie; q1's utilities do not leak into it
    assert adv[0] > adv[2] > adv[1]
    order = [4, 2, 0, 3, 1]
    adv_perm = advanced_scores([samples[i] for i in order], [0.0] * 5, judge, None)
    assert torch.allclose(adv_perm, adv[order], atol=1e-12)


def test_group_id_overrides_prompt_grouping():
    samples = [Sample(prompt="x", response="r", group_id=1), Sample(prompt="y", response="r", group_id=1),
               Sample(prompt="x", response="r", group_id=2)]
    gidx, keys = group_index(samples)
    assert gidx.tolist() == [0, 0, 1] and keys == [1, 2]


def test_buffer_comparisons_and_eviction():
    judge = TableJudge({"good": 3.0, "bad": 0.0, "old_good": 3.0, "old_bad": 0.0})
    buf = OlderPolicyBuffer(capacity=3, per_prompt=2)
    group = _group(["good", "bad"], "q1")
    alone = advanced_scores(group, [0, 0], judge, buf)
    buf.push(_group(["old_good"], "q1"), [1.0])
    with_good = advanced_scores(group, [0, 0], judge, buf)
    assert with_good[0] < alone[0]  # a strong older sample makes it harder to win
    buf.push(_group(["old_bad", "old_bad"], "q1"), [0.0, 0.0])  # per_prompt=2 evicts old_good
    assert [s.response for s, _ in buf.get("q1")] == ["old_bad", "old_bad"]
    assert advanced_scores(group, [0, 0], judge, buf)[0] > with_good[0]
    buf.push(_group(["old_good", "old_good"], "q2"), [1.0, 1.0])  # capacity 3: oldest prompt loses one
    assert len(buf) == 3 and len(buf.get("q1")) == 1
    # state round trip keeps order and content
    other = OlderPolicyBuffer(capacity=3, per_prompt=2)
    other.load_state_dict(buf.state_dict())
    assert other.state_dict() == buf.state_dict()
    # buffer of another prompt is not used
    assert torch.allclose(advanced_scores(_group(["good", "bad"], "q3"), [0, 0], judge, other), alone)


def test_deterministic_judge_prefers_correct_then_clean_text():
    judge = DeterministicJudge()
    s = [Sample(prompt="Say hi.", response=r) for r in
         ("Hello there, nice to meet you.", "hi hi hi hi hi hi hi hi hi hi hi hi", "Hello 你好 there 朋友 nice 见到")]
    u = judge.utilities(s, [1.0, 1.0, 1.0])
    assert u[0] > u[1] and u[0] > u[2]
    u2 = judge.utilities(s, [0.0, 1.0, 1.0])
    assert u2[0] < u2[1]  # the base score dominates the quality features


def test_tensor_response_ids_become_ints_and_state_is_json():
    import json

    s = Sample(prompt="q", response="a b", response_ids=torch.tensor([5, 6, 5, 6, 5, 6]), group_id=(1, 2))
    assert s.response_ids == [5, 6, 5, 6, 5, 6] and all(type(t) is int for t in s.response_ids)
    buf = OlderPolicyBuffer(capacity=4, per_prompt=2)
    buf.push([s], [0.5])
    state = json.loads(json.dumps(buf.state_dict()))
    other = OlderPolicyBuffer(capacity=4, per_prompt=2)
    other.load_state_dict(state)
    (old, base), = other.get("q")
    assert old.response_ids == [5, 6, 5, 6, 5, 6] and old.group_id is None and base == 0.5
