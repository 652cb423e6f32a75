"""Rollout engines behind `ENGINES`; `build_engine` starts the configured one for a training run."""

from typing import Optional

from trace_mega.rollout.engines.base import ENGINES, Completion, Engine, EngineSetup, SamplingParams
from trace_mega.rollout.engines.prefix_cache import PrefixKVCache
from trace_mega.rollout.engines.torch_engine import TorchEngine
from trace_mega.rollout.engines.vllm_engine import VLLMEngine  # imports vLLM only when one is constructed


def build_engine(setup: EngineSetup) -> Optional[Engine]:
    """The engine named by `setup.rollout.engine`, started by its own `launch` (call on every rank:
    the engine is returned on the hosting rank, None elsewhere)."""
    return ENGINES.check(setup.rollout.engine, "rollout.engine").launch(setup)


__all__ = [
    "ENGINES",
    "Completion",
    "Engine",
    "EngineSetup",
    "PrefixKVCache",
    "SamplingParams",
    "TorchEngine",
    "VLLMEngine",
    "build_engine",
]
