"""Bounded-staleness rollouts (rollout.max_staleness) without a model: a one-parameter "policy" whose
value is its weight version, engines that record which version generated, the real sampling and
reward code."""
from __future__ import annotations

import threading

import pytest
import torch

from dpcc_megatron.algo import DPCCController
from dpcc_megatron.rollout.engine import Generation, RefitByVersion
from dpcc_megatron.train import async_rollout
from dpcc_megatron.train.async_rollout import RolloutPipeline, overlap_possible
from dpcc_megatron.train.refit import EngineWeights


class _Tok:
    pad_id, stop_ids = 0, set()

    def encode_prompt(self, text, chat=False):
        return [1] + [3 + ord(c) % 40 for c in text]

    def decode(self, ids):
        return "".join(str(t % 10) for t in ids)


class _Engine(RefitByVersion):
    """``megatron``: generates with the model's current parameter (reads the training weights);
    ``vllm``: with the copy its last refit took, optionally blocking until released."""

    last_refit_s = 0.0

    def __init__(self, name, chunks, gate=None):
        self.name, self.chunks, self.gate, self.held, self.seen = name, chunks, gate, None, []

    def update_weights(self, chunks):
        self.held = float(chunks[0].weight.detach().flatten()[0])

    def generate(self, prompt_ids, sampling):
        if self.gate is not None:
            assert self.gate.wait(10)
        v = float(self.chunks[0].weight.detach().flatten()[0]) if self.name == "megatron" else self.held
        self.seen.append(v)
        resp = [[3 + int(v), 4 + (sampling.seed + i) % 5] for i in range(len(prompt_ids))]
        return Generation(resp, [torch.full((2,), -1.0) for _ in resp], [False] * len(resp))

    def sleep(self):
        pass


class _Ctx:
    def __init__(self, k, engine="megatron", gate=None, dynamic=False):
        from dpcc_megatron.config import load_config
        from dpcc_megatron.data.prompts import PromptDataset, synthetic_prompts
        from dpcc_megatron.rewards import DualTrackReward

        self.cfg = load_config(overrides=[f"rollout.max_staleness={k}", "rollout.group_size=2",
                                          "rollout.prompts_per_iteration=2", f"rollout.dynamic_sampling={dynamic}",
                                          "train.mini_batch_size=4", "train.micro_batch_size=2"])
        self.dp, self.dp_rank, self.mp_rank, self.mp_group, self.dp_group = 1, 0, 0, None, None
        self.chunks = [torch.nn.Linear(1, 1, bias=False)]
        self.tokenizer, self.counters = _Tok(), {"prompts_truncated": 0}
        self.dataset = PromptDataset(synthetic_prompts("addition", 1, 64, seed=1), seed=1)
        self.reward = DualTrackReward(self.cfg.reward)
        self.engine = _Engine(engine, self.chunks, gate)
        self.weights = EngineWeights(self.engine, self.chunks)
        self.set_version(0)

    def set_version(self, v):
        with torch.no_grad():
            self.chunks[0].weight.fill_(float(v))
        self.weights.version = v  # the trainer's weight version moves with the weights


def _loop(ctx, pipe, iterations, start=0):
    """The trainer's order: refit (unless overlapping), take, submit ahead, "update" (the weights become
    version i + 1)."""
    out = []
    for i in range(start, iterations):
        if not pipe.overlapping:
            ctx.weights.refit()
        s = pipe.take(ctx, i)
        pipe.submit_ahead(ctx, i, iterations)
        assert float(ctx.chunks[0].weight) == i  # the current weights are back after a snapshot
        out.append((s.weight_version, s.rollouts.response_ids, [p.text for p in s.rollouts.prompts]))
        ctx.set_version(i + 1)
    return out


def test_k0_is_the_synchronous_loop(monkeypatch):
    ctx = _Ctx(0)
    pipe = RolloutPipeline(ctx)
    seen = []
    real = async_rollout.sample_iteration
    monkeypatch.setattr(async_rollout, "sample_iteration", lambda c, i: seen.append(real(c, i)) or seen[-1])
    with pytest.raises(RuntimeError, match="refit it"):  # generating from weights the engine does not serve
        pipe.take(ctx, 0)
    ctx.weights.refit()
    s = pipe.take(ctx, 0)
    assert s is seen[-1] and s.weight_version is None  # exactly what the synchronous loop samples
    pipe.submit_ahead(ctx, 0, 5)
    assert not pipe.inflight and pipe.state_dict() is None
    ctl = DPCCController(ctx.cfg.loss.dpcc, 10)
    before = ctl.state_dict()
    assert pipe.staleness_fields(ctx, ctl, s, None, 0) == {}  # no record field, nothing told to DPCC
    assert ctl.state_dict() == before and "dpcc/behaviour_kl" not in ctl.metrics()


@pytest.mark.parametrize("k", [1, 2])
def test_snapshot_mode_samples_with_weights_at_most_k_versions_old(k):
    ctx = _Ctx(k)
    pipe = RolloutPipeline(ctx)
    assert pipe.mode == "snapshot" and not pipe.overlapping
    got = _loop(ctx, pipe, 5)
    versions = [v for v, _, _ in got]
    assert versions == [max(0, i - k) for i in range(5)]
    assert ctx.engine.seen == [float(v) for v in versions]  # the generation saw exactly those weights
    assert max(i - v for i, v in enumerate(versions)) == k
    # the prompts are the synchronous loop's, iteration by iteration
    ref_ctx = _Ctx(0)
    ref = _loop(ref_ctx, RolloutPipeline(ref_ctx), 5)
    assert [p for _, _, p in got] == [p for _, _, p in ref]


def test_overlap_mode_generates_the_next_rollouts_while_the_update_runs():
    gate = threading.Event()
    ctx = _Ctx(1, engine="vllm", gate=gate)
    pipe = RolloutPipeline(ctx)
    assert pipe.mode == "overlap" and pipe.overlapping
    gate.set()
    first = pipe.take(ctx, 0)
    gate.clear()
    pipe.submit_ahead(ctx, 0, 3)
    req = pipe.inflight[1]
    assert req.thread is not None and req.thread.is_alive()  # generating while iteration 0 "trains"
    ctx.set_version(1)
    gate.set()
    second = pipe.take(ctx, 1)
    assert (first.weight_version, second.weight_version) == (0, 0) and ctx.engine.seen == [0.0, 0.0]
    # same prompts and weight versions as the snapshot mode (only where the generation runs differs)
    snap = _Ctx(1)
    ref = _loop(snap, RolloutPipeline(snap), 2)
    assert [p.text for p in second.rollouts.prompts] == ref[1][2]
    assert second.rollouts.response_ids == ref[1][1]


def test_a_failed_background_generation_raises_in_the_trainer():
    ctx = _Ctx(1, engine="vllm")
    pipe = RolloutPipeline(ctx)
    pipe.take(ctx, 0)
    ctx.engine.generate = lambda *a: (_ for _ in ()).throw(RuntimeError("engine died"))
    pipe.submit_ahead(ctx, 0, 3)
    with pytest.raises(RuntimeError, match="iteration 1 failed: engine died"):
        pipe.take(ctx, 1)


@pytest.mark.parametrize("engine", ["megatron", "vllm"])
def test_resume_from_the_in_flight_state_is_exact(engine):
    straight_ctx = _Ctx(2, engine=engine)
    straight = _loop(straight_ctx, RolloutPipeline(straight_ctx), 6)

    ctx = _Ctx(2, engine=engine)
    pipe = RolloutPipeline(ctx)
    part = []
    for i in range(3):  # three iterations, then "checkpoint" after the third
        s = pipe.take(ctx, i)
        pipe.submit_ahead(ctx, i, 6)
        part.append((s.weight_version, s.rollouts.response_ids, [p.text for p in s.rollouts.prompts]))
        ctx.set_version(i + 1)
    state = torch.load(_roundtrip(pipe.state_dict()), weights_only=False)
    data, reward = ctx.dataset.state_dict(), ctx.reward.state_dict()
    assert sorted(r["iteration"] for r in state["requests"]) == [3, 4]

    resumed = _Ctx(2, engine=engine)
    resumed.set_version(3)
    resumed.dataset.load_state_dict(data)
    resumed.reward.load_state_dict(reward)
    pipe2 = RolloutPipeline(resumed)
    pipe2.load_state_dict(state, resumed)
    rest = _loop(resumed, pipe2, 6, start=3)
    assert part + rest == straight


def _roundtrip(state):
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf


def test_a_checkpoint_of_another_staleness_is_refused():
    from dpcc_megatron.megatron.checkpoint import CheckpointError

    ctx = _Ctx(1)
    pipe = RolloutPipeline(ctx)
    pipe.take(ctx, 0)
    pipe.submit_ahead(ctx, 0, 4)
    state = pipe.state_dict()
    with pytest.raises(CheckpointError, match="max_staleness=1"):
        RolloutPipeline(_Ctx(2)).load_state_dict(state, None)
    with pytest.raises(CheckpointError, match="max_staleness=1"):
        RolloutPipeline(_Ctx(0)).load_state_dict(state, None)
    fresh = RolloutPipeline(_Ctx(1))
    fresh.load_state_dict(None, None)  # a synchronous checkpoint: nothing in flight, said so
    assert not fresh.inflight


def test_a_rollback_discards_the_requests_in_flight():
    ctx = _Ctx(2)
    pipe = RolloutPipeline(ctx)
    pipe.take(ctx, 0)
    pipe.submit_ahead(ctx, 0, 6)
    pipe.reset()
    assert not pipe.inflight and pipe.discarded == 2
    assert pipe.take(ctx, 1).weight_version == 1  # sampled from the restored weights


def test_when_overlap_is_possible():
    ctx = _Ctx(1)
    assert "decodes with the training weights" in overlap_possible(ctx.cfg, "megatron", 1)
    assert "model-parallel" in overlap_possible(ctx.cfg, "vllm", 2)
    assert "dynamic_sampling" in overlap_possible(_Ctx(1, dynamic=True).cfg, "vllm", 1)
    assert overlap_possible(ctx.cfg, "vllm", 1) is None


@pytest.mark.multirank
@pytest.mark.slow
def test_resume_is_exact_with_rollouts_in_flight(tmp_path):
    """k = 1 through the real trainer: 4 iterations straight == 2, stop, resume, 2 more; the records
    carry the staleness and the behaviour KL."""
    import json

    from dpcc_megatron.testing import run_multirank

    from .test_train_e2e import _run_rank

    keys = ("pg_loss", "reward_mean", "kl_old_new", "tau", "lr_factor", "kl_behaviour", "staleness_mean",
            "dpcc/lr_scale")
    common = {"train.iterations": 4, "checkpoint.save_interval": 2, "checkpoint.keep_last": 2,
              "rollout.max_staleness": 1, "train.warmup_sft_steps": 0}
    straight = tmp_path / "straight"
    run_multirank(_run_rank, 1, args=(str(straight), {**common, "checkpoint.dir": str(straight / "ck")}), timeout=300)
    split = tmp_path / "split"
    over = {**common, "checkpoint.dir": str(split / "ck"), "train.exit_interval": 2}
    (first, _), = run_multirank(_run_rank, 1, args=(str(split), over), timeout=300)
    assert first["iterations"] == 2
    (second, _), = run_multirank(_run_rank, 1, args=(str(split), over), timeout=300)
    assert second["iterations"] == 4 and second["stop_reason"] == "completed"
    a = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
    assert [r["staleness_max"] for r in a] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["kl_behaviour"] >= 0 for r in a) and a[2]["kl_behaviour"] > 0
    # mismatch_kl only where sampler and trainer held the same weights (iteration 0, sampled on the spot);
    # a stale batch's gap is staleness, which kl_behaviour reports
    assert a[0]["mismatch_kl"] < 1e-5 and [r["mismatch_kl"] for r in a[1:]] == [None] * 3
    for ra, rb in zip(a[2:], b):
        for k in keys:
            assert abs(ra[k] - rb[k]) <= 1e-6, (k, ra["iteration"], ra[k], rb[k])


def test_wait_idle_finishes_the_background_generation_and_keeps_its_result():
    gate = threading.Event()
    ctx = _Ctx(1, engine="vllm", gate=gate)
    pipe = RolloutPipeline(ctx)
    gate.set()
    pipe.take(ctx, 0)
    gate.clear()
    pipe.submit_ahead(ctx, 0, 3)
    threading.Timer(0.2, gate.set).start()
    pipe.wait_idle()  # the engine is idle now (e.g. before the evaluation refits it)
    assert pipe.inflight[1].thread is None and pipe.inflight[1].generation is not None
    ctx.set_version(1)
    ctx.engine.update_weights(ctx.chunks)  # what an evaluation would do in between
    assert pipe.take(ctx, 1).weight_version == 0 and ctx.engine.seen == [0.0, 0.0]


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason="vllm is not installed")
def test_the_vllm_engine_generates_the_next_rollouts_in_the_background(tmp_path):
    """k = 1 with the real vLLM engine (its own process): overlap mode through the trainer."""
    import json

    from dpcc_megatron.testing import run_multirank

    from .test_train_e2e import _run_rank

    over = {"rollout.engine": "vllm", "rollout.max_staleness": 1, "train.iterations": 3,
            "model.hidden_size": 128, "model.ffn_hidden_size": 256, "parallel.tensor_model_parallel_size": 1,
            "eval.max_prompts": 4}
    (summary, moved), = run_multirank(_run_rank, 1, args=(str(tmp_path), over), timeout=600)
    assert summary["stop_reason"] == "completed" and moved > 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["staleness_max"] for r in records] == [0.0, 1.0, 1.0]
    assert [r["rollout_weight_version"] for r in records] == [0, 0, 1]
    assert all(r["kl_behaviour"] >= 0 for r in records) and records[-1]["kl_behaviour"] > 0
    # the engine took new weights in iteration 1 only: iteration 0 reuses the evaluation's refit, and
    # iteration 2 requests nothing ahead (it is the last)
    assert [r["time_refit_s"] > 0 for r in records] == [False, True, False]
