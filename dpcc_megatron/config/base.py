"""Typed-dataclass config machinery: build dataclasses from plain dicts with
errors that name the offending key (``loss.dpcc.tau_min must be > 1, got 0.9``).

Every config section is a ``@dataclass`` whose fields carry type hints and a
docstring (the string literal right after the field). Range checks live in a
``validate(self)`` method that calls :func:`check`; the loader prefixes the
key path, so sections never need to know where they sit in the tree.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or out of range."""


class _FieldError(Exception):
    def __init__(self, field: str, msg: str):
        super().__init__(msg)
        self.field = field
        self.msg = msg


def check(cond: bool, field: str, msg: str) -> None:
    """Raise a range error for ``field`` (relative to the section) unless ``cond``."""
    if not cond:
        raise _FieldError(field, msg)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp) if a is not type(None))
    if origin is Literal:
        return " or ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, path)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:  # Optional[X]: X's own message ("must be a number", "must be one of ...")
            raise ConfigError(errors[0])
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in get_args(tp):
            choices = ", ".join(repr(a) for a in get_args(tp))
            raise ConfigError(f"{path} must be one of {choices}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping, got {type(value).__name__}")
        return from_dict(tp, value, path)
    if tp in (list, tuple) or origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be a list, got {type(value).__name__}")
        args = get_args(tp) if origin is not None else ()
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{path} must have {len(args)} items, got {len(value)}")
            return tuple(_coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        inner = args[0] if args else Any
        out = [_coerce(inner, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if (origin or tp) is tuple else out
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping, got {type(value).__name__}")
        kt, vt = (get_args(tp) or (Any, Any)) if origin is dict else (Any, Any)
        return {_coerce(kt, k, path): _coerce(vt, v, _join(path, str(k))) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path} must be a bool, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{path} must be an int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path} must be a string, got {value!r}")
    raise ConfigError(f"{path}: unsupported config type {_type_name(tp)}")


def run_validate(obj: Any, path: str) -> None:
    """Call ``obj.validate()`` and re-raise range errors with the full key path."""
    fn = getattr(obj, "validate", None)
    if fn is None:
        return
    try:
        fn()
    except _FieldError as e:
        raise ConfigError(f"{_join(path, e.field)} {e.msg}") from None


def from_dict(cls: type, data: dict, path: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys and bad types raise ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        known = ", ".join(sorted(fields))
        raise ConfigError(f"unknown key {_join(path, str(unknown[0]))} (known keys here: {known})")
    kwargs = {name: _coerce(hints[name], data[name], _join(path, name)) for name in data}
    missing = [n for n, f in fields.items() if n not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"missing required key {_join(path, missing[0])}")
    obj = cls(**kwargs)
    run_validate(obj, path)
    return obj


def to_dict(obj: Any) -> Any:
    """Plain-dict form of a config dataclass (for YAML dumps and checkpoint metadata)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def validate_tree(obj: Any, path: str = "") -> None:
    """Re-run every section's ``validate`` (after programmatic edits or overrides)."""
    if not dataclasses.is_dataclass(obj):
        return
    for f in dataclasses.fields(obj):
        validate_tree(getattr(obj, f.name), _join(path, f.name))
    run_validate(obj, path)


def apply_override(data: dict, assignment: str) -> None:
    """Apply one ``a.b.c=value`` override to a plain dict; value is parsed as YAML."""
    import yaml

    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like key.path=value")
    key, raw = assignment.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {assignment!r} has an empty key")
    value = yaml.safe_load(raw) if raw.strip() else ""
    node = data
    parts = key.split(".")
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key}: {p} is not a section")
        node = nxt
    node[parts[-1]] = value
