"""Mixture-of-experts pieces of the engine interface that need no engine: the sampler's routing in a
Generation and a batch, and which vLLM experts modules a refit bucket reloads."""
import pytest
import torch


def test_generation_routing_is_checked_per_response():
    from dpcc_megatron.rollout.engine import Generation

    lp = [torch.zeros(2), torch.zeros(1)]
    routing = [torch.zeros(4, 2, 2, dtype=torch.int16), torch.zeros(3, 2, 2, dtype=torch.int16)]
    assert Generation([[1, 2], [3]], lp, [True, False], routing).routing is routing
    with pytest.raises(ValueError, match="2 responses but 1 routing rows"):
        Generation([[1, 2], [3]], lp, [True, False], routing[:1])


def test_routing_matrix_pads_each_sample_past_its_end():
    from dpcc_megatron.megatron.routing_replay import routing_matrix

    rows = [torch.full((3, 2, 2), 3, dtype=torch.int16), torch.full((5, 2, 2), 1, dtype=torch.int16)]
    m = routing_matrix(rows, 5)
    assert m.shape == (2, 5, 2, 2) and m.dtype == torch.int16
    assert (m[0, :3] == 3).all() and (m[1] == 1).all()
    assert m[0, 3:, :, 0].eq(0).all() and m[0, 3:, :, 1].eq(1).all()  # padding: experts 0..k-1
    with pytest.raises(ValueError, match="routing of sample 1"):
        routing_matrix(rows, 4)


def test_rollout_batch_carries_the_routing_through_group_selection():
    from dpcc_megatron.train.rollout import RolloutBatch

    def batch(first):
        n = 4
        return RolloutBatch([None] * n, [[5, 6]] * n, [[7, 8, 9]] * n, [""] * n, [torch.zeros(3)] * n,
                            [False] * n, 0, [torch.full((4, 1, 2), first + i, dtype=torch.int16) for i in range(n)])

    both = RolloutBatch.concat([batch(0), batch(10)])
    picked = both.select_groups([1, 2], group_size=2)
    assert [int(r[0, 0, 0]) for r in picked.routing] == [2, 3, 10, 11]
    rl = picked.to_batch(torch.zeros(4))
    assert rl.routing.shape == (4, 4, 1, 2) and int(rl.routing[2, 0, 0, 0]) == 10
    no_routing = RolloutBatch([None], [[5]], [[6]], [""], [torch.zeros(1)], [True], 0)
    assert no_routing.to_batch(torch.zeros(1)).routing is None
    assert RolloutBatch.concat([no_routing, batch(0)]).routing is None


def test_refit_buckets_name_their_experts_modules():
    from dpcc_megatron.rollout.vllm_moe import expert_modules

    names = ["model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.0.gate_proj.weight",
             "model.layers.0.mlp.experts.3.down_proj.weight", "model.layers.2.block_sparse_moe.experts.1.w2.weight",
             "model.layers.1.self_attn.q_proj.weight"]
    assert expert_modules(names) == {"model.layers.0.mlp.experts", "model.layers.2.block_sparse_moe.experts"}
    assert expert_modules(["model.norm.weight"]) == set()


def test_vllm_workers_must_split_the_experts_evenly():
    from dpcc_megatron.config import ConfigError, load_config

    moe = ["model.num_moe_experts=4", "rollout.engine=vllm", "parallel.pipeline_model_parallel_size=2",
           "rollout.vllm.tensor_parallel_size=2"]
    with pytest.raises(ConfigError, match=r"rollout.vllm.tensor_parallel_size.*moe_ffn_hidden_size \(25"):
        load_config(None, [*moe, "model.moe_ffn_hidden_size=25"])
    assert load_config(None, [*moe, "model.moe_ffn_hidden_size=24"]).rollout.vllm.tensor_parallel_size == 2
