"""Bad input gets one clear error line (exit code 1, no traceback) before any work is done."""
import json
import shutil

import pytest

from .hf_models import build_hf, run_cli


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    build_hf("llama", root / "llama")
    build_hf("mistral", root / "sharded", max_shard_size="100KB")
    return root


def _fails(argv, *needles):
    rc, out, err = run_cli(argv)
    assert rc == 1, (rc, out, err)
    assert err.startswith("error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


def test_unsupported_architecture_lists_the_supported_ones(dirs, tmp_path):
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(dirs / "llama", gpt2)
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    _fails(["convert", "hf-to-mcore", "--hf", str(gpt2), "--out", str(tmp_path / "o")],
           "GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@pytest.mark.parametrize("tp,needle", [("3", "TP=3 does not divide num_attention_heads=4"),
                                       ("4", "TP=4 does not divide num_query_groups=2")])
def test_tp_must_divide_heads_and_groups(dirs, tmp_path, tp, needle):
    _fails(["convert", "hf-to-mcore", "--hf", str(dirs / "llama"), "--out", str(tmp_path / "o"), "--tp", tp], needle)
    assert not (tmp_path / "o").exists()


def test_missing_shard_is_named(dirs, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(dirs / "sharded", broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[-1]
    (broken / gone).unlink()
    _fails(["convert", "hf-to-mcore", "--hf", str(broken), "--out", str(tmp_path / "o")], gone, "do not exist")


def test_missing_tensor_is_named(dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    partial = tmp_path / "partial"
    shutil.copytree(dirs / "llama", partial)
    tensors = load_file(str(partial / "model.safetensors"))
    del tensors["model.layers.2.mlp.down_proj.weight"]
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    _fails(["convert", "hf-to-mcore", "--hf", str(partial), "--out", str(tmp_path / "o")],
           "model.layers.2.mlp.down_proj.weight")


def test_unmapped_tensor_is_not_dropped_silently(dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    extra = tmp_path / "extra"
    shutil.copytree(dirs / "llama", extra)
    tensors = load_file(str(extra / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.bias"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(extra / "model.safetensors"), metadata={"format": "pt"})
    _fails(["convert", "hf-to-mcore", "--hf", str(extra), "--out", str(tmp_path / "o")], "o_proj.bias", "refusing")


def test_quantized_dtype_in_config_is_refused(dirs, tmp_path):
    q = tmp_path / "q"
    shutil.copytree(dirs / "llama", q)
    cfg = json.loads((q / "config.json").read_text())
    cfg["dtype"] = "float8_e4m3fn"
    (q / "config.json").write_text(json.dumps(cfg))
    _fails(["convert", "hf-to-mcore", "--hf", str(q), "--out", str(tmp_path / "o")], "float8_e4m3fn")


def test_existing_output_is_refused_without_overwrite(dirs, tmp_path):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep").write_text("x")
    _fails(["convert", "hf-to-mcore", "--hf", str(dirs / "llama"), "--out", str(tmp_path / "o")], "--overwrite")
    _fails(["convert", "mcore-to-hf", "--mcore", str(tmp_path / "o"), "--out", str(tmp_path / "o")],
           "not a Megatron-Core distributed checkpoint")
    assert (tmp_path / "o" / "keep").read_text() == "x"


def test_unknown_dtype_is_an_argument_error(dirs, tmp_path):
    rc, _, err = run_cli(["convert", "hf-to-mcore", "--hf", str(dirs / "llama"), "--out", str(tmp_path / "o"),
                       "--dtype", "int8"])
    assert rc == 2 and "invalid choice: 'int8'" in err


def test_missing_hf_dir_and_config(tmp_path):
    _fails(["convert", "hf-to-mcore", "--hf", str(tmp_path / "nope"), "--out", str(tmp_path / "o")], "not a directory")
    (tmp_path / "empty").mkdir()
    _fails(["convert", "hf-to-mcore", "--hf", str(tmp_path / "empty"), "--out", str(tmp_path / "o")], "no config.json")


def test_verify_refuses_a_directory_that_is_no_checkpoint(dirs, tmp_path):
    _fails(["convert", "verify", "--hf", str(dirs / "llama"), "--mcore", str(tmp_path)],
           "not a Megatron-Core distributed checkpoint")
