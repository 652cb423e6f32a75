"""Stopping a run cleanly at a step boundary (docs/operations.md "Preemption and the wall-clock limit").

`StopWatch` is asked once per step, after the step is logged, whether the run should stop:

* an exit signal (`checkpoint.exit_signals`, e.g. Slurm's SIGUSR1 ahead of a preemption or the
  time limit) reached some rank since the last step boundary;
* the process has run `checkpoint.exit_after_minutes`;
* `optim.max_consecutive_skipped` steps in a row updated nothing (non-finite loss or gradients).

Every rank must stop after the same step (the checkpoint that follows is a collective), so the
signal and clock flags are all-reduced (MAX) over the default process group at every boundary: a
signal that reached one rank (or one node) stops all of them. The skipped counts need no
collective: the learner's loss and gradient norm are reduced over every rank already, so each
rank sees the same `loss/skipped`.

The trainer checkpoints the step and returns the `Stop`; the command exits with its code. A
preemption or the clock exits with `REQUEUE_EXIT_CODE`, and when the launcher
(`trace_mega.commands.launch`, whose torchrun does not pass the workers' codes on) set
`EXIT_FILE_ENV`, the code is also written to that file for it to read.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

log = logging.getLogger("trace_mega")

REQUEUE_EXIT_CODE = 75
"""EX_TEMPFAIL ("try again later"): stopped for a signal or the clock after a checkpoint; rerunning
the same command resumes. scripts/slurm/train.sbatch requeues the job on it."""
SKIPPED_EXIT_CODE = 3
"""Stopped after `optim.max_consecutive_skipped` skipped steps: rerunning would skip again."""
EXIT_FILE_ENV = "TRACE_MEGA_EXIT_FILE"
"""Set by the launcher: where a worker that stops writes its exit code (torchrun reports only 1)."""

# The metrics a skipped step is blamed on, in the order they are named.
_GUARDED = ("loss/total", "loss/grad_norm")


@dataclass
class Stop:
    """Why the run stopped after `step` (the last step done and checkpointed)."""

    step: int
    """The last step the run completed (its metrics are logged)."""
    message: str
    """One line for the user."""
    exit_code: int
    """The command's exit status: `REQUEUE_EXIT_CODE` or `SKIPPED_EXIT_CODE`."""


class StopWatch:
    """Exit signals, the wall-clock limit and the run of skipped steps, checked at step boundaries."""

    def __init__(
        self,
        signals: list[str],
        exit_after_minutes: Optional[float],
        max_consecutive_skipped: int,
        device: torch.device,
    ) -> None:
        self.exit_after_s = None if exit_after_minutes is None else 60.0 * exit_after_minutes
        self.max_skipped = max_consecutive_skipped
        self.device = device
        self.started = time.monotonic()
        self.received: Optional[str] = None  # the first exit signal's name, set by the handler
        self.skipped_run = 0  # consecutive skipped steps so far
        self._previous: dict[int, object] = {}
        # Python runs handlers in the main thread only; a trainer built elsewhere (a test's thread)
        # keeps the default actions.
        if threading.current_thread() is threading.main_thread():
            for name in signals:
                sig = signal.Signals[name]
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame) -> None:
        # Only a flag: the step in flight (collectives, engine calls) must run to its end.
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
            log.warning("got %s: stopping after the current step (checkpoint, then exit)", name)

    def check(self, step: int, metrics: dict[str, float]) -> Optional[Stop]:
        """The stop after `step`, if any (the same on every rank); `metrics` is the step's record."""
        timed_out = self.exit_after_s is not None and time.monotonic() - self.started >= self.exit_after_s
        flags = torch.tensor([float(self.received is not None), float(timed_out)], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        got_signal, timed_out = (bool(f) for f in flags.tolist())
        if got_signal:
            # The rank that got it names it; the others say a peer got one.
            what = self.received or "an exit signal on another rank"
            return Stop(step, f"stopped after step {step}: {what}", REQUEUE_EXIT_CODE)
        if timed_out:
            minutes = self.exit_after_s / 60.0
            message = f"stopped after step {step}: checkpoint.exit_after_minutes={minutes:g} reached"
            return Stop(step, message, REQUEUE_EXIT_CODE)
        return self._check_skipped(step, metrics)

    def _check_skipped(self, step: int, metrics: dict[str, float]) -> Optional[Stop]:
        if not metrics.get("loss/skipped", 0.0):
            self.skipped_run = 0
            return None
        self.skipped_run += 1
        if not self.max_skipped or self.skipped_run < self.max_skipped:
            return None
        bad = [f"{k} = {metrics[k]}" for k in _GUARDED if k in metrics and not math.isfinite(metrics[k])]
        if metrics.get("credit/probe_nonfinite"):  # the cause of the NaN loss, when it was the probe
            bad.insert(0, f"credit/probe_nonfinite = {metrics['credit/probe_nonfinite']:g}")
        what = ", ".join(bad) or f"loss/skipped = {metrics['loss/skipped']:g}"
        return Stop(
            step,
            f"stopped after step {step}: {self.skipped_run} steps in a row updated nothing "
            f"(optim.max_consecutive_skipped={self.max_skipped}); step {step}: {what}",
            SKIPPED_EXIT_CODE,
        )

    def close(self) -> None:
        """Give the signals their previous handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def report_exit(stop: Stop) -> None:
    """Write `stop`'s exit code where the launcher reads it (`EXIT_FILE_ENV`), when it asked."""
    path = os.environ.get(EXIT_FILE_ENV)
    if path:
        Path(path).write_text(f"{stop.exit_code}\n")
