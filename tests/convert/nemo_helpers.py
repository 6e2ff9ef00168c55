"""Shared by the NeMo 2 tests: the committed NeMo-made fixture and ways to read checkpoints raw."""
from __future__ import annotations

import json
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nemo2"
LLAMA = FIXTURES / "llama"            # saved by NeMo 2.7.3 (tests/fixtures/nemo2/make_fixture.py)
LOGITS = FIXTURES / "llama_logits.pt"  # NeMo's forward of it: {"tokens", "logits"}
CONFIGS = FIXTURES / "configs"         # NeMo's model.yaml of tiny Qwen2 / Mistral models


def read_dcp(path: Path) -> dict:
    """Every entry of a torch_dist checkpoint directory, read whole (no process group needed)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    out: dict = {}
    _load_state_dict(out, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return out


def config_paths(io_json: Path) -> dict[str, str]:
    """io.json's fiddle objects that sit at a ``<root>...`` path: path -> class (module.name)."""
    objects = json.loads(io_json.read_text())["objects"]
    out = {}
    for obj in objects.values():
        for p in obj.get("paths", []):
            meta = obj.get("metadata")
            cls = obj["type"]["name"]
            if isinstance(meta, dict) and meta.get("type") == "ref":
                fn = dict(objects[meta["key"]]["items"])["Attr(name='fn_or_cls')"]
                cls = f"{fn['module']}.{fn['name']}"
            out[p] = cls
    return out


def redraw(module: torch.nn.Module, seed: int) -> None:
    """Weights far from initialisation (norms around 1), so logits are not nearly flat."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            base = 1.0 if ("norm" in name) else 0.0
            p.copy_(base + (0.1 if base else 0.15) * torch.randn(p.shape, generator=g))
