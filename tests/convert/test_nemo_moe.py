"""NeMo 2 checkpoints of Qwen3 (QK layernorm), Qwen3-MoE and Mixtral, both ways, against the HF forward:

- out: tiny random HF models converted with ``hf-to-mcore`` and written with ``convert mcore-to-nemo``
  name NeMo's Qwen3Model (Qwen3Config / Qwen3MoEConfig) and MixtralModel (MixtralConfig) and
  carry the tokenizer in ``context/nemo_tokenizer`` named by io.json;
- in: those NeMo directories load as ``checkpoint.load`` reads them, at TP, PP and expert-parallel
  layouts, and the logits equal the HF forward within 1e-4;
- back: the Qwen3-MoE NeMo checkpoint loaded at EP=2, saved by the trainer's writer and written
  with ``mcore-to-nemo`` again, is bit-identical to the first.

The conversions run in one child process and the Megatron forwards in one 2-rank job.
"""
import json

import pytest
import torch
import yaml

from dpcc_megatron.testing import run_multirank

from .hf_models import VOCAB, assert_one_rank_matches_hf, build_hf, run_cli
from .nemo_helpers import config_paths, read_dcp

pytestmark = pytest.mark.multirank

TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(11))
# name -> (HF family, NeMo model class, NeMo config class)
_GPT = "nemo.collections.llm.gpt.model"
MODELS = {"qwen3": ("qwen3", f"{_GPT}.qwen3.Qwen3Model", f"{_GPT}.qwen3.Qwen3Config"),
          "qwen3_moe": ("qwen3_moe", f"{_GPT}.qwen3.Qwen3Model", f"{_GPT}.qwen3.Qwen3MoEConfig"),
          "mixtral": ("mixtral", f"{_GPT}.mixtral.MixtralModel", f"{_GPT}.mixtral.MixtralConfig")}
# (model, TP, PP, EP, expert TP) on 2 ranks
LAYOUTS = [("qwen3", 1, 1, 1, None), ("qwen3", 2, 1, 1, None), ("qwen3", 1, 2, 1, None),
           ("qwen3_moe", 1, 1, 2, None), ("qwen3_moe", 2, 1, 2, 1), ("mixtral", 1, 2, 1, None),
           ("mixtral", 1, 1, 2, None)]


def _conversions(rank, world, jobs):
    return {name: run_cli(job) for name, job in jobs.items()}


def _forwards(rank, world, cases, tokens, moe_nemo, trained, local_named):
    import shutil

    from megatron.core import dist_checkpointing

    from dpcc_megatron.config import ParallelConfig
    from dpcc_megatron.convert import load_mcore_checkpoint, read_model_config
    from dpcc_megatron.convert.nemo_format import COMMON_STATE, PREFIX
    from dpcc_megatron.convert.verify import mcore_logits
    from dpcc_megatron.megatron.model import build_gpt_model
    from dpcc_megatron.megatron.parallel import destroy_model_parallel, init_model_parallel

    from .hf_models import resave

    out = {key: mcore_logits(path, tokens, tp, pp, ep=ep, etp=etp) for key, (path, tp, pp, ep, etp) in cases.items()}
    # The NeMo Qwen3-MoE policy at EP=2, saved as a training checkpoint (each rank holds half the experts).
    cfg, ep2 = read_model_config(moe_nemo), ParallelConfig(expert_model_parallel_size=2)
    resave(moe_nemo, cfg, ep2, trained, 3)
    # The same NeMo checkpoint as NeMo saves it without Transformer Engine (Megatron's local spec: the
    # MoE layer's norm under the dense layer's fused name), read back at EP=2.
    init_model_parallel(ep2)
    try:
        model = build_gpt_model(cfg, ep2)
        load_mcore_checkpoint([model], moe_nemo, cfg)
        dist_checkpointing.save({"state_dict": model.sharded_state_dict(prefix=PREFIX), **COMMON_STATE},
                                str(local_named / "weights"))
    finally:
        destroy_model_parallel()
    if rank == 0:
        shutil.copytree(moe_nemo / "context", local_named / "context")
    import torch.distributed as dist

    dist.barrier()
    out["local_named"] = mcore_logits(local_named, tokens, 1, 1, ep=2)
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("nemo_moe")
    hf = {name: root / name for name in MODELS}
    for name, (family, _, _) in MODELS.items():
        build_hf(family, hf[name], tokenizer=True)
    mc = {name: root / f"{name}_mc" for name in MODELS}
    nemo = {name: root / f"{name}_nemo" for name in MODELS}
    jobs = {}
    for name in MODELS:
        jobs[f"{name}_to_mcore"] = ["convert", "hf-to-mcore", "--hf", str(hf[name]), "--out", str(mc[name]),
                                    "--no-progress"]
        jobs[f"{name}_to_nemo"] = ["convert", "mcore-to-nemo", "--mcore", str(mc[name]), "--out", str(nemo[name]),
                                   "--no-progress"]
    (results,) = run_multirank(_conversions, 1, args=(jobs,), timeout=600)
    for job, (rc, _, err) in results.items():
        assert rc == 0, f"{job} failed:\n{err[-3000:]}"
    cases = {layout: (str(nemo[layout[0]]), *layout[1:]) for layout in LAYOUTS}
    (root / "local_named" / "weights").mkdir(parents=True)
    ranks = run_multirank(_forwards, 2, args=(cases, TOKENS, nemo["qwen3_moe"], root / "trained",
                                              root / "local_named"), timeout=600)
    back = run_multirank(_conversions, 1, args=({"back": [
        "convert", "mcore-to-nemo", "--mcore", str(root / "trained"), "--out", str(root / "back"), "--no-progress",
        "--tokenizer", str(hf["qwen3_moe"])]},), timeout=600)[0]["back"]
    return {"root": root, "hf": hf, "mc": mc, "nemo": nemo, "results": results, "ranks": ranks, "back": back}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "{}-tp{}-pp{}-ep{}-etp{}".format(*lay))
def test_nemo_checkpoint_logits_match_hf(work, layout):
    ref = assert_one_rank_matches_hf(work["ranks"], layout, work["hf"][layout[0]], TOKENS)
    assert float(ref.abs().max()) > 0.5  # not a flat model


@pytest.mark.parametrize("name", list(MODELS))
def test_written_context_names_nemos_classes_and_the_tokenizer(work, name):
    from dpcc_megatron.convert import read_model_config
    from dpcc_megatron.convert.compat import architecture_of

    _, model_class, config_class = MODELS[name]
    out = work["nemo"][name]
    summary = json.loads(work["results"][f"{name}_to_nemo"][1].strip().splitlines()[-1])
    assert summary["config_class"] == config_class and summary["tokenizer"] == "context/nemo_tokenizer"
    paths = config_paths(out / "context" / "io.json")
    assert paths["<root>.model"] == model_class and paths["<root>.model.config"] == config_class
    assert paths["<root>.model.tokenizer"] == \
        "nemo.collections.common.tokenizers.huggingface.auto_tokenizer.AutoTokenizer"
    doc = yaml.safe_load((out / "context" / "model.yaml").read_text())
    assert doc["_target_"] == model_class and doc["config"]["_target_"] == config_class
    assert doc["tokenizer"]["pretrained_model_name"] == "nemo_tokenizer"
    assert (out / "context" / "nemo_tokenizer" / "tokenizer.json").is_file()
    # The NeMo context reads back as the converted checkpoint's architecture.
    assert architecture_of(read_model_config(out)) == architecture_of(read_model_config(work["mc"][name]))
    moe = doc["config"].get("num_moe_experts")
    assert moe == {"qwen3": None, "qwen3_moe": 8, "mixtral": 4}[name]
    assert doc["config"].get("qk_layernorm", False) == name.startswith("qwen3")


def test_expert_weights_are_stored_as_nemo_stores_them(work):
    """Experts under ``module.decoder.layers.mlp.experts.experts.*`` stacked [layers, experts, ...], as
    Megatron's SequentialMLP and NeMo's grouped-GEMM experts both checkpoint them; the MoE layer's
    norm is ``pre_mlp_layernorm`` as NeMo's Transformer Engine model (and its HF importer) names it,
    not the local spec's fused name; the QK norms are ``q_layernorm``/``k_layernorm``."""
    from dpcc_megatron.convert.stored import stored_entries

    tensors, _ = stored_entries(work["nemo"]["qwen3_moe"] / "weights")
    layers = "module.decoder.layers."
    assert tensors[layers + "mlp.experts.experts.linear_fc1.weight"][0] == (2, 8, 48, 32)  # [gate; up] of width 24
    assert tensors[layers + "mlp.experts.experts.linear_fc2.weight"][0] == (2, 8, 32, 24)
    assert tensors[layers + "mlp.router.weight"][0] == (2, 8, 32)
    for key in ("pre_mlp_layernorm.weight", "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
        assert layers + key in tensors, key
    assert not any("local_experts" in k or "linear_fc1.layer_norm" in k for k in tensors)
    dense, _ = stored_entries(work["nemo"]["qwen3"] / "weights")  # a dense layer's norm is fused, as in TE
    assert layers + "mlp.linear_fc1.layer_norm_weight" in dense and layers + "pre_mlp_layernorm.weight" not in dense


def test_a_nemo_moe_checkpoint_saved_without_transformer_engine_loads(work):
    from dpcc_megatron.convert.stored import stored_entries

    tensors, _ = stored_entries(work["root"] / "local_named" / "weights")
    assert "module.decoder.layers.mlp.linear_fc1.layer_norm_weight" in tensors
    assert "module.decoder.layers.pre_mlp_layernorm.weight" not in tensors
    assert_one_rank_matches_hf(work["ranks"], "local_named", work["hf"]["qwen3_moe"], TOKENS)


def test_expert_parallel_round_trip_is_bit_identical(work):
    rc, out, err = work["back"]
    assert rc == 0, err[-3000:]
    first, back = read_dcp(work["nemo"]["qwen3_moe"] / "weights"), read_dcp(work["root"] / "back" / "weights")
    tensors = sorted(k for k, v in first.items() if isinstance(v, torch.Tensor))
    assert tensors == sorted(k for k, v in back.items() if isinstance(v, torch.Tensor)) and len(tensors) > 10
    for key in tensors:
        assert first[key].dtype == back[key].dtype and torch.equal(first[key], back[key]), key
    assert (work["root"] / "back" / "context" / "io.json").read_text() == \
        (work["nemo"]["qwen3_moe"] / "context" / "io.json").read_text()


def test_verify_reads_a_nemo_checkpoint(work):
    rc, out, err = run_cli(["convert", "verify", "--hf", str(work["hf"]["mixtral"]), "--mcore",
                            str(work["nemo"]["mixtral"]), "--ep", "2", "--seq-len", "8", "--atol", "1e-4"])
    assert rc == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["ok"] and report["ep"] == 2 and report["params_dtype"] == "fp32"
    assert report["max_abs_logit_diff"] <= 1e-4
