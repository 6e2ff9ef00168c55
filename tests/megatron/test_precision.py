"""Precision: config plumbing per mode, environment checks, FP8 recipes and the TE autocast shim,
fp32 loss math, BF16/FP16 training through Megatron's mixed-precision optimizer, and the
sampler/trainer mismatch metrics with the truncated-IS correction."""
import types

import pytest
import torch

from dpcc_megatron.config import ConfigError, JobConfig, LossConfig, PrecisionConfig, from_dict
from dpcc_megatron.megatron.precision import (build_fp8_recipe, fp8_transformer_fields, mismatch_stats,
                                              te_autocast, tis_weights, validate_precision)

H100, A100, V100, B200 = (9, 0), (8, 0), (7, 0), (10, 0)


def _precision(**kw) -> PrecisionConfig:
    return from_dict(JobConfig, {"precision": kw}).precision


# ---------------------------------------------------------------- config plumbing, every mode

MODES = {
    "fp32": dict(params_dtype="fp32"),
    "bf16": dict(params_dtype="bf16"),
    "fp16": dict(params_dtype="fp16", initial_loss_scale=1024.0, loss_scale_hysteresis=1),
    "fp8_delayed": dict(params_dtype="bf16", transformer_engine=True, fp8="delayed", fp8_amax_history_len=16,
                        fp8_amax_compute_algo="most_recent"),
    "fp8_current": dict(params_dtype="bf16", transformer_engine=True, fp8="current", fp8_format="e4m3"),
    "mxfp8": dict(params_dtype="bf16", transformer_engine=True, fp8="mxfp8"),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_transformer_config_per_mode(mode):
    from dpcc_megatron.megatron.model import transformer_config
    from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config

    prec = _precision(**MODES[mode])
    tcfg = transformer_config(tiny_model_config(), parallel_config(), prec)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[prec.params_dtype]
    assert tcfg.params_dtype == dtype and tcfg.pipeline_dtype == dtype
    assert tcfg.bf16 == (prec.params_dtype == "bf16") and tcfg.fp16 == (prec.params_dtype == "fp16")
    expected_recipe = {"delayed": "delayed", "current": "tensorwise", "mxfp8": "mxfp8", None: None}[prec.fp8]
    if prec.fp8 is None:
        assert tcfg.fp8 is None
    else:
        assert tcfg.fp8 == prec.fp8_format
        assert str(getattr(tcfg.fp8_recipe, "value", tcfg.fp8_recipe)) == expected_recipe
        assert tcfg.fp8_amax_history_len == prec.fp8_amax_history_len
        assert tcfg.fp8_amax_compute_algo == prec.fp8_amax_compute_algo


@pytest.mark.parametrize("data,key", [
    (dict(fp8="delayed"), "precision.fp8"),                                      # no TE
    (dict(fp8="delayed", transformer_engine=True), "precision.fp8"),             # fp32 params
    (dict(fp8="current", transformer_engine=True, params_dtype="fp16"), "precision.fp8"),
    (dict(fp8="fp4", transformer_engine=True, params_dtype="bf16"), "precision.fp8"),
    (dict(params_dtype="fp8"), "precision.params_dtype"),
    (dict(loss_scale_hysteresis=0), "precision.loss_scale_hysteresis"),
    (dict(min_loss_scale=10.0, initial_loss_scale=2.0), "precision.min_loss_scale"),
    (dict(tis_cap=0.5), "precision.tis_cap"),
    (dict(tis_cap=float("inf")), "precision.tis_cap"),
    (dict(fp8_margin=-1), "precision.fp8_margin"),
])
def test_bad_precision_config_names_key(data, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _precision(**data)


def test_tis_cap_loads():
    assert _precision(tis_cap=2.0).tis_cap == 2.0
    assert PrecisionConfig().tis_cap is None


# ---------------------------------------------------------------- environment checks

def _raw(**kw) -> PrecisionConfig:
    return PrecisionConfig(**kw)  # unvalidated: validate_precision must catch it on its own


@pytest.mark.parametrize("cfg,te,cap,key,text", [
    (_raw(params_dtype="bf16", transformer_engine=True, fp8="delayed"), False, H100, "precision.fp8", "not installed"),
    (_raw(params_dtype="bf16", transformer_engine=True, fp8="delayed"), True, A100, "precision.fp8", ">= 8.9"),
    (_raw(params_dtype="bf16", transformer_engine=True, fp8="mxfp8"), True, H100, "precision.fp8", ">= 10.0"),
    (_raw(params_dtype="fp32", transformer_engine=True, fp8="delayed"), True, H100, "precision.fp8", "bf16"),
    (_raw(params_dtype="fp16", transformer_engine=True, fp8="current"), True, H100, "precision.fp8", "bf16"),
    (_raw(params_dtype="bf16", fp8="delayed"), True, H100, "precision.fp8", "transformer_engine"),
    (_raw(transformer_engine=True), False, H100, "precision.transformer_engine", "not installed"),
    (_raw(transformer_engine=True), True, None, "precision.transformer_engine", "GPU"),
    (_raw(params_dtype="bf16"), False, V100, "precision.params_dtype", "fp16"),
])
def test_validate_precision_refuses(cfg, te, cap, key, text):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        validate_precision(cfg, te_available=te, device_capability=cap)
    assert text in str(e.value)


@pytest.mark.parametrize("cfg,te,cap", [
    (_raw(), False, None), (_raw(params_dtype="bf16"), False, None), (_raw(params_dtype="fp16"), False, V100),
    (_raw(params_dtype="bf16", transformer_engine=True, fp8="delayed"), True, H100),
    (_raw(params_dtype="bf16", transformer_engine=True, fp8="current"), True, (8, 9)),
    (_raw(params_dtype="bf16", transformer_engine=True, fp8="mxfp8"), True, B200),
    (_raw(params_dtype="bf16", transformer_engine=True), True, A100),
])
def test_validate_precision_accepts(cfg, te, cap):
    validate_precision(cfg, te_available=te, device_capability=cap)


def test_te_requested_without_te_fails_before_building():
    pytest.importorskip("megatron.core")
    try:
        import transformer_engine  # noqa: F401
        pytest.skip("Transformer Engine is installed here")
    except ImportError:
        pass
    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config

    # Raised before parallel state is touched: no process group needed.
    with pytest.raises(ConfigError, match=r"precision\.fp8 needs Transformer Engine"):
        build_gpt_model(tiny_model_config(), parallel_config(), _precision(params_dtype="bf16", transformer_engine=True,
                                                                           fp8="delayed"))


# ---------------------------------------------------------------- FP8 recipes and the TE autocast shim

class _Recorder:
    def __init__(self, **kw):
        self.kw = kw


def _fake_recipe_module(current=True, mx=True):
    mod = types.SimpleNamespace(Format=types.SimpleNamespace(HYBRID="HYBRID", E4M3="E4M3"),
                                DelayedScaling=type("DelayedScaling", (_Recorder,), {}))
    if current:
        mod.Float8CurrentScaling = type("Float8CurrentScaling", (_Recorder,), {})
    if mx:
        mod.MXFP8BlockScaling = type("MXFP8BlockScaling", (_Recorder,), {})
    return mod


def test_fp8_recipes():
    mod = _fake_recipe_module()
    r = build_fp8_recipe(_precision(**MODES["fp8_delayed"]), mod)
    assert type(r).__name__ == "DelayedScaling"
    assert r.kw == dict(fp8_format="HYBRID", margin=0, amax_history_len=16, amax_compute_algo="most_recent")
    r = build_fp8_recipe(_precision(**MODES["fp8_current"]), mod)
    assert type(r).__name__ == "Float8CurrentScaling" and r.kw == dict(fp8_format="E4M3")
    r = build_fp8_recipe(_precision(**MODES["mxfp8"]), mod)
    assert type(r).__name__ == "MXFP8BlockScaling" and r.kw == dict(fp8_format="HYBRID")
    assert build_fp8_recipe(_precision(params_dtype="bf16"), mod) is None
    with pytest.raises(ConfigError, match=r"precision\.fp8 'current' needs Transformer Engine >= 2\.2"):
        build_fp8_recipe(_precision(**MODES["fp8_current"]), _fake_recipe_module(current=False))
    assert fp8_transformer_fields(_precision(params_dtype="bf16")) == {}


def _fake_te(new: bool, old: bool):
    calls = []
    mod = types.SimpleNamespace()
    if new:
        def autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None, _graph=False):
            calls.append(("autocast", enabled, recipe))
            return "new-context"
        mod.autocast = autocast
    if old:
        def fp8_autocast(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None, _graph=False):
            calls.append(("fp8_autocast", enabled, fp8_recipe))
            return "old-context"
        mod.fp8_autocast = fp8_autocast
    return mod, calls


@pytest.mark.parametrize("new,old,expected", [(True, True, "autocast"), (True, False, "autocast"),
                                              (False, True, "fp8_autocast")])
def test_te_autocast_shim_picks_the_available_api(new, old, expected):
    mod, calls = _fake_te(new, old)
    ctx = te_autocast(True, "RECIPE", te_pytorch=mod)
    assert calls == [(expected, True, "RECIPE")]
    assert ctx == ("new-context" if expected == "autocast" else "old-context")


def test_te_autocast_shim_edge_cases():
    # An unrelated `autocast` without a recipe argument is not TE's new API: use fp8_autocast.
    mod, calls = _fake_te(new=False, old=True)
    mod.autocast = lambda enabled=True, dtype=None: pytest.fail("called the wrong autocast")
    te_autocast(True, "R", te_pytorch=mod)
    assert calls == [("fp8_autocast", True, "R")]
    with te_autocast(False):  # disabled needs no Transformer Engine
        pass
    with pytest.raises(RuntimeError, match="neither autocast"):
        te_autocast(True, "R", te_pytorch=types.SimpleNamespace())


# ---------------------------------------------------------------- fp32 loss math

def _loss_inputs(seed=0, b=3, t=7, v=50):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g)
    targets = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.3
    return logits, targets, mask, torch.randn(b, generator=g)


def test_loss_math_is_fp32_from_bf16_logits():
    from dpcc_megatron.algo import LossNormalizer
    from dpcc_megatron.megatron.policy_step import RLBatch, policy_loss_fn
    from dpcc_megatron.megatron.vocab_parallel import vocab_parallel_token_stats

    logits, targets, mask, adv = _loss_inputs()
    logits16 = logits.bfloat16().requires_grad_()
    stats = vocab_parallel_token_stats(logits16, targets)
    assert stats.logprobs.dtype == torch.float32 and stats.entropy.dtype == torch.float32
    ref = torch.log_softmax(logits16.detach().float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(stats.logprobs.detach(), ref, atol=1e-5, rtol=1e-5)  # no bf16 rounding of the math
    tokens = torch.cat([targets[:, :1], targets], dim=1)  # only the mask and shapes matter to the loss
    old = (stats.logprobs.detach() + 0.1).float()
    mb = RLBatch(tokens=tokens, mask=mask, old_logprobs=old, advantages=adv,
                 sampler_logprobs=old - 0.05)
    for cap in (None, 2.0):
        loss, metrics = policy_loss_fn(LossConfig(name="dpcc"), LossNormalizer.from_mask(mask), cap)(
            stats.logprobs, stats.entropy, mb)
        assert loss.dtype == torch.float32 and metrics["pg_loss"].dtype == torch.float32
        assert all(torch.as_tensor(v).dtype in (torch.float32, torch.float64) for v in metrics.values())
    loss.backward()
    assert logits16.grad is not None and logits16.grad.dtype == torch.bfloat16
    assert torch.isfinite(logits16.grad.float()).all() and logits16.grad.abs().sum() > 0


# ---------------------------------------------------------------- mismatch metrics and TIS

def _perturbed(seed=1, b=4, t=9, noise=0.3):
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(b, t, generator=g) * 3 - 0.05
    sampler = trainer + noise * torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.25
    return trainer, sampler, mask


def test_mismatch_stats_on_a_perturbed_sampler():
    from dpcc_megatron.train.metrics import logprob_stats

    trainer, sampler, mask = _perturbed()
    same = mismatch_stats(trainer, trainer, mask, cap=2.0)
    assert same["mismatch_kl"] == pytest.approx(0.0, abs=1e-7)
    assert same["is_weight_mean"] == pytest.approx(1.0) and same["is_weight_max"] == pytest.approx(1.0)
    assert same["is_ess_frac"] == pytest.approx(1.0) and same["tis_clip_frac"] == 0.0

    st = mismatch_stats(trainer, sampler, mask, cap=1.2)
    w = torch.exp(trainer - sampler)[mask]
    assert st["mismatch_kl"] > 1e-3
    assert st["is_weight_mean"] == pytest.approx(float(w.mean()), rel=1e-6)
    assert st["is_weight_max"] == pytest.approx(float(w.max()), rel=1e-6) and st["is_weight_max"] > 1.2
    assert st["is_weight_min"] == pytest.approx(float(w.min()), rel=1e-6) and st["is_weight_min"] < 1.0
    assert 0.0 < st["is_ess_frac"] < 1.0
    assert st["tis_clip_frac"] == pytest.approx(float((w > 1.2).float().mean()))

    # The trainer's per-iteration record reports the same KL(sampler || trainer) from its rollouts.
    class Rollouts:
        def sampler_logprob_matrix(self, m):
            return torch.where(m, sampler, 0.0)

    batch = types.SimpleNamespace(mask=mask)
    rec = logprob_stats(batch, Rollouts(), trainer, torch.zeros_like(trainer))
    assert rec["mismatch_kl"] == pytest.approx(st["mismatch_kl"], rel=1e-5)
    assert rec["mismatch_max_abs"] == pytest.approx(float((sampler - trainer)[mask].abs().max()), rel=1e-6)
    # a stale batch (rollout.max_staleness >= 1, sampled by older weights): the gap is staleness, not mismatch
    stale = logprob_stats(batch, Rollouts(), trainer, torch.zeros_like(trainer), on_policy=False)
    assert stale["mismatch_kl"] is None and stale["mismatch_max_abs"] is None
    assert stale["is_weight_mean"] == rec["is_weight_mean"] and stale["entropy"] == rec["entropy"]
    with pytest.raises(ValueError, match="non-finite"):
        mismatch_stats(trainer, torch.where(mask, float("-inf"), sampler), mask)
    assert mismatch_stats(trainer, sampler, torch.zeros_like(mask))["mismatch_kl"] == 0.0


def test_tis_weights():
    trainer, sampler, mask = _perturbed()
    w = tis_weights(trainer, sampler, mask, cap=1.5)
    assert not w.requires_grad and w.dtype == torch.float32
    assert (w[~mask] == 0).all()
    expected = torch.exp(trainer - sampler).clamp(max=1.5)
    torch.testing.assert_close(w[mask], expected[mask])
    assert (w[mask] == 1.5).any() and (w[mask] < 1.0).any()


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo", "gspo", "cispo", "dpcc"])
def test_tis_multiplies_each_token_loss(name):
    """policy_loss_fn with tis_cap == aggregate(w * per-token loss), in value and gradient."""
    from dpcc_megatron.algo import LossNormalizer, get_policy_loss
    from dpcc_megatron.algo.aggregation import aggregate
    from dpcc_megatron.algo.registry import prepare_inputs
    from dpcc_megatron.megatron.policy_step import RLBatch, policy_loss_fn

    old, sampler, mask = _perturbed(seed=4)
    g = torch.Generator().manual_seed(5)
    lp = (old + 0.2 * torch.randn(old.shape, generator=g)).requires_grad_()
    adv = torch.randn(old.shape[0], generator=g)
    norm = LossNormalizer.from_mask(mask)
    cfg = LossConfig(name=name)
    mb = RLBatch(tokens=torch.zeros(old.shape[0], old.shape[1] + 1, dtype=torch.long), mask=mask,
                 old_logprobs=old, advantages=adv, sampler_logprobs=sampler)
    got, metrics = policy_loss_fn(cfg, norm, 1.3)(lp, torch.zeros_like(lp), mb)
    (grad_got,) = torch.autograd.grad(got, lp)

    loss = get_policy_loss(name)
    x = prepare_inputs(lp, old, adv, mask, cfg.log_ratio_clamp)
    w = tis_weights(old, sampler, mask, 1.3)
    want = aggregate(loss.kernel(x, cfg).loss * w, x.mask, loss.aggregation, norm)
    (grad_want,) = torch.autograd.grad(want, lp)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad_got, grad_want, atol=1e-6, rtol=1e-5)
    assert float(metrics["tis_weight_mean"]) == pytest.approx(float(w[mask].mean()), rel=1e-5)
    assert 0.0 < float(metrics["tis_clip_frac"]) < 1.0

    # Sampler == trainer: weights are 1 and TIS changes nothing.
    mb.sampler_logprobs = old
    plain, _ = policy_loss_fn(cfg, norm)(lp, torch.zeros_like(lp), mb)
    same, _ = policy_loss_fn(cfg, norm, 1.3)(lp, torch.zeros_like(lp), mb)
    torch.testing.assert_close(same, plain)
    mb.sampler_logprobs = None
    with pytest.raises(ValueError, match=r"precision\.tis_cap is set but the batch carries no sampler_logprobs"):
        policy_loss_fn(cfg, norm, 1.3)(lp, torch.zeros_like(lp), mb)


# ---------------------------------------------------------------- BF16 / FP16 through Megatron's optimizer

B, L, VOCAB = 4, 10, 200


def _batch():
    from dpcc_megatron.megatron.policy_step import RLBatch

    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (B, L), generator=g)
    mask = torch.zeros(B, L - 1, dtype=torch.bool)
    mask[:, 3:] = True
    return RLBatch(tokens=tokens, mask=mask, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))


def _job(dtype, **precision):
    from dpcc_megatron.config import OptimizerConfig, TrainConfig
    from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config

    cfg = JobConfig(model=tiny_model_config(num_layers=2), parallel=parallel_config(),
                    optim=OptimizerConfig(name="adam", lr=1e-3, clip_grad=1.0),
                    train=TrainConfig(mini_batch_size=B, micro_batch_size=2))
    cfg.precision = _precision(params_dtype=dtype, **precision)
    cfg.loss.dpcc.early_phase_fraction = 0.0
    cfg.loss.dpcc.early_relax_fraction = 0.0
    return cfg


def _mixed_precision_inner(optimizer):
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    inner = [o for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]
             if isinstance(o, Float16OptimizerWithFloat16Params)]
    assert inner, f"expected Megatron's mixed-precision optimizer, got {type(optimizer).__name__}"
    return inner


def _update(chunks, optimizer, cfg, batch):
    from megatron.core import parallel_state as ps

    from dpcc_megatron.algo import DPCCController
    from dpcc_megatron.train.update import policy_update

    return policy_update(chunks, optimizer, None, DPCCController(cfg.loss.dpcc, total_steps=10), batch, cfg,
                         dp_size=1, dp_group=ps.get_data_parallel_group(),
                         pp_group=ps.get_pipeline_model_parallel_group(), vocab_size=VOCAB)


def _bf16_rank(rank, world):
    from dpcc_megatron.megatron.optimizer import build_optimizer, build_training_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.policy_step import compute_logprobs
    from dpcc_megatron.megatron.reshard import load_full_state_dict, local_named_tensors

    out = {}
    cfg = _job("bf16", tis_cap=2.0)
    init_model_parallel(cfg.parallel, seed=3)
    torch.manual_seed(3)
    chunks = build_training_model(cfg.model, cfg.parallel, cfg.precision)
    optimizer = build_optimizer(chunks, cfg.optim, cfg.parallel, cfg.precision)
    inner = _mixed_precision_inner(optimizer)
    main = [p for o in inner for group in o.fp32_from_float16_groups for p in group]
    fp32_params = [p for o in inner for group in o.fp32_from_fp32_groups for p in group]
    out["param_dtypes"] = {n.split(".")[-2]: p.dtype for n, p in chunks[0].module.named_parameters()}
    out["main_dtypes"] = {p.dtype for p in main}
    out["main_numel"] = sum(p.numel() for p in main) + sum(p.numel() for p in fp32_params)
    out["param_numel"] = sum(p.numel() for p in chunks[0].parameters())

    # Sampler in bf16 (this model), trainer in fp32 with the very same weights.
    batch = _batch()
    sampler_lp, _ = compute_logprobs(chunks, batch, micro_batch_size=2, vocab_size=VOCAB, dp_size=1)
    weights = {k: v.float() for k, v in local_named_tensors(chunks).items()}
    fp32_cfg = _job("fp32")
    fp32_chunks = build_training_model(fp32_cfg.model, fp32_cfg.parallel, fp32_cfg.precision,
                                       lambda c: load_full_state_dict(c, weights))
    trainer_lp, _ = compute_logprobs(fp32_chunks, batch, micro_batch_size=2, vocab_size=VOCAB, dp_size=1)
    out["sampler_dtype"], out["trainer_dtype"] = sampler_lp.dtype, trainer_lp.dtype
    out["mismatch"] = mismatch_stats(trainer_lp, sampler_lp, batch.mask, cap=cfg.precision.tis_cap)

    # Two DPCC steps in bf16 with the TIS correction, old log-probs from the fp32 trainer.
    batch.old_logprobs, batch.sampler_logprobs = trainer_lp, sampler_lp
    before = local_named_tensors(chunks)
    main_before = [p.detach().clone() for p in main]
    steps = [_update(chunks, optimizer, cfg, batch) for _ in range(2)]
    after = local_named_tensors(chunks)
    out["steps"] = [(s.skipped, s.metrics["pg_loss"], s.grad_norm, s.metrics.get("tis_weight_mean")) for s in steps]
    out["unmoved"] = sorted(k for k in before if torch.equal(before[k], after[k]))
    out["main_moved"] = max(float((a - b).abs().max()) for a, b in zip(main, main_before))
    out["every_main_moved"] = all(not torch.equal(a, b) for a, b in zip(main, main_before))
    out["n_params"] = len(before)
    return out


@pytest.mark.multirank
def test_bf16_training_and_mismatch_vs_fp32_trainer():
    from dpcc_megatron.testing import run_multirank

    (r,) = run_multirank(_bf16_rank, 1, timeout=300)
    # Every weight is bf16, the norms included (torch's norm fallback without apex/TE creates fp32
    # weights; the builder casts them, as Megatron-LM's Float16Module does), with fp32 main weights.
    assert set(r["param_dtypes"].values()) == {torch.bfloat16}, r["param_dtypes"]
    assert {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "word_embeddings", "output_layer",
            "input_layernorm", "final_layernorm"} <= set(r["param_dtypes"])
    assert r["main_dtypes"] == {torch.float32} and r["main_numel"] == r["param_numel"]  # fp32 main weights
    assert r["sampler_dtype"] == r["trainer_dtype"] == torch.float32  # log-probs in fp32 from bf16 logits
    m = r["mismatch"]
    assert m["mismatch_kl"] > 0.0, m  # bf16 sampler vs fp32 trainer: measurable, reported
    assert m["is_weight_max"] > 1.0 > m["is_weight_min"] and m["is_ess_frac"] < 1.0, m
    assert m["mismatch_kl"] < 0.05, m  # but small: same weights
    for skipped, loss, grad_norm, tis_mean in r["steps"]:
        assert not skipped
        assert loss == loss and abs(loss) < 1e3 and grad_norm > 0
        assert tis_mean is not None and 0.5 < tis_mean <= 2.0
    # Two steps of lr 1e-3 move every fp32 main weight; a bf16 copy near 1.0 (a norm weight: bf16
    # spacing 2^-7 there) may round back to its old value, every GEMM/embedding weight moves.
    assert r["every_main_moved"] and r["main_moved"] > 0
    assert all("layernorm" in k for k in r["unmoved"]), r["unmoved"]


def _fp16_supported() -> bool:
    try:
        a = torch.ones(4, 4, dtype=torch.float16, requires_grad=True)
        (a @ a).sum().backward()
        return a.grad is not None
    except RuntimeError:
        return False


def _fp16_rank(rank, world):
    from dpcc_megatron.megatron.optimizer import build_optimizer, build_training_model, grad_scaler
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.policy_step import compute_logprobs
    from dpcc_megatron.megatron.reshard import load_full_state_dict, local_named_tensors

    out = {}
    batch = _batch()
    # fp32 reference: same weights, same batch, its gradient norm.
    ref_cfg = _job("fp32")
    init_model_parallel(ref_cfg.parallel, seed=4)
    torch.manual_seed(4)
    ref = build_training_model(ref_cfg.model, ref_cfg.parallel, ref_cfg.precision)
    weights = {k: v.half().float() for k, v in local_named_tensors(ref).items()}  # representable in fp16
    load_full_state_dict(ref, weights)
    batch.old_logprobs, _ = compute_logprobs(ref, batch, micro_batch_size=2, vocab_size=VOCAB, dp_size=1)
    ref_opt = build_optimizer(ref, ref_cfg.optim, ref_cfg.parallel, ref_cfg.precision)
    out["ref_grad_norm"] = _update(ref, ref_opt, ref_cfg, batch).grad_norm

    # fp16 with a scale so large the fp16 gradients overflow: the step is skipped, the scale halves.
    cfg = _job("fp16", initial_loss_scale=2.0 ** 40, loss_scale_hysteresis=1, loss_scale_window=1000)
    chunks = build_training_model(cfg.model, cfg.parallel, cfg.precision, lambda c: load_full_state_dict(c, weights))
    out["param_dtypes"] = {p.dtype for n, p in chunks[0].module.named_parameters() if "layernorm" not in n}
    optimizer = build_optimizer(chunks, cfg.optim, cfg.parallel, cfg.precision)
    _mixed_precision_inner(optimizer)
    scaler = grad_scaler(optimizer)
    before = local_named_tensors(chunks)
    scales = [float(scaler.scale)]
    res = _update(chunks, optimizer, cfg, batch)
    scales.append(float(scaler.scale))
    out["overflow"] = (res.skipped, scales)
    out["unchanged_after_overflow"] = all(torch.equal(before[k], v) for k, v in local_named_tensors(chunks).items())

    # A sane scale on a fresh optimizer: the step is taken and the unscaled gradient matches fp32.
    cfg.precision.initial_loss_scale = 256.0
    optimizer = build_optimizer(chunks, cfg.optim, cfg.parallel, cfg.precision)
    res = _update(chunks, optimizer, cfg, batch)
    out["good"] = (res.skipped, res.grad_norm, float(grad_scaler(optimizer).scale))
    out["moved"] = any(not torch.equal(before[k], v) for k, v in local_named_tensors(chunks).items())
    return out


@pytest.mark.multirank
def test_fp16_dynamic_loss_scaling():
    if not _fp16_supported():
        pytest.skip("this CPU build of torch has no fp16 matmul/backward")
    from dpcc_megatron.testing import run_multirank

    (r,) = run_multirank(_fp16_rank, 1, timeout=300)
    assert r["param_dtypes"] == {torch.float16}
    skipped, scales = r["overflow"]
    assert skipped, "an overflowing fp16 step must be skipped (and counted by the trainer)"
    assert scales == [2.0 ** 40, 2.0 ** 39], scales  # hysteresis 1: halved after one overflow
    assert r["unchanged_after_overflow"]
    skipped, grad_norm, scale = r["good"]
    assert not skipped and scale == 256.0 and r["moved"]
    # The loss is scaled before backward and unscaled before the step: the norm is the fp32 one.
    assert grad_norm == pytest.approx(r["ref_grad_norm"], rel=0.05)
