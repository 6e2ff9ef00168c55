"""Hugging Face checkpoint files: lazy reads, streamed safetensors writes, tokenizer files.

Reads never load a whole shard: safetensors tensors come one at a time through
``safe_open``; ``.bin`` shards are opened with ``torch.load(weights_only=True, mmap=True)``
(never a full unpickle of untrusted data, and pages are read on access).
Writes stream too: a safetensors header can be written up front from the known shapes,
then each tensor's bytes in order, so a shard never has to be assembled in memory.
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Iterable, Optional

import torch

from .errors import ConversionError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
# Tensors in some HF checkpoints that are recomputed buffers, not weights.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class HFCheckpoint:
    """The weights of a Hugging Face model directory, read lazily tensor by tensor."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConversionError(f"{self.path} is not a directory")
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise ConversionError(f"{self.path} has no config.json")
        try:
            self.config = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise ConversionError(f"{cfg}: invalid JSON: {e}") from None
        self._bin_cache: dict[str, dict] = {}
        self.weight_map = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = self.path / index_name
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (json.JSONDecodeError, KeyError) as e:
                    raise ConversionError(f"{index}: not a valid checkpoint index ({e})") from None
                missing = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
                if missing:
                    raise ConversionError(f"{index} names shard file(s) that do not exist: {', '.join(missing)}")
                return weight_map
        for single in ("model.safetensors", "pytorch_model.bin"):
            if (self.path / single).is_file():
                return {name: single for name in self._names_in(single)}
        raise ConversionError(f"{self.path} has no model.safetensors, pytorch_model.bin or an index of shards")

    def _names_in(self, file: str) -> list[str]:
        if file.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(self.path / file, framework="pt") as f:
                return list(f.keys())
        return list(self._bin(file).keys())

    def _bin(self, file: str) -> dict:
        if file not in self._bin_cache:
            try:
                self._bin_cache[file] = torch.load(self.path / file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:
                # Pre-zipfile .bin files cannot be memory-mapped; they load whole (still weights_only).
                self._bin_cache[file] = torch.load(self.path / file, map_location="cpu", weights_only=True)
        return self._bin_cache[file]

    def names(self) -> set[str]:
        return {n for n in self.weight_map if not n.endswith(_IGNORED_SUFFIXES)}

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ConversionError(f"{self.path}: tensor {name} is missing from the checkpoint")
        file = self.weight_map[name]
        if file.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(self.path / file, framework="pt") as f:
                return f.get_tensor(name)
        t = self._bin(file)[name]
        return t.clone()  # detach from the mmap so callers can free it


def _align8(n: int) -> int:
    return (n + 7) // 8 * 8


class SafetensorsStreamWriter:
    """Write one safetensors file tensor by tensor, in a declared order, with a header written first."""

    def __init__(self, path: str | Path, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: Optional[dict[str, str]] = None):
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        self._order: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        offset = 0
        for name, dtype, shape in entries:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, dtype, tuple(shape)))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (_align8(len(raw)) - len(raw))
        self.path = Path(path)
        self.nbytes = offset
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want, dtype, shape = self._order[self._next]
        if name != want:
            raise RuntimeError(f"{self.path.name}: expected {want} next, got {name}")
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise RuntimeError(f"{name}: declared {dtype} {shape}, got {tensor.dtype} {tuple(tensor.shape)}")
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        self._f.write(memoryview(data.numpy()))
        self._next += 1

    @property
    def done(self) -> bool:
        return self._next == len(self._order)

    def abort(self) -> None:
        """Close without the completeness check (the caller is failing anyway)."""
        self._f.close()

    def close(self) -> None:
        self._f.close()
        if not self.done:
            raise RuntimeError(f"{self.path.name}: {len(self._order) - self._next} tensors were never written")


def plan_shards(entries: list[tuple[str, torch.dtype, tuple[int, ...]]], max_bytes: int) -> list[list]:
    """Split ordered entries into consecutive shards of at most ``max_bytes`` (a bigger tensor stands alone)."""
    shards: list[list] = [[]]
    size = 0
    for entry in entries:
        n = torch.Size(entry[2]).numel() * entry[1].itemsize
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    return shards


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def fill_token_ids(config: dict, out_dir: Path) -> list[str]:
    """Give a generated ``config`` the bos/eos token ids it lacks from ``out_dir``'s
    generation_config.json (copied with the tokenizer); returns the keys filled."""
    gen = out_dir / "generation_config.json"
    if not gen.is_file():
        return []
    try:
        values = json.loads(gen.read_text())
    except json.JSONDecodeError:
        return []
    filled = []
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is None and values.get(key) is not None:
            config[key] = values[key]
            filled.append(key)
    return filled


# Any of these makes a directory a tokenizer that transformers' AutoTokenizer can load.
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def has_tokenizer(copied: list[str]) -> bool:
    return any(name in copied for name in TOKENIZER_VOCAB_FILES)


def missing_export_files(config_from: Optional[str], copied: list[str], cfg, filled: list[str]) -> list[str]:
    """What an exported HF directory lacks that a user of it expects, one phrase each (empty: nothing).

    ``config_from``: where config.json came from (None: generated from the model config);
    ``copied``: the tokenizer files written; ``filled``: token-id keys a generated config took from
    generation_config.json."""
    missing = []
    if config_from is None:
        ids = "bos/eos token ids from generation_config.json" if filled else "no bos/eos token ids"
        missing.append(f"the source model's config.json: config.json was generated from the model config ({ids}, "
                       f"max_position_embeddings = model.max_seq_len = {cfg.max_seq_len}); pass --hf-config "
                       "config.json of the model the run started from")
    if not has_tokenizer(copied):
        missing.append("tokenizer files: pass --tokenizer DIR (the source model's or data.tokenizer's directory)")
    if "generation_config.json" not in copied:
        missing.append("generation_config.json (sampling defaults and the eos ids chat models stop on): put it in "
                       "the --tokenizer directory")
    return missing
