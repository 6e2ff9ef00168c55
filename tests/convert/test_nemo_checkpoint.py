"""NeMo 2 checkpoints in and out, against the checkpoint NeMo 2.7.3 itself saved (tests/fixtures/nemo2):

- in: ``load_mcore_checkpoint`` (what ``checkpoint.load`` calls) reads it at TP=1, TP=2 and PP=2,
  and the Megatron forward equals NeMo's recorded forward within 1e-5; at PP=2 x VPP=2 every
  parameter equals the single-rank load; a model of another shape is refused with the
  differences listed;
- out: the policy loaded at TP=2 and saved by the trainer's writer, written back with
  ``convert mcore-to-nemo``, has NeMo's files, keys, shapes and dtypes, bit-identical tensors,
  and reads back with NeMo's logits.

All Megatron work runs in one 2-rank job and one 1-rank job (process start-ups are the cost).
"""
import json

import pytest
import torch
import yaml

from dpcc_megatron.testing import run_multirank

from .hf_models import resave, run_cli, try_loads, vpp_mismatches
from .nemo_helpers import LLAMA, LOGITS, read_dcp

pytestmark = pytest.mark.multirank

LAYOUTS = ((1, 1), (2, 1), (1, 2))


def _two_ranks(rank, world, tokens, trained, reshaped):
    import dataclasses

    from dpcc_megatron.config import ParallelConfig
    from dpcc_megatron.convert import read_model_config
    from dpcc_megatron.convert.verify import mcore_logits

    out = {f"tp{tp}pp{pp}": mcore_logits(LLAMA, tokens, tp, pp) for tp, pp in LAYOUTS}
    cfg = read_model_config(LLAMA)
    tp2 = ParallelConfig(tensor_model_parallel_size=2)
    attempts = {  # (checkpoint, config the model is built from, the job's model section)
        "wider": (LLAMA, dataclasses.replace(cfg, ffn_hidden_size=128), None),
        "job_section": (LLAMA, cfg, dataclasses.replace(cfg, ffn_hidden_size=128, tie_embeddings=False)),
        "reshaped": (reshaped, read_model_config(reshaped), None),  # model.yaml disagrees with weights/
    }
    out.update(try_loads(attempts, tp2))
    resave(LLAMA, cfg, tp2, trained, 4)  # the policy, as a TP=2 training checkpoint
    out["vpp"] = vpp_mismatches(cfg, LLAMA)
    return out


def _one_rank(rank, world, trained, written, tokens):
    from dpcc_megatron.convert.verify import mcore_logits

    rc, out, err = run_cli(["convert", "mcore-to-nemo", "--mcore", str(trained), "--out", str(written),
                            "--no-progress"])
    assert rc == 0, err
    rc2, _, err2 = run_cli(["convert", "mcore-to-nemo", "--mcore", str(trained), "--out", str(written)])
    return {"summary": json.loads(out), "refused_existing": (rc2, err2), "logits": mcore_logits(written, tokens, 1, 1)}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    import shutil

    root = tmp_path_factory.mktemp("nemo2")
    ref = torch.load(LOGITS)
    reshaped = root / "reshaped"
    shutil.copytree(LLAMA, reshaped)
    doc = yaml.safe_load((reshaped / "context" / "model.yaml").read_text())
    doc["config"]["ffn_hidden_size"] = 64
    (reshaped / "context" / "model.yaml").write_text(yaml.safe_dump(doc))
    out = run_multirank(_two_ranks, 2, args=(ref["tokens"], root / "trained", reshaped), timeout=600)
    written = root / "written"
    back = run_multirank(_one_rank, 1, args=(root / "trained", written, ref["tokens"]), timeout=600)[0]
    return {"ref": ref, "ranks": out, "back": back, "written": written}


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_logits_equal_nemos_forward(work, tp, pp):
    ref = work["ref"]["logits"]
    # mcore_logits returns the logits on the rank holding the last stage's TP rank 0.
    got = [r[f"tp{tp}pp{pp}"] for r in work["ranks"] if r[f"tp{tp}pp{pp}"] is not None]
    assert len(got) == 1 and got[0].shape == ref.shape
    assert float((got[0] - ref).abs().max()) <= 1e-5
    assert float(ref.abs().max()) > 1.0  # the fixture's logits are far from flat


def test_a_model_of_another_shape_is_refused_with_the_differences(work):
    for r in work["ranks"]:
        assert "ffn_hidden_size: checkpoint has 96, the model has 128" in r["wider"]
        # The stored tensor that does not fit, by its NeMo key.
        assert "module.decoder.layers.mlp.linear_fc2.weight: checkpoint shape (4, 64, 96), model (4, 64, 128)" \
            in r["wider"]
        assert "ffn_hidden_size: checkpoint has 96, the model has 128" in r["job_section"]
        assert "tie_embeddings: checkpoint has True, the model has False" in r["job_section"]
        # model.yaml and weights/ disagree: the config alone passes, the weights do not fit it.
        assert "ffn_hidden_size" not in r["reshaped"]
        assert "linear_fc2.weight: checkpoint shape (4, 64, 96), model (4, 64, 64)" in r["reshaped"]


def test_pp2_vpp2_load_equals_the_single_rank_load(work):
    assert [r["vpp"] for r in work["ranks"]] == [[], []]


def test_written_checkpoint_has_nemos_layout_and_equal_tensors(work):
    written = work["written"]
    names = lambda d: sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())  # noqa: E731
    assert names(written) == names(LLAMA)  # context/io.json, context/model.yaml, weights/ (same shard files)
    assert json.loads((written / "weights" / "metadata.json").read_text()) == \
        json.loads((LLAMA / "weights" / "metadata.json").read_text())
    ours, theirs = read_dcp(written / "weights"), read_dcp(LLAMA / "weights")
    assert sorted(ours) == sorted(theirs)
    tensors = [k for k, v in theirs.items() if isinstance(v, torch.Tensor)]
    assert len(tensors) == 8 and all(k.startswith("module.") for k in tensors)
    for key in tensors:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    common = torch.load(written / "weights" / "common.pt", weights_only=False)
    assert common["content_metadata"] == torch.load(LLAMA / "weights" / "common.pt",
                                                    weights_only=False)["content_metadata"]
    assert work["back"]["summary"]["config_class"] == "nemo.collections.llm.gpt.model.llama.Llama31Config"
    rc, err = work["back"]["refused_existing"]
    assert rc == 1 and "already exists" in err


def test_written_checkpoint_reads_back_with_nemos_logits(work):
    got, ref = work["back"]["logits"], work["ref"]["logits"]
    assert got.shape == ref.shape and float((got - ref).abs().max()) <= 1e-5
