"""Strict loading of typed dataclass configs from dicts and YAML.

Every component owns one dataclass config (fields with a docstring and units in
their names). `load_config(cls, data)` builds it from a nested dict and fails at
load, naming the dotted field path, on an unknown key, a wrong type, or a value
that the dataclass's own `validate()` rejects.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

C = TypeVar("C")


class ConfigError(ValueError):
    """A config that cannot be loaded; the message starts with the field path."""


def _check_scalar(path: str, tp: Any, value: Any) -> Any:
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        # PyYAML (YAML 1.1) reads `1e-5` (no dot) as a string; accept any float literal.
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{path}: expected {tp.__name__}, got bool {value!r}")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def _convert(path: str, tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping for {tp.__name__}, got {type(value).__name__}")
        return _build(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(path, arg, value)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of {args}")
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path}: {value!r} is not one of {list(allowed)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        (arg,) = typing.get_args(tp)[:1] or (Any,)
        items = [_convert(f"{path}[{i}]", arg, v) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        _, varg = typing.get_args(tp) or (Any, Any)
        return {k: _convert(f"{path}.{k}", varg, v) for k, v in value.items()}
    return _check_scalar(path, tp, value)


def _build(cls: type[C], data: dict, prefix: str = "") -> C:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"{where}{unknown[0]}: unknown key for {cls.__name__}; valid keys: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in data.items():
        path = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _convert(path, hints[name], value)
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError as exc:
            raise ConfigError(f"{prefix}.{exc}" if prefix else str(exc)) from None
    return obj


def load_config(cls: type[C], data: dict | None) -> C:
    """Build `cls` from a nested dict, rejecting unknown keys and bad types."""
    return _build(cls, data or {})


def load_yaml(cls: type[C], path: str | Path, overrides: list[str] | None = None) -> C:
    """Load `cls` from a YAML file, then apply `a.b.c=value` overrides (YAML-parsed values)."""
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r}: expected key=value")
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(raw)
    return load_config(cls, data)


def to_dict(cfg: Any) -> dict:
    """Plain nested dict of a config (for logging and checkpoint metadata)."""
    return dataclasses.asdict(cfg)


def save_yaml(cfg: Any, path: str | Path) -> Path:
    """Write every field of `cfg` as YAML that `load_yaml` reads back to an equal config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path


def require(cond: bool, field: str, message: str) -> None:
    """Raise ConfigError naming `field` unless `cond` holds (use inside `validate`)."""
    if not cond:
        raise ConfigError(f"{field}: {message}")
