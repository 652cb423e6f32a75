"""Environments behind the `ENVS` registry; importing this package registers the built-ins."""

import inspect
from typing import Any

from trace_mega.configbase import ConfigError
from trace_mega.envs import (
    bfcl,  # noqa: F401  (registers bfcl_multi_turn)
    math_python,  # noqa: F401  (registers math_python)
    multihop_qa,  # noqa: F401  (registers multihop_qa)
    synthetic,  # noqa: F401  (registers synthetic, synthetic_tools)
    synthetic_levels,  # noqa: F401  (registers synthetic_levels)
    synthetic_search,  # noqa: F401  (registers synthetic_search)
)
from trace_mega.envs.base import ENVS, Env, EpisodeState, ParsedTurn, Task, ToolCall


def check_env(name: str, options: dict[str, Any], field: str = "env") -> type[Env]:
    """The environment class registered as `name`, its `options` checked against its constructor
    (ConfigError naming `<field>.name` or `<field>.options.<key>`)."""
    cls = ENVS.check(name, f"{field}.name")
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        valid = sorted(k for k in params if k != "self")
        for key in options:
            if key not in valid:
                raise ConfigError(f"{field}.options.{key}: unknown option of {name!r}; valid: {', '.join(valid)}")
    return cls


def build_env(name: str, **options: Any) -> Env:
    """The environment registered as `name`, built with its options (checked first: `check_env`)."""
    return check_env(name, options)(**options)


__all__ = ["ENVS", "Env", "EpisodeState", "ParsedTurn", "Task", "ToolCall", "build_env", "check_env"]
