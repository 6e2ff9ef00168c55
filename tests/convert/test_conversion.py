"""HF -> Megatron -> HF on tiny Llama / Qwen2 / Mistral models: logit parity at TP=1, TP=2 and
PP=2 against the HF forward, bit-identical round trips (also from a training checkpoint saved
at TP=2), the verify command, atomic outputs.

To keep process start-ups few, the conversions run in one child process, all Megatron work
in one 2-rank job, and the export of the training checkpoint in one more child; the tests
below check their results.
"""
import json
import subprocess
from pathlib import Path
import sys

import pytest
import torch

from dpcc_megatron.testing import run_multirank

from .hf_models import VOCAB, build_hf, edit_weights, hf_logits, read_tensors, resave, run_cli, try_loads, vpp_mismatches
from .nemo_helpers import config_paths

pytestmark = pytest.mark.multirank

FAMILIES = ("llama", "qwen2", "mistral")
LAYOUTS = ((1, 1), (2, 1), (1, 2))
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))


def _conversions(rank, world, jobs):
    """Child process: run CLI conversions; also read back rotary frequencies of a checkpoint."""
    results = {}
    for name, job in jobs.items():
        if job[0] == "inv_freq":
            from dpcc_megatron.convert.mcore_format import read_model_config
            from dpcc_megatron.convert.mcore_layout import meta_model
            from dpcc_megatron.convert.runtime import single_process_megatron

            with single_process_megatron():
                results[name] = meta_model(read_model_config(job[1]), torch.float32).rotary_pos_emb.inv_freq.clone()
        else:
            results[name] = run_cli(job)
    return results


def _forwards(rank, world, cases, tokens, ckpt, trained):
    """2 ranks: Megatron logits for every (checkpoint, TP, PP); loads that must be refused; a
    training checkpoint (the trainer's own writer) of ``ckpt`` loaded at TP=2."""
    import dataclasses

    from dpcc_megatron.config import ParallelConfig
    from dpcc_megatron.convert import read_model_config
    from dpcc_megatron.convert.verify import mcore_logits

    out = {key: mcore_logits(path, tokens, tp, pp) for key, (path, tp, pp) in cases.items()}
    cfg = read_model_config(ckpt)
    narrow = dataclasses.replace(cfg, hidden_size=cfg.hidden_size // 2, kv_channels=16)
    tp2 = ParallelConfig(tensor_model_parallel_size=2)
    # A model of another width; then a problem only rank 1 sees, which must not leave rank 0 waiting.
    out.update(try_loads({"mismatch": (ckpt, narrow, None),
                          "one_rank": (ckpt, cfg, dataclasses.replace(cfg, vocab_size=99) if rank else None)}, tp2))
    resave(ckpt, cfg, tp2, trained, 3)
    resave(ckpt, cfg, tp2, trained + "_carry", 4, carry=True)
    out["vpp"] = vpp_mismatches(cfg, ckpt)
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    hf = {"llama": root / "llama", "qwen2": root / "qwen2", "mistral": root / "mistral"}
    build_hf("llama", hf["llama"], tokenizer=True)
    build_hf("qwen2", hf["qwen2"], dtype=torch.bfloat16)
    build_hf("mistral", hf["mistral"], max_shard_size="100KB")
    assert len(list(hf["mistral"].glob("*.safetensors"))) > 1  # the sharded-input path is exercised

    def corrupt(t):
        t["model.layers.1.self_attn.q_proj.weight"][3] += 0.5

    def overflow(t):
        t["model.layers.0.mlp.up_proj.weight"][0, 0] = 1e5

    def quantized(t):
        t["model.layers.0.mlp.up_proj.weight"] = torch.zeros_like(t["model.layers.0.mlp.up_proj.weight"], dtype=torch.int8)

    for name, edit in (("corrupt", corrupt), ("overflow", overflow), ("int8", quantized)):
        edit_weights(hf["llama"], root / f"llama_{name}", edit)
    _as_bin(hf["llama"], root / "llama_bin")
    (root / "taken").mkdir()
    (root / "taken" / "old_file").write_text("x")

    mc = {f: root / f"{f}_mc" for f in FAMILIES}
    jobs = {}
    for f in FAMILIES:
        layout = ["--tp", "2", "--pp", "2"] if f == "mistral" else []
        jobs[f"{f}_to_mcore"] = ["convert", "hf-to-mcore", "--hf", str(hf[f]), "--out", str(mc[f]), *layout]
        shards = ["--max-shard-size", "60KB"] if f == "mistral" else []
        jobs[f"{f}_to_hf"] = ["convert", "mcore-to-hf", "--mcore", str(mc[f]), "--out", str(root / f"{f}_rt"), *shards]
    jobs["corrupt"] = ["convert", "hf-to-mcore", "--hf", str(root / "llama_corrupt"), "--out", str(root / "corrupt_mc")]
    jobs["overflow"] = ["convert", "hf-to-mcore", "--hf", str(root / "llama_overflow"), "--out",
                        str(root / "overflow_mc"), "--dtype", "fp16"]
    jobs["int8"] = ["convert", "hf-to-mcore", "--hf", str(root / "llama_int8"), "--out", str(root / "int8_mc")]
    jobs["overwrite"] = ["convert", "hf-to-mcore", "--hf", str(hf["qwen2"]), "--out", str(root / "taken"),
                         "--overwrite", "--no-progress"]
    jobs["bin"] = ["convert", "hf-to-mcore", "--hf", str(root / "llama_bin"), "--out", str(root / "bin_mc")]
    jobs["inv_freq"] = ("inv_freq", str(mc["llama"]))
    (results,) = run_multirank(_conversions, 1, args=(jobs,), timeout=600)
    for key in jobs:
        if key not in ("overflow", "int8", "inv_freq"):
            assert results[key][0] == 0, f"{key} failed:\n{results[key][2][-3000:]}"

    cases = {(f, tp, pp): (str(mc[f]), tp, pp) for f in FAMILIES for tp, pp in LAYOUTS}
    cases[("bin", 1, 1)] = (str(root / "bin_mc"), 1, 1)
    ranks = run_multirank(_forwards, 2, args=(cases, TOKENS, str(mc["llama"]), str(root / "trained")), timeout=600)
    exports = {"trained": ["convert", "mcore-to-hf", "--mcore", str(root / "trained"), "--out", str(root / "trained_hf")],
               "carried": ["convert", "mcore-to-hf", "--mcore", str(root / "trained_carry"), "--out",
                           str(root / "carried_hf")],
               "carried_nemo": ["convert", "mcore-to-nemo", "--mcore", str(root / "trained_carry"), "--out",
                                str(root / "carried_nemo"), "--no-progress"]}
    (exported,) = run_multirank(_conversions, 1, args=(exports,), timeout=300)
    results.update(exported)
    return {"root": root, "hf": hf, "mc": mc, "results": results, "ranks": ranks}


def _as_bin(src, dst):
    """The same model as a pytorch_model.bin checkpoint (read with weights_only=True)."""
    import shutil

    from safetensors.torch import load_file

    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    torch.save(load_file(str(src / "model.safetensors")), dst / "pytorch_model.bin")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_logits_match_hf(work, family, tp, pp):
    ref = hf_logits(work["hf"][family], TOKENS)
    got = [r[(family, tp, pp)] for r in work["ranks"] if r[(family, tp, pp)] is not None]
    assert len(got) == 1, "exactly one rank (last stage, TP rank 0, DP rank 0) returns logits"
    assert got[0].shape == ref.shape == (2, 16, VOCAB)  # padded vocabulary columns are dropped
    torch.testing.assert_close(got[0], ref, atol=1e-4, rtol=0)


def test_virtual_pipeline_chunks_load_the_right_layers(work):
    assert [r["vpp"] for r in work["ranks"]] == [[], []]


def test_bin_checkpoint_converts_like_safetensors(work):
    (got,) = [r[("bin", 1, 1)] for r in work["ranks"] if r[("bin", 1, 1)] is not None]
    torch.testing.assert_close(got, hf_logits(work["hf"]["llama"], TOKENS), atol=1e-4, rtol=0)


def test_training_checkpoint_exports_to_hf(work):
    """The trainer's checkpoint (saved at TP=2, padded vocabulary 256, no hf_config.json or
    tokenizer) exports bit-identically, with a generated config.json transformers loads."""
    rc, out, err = work["results"]["trained"]
    assert rc == 0, err[-3000:]
    trained_hf = work["root"] / "trained_hf"
    a, b = read_tensors(work["hf"]["llama"]), read_tensors(trained_hf)
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    config = json.loads((trained_hf / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["rope_parameters"]["rope_type"] == "llama3"
    assert torch.equal(hf_logits(trained_hf, TOKENS), hf_logits(work["hf"]["llama"], TOKENS))


def test_training_checkpoint_without_source_files_says_what_the_export_lacks(work):
    rc, out, err = work["results"]["trained"]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["config_from"] == "generated from the model config" and len(summary["missing"]) == 3
    assert summary["missing"][0].startswith("the source model's config.json: config.json was generated from the "
                                            "model config (no bos/eos token ids, max_position_embeddings = "
                                            "model.max_seq_len = ")
    assert "--tokenizer DIR" in summary["missing"][1] and summary["missing"][2].startswith("generation_config.json")
    assert err.count("missing: ") == 3


def test_a_run_started_from_a_converted_checkpoint_exports_the_source_models_files(work):
    """The trainer's checkpoint carries hf_config.json, the tokenizer and generation_config.json of the
    HF model it started from; mcore-to-hf and mcore-to-nemo write them back out and miss nothing."""
    root, src = work["root"], work["hf"]["llama"]
    state = json.loads((root / "trained_carry" / "iter_0000004" / "trainer_state.json").read_text())
    assert state["source"]["type"] == "huggingface" and state["source"]["path"] == str(src.resolve())
    assert state["source"]["checkpoint_load"] == str(work["mc"]["llama"])
    rc, out, err = work["results"]["carried"]
    assert rc == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["missing"] == [] and "missing:" not in err
    assert summary["config_from"] == "the checkpoint's hf_config.json"
    exported = root / "carried_hf"
    original, written = json.loads((src / "config.json").read_text()), json.loads((exported / "config.json").read_text())
    assert {k: v for k, v in written.items() if k not in ("dtype", "torch_dtype")} == \
        {k: v for k, v in original.items() if k not in ("dtype", "torch_dtype")}
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (exported / name).read_bytes() == (src / name).read_bytes(), name
    rc, out, err = work["results"]["carried_nemo"]
    assert rc == 0, err[-3000:]
    nemo = json.loads(out.strip().splitlines()[-1])
    assert nemo["missing"] == [] and set(nemo["tokenizer_files"]) >= {"tokenizer.json", "generation_config.json",
                                                                      "config.json"}
    kept = root / "carried_nemo" / "context" / "nemo_tokenizer"
    assert json.loads((kept / "config.json").read_text()) == original
    # io.json names it as NeMo's HF importers do, so load_context builds the model with it.
    assert nemo["tokenizer"] == "context/nemo_tokenizer"
    assert config_paths(root / "carried_nemo" / "context" / "io.json")["<root>.model.tokenizer"] == \
        "nemo.collections.common.tokenizers.huggingface.auto_tokenizer.AutoTokenizer"


def test_llama3_rope_frequencies_match_hf(work):
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = AutoConfig.from_pretrained(work["hf"]["llama"])
    hf_inv = LlamaRotaryEmbedding(config).inv_freq
    unscaled = LlamaRotaryEmbedding(AutoConfig.from_pretrained(
        work["hf"]["llama"], rope_parameters={"rope_type": "default", "rope_theta": 500000.0})).inv_freq
    assert not torch.allclose(hf_inv, unscaled), "the scaling must matter for this check to mean anything"
    torch.testing.assert_close(work["results"]["inv_freq"], hf_inv, atol=0, rtol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_identical(work, family):
    a, b = read_tensors(work["hf"][family]), read_tensors(work["root"] / f"{family}_rt")
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_round_trip_loads_in_transformers_with_sharding_and_tokenizer(work):
    from transformers import AutoTokenizer

    rt = work["root"] / "mistral_rt"
    index = json.loads((rt / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    for family in ("mistral", "qwen2"):
        ref = hf_logits(work["hf"][family], TOKENS)
        assert torch.equal(hf_logits(work["root"] / f"{family}_rt", TOKENS), ref)
    config = json.loads((work["root"] / "qwen2_rt" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"] is True
    tok = AutoTokenizer.from_pretrained(work["root"] / "llama_rt")
    assert tok.convert_tokens_to_ids("w7") == 7
    assert (work["mc"]["llama"] / "tokenizer" / "tokenizer.json").is_file()


def test_checkpoint_dir_records_config_and_dtype(work):
    import yaml

    from dpcc_megatron.convert import read_model_config

    doc = yaml.safe_load((work["mc"]["qwen2"] / "dpcc_model.yaml").read_text())
    assert doc["format"] == "dpcc-mcore/1" and doc["dtype"] == "bf16"  # the HF checkpoint's dtype by default
    cfg = read_model_config(work["mc"]["qwen2"])
    assert cfg.add_qkv_bias and cfg.tie_embeddings and cfg.vocab_size == VOCAB
    assert (work["mc"]["qwen2"] / "metadata.json").is_file() and (work["mc"]["qwen2"] / "hf_config.json").is_file()
    assert json.loads(work["results"]["overwrite"][1])["architecture"] == "Qwen2ForCausalLM"
    assert not (work["root"] / "taken" / "old_file").exists()


def test_incompatible_model_is_refused_with_the_difference(work):
    msgs = [r["mismatch"] for r in work["ranks"]]
    assert all(m is not None for m in msgs)
    assert "does not fit the model" in msgs[0] and "hidden_size: checkpoint has 64, the model has 32" in msgs[0]
    rank0, rank1 = (r["one_rank"] for r in work["ranks"])
    assert "vocab_size: checkpoint has 100, the model has 99" in rank1
    assert rank0 is not None and "another rank" in rank0


@pytest.mark.parametrize("job,match", [("overflow", "overflow torch.float16"),
                                       ("int8", "torch.int8, which cannot be represented")])
def test_unrepresentable_weights_fail_without_leaving_output(work, job, match):
    rc, _, err = work["results"][job]
    assert rc == 1 and match in err and "Traceback" not in err
    root = work["root"]
    assert not (root / f"{job}_mc").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(f".{job}_mc.")], "temporary dirs were left behind"


def _verify(hf, mc, *extra):
    proc = subprocess.run([sys.executable, "-m", "dpcc_megatron.cli", "convert", "verify", "--hf", str(hf),
                           "--mcore", str(mc), "--seq-len", "12", *extra],
                          capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout


def test_verify_passes_for_a_faithful_conversion(work):
    rc, out = _verify(work["hf"]["qwen2"], work["mc"]["qwen2"], "--tp", "2", "--params-dtype", "fp32")
    assert rc == 0, out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["ok"] and report["tp"] == 2
    assert report["max_abs_logit_diff"] < 1e-4 and report["max_abs_logprob_diff"] < 1e-4
    assert "max |logit diff|" in out and "PASS" in out


def test_verify_runs_in_the_models_own_dtype_and_says_what_memory_it_needs(work):
    from dpcc_megatron.convert.verify_memory import PROCESS_OVERHEAD_BYTES, memory_need
    from dpcc_megatron.config import load_config

    # qwen2 was built and converted in bf16: that is the default, for both models
    rc, out, err = run_cli(["convert", "verify", "--hf", str(work["hf"]["qwen2"]), "--mcore", str(work["mc"]["qwen2"]),
                            "--tp", "2", "--memory-only"])  # in this process: nothing is loaded or started
    assert rc == 0, err
    need = json.loads(out.strip().splitlines()[-1])
    assert need["dtype"] == "bf16" and need["ranks"] == 2
    assert "verify needs about" in err and "(estimate)" in err
    assert need["megatron_phase_bytes"] > 2 * need["params"] * 2 and need["hf_phase_bytes"] > need["params"] * 2
    # Llama-3-70B in its own bf16 on 16 ranks: ~2 x 141 GB while the ranks load, the HF model alone after
    cfg = load_config(Path(__file__).resolve().parents[2] / "examples" / "llama3_70b.yaml").model
    bf16, fp32 = memory_need(cfg, "bf16", 8, 2, 2, 32), memory_need(cfg, "fp32", 8, 2, 2, 32)
    assert 70.5e9 < bf16["params"] < 71.5e9
    assert bf16["bytes"] == bf16["megatron_phase_bytes"] and 2 * fp32["params"] * 4 < fp32["bytes"]
    assert bf16["bytes"] - 4 * bf16["params"] < 16 * PROCESS_OVERHEAD_BYTES + (1 << 30)
    assert fp32["bytes"] > 1.9 * bf16["bytes"]


def test_verify_fails_when_a_weight_was_corrupted(work):
    rc, out = _verify(work["hf"]["llama"], work["root"] / "corrupt_mc")
    assert rc == 1, out
    report = json.loads(out.strip().splitlines()[-1])
    assert not report["ok"] and report["max_abs_logit_diff"] > 1e-2 and report["max_abs_logprob_diff"] > 1e-2
    assert "FAIL" in out
