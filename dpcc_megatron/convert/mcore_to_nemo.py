"""Megatron-Core checkpoint (converted or trained policy) -> NeMo 2 checkpoint, holding one unit at a time.

The output is what NeMo 2's own trainer writes (see :mod:`.nemo_format`): ``weights/`` is the
sharded state dict of a TP=1/PP=1 ``GPTModel`` taken with ``prefix="module."``, whose
vocabulary is exactly ``vocab_size`` rows (NeMo does not pad a vocabulary its config sets),
with Lightning's counters in common.pt; ``context/`` holds model.yaml and io.json, written
here without NeMo. NeMo rebuilds the model with ``nemo.lightning.io.load_context`` and loads
the weights with its strategy's restore at any TP/PP.

Like hf-to-mcore, the tensors are staged one unit at a time (see :mod:`.staging`) and saved
in one ``dist_checkpointing.save``.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Optional

import torch

from .errors import ConversionError
from .hf_files import has_tokenizer
from .layout import EMBED, OUTPUT, units
from .mcore_format import DTYPES, output_dtype, read_model_config, resolve_checkpoint_dir
from .mcore_layout import iter_checkpoint_units, meta_model
from .nemo_format import (COMMON_STATE, CONTEXT_DIR, IO_JSON, MODEL_YAML, PREFIX, TOKENIZER_SUBDIR, WEIGHTS_DIR,
                          io_json, model_yaml, nemo_config_args, nemo_key)
from .runtime import check_output_dir, single_process_megatron, staged_dir
from .staging import attach_staged, scratch_stager, staged_targets
from .tensors import checked_cast


def mcore_to_nemo(mcore_dir: str | Path, out: str | Path, *, dtype: Optional[str] = None, overwrite: bool = False,
                  progress: bool = True, log: Callable[[str], None] = print, hf_config: Optional[str | Path] = None,
                  tokenizer: Optional[str | Path] = None) -> dict:
    """Convert; returns a summary. Raises ConversionError for anything it cannot write exactly.

    The source model's files the checkpoint carries (or ``hf_config`` / ``tokenizer`` name) go to
    ``context/nemo_tokenizer/`` (tokenizer files, generation_config.json, config.json), where NeMo's
    own HF import keeps its tokenizer; when there is a tokenizer, ``io.json`` and ``model.yaml``
    name it as NeMo's importers do (the model's ``tokenizer`` is NeMo's ``AutoTokenizer`` of
    ``nemo_tokenizer``, relative to ``context/``), so ``load_context`` builds the model with it."""
    from megatron.core import dist_checkpointing
    from tqdm import tqdm

    out = Path(out)
    path = resolve_checkpoint_dir(mcore_dir)
    cfg = read_model_config(path)
    family, config_class, _ = nemo_config_args(cfg)  # refuses what NeMo's model classes cannot express
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_output_dir(out, overwrite)

    with single_process_megatron():
        dtype_name, target = output_dtype(path, dtype)
        # The NeMo model's vocabulary is vocab_size rows: Megatron's padding (rows that never count)
        # is dropped, as NeMo itself does not pad a vocabulary its config sets.
        unpadded = dataclasses.replace(cfg, make_vocab_size_divisible_by=1)
        with staged_dir(out, overwrite) as tmp, scratch_stager(out) as stager:
            sharded = meta_model(unpadded, target).sharded_state_dict(prefix=PREFIX)
            targets = staged_targets(sharded, PREFIX)
            for unit, can in tqdm(iter_checkpoint_units(path, cfg), total=len(units(cfg)), desc="mcore-to-nemo",
                                  unit="unit", disable=not progress):
                for canon, t in can.items():
                    if canon not in targets:
                        raise ConversionError(f"{canon}: in the checkpoint but not in the NeMo model")
                    kind, shape = targets.pop(canon)
                    t = checked_cast(t, target, canon)
                    if canon in (EMBED, OUTPUT):
                        t = t[: cfg.vocab_size]
                    blocks = torch.chunk(t, 2, dim=-2) if kind == "swiglu" else (t,)
                    for i, (block, want) in enumerate(zip(blocks, shape if kind == "swiglu" else [shape])):
                        if tuple(block.shape) != want:
                            raise ConversionError(f"{canon}: the checkpoint gives {tuple(block.shape)}, "
                                                  f"the NeMo model expects {want}")
                        stager.put(f"{canon}#{i}" if kind == "swiglu" else canon, block)
                del can
            if targets:
                raise ConversionError(f"the checkpoint lacks {sorted(targets)[:5]}")
            log(f"writing the NeMo 2 checkpoint to {out} ...")
            (tmp / WEIGHTS_DIR).mkdir()
            state = attach_staged(sharded, stager, PREFIX)
            moe = cfg.num_moe_experts is not None
            for sh in state.values():  # an MoE layer's norm under the name NeMo's TE model gives it
                for piece in sh if isinstance(sh, list) else [sh]:
                    if hasattr(piece, "key"):
                        piece.key = nemo_key(piece.key, moe)
            dist_checkpointing.save({"state_dict": state, **COMMON_STATE}, str(tmp / WEIGHTS_DIR))
            (tmp / CONTEXT_DIR).mkdir()
            copied, missing = _source_files(path, tmp / CONTEXT_DIR / TOKENIZER_SUBDIR, cfg, hf_config, tokenizer)
            with_tokenizer = has_tokenizer(copied)
            (tmp / CONTEXT_DIR / MODEL_YAML).write_text(model_yaml(cfg, with_tokenizer, dtype_name))
            (tmp / CONTEXT_DIR / IO_JSON).write_text(io_json(cfg, with_tokenizer, dtype_name))
    for line in missing:
        log(f"missing: {line}")
    return {"out": str(out), "model": family, "config_class": ".".join(config_class), "dtype": dtype_name,
            "layers": cfg.num_layers, "vocab_size": cfg.vocab_size, "tokenizer_files": copied,
            "tokenizer": f"{CONTEXT_DIR}/{TOKENIZER_SUBDIR}" if with_tokenizer else None, "missing": missing}


def _source_files(path: Path, dst: Path, cfg, hf_config, tokenizer) -> tuple[list[str], list[str]]:
    """Copy the source model's tokenizer files, generation_config.json and config.json into ``dst``;
    returns (names copied, what is missing)."""
    import shutil

    from .hf_files import copy_tokenizer_files, missing_export_files
    from .mcore_format import HF_CONFIG_FILE, TOKENIZER_DIR

    tok = Path(tokenizer) if tokenizer else path / TOKENIZER_DIR
    if tokenizer and not tok.is_dir():
        raise ConversionError(f"--tokenizer {tok} is not a directory")
    copied = copy_tokenizer_files(tok, dst) if tok.is_dir() else []
    src = Path(hf_config) if hf_config else path / HF_CONFIG_FILE
    if hf_config and not src.is_file():
        raise ConversionError(f"--hf-config {src} is not a file")
    if src.is_file():
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / "config.json")
        copied.append("config.json")
    missing = missing_export_files(str(src) if src.is_file() else None, copied, cfg, [])
    if not src.is_file():  # NeMo's model config is model.yaml; only the HF config.json is missing here
        missing[0] = ("the source model's config.json (bos/eos token ids, max_position_embeddings): pass --hf-config "
                      "config.json of the model the run started from")
    return copied, missing
