"""The converted checkpoint directory: its files, its model config, what its tensors are.

Layout of a directory written by ``convert hf-to-mcore``::

    metadata.json, common.pt, .metadata, __0_*.distcp
                        a Megatron-Core ``dist_checkpointing`` checkpoint (torch_dist) of
                        ``GPTModel.sharded_state_dict()`` (default sharding metadata), saved from
                        the TP=1/PP=1 layout; dist_checkpointing reshards it on load
    dpcc_model.yaml     format tag, the ModelConfig (``model:``), the stored dtype, the source
    hf_config.json      the source config.json, verbatim (mcore-to-hf writes it back)
    tokenizer/          the source tokenizer files, when it had any

Training checkpoints (``iter_*/`` written by the trainer, or their root holding ``latest``)
are read the same way: their model tensors have the same keys, and their
``trainer_state.json`` holds the ModelConfig.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from ..config import ConfigError, ModelConfig, from_dict, to_dict
from ..config.base import run_validate
from .errors import ConversionError
from .nemo_format import is_nemo2_dir, read_nemo_checkpoint
from .stored import stored_entries

FORMAT = "dpcc-mcore/1"
MODEL_FILE = "dpcc_model.yaml"
HF_CONFIG_FILE = "hf_config.json"
TOKENIZER_DIR = "tokenizer"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """``path`` itself, or the checkpoint its ``latest`` pointer names (a training checkpoint root)."""
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"checkpoint directory {path} does not exist")
    pointer = path / "latest"
    if not (path / "metadata.json").is_file() and pointer.is_file():
        path = path / pointer.read_text().strip()
    if not (path / "metadata.json").is_file():
        raise ConversionError(f"{path} is not a Megatron-Core distributed checkpoint (no metadata.json)")
    return path


def write_model_config(out: Path, cfg: ModelConfig, dtype: str, source: Optional[dict] = None) -> None:
    import yaml

    doc = {"format": FORMAT, "dtype": dtype, "source": source or {}, "model": to_dict(cfg)}
    (out / MODEL_FILE).write_text(yaml.safe_dump(doc, sort_keys=False))


def read_model_config(ckpt_dir: str | Path) -> ModelConfig:
    """The ModelConfig a checkpoint was written for (dpcc_model.yaml, a training checkpoint's
    trainer_state.json, or a NeMo 2 checkpoint's context/model.yaml)."""
    import yaml

    if is_nemo2_dir(ckpt_dir):
        return read_nemo_checkpoint(ckpt_dir)[0]
    path = resolve_checkpoint_dir(ckpt_dir)
    if (path / MODEL_FILE).is_file():
        try:
            doc = yaml.safe_load((path / MODEL_FILE).read_text())
        except yaml.YAMLError as e:
            raise ConversionError(f"{path / MODEL_FILE}: invalid YAML: {e}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ConversionError(f"{path / MODEL_FILE}: not a {FORMAT} file (format: "
                                  f"{doc.get('format') if isinstance(doc, dict) else None!r})")
        data, where = doc.get("model"), path / MODEL_FILE
    elif (path / "trainer_state.json").is_file():
        try:
            data = json.loads((path / "trainer_state.json").read_text()).get("model")
        except json.JSONDecodeError as e:
            raise ConversionError(f"{path / 'trainer_state.json'}: invalid JSON: {e}") from None
        where = path / "trainer_state.json"
    else:
        raise ConversionError(f"{path} has neither {MODEL_FILE} nor trainer_state.json: its model config is unknown")
    if not isinstance(data, dict):
        raise ConversionError(f"{where}: no model config section")
    # from_dict cannot coerce rope_scaling's bare `dict` type, so it is set after the rest.
    data = dict(data)
    rope = data.pop("rope_scaling", None)
    if rope is not None and not isinstance(rope, dict):
        raise ConversionError(f"{where}: model.rope_scaling must be a mapping, got {rope!r}")
    try:
        cfg = from_dict(ModelConfig, data, "model")
        cfg.rope_scaling = rope
        run_validate(cfg, "model")
    except ConfigError as e:
        raise ConversionError(f"{where}: {e}") from None
    return cfg


def read_checkpoint_info(ckpt_dir: Path) -> dict:
    import yaml

    f = resolve_checkpoint_dir(ckpt_dir) / MODEL_FILE
    return yaml.safe_load(f.read_text()) if f.is_file() else {}


def stored_dtype(path: Path, prefix: str = "") -> torch.dtype:
    """The embedding's dtype in the torch_dist checkpoint ``path`` (keys behind ``prefix``)."""
    tensors, _ = stored_entries(path)
    key = prefix + "embedding.word_embeddings.weight"
    if key not in tensors:
        raise ConversionError(f"{path} holds no {key}: not a GPT model checkpoint")
    return tensors[key][1]


def output_dtype(path: Path, requested: Optional[str], prefix: str = "") -> tuple[str, torch.dtype]:
    """(name, dtype) a converter writes: ``requested``, else the dtype the checkpoint stores."""
    source = stored_dtype(path, prefix)
    if requested is None and source not in DTYPE_NAMES:
        raise ConversionError(f"the checkpoint stores {source}; pass --dtype fp32, bf16 or fp16")
    name = requested or DTYPE_NAMES[source]
    return name, DTYPES[name]
