from trace_mega.rollout.engines.base import ENGINES, Completion, Engine, EngineStats, SamplingParams
from trace_mega.rollout.engines.torch_engine import PrefixKVCache, TorchEngine


@ENGINES.register("vllm")
def _vllm_engine(*args, **kwargs) -> Engine:
    """Build a `VLLMEngine`; vLLM is imported only here, so the CPU main path never imports it."""
    from trace_mega.rollout.engines.vllm_engine import VLLMEngine

    return VLLMEngine(*args, **kwargs)


__all__ = ["ENGINES", "Completion", "Engine", "EngineStats", "PrefixKVCache", "SamplingParams", "TorchEngine"]
