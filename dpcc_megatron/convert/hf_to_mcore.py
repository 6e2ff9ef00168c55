"""Hugging Face checkpoint -> Megatron-Core distributed checkpoint, holding about one layer at a time.

Two passes, because ``dist_checkpointing.save`` takes the whole sharded state dict at once:

1. *Stage*: unit by unit (embedding, each layer, final norm + head), read the HF tensors
   lazily, check and cast them, lay them out as Megatron does and write each one raw to a
   scratch file next to the output. Only the current unit is in memory.
2. *Save*: map every scratch file back with ``torch.from_file`` (file-backed, paged in on
   demand, evictable) and give them to ``dist_checkpointing.save`` as the data of the
   sharded state dict of a TP=1/PP=1 ``GPTModel`` built on the meta device. The layout
   (keys, global shapes, padded vocabulary, SwiGLU split) is therefore Megatron's own.
   Each mapped tensor owns its storage exactly, so Megatron's writer does not clone it, and
   the SwiGLU halves are staged separately for the same reason.

Disk: the scratch files need about the model's size in the target dtype, on the output's
filesystem; they are removed at the end.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Optional

import torch

from .errors import ConversionError
from .hf_config import architecture, check_layout, hf_dtype_name, model_config_from_hf
from .hf_files import HFCheckpoint, copy_tokenizer_files
from .layout import EMBED, OUTPUT, all_hf_shapes, hf_shapes, iter_hf_to_canonical, units
from .mcore_format import DTYPE_NAMES, DTYPES, HF_CONFIG_FILE, TOKENIZER_DIR, write_model_config
from .mcore_layout import meta_model
from .runtime import check_output_dir, single_process_megatron, staged_dir
from .staging import attach_staged, scratch_stager, staged_targets
from .tensors import checked_cast, pad_rows


def _check_names(hf: HFCheckpoint, cfg) -> None:
    required = {name for name, _ in all_hf_shapes(cfg)}
    present = hf.names()
    missing = sorted(required - present)
    if missing:
        raise ConversionError(f"{hf.path} lacks {len(missing)} tensor(s) the config implies, e.g. {missing[:5]}")
    extra = present - required - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    if extra:
        raise ConversionError(f"{hf.path} has {len(extra)} tensor(s) this converter does not map "
                              f"(refusing to drop them): {sorted(extra)[:5]}")


def _target_dtype(requested: Optional[str], hf: HFCheckpoint) -> str:
    if requested:
        return requested
    declared = hf_dtype_name(hf.config)
    if declared:
        return declared
    found = hf.get("model.embed_tokens.weight").dtype
    if found not in DTYPE_NAMES:
        raise ConversionError(f"the checkpoint stores {found}; pass --dtype fp32, bf16 or fp16")
    return DTYPE_NAMES[found]


def _reader(hf: HFCheckpoint, shapes: dict, target: torch.dtype) -> Callable[[str], torch.Tensor]:
    def get(name: str) -> torch.Tensor:
        t = hf.get(name)
        if tuple(t.shape) != shapes[name]:
            raise ConversionError(f"{name} has shape {tuple(t.shape)}, config.json implies {shapes[name]}")
        return checked_cast(t, target, name)

    return get


def hf_to_mcore(hf_dir: str | Path, out: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1, dtype: Optional[str] = None,
                overwrite: bool = False, progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """Convert; returns a summary. Raises ConversionError for any input it cannot convert exactly."""
    from megatron.core import dist_checkpointing
    from tqdm import tqdm

    out = Path(out)
    hf = HFCheckpoint(hf_dir)
    arch = architecture(hf.config)
    cfg, notes = model_config_from_hf(hf.config)
    for note in notes:
        log(f"note: {note}")
    check_layout(cfg, tp, pp, ep)
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    _check_names(hf, cfg)
    check_output_dir(out, overwrite)
    dtype_name = _target_dtype(dtype, hf)
    target = DTYPES[dtype_name]

    with single_process_megatron(), staged_dir(out, overwrite) as tmp:
        with scratch_stager(out) as stager:
            sharded = meta_model(cfg, target).sharded_state_dict()
            targets = staged_targets(sharded)
            for unit in tqdm(units(cfg), desc="hf-to-mcore", unit="unit", disable=not progress):
                for canon, blocks in iter_hf_to_canonical(cfg, unit, _reader(hf, hf_shapes(cfg, unit), target)):
                    kind, shape = targets[canon]
                    if kind == "swiglu":
                        for i, (block, part_shape) in enumerate(zip(blocks, shape)):
                            if tuple(block.shape) != part_shape:
                                raise ConversionError(f"{canon}: half {i} is {tuple(block.shape)}, "
                                                      f"Megatron expects {part_shape}")
                            stager.put(f"{canon}#{i}", block)
                        continue
                    (t,) = blocks
                    if canon in (EMBED, OUTPUT):
                        t = pad_rows(t, shape[0])
                    if tuple(t.shape) != shape:
                        raise ConversionError(f"{canon}: laid out as {tuple(t.shape)}, Megatron expects {shape}")
                    stager.put(canon, t)
                blocks = t = None  # nothing of this unit survives into the next
            log(f"writing the distributed checkpoint to {out} ...")
            dist_checkpointing.save(attach_staged(sharded, stager), str(tmp))
        write_model_config(tmp, cfg, dtype_name, source={"type": "huggingface", "architecture": arch,
                                                         "path": str(Path(hf_dir).resolve()),
                                                         "converted_for": {"tp": tp, "pp": pp, "ep": ep}})
        shutil.copy2(hf.path / "config.json", tmp / HF_CONFIG_FILE)
        copied = copy_tokenizer_files(hf.path, tmp / TOKENIZER_DIR)
    return {"out": str(out), "architecture": arch, "dtype": dtype_name, "layers": cfg.num_layers,
            "tokenizer_files": copied}
