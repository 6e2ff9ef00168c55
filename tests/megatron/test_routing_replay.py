"""Routing replay on a tiny mixture-of-experts model (one rank): the experts recorded with the old
log-probs are the ones the update's forward uses, so the ratio at step 0 is exactly 1 even when the
update would route differently by itself; a sampler whose numerics route some tokens elsewhere is
matched more closely when its routing is replayed."""
import pytest
import torch

from dpcc_megatron.testing import run_multirank
from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config

pytestmark = pytest.mark.multirank

B, L, VOCAB, EXPERTS = 4, 10, 200, 4


def _lp_of(chunks, batch):
    """Log-probs of ``batch`` through the training schedule's forward, replaying batch.routing if set."""
    from dpcc_megatron.megatron.policy_step import run_schedule

    def collect(logprobs, entropy, mb):
        return torch.zeros(()), {"lp": logprobs.detach()}

    with torch.no_grad():
        out = run_schedule(chunks, batch.split(2), collect, forward_only=True, vocab_size=VOCAB, dp_size=1)
    return torch.cat([o["lp"][:, : L - 1] for o in out]) if out else None  # None off the last stage


def _router_noise(chunks, scale, seed):
    from dpcc_megatron.megatron.routing_replay import routers

    g = torch.Generator().manual_seed(seed)
    for r in routers(chunks[0]):
        with torch.no_grad():
            r.weight.add_(scale * torch.randn(r.weight.shape, generator=g))


def _replay_rank(rank, world):
    import dataclasses

    from dpcc_megatron.config import JobConfig, OptimizerConfig, TrainConfig
    from dpcc_megatron.megatron.optimizer import build_training_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.policy_step import RLBatch, compute_logprobs

    cfg = JobConfig(model=tiny_model_config(num_layers=2, num_moe_experts=EXPERTS, moe_router_topk=2,
                                            moe_ffn_hidden_size=32),
                    parallel=parallel_config(1, 1), optim=OptimizerConfig(name="adam", lr=1e-3),
                    train=TrainConfig(mini_batch_size=B, micro_batch_size=2))
    cfg.rollout.routing_replay = True
    init_model_parallel(cfg.parallel, seed=3)
    torch.manual_seed(3)
    chunks = build_training_model(cfg.model, cfg.parallel, cfg.precision)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (B, L), generator=g)
    mask = torch.ones(B, L - 1, dtype=torch.bool)
    out = {}

    # A "sampler" whose numerics differ (emulated by router noise) records its routing and log-probs.
    _router_noise(chunks, 0.05, seed=5)
    sampler = RLBatch(tokens=tokens, mask=mask)
    sampler_lp, _ = compute_logprobs(chunks, sampler, micro_batch_size=2, vocab_size=VOCAB, dp_size=1,
                                     record_routing=True)
    _router_noise(chunks, -0.05, seed=5)
    free_lp = _lp_of(chunks, RLBatch(tokens=tokens, mask=mask))
    replayed_lp = _lp_of(chunks, dataclasses.replace(RLBatch(tokens=tokens, mask=mask), routing=sampler.routing))
    out["mismatch_free"] = float((free_lp - sampler_lp).abs().mean())
    out["mismatch_replayed"] = float((replayed_lp - sampler_lp).abs().mean())

    # Old log-probs recorded with their routing; the update's forward replays it.
    batch = RLBatch(tokens=tokens, mask=mask, advantages=torch.randn(B, generator=g))
    old, _ = compute_logprobs(chunks, batch, micro_batch_size=2, vocab_size=VOCAB, dp_size=1, record_routing=True)
    out["routing"] = batch.routing.clone()
    out["free_routing_differs_from_sampler"] = float((batch.routing != sampler.routing).any(-1).float().mean())
    out["replay_equal"] = torch.equal(_lp_of(chunks, batch), old)
    shifted = dataclasses.replace(batch, routing=(batch.routing + 1) % EXPERTS)
    out["shifted_diff"] = float((_lp_of(chunks, shifted) - old).abs().max())
    # Step 0 of the update on the sampler's routing and old log-probs: ratio exactly 1 with replay.
    out["ratio"] = _step_zero_ratio(chunks, cfg, dataclasses.replace(batch, routing=sampler.routing,
                                                                      old_logprobs=replayed_lp))
    return out


def _step_zero_ratio(chunks, cfg, batch):
    """(min, max) of the importance ratio in one policy update of ``batch`` (one rank)."""
    from megatron.core import parallel_state as ps

    from dpcc_megatron.algo import DPCCController
    from dpcc_megatron.megatron.optimizer import build_optimizer, build_scheduler
    from dpcc_megatron.train.update import policy_update

    optimizer = build_optimizer(chunks, cfg.optim, cfg.parallel, cfg.precision)
    res = policy_update(chunks, optimizer, build_scheduler(optimizer, cfg.optim, total_steps=2),
                        DPCCController(cfg.loss.dpcc, total_steps=2), batch, cfg, dp_size=1,
                        dp_group=ps.get_data_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
                        vocab_size=VOCAB)
    return res.metrics["ratio_min"], res.metrics["ratio_max"]


@pytest.fixture(scope="module")
def replay():
    (res,) = run_multirank(_replay_rank, 1, timeout=300)
    return res


def test_routing_is_recorded_per_token_and_layer(replay):
    r = replay["routing"]
    assert r.shape == (B, L - 1, 2, 2) and r.dtype == torch.int16
    assert int(r.min()) >= 0 and int(r.max()) < EXPERTS
    assert (r[..., 0] != r[..., 1]).all()  # top-2: two different experts


def test_replay_reproduces_the_recorded_forward_and_is_really_used(replay):
    assert replay["replay_equal"]
    assert replay["shifted_diff"] > 1e-3


def test_ratio_at_step_zero_is_exactly_one_with_replay(replay):
    assert replay["free_routing_differs_from_sampler"] > 0.05  # without replay some tokens route elsewhere
    assert replay["ratio"] == (1.0, 1.0)


def test_sampler_mismatch_falls_with_replay(replay):
    assert replay["mismatch_replayed"] < 0.5 * replay["mismatch_free"]


def test_routing_replay_config_is_checked():
    from dpcc_megatron.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="rollout.routing_replay.*mixture-of-experts"):
        load_config(None, ["rollout.routing_replay=true"])
    moe = ["rollout.routing_replay=true", "model.num_moe_experts=4"]
    with pytest.raises(ConfigError, match="rollout.routing_replay.*recompute_granularity"):
        load_config(None, [*moe, "parallel.recompute_granularity=full"])
    with pytest.raises(ConfigError, match="rollout.routing_replay.*max_tokens_per_micro_batch"):
        load_config(None, [*moe, "train.max_tokens_per_micro_batch=4096"])
    assert load_config(None, moe).rollout.routing_replay


def _layout_rank(rank, world, tp, pp):
    import dataclasses

    from megatron.core import parallel_state as ps

    from dpcc_megatron.config import PrecisionConfig
    from dpcc_megatron.megatron.optimizer import build_training_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.policy_step import RLBatch, compute_logprobs

    model = tiny_model_config(num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=32)
    par = parallel_config(tp, pp, sequence_parallel=tp > 1, expert_model_parallel_size=2 if tp > 1 else 1,
                          expert_tensor_parallel_size=1 if tp > 1 else None)
    init_model_parallel(par, seed=3)
    torch.manual_seed(3)
    chunks = build_training_model(model, par, PrecisionConfig())
    tokens = torch.randint(0, VOCAB, (B, L), generator=torch.Generator().manual_seed(4))
    batch = RLBatch(tokens=tokens, mask=torch.ones(B, L - 1, dtype=torch.bool))
    old, _ = compute_logprobs(chunks, batch, micro_batch_size=2, vocab_size=VOCAB, dp_size=1, record_routing=True)
    replayed = _lp_of(chunks, batch)
    shifted = _lp_of(chunks, dataclasses.replace(batch, routing=(batch.routing + 1) % EXPERTS))
    last = ps.is_pipeline_last_stage()
    assert (replayed is None) != last
    return {"layers": batch.routing.shape[2], "last": last,
            "equal": torch.equal(replayed, old) if last else None,
            "shifted_diff": float((shifted - old).abs().max()) if last else None}


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2-sp-ep2", "pp2"])
def test_replay_under_sequence_and_pipeline_parallelism(tp, pp):
    results = run_multirank(_layout_rank, 2, args=(tp, pp), timeout=300)
    assert [r["layers"] for r in results] == ([4, 4] if pp == 1 else [2, 2])  # each rank: its own layers
    last = [r for r in results if r["last"]]
    assert last and all(r["equal"] and r["shifted_diff"] > 1e-3 for r in last)


# -- the sampler's routing (Megatron engine) replayed in the old-log-prob pass and the update -------------
PROMPTS = [[(5 * i + 3 * j) % 190 + 5 for j in range(n)] for i, n in enumerate((3, 6, 4, 5))]


def _sampler_replay_rank(rank, world):
    import dataclasses

    from dpcc_megatron.config import JobConfig, OptimizerConfig, TrainConfig
    from dpcc_megatron.megatron.megatron_engine import MegatronEngine
    from dpcc_megatron.megatron.optimizer import build_training_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.policy_step import compute_logprobs
    from dpcc_megatron.megatron.precision import mismatch_stats
    from dpcc_megatron.rollout.engine import Sampling
    from dpcc_megatron.train.rollout import RolloutBatch

    cfg = JobConfig(model=tiny_model_config(num_layers=2, num_moe_experts=EXPERTS, moe_router_topk=2,
                                            moe_ffn_hidden_size=32, init_method_std=0.1),
                    parallel=parallel_config(1, 1), optim=OptimizerConfig(name="adam", lr=1e-3),
                    train=TrainConfig(mini_batch_size=len(PROMPTS) * 2, micro_batch_size=2))
    cfg.rollout.routing_replay = True
    init_model_parallel(cfg.parallel, seed=3)
    torch.manual_seed(3)
    chunks = build_training_model(cfg.model, cfg.parallel, cfg.precision)
    engine = MegatronEngine(chunks, vocab_size=VOCAB, pad_id=0, record_routing=True)
    prompts = [p for p in PROMPTS for _ in range(2)]
    sampling = Sampling(max_new_tokens=8, temperature=1.0, seed=9)
    out = {}

    def rollout_batch(gen):
        rb = RolloutBatch([None] * len(prompts), prompts, gen.responses, [""] * len(prompts), gen.logprobs,
                          gen.finished, 0, gen.routing)
        return rb.to_batch(torch.randn(len(prompts), generator=torch.Generator().manual_seed(2)))

    def mismatch(batch, replay):
        b = batch if replay else dataclasses.replace(batch, routing=None)
        old, _ = compute_logprobs(chunks, b, micro_batch_size=2, vocab_size=VOCAB, dp_size=1, record_routing=True)
        return old, b, mismatch_stats(old, batch.sampler_logprobs, batch.mask)["mismatch_kl"]

    # The same numerics as the trainer: replaying the sampler's routing reproduces its log-probs.
    exact = rollout_batch(engine.generate(prompts, sampling))
    out["exact_lp_gap"] = float((mismatch(exact, True)[0] - exact.sampler_logprobs)[exact.mask].abs().max())
    # A sampler whose numerics route some tokens elsewhere (emulated by router noise while it samples).
    _router_noise(chunks, 0.05, seed=5)
    gen = engine.generate(prompts, sampling)
    _router_noise(chunks, -0.05, seed=5)
    batch = rollout_batch(gen)
    out["routing_rows"] = [tuple(r.shape) for r in gen.routing]
    out["lens"] = [len(p) + len(r) for p, r in zip(prompts, gen.responses)]
    old_off, off_batch, out["mismatch_off"] = mismatch(batch, False)
    out["free_differs"] = float((off_batch.routing != batch.routing)[batch.mask].any(-1).float().mean())
    old_on, on_batch, out["mismatch_on"] = mismatch(batch, True)
    out["routing_kept"] = on_batch.routing is batch.routing
    # Step 0 of the update: the old log-probs and the update's forward use the sampler's experts.
    out["ratio"] = _step_zero_ratio(chunks, cfg, dataclasses.replace(on_batch, old_logprobs=old_on))
    return out


@pytest.fixture(scope="module")
def sampler_replay():
    (res,) = run_multirank(_sampler_replay_rank, 1, timeout=300)
    return res


def test_the_sampler_routing_reaches_the_batch(sampler_replay):
    r = sampler_replay
    assert r["routing_rows"] == [(n - 1, 2, 2) for n in r["lens"]]  # every fed position, each layer, top-2
    assert r["routing_kept"]  # the old-log-prob pass replayed it (it did not record its own)
    assert r["exact_lp_gap"] < 1e-4


def test_sampler_routing_replay_cuts_the_mismatch_and_keeps_the_ratio_at_one(sampler_replay):
    r = sampler_replay
    assert r["free_differs"] > 0.05  # routed freely, the trainer sends some tokens to other experts
    assert r["mismatch_on"] < 0.5 * r["mismatch_off"], (r["mismatch_on"], r["mismatch_off"])
    assert r["ratio"] == (1.0, 1.0)


def _train_rank(rank, world, out):
    """Two RL iterations of a tiny MoE model at EP2 (two data-parallel replicas, different prompts) with
    routing replay and the Megatron engine; every old-log-prob pass must receive the sampler's routing."""
    from pathlib import Path

    import dpcc_megatron.train.passes as passes
    import dpcc_megatron.train.trainer as trainer
    from dpcc_megatron.config import load_config

    seen = []
    real = passes.compute_logprobs

    def spy(chunks, batch, **kw):
        seen.append((batch.routing is not None, kw.get("record_routing"),
                     None if batch.routing is None else tuple(batch.routing.shape)))
        return real(chunks, batch, **kw)

    passes.compute_logprobs = spy
    base = {"model.num_layers": 2, "model.hidden_size": 32, "model.ffn_hidden_size": 64,
            "model.num_attention_heads": 4, "model.num_query_groups": 2, "model.vocab_size": 128,
            "model.make_vocab_size_divisible_by": 32, "model.max_seq_len": 32, "model.num_moe_experts": 4,
            "model.moe_router_topk": 2, "model.moe_ffn_hidden_size": 32,
            "parallel.expert_model_parallel_size": 2, "parallel.use_distributed_optimizer": False,
            "data.synthetic_digits": 1, "rollout.group_size": 4, "rollout.prompts_per_iteration": 4,
            "rollout.max_new_tokens": 3, "rollout.routing_replay": True, "train.mini_batch_size": 8,
            "train.micro_batch_size": 4, "train.iterations": 2, "train.warmup_sft_steps": 0, "optim.lr": 1e-3,
            "train.output_dir": str(Path(out) / "run"), "monitor.enabled": False}
    summary = trainer.train(load_config(overrides=[f"{k}={v}" for k, v in base.items()]))
    return {"seen": seen, "summary": summary}


@pytest.mark.slow
def test_training_replays_the_sampler_routing_at_ep2(tmp_path):
    results = run_multirank(_train_rank, 2, args=(str(tmp_path),), timeout=600)
    for res in results:
        assert len(res["seen"]) == 2  # one old-log-prob pass per iteration
        assert all(carried and record for carried, record, _ in res["seen"])
        assert all(shape[2:] == (2, 2) for _, _, shape in res["seen"])  # both MoE layers, top-2
