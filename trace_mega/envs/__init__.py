"""Environments behind the `ENVS` registry; importing this package registers the built-ins."""

from trace_mega.envs import (
    bfcl,  # noqa: F401  (registers bfcl_multi_turn)
    math_python,  # noqa: F401  (registers math_python)
    multihop_qa,  # noqa: F401  (registers multihop_qa)
    synthetic,  # noqa: F401  (registers synthetic, synthetic_tools)
    synthetic_search,  # noqa: F401  (registers synthetic_search)
)
from trace_mega.envs.base import ENVS, Env, EpisodeState, ParsedTurn, Task, ToolCall, build_env

__all__ = ["ENVS", "Env", "EpisodeState", "ParsedTurn", "Task", "ToolCall", "build_env"]
