"""Typed dataclass configs, one per component, and the top-level `TrainConfig`. YAML in `configs/` only
sets fields; unknown keys are errors naming the dotted path (`configbase.load_config`); units in names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from trace_mega.config_trace_a import AllocationConfig, PredictorConfig
from trace_mega.configbase import ConfigError, load_config, load_yaml, require, save_yaml, to_dict

# fmt: off
__all__ = [
    "AllocationConfig", "PredictorConfig", "RolloutConfig", "EnvConfig", "ModelConfig", "ParallelConfig",
    "OptimConfig", "LossConfig", "AdvantageConfig", "CreditConfig", "CheckpointConfig", "TelemetryConfig",
    "EvalConfig", "ClusterConfig", "TrainConfig", "ConfigError", "load_config", "load_yaml", "save_yaml", "to_dict",
]
# fmt: on


@dataclass
class RolloutConfig:
    engine: str = "torch"
    """Rollout engine registry name: torch | vllm."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype the engine computes in; auto = the learner's `model.params_dtype` (vLLM's own "auto"
    would downcast a float32 policy to bfloat16 and the behaviour log-probs would drift from the
    learner's)."""
    lm_head_fp32: bool = False
    """Compute the LM head's matmul and logits in float32 in a bfloat16 / float16 engine, as the learner's fused
    log-prob kernel does (vLLM: `head_dtype` float32); cuts the mismatch the rounded logits cause (docs/learner.md)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_new_tokens_per_turn: int = 64
    """Generation stops after this many tokens in one turn (truncation becomes an error observation)."""
    max_turns: int = 6
    """Most ReAct turns per trajectory."""
    max_total_tokens: int = 2048
    """Most tokens (prompt + all turns) per trajectory."""
    gpu_memory_utilization: float = 0.5
    """vLLM: fraction of GPU memory its KV cache may take (colocated with the learner)."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prefixes when branching."""
    kv_block_size_tokens: Optional[int] = None
    """vLLM KV-cache block size (prefix-cache hits come in whole blocks); None: vLLM's default."""
    tensor_parallel_size: Optional[int] = None
    """Ranks of one rollout replica (vLLM tensor parallel, experts spread over them); None: the learner's TP x PP.
    With PP = 1 a multiple of the learner's TP dividing the world size (a replica is that many consecutive
    ranks); `trace-mega plan` sizes the engines with it (README "Scaling out")."""

    def validate(self) -> None:
        require(
            self.tensor_parallel_size is None or self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1"
        )
        require(self.temperature >= 0, "temperature", "must be >= 0")
        require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        require(self.max_turns >= 1, "max_turns", "must be >= 1")


@dataclass
class EnvConfig:
    name: str = "synthetic_tools"
    """Environment registry name: synthetic | synthetic_tools | synthetic_search | bfcl_multi_turn | multihop_qa | math_python."""
    options: dict[str, Any] = field(default_factory=dict)
    """Environment-specific keyword arguments (data paths, categories, limits)."""
    tool_timeout_s: float = 10.0
    """Wall-clock limit for all tool calls of one turn together (they run in order and share it), counted
    from when a worker starts them; a turn that runs out is an error observation and changes nothing."""
    max_concurrent_tool_calls: Optional[int] = None
    """Most turns whose tool calls run at once on a rollout replica (each turn's calls run in order);
    None: one worker per live episode, so no episode waits for another's tools."""
    max_tool_calls_per_turn: int = 8
    """Most tool calls one turn may make; a turn with more becomes an error observation and runs none of
    them (bounds the work of a turn and how fast a model can grow the environment state)."""

    def validate(self) -> None:
        require(self.tool_timeout_s > 0, "tool_timeout_s", "must be > 0")
        require(
            self.max_concurrent_tool_calls is None or self.max_concurrent_tool_calls >= 1,
            "max_concurrent_tool_calls",
            "must be >= 1 (or null: one per live episode)",
        )
        require(self.max_tool_calls_per_turn >= 1, "max_tool_calls_per_turn", "must be >= 1")


@dataclass
class ModelConfig:
    hf_checkpoint: Optional[str] = None
    """Directory of an HF checkpoint to initialise from (safetensors); None: random init from the fields below."""
    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Model width."""
    ffn_hidden_size: int = 128
    """Gated-MLP inner width (dense layers)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int = 2
    """KV heads (GQA)."""
    head_dim: int = 16
    """Channels per head (kv_channels)."""
    vocab_size: Optional[int] = 64
    """Vocabulary size (padded to a multiple of the TP size internally); None: the tokenizer's size."""
    max_position_embeddings: int = 1024
    """Longest sequence RoPE is built for."""
    rotary_base: float = 10000.0
    """RoPE theta."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon."""
    activation: Literal["silu", "gelu", "gelu_tanh", "relu"] = "silu"
    """Activation of the gated MLP (act(gate) * up): silu (SwiGLU, Qwen / Llama), gelu (erf), gelu_tanh
    (tanh approximation: HF gelu_pytorch_tanh / gelu_new), relu. From the HF config's hidden_act."""
    qk_layernorm: bool = True
    """Qwen3 q/k RMSNorm."""
    qkv_bias: bool = False
    """Bias on the q/k/v projections (Qwen2)."""
    tie_word_embeddings: bool = True
    """Share input embedding and output layer."""
    num_experts: Optional[int] = None
    """MoE experts per layer (None: dense)."""
    moe_router_topk: int = 2
    """Experts per token."""
    moe_ffn_hidden_size: Optional[int] = None
    """Expert inner width (None: ffn_hidden_size)."""
    moe_norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to 1 (Qwen3-MoE norm_topk_prob)."""
    moe_routing_replay: Literal["rollout", "none"] = "rollout"
    """MoE policies: `rollout` — the rollout engine records each token's experts in every MoE layer and
    the learner's policy forwards replay them (docs/learner.md, "MoE routing replay"); `none` — the
    learner routes on its own. Ignored for dense models."""
    moe_replay_probe: bool = False
    """With replay: one more no-grad policy forward per step routing on its own (same tokens, same
    weights) gives `moe/own_routing_k3`, what `mismatch/k3` would be without replay (docs/learner.md)."""
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype."""
    attention_backend: Literal["auto", "sdpa", "tree_triton"] = "auto"
    """Core attention leaf: tree_triton on GPU with Triton, sdpa with a materialised tree mask otherwise."""

    def validate(self) -> None:
        require(
            not (self.num_experts and self.moe_router_topk == 1 and self.moe_norm_topk_prob),
            "moe_norm_topk_prob",
            "top-1 routing with renormalised weights (all 1) is not representable by "
            "megatron-core's router; set it false (weight = the softmax probability)",
        )
        msg = "compares replayed with own routing: it needs moe_routing_replay: rollout"
        require(not self.moe_replay_probe or self.moe_routing_replay == "rollout", "moe_replay_probe", msg)


@dataclass
class ParallelConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda when available."""
    tensor_model_parallel_size: int = 1
    """TP degree."""
    pipeline_model_parallel_size: int = 1
    """PP degree."""
    expert_model_parallel_size: int = 1
    """EP degree (MoE only)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (required for MoE with TP > 1)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks."""
    micro_batch_tokens: int = 4096
    """Packed tokens per micro-batch."""
    recompute_activations: bool = False
    """Keep only each layer's input for backward and recompute the layer there (megatron's full
    recompute, one layer per checkpoint): activation memory of one layer instead of all."""
    collective_timeout_s: float = 1800.0
    """Timeout of the process group's collectives: a rank that never reaches one (a hung engine or
    tool on another replica) fails the step after this long instead of waiting forever."""

    def validate(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
            require(getattr(self, name) >= 1, name, "must be >= 1")
        require(self.collective_timeout_s > 0, "collective_timeout_s", "must be > 0")


@dataclass
class OptimConfig:
    lr: float = 1e-5
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the schedule."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_decay_steps: int = 0
    """0: constant LR after warm-up; else cosine decay to min_lr, reaching it at this step."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad_norm: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    mini_batches_per_step: int = 1
    """Optimiser steps per epoch: the step's trees are split into this many mini-batches of whole
    trees (balanced by tokens, deterministic); capped at (number of trees) / (data-parallel size)."""
    contrasted_trees_per_mini_batch: int = 0
    """> 0: instead, one mini-batch per this many contrasted trees (nonzero advantage somewhere),
    rounded, at least 1, so a batch with more contrast takes more optimiser steps (verl's DAPO: a
    fixed count of kept groups per step). 0: `mini_batches_per_step`."""
    epochs_per_step: int = 1
    """Passes over the step's mini-batches. With 1 mini-batch and 1 epoch the update is on-policy
    (the old log-probs are the current ones, so PPO's ratio is exactly 1)."""
    max_consecutive_skipped: int = 5
    """Stop the run (after a checkpoint, with `checkpoint.dir`) once this many steps in a row were
    skipped: a step counts as skipped when any of its optimiser steps had a non-finite loss or
    gradient norm and so updated nothing (`loss/skipped` > 0). 0: never stop."""

    def validate(self) -> None:
        require(self.max_consecutive_skipped >= 0, "max_consecutive_skipped", "must be >= 0 (0: never stop)")
        require(self.lr > 0, "lr", "must be > 0")
        require(self.mini_batches_per_step >= 1, "mini_batches_per_step", "must be >= 1")
        require(self.contrasted_trees_per_mini_batch >= 0, "contrasted_trees_per_mini_batch", "must be >= 0")
        require(
            self.contrasted_trees_per_mini_batch == 0 or self.mini_batches_per_step == 1,
            "contrasted_trees_per_mini_batch",
            "sizes the mini-batches itself: leave mini_batches_per_step at 1",
        )
        require(self.epochs_per_step >= 1, "epochs_per_step", "must be >= 1")


@dataclass
class LossConfig:
    name: str = "ppo_clip_token"
    """Loss registry name: ppo_clip_token (GRPO) | dapo | gspo (trace_mega/objective/losses.py)."""
    clip_eps_low: Optional[float] = None
    """Lower clip range of the ratio (None: the loss's default, 0.2; gspo 3e-4)."""
    clip_eps_high: Optional[float] = None
    """Upper clip range (None: the loss's default, 0.2; dapo clip-higher 0.28; gspo 4e-4)."""
    dual_clip_c: Optional[float] = 3.0
    """Dual-clip constant c > 1: for A < 0 the per-token loss is at most -c*A, so one token with a huge
    ratio cannot dominate the batch (verl's clip_ratio_c, default 3); None disables."""
    aggregation: Optional[Literal["token_mean", "sequence_mean", "prompt_mean", "seq_mean_token_sum_norm"]] = None
    """Unit the loss is averaged over: tokens | sequences (root-to-leaf paths) | prompts |
    sequences with a constant per-sequence normaliser (Dr.GRPO) (None: the loss's own)."""
    seq_norm_tokens: Optional[int] = None
    """seq_mean_token_sum_norm: the constant C each sequence's token sum is divided by
    (None: rollout.max_total_tokens, filled in by the learner)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference."""
    kl_clamp: Optional[float] = 10.0
    """Clamp of the per-token k3 KL value to [0, kl_clamp] (verl's low_var_kl clamps at 10); None: no clamp.
    The log-ratio inside it is always clamped to +-20 before exp."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    old_logprobs: Literal["learner", "behaviour"] = "learner"
    """Log-probs the PPO ratio is taken against: learner (one no-grad learner forward before the first
    update of the step) | behaviour (the rollout engine's sampling log-probs)."""
    rollout_is: Literal["none", "token", "sequence"] = "none"
    """Truncated importance weights min(pi_old / pi_engine, cap) on the loss against the engine-vs-learner
    mismatch (docs/credit.md "Rollout importance correction"): per token, per root-to-leaf path, or none."""
    rollout_is_cap: float = 2.0
    """Cap C of the truncated importance weights (verl's rollout_is_threshold, default 2)."""
    rollout_is_batch_normalize: bool = False
    """Divide the rollout_is weights by their mean over the step's batch and ranks (verl's field of that name);
    an otherwise on-policy update then runs one no-grad forward for its old log-probs."""
    rollout_mask: Literal["none", "token", "sequence", "geometric"] = "none"
    """Weight 0 where the ratio pi_old / pi_engine of a token, a path (product) or a path's geometric mean
    leaves [rollout_mask_low, rollout_mask_high]; times rollout_is (IcePop / MIS, docs/learner.md)."""
    rollout_mask_low: float = 0.5
    """Lower bound of the kept ratio pi_old / pi_engine (IcePop's 0.5)."""
    rollout_mask_high: float = 2.0
    """Upper bound of the kept ratio pi_old / pi_engine (IcePop's 2)."""
    rollout_reject: Literal[
        "none", "token_k2", "token_k3", "seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"
    ] = "none"  # fmt: skip
    """verl's rollout_rs: weight 0 where k2 or k3 of r = pi_old / pi_engine, per token or per path (sum / mean
    / max), exceeds rollout_reject_max; times the other factors (docs/learner.md)."""
    rollout_reject_max: float = 0.01
    """Largest kept divergence of rollout_reject (verl's K3-RS preset: 0.01)."""

    def validate(self) -> None:
        for name in ("clip_eps_low", "clip_eps_high"):
            v = getattr(self, name)
            require(v is None or v >= 0, name, "must be >= 0")
        require(self.dual_clip_c is None or self.dual_clip_c > 1, "dual_clip_c", "must be > 1 (or null)")
        require(self.seq_norm_tokens is None or self.seq_norm_tokens >= 1, "seq_norm_tokens", "must be >= 1")
        require(self.kl_coef >= 0, "kl_coef", "must be >= 0")
        require(self.kl_clamp is None or self.kl_clamp > 0, "kl_clamp", "must be > 0 (or null)")
        require(self.rollout_is_cap >= 1, "rollout_is_cap", "must be >= 1")
        require(0 < self.rollout_mask_low <= 1, "rollout_mask_low", "must be in (0, 1] (ratio 1 is kept)")
        require(self.rollout_mask_high >= 1, "rollout_mask_high", "must be >= 1 (ratio 1 is kept)")
        require(self.rollout_reject_max > 0, "rollout_reject_max", "must be > 0")
        for name in ("rollout_is", "rollout_mask", "rollout_reject"):  # against behaviour every ratio is 1
            msg = "weighs the learner's old log-probs against the engine's; needs old_logprobs: learner"
            require(getattr(self, name) == "none" or self.old_logprobs == "learner", name, msg)
        msg = "normalises the rollout_is weights: set rollout_is"
        require(not self.rollout_is_batch_normalize or self.rollout_is != "none", "rollout_is_batch_normalize", msg)


@dataclass
class AdvantageConfig:
    name: str = "tree"
    """Advantage estimator registry name: grpo | rloo | tree | gigpo (the outcome term; credit.enabled adds TRACE-C)."""
    normalize_std: bool = False
    """Divide group-relative advantages by the group's reward std."""
    shared_token_weight: Literal["once", "per_leaf"] = "once"
    """Loss weight of a shared-prefix token: once (1) | per_leaf (leaves below it: equals flattened training)."""
    drop_uncontrasted: bool = False
    """Tokens of a tree whose advantages are all 0 weigh 0, so the loss's mean runs over the trees with signal, as on
    dynamic sampling's filtered batch (the trees still reach the predictor)."""
    drop_uncontrasted_from: Literal["loss", "policy_gradient"] = "loss"
    """What drop_uncontrasted drops them from: loss (KL, entropy too) | policy_gradient (alone: losses.signal_scale)."""
    gigpo_step_weight: float = 1.0
    """gigpo: weight omega of the anchor-state (step) advantage added to the episode advantage."""
    gigpo_gamma: float = 0.95
    """gigpo: discount of the outcome reward back to each turn (step return gamma^(turns to the end) * r)."""

    def validate(self) -> None:
        require(0 < self.gigpo_gamma <= 1, "gigpo_gamma", "must be in (0, 1]")
        ok = self.drop_uncontrasted or self.drop_uncontrasted_from == "loss"
        require(ok, "drop_uncontrasted_from", "says what drop_uncontrasted drops trees from: set drop_uncontrasted")
        msg = "picks the outcome term (grpo | rloo | tree | gigpo); TRACE-C is switched on by credit.enabled"
        require(self.name != "trace_credit", "name", msg)
        msg = "rloo's leave-one-out baseline is not std-normalised"
        require(not (self.name == "rloo" and self.normalize_std), "normalize_std", msg)


@dataclass
class CreditConfig:
    enabled: bool = False
    """TRACE-C turn credit from the frozen reference (composes with any advantage estimator)."""
    epsilon: float = 0.1
    """Offset eps in V(S_k) = log((-l_0 + eps) / (-l_k + eps))."""
    lookahead_turns: int = 2
    """K of the truncated K-step TD backup."""
    gamma_td: float = 0.9
    """Discount of the look-ahead."""
    mixing: Literal["auto", "anchored", "broadcast"] = "auto"
    """broadcast: every turn A_out + beta * R_k (with the tree outcome term every turn keeps its
    branch-point contrasts); anchored (the paper's literal rule): turn k gets beta * R_k, the final
    turn beta * R_K + A_out; auto: broadcast with advantage.name tree (TRACE-A + TRACE-C), anchored
    otherwise (docs/credit.md)."""
    beta: float = 1.0
    """Weight of the turn credit."""
    answer_template: str = "\nFinal answer: "
    """Text placed between a prefix and the gold answer when scoring it."""
    max_answer_tokens: int = 32
    """Longest gold answer (in tokens, as split after `answer_template`) the probe scores; a longer one is
    refused with an error, not scored: the mean log-prob of a long or open answer is an unreliable state
    value (the method's stated limitation, docs/credit.md). 32 covers short entity / number answers under a
    byte-level tokenizer."""

    def validate(self) -> None:
        require(self.epsilon > 0, "epsilon", "must be > 0")
        require(self.lookahead_turns >= 1, "lookahead_turns", "must be >= 1")
        require(self.max_answer_tokens >= 1, "max_answer_tokens", "must be >= 1")


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    """Checkpoint directory (None: no checkpoints)."""
    every_steps: int = 10
    """Save every this many steps."""
    resume: bool = True
    """Resume from the newest intact checkpoint in `dir` when there is one (a damaged or incomplete
    newer one is skipped with a warning naming the broken file; docs/operations.md)."""
    keep_last: int = 2
    """Complete checkpoints kept: once a new one is complete, rank 0 removes the older ones beyond the
    newest this-many, with their predictor files (0: keep all). The newest is never removed."""
    keep_every: Optional[int] = None
    """Milestones kept for good whatever `keep_last` says: checkpoints whose step is a multiple of this
    (None or 0: none)."""
    export_hf_at_end: bool = False
    """When training ends, write the policy as an HF checkpoint to `<telemetry.out_dir>/hf`
    (safetensors, config.json, tokenizer, generation config; what `trace-mega export` writes)."""
    exit_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that stop the run cleanly (with `dir` set): every rank finishes the current step,
    checkpoints it and exits with code 75, which scripts/slurm/train.sbatch turns into a requeue
    (docs/operations.md "Preemption"). [] leaves every signal's default action."""
    exit_after_minutes: Optional[float] = None
    """Wall-clock limit of this process in minutes: the first step boundary past it stops the run as
    an exit signal does (None: no limit; needs `dir`)."""

    def validate(self) -> None:
        require(self.every_steps >= 1, "every_steps", "must be >= 1")
        require(self.keep_last >= 0, "keep_last", "must be >= 0 (0 keeps every checkpoint)")
        require(self.keep_every is None or self.keep_every >= 0, "keep_every", "must be >= 0 (or null)")
        known = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGQUIT")
        for name in self.exit_signals:
            require(name in known, "exit_signals", f"{name!r} is not one of {', '.join(known)}")
        if self.exit_after_minutes is not None:
            require(self.exit_after_minutes > 0, "exit_after_minutes", "must be > 0 (or null)")
            require(self.dir is not None, "exit_after_minutes", "needs checkpoint.dir (the run stops to resume)")


@dataclass
class TelemetryConfig:
    out_dir: str = "runs/default"
    """Where metrics.jsonl, TensorBoard events and plots go."""
    tensorboard: bool = True
    """Also write TensorBoard events."""
    progress_bars: bool = True
    """tqdm bars on rollout and training phases."""
    wandb_project: Optional[str] = None
    """Weights & Biases project to log the same scalars to (None: no W&B; needs the `wandb` extra)."""
    wandb_entity: Optional[str] = None
    """W&B entity (team or user); None: the logged-in default."""
    wandb_run_name: Optional[str] = None
    """W&B run name; None: W&B picks one."""
    wandb_mode: Optional[Literal["online", "offline", "disabled"]] = None
    """W&B mode; None: W&B's default (WANDB_MODE, else online). offline writes under out_dir/wandb for `wandb sync`."""


@dataclass
class EvalConfig:
    split: str = "test"
    """Task split evaluated by `trace-mega eval` and by periodic validation."""
    samples_per_task: int = 4
    """n: sampled rollouts per task (pass@k needs k <= n); sampling follows `rollout` (temperature, top_p)."""
    ks: Optional[list[int]] = None
    """The k of pass@k, each in 1..samples_per_task (None: 1, 2, 4, ... up to n, and n)."""
    success_threshold: float = 0.5
    """A sample counts as solved when its reward is above this (binary rewards: 1 solved, 0 not)."""
    max_tasks: Optional[int] = None
    """Evaluate the first this-many tasks of the split (None: all)."""
    batch_tasks: int = 64
    """Tasks rolled out together (bounds the engine's batch to batch_tasks * samples_per_task)."""
    every_steps: int = 0
    """Periodic validation during training: every this many steps and after the last (0: off).
    Its metrics go into that step's metrics.jsonl row (eval/<split>/pass@k, ...)."""
    seed: int = 1_000_000
    """Sampling seed of evaluation rollouts (the same at every validation, so runs and steps compare)."""

    def validate(self) -> None:
        n = self.samples_per_task
        require(n >= 1, "samples_per_task", "must be >= 1")
        require(self.ks is None or all(1 <= k <= n for k in self.ks), "ks", f"every k must be in 1..{n}")
        require(self.max_tasks is None or self.max_tasks >= 1, "max_tasks", "must be >= 1")
        require(self.batch_tasks >= 1, "batch_tasks", "must be >= 1")
        require(self.every_steps >= 0, "every_steps", "must be >= 0")

    def resolved_ks(self) -> list[int]:
        """The k values in force, ascending: `ks`, else the powers of 2 below n, and n."""
        n = self.samples_per_task
        return sorted(set(self.ks)) if self.ks is not None else [1 << i for i in range((n - 1).bit_length())] + [n]


@dataclass
class ClusterConfig:
    nodes: int = 1
    """Nodes the run is launched on (`trace-mega plan` checks the config fits them)."""
    gpus_per_node: int = 8
    """GPUs per node (one torchrun process each)."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU (H100 SXM: 80)."""
    reserve_gib: float = 3.0
    """Per-GPU memory the plan keeps free for the CUDA context, NCCL buffers and allocator fragmentation."""
    engine_working_memory_gib: float = 1.0
    """Per-GPU memory of a rollout engine beside its weights and KV cache (activations, sampler, CUDA graphs)."""

    def validate(self) -> None:
        require(self.nodes >= 1, "nodes", "must be >= 1")
        require(self.gpus_per_node >= 1, "gpus_per_node", "must be >= 1")
        require(self.gpu_memory_gib > 0, "gpu_memory_gib", "must be > 0")


@dataclass
class TrainConfig:
    steps: int = 10
    """Trainer steps."""
    seed: int = 0
    """Seed of data order, sampling and init."""
    allocation: AllocationConfig = field(default_factory=AllocationConfig)
    predictor: PredictorConfig = field(default_factory=PredictorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    credit: CreditConfig = field(default_factory=CreditConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def validate(self) -> None:
        require(self.steps >= 0, "steps", "must be >= 0")
