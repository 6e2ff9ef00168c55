"""Speed settings: resolution per machine (pure), refusals naming the key, and the wiring into
megatron-core checked on CPU (deallocated pipeline outputs at PP=2; the DP overlaps at DP=2 with the
machine check bypassed, since gloo runs the same code paths without the speed-up)."""
import pytest
import torch

from dpcc_megatron.config import ConfigError, ParallelConfig
from dpcc_megatron.megatron.performance import Hardware, Performance, release_memory_enabled, resolve

CPU = Hardware(cuda=False, fused_wgrad=False)
GPU = Hardware(cuda=True, fused_wgrad=False)
GPU_APEX = Hardware(cuda=True, fused_wgrad=True)


def test_auto_is_off_on_cpu_and_on_where_the_gpu_supports_it():
    auto = ParallelConfig()
    assert resolve(auto, CPU) == Performance(False, False, False, False)
    assert resolve(auto, GPU) == Performance(False, True, True, True)  # no apex: no wgrad fusion
    assert resolve(auto, GPU_APEX) == Performance(True, True, True, True)
    assert resolve(ParallelConfig(use_distributed_optimizer=False), GPU_APEX).overlap_param_gather is False
    assert resolve(ParallelConfig(overlap_grad_reduce=False), GPU).overlap_param_gather is False
    off = ParallelConfig(gradient_accumulation_fusion=False, overlap_grad_reduce=False, overlap_param_gather=False,
                         deallocate_pipeline_outputs=False)
    assert resolve(off, GPU_APEX) == Performance()
    assert release_memory_enabled("auto", CPU) is False and release_memory_enabled("auto", GPU) is True


@pytest.mark.parametrize("key, hw, match", [
    ("gradient_accumulation_fusion", CPU, "needs a CUDA GPU"),
    ("gradient_accumulation_fusion", GPU, "fused_weight_gradient_mlp_cuda"),
    ("overlap_grad_reduce", CPU, "needs a CUDA GPU"),
    ("overlap_param_gather", CPU, "needs parallel.overlap_grad_reduce on"),  # which auto resolves off on CPU
])
def test_explicit_true_that_cannot_run_is_refused_naming_the_key(key, hw, match):
    with pytest.raises(ConfigError, match=rf"^parallel\.{key} is true but .*{match}"):
        resolve(ParallelConfig(**{key: True}), hw)


def test_config_refuses_impossible_combinations_and_release_on_cpu():
    from dpcc_megatron.config import load_config

    with pytest.raises(ConfigError, match=r"parallel\.overlap_param_gather needs use_distributed_optimizer"):
        load_config(overrides=["parallel.use_distributed_optimizer=false", "parallel.overlap_param_gather=true"])
    with pytest.raises(ConfigError, match=r"parallel\.overlap_param_gather needs overlap_grad_reduce"):
        load_config(overrides=["parallel.overlap_grad_reduce=false", "parallel.overlap_param_gather=true"])
    with pytest.raises(ConfigError, match=r"^train\.release_memory_between_phases is true but"):
        release_memory_enabled(True, CPU)
    assert resolve(ParallelConfig(deallocate_pipeline_outputs=True), CPU).deallocate_pipeline_outputs


def test_settings_reach_transformer_and_ddp_configs(monkeypatch):
    import dpcc_megatron.megatron.performance as perf
    from dpcc_megatron.megatron.model import transformer_config
    from dpcc_megatron.testing.tiny import tiny_model_config

    monkeypatch.setattr(perf.Hardware, "detect", classmethod(lambda cls: GPU_APEX))
    cfg = transformer_config(tiny_model_config(), ParallelConfig(pipeline_model_parallel_size=1))
    assert cfg.gradient_accumulation_fusion and cfg.deallocate_pipeline_outputs
    assert perf.ddp_config_kwargs(perf.resolve(ParallelConfig())) == {"overlap_grad_reduce": True,
                                                                      "overlap_param_gather": True}
    monkeypatch.setattr(perf.Hardware, "detect", classmethod(lambda cls: CPU))
    cfg = transformer_config(tiny_model_config(), ParallelConfig())
    assert not cfg.gradient_accumulation_fusion and not cfg.deallocate_pipeline_outputs


def _with_settings(rank, world, settings, fake_gpu, *args):
    """tests/megatron/test_policy_step.py's update, with speed settings (and optionally the machine
    check told there is a GPU); also reports what the schedule and DDP actually ran with."""
    import megatron.core.pipeline_parallel.schedules as schedules

    import dpcc_megatron.megatron.performance as perf
    import dpcc_megatron.train.update as update
    import tests.megatron.test_policy_step as ps_test

    if fake_gpu:
        perf.Hardware.detect = classmethod(lambda cls: Hardware(cuda=True, fused_wgrad=False))
    real_parallel = ps_test.parallel_config
    ps_test.parallel_config = lambda tp, pp, **kw: real_parallel(tp, pp, **kw, **settings)
    seen = {"dealloc": [], "gathered": 0, "overlap": []}
    real_dealloc = schedules.deallocate_output_tensor

    def dealloc(out, deallocate_pipeline_outputs=False):
        seen["dealloc"].append(deallocate_pipeline_outputs)
        return real_dealloc(out, deallocate_pipeline_outputs)

    schedules.deallocate_output_tensor = dealloc
    real_update = update.policy_update

    def policy_update(chunks, *a, **k):
        seen["overlap"].append((chunks[0].ddp_config.overlap_grad_reduce, chunks[0].ddp_config.overlap_param_gather))
        res = real_update(chunks, *a, **k)
        seen["gathered"] += perf.gather_params(chunks)  # what the trainer does after the update phase
        return res

    update.policy_update = policy_update
    ps_test.policy_update = policy_update
    return ps_test._update_rank(rank, world, *args), seen


@pytest.fixture(scope="module")
def reference():
    from dpcc_megatron.testing import run_multirank
    from tests.megatron.test_policy_step import _all_rows, _update_rank

    (res,), = [run_multirank(_update_rank, 1, args=(1, 1, False, None, None, _all_rows))]
    return res["dpcc"][3], res["dpcc"][4], res


@pytest.mark.multirank
@pytest.mark.parametrize("name, tp, pp, dp, dist_opt, settings, fake_gpu", [
    ("pp2_deallocate", 1, 2, 1, False, {"deallocate_pipeline_outputs": True}, False),
    ("dp2_overlaps", 1, 1, 2, True, {"overlap_grad_reduce": True, "overlap_param_gather": True}, True),
])
def test_update_with_settings_matches_single_rank(reference, name, tp, pp, dp, dist_opt, settings, fake_gpu):
    from dpcc_megatron.testing import run_multirank
    from tests.megatron.test_policy_step import LOSSES, _all_rows, _dp_rows

    state, old, ref = reference
    ref_grads = {n: ref[n][1] for n in LOSSES}
    rows = _dp_rows if dp > 1 else _all_rows
    results = run_multirank(_with_settings, tp * pp * dp,
                            args=(settings, fake_gpu, tp, pp, dist_opt, state, old, rows, ref_grads), timeout=300)
    for rank_res, seen in results:
        if name == "pp2_deallocate":
            assert seen["dealloc"] and all(seen["dealloc"])  # the schedule freed the sent outputs
        else:
            assert seen["overlap"] == [(True, True)] * len(LOSSES) and seen["gathered"] == len(LOSSES)
        for loss_name in LOSSES:
            ref_loss, ref_g = ref[loss_name][0], ref[loss_name][1]
            loss, grads, skipped, expected, _ = rank_res[loss_name]
            assert not skipped and abs(loss - ref_loss) < 1e-5, (loss_name, loss, ref_loss)
            for key, g in grads.items():
                torch.testing.assert_close(g, expected[key], atol=1e-5, rtol=1e-4)


def _steps_rank(rank, world):
    """Both runs in one launch (starting ranks costs more than the steps)."""
    from megatron.core import parallel_state as ps

    plain = _steps(False)
    ps.destroy_model_parallel()
    return plain, _steps(True)


def _steps(overlap):
    """Three DPCC updates at DP=2 with the distributed optimizer, a forward-only pass before each
    (as the next iteration's old log-probs) and the phase-boundary gather at the end."""
    from megatron.core import parallel_state as ps

    import dpcc_megatron.megatron.performance as perf
    from dpcc_megatron.algo import DPCCController
    from dpcc_megatron.megatron.optimizer import build_optimizer, build_scheduler, build_training_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.policy_step import RLBatch, compute_logprobs
    from dpcc_megatron.megatron.reshard import local_named_tensors
    from dpcc_megatron.train.update import policy_update
    from tests.megatron.test_policy_step import _data, _dp_rows, _job

    if overlap:  # the machine check is told there is a GPU; gloo runs the same hooks and buckets
        perf.Hardware.detect = classmethod(lambda cls: Hardware(cuda=True, fused_wgrad=False))
    cfg = _job(1, 1, True)
    cfg.optim.lr, cfg.optim.adam_eps = 1e-2, 1e-8
    init_model_parallel(cfg.parallel, seed=5)
    torch.manual_seed(5)
    chunks = build_training_model(cfg.model, cfg.parallel, cfg.precision)
    assert chunks[0].ddp_config.overlap_param_gather is overlap
    tokens, mask, adv, _ = _data()
    rows = _dp_rows(ps.get_data_parallel_rank(), 2)
    batch = RLBatch(tokens=tokens[rows], mask=mask[rows], advantages=adv[rows])
    optimizer = build_optimizer(chunks, cfg.optim, cfg.parallel, cfg.precision)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps=10)
    ctl = DPCCController(cfg.loss.dpcc, total_steps=10)
    losses, logprobs = [], []
    for step in range(3):
        lp, _ = compute_logprobs(chunks, batch, micro_batch_size=2, vocab_size=200, dp_size=2)
        logprobs.append(lp)
        batch.old_logprobs = lp
        res = policy_update(chunks, optimizer, scheduler, ctl, batch, cfg, dp_size=2,
                            dp_group=ps.get_data_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
                            vocab_size=200, fresh=step == 0)
        losses.append(res.metrics["pg_loss"])
    gathered = perf.gather_params(chunks)
    return losses, logprobs, local_named_tensors(chunks), gathered


@pytest.mark.multirank
def test_overlapped_param_gather_over_several_steps_equals_no_overlap():
    from dpcc_megatron.testing import run_multirank

    for (l0, lp0, w0, g0), (l1, lp1, w1, g1) in run_multirank(_steps_rank, 2, timeout=300):
        assert (g0, g1) == (False, True)
        assert (lp0[1] - lp0[0]).abs().max() > 1e-4 and (lp0[2] - lp0[1]).abs().max() > 1e-4  # steps moved it
        assert l1 == pytest.approx(l0, abs=1e-6)
        for a, b in zip(lp0, lp1):  # forward passes after a step see the gathered, updated weights
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        for k in w0:
            torch.testing.assert_close(w0[k], w1[k], atol=1e-6, rtol=0, msg=k)
