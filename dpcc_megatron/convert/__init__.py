"""Hugging Face <-> Megatron-Core checkpoint conversion (Llama 2/3/3.1, Qwen2/2.5, Mistral), and
NeMo 2 checkpoints in (loaded directly) and out (``mcore_to_nemo``).

For the trainer:

    from dpcc_megatron.convert import load_mcore_checkpoint, read_model_config
    cfg.model = read_model_config(ckpt_dir)            # the architecture the weights were written for
    load_mcore_checkpoint(chunks, ckpt_dir, cfg.model) # collective; any TP/PP/VPP

``ckpt_dir`` may also be a NeMo 2 checkpoint (``context/model.yaml`` + ``weights/``).

The checkpoint directory format is described in :mod:`.mcore_format`. Heavy imports
(torch, megatron, transformers) happen inside the functions.
"""
from .errors import ConversionError


def load_mcore_checkpoint(chunks, ckpt_dir, model_cfg=None):
    from .mcore_load import load_mcore_checkpoint as _load

    return _load(chunks, ckpt_dir, model_cfg)


def read_model_config(ckpt_dir):
    from .mcore_format import read_model_config as _read

    return _read(ckpt_dir)


def hf_to_mcore(hf_dir, out, **kwargs):
    from .hf_to_mcore import hf_to_mcore as _convert

    return _convert(hf_dir, out, **kwargs)


def mcore_to_hf(mcore_dir, out, **kwargs):
    from .mcore_to_hf import mcore_to_hf as _convert

    return _convert(mcore_dir, out, **kwargs)


def mcore_to_nemo(mcore_dir, out, **kwargs):
    from .mcore_to_nemo import mcore_to_nemo as _convert

    return _convert(mcore_dir, out, **kwargs)


__all__ = ["ConversionError", "hf_to_mcore", "load_mcore_checkpoint", "mcore_to_hf", "mcore_to_nemo",
           "read_model_config"]
