"""What a torch_dist (Megatron-Core ``dist_checkpointing``) directory stores, read from its metadata
alone: shared by the converted/training checkpoint format (:mod:`.mcore_format`) and the NeMo 2
format (:mod:`.nemo_format`), which imports nothing else of the former."""
from __future__ import annotations

from pathlib import Path

import torch


def stored_entries(path: Path) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], set[str]]:
    """Tensor keys (global shape, dtype) and object keys stored in a torch_dist checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(path)).read_metadata()
    tensors, objects = {}, set()
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            tensors[key] = (tuple(meta.size), meta.properties.dtype)
        else:
            objects.add(key)
    return tensors, objects
