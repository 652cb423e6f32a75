"""TRACE-A's two component configs: the allocator (`allocation.*`) and the success predictor (`predictor.*`).
`trace_mega.config` re-exports both; they live here to keep that module short."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from trace_mega.configbase import require


@dataclass
class AllocationConfig:
    name: str = "trace"
    """Allocator registry name: uniform | pcl | treepo | trace | trace_global | dapo."""
    prompts_per_step: int = 64
    """Candidate prompt pool size B drawn each step."""
    root_rollouts_per_step: int = 256
    """Root (bare) rollout budget M per step, shared by all prompts."""
    rollouts_per_prompt_max: int = 8
    """M_max: the most bare rollouts one prompt may get (m_i in {0} ∪ {rollouts_per_prompt_min..M_max})."""
    rollouts_per_prompt_min: int = 2
    """trace / trace_global: the smallest group, m_i in {0} ∪ {min..M_max}; 2 is the paper's (design.md §3.2), `group_size`
    gives no group fewer rollouts than the baselines' (docs/allocation.md "The root head and a minimum group")."""
    root_selection: Literal["solver", "sampled"] = "solver"
    """trace / trace_global: solver, the exact root solver on the predictions; sampled, each candidate in random order is
    accepted with its predicted chance that a `group_size` group is contrasted and the solver serves the first accepted
    ones alike: dynamic sampling's kept prompts, without generating the dropped groups (docs/allocation.md)."""
    group_size: int = 4
    """Fixed group size used by uniform / pcl / treepo (budget / group_size prompts are active)."""
    continuations_per_rollout: float = 1.0
    """N: mean continuation slots per bare rollout (prefix budget of prompt i is m_i * N)."""
    continuations_per_prefix_max: Optional[int] = None
    """Cap on continuations branched from one prefix (None: no cap)."""
    min_turns_left: int = 2
    """Branch only from prefixes with at least this many of `rollout.max_turns` left (1: every prefix; one left can only
    answer: docs/allocation.md "Branch points near the turn limit")."""
    predictor_fallback: bool = True
    """When the predictor's smoothed held-out skill is below `fallback_skill_threshold`, the next
    step uses the allocator's predictor-free counterpart (trace, trace_global -> treepo; pcl ->
    uniform); the predictor keeps fitting meanwhile (`trace_mega.predictor.guard`)."""
    fallback_skill_decay: float = 0.8
    """EMA decay of the Brier scores the guard pools (window ≈ 1 / (1 - decay) steps; 0: the newest alone)."""
    fallback_skill_threshold: float = 0.0
    """Smoothed Brier skill below which the guard falls back (0: worse than the constant)."""
    exploration_fraction: float = 0.0
    """trace / trace_global: share of the root budget given, `rollouts_per_prompt_min` each, to prompts drawn at
    random before the root solver spends the rest (an exploration floor: V(1-V) alone starves
    prompts that succeed about once in 8; docs/allocation.md "Rare successes")."""
    dapo_target_groups: Optional[int] = None
    """dapo: contrasted groups the step trains on (verl's `data.train_batch_size`); its rounds stop
    once that many are kept and the last round's surplus is cut. None: trajectories_per_step //
    group_size, every group the budget can generate (docs/allocation.md "DAPO dynamic sampling")."""
    dapo_groups_per_round: Optional[int] = None
    """dapo: prompts drawn per round, `group_size` rollouts each (verl's `data.gen_batch_size`; None: the target)."""

    def validate(self) -> None:
        require(self.prompts_per_step >= 1, "prompts_per_step", "must be >= 1")
        require(self.root_rollouts_per_step >= 0, "root_rollouts_per_step", "must be >= 0")
        require(self.root_rollouts_per_step != 1, "root_rollouts_per_step", "1 is infeasible (m_i is never 1)")
        require(self.rollouts_per_prompt_max >= 2, "rollouts_per_prompt_max", "must be >= 2")
        require(self.group_size >= 2, "group_size", "must be >= 2 (a lone rollout has no contrast)")
        require(self.min_turns_left >= 1, "min_turns_left", "must be >= 1 (1: every prefix is a branch point)")
        lo, hi = self.rollouts_per_prompt_min, self.rollouts_per_prompt_max
        require(2 <= lo <= hi, "rollouts_per_prompt_min", "must lie in [2, rollouts_per_prompt_max]")
        require(self.continuations_per_rollout >= 0, "continuations_per_rollout", "must be >= 0")
        require(0.0 <= self.fallback_skill_decay < 1.0, "fallback_skill_decay", "must be in [0, 1)")
        require(0.0 <= self.exploration_fraction <= 1.0, "exploration_fraction", "must be in [0, 1]")
        for name in ("dapo_target_groups", "dapo_groups_per_round"):
            require(getattr(self, name) is None or getattr(self, name) >= 1, name, "must be >= 1 (or null)")


@dataclass
class PredictorConfig:
    backend: Literal["value_head", "small_model"] = "value_head"
    """value_head: a head on the policy's hidden states at turn boundaries; small_model: a separate tiny model."""
    lr: float = 1e-3
    """Predictor learning rate."""
    updates_per_step: int = 4
    """Optimiser steps on the newest trees per trainer step."""
    replay_steps: int = 1
    """Train on the trees of the newest this-many steps (1: the newest only, as in the paper); not checkpointed."""
    prefix_sample_fraction: Optional[float] = None
    """Fraction of training samples that are prefixes (rest roots); None keeps the natural mix. Logged either way."""
    replay_decay: float = 1.0
    """Staleness weighting of the replay window: a batch k steps old weighs replay_decay**k (1.0: all equal)."""
    weight_decay: float = 0.0
    """AdamW weight decay of the predictor's parameters: shrinks a value head towards the
    anchored constant (`anchor_at_mean`) when its features carry no signal."""
    anchor_at_mean: bool = False
    """Offset every logit by logit(previous fit's mean target), so an untrained (zero) head
    predicts exactly the constant the fallback guard compares with and the head learns only
    the deviation from it (docs/design.md §3.1)."""
    root_head: bool = False
    """value_head: score the prompts (roots) with a head of their own, anchored at the previous
    fit's mean root target (prefixes keep theirs, at the mean prefix target). The state at a
    prompt's last token lies apart from the turn boundaries', and roots are ~5% of the samples,
    so a shared head predicts about the same value for every prompt (docs/allocation.md
    "The root head and a minimum group")."""
    root_token_bag: bool = False
    """root_head: add the logit of a bag of the prompt's tokens, read from the words themselves, not from
    the policy's state (trace_mega/predictor/token_bag.py; docs/allocation.md "All-0 prompts and a level to learn")."""
    root_bag_pair_buckets: int = 0
    """root_token_bag: also a feature per adjacent token pair, hashed into this many buckets (0: none)."""
    root_bag_hidden_size: int = 0
    """root_token_bag: 0, a logit per feature; above 0, embeddings of this width through ReLU and a linear layer."""
    calibration_bins: int = 10
    """Bins of the ECE / reliability curve."""
    memory_prior_rollouts: float = 0.0
    """Pool each candidate's own earlier root outcomes with its prediction: the prediction is the prior mean of a
    per-prompt Beta posterior, worth this many rollouts (0: no memory; trace_mega/predictor/memory.py)."""
    memory_half_life_steps: float = 100.0
    """memory_prior_rollouts: steps after which a remembered rollout counts half (the policy moves between visits)."""

    def validate(self) -> None:
        require(self.lr > 0, "lr", "must be > 0")
        require(self.calibration_bins >= 2, "calibration_bins", "must be >= 2")
        require(self.replay_steps >= 1, "replay_steps", "must be >= 1")
        require(0.0 < self.replay_decay <= 1.0, "replay_decay", "must be in (0, 1]")
        require(self.weight_decay >= 0.0, "weight_decay", "must be >= 0")
        require(self.memory_prior_rollouts >= 0.0, "memory_prior_rollouts", "must be >= 0 (0: no memory)")
        require(self.memory_half_life_steps > 0.0, "memory_half_life_steps", "must be > 0")
        f = self.prefix_sample_fraction
        require(f is None or 0.0 <= f <= 1.0, "prefix_sample_fraction", "must be in [0, 1]")
        require(not self.root_head or self.backend == "value_head", "root_head", "is a value_head option")
        require(not self.root_token_bag or self.root_head, "root_token_bag", "is a root_head option")
        for name in ("root_bag_pair_buckets", "root_bag_hidden_size"):
            require(getattr(self, name) >= 0 and (not getattr(self, name) or self.root_token_bag), name,
                    "must be >= 0, and set only with root_token_bag")  # fmt: skip
