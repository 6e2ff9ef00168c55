"""Cross-rank agreement (dpcc_megatron/distributed.py): every rank gets the same answer, local without
torch.distributed, and over a subgroup only its ranks take part."""
from __future__ import annotations

import torch

from dpcc_megatron.distributed import any_rank, collective_device, every_rank, first_error, reduce_values
from dpcc_megatron.testing.multirank import run_multirank


def test_without_torch_distributed_each_helper_answers_locally():
    assert any_rank(True) and not any_rank(False)
    assert every_rank(True) and not every_rank(False)
    assert first_error("boom") == "boom" and first_error(None) is None
    assert reduce_values([1, 2.5], "max") == [1.0, 2.5]
    assert collective_device() == torch.device("cpu")


def _agree_on_three_ranks(rank, world):
    import torch.distributed as dist

    pair = dist.new_group([0, 1])  # a subgroup: rank 2 never calls its collectives
    out = {
        "any": [any_rank(rank == r) for r in range(world)] + [any_rank(False)],
        "every": [every_rank(rank != 1), every_rank(True)],
        "error": [first_error(None), first_error(f"rank {rank} failed" if rank else None)],
        "sum": reduce_values([rank, 1.0], "sum"), "max": reduce_values([rank, -rank], "max"),
        "min": reduce_values([rank], "min"),
        "device": str(collective_device()),
    }
    if rank < 2:
        out["pair"] = [any_rank(rank == 1, pair), first_error(f"pair rank {rank}", pair),
                       reduce_values([rank + 1], "sum", pair)]
    return out


def test_every_rank_gets_the_same_answer_over_the_world_and_a_subgroup():
    results = run_multirank(_agree_on_three_ranks, 3, timeout=120)
    for rank, out in enumerate(results):
        assert out["any"] == [True, True, True, False]
        assert out["every"] == [False, True]
        assert out["error"] == [None, "rank 1 failed"]  # the lowest failing rank's message, everywhere
        assert out["sum"] == [3.0, 3.0] and out["max"] == [2.0, 0.0] and out["min"] == [0.0]
        assert out["device"] == "cpu"  # gloo reduces on the host, whatever CUDA there is
        if rank < 2:
            assert out["pair"] == [True, "pair rank 0", [3.0]]
