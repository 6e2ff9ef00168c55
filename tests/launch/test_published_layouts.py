"""The planner against layouts NVIDIA publishes for pre-training (numbers quoted in docs/launch.md).

Sources: Megatron-Bridge performance presets (scripts/performance/configs/llama/
llama3_workload_base_configs.py, llama31_workload_base_configs.py): 64 H100s, GBS 128,
MBS 1, sequence 8192 for Llama-3-70B; 1024 H100s, GBS 512 for Llama-3.1-405B.
"""
from __future__ import annotations

import pytest

from dpcc_megatron.launch.memory import GIB, Layout, ModelShape, Workload, estimate, peak_stage

LLAMA3_70B = ModelShape(num_layers=80, hidden=8192, ffn=28672, heads=64, kv_groups=8, head_dim=128, vocab=128256)
LLAMA31_405B = ModelShape(num_layers=126, hidden=16384, ffn=53248, heads=128, kv_groups=8, head_dim=128,
                          vocab=128256)


def pretraining_peak(model, gpus, tp, pp, vpp, cp, global_batch, fp8, recompute="none") -> float:
    """Peak GiB per GPU of a pre-training step (no rollout): SP and the distributed optimizer on."""
    dp = gpus // (tp * pp * cp)
    layout = Layout(tp=tp, pp=pp, vpp=vpp, cp=cp, dp=dp, sequence_parallel=tp > 1, distributed_optimizer=True)
    work = Workload(seq_len=8192, micro_batch=1, num_microbatches=global_batch // dp, fp8=fp8, recompute=recompute)
    return peak_stage(estimate(model, layout, work)).peak / GIB


# (name, args, GiB quoted in docs/launch.md, fits in 80 GiB)
CASES = [
    ("70B TP4 PP8 VP5 FP8 (published H100 FP8 preset)", (LLAMA3_70B, 64, 4, 8, 5, 1, 128, True), 74.5, True),
    ("70B TP4 PP8 VP5 BF16", (LLAMA3_70B, 64, 4, 8, 5, 1, 128, False), 80.1, False),
    ("70B TP4 PP4 CP2 VP5 BF16 (published H100 BF16 preset)", (LLAMA3_70B, 64, 4, 4, 5, 2, 128, False), 66.2, True),
    ("70B TP1 PP1 BF16", (LLAMA3_70B, 64, 1, 1, None, 1, 128, False), 583.9, False),
    ("405B TP8 PP8 CP2 VP8 BF16 (published, uneven split)", (LLAMA31_405B, 1024, 8, 8, 8, 2, 512, False), 81.0,
     False),
]


@pytest.mark.parametrize("name, args, quoted, fits", CASES, ids=[c[0] for c in CASES])
def test_pretraining_layouts(name, args, quoted, fits):
    gib = pretraining_peak(*args)
    assert gib == pytest.approx(quoted, abs=0.05), f"{name}: update docs/launch.md ({gib:.1f} GiB)"
    assert (gib <= 80) == fits


def test_llama3_70b_published_layout_fits_and_tp1_pp1_does_not_even_with_full_recompute():
    assert pretraining_peak(LLAMA3_70B, 64, 4, 8, 5, 1, 128, True) < 80
    # Weights and fp32 grads alone are 70.6B x 6 B = 394 GiB on every GPU.
    assert pretraining_peak(LLAMA3_70B, 64, 1, 1, None, 1, 128, False, recompute="full") > 394
