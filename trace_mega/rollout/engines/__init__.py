"""Rollout engines: `torch` (in-process, prefix-shared KV cache) and `vllm` (imported lazily)."""
from trace_mega.rollout.engines.base import ENGINES, Completion, Engine, EngineStats, SamplingParams

__all__ = ["ENGINES", "Completion", "Engine", "EngineStats", "SamplingParams"]
