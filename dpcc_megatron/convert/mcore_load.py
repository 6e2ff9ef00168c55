"""Load a converted, training or NeMo 2 checkpoint into built model chunks: the trainer's entry point."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..config import ModelConfig
from .compat import architecture_diffs
from .errors import ConversionError
from .mcore_format import MODEL_FILE, read_model_config, resolve_checkpoint_dir
from .nemo_format import PREFIX as NEMO_PREFIX
from .nemo_format import is_nemo2_dir, read_nemo_checkpoint, stored_nemo_key
from .stored import stored_entries


def load_mcore_checkpoint(chunks: list, ckpt_dir: str | Path, model_cfg: Optional[ModelConfig] = None) -> None:
    """Load a converted, training or NeMo 2 checkpoint into already-built model chunks, at any TP/PP/VPP.

    Collective: every rank of the job calls it with its own chunks. dist_checkpointing reads
    each rank's slices and pads the vocabulary to the model's size. ``model_cfg``, when given,
    is compared with the checkpoint's config field by field; the built chunks always are.
    A NeMo 2 directory (``context/model.yaml`` + ``weights/``) is read from its ``weights/``,
    whose keys carry NeMo's ``module.`` prefix, with the config from ``context/model.yaml``.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    raw = [getattr(c, "module", c) for c in chunks]
    problems: list[str] = []
    if is_nemo2_dir(ckpt_dir):
        stored_cfg, path = read_nemo_checkpoint(ckpt_dir)
        prefix = NEMO_PREFIX
        problems += architecture_diffs(raw, stored_cfg, model_cfg)
    else:
        path, prefix = resolve_checkpoint_dir(ckpt_dir), ""
        if (path / MODEL_FILE).is_file() or (path / "trainer_state.json").is_file():
            problems += architecture_diffs(raw, read_model_config(path), model_cfg)
    tensors, objects = stored_entries(path)
    request = {}
    for i, chunk in enumerate(raw):
        part = {}
        for name, sh in chunk.sharded_state_dict(prefix=prefix).items():
            if isinstance(sh, ShardedObject):
                if sh.unique_key in objects:  # extra state is optional (e.g. local spec -> TE)
                    part[name] = sh
                continue
            if prefix == NEMO_PREFIX:
                sh.key = stored_nemo_key(sh.key, tensors)
            if sh.key not in tensors:
                problems.append(f"{sh.key} is not in the checkpoint")
            elif isinstance(sh, ShardedTensor) and not sh.allow_shape_mismatch and \
                    tuple(sh.global_shape) != tensors[sh.key][0]:
                problems.append(f"{sh.key}: checkpoint shape {tensors[sh.key][0]}, model {tuple(sh.global_shape)}")
            part[name] = sh
        request[f"model{i}"] = part
    problems = list(dict.fromkeys(problems))
    _agree(f"{path} does not fit the model:\n  " + "\n  ".join(problems[:20]) if problems else None)
    loaded = dist_checkpointing.load(request, str(path))
    for i, chunk in enumerate(raw):
        state = {name[len(prefix):]: value for name, value in loaded[f"model{i}"].items()}
        result = chunk.load_state_dict(state, strict=False)
        bad = [k for k in result.missing_keys if not k.endswith("_extra_state")] + list(result.unexpected_keys)
        if bad:
            raise ConversionError(f"{path}: state dict mismatch after loading: {bad[:10]}")


def _agree(problem: Optional[str]) -> None:
    """Raise on every rank if any rank found a problem: a rank that went on alone into the
    collective load would wait for the others until the timeout."""
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        on_gpu = dist.get_backend() == "nccl"
        flag = torch.tensor([1 if problem else 0], device=torch.cuda.current_device() if on_gpu else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not problem:
            problem = "another rank found the checkpoint incompatible with its model part (see its error)"
    if problem:
        raise ConversionError(problem)
