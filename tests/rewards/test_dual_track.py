import json
import random
import time

import pytest
import torch

from dpcc_megatron.config.reward import CheckerSpec, DynamicWeightConfig, RewardConfig
from dpcc_megatron.rewards import DualTrackReward, Sample, SampleError, register_checker, unregister_checker


def addition_batch(rng, groups=8, size=8, p_correct=0.5):
    out = []
    for g in range(groups):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        for _ in range(size):
            resp = str(a + b) if rng.random() < p_correct else str(a + b + rng.randint(1, 9))
            out.append(Sample(prompt=f"{a}+{b}=", response=resp, task="addition", answer=str(a + b), group_id=g))
    return out


class CorrectnessJudge:
    """Clean judge independent of the base track: 1 for the right answer."""

    def utilities(self, samples, base):
        return torch.tensor([float(s.response.strip() == s.answer) * 4 for s in samples], dtype=torch.float64)


class RandomJudge:
    def __init__(self, seed=0):
        self.rng = random.Random(seed)

    def utilities(self, samples, base):
        return torch.tensor([self.rng.gauss(0, 3) for _ in samples], dtype=torch.float64)


class BrokenJudge:
    def utilities(self, samples, base):
        raise RuntimeError("judge down")


def test_addition_defaults_and_static_combination():
    rng = random.Random(1)
    samples = addition_batch(rng)
    with DualTrackReward() as reward:
        res = reward.score(samples)
    correct = torch.tensor([s.response == s.answer for s in samples])
    assert torch.all(res.base[correct] == 1.0)
    # wrong but well-formatted: only the 0.1-weight format checker passes -> 0.1 / 1.1
    assert torch.allclose(res.base[~correct], torch.full(((~correct).sum(),), 0.1 / 1.1))
    assert res.weights == {"base": 0.4, "advanced": 0.6}
    assert torch.allclose(res.total, 0.4 * res.base + 0.6 * res.advanced, atol=1e-6)
    for t in (res.base, res.advanced, res.total):
        assert t.dtype == torch.float32 and t.shape == (64,) and ((t >= 0) & (t <= 1)).all()
    # in every mixed group correct answers beat wrong ones on the advanced track too
    for g in range(8):
        m = res.group_index == g
        if correct[m].any() and (~correct[m]).any():
            assert res.advanced[m][correct[m]].min() > res.advanced[m][~correct[m]].max()
    assert res.metrics["reward/checker/math"] == pytest.approx(float(correct.double().mean()))
    assert res.components()["base"] is res.base


def test_sorting_defaults():
    samples = [Sample(prompt="sort: 3 1 2", response=r, task="sorting", answer="1 2 3") for r in
               ("1 2 3", "1, 2, 3", "3 2 1", "1 2 3 because")]
    with DualTrackReward() as reward:
        res = reward.score(samples)
    assert res.checker_scores["sequence"] == [1.0, 1.0, 0.0, 1.0]
    assert res.checker_scores["format"] == [1.0, 1.0, 1.0, 0.0]
    assert res.base[0] == 1.0 and res.base[0] > res.base[3] > res.base[2]


def test_scoring_64_samples_is_cheap():
    samples = addition_batch(random.Random(2))
    with DualTrackReward() as reward:
        reward.score(samples)
        t = time.perf_counter()
        reward.score(samples)
        assert time.perf_counter() - t < 0.5


def test_metrics_variance_and_zero_variance_groups():
    samples = [Sample(prompt="1+1=", response="2", task="addition", answer="2") for _ in range(4)]
    samples += [Sample(prompt="2+2=", response=r, task="addition", answer="4") for r in ("4", "5", "4", "6")]
    with DualTrackReward() as reward:
        res = reward.score(samples)
    m = res.metrics
    assert m["reward/zero_var_group_frac"] == 0.5
    assert m["reward/base_zero_var_group_frac"] == 0.5
    assert m["reward/var_batch"] == pytest.approx(float(res.total.double().var(unbiased=False)), rel=1e-5)
    second = res.total[4:].double()
    assert m["reward/var_within_group"] == pytest.approx(float(second.var(unbiased=False)) / 2, rel=1e-5)
    assert 0.9 < m["reward/inter_track_agreement"] <= 1.0
    assert all(isinstance(v, float) for v in m.values())


def test_group_normalisation_keeps_tracks_separate():
    samples = addition_batch(random.Random(3))
    cfg = RewardConfig(normalize="group")
    with DualTrackReward(cfg) as reward:
        res = reward.score(samples)
    for g in range(8):
        m = res.group_index == g
        assert abs(float(res.total[m].double().mean())) < 1e-5
        if res.base[m].unique().numel() > 1:
            # each track has unit spread before weighting, so the total's spread is fixed by the weights
            assert float(res.total[m].double().std(unbiased=False)) == pytest.approx(1.0, rel=1e-3)


def test_judge_failure_scores_zero_and_is_counted():
    with DualTrackReward(judge=BrokenJudge()) as reward:
        res = reward.score(addition_batch(random.Random(4), groups=2))
    assert torch.all(res.advanced == 0)
    assert res.metrics["reward/judge_errors"] == 1.0
    assert any("judge down" in m for m in res.messages)


def _final_base_weight(judge, task_specs=None, steps=25):
    cfg = RewardConfig(dynamic=DynamicWeightConfig(enabled=True, rate=0.3, ema=0.5, probe_size=8),
                       tasks=task_specs or {})
    rng = random.Random(5)
    with DualTrackReward(cfg, judge=judge) as reward:
        for _ in range(steps):
            res = reward.score(addition_batch(rng))
    return res.weights["base"], res.metrics


def test_dynamic_weights_move_toward_the_clean_track():
    noise = random.Random(6)

    @register_checker("test_noisy")
    def noisy(sample, ctx):
        return noise.random()

    try:
        clean, m_clean = _final_base_weight(CorrectnessJudge())
        noisy_base, m_noisy = _final_base_weight(
            CorrectnessJudge(), {"addition": [CheckerSpec("math"), CheckerSpec("test_noisy", weight=3.0)]})
        noisy_adv, m_adv = _final_base_weight(RandomJudge())
    finally:
        unregister_checker("test_noisy")
    assert abs(clean - 0.4) < 0.03  # both clean and agreeing: the static prior stays
    assert noisy_base < 0.32  # base made noisy: weight goes to the advanced track
    assert noisy_adv > 0.55  # advanced made noisy: weight goes to the base track
    assert 0.2 <= noisy_base and noisy_adv <= 0.8  # within the configured bounds
    assert m_noisy["reward/noise_base"] > m_noisy["reward/noise_advanced"]
    assert m_adv["reward/noise_advanced"] > m_adv["reward/noise_base"]


def test_static_weights_when_dynamic_is_off():
    with DualTrackReward(judge=RandomJudge()) as reward:
        for _ in range(5):
            res = reward.score(addition_batch(random.Random(7)))
    assert res.weights == {"base": 0.4, "advanced": 0.6}


def _write_eval_set(path, rng):
    with path.open("w") as f:
        for s in addition_batch(rng, groups=4):
            f.write(json.dumps({**s.to_dict(), "label": float(s.response == s.answer)}) + "\n")


def test_eval_set_agreement_drives_weights(tmp_path):
    _write_eval_set(tmp_path / "eval.jsonl", random.Random(8))

    class AntiJudge(CorrectnessJudge):
        def utilities(self, samples, base):
            return -super().utilities(samples, base)

    cfg = RewardConfig(eval_set=str(tmp_path / "eval.jsonl"), dynamic=DynamicWeightConfig(enabled=True, rate=0.5))
    with DualTrackReward(cfg, judge=AntiJudge()) as reward:
        for _ in range(6):
            res = reward.score(addition_batch(random.Random(9)))
    assert res.metrics["reward/label_agreement_base"] == 1.0
    assert res.metrics["reward/label_agreement_advanced"] == 0.0
    assert res.weights["base"] > 0.75  # toward the track humans agree with, capped at 0.8
    with DualTrackReward(RewardConfig(eval_set=str(tmp_path / "eval.jsonl"))) as reward:  # metric only
        res = reward.score(addition_batch(random.Random(9)))
    assert res.metrics["reward/label_agreement_base"] == 1.0 and res.weights["base"] == 0.4


@pytest.mark.parametrize("line,msg", [
    ('{"prompt": "p", "response": "r"}', "'label' must be a number"),
    ('{"prompt": "p", "response": "r", "label": 2}', "'label' must be a number in \\[0, 1\\]"),
    ('{"prompt": "p", "response": "r", "label": 1', "invalid JSON"),
    ('{"prompt": "p", "label": 1}', "'response' must be a string"),
])
def test_malformed_eval_set_names_the_line(tmp_path, line, msg):
    path = tmp_path / "eval.jsonl"
    path.write_text('{"prompt": "p", "response": "r", "label": 1}\n\n' + line + "\n")
    with pytest.raises(SampleError, match=rf"eval.jsonl:3: .*{msg}"):
        DualTrackReward(RewardConfig(eval_set=str(path)))


def test_state_dict_resume_is_exact():
    cfg = RewardConfig(dynamic=DynamicWeightConfig(enabled=True, rate=0.3), buffer_size=32, buffer_per_prompt=3)
    batches = [addition_batch(random.Random(10 + i)) for i in range(4)]
    # same prompts every step so the buffer is used
    batches = [[Sample(**{**s.__dict__, "prompt": f"q{s.group_id}"}) for s in b] for b in batches]
    with DualTrackReward(cfg, judge=RandomJudge(1)) as a:
        for b in batches[:3]:
            a.push_buffer(b, a.score(b))
        state = json.loads(json.dumps(a.state_dict()))  # checkpoint-able as plain JSON
        judge_state = a.judge.rng.getstate()
        ref = a.score(batches[3])
    with DualTrackReward(cfg, judge=RandomJudge(1)) as b:
        b.load_state_dict(state)
        b.judge.rng.setstate(judge_state)
        got = b.score(batches[3])
    assert len(b.buffer) == 24 and b.buffer.state_dict() == a.buffer.state_dict()
    assert torch.equal(got.total, ref.total) and got.weights == ref.weights
    assert {k: v for k, v in got.metrics.items() if k != "reward/score_seconds"} == \
           {k: v for k, v in ref.metrics.items() if k != "reward/score_seconds"}


def test_update_false_leaves_state_untouched():
    cfg = RewardConfig(dynamic=DynamicWeightConfig(enabled=True))
    with DualTrackReward(cfg, judge=RandomJudge()) as reward:
        before = reward.state_dict()
        reward.score(addition_batch(random.Random(11)), update=False)
        assert reward.state_dict() == before
        reward.score(addition_batch(random.Random(11)))
        assert reward.state_dict() != before


def test_mixed_random_batch_stays_in_unit_interval(fast_cfg):
    rng = random.Random(12)
    pieces = ["42", r"\boxed{1/2}", "#### 7", '{"a": 1}', "```python\nx = 1\n```", "你好 hello", "1 2 3",
              "def f(:", "the the the the the the", "", "0.5", "[1, 2"]
    tasks = ["math", "addition", "sorting", "json", "code", "text", "unknown"]
    samples = [Sample(prompt=f"q{rng.randint(0, 5)}", response=" ".join(rng.sample(pieces, 3)),
                      task=rng.choice(tasks), answer=rng.choice(["42", "1 2 3", None, "0.5"]))
               for _ in range(60)]
    import dataclasses

    with DualTrackReward(dataclasses.replace(fast_cfg, fallback_task="text")) as reward:  # "unknown" falls back
        res = reward.score(samples)
    for t in (res.base, res.advanced, res.total):
        assert ((t >= 0) & (t <= 1)).all()
    for values in res.checker_scores.values():
        assert all(v is None or 0 <= v <= 1 for v in values)
    assert res.metrics["reward/checker_errors"] == 0.0


def test_global_penalties_are_subtracted_from_the_base_score():
    from dpcc_megatron.config.reward import PenaltyConfig

    cfg = RewardConfig(penalties=PenaltyConfig(max_length=4, overlong_buffer=2))
    samples = [Sample(prompt="1+1=", response="2", task="addition", answer="2", response_ids=ids)
               for ids in ([7], [7, 7, 7], [7, 7, 7, 7, 7])]
    with DualTrackReward(cfg) as reward:
        res = reward.score(samples)
    assert res.checker_scores["overlong"] == [0.0, 0.5, 1.0]
    assert res.base.tolist() == [1.0, 0.5, 0.0]
    assert res.advanced[0] > res.advanced[1] > res.advanced[2]


@pytest.mark.parametrize("normalize", ["none", "group", "batch"])
def test_empty_batch(normalize):
    cfg = RewardConfig(normalize=normalize, dynamic=DynamicWeightConfig(enabled=True))
    with DualTrackReward(cfg) as reward:
        res = reward.score([])
    assert res.total.shape == (0,) and res.metrics["reward/zero_var_group_frac"] == 0.0


class LengthJudge:
    """Prefers short responses whatever their correctness (a judge with a non-correctness preference)."""

    def utilities(self, samples, base):
        return torch.tensor([-float(len(s.response)) for s in samples], dtype=torch.float64)


def test_contrastive_gate_flattens_groups_without_rule_spread():
    from dpcc_megatron.rewards.combine import gate_by_base_spread

    # group 0: all correct (no rule spread) with different lengths the judge tells apart;
    # group 1: mixed correctness.
    samples = [Sample(prompt="1+1=", response=r, task="addition", answer="2", group_id=0)
               for r in ("2", " 2", "2 ", "  2  ")]
    samples += [Sample(prompt="2+2=", response=r, task="addition", answer="4", group_id=1)
                for r in ("4", "5", "4", "6")]
    with DualTrackReward(RewardConfig(buffer_size=0, contrastive_gate="none"), judge=LengthJudge()) as plain:
        ungated = plain.score(samples)
    with DualTrackReward(RewardConfig(buffer_size=0, contrastive_gate="base_spread"), judge=LengthJudge()) as gated_reward:
        gated = gated_reward.score(samples)
    assert ungated.advanced[:4].unique().numel() > 1          # the judge does separate them
    assert gated.advanced[:4].unique().numel() == 1           # flattened to one value ...
    assert float(gated.advanced[:4].mean()) == pytest.approx(float(ungated.advanced[:4].mean()), abs=1e-6)
    assert torch.equal(gated.advanced[4:], ungated.advanced[4:])  # ... the mixed group is untouched
    assert gated.total[:4].unique().numel() == 1              # so group 0 gives zero advantages
    assert gated.metrics["reward/contrastive_gated_group_frac"] == 0.5
    assert "reward/contrastive_gated_group_frac" not in ungated.metrics

    adv, mask = gate_by_base_spread(torch.tensor([0.1, 0.3, 0.9, 0.2]), torch.tensor([1.0, 1.0, 0.0, 1.0]),
                                    torch.tensor([0, 0, 1, 1]))
    assert mask.tolist() == [True, False]
    assert adv.tolist() == pytest.approx([0.2, 0.2, 0.9, 0.2])


def test_contrastive_gate_is_validated():
    from dpcc_megatron.config import ConfigError
    from dpcc_megatron.config.base import from_dict

    with pytest.raises(ConfigError, match="contrastive_gate"):
        from_dict(RewardConfig, {"contrastive_gate": "sometimes"})
