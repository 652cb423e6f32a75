"""The TRACE training loop (docs/design.md §3.4, docs/step.md), top to bottom in `Trainer.train`.

One step fills one `StepBatch`: plan roots (predictor on the prompts →
`plan_roots`) → roll out (bare rollouts) → score prefixes (predictor on every
prefix, one packed pass → `plan_prefixes`) → expand (continuations from the
chosen prefixes; the engine reuses their KV) → credit (TRACE-C probe when
enabled, advantages) → learn (one optimiser step; its forward leaves the
step's hidden states) → fit predictor (on those hidden states) → sync (the
engine gets the new weights in memory).

Which allocator, advantage estimator, environment and engine run is chosen by
name in the config; every allocator spends the same trajectory budget.
Distributed runs (torchrun): every rank joins the model forwards (they are TP
collectives). Every data-parallel replica (one model-parallel group) has its
own engine and rolls out its share of the step's prompts
(`trace_mega/rollout/replicas.py`, `RolloutCollector`); the trees are
all-gathered after each rollout phase, so every rank holds the same step
record and takes the same (global) allocation decisions with the step's
generator, and the learner trains on each rank's share.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from trace_mega.allocation import Allocator, build_allocator
from trace_mega.config import TrainConfig, save_yaml, to_dict
from trace_mega.envs import build_env
from trace_mega.evaluation import EvalReport, evaluate
from trace_mega.export import policy_tokenizer, write_hf_extras
from trace_mega.learner.advantages import compute_advantages
from trace_mega.learner.credit_metrics import env_credit_accuracy
from trace_mega.learner.learner import Learner, balanced_bins, hf_config
from trace_mega.learner.probe import check_task_answers
from trace_mega.predictor import SkillGuard, build_predictor, plot_reliability
from trace_mega.rollout.collector import RolloutCollector
from trace_mega.rollout.engines import EngineSetup, build_engine
from trace_mega.rollout.replicas import ReplicaLayout
from trace_mega.sampler import PromptSampler, SamplerState
from trace_mega.step import StepBatch
from trace_mega.telemetry import GpuProbe, MetricsSink, PhaseTimer, tree_metrics

log = logging.getLogger("trace_mega")


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        self.env = build_env(cfg.env.name, **cfg.env.options)
        self.tasks = self.env.tasks("train")
        self.tokenizer = policy_tokenizer(cfg, self.env)
        if cfg.model.vocab_size is None:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=len(self.tokenizer)))
        elif cfg.model.hf_checkpoint is None and len(self.tokenizer) > cfg.model.vocab_size:
            raise ValueError(f"model.vocab_size {cfg.model.vocab_size} < tokenizer size {len(self.tokenizer)}")
        self.cfg = cfg
        if cfg.credit.enabled:  # refuse gold answers the probe cannot score before building anything
            check_task_answers(self.tasks, self._encode, cfg.credit.answer_template, cfg.credit.max_answer_tokens)
        self.learner = Learner(cfg)
        g = self.learner.groups
        self.is_main = g.rank == 0
        self.dp_group = g.pgs.dp if g.dp_size > 1 else None  # the predictor's fit sums gradients over it
        layout = ReplicaLayout.from_groups(g, cfg.rollout.tensor_parallel_size)
        if cfg.rollout.engine == "vllm" and g.pp_size > 1 and layout.num_replicas > 1:
            # megatron orders PP outermost, so a replica's ranks are not consecutive; vLLM's
            # external launcher groups consecutive ranks into its tensor-parallel group.
            raise ValueError(
                "rollout.engine vllm with parallel.pipeline_model_parallel_size > 1 runs one replica "
                f"only (here {layout.num_replicas}): use PP = 1 with DP replicas, or the torch engine"
            )
        engine = build_engine(
            EngineSetup(
                rollout=cfg.rollout,
                seed=cfg.seed,
                dtype=cfg.model.params_dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype,
                eos_token_ids=[self.tokenizer.eos_token_id],
                device=self.learner.groups.device,
                policy_config=hf_config(self.learner.model_cfg),
                checkpoint_dir=cfg.model.hf_checkpoint,
                write_checkpoint=self.learner.save_hf,
                work_dir=Path(cfg.telemetry.out_dir),
                host=layout.leader,
                replica_size=g.world_size // layout.num_replicas,
                distributed=g.world_size > 1,
            )
        )
        self.rollouts = RolloutCollector(
            self.env,
            engine,
            self.tokenizer,
            cfg.rollout,
            tool_timeout_s=cfg.env.tool_timeout_s,
            max_tool_calls_per_turn=cfg.env.max_tool_calls_per_turn,
            layout=layout,
        )
        # On GPU the solvers run on the predictions' device without host syncs: no input
        # validation and a static prefix-table width (the most prefixes one prompt can have).
        on_gpu = self.learner.groups.device.type == "cuda"
        sync_free = dict(check=False, max_group_size=cfg.allocation.rollouts_per_prompt_max * cfg.rollout.max_turns)
        self.allocator = build_allocator(cfg.allocation, **(sync_free if on_gpu else {}))
        self.fallback = self.allocator.without_predictor()
        self.predictor = build_predictor(
            cfg.predictor, hidden_size=self.learner.hidden_size, vocab_size=self.learner.model_cfg.vocab_size
        ).to(self.learner.groups.device)
        self.guard = SkillGuard(
            cfg.allocation.fallback_skill_decay,
            cfg.allocation.fallback_skill_threshold,
            enabled=cfg.allocation.predictor_fallback and self.allocator.uses_predictor,
        )
        self.sampler = PromptSampler(len(self.tasks), cfg.seed)
        self.sink = MetricsSink.from_config(cfg.telemetry, to_dict(cfg), enabled=self.is_main)
        if self.is_main:  # the resolved config of the run (`trace-mega export --run OUT_DIR` reads it)
            save_yaml(cfg, Path(cfg.telemetry.out_dir) / "config.yaml")
        self.gpu = GpuProbe()
        self.step = 0
        self.use_fallback = self.guard.fallback  # an unmeasured predictor does not plan step 0
        self.learner.sync_weights(self.rollouts.engine)  # the engine starts from the learner's initial weights
        self._resume()

    # --- the loop ------------------------------------------------------------------
    def train(self) -> None:
        cfg = self.cfg
        steps = range(self.step, cfg.steps)
        for step in tqdm(steps, desc="train", disable=not (self.is_main and cfg.telemetry.progress_bars)):
            # A CPU generator: the allocators draw on the host and move the draws to v's device.
            timer, gen = PhaseTimer(), torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            allocator = self.fallback if self.use_fallback else self.allocator
            self.rollouts.begin_step(seed=cfg.seed * 1_000_003 + step)
            with timer("step"):
                tasks = [self.tasks[i] for i in self.sampler.next(cfg.allocation.prompts_per_step)]
                batch = StepBatch.from_prompts(step, tasks, self.rollouts.prompt_ids(tasks))
                batch.v_root = self._predict(batch, batch.root_nodes(), allocator)  # plan roots
                batch.rollouts = allocator.plan_roots(batch.v_root, gen).cpu()
                with timer("rollout"):
                    self.rollouts.roll_out(batch, seed=2 * step)  # roll out
                cand = batch.prefix_candidates()
                batch.v_prefix = self._predict(batch, cand.node, allocator)  # score prefixes
                batch.continuations = allocator.plan_prefixes(
                    batch.v_prefix, cand.r.to(batch.v_prefix), cand.group.to(batch.v_prefix.device), batch.rollouts, gen
                )
                # Budget no prefix could take: fresh rollouts, i.e. continuations from the root (node 0).
                batch.root_continuations = allocator.plan_root_continuations(
                    batch.rollouts, batch.continuations.cpu(), gen
                )
                with timer("expand"):
                    self.rollouts.expand(batch, seed=2 * step + 1)  # expand
                with timer("credit"):
                    metrics = self._credit(batch)  # credit
                with timer("train"), self.rollouts.paused():
                    metrics |= self.learner.train_step(batch)  # learn
                with timer("predictor"):
                    fit = self.predictor.fit_step(batch, self.dp_group)  # fit predictor
                metrics |= self._plot_predictor(fit)  # telemetry, outside the predictor's time
                with timer("weight_sync"):
                    self.learner.sync_weights(self.rollouts.engine)  # sync
            metrics |= tree_metrics(batch.packed) | self.rollouts.step_metrics() | timer.seconds | self.gpu.sample()
            spent = int(batch.rollouts.sum() + batch.continuations.sum() + batch.root_continuations.sum())
            metrics |= {
                "alloc/fallback": float(allocator is not self.allocator),
                "alloc/budget_unspent": float(allocator.trajectories_per_step - spent),
                "alloc/root_continuations": float(batch.root_continuations.sum()),
                "data/prompt_hash": _hash(tasks),
            } | allocator.metrics()
            metrics |= self.guard.update(metrics)  # the smoothed held-out skill decides the next step
            self.use_fallback = self.guard.fallback
            self.step = step + 1
            metrics |= self._validate()
            self.sink.log(step, metrics, tag=f"[{allocator.name}] ")
            self._maybe_checkpoint()
        if cfg.checkpoint.export_hf_at_end:
            self.export_hf(Path(cfg.telemetry.out_dir) / "hf")

    # --- components' glue -------------------------------------------------------------
    def _predict(self, batch: StepBatch, nodes: torch.Tensor, allocator: Allocator) -> torch.Tensor:
        """(S,) float64 predicted success of `nodes` of the step's layout, on the learner's device;
        zeros, with no forward at all, for an allocator that does not read them.

        The forwards are split over data-parallel ranks: each DP rank (with its TP and PP peers)
        encodes only its share of the trees that hold `nodes` (`balanced_bins` on tokens, the same
        on every rank) and scores their nodes; the predictions are summed over DP into the whole
        vector (each is filled by exactly one rank), so no rank repeats another rank's forward."""
        g = self.learner.groups
        out = torch.zeros(nodes.numel(), dtype=torch.float64, device=g.device)
        if not allocator.uses_predictor or nodes.numel() == 0:
            return out
        packed = batch.packed
        trees = sorted(set(packed.node_tree[nodes.cpu()].tolist()))
        tokens = packed.tree_num_tokens().tolist()
        share = [trees[j] for j in balanced_bins([tokens[t] for t in trees], g.dp_size)[g.dp_rank]]
        if share:
            sub = packed.select(share)
            idx, local = packed.nodes_in(share, nodes)
            hidden = self.learner.hidden_states(sub) if self.predictor.needs_policy_hidden else None
            out[idx.to(g.device)] = self.predictor.predict(sub, local, hidden).to(out)
        if g.dp_size > 1:
            dist.all_reduce(out, group=g.pgs.dp)
        return out

    def _credit(self, batch: StepBatch) -> dict[str, float]:
        """TRACE-C probe values (when enabled) and the advantages of the step's final trees; returns the
        credit-accuracy metrics (`credit/auc`, ...) when the environment labels its turns."""
        cfg = self.cfg
        if cfg.credit.enabled:
            batch.node_ell = self.learner.probe(batch, self._encode, cfg.credit.answer_template)
        batch.advantages = compute_advantages(batch.packed, batch.trees, cfg.advantage, cfg.credit, batch.node_ell)
        return env_credit_accuracy(self.env, batch.packed, batch.trees, batch.node_ell, cfg.credit)

    def _plot_predictor(self, out: dict[str, Any]) -> dict[str, Any]:
        """`out` (a fit's metrics) without its calibration, whose reliability curve is saved every 10 steps."""
        cal = out.pop("_calibration", None)
        last = self.step == self.cfg.steps - 1
        if cal is not None and self.is_main and cal.num_samples and (self.step % 10 == 0 or last):
            plot_reliability(
                cal,
                Path(self.cfg.telemetry.out_dir) / "reliability.png",
                title=f"step {self.step}: predictor on the newest trees",
            )
        return out

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    # --- checkpoints ---------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {
            "trainer_step": self.step,
            "sampler": dataclasses.asdict(self.sampler.state),
            "use_fallback": self.use_fallback,
            "guard": self.guard.state_dict(),
            "config": to_dict(self.cfg),
        }

    def _maybe_checkpoint(self) -> None:
        ck = self.cfg.checkpoint
        if ck.dir is None or (self.step % ck.every_steps and self.step != self.cfg.steps):
            return
        root = Path(ck.dir)
        if self.is_main:  # written before `latest` moves, so a kill never pairs it with another step
            root.mkdir(parents=True, exist_ok=True)
            torch.save(self.predictor.state_dict(), root / f"predictor_{self.step:08d}.pt")
        self.learner.save(root, self.step, self._state())

    def _resume(self) -> None:
        ck = self.cfg.checkpoint
        if ck.dir is None or not ck.resume:
            return
        state = self.learner.load_latest(ck.dir)
        if state is None:
            return
        self.step = int(state["trainer_step"])
        self.sampler = PromptSampler(len(self.tasks), self.cfg.seed, SamplerState(**state["sampler"]))
        self.use_fallback = bool(state["use_fallback"])
        self.guard.load_state_dict(state["guard"])
        pred = Path(ck.dir) / f"predictor_{self.step:08d}.pt"
        self.predictor.load_state_dict(torch.load(pred, map_location=self.learner.groups.device))
        self.learner.sync_weights(self.rollouts.engine)
        log.info("resumed from %s at step %d", ck.dir, self.step)

    # --- evaluation, export and teardown -------------------------------------------------
    @torch.no_grad()
    def evaluate(self, split: Optional[str] = None) -> Optional[EvalReport]:
        """pass@k / mean@n per benchmark of the current policy on `split` (default `eval.split`);
        replica 0 runs the rollouts (on each of its ranks with an engine: a vLLM replica's TP
        ranks submit identical requests), rank 0 gets the report, the other ranks None
        (trace_mega/evaluation.py)."""
        if self.rollouts.agent is None or self.rollouts.layout.replica != 0:
            return None
        report = evaluate(self.rollouts.agent, self.env, self.cfg.eval, split)
        return report if self.is_main else None

    def _validate(self) -> dict[str, float]:
        """Periodic validation (`eval.every_steps`, and after the last step): this step's eval
        metrics, the report written to `<out_dir>/eval/step_XXXXXXXX.{json,md}`."""
        every = self.cfg.eval.every_steps
        if not every or (self.step % every and self.step != self.cfg.steps):
            return {}
        report = self.evaluate()
        if report is None:
            return {}
        report.write(Path(self.cfg.telemetry.out_dir) / "eval", f"step_{self.step:08d}")
        return report.metrics()

    def export_hf(self, out_dir: str | Path) -> Path:
        """Write the policy as an HF checkpoint with tokenizer and generation config (collective)."""
        out = self.learner.save_hf(out_dir)
        if self.is_main:
            write_hf_extras(out, self.cfg, self.tokenizer)
            log.info("exported the policy at step %d to %s", self.step, out)
        return out

    def close(self) -> None:
        self.sink.close()
        self.rollouts.close()
        self.env.close()
        from trace_mega.learner.parallel import destroy_parallel

        destroy_parallel()


def _hash(tasks) -> float:
    """A stable number identifying the step's prompts (checks the data order after a resume)."""
    digest = hashlib.sha1("|".join(t.task_id for t in tasks).encode()).hexdigest()
    return float(int(digest[:12], 16))
