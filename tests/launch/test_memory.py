"""The memory arithmetic against the formulas it implements and against published numbers."""
from __future__ import annotations

import pytest

from dpcc_megatron.launch.memory import (
    GIB, Layout, ModelShape, Workload, bubble_fraction, bytes_per_param, estimate, in_flight,
    layer_activation_bytes, layers_on_stage, stage_params, stage_terms,
)

# GPT-3 175B as in Korthikanti et al. 2022, Table 3: a = 96, h = 12288, L = 96, s = 2048.
GPT3 = ModelShape(num_layers=96, hidden=12288, ffn=4 * 12288, heads=96, kv_groups=96, head_dim=128,
                  vocab=51200, swiglu=False, layernorm=True, linear_bias=True)
LLAMA3_70B = ModelShape(num_layers=80, hidden=8192, ffn=28672, heads=64, kv_groups=8, head_dim=128, vocab=128256)


def paper_work(**kw) -> Workload:
    """The paper's setting: 16-bit activations, dropout everywhere, unfused attention."""
    base = dict(seq_len=2048, micro_batch=1, num_microbatches=1, params_dtype="fp16", flash_attention=False,
                attention_dropout=True, hidden_dropout=True)
    base.update(kw)
    return Workload(**base)


@pytest.mark.parametrize("t", [1, 2, 8])
def test_table2_tensor_parallel(t):
    s, b, h, a = 2048, 1, GPT3.hidden, GPT3.heads
    got = layer_activation_bytes(GPT3, Layout(tp=t), paper_work())
    assert got == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))


@pytest.mark.parametrize("t", [2, 8])
def test_table2_sequence_parallel_and_selective_recompute(t):
    s, b, h, a = 2048, 1, GPT3.hidden, GPT3.heads
    sp = Layout(tp=t, sequence_parallel=True)
    assert layer_activation_bytes(GPT3, sp, paper_work()) == pytest.approx(s * b * h / t * (34 + 5 * a * s / h))
    assert layer_activation_bytes(GPT3, sp, paper_work(recompute="selective")) == pytest.approx(34 * s * b * h / t)
    assert layer_activation_bytes(GPT3, Layout(tp=t), paper_work(recompute="selective")) == pytest.approx(
        s * b * h * (10 + 24 / t))


def test_table2_full_recompute_keeps_only_the_layer_input():
    s, b, h = 2048, 1, GPT3.hidden
    assert layer_activation_bytes(GPT3, Layout(tp=8), paper_work(recompute="full")) == 2 * s * b * h
    assert layer_activation_bytes(GPT3, Layout(tp=8, sequence_parallel=True),
                                  paper_work(recompute="full")) == 2 * s * b * h / 8


def test_megatron_formula_for_llama_with_fused_attention():
    """Megatron-LM's theoretical_memory_usage.py (SP + selective): s*b*h*(18 + 4*f/h)/t per layer.

    It keeps two dropout masks and ignores GQA, SwiGLU's double-width first MLP output and flash
    attention's log-sum-exp; Llama has no dropout, so the difference must be exactly those four terms."""
    m, t, s = LLAMA3_70B, 4, 8192
    work = Workload(seq_len=s, micro_batch=1, num_microbatches=1, recompute="selective")
    ours = layer_activation_bytes(m, Layout(tp=t, sequence_parallel=True), work)
    megatron = s * m.hidden * (18 + 4 * m.ffn / m.hidden) / t
    gqa = -2 * 2 * s * (m.heads - m.kv_groups) * m.head_dim  # K and V have g, not a, heads
    swiglu = 2 * s * m.ffn  # the gate half of the first MLP output
    lse = 4 * m.heads * s
    masks = -2 * s * m.hidden
    assert ours == pytest.approx(megatron + (gqa + swiglu + lse + masks) / t)


def test_fp8_stores_linear_inputs_in_one_byte():
    m, s = LLAMA3_70B, 1024
    layout = Layout(tp=1)
    bf16 = layer_activation_bytes(m, layout, Workload(seq_len=s, micro_batch=1, num_microbatches=1))
    fp8 = layer_activation_bytes(m, layout, Workload(seq_len=s, micro_batch=1, num_microbatches=1, fp8=True))
    linear_inputs = s * (3 * m.hidden + m.ffn)  # QKV in, out-proj in, fc1 in, fc2 in
    assert bf16 - fp8 == pytest.approx(linear_inputs)


@pytest.mark.parametrize("dtype, dist, expected", [
    ("bf16", False, 18), ("bf16", True, 6 + 12 / 8), ("fp32", False, 16), ("fp32", True, 8 + 8 / 8),
])
def test_bytes_per_param_match_megatrons_distributed_optimizer_table(dtype, dist, expected):
    w, g, o = bytes_per_param(Workload(seq_len=1, micro_batch=1, num_microbatches=1, params_dtype=dtype),
                              Layout(dp=8, distributed_optimizer=dist))
    assert w + g + o == pytest.approx(expected)


@pytest.mark.parametrize("shape, published", [
    (LLAMA3_70B, 70.55e9),
    (ModelShape(num_layers=28, hidden=3584, ffn=18944, heads=28, kv_groups=4, head_dim=128, vocab=152064,
                qkv_bias=True), 7.62e9),      # Qwen2.5-7B
    (ModelShape(num_layers=88, hidden=12288, ffn=28672, heads=96, kv_groups=8, head_dim=128, vocab=32768),
     122.6e9),                                 # Mistral-Large-2407
])
def test_parameter_counts_match_the_published_models(shape, published):
    assert shape.total_params() == pytest.approx(published, rel=3e-3)


def test_stage_params_sum_to_the_model():
    layout = Layout(tp=4, pp=8)
    total = sum(stage_params(LLAMA3_70B, layout, st) * 4 for st in range(8))
    # Norm weights are replicated on the 4 TP ranks: counted 3 extra times.
    norms = (2 * LLAMA3_70B.num_layers + 1) * LLAMA3_70B.norm_params() * 3
    assert total - norms == pytest.approx(LLAMA3_70B.total_params(tp=4), rel=1e-12)


def test_in_flight_micro_batches():
    # 1F1B: stage i holds min(p - i, m); the last stage one.
    assert [in_flight(i, Layout(pp=4), 8) for i in range(4)] == [4, 3, 2, 1]
    assert in_flight(0, Layout(pp=4), 2) == 2
    # Interleaved: the first stage holds L * (1 + (p - 1) / (p * v)) layers' worth (the paper's penalty).
    layout = Layout(pp=8, vpp=5)
    chunks = in_flight(0, layout, 64)
    assert chunks * layers_on_stage(LLAMA3_70B, layout) // 5 == 80 * (1 + 7 / 40)


def test_bubble():
    assert bubble_fraction(Layout(pp=8), 64) == pytest.approx(7 / 71)
    assert bubble_fraction(Layout(pp=8, vpp=5), 64) == pytest.approx(7 / (320 + 7))
    assert bubble_fraction(Layout(pp=1), 4) == 0


def test_kv_cache_term():
    layout = Layout(tp=4, pp=8)
    work = Workload(seq_len=4096, micro_batch=1, num_microbatches=1, rollout_batch=64, rollout_len=4096,
                    rollout_prompt_len=1024)
    kv = next(x for x in stage_terms(LLAMA3_70B, layout, work, 0) if x.name == "rollout KV cache")
    assert kv.bytes == 2 * 10 * (8 / 4) * 128 * 4096 * 64 * 2
    assert kv.phase == "rollout"


def test_peak_is_resident_state_plus_the_larger_phase():
    work = Workload(seq_len=4096, micro_batch=1, num_microbatches=32, rollout_batch=512, rollout_len=4096,
                    rollout_prompt_len=1024)
    st = estimate(LLAMA3_70B, Layout(tp=8, pp=2, dp=4, sequence_parallel=True), work)[0]
    assert st.peak == st.phase("static") + max(st.phase("train"), st.phase("rollout"))
    assert st.peak_phase == "rollout"  # 512 sequences of KV outweigh the activations
    assert st.peak / GIB > st.phase("static") / GIB


def test_reference_model_adds_a_weight_copy():
    work = Workload(seq_len=1024, micro_batch=1, num_microbatches=1)
    layout = Layout(tp=8, pp=2)
    plain = {x.name: x.bytes for x in stage_terms(LLAMA3_70B, layout, work, 0)}
    ref = {x.name: x.bytes for x in stage_terms(LLAMA3_70B, layout,
                                                 Workload(seq_len=1024, micro_batch=1, num_microbatches=1,
                                                          ref_model=True), 0)}
    assert ref["reference weights"] == plain["weights"]
