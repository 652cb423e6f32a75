"""`trace-mega plan`: per-GPU memory of a config on its cluster, checked before launch.

The estimate is analytic (no GPU, no weights): parameter counts come from the
model's architecture (the HF checkpoint's `config.json`, else an architecture
card shipped under `trace_mega/data/hf_configs/<checkpoint name>/`), sharded the
way the learner shards them (docs/learner.md):

* learner weights: linear weights split over TP, pipeline stages split the
  layers (stage 0 holds the embedding, the last stage the output layer), MoE
  experts split over EP only (expert TP = 1); norms and routers replicated;
* gradients: Megatron DDP's fp32 grad buffers (`grad_reduce_in_fp32=True`),
  one per local parameter (the distributed optimizer does not shard them);
* optimizer: Adam's two fp32 moments plus an fp32 master copy when the
  parameters are not fp32, sharded over data-parallel ranks (experts: over
  expert-data-parallel ranks) under the distributed optimizer;
* activations: one packed micro-batch of `parallel.micro_batch_tokens` tokens
  per layer, the attention scores never materialised (tree / flash attention),
  times the micro-batches a 1F1B pipeline keeps in flight on stage 0 (PP of
  them); under `parallel.recompute_activations` only each layer's input of
  those, plus one layer's full activations while it is recomputed; the
  vocab-parallel logits and their fp32 gradient;
* MoE routing replay (`model.moe_routing_replay: rollout`): the replayed experts of one
  micro-batch, int64 per token, local layer and top-k slot, in the training peak (under recompute
  a copy waits for each micro-batch in flight); the engine's capture buffer, int32 for each of
  vLLM's batched tokens (16,384 for the offline `LLM` on an H100 or H200), layer and slot, out
  of its KV cache; and in each process's host memory, not on the GPU, the step's routes as int16
  per token (at most its replica's share of the step's trajectories at `rollout.max_total_tokens`);
* engine (one vLLM replica per `rollout.tensor_parallel_size` GPUs): the full
  weights split over the replica, and `rollout.gpu_memory_utilization` of the
  GPU for weights + working memory + KV cache (what vLLM reserves);
* a fixed reserve for the CUDA context, NCCL buffers and fragmentation.

Phases: while the engines generate, the learner's weights, gradients and
optimizer state stay resident beside the engine's reservation; while the
learner trains, a sleeping engine (CUDA sleep mode, the trainer's default)
holds nothing, an awake one its whole reservation. The plan fails, naming the
config field to change, when a phase does not fit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trace_mega.allocation.allocators import step_trajectories
from trace_mega.config import ConfigError, ModelConfig, TrainConfig

__all__ = ["MemoryPlan", "ParamCounts", "count_params", "plan_memory", "model_for_plan", "format_plan"]

GIB = 1024**3
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# vLLM's default `max_num_batched_tokens` for the offline `LLM` class on an H100 or H200 (>= 70 GiB, not A100)
# (`EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`); its routing capture buffer has one row per token.
_VLLM_BATCHED_TOKENS = 16384
CARDS = Path(__file__).resolve().parents[1] / "data" / "hf_configs"


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of one model, split the way the learner shards them."""

    num_layers: int
    embedding: int  # V * h (input embedding)
    output: int  # V * h when untied, else 0
    layer_linear: int  # per layer: attention + dense-MLP matrices (TP-split)
    layer_replicated: int  # per layer: norms, MoE router (replicated over TP)
    layer_experts: int  # per layer: all experts' matrices (EP-split)
    final_norm: int

    @property
    def total(self) -> int:
        return (
            self.embedding
            + self.output
            + self.final_norm
            + self.num_layers * (self.layer_linear + self.layer_replicated + self.layer_experts)
        )


def count_params(m: ModelConfig) -> ParamCounts:
    """Exact parameter counts of the Qwen3 / Qwen3-MoE / Qwen2 / Llama networks the learner builds."""
    h, d = m.hidden_size, m.head_dim
    q, kv = m.num_attention_heads * d, m.num_query_groups * d
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if m.qkv_bias else 0)
    norms = 2 * h + (2 * d if m.qk_layernorm else 0)
    if m.num_experts:
        f = m.moe_ffn_hidden_size or m.ffn_hidden_size
        linear, replicated, experts = attn, norms + h * m.num_experts, m.num_experts * 3 * h * f
    else:
        linear, replicated, experts = attn + 3 * h * m.ffn_hidden_size, norms, 0
    vocab = m.vocab_size or 0
    return ParamCounts(
        num_layers=m.num_layers,
        embedding=vocab * h,
        output=0 if m.tie_word_embeddings else vocab * h,
        layer_linear=linear,
        layer_replicated=replicated,
        layer_experts=experts,
        final_norm=h,
    )


def model_for_plan(cfg: TrainConfig) -> ModelConfig:
    """The architecture in force: the checkpoint's config.json, else a shipped card of the same name."""
    if cfg.model.hf_checkpoint is None:
        return cfg.model
    src = Path(cfg.model.hf_checkpoint)
    if not (src / "config.json").is_file():
        card = CARDS / src.name
        if not (card / "config.json").is_file():
            known = ", ".join(sorted(p.name for p in CARDS.iterdir()))
            raise ConfigError(
                f"model.hf_checkpoint: {src}/config.json not found and no shipped architecture "
                f"card named {src.name!r} (cards: {known})"
            )
        src = card
    from transformers import AutoConfig

    from trace_mega.learner.models import model_config_from_hf

    return model_config_from_hf(AutoConfig.from_pretrained(str(src)), params_dtype=cfg.model.params_dtype)


@dataclass
class MemoryPlan:
    """Per-GPU bytes of each component and phase, plus the layout they assume."""

    world_size: int
    layout: dict[str, int]  # tp, pp, ep, dp, expert_dp, rollout_tp, replicas
    params_total: int
    params_per_gpu: int
    learner_weights: float
    learner_grads: float
    optimizer_state: float
    activations: float
    logits: float
    engine_weights: float
    engine_reserved: float
    engine_kv: float
    kv_tokens: int
    reserve: float
    gpu_memory: float
    errors: list[str]
    routing_replay: float = 0.0
    """MoE routing replay: the replayed experts of the micro-batches on the device."""
    engine_routing: float = 0.0
    """MoE routing capture: the engine's buffer of its batched tokens' experts (inside its reservation)."""
    host_routes: float = 0.0
    """MoE routing replay: a step's routes in each process's host memory (every rank of a replica
    holds the replica's trees), not GPU memory."""

    @property
    def learner_resident(self) -> float:
        return self.learner_weights + self.learner_grads + self.optimizer_state

    def peaks(self, engine_sleeps: bool) -> dict[str, float]:
        rollout = self.learner_resident + self.engine_reserved + self.reserve
        train = self.learner_resident + self.activations + self.logits + self.routing_replay + self.reserve
        if not engine_sleeps:
            train += self.engine_reserved
        return {"rollout": rollout, "train": train}


def _divides(errors: list[str], field: str, a: int, b: int, what: str) -> None:
    if a < 1 or b % a:
        errors.append(f"{field}: {a} does not divide {what} ({b})")


def plan_memory(cfg: TrainConfig, model: Optional[ModelConfig] = None) -> MemoryPlan:
    """The per-GPU memory plan of `cfg` on `cfg.cluster`; `errors` names each field that cannot fit."""
    m = model or model_for_plan(cfg)
    par, ro, cl = cfg.parallel, cfg.rollout, cfg.cluster
    world = cl.nodes * cl.gpus_per_node
    tp, pp, ep = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.expert_model_parallel_size
    errors: list[str] = []
    _divides(errors, "parallel.tensor_model_parallel_size", tp, m.num_attention_heads, "num_attention_heads")
    _divides(errors, "parallel.tensor_model_parallel_size", tp, m.num_query_groups, "num_query_groups")
    _divides(errors, "parallel.pipeline_model_parallel_size", pp, m.num_layers, "num_layers")
    _divides(
        errors,
        "parallel.tensor_model_parallel_size",
        tp * pp,
        world,
        "the world size (cluster.nodes x gpus_per_node) / PP",
    )
    if m.num_experts:
        _divides(errors, "parallel.expert_model_parallel_size", ep, m.num_experts, "num_experts")
        _divides(errors, "parallel.expert_model_parallel_size", ep * pp, world, "the world size / PP")
    dp = max(1, world // (tp * pp))
    edp = max(1, world // (ep * pp)) if m.num_experts else dp
    rtp = ro.tensor_parallel_size or tp * pp
    _divides(errors, "rollout.tensor_parallel_size", rtp, world, "the world size")
    _divides(errors, "rollout.tensor_parallel_size", rtp, m.num_attention_heads, "num_attention_heads")

    c = count_params(m)
    wb = _BYTES[m.params_dtype]
    layers = math.ceil(m.num_layers / pp)
    vocab_pad = -(-(m.vocab_size or 0) // tp) * tp
    h = m.hidden_size
    # The heaviest stage: stage 0 has the embedding; the last the output layer (a copy when tied and PP > 1).
    embed = vocab_pad * h // tp
    head = embed if (not m.tie_word_embeddings or pp > 1) else 0
    ends = embed + head if pp == 1 else max(embed, head)
    dense = ends + layers * c.layer_linear // tp + layers * c.layer_replicated + c.final_norm
    experts = layers * c.layer_experts // ep if m.num_experts else 0
    local = dense + experts
    opt_per_param = 8 + (0 if m.params_dtype == "float32" else 4)
    sharded = dense / dp + experts / edp if par.use_distributed_optimizer else local

    # Activations kept for backward, bytes per token per layer (no recompute, no attention scores):
    # two norm inputs, QKV input and outputs, attention output (+ fp32 log-sum-exp), MLP input,
    # gate/up outputs and the activation's output; MoE: that MLP part once per routed expert.
    q, kv = m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim
    attn_part = wb * (3 * h + q + 2 * kv + q) + 4 * m.num_attention_heads
    if m.num_experts:
        f = m.moe_ffn_hidden_size or m.ffn_hidden_size
        mlp_part = m.moe_router_topk * wb * (h + 3 * f) + 4 * m.num_experts
    else:
        mlp_part = wb * (h + 3 * m.ffn_hidden_size)
    per_token_layer = (attn_part + mlp_part + wb * h) / tp  # (+ the residual stream); SP / TP split every part
    if tp > 1 and not (par.sequence_parallel or m.num_experts):
        per_token_layer += (tp - 1) / tp * wb * 4 * h  # norms and residuals replicated without SP
    tokens = par.micro_batch_tokens
    if par.recompute_activations:  # each layer's input (split under SP) kept; one layer recomputed at a time
        sp = tp if (par.sequence_parallel or m.num_experts) else 1
        activations = tokens * wb * h / sp * layers * pp + tokens * per_token_layer
    else:
        activations = tokens * per_token_layer * layers * pp
    logits = tokens * (vocab_pad // tp) * (wb + 4)
    # R3: a forward's replay targets, (tokens[/tp under SP], local layers, top-k) int64; recompute
    # keeps them until each in-flight micro-batch's backward.
    replays = bool(m.num_experts) and cfg.model.moe_routing_replay == "rollout"
    in_flight = pp if par.recompute_activations else 1
    routing = tokens / tp * layers * m.moe_router_topk * 8 * in_flight if replays else 0.0
    routes_per_token = m.num_layers * m.moe_router_topk if replays else 0
    engine_routing = _VLLM_BATCHED_TOKENS * routes_per_token * 4 if ro.engine == "vllm" else 0
    host_routes = step_trajectories(cfg.allocation) / (world // rtp) * ro.max_total_tokens * routes_per_token * 2

    gpu = cl.gpu_memory_gib * GIB
    engine_weights = c.total * wb / rtp
    engine_reserved = ro.gpu_memory_utilization * gpu
    engine_kv = engine_reserved - engine_weights - cl.engine_working_memory_gib * GIB - engine_routing
    kv_per_token = 2 * m.num_layers * max(1, m.num_query_groups // rtp) * m.head_dim * wb
    kv_tokens = max(0, int(engine_kv // kv_per_token))

    plan = MemoryPlan(
        world_size=world,
        layout=dict(tp=tp, pp=pp, ep=ep, dp=dp, expert_dp=edp, rollout_tp=rtp, replicas=world // rtp),
        params_total=c.total,
        params_per_gpu=local,
        learner_weights=local * wb,
        learner_grads=local * 4.0,
        optimizer_state=sharded * opt_per_param,
        activations=activations,
        logits=logits,
        engine_weights=engine_weights,
        engine_reserved=engine_reserved,
        engine_kv=engine_kv,
        kv_tokens=kv_tokens,
        reserve=cl.reserve_gib * GIB,
        gpu_memory=gpu,
        errors=errors,
        routing_replay=routing,
        engine_routing=engine_routing,
        host_routes=host_routes,
    )
    g = lambda x: f"{x / GIB:.1f} GiB"  # noqa: E731
    if engine_kv < ro.max_total_tokens * kv_per_token:
        errors.append(
            f"rollout.gpu_memory_utilization: {ro.gpu_memory_utilization} x {g(gpu)} leaves "
            f"{g(max(engine_kv, 0))} of KV cache after {g(engine_weights)} of engine weights per GPU, less than "
            f"one trajectory of rollout.max_total_tokens={ro.max_total_tokens} "
            f"({g(ro.max_total_tokens * kv_per_token)}); raise it or rollout.tensor_parallel_size"
        )
    peaks = plan.peaks(engine_sleeps=True)
    if peaks["rollout"] > gpu:
        errors.append(
            f"rollout.gpu_memory_utilization: the learner's resident {g(plan.learner_resident)} + the engine's "
            f"{g(engine_reserved)} + reserve {g(plan.reserve)} = {g(peaks['rollout'])} > {g(gpu)} per GPU; "
            f"lower it, or shard the learner further (parallel.*_model_parallel_size)"
        )
    if peaks["train"] > gpu:
        errors.append(
            f"parallel.micro_batch_tokens: training needs {g(peaks['train'])} per GPU (activations "
            f"{g(activations)}, logits {g(logits)}) > {g(gpu)}; lower it or raise "
            f"parallel.tensor_model_parallel_size"
        )
    return plan


def format_plan(cfg: TrainConfig, plan: MemoryPlan) -> str:
    """A Markdown table of the plan (GiB per GPU) and its verdict."""
    g = lambda x: f"{x / GIB:.2f}"  # noqa: E731
    lay = plan.layout
    sleep, awake = plan.peaks(engine_sleeps=True), plan.peaks(engine_sleeps=False)
    rows = [
        ("learner weights", plan.learner_weights),
        ("gradients (fp32 buffers)", plan.learner_grads),
        ("optimizer state", plan.optimizer_state),
        (
            "activations (recomputed layers)"
            if cfg.parallel.recompute_activations
            else "activations (one micro-batch)",
            plan.activations,
        ),
        ("logits + grad", plan.logits),
        ("MoE routing replay (micro-batches in flight)", plan.routing_replay),
        ("engine's MoE routing capture", plan.engine_routing),
        ("engine weights", plan.engine_weights),
        ("engine KV cache", max(plan.engine_kv, 0.0)),
        ("engine reservation (util x GPU)", plan.engine_reserved),
        ("reserve (context, NCCL, fragmentation)", plan.reserve),
        ("peak while generating", sleep["rollout"]),
        ("peak while training, engine asleep", sleep["train"]),
        ("peak while training, engine awake", awake["train"]),
    ]
    head = (
        f"{plan.world_size} GPUs x {g(plan.gpu_memory)} GiB ({cfg.cluster.nodes} node(s) x "
        f"{cfg.cluster.gpus_per_node}); learner TP={lay['tp']} PP={lay['pp']} EP={lay['ep']} DP={lay['dp']} "
        f"expert-DP={lay['expert_dp']}; {lay['replicas']} rollout replica(s) of TP={lay['rollout_tp']}; "
        f"{plan.params_total / 1e9:.2f} B parameters, {plan.params_per_gpu / 1e9:.2f} B per GPU"
    )
    lines = [head, "", "| per GPU | GiB |", "|---|---:|"] + [f"| {name} | {g(v)} |" for name, v in rows]
    lines.append(
        f"\nKV cache holds {plan.kv_tokens:,} tokens per replica rank "
        f"({plan.kv_tokens // max(cfg.rollout.max_total_tokens, 1)} trajectories at "
        f"rollout.max_total_tokens={cfg.rollout.max_total_tokens})."
    )
    if plan.host_routes:
        lines.append(f"Host memory per process for a step's MoE routes (int16): at most {g(plan.host_routes)} GiB.")
    lines.append("fits" if not plan.errors else "does NOT fit:\n" + "\n".join(f"- {e}" for e in plan.errors))
    return "\n".join(lines)


def replace_cluster(cfg: TrainConfig, **fields) -> TrainConfig:
    """`cfg` with cluster fields overridden (None values ignored): the CLI's --nodes / --gpus-per-node / --gpu-memory-gib."""
    fields = {k: v for k, v in fields.items() if v is not None}
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, **fields))
