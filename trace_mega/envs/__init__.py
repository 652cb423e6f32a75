"""Environments behind the `ENVS` registry; importing this package registers the built-ins."""
from trace_mega.envs.base import ENVS, Env, EpisodeState, ParsedTurn, Task, ToolCall, build_env
from trace_mega.envs import bfcl  # noqa: F401  (registers bfcl_multi_turn)
from trace_mega.envs import math_python  # noqa: F401  (registers math_python)
from trace_mega.envs import multihop_qa  # noqa: F401  (registers multihop_qa)
from trace_mega.envs import synthetic  # noqa: F401  (registers synthetic, synthetic_tools)
from trace_mega.envs import synthetic_search  # noqa: F401  (registers synthetic_search)

__all__ = ["ENVS", "Env", "EpisodeState", "ParsedTurn", "Task", "ToolCall", "build_env"]
