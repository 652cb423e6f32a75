"""Environments behind the `ENVS` registry; importing this package registers the built-ins."""
from trace_mega.envs.base import ENVS, Env, EpisodeState, ParsedTurn, Task, ToolCall, build_env

__all__ = ["ENVS", "Env", "EpisodeState", "ParsedTurn", "Task", "ToolCall", "build_env"]
