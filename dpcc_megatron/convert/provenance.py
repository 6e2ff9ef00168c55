"""Where a checkpoint's model came from, carried into every training checkpoint so exports are usable.

A run that starts from a converted checkpoint (``checkpoint.load``) inherits what
``hf-to-mcore`` kept of the source model: ``hf_config.json`` (its config.json, verbatim) and
``tokenizer/`` (tokenizer files and generation_config.json). The trainer copies both into each
of its checkpoints and records the chain in ``trainer_state.json`` (``source``), so
``mcore-to-hf`` / ``mcore-to-nemo`` of any training checkpoint write the source model's
config.json fields, tokenizer and generation_config.json back out. A run that starts from a
training checkpoint passes on what that one carries; a run whose ``data.tokenizer`` is a local
directory carries that tokenizer when the source has none.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from .mcore_format import HF_CONFIG_FILE, TOKENIZER_DIR, read_checkpoint_info


def _source_dir(load: str) -> Optional[Path]:
    from .mcore_format import resolve_checkpoint_dir
    from .nemo_format import is_nemo2_dir

    if is_nemo2_dir(load):
        return None
    try:
        return resolve_checkpoint_dir(load)
    except Exception:  # noqa: BLE001 - the load itself reports a bad path
        return None


def carried_from(load: Optional[str], tokenizer: Optional[str] = None) -> tuple[dict, dict[str, Path]]:
    """(provenance, files) for a run started from ``load`` (``checkpoint.load``, or None for a random
    init) with ``tokenizer`` (``data.tokenizer``): ``files`` maps a name inside the training checkpoint
    (``hf_config.json``, ``tokenizer``) to the file or directory to copy there."""
    files: dict[str, Path] = {}
    source: dict = {"checkpoint_load": load}
    src = _source_dir(load) if load else None
    if load and src is None:
        from .nemo_format import is_nemo2_dir

        source["type"] = "nemo2" if is_nemo2_dir(load) else "unknown"
    if src is not None:
        state = src / "trainer_state.json"
        if state.is_file():  # a training checkpoint: its own source passes on
            try:
                source["from"] = json.loads(state.read_text()).get("source")
            except (OSError, json.JSONDecodeError):
                source["from"] = None
            source["type"] = "training_checkpoint"
        else:
            info = read_checkpoint_info(src)
            source.update(info.get("source") or {})
        for name in (HF_CONFIG_FILE, TOKENIZER_DIR):
            if (src / name).exists():
                files[name] = src / name
    if TOKENIZER_DIR not in files and tokenizer and Path(tokenizer).is_dir():
        files[TOKENIZER_DIR] = Path(tokenizer)
        source["tokenizer"] = str(Path(tokenizer).resolve())
    return source, files


def copy_carried(files: dict[str, Path], dst: Path) -> None:
    """Copy ``files`` (from :func:`carried_from`) into the checkpoint directory ``dst``; only the tokenizer's
    known files are taken from a tokenizer directory (it may be a whole model directory)."""
    import shutil

    from .hf_files import copy_tokenizer_files

    for name, src in files.items():
        if name == TOKENIZER_DIR:
            copy_tokenizer_files(src, dst / TOKENIZER_DIR)
        else:
            shutil.copy2(src, dst / name)
