"""Megatron-Core distributed checkpoint -> Hugging Face safetensors, one unit at a time.

Each unit (embedding, layer, final norm + head) is read with ``dist_checkpointing.load`` of
just its tensors, laid out as HF expects and streamed into pre-declared safetensors shards
(the shard headers are written first from the known shapes), so memory holds one unit.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import torch

from .errors import ConversionError
from .hf_config import architecture, hf_config_from_model, model_config_from_hf, with_dtype
from .hf_files import (SafetensorsStreamWriter, copy_tokenizer_files, fill_token_ids, missing_export_files,
                       plan_shards)
from .layout import all_hf_shapes, canonical_to_hf, hf_shapes, units
from .compat import architecture_of
from .mcore_format import (DTYPES, HF_CONFIG_FILE, TOKENIZER_DIR, output_dtype, read_checkpoint_info,
                           read_model_config, resolve_checkpoint_dir)
from .mcore_layout import iter_checkpoint_units
from .runtime import check_output_dir, single_process_megatron, staged_dir
from .tensors import checked_cast


def _hf_config(path: Path, cfg, dtype_name: str, hf_config: Optional[Path]) -> dict:
    src = hf_config or (path / HF_CONFIG_FILE)
    if hf_config is not None and not src.is_file():
        raise ConversionError(f"--hf-config {src} is not a file")
    if not src.is_file():
        return hf_config_from_model(cfg, dtype_name)
    try:
        original = json.loads(src.read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{src}: invalid JSON: {e}") from None
    mapped, _ = model_config_from_hf(original)
    want, have = architecture_of(cfg), architecture_of(mapped)
    # max_seq_len is not an architecture field; anything else differing means a stale config.json.
    diffs = [f"{k}: checkpoint {want[k]!r}, {src.name} {have[k]!r}" for k in want if want[k] != have[k]]
    if diffs:
        raise ConversionError(f"{src} does not describe this checkpoint:\n  " + "\n  ".join(diffs))
    return with_dtype(original, dtype_name)


def mcore_to_hf(mcore_dir: str | Path, out: str | Path, *, dtype: Optional[str] = None, overwrite: bool = False,
                max_shard_bytes: int = 4 << 30, hf_config: Optional[str | Path] = None,
                tokenizer: Optional[str | Path] = None, progress: bool = True,
                log: Callable[[str], None] = print) -> dict:
    """Convert; returns a summary. ``hf_config``/``tokenizer`` override what the checkpoint carries."""
    from tqdm import tqdm

    out = Path(out)
    path = resolve_checkpoint_dir(mcore_dir)
    cfg = read_model_config(path)
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_output_dir(out, overwrite)
    if max_shard_bytes <= 0:
        raise ConversionError(f"--max-shard-size must be > 0, got {max_shard_bytes}")

    with single_process_megatron():
        dtype_name, target = output_dtype(path, dtype)
        config = _hf_config(path, cfg, dtype_name, Path(hf_config) if hf_config else None)
        arch = architecture(config)

        entries = [(name, target, shape) for name, shape in all_hf_shapes(cfg)]
        shards = plan_shards(entries, max_shard_bytes)
        files = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        file_of = {e[0]: (i, files[i]) for i, shard in enumerate(shards) for e in shard}

        with staged_dir(out, overwrite) as tmp:
            writers: dict[int, SafetensorsStreamWriter] = {}
            try:
                for unit, can in tqdm(iter_checkpoint_units(path, cfg), total=len(units(cfg)),
                                      desc="mcore-to-hf", unit="unit", disable=not progress):
                    tensors = canonical_to_hf(cfg, unit, can)
                    del can
                    for name, shape in hf_shapes(cfg, unit).items():
                        i, file = file_of[name]
                        if i not in writers:
                            writers[i] = SafetensorsStreamWriter(tmp / file, shards[i])
                        t = checked_cast(tensors.pop(name), target, name)
                        if tuple(t.shape) != shape:
                            raise ConversionError(f"{name}: checkpoint gives {tuple(t.shape)}, expected {shape}")
                        writers[i].write(name, t)
                        if writers[i].done:
                            writers.pop(i).close()
            finally:
                for w in writers.values():
                    w.abort()
            if writers:
                raise ConversionError(f"shard(s) {sorted(writers)} were left incomplete")
            if len(shards) > 1:
                total = sum(torch.Size(shape).numel() * target.itemsize for _, _, shape in entries)
                index = {"metadata": {"total_size": total},
                         "weight_map": {name: file for name, (_, file) in file_of.items()}}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
            config["architectures"] = [arch]
            tok_src = Path(tokenizer) if tokenizer else path / TOKENIZER_DIR
            if tokenizer and not tok_src.is_dir():
                raise ConversionError(f"--tokenizer {tok_src} is not a directory")
            copied = copy_tokenizer_files(tok_src, tmp) if tok_src.is_dir() else []
            config_from = str(hf_config) if hf_config else (
                "the checkpoint's hf_config.json" if (path / HF_CONFIG_FILE).is_file() else None)
            filled = fill_token_ids(config, tmp) if config_from is None else []
            missing = missing_export_files(config_from, copied, cfg, filled)
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for line in missing:
        log(f"missing: {line}")
    info = read_checkpoint_info(path)
    return {"out": str(out), "architecture": arch, "dtype": dtype_name, "shards": len(shards),
            "tokenizer_files": copied, "config_from": config_from or "generated from the model config",
            "missing": missing, "source": info.get("source") or _training_source(path)}


def _training_source(path: Path) -> dict:
    """A training checkpoint's recorded source (trainer_state.json ``source``), or {}."""
    try:
        return json.loads((path / "trainer_state.json").read_text()).get("source") or {}
    except (OSError, json.JSONDecodeError):
        return {}
