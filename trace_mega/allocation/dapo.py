"""DAPO dynamic sampling as an allocator (`dapo`), on the budget of every other allocator.

Dynamic sampling (DAPO; verl's `algorithm.filter_groups`, NeMo-RL's `use_dynamic_sampling`)
draws prompts, rolls out a group of `group_size` per prompt, drops the groups whose rewards are
all equal (all-0 or all-1: no group-relative advantage) and draws again, until the batch holds
`dapo_target_groups` contrasted groups. Here the stream is the step's candidate prompts in the
sampler's order: round r takes the next `dapo_groups_per_round` candidates (verl's gen batches
are the next slices of its shuffled dataloader). No predictor is read.

Every generated trajectory counts against `trajectories_per_step`, the budget the other
allocators spend, so the rounds also end when the budget cannot pay one more group (the last
round is cut to the groups it can pay) or the candidates run out; the step then trains on the
contrasted groups kept, fewer than the target (verl would go on generating up to
`max_num_gen_batches` gen batches and then raise). Contrasted groups beyond the target are cut
in draw order, as verl's `batch[:train_batch_size * n]` does. A candidate drawn in no round, or
dropped, leaves the step (`plan_keep`), except that a step keeps at least `min_trees` groups (the
learner gives each data-parallel rank a tree): one with fewer contrasted groups (none, early in a
run) also keeps the first uncontrasted ones it drew, which carry no advantage.

The plan is a function of `m` and the spreads alone, with no state between rounds: the
candidates drawn so far are always the first ones of the step's order. It runs on the host
between rollout phases (`RolloutCollector.roll_out_rounds`), where the rewards already are.
"""

from __future__ import annotations

import logging
import math

import torch

from trace_mega.allocation.allocators import ALLOCATORS, Allocator
from trace_mega.config import AllocationConfig

log = logging.getLogger(__name__)


@ALLOCATORS.register("dapo")
class DapoAllocator(Allocator):
    """Rounds of fresh `group_size` groups; zero-variance groups dropped; stop at the target or the budget."""

    name = "dapo"

    def __init__(self, cfg: AllocationConfig, **kwargs) -> None:
        super().__init__(cfg, **kwargs)
        self.group_budget = self.trajectories_per_step // cfg.group_size
        """Groups the budget can pay (a remainder below `group_size` stays unspent)."""
        self.target = cfg.dapo_target_groups if cfg.dapo_target_groups is not None else self.group_budget
        self.per_round = cfg.dapo_groups_per_round if cfg.dapo_groups_per_round is not None else self.target
        self._figures: dict[str, float] = {}
        if cfg.prompts_per_step < self.group_budget:
            log.warning(
                "allocation.name=dapo: %d candidate prompts cannot pay the budget's %d groups; the rounds "
                "stop when they run out (raise allocation.prompts_per_step)",
                cfg.prompts_per_step,
                self.group_budget,
            )

    def fewest_trees(self) -> int:
        # The first round draws `per_round` groups; a step keeps at least min_trees of those (plan_keep).
        groups = self.trajectories_per_step // self.cfg.group_size
        target = self.cfg.dapo_target_groups if self.cfg.dapo_target_groups is not None else groups
        per_round = self.cfg.dapo_groups_per_round if self.cfg.dapo_groups_per_round is not None else target
        return min(self.cfg.prompts_per_step, groups, per_round)

    def plan_roots(self, v_root, generator=None):
        self._clean(v_root)  # counted like every allocator's; dapo reads no prediction
        return self._round(torch.zeros(v_root.numel(), dtype=torch.long))

    def plan_refill(self, m, spread, generator=None):
        if int(self._contrasted(m, spread).sum()) >= self.target:
            return torch.zeros_like(m)
        return self._round(m)

    def plan_keep(self, m, spread):
        keep = self._contrasted(m, spread)
        keep &= torch.cumsum(keep.long(), 0) <= self.target  # the surplus cut in draw order
        self._figures = {
            "alloc/dapo_rounds": float(math.ceil(self._drawn(m) / self.per_round)),
            "alloc/kept_groups": float(keep.sum()),
        }
        # The learner needs `min_trees` trees (one per data-parallel rank): a step that kept fewer
        # contrasted groups also keeps the first uncontrasted ones it drew (no advantage in them).
        pad = (m > 0) & ~keep
        pad &= torch.cumsum(pad.long(), 0) <= self.min_trees - int(keep.sum())
        return keep | pad

    def metrics(self) -> dict[str, float]:
        """`alloc/dapo_rounds` and `alloc/kept_groups` of the last step, with the base's counts."""
        out = super().metrics() | self._figures
        self._figures = {}
        return out

    def _round(self, m: torch.Tensor) -> torch.Tensor:
        """(B,) the next round after `m`: `group_size` each for the next candidates in order, as many
        as `per_round`, the unspent budget and the candidates left allow."""
        drawn = self._drawn(m)
        left = self.trajectories_per_step - int(m.sum())
        n = max(0, min(self.per_round, left // self.cfg.group_size, m.numel() - drawn))
        out = torch.zeros_like(m)
        out[drawn : drawn + n] = self.cfg.group_size
        return out

    @staticmethod
    def _drawn(m: torch.Tensor) -> int:
        """Candidates drawn so far: those up to the last one given rollouts (the rounds draw in order)."""
        given = torch.nonzero(m).flatten()
        return int(given.max()) + 1 if given.numel() else 0

    @staticmethod
    def _contrasted(m: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
        """(B,) bool: drawn candidates whose rewards are not all equal (verl: reward std > 0)."""
        return (m > 0) & (spread.to(m.device) > 0)
