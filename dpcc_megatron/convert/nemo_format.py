"""NeMo 2 checkpoint directories: detection, ``context/model.yaml`` <-> ModelConfig, ``context/io.json``.

A NeMo 2 checkpoint (nemo-toolkit 2.x, ``nemo.collections.llm``) is a directory::

    context/io.json      the fiddle-serialised TrainerContext that ``nemo.lightning.io.load_context``
                         rebuilds (the model class and the constructor arguments given to its config)
    context/model.yaml   the same model with every config field written out (defaults included)
    weights/             a Megatron-Core dist_checkpointing checkpoint (torch_dist) of
                         ``GPTModel.sharded_state_dict(prefix="module.")``: the same stacked
                         ``[num_layers, ...]`` decoder tensors and TE-style norm names as ours,
                         behind a ``module.`` prefix; common.pt holds Lightning's counters

Everything here is yaml/json and dataclass work: nothing imports NeMo. The supported model
classes are NeMo's Llama (Llama 2/3/3.1/3.2 configs), Qwen2, Mistral, Qwen3 (dense and MoE
configs) and Mixtral; a config that asks for anything this project's Megatron model does not
compute exactly is refused, naming the ``config.<field>``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from ..config import ConfigError, ModelConfig
from ..config.base import run_validate
from .errors import ConversionError
from .hf_config import MEGATRON_LLAMA3_FIXED
from .stored import stored_entries

CONTEXT_DIR = "context"
WEIGHTS_DIR = "weights"
MODEL_YAML = "model.yaml"
IO_JSON = "io.json"
PREFIX = "module."  # NeMo's MegatronParallel saves the model's sharded state dict behind it
# NeMo's HF importers save the tokenizer to a directory of this name, which io_dump copies into
# context/ (a DirOrStringArtifact); io.json names it relative to context/ and load_context makes
# the path absolute before it builds nemo.collections.common.tokenizers AutoTokenizer from it.
TOKENIZER_SUBDIR = "nemo_tokenizer"
AUTO_TOKENIZER = ("nemo.collections.common.tokenizers.huggingface.auto_tokenizer", "AutoTokenizer")
# An MoE layer's pre-MLP norm has two checkpoint names: Megatron's local spec (this project's
# model, and NeMo where Transformer Engine is missing) stores it under the dense layer's fused
# name, the Transformer Engine spec (NeMo on GPUs, and NeMo's HF importers) under its own module.
_MOE_NORM_LOCAL = PREFIX + "decoder.layers.mlp.linear_fc1.layer_norm_"
_MOE_NORM_TE = PREFIX + "decoder.layers.pre_mlp_layernorm."
# The weights' dtype -> the config's precision fields (fp16, bf16, params_dtype), as NeMo's HF
# importers set them: NeMo builds the model in this dtype (MixtralConfig's default is bf16).
_PRECISION = {"fp32": (False, False, "float32"), "bf16": (False, True, "bfloat16"), "fp16": (True, False, "float16")}

_GPT = "nemo.collections.llm.gpt.model"
# NeMo model class (module, name) -> the family's base config class written by mcore-to-nemo.
MODELS = {
    (f"{_GPT}.llama", "LlamaModel"): "Llama",
    (f"{_GPT}.qwen2", "Qwen2Model"): "Qwen2",
    (f"{_GPT}.mistral", "MistralModel"): "Mistral",
    (f"{_GPT}.qwen3", "Qwen3Model"): "Qwen3",  # dense (Qwen3Config) and MoE (Qwen3MoEConfig)
    (f"{_GPT}.mixtral", "MixtralModel"): "Mixtral",
}
_CONFIG_CLASS = {"Llama": (f"{_GPT}.llama", "LlamaConfig"), "Llama31": (f"{_GPT}.llama", "Llama31Config"),
                 "Qwen2": (f"{_GPT}.qwen2", "Qwen2Config"), "Qwen3": (f"{_GPT}.qwen3", "Qwen3Config"),
                 "Qwen3MoE": (f"{_GPT}.qwen3", "Qwen3MoEConfig"), "Mixtral": (f"{_GPT}.mixtral", "MixtralConfig")}
_MODEL_CLASS = {family: key for key, family in MODELS.items()}
_ROPE_SCALING_FIELDS = {"low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
                        "old_context_len": "original_max_position_embeddings"}

# config.<field> -> the value this project's model computes; any other value is refused. A field
# missing from model.yaml has NeMo's GPTConfig default, which is this value.
_MUST_BE = {
    "multi_latent_attention": False, "qk_l2_norm": False,
    "rotary_percent": 1.0, "rotary_interleaved": False, "seq_len_interpolation_factor": None,
    "layernorm_zero_centered_gamma": False, "apply_residual_connection_post_layernorm": False,
    "softmax_scale": None, "softmax_type": "vanilla", "attention_output_gate": False, "mrope_section": None,
    "no_rope_freq": None, "mtp_num_layers": None, "heterogeneous_block_specs": False, "is_hybrid_model": False,
    "experimental_attention_variant": None, "apply_query_key_layer_scaling": False, "glu_linear_offset": 0.0,
    "activation_func_clamp_value": None, "use_kitchen": False,
    # Mixture of experts: a plain softmax top-k router over routed experts only, in every layer.
    "moe_shared_expert_intermediate_size": None, "moe_layer_freq": 1, "moe_router_score_function": "softmax",
    "moe_router_topk_scaling_factor": None, "moe_router_num_groups": None, "moe_router_group_topk": None,
    "moe_router_enable_expert_bias": False, "moe_input_jitter_eps": None, "moe_router_force_load_balancing": False,
    "moe_pad_expert_input_to_capacity": False, "moe_token_drop_policy": "probs", "moe_apply_probs_on_input": False,
    "moe_router_topk_limited_devices": None, "moe_latent_size": None, "moe_shared_expert_gate": False,
}
# NeMo's load-balancing types -> the model's: the aux-loss coefficient is read only with "aux_loss".
_BALANCING = ("aux_loss", "none")
_REQUIRED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "normalization",
             "layernorm_epsilon", "gated_linear_unit", "position_embedding_type", "rotary_base",
             "share_embeddings_and_output_weights", "seq_length")
_ACTIVATIONS = {True: "torch.nn.functional.silu", False: "torch.nn.functional.gelu"}


def is_nemo2_dir(path: str | Path) -> bool:
    """A directory holding ``context/model.yaml`` (and ``weights/``) is a NeMo 2 checkpoint. One
    without ``weights/`` is still taken for one, so that reading it names what is missing."""
    return (Path(path) / CONTEXT_DIR / MODEL_YAML).is_file()


def nemo_weights_dir(path: str | Path) -> Path:
    """``path/weights``, checked to be a dist_checkpointing (torch_dist) checkpoint."""
    weights = Path(path) / WEIGHTS_DIR
    if not weights.is_dir():
        raise ConversionError(f"{path} has {CONTEXT_DIR}/{MODEL_YAML} but no {WEIGHTS_DIR}/ directory: "
                              "an incomplete NeMo 2 checkpoint")
    meta = weights / "metadata.json"
    if not meta.is_file():
        raise ConversionError(f"{weights} is not a Megatron-Core distributed checkpoint (no metadata.json)")
    try:
        backend = json.loads(meta.read_text()).get("sharded_backend")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ConversionError(f"{meta}: invalid JSON: {e}") from None
    if backend != "torch_dist":
        raise ConversionError(f"{weights}: sharded_backend {backend!r}; only torch_dist NeMo checkpoints are read")
    if not (weights / ".metadata").is_file():
        raise ConversionError(f"{weights} has no .metadata: the checkpoint is incomplete")
    return weights


def _target(node: Any, where: str) -> tuple[str, str]:
    if not isinstance(node, dict) or not isinstance(node.get("_target_"), str) or "." not in node["_target_"]:
        raise ConversionError(f"{where}: no _target_ class")
    module, _, name = node["_target_"].rpartition(".")
    return module, name


def _load_yaml(path: Path) -> dict:
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConversionError(f"{path}: invalid YAML: {e}") from None
    except OSError as e:
        raise ConversionError(f"{path}: unreadable: {e}") from None
    if not isinstance(doc, dict):
        raise ConversionError(f"{path}: not a NeMo model.yaml (a mapping with _target_ and config)")
    return doc


def read_nemo_model_config(ckpt_dir: str | Path, stored_vocab_rows: Optional[int] = None) -> ModelConfig:
    """The ModelConfig of a NeMo 2 checkpoint, from ``context/model.yaml`` (no NeMo import).

    ``stored_vocab_rows`` is the embedding's row count in ``weights/``, used only when model.yaml
    leaves ``config.vocab_size`` null (NeMo then took the padded tokenizer size, which is what
    the weights hold)."""
    path = Path(ckpt_dir) / CONTEXT_DIR / MODEL_YAML
    doc = _load_yaml(path)
    module, name = _target(doc, str(path))
    if (module, name) not in MODELS:
        supported = ", ".join(f"{m}.{n}" for m, n in MODELS)
        raise ConversionError(f"{path}: _target_ {module}.{name} is not supported; supported: {supported}")
    c = doc.get("config")
    _target(c, f"{path}: config")
    where = f"{path}: config"

    def get(field: str, default: Any = ...) -> Any:
        if field in c:
            return c[field]
        if default is ...:
            raise ConversionError(f"{where}.{field} is missing")
        return default

    def number(field: str, kind: type, default: Any = ...) -> Any:
        value = get(field, default)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (kind is int and float(value) != int(value)):
            expected = "an integer" if kind is int else "a number"
            raise ConversionError(f"{where}.{field} is {value!r}; expected {expected}")
        return kind(value)

    def optional_int(field: str) -> Optional[int]:
        return None if get(field, None) is None else number(field, int)

    for field in _REQUIRED:
        get(field)
    for field, want in _MUST_BE.items():
        got = get(field, want)
        if got != want and not (isinstance(want, float) and isinstance(got, (int, float)) and float(got) == want):
            raise ConversionError(f"{where}.{field} is {got!r}; this project's Megatron model supports only "
                                  f"{want!r}")

    def one_of(field: str, allowed: tuple[str, ...]) -> str:
        value = get(field)
        if value not in allowed:
            raise ConversionError(f"{where}.{field} is {value!r}; supported: {', '.join(allowed)}")
        return value

    norm = one_of("normalization", ("RMSNorm", "LayerNorm"))
    gated = bool(get("gated_linear_unit"))
    act = get("activation_func", {"_target_": _ACTIVATIONS[gated]})
    act_name = act.get("_target_") if isinstance(act, dict) else act
    if act_name != _ACTIVATIONS[gated]:
        raise ConversionError(f"{where}.activation_func is {act_name!r}; with gated_linear_unit={gated} "
                              f"this project's model uses {_ACTIVATIONS[gated]}")
    pos = one_of("position_embedding_type", ("rope", "learned_absolute"))
    max_seq = number("seq_length", int)
    window = get("window_size", None)
    if window is not None:
        if not (isinstance(window, (list, tuple)) and len(window) == 2 and window[1] == 0 and int(window[0]) > 0):
            raise ConversionError(f"{where}.window_size is {window!r}; only a left-only sliding window "
                                  "[W, 0] (read as full attention up to W tokens) or null is supported")
        # Full attention equals a window of W for sequences of at most W tokens.
        max_seq = min(max_seq, int(window[0]))
    rotary_base = number("rotary_base", float)
    if not rotary_base.is_integer():
        raise ConversionError(f"{where}.rotary_base is {rotary_base}; Megatron-Core's builder needs a whole number")
    vocab = optional_int("vocab_size")
    if vocab is None:
        if stored_vocab_rows is None:
            raise ConversionError(f"{where}.vocab_size is null (NeMo took it from the tokenizer) and the weights "
                                  "were not read to find it")
        vocab = stored_vocab_rows
    cfg = ModelConfig(
        num_layers=number("num_layers", int), hidden_size=number("hidden_size", int),
        ffn_hidden_size=number("ffn_hidden_size", int), num_attention_heads=number("num_attention_heads", int),
        num_query_groups=optional_int("num_query_groups"), kv_channels=optional_int("kv_channels"),
        vocab_size=vocab, make_vocab_size_divisible_by=number("make_vocab_size_divisible_by", int, 128),
        max_seq_len=max_seq, normalization=norm, norm_epsilon=number("layernorm_epsilon", float), swiglu=gated,
        add_qkv_bias=bool(get("add_qkv_bias", False)), add_bias_linear=bool(get("add_bias_linear", False)),
        position_embedding_type=pos, rotary_base=rotary_base, rope_scaling=_rope_scaling(c, where),
        tie_embeddings=bool(get("share_embeddings_and_output_weights")),
        init_method_std=number("init_method_std", float, 0.02), qk_layernorm=bool(get("qk_layernorm", False)),
        **_moe_fields(get, number, optional_int, where))
    try:
        run_validate(cfg, "model")
    except ConfigError as e:
        raise ConversionError(f"{where} maps to an invalid model config: {e}") from None
    return cfg


def _moe_fields(get, number, optional_int, where: str) -> dict:
    """The ModelConfig MoE fields of a config with ``num_moe_experts`` (none for a dense one).
    The router's load-balancing and z-loss coefficients are training settings: they are read so
    that a model written back carries them, and do not change the forward."""
    experts = optional_int("num_moe_experts")
    if experts is None:
        return {}
    balancing = get("moe_router_load_balancing_type", "aux_loss")
    if balancing not in _BALANCING:
        raise ConversionError(f"{where}.moe_router_load_balancing_type is {balancing!r}; supported: "
                              f"{', '.join(_BALANCING)}")
    capacity = get("moe_expert_capacity_factor", None)
    return {"num_moe_experts": experts, "moe_router_topk": number("moe_router_topk", int, 2),
            "moe_ffn_hidden_size": optional_int("moe_ffn_hidden_size"),
            "moe_router_pre_softmax": bool(get("moe_router_pre_softmax", False)),
            "moe_aux_loss_coeff": number("moe_aux_loss_coeff", float, 0.0) if balancing == "aux_loss" else 0.0,
            "moe_z_loss_coeff": 0.0 if get("moe_z_loss_coeff", None) is None else number("moe_z_loss_coeff", float),
            "moe_expert_capacity_factor": None if capacity is None else number("moe_expert_capacity_factor", float)}


def _rope_scaling(c: dict, where: str) -> Optional[dict]:
    """NeMo's Llama 3.1/3.2 configs (Llama31Config and subclasses) carry ``scale_factor`` and apply
    llama3 rope scaling in ``configure_model``; Megatron-Core's own llama3 scaling is the same
    function with its frequency bands fixed, so only those bands are accepted."""
    if "scale_factor" not in c:
        return None
    out = {"rope_type": "llama3", "factor": float(c["scale_factor"])}
    for field, key in _ROPE_SCALING_FIELDS.items():
        value = float(c.get(field, MEGATRON_LLAMA3_FIXED[key]))
        if value != MEGATRON_LLAMA3_FIXED[key]:
            raise ConversionError(f"{where}.{field} is {value:g}; Megatron-Core's llama3 rope scaling hard-codes "
                                  f"{MEGATRON_LLAMA3_FIXED[key]:g}")
        out[key] = int(value) if key == "original_max_position_embeddings" else value
    return out


# ----------------------------------------------------------------------------------------------
# Writing: ModelConfig -> the NeMo config arguments, model.yaml and io.json


class PyRef(tuple):
    """A reference to a Python object by (module, name), as a config value (e.g. ``torch.float32``)."""


def nemo_config_args(cfg: ModelConfig, dtype: str = "fp32") -> tuple[str, tuple[str, str], dict]:
    """(family, config class, constructor arguments) that make NeMo build ``cfg``'s model, with
    its parameters in ``dtype`` (the dtype of the weights written).

    Qwen3 (Qwen3Config, or Qwen3MoEConfig with experts) when the model has QK layernorm; else
    Mixtral when it has experts; else Qwen2 when it has a QKV bias; else Llama (Llama31Config
    when rope scaling is on). A Mistral model without sliding window is a Llama model, so it is
    written as one. The fusions (and the MoE configs' grouped GEMM) keep NeMo's defaults (on;
    they need Transformer Engine): they change no math."""
    if cfg.normalization != "RMSNorm" or not cfg.swiglu or cfg.add_bias_linear or cfg.position_embedding_type != "rope":
        raise ConversionError("only RMSNorm + SwiGLU + RoPE models without linear biases (Llama, Qwen2, Mistral, "
                              "Qwen3, Qwen3-MoE, Mixtral) are written as NeMo checkpoints")
    moe = cfg.num_moe_experts is not None
    if cfg.add_qkv_bias and (moe or cfg.qk_layernorm):
        field = "num_moe_experts" if moe else "qk_layernorm"
        raise ConversionError(f"add_qkv_bias with {field}={getattr(cfg, field)}: no NeMo 2 model class has both "
                              "(Qwen2 has the QKV bias, Qwen3 and Mixtral do not)")
    heads = cfg.num_attention_heads
    args = {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "ffn_hidden_size": cfg.ffn_hidden_size or 4 * cfg.hidden_size, "num_attention_heads": heads,
            "num_query_groups": cfg.num_query_groups or heads,
            "kv_channels": cfg.kv_channels or cfg.hidden_size // heads, "vocab_size": cfg.vocab_size,
            "make_vocab_size_divisible_by": cfg.make_vocab_size_divisible_by, "seq_length": cfg.max_seq_len,
            "normalization": "RMSNorm", "gated_linear_unit": True, "position_embedding_type": "rope",
            "add_bias_linear": False, "add_qkv_bias": cfg.add_qkv_bias, "layernorm_epsilon": cfg.norm_epsilon,
            "rotary_base": int(cfg.rotary_base), "share_embeddings_and_output_weights": cfg.tie_embeddings,
            "init_method_std": cfg.init_method_std, "attention_dropout": 0.0, "hidden_dropout": 0.0}
    if dtype not in _PRECISION:
        raise ConversionError(f"dtype {dtype!r}; NeMo configs are written for {', '.join(_PRECISION)}")
    fp16, bf16, torch_name = _PRECISION[dtype]
    args.update(fp16=fp16, bf16=bf16, params_dtype=PyRef(("torch", torch_name)))
    if cfg.qk_layernorm:
        family, config_class = "Qwen3", "Qwen3MoE" if moe else "Qwen3"
        args["qk_layernorm"] = True
    elif moe:
        family, config_class = "Mixtral", "Mixtral"
    else:
        family, config_class = ("Qwen2", "Qwen2") if cfg.add_qkv_bias else ("Llama", "Llama")
    if moe:
        args.update(_moe_args(cfg))
    if cfg.rope_scaling:
        if family != "Llama":
            raise ConversionError("rope scaling is written only for Llama models (NeMo's Llama31Config); this "
                                  f"model is written as {family}")
        config_class = "Llama31"
        args["scale_factor"] = float(cfg.rope_scaling.get("factor", 8.0))
        for field, key in _ROPE_SCALING_FIELDS.items():
            value = cfg.rope_scaling.get(key, MEGATRON_LLAMA3_FIXED[key])
            args[field] = int(value) if field == "old_context_len" else float(value)
    return family, _CONFIG_CLASS[config_class], args


def _moe_args(cfg: ModelConfig) -> dict:
    """The MoE config fields NeMo builds ``cfg``'s router and experts from; the routing-changing
    fields NeMo's MoE configs leave at their defaults are written too, so a config class whose
    defaults differ cannot change the routing."""
    return {"num_moe_experts": cfg.num_moe_experts, "moe_router_topk": cfg.moe_router_topk,
            "moe_ffn_hidden_size": cfg.moe_ffn_hidden_size,  # None: ffn_hidden_size, in Megatron as here
            "moe_router_pre_softmax": cfg.moe_router_pre_softmax, "moe_router_score_function": "softmax",
            "moe_shared_expert_intermediate_size": None, "moe_layer_freq": 1,
            "moe_router_load_balancing_type": "aux_loss" if cfg.moe_aux_loss_coeff > 0 else "none",
            "moe_aux_loss_coeff": cfg.moe_aux_loss_coeff, "moe_z_loss_coeff": cfg.moe_z_loss_coeff or None,
            "moe_expert_capacity_factor": cfg.moe_expert_capacity_factor}


def _tokenizer_args(tokenizer: bool) -> Optional[tuple]:
    """The model's ``tokenizer`` argument: NeMo's AutoTokenizer of ``context/nemo_tokenizer``
    (as NeMo's own HF importers record it), or None."""
    return (AUTO_TOKENIZER, {"pretrained_model_name": TOKENIZER_SUBDIR}) if tokenizer else None


def model_yaml(cfg: ModelConfig, tokenizer: bool = False, dtype: str = "fp32") -> str:
    """``context/model.yaml`` as NeMo writes it, with the config fields this model sets; with
    ``tokenizer``, the model's tokenizer is the AutoTokenizer of ``context/nemo_tokenizer``."""
    import yaml

    family, (module, name), args = nemo_config_args(cfg, dtype)
    args = {k: {"_call_": False, "_target_": ".".join(v)} if isinstance(v, PyRef) else v for k, v in args.items()}
    model_module, model_name = _MODEL_CLASS[family]
    tok = _tokenizer_args(tokenizer)
    doc = {"_target_": f"{model_module}.{model_name}",
           "config": {"_target_": f"{module}.{name}", **dict(sorted(args.items()))},
           "model_transform": None, "optim": None,
           "tokenizer": {"_target_": ".".join(tok[0]), **tok[1]} if tok else None}
    return yaml.safe_dump(doc, sort_keys=False)


class _FiddleJson:
    """fiddle's JSON serialisation (format version 0.0.1, what NeMo's io.json holds) of a tree of
    ``fdl.Config(cls, **arguments)`` objects with plain leaf values, written without fiddle.

    Each Config becomes an object with its items (``Attr(name=...)`` -> leaf or ref), a
    ``BuildableTraverserMetadata`` (the class, the argument names, empty tags and history)
    and the ``<root>...`` paths at which it sits, as ``fiddle._src.experimental.serialization``
    writes them; NeMo's ``load_context(path, subpath=...)`` finds objects by those paths."""

    def __init__(self):
        self.objects: dict[str, dict] = {}
        self._counts: dict[str, int] = {}

    def _key(self, base: str) -> str:
        self._counts[base] = self._counts.get(base, 0) + 1
        return f"{base}_{self._counts[base]}"

    @staticmethod
    def _pyref(module: str, name: str) -> dict:
        return {"type": "pyref", "module": module, "name": name}

    def _add(self, base: str, obj: dict) -> dict:
        key = self._key(base)
        self.objects[key] = obj
        return {"type": "ref", "key": key}

    def _tuple(self, items: list) -> dict:
        return {"type": self._pyref("builtins", "tuple"),
                "items": [[f"Index(index={i})", v] for i, v in enumerate(items)], "metadata": None}

    def _dict(self, path: Optional[str] = None) -> dict:
        obj = {"type": self._pyref("builtins", "dict"), "items": [], "metadata": self._tuple([])}
        if path is not None:
            obj["paths"] = [path]
        return obj

    def config(self, cls: tuple[str, str], arguments: dict, path: str) -> dict:
        """A ref to ``fdl.Config(cls, **arguments)`` at ``path``; a value that is itself a
        (cls, arguments) pair becomes a nested Config, an empty dict becomes a dict object."""
        names = self._add("tuple", self._tuple(list(arguments)))
        tags, history = self._add("dict", self._dict()), self._add("dict", self._dict())
        metadata = self._add("buildable_traverser_metadata", {
            "type": self._pyref("fiddle._src.config", "BuildableTraverserMetadata"),
            "items": [["Attr(name='fn_or_cls')", self._pyref(*cls)], ["Attr(name='argument_names')", names],
                      ["Attr(name='argument_tags')", tags], ["Attr(name='argument_history')", history]],
            "metadata": self._pyref("fiddle._src.config", "BuildableTraverserMetadata")})
        items = []
        for arg, value in arguments.items():
            at = f"{path}.{arg}"
            if isinstance(value, PyRef):
                ref = {**self._pyref(*value), "paths": [at]}
            elif isinstance(value, tuple):
                ref = self.config(value[0], value[1], at)
            elif isinstance(value, dict) and not value:
                ref = self._add("dict", self._dict(at))
            else:
                if not (value is None or isinstance(value, (bool, int, float, str))):
                    raise TypeError(f"{at}: cannot serialise {type(value).__name__}")
                ref = {"type": "leaf", "value": value, "paths": [at]}
            items.append([f"Attr(name='{arg}')", ref])
        base = re.sub(r"(?<!^)(?=[A-Z])", "_", cls[1]).lower()
        return self._add(base, {"type": self._pyref("fiddle._src.config", "Config"), "items": items,
                                "metadata": metadata, "paths": [path]})

    def document(self, root: dict) -> str:
        refcounts = {key: 1 for key in self.objects}
        return json.dumps({"root": root, "objects": self.objects, "refcounts": refcounts, "version": "0.0.1"},
                          indent=2)


def io_json(cfg: ModelConfig, tokenizer: bool = False, dtype: str = "fp32") -> str:
    """``context/io.json``: a TrainerContext holding the model (its config, and with ``tokenizer``
    the AutoTokenizer of ``context/nemo_tokenizer``, else none) and the single-device trainer
    NeMo's own checkpoint importers record."""
    family, config_class, args = nemo_config_args(cfg, dtype)
    model = (_MODEL_CLASS[family], {"config": (config_class, args), "tokenizer": _tokenizer_args(tokenizer)})
    strategy = (("nemo.lightning.pytorch.strategies.megatron_strategy", "MegatronStrategy"),
                {"ckpt_save_optimizer": False})
    trainer = (("nemo.lightning.pytorch.trainer", "Trainer"),
               {"accelerator": "cpu", "devices": 1, "strategy": strategy})
    writer = _FiddleJson()
    root = writer.config(("nemo.lightning.io.pl", "TrainerContext"),
                         {"model": model, "trainer": trainer, "extra": {}}, "<root>")
    return writer.document(root)


# Lightning's counters in weights/common.pt, and the sharded-state-dict metadata NeMo 2.7 reads
# back (``load_content_metadata``) before it builds the state dict it loads into.
COMMON_STATE = {"epoch": 0, "global_step": 0,
                "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}}


def nemo_key(key: str, moe: bool) -> str:
    """The key under which NeMo's Transformer Engine model stores our model's tensor ``key``
    (``module.``-prefixed): only an MoE layer's pre-MLP norm differs."""
    if moe and key.startswith(_MOE_NORM_LOCAL):
        return _MOE_NORM_TE + key[len(_MOE_NORM_LOCAL):]
    return key


def stored_nemo_key(key: str, stored: dict) -> str:
    """``key`` of our model's sharded state dict as a NeMo checkpoint ``stored`` holds it: as is
    (NeMo without Transformer Engine, or a dense layer), else an MoE layer's norm under its TE name."""
    if key in stored:
        return key
    te = nemo_key(key, moe=True)
    return te if te in stored else key


def read_nemo_checkpoint(ckpt_dir: str | Path) -> tuple[ModelConfig, Path]:
    """(ModelConfig, weights directory) of a NeMo 2 checkpoint; the weights are checked to be a
    torch_dist checkpoint holding the embedding, whose rows give a null ``vocab_size``."""
    weights = nemo_weights_dir(ckpt_dir)
    tensors, _ = stored_entries(weights)
    embed = tensors.get(PREFIX + "embedding.word_embeddings.weight")
    if embed is None:
        raise ConversionError(f"{weights} holds no {PREFIX}embedding.word_embeddings.weight: not a NeMo GPT "
                              "checkpoint (or not saved with the module. prefix)")
    return read_nemo_model_config(ckpt_dir, stored_vocab_rows=embed[0][0]), weights
