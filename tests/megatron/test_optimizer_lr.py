"""Drift-aware LR on Megatron's optimizer: the LR the inner torch optimizer sees is the
scheduled LR x the DPCC factor of that step, per param group, and the schedule is untouched."""
import pytest
import torch

from dpcc_megatron.testing import run_multirank
from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config

pytestmark = pytest.mark.multirank


def _lr_rank(rank, world, dist_opt):
    from dpcc_megatron.algo import drift_lr_factor
    from dpcc_megatron.config import OptimizerConfig, PrecisionConfig
    from dpcc_megatron.megatron.optimizer import build_optimizer, build_scheduler, build_training_model, scaled_lr
    from dpcc_megatron.megatron.parallel import init_model_parallel

    par = parallel_config(1, 1, use_distributed_optimizer=dist_opt)
    init_model_parallel(par, seed=1)
    chunks = build_training_model(tiny_model_config(num_layers=2), par, PrecisionConfig())
    optim = OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_iters=2, lr_decay_style="linear", weight_decay=0.1)
    optimizer = build_optimizer(chunks, optim, par, PrecisionConfig())
    scheduler = build_scheduler(optimizer, optim, total_steps=10)

    inner = [getattr(o, "optimizer", o) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    seen = []
    for opt in inner:
        original = opt.step

        def recording_step(*a, _orig=original, _opt=opt, **k):
            seen.append([g["lr"] for g in _opt.param_groups])
            return _orig(*a, **k)

        opt.step = recording_step

    drifts = [0.0, 0.5, 1.5, 0.01, 0.0, 3.0, 0.0]
    expected, scheduled_seen = [], []
    for d in drifts:
        factor = drift_lr_factor(d, 0.02)
        for chunk in chunks:
            for p in chunk.parameters():
                p.main_grad.normal_()
        scheduled = [g["lr"] for g in optimizer.param_groups]
        with scaled_lr(optimizer, factor):
            optimizer.step()
        scheduled_seen.append(scheduled)
        expected.append([lr * factor for lr in scheduled])
        assert [g["lr"] for g in optimizer.param_groups] == scheduled  # restored right after the step
        scheduler.step(1)
    return seen, expected, scheduled_seen, [scheduler.get_lr(g) for g in optimizer.param_groups]


@pytest.mark.parametrize("dist_opt", [False, True])
def test_effective_lr_is_scheduled_times_factor(dist_opt):
    (seen, expected, scheduled, final), = run_multirank(_lr_rank, 1, args=(dist_opt,))
    assert len(seen) == len(expected) == 7
    for got, want in zip(seen, expected):
        assert got == pytest.approx(want, rel=1e-12)
    # the schedule itself (warm-up then linear decay) never saw the factor: it is the plain schedule
    warm = [s[0] for s in scheduled]
    assert warm[0] == 0.0 and warm[1] == pytest.approx(5e-4) and warm[2] == pytest.approx(1e-3)
    assert warm[3] < warm[2]
    # after drift subsides the LR is the schedule again (last step had drift 0 -> factor 1)
    assert seen[-1] == pytest.approx(scheduled[-1])
    assert seen[2][0] == pytest.approx(scheduled[2][0] * 0.5 / (1.5 - 0.02 + 1))
