"""Evaluation as papers report it: pass@k, mean@n and accuracy per benchmark.

Each task of a split gets n sampled rollouts (`eval.samples_per_task`); a
sample is solved when its reward is above `eval.success_threshold`. Per task
with c solved samples out of n:

* pass@k — the unbiased estimator 1 - C(n-c, k) / C(n, k) of the chance that
  at least one of k samples solves the task (Chen et al., 2021, "Evaluating
  Large Language Models Trained on Code"), for every k in 1..n;
* mean@n — the mean reward of the n samples (for binary rewards the accuracy,
  equal to pass@1; for F1-style rewards the mean score). It is also the
  unbiased estimate of mean@k for every k <= n;
* none_solved / all_solved — the share of tasks with no / every sample solved:
  under uniform sampling with groups of n, the prompts whose group has no
  contrast (paper Fig. 2a). The report also counts the tasks by number of
  solved samples, 0..n (`EvalReport.solved_histogram`).

Tasks are grouped by the benchmark they come from — the first of their meta
fields `benchmark`, `data_source`, `source` (math files: the file name),
`dataset` (multi-hop QA: hotpotqa, 2wikimultihopqa, musique, bamboogle, or the
file name) and `category` (BFCL: base, long_context, miss_func, miss_param).
The report has one row per group, `all` (every task) and, with several groups,
`macro` (the unweighted mean of the groups, as papers average benchmarks).
It is written as JSON and as a Markdown table.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from trace_mega.config import EvalConfig

GROUP_KEYS = ("benchmark", "data_source", "source", "dataset", "category")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of a task with `c` solved out of `n` samples: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i): no large binomials.
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def group_of(meta: dict[str, Any], default: str = "all") -> str:
    """The benchmark a task belongs to, from its meta (see the module docstring)."""
    for key in GROUP_KEYS:
        value = meta.get(key)
        if value not in (None, ""):
            return str(value)
    return default


@dataclass
class TaskResult:
    """The n sampled rewards of one task."""

    task_id: str
    group: str
    rewards: list[float]


@dataclass
class EvalReport:
    split: str
    n: int
    ks: list[int]
    rows: dict[str, dict[str, float]]
    """Group (and `all`, `macro`) -> {"tasks", "mean@n", "pass@k" for each k, "none_solved", "all_solved"}."""
    tasks: list[TaskResult] = field(default_factory=list)
    success_threshold: float = 0.5
    """A sample is solved when its reward is above this."""

    def solved_histogram(self) -> list[int]:
        """Tasks by number of solved samples: entry c counts the tasks with c of n solved, c = 0..n."""
        counts = [0] * (self.n + 1)
        for t in self.tasks:
            counts[sum(r > self.success_threshold for r in t.rewards)] += 1
        return counts

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        """Flat scalars for the metrics sink: `<prefix>/<split>/pass@1` (all tasks) and
        `<prefix>/<split>/<group>/pass@1`; `<prefix>/<split>/reward` is mean@n of all tasks."""
        out: dict[str, float] = {}
        for group, row in self.rows.items():
            base = f"{prefix}/{self.split}" if group == "all" else f"{prefix}/{self.split}/{group}"
            out |= {f"{base}/{k}": v for k, v in row.items()}
        out[f"{prefix}/{self.split}/reward"] = self.rows["all"][f"mean@{self.n}"]
        return out

    def columns(self) -> list[str]:
        return ["tasks", f"mean@{self.n}", *(f"pass@{k}" for k in self.ks)]

    def markdown(self) -> str:
        cols = self.columns()
        lines = [f"| {self.split} | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
        for group, row in self.rows.items():
            cells = [f"{row['tasks']:.0f}"] + [f"{100 * row[c]:.1f}" for c in cols[1:]]
            name = f"**{group}**" if group in ("all", "macro") else group
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += ["", f"mean@{self.n} and pass@k in %; n = {self.n} samples per task."]
        if self.tasks:
            hist = self.solved_histogram()
            lines += [
                "",
                "| solved samples | " + " | ".join(str(c) for c in range(self.n + 1)) + " |",
                "|---|" + "---:|" * (self.n + 1),
                "| tasks | " + " | ".join(str(h) for h in hist) + " |",
            ]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "n": self.n,
            "ks": self.ks,
            "rows": self.rows,
            "success_threshold": self.success_threshold,
            "solved_histogram": self.solved_histogram(),
            "tasks": [{"task_id": t.task_id, "group": t.group, "rewards": t.rewards} for t in self.tasks],
        }

    def write(self, out_dir: str | Path, name: str) -> tuple[Path, Path]:
        """`<out_dir>/<name>.json` and `<name>.md`."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        js, md = out / f"{name}.json", out / f"{name}.md"
        js.write_text(json.dumps(self.to_json(), indent=1))
        md.write_text(self.markdown())
        return js, md


def summarize(
    results: Sequence[TaskResult], ks: Sequence[int], split: str = "test", success_threshold: float = 0.5
) -> EvalReport:
    """The report of `results` (every task with the same number n of samples)."""
    if not results:
        raise ValueError("no tasks to evaluate")
    n = len(results[0].rewards)
    if n == 0 or any(len(r.rewards) != n for r in results):
        raise ValueError(
            f"every task needs the same number (>= 1) of samples; got {sorted({len(r.rewards) for r in results})}"
        )
    ks = sorted(set(ks))
    if not all(1 <= k <= n for k in ks):
        raise ValueError(f"every k must be in 1..{n}, got {ks}")

    def row(items: Sequence[TaskResult]) -> dict[str, float]:
        solved = [sum(r > success_threshold for r in t.rewards) for t in items]
        out = {"tasks": float(len(items)), f"mean@{n}": statistics.fmean(statistics.fmean(t.rewards) for t in items)}
        for k in ks:
            out[f"pass@{k}"] = statistics.fmean(pass_at_k(n, c, k) for c in solved)
        out["none_solved"] = statistics.fmean(float(c == 0) for c in solved)
        out["all_solved"] = statistics.fmean(float(c == n) for c in solved)
        return out

    groups: dict[str, list[TaskResult]] = {}
    for r in results:
        groups.setdefault(r.group, []).append(r)
    rows = {g: row(items) for g, items in sorted(groups.items())}
    if len(rows) > 1:
        macro = {k: statistics.fmean(r[k] for r in rows.values()) for k in next(iter(rows.values()))}
        macro["tasks"] = float(len(results))
        rows["all"], rows["macro"] = row(results), macro
    else:
        rows = {"all": row(results)}
    return EvalReport(
        split=split, n=n, ks=list(ks), rows=rows, tasks=list(results), success_threshold=success_threshold
    )


def results_from_trees(trees: Sequence[Any]) -> list[TaskResult]:
    """One `TaskResult` per rollout tree of bare rollouts (its leaves are the samples)."""
    return [TaskResult(t.prompt_id, group_of(t.meta, t.meta.get("env", "all")), t.leaf_rewards()) for t in trees]


def evaluate(agent: Any, env: Any, cfg: EvalConfig, split: Optional[str] = None) -> EvalReport:
    """Roll out `cfg.samples_per_task` samples of every task of `split` with `agent` and summarise.

    Tasks go `cfg.batch_tasks` at a time; a batch's sampling seed is `cfg.seed` plus the index
    of its first task, so the report depends only on the policy, the config and the task list.
    """
    split = split or cfg.split
    tasks = env.tasks(split)
    if cfg.max_tasks is not None:
        tasks = tasks[: cfg.max_tasks]
    results: list[TaskResult] = []
    env.reseed(cfg.seed)
    for start in range(0, len(tasks), cfg.batch_tasks):
        batch = tasks[start : start + cfg.batch_tasks]
        trees = agent.rollout(batch, [cfg.samples_per_task] * len(batch), seed=cfg.seed + start)
        agent.release(trees)
        results += results_from_trees(trees)
    return summarize(results, cfg.resolved_ks(), split, cfg.success_threshold)
