"""Per-prompt outcome memory: a prompt's own earlier root outcomes, pooled with the predictor's prediction.

The predictor ranks prompts by what they share (their words, the policy's state at their last token).
At a small budget it sees each train prompt's groups about twice a run, so within a difficulty level it
ranks weakly, and a prompt's own last group says more about its next one (docs/results/allocation.md,
attempt 22; docs/allocation.md, "Prompt memory"). The memory is a Beta posterior per prompt whose prior
mean is the prediction v, worth `prior_rollouts` rollouts, and whose evidence is the prompt's earlier
root rollouts, each weighted by 2^(-age / half_life_steps) because the policy moves between visits:

    v_post = (prior_rollouts * v + sum_j w_j r_j) / (prior_rollouts + sum_j w_j)

A prompt never served keeps v. The memory reads the step's exchanged trees, so it is the same on every
rank, and it is checkpointed with the trainer.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from trace_mega.rollout.tree import RolloutTree


class PromptMemory:
    """Decayed reward sums and rollout counts of every task's root rollouts, indexed like the task set."""

    def __init__(self, num_tasks: int, prior_rollouts: float, half_life_steps: float) -> None:
        self.prior_rollouts = float(prior_rollouts)
        self.half_life_steps = float(half_life_steps)
        self.reward_sum = torch.zeros(num_tasks, dtype=torch.float64)  # (num_tasks,) decayed to `last_step`
        self.count = torch.zeros(num_tasks, dtype=torch.float64)  # (num_tasks,) decayed rollout weights
        self.last_step = torch.zeros(num_tasks, dtype=torch.float64)  # (num_tasks,) step of the last update
        self._planned: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        self._metrics: dict[str, float] = {}

    @property
    def enabled(self) -> bool:
        return self.prior_rollouts > 0

    def _decayed(self, idx: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.pow(0.5, (step - self.last_step[idx]) / self.half_life_steps)
        return self.reward_sum[idx] * w, self.count[idx] * w

    def pool(self, task_index: Sequence[int], v: torch.Tensor, step: int, read: bool = True) -> torch.Tensor:
        """(B,) the posterior success of the step's candidates `task_index` given their predictions `v`
        (B,); `v` itself when the memory is off or `read` is False (an allocator that reads no prediction)."""
        if not (self.enabled and read):
            self._planned = None
            return v
        idx = torch.as_tensor(list(task_index), dtype=torch.long)
        s, n = self._decayed(idx, step)
        prior = v.detach().cpu().double()
        post = (self.prior_rollouts * prior + s) / (self.prior_rollouts + n)
        self._planned = (idx, prior, post)
        return post.to(device=v.device, dtype=v.dtype)

    def record(self, task_index: Sequence[int], trees: Sequence[RolloutTree], step: int) -> None:
        """Add the root rollouts of `trees` (one per candidate in `task_index`, as the rollout returns
        them, before any continuation) to the memory; a tree without leaves adds nothing. Off, it keeps
        nothing (and checkpoints nothing)."""
        if not self.enabled:
            return
        rewards = [t.leaf_rewards() for t in trees]
        served = torch.as_tensor([j for j, r in enumerate(rewards) if r], dtype=torch.long)
        sums = torch.tensor([sum(rewards[j]) for j in served.tolist()], dtype=torch.float64)
        counts = torch.tensor([float(len(rewards[j])) for j in served.tolist()], dtype=torch.float64)
        self._metrics = self._scores(served, sums / counts)
        if not served.numel():
            return
        idx = torch.as_tensor(list(task_index), dtype=torch.long)[served]
        s, n = self._decayed(idx, step)
        self.reward_sum[idx] = s + sums
        self.count[idx] = n + counts
        self.last_step[idx] = float(step)

    def _scores(self, served: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        """The Brier scores against the served candidates' (`served`) group means `target` of the plan's
        posterior and of the prediction it pooled (`memory/brier`, `memory/brier_prediction`), and the
        share of served candidates the memory knew (`memory/known_fraction`)."""
        if self._planned is None or not served.numel():
            return {}
        idx, prior, post = self._planned
        return {
            "memory/brier": float(((post[served] - target) ** 2).mean()),
            "memory/brier_prediction": float(((prior[served] - target) ** 2).mean()),
            "memory/known_fraction": float((self.count[idx[served]] > 0).double().mean()),
        }

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able (the trainer state is JSON): the tasks served so far and their entries."""
        idx = torch.nonzero(self.count > 0).flatten()
        return {"num_tasks": self.count.numel(), "index": idx.tolist()} | {
            name: getattr(self, name)[idx].tolist() for name in ("reward_sum", "count", "last_step")
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["num_tasks"]) != self.count.numel():
            raise ValueError(f"prompt memory of {state['num_tasks']} tasks, the task set has {self.count.numel()}")
        idx = torch.as_tensor(state["index"], dtype=torch.long)
        for name in ("reward_sum", "count", "last_step"):
            value = torch.zeros_like(getattr(self, name))
            value[idx] = torch.as_tensor(state[name], dtype=torch.float64)
            setattr(self, name, value)
