"""bf16 without apex/TE: Megatron's torch-norm fallback creates fp32 norm weights; they are cast to
params_dtype (as Float16Module would), so the mixed-precision optimizer (not distributed) can save."""
import pytest
import torch

from dpcc_megatron.testing import run_multirank
from dpcc_megatron.testing.tiny import parallel_config, tiny_model_config

from .test_checkpoint import _step


def _bf16_rank(rank, world, root):
    from dpcc_megatron.config import OptimizerConfig, PrecisionConfig
    from dpcc_megatron.megatron.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from dpcc_megatron.megatron.optimizer import build_optimizer, build_training_model
    from dpcc_megatron.megatron.parallel import init_model_parallel
    from dpcc_megatron.megatron.reshard import local_named_tensors

    par = parallel_config(1, 1, use_distributed_optimizer=False)
    init_model_parallel(par, seed=1)
    prec = PrecisionConfig(params_dtype="bf16")

    def fresh(seed):
        torch.manual_seed(seed)
        chunks = build_training_model(tiny_model_config(num_layers=2), par, prec)
        return chunks, build_optimizer(chunks, OptimizerConfig(lr=1e-2), par, prec)

    chunks, opt = fresh(0)
    dtypes = sorted({str(p.dtype) for c in chunks for p in c.parameters()})
    _step(chunks, opt, 1)
    meta = {"model": {}, "layout": {}}
    save_checkpoint(root, 1, chunks, opt, None, meta, keep_last=1)
    expected = local_named_tensors(chunks)
    chunks2, opt2 = fresh(5)
    load_checkpoint(latest_checkpoint(root), chunks2, opt2, None, meta)
    got = local_named_tensors(chunks2)
    return dtypes, max(float((expected[k].float() - got[k].float()).abs().max()) for k in expected)


@pytest.mark.multirank
def test_bf16_mixed_precision_optimizer_checkpoints(tmp_path):
    (dtypes, diff), = run_multirank(_bf16_rank, 1, args=(str(tmp_path / "ck"),), timeout=240)
    assert dtypes == ["torch.bfloat16"]
    assert diff == 0.0
