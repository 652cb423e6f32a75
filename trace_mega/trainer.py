"""The TRACE training loop (docs/design.md §3.4, docs/step.md), top to bottom in `Trainer.train`.

One step fills one `StepBatch`: plan roots (predictor on the prompts →
`plan_roots`) → roll out (bare rollouts) → score prefixes (predictor on every
prefix, one packed pass → `plan_prefixes`) → expand (continuations from the
chosen prefixes; the engine reuses their KV) → credit (TRACE-C probe when
enabled, advantages) → learn (the policy update; its forward returns the
step's hidden states) → fit predictor (on those hidden states) → sync (the
engine gets the new weights in memory). Each stage takes its inputs as
arguments and returns what it makes; only this loop writes the step record.

Which allocator, advantage estimator, environment and engine run is chosen by
name in the config (checked before anything is built: `check_component_names`);
every allocator spends the same trajectory budget.
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
from tqdm import tqdm

from trace_mega.allocation import ALLOCATORS, Allocator, build_allocator
from trace_mega.config import TrainConfig, save_yaml, to_dict
from trace_mega.credit.metrics import env_credit_accuracy
from trace_mega.credit.probe import check_task_answers, nonfinite_probes
from trace_mega.envs import build_env, check_env
from trace_mega.evaluation import EvalReport, evaluate
from trace_mega.learner.hf_files import hf_config, policy_tokenizer, write_hf_extras
from trace_mega.learner.learner import Learner
from trace_mega.objective.advantages import ADVANTAGES, compute_advantages
from trace_mega.objective.losses import LOSSES
from trace_mega.predictor import Calibration, PromptMemory, SkillGuard, build_predictor, plot_reliability
from trace_mega.rollout.collector import RolloutCollector
from trace_mega.rollout.engines import ENGINES, EngineSetup, build_engine
from trace_mega.rollout.engines.routing import packed_routes
from trace_mega.rollout.replicas import ReplicaLayout
from trace_mega.rollout.tree import PackedTrees
from trace_mega.sampler import PromptSampler, SamplerState
from trace_mega.step import StepBatch
from trace_mega.stopping import Stop, StopWatch, report_exit
from trace_mega.telemetry import GpuProbe, MetricsSink, PhaseTimer, throughput_metrics, tree_metrics

log = logging.getLogger("trace_mega")


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        check_component_names(cfg)  # a bad registry name fails before anything is built
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
        layout = ReplicaLayout.from_groups(g, cfg.rollout.tensor_parallel_size, engine=cfg.rollout.engine)
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
                capture_routing=self.learner.replays_routes,
            )
        )
        self.rollouts = RolloutCollector(
            self.env,
            engine,
            self.tokenizer,
            cfg.rollout,
            tool_timeout_s=cfg.env.tool_timeout_s,
            max_concurrent_tool_calls=cfg.env.max_concurrent_tool_calls,
            max_tool_calls_per_turn=cfg.env.max_tool_calls_per_turn,
            layout=layout,
        )
        # On GPU the solvers run on the predictions' device without host syncs: no input
        # validation and a static prefix-table width (the most prefixes one prompt can have).
        on_gpu = self.learner.groups.device.type == "cuda"
        sync_free = dict(check=False, max_group_size=cfg.allocation.rollouts_per_prompt_max * cfg.rollout.max_turns)
        self.allocator = build_allocator(cfg.allocation, min_trees=g.dp_size, **(sync_free if on_gpu else {}))
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
        p = cfg.predictor
        self.memory = PromptMemory(len(self.tasks), p.memory_prior_rollouts, p.memory_half_life_steps)
        self.sink = MetricsSink.from_config(cfg.telemetry, to_dict(cfg), enabled=self.is_main)
        if self.is_main:  # the resolved config of the run (`trace-mega export --run OUT_DIR` reads it)
            save_yaml(cfg, Path(cfg.telemetry.out_dir) / "config.yaml")
        self.gpu = GpuProbe()
        # Without a checkpoint directory a signal keeps its default action: there is nothing to save.
        self.stops = StopWatch(
            cfg.checkpoint.exit_signals if cfg.checkpoint.dir else [],
            cfg.checkpoint.exit_after_minutes,
            cfg.optim.max_consecutive_skipped,
            self.learner.groups.device,
        )
        self.step = 0
        self.use_fallback = self.guard.fallback  # an unmeasured predictor does not plan step 0
        self.learner.sync_weights(self.rollouts.engine)  # the engine starts from the learner's initial weights
        self._resume()

    # --- the loop ------------------------------------------------------------------
    def train(self) -> Optional[Stop]:
        """Train to `cfg.steps`; returns the `Stop` when the run stopped early, after checkpointing the
        step it ended on (an exit signal, the wall-clock limit, or too many skipped steps)."""
        cfg = self.cfg
        steps = range(self.step, cfg.steps)
        for step in tqdm(steps, desc="train", disable=not (self.is_main and cfg.telemetry.progress_bars)):
            # A CPU generator: the allocators draw on the host and move the draws to v's device.
            timer, gen = PhaseTimer(), torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            allocator = self.fallback if self.use_fallback else self.allocator
            self.rollouts.begin_step(seed=cfg.seed * 1_000_003 + step)
            with timer("step"):
                index = self.sampler.next(cfg.allocation.prompts_per_step)
                tasks = [self.tasks[i] for i in index]
                batch = StepBatch.from_prompts(step, tasks, self.rollouts.prompt_ids(tasks))
                v_root = self._predict(batch, batch.root_nodes(), allocator)  # plan roots
                batch.v_root = self.memory.pool(index, v_root, step, read=allocator.uses_predictor)
                batch.rollouts = allocator.plan_roots(batch.v_root, gen).cpu()
                with timer("rollout"):  # roll out (in rounds where the allocator refills: dapo)
                    grown, batch.rollouts, keep = self.rollouts.roll_out_rounds(
                        tasks, batch.trees, batch.rollouts, allocator, seed=2 * step, generator=gen
                    )
                self.memory.record(index, grown, step)  # the prompts' own outcomes, for their next visits
                batch.grow(grown, keep=keep)  # prompts given none, or dropped by the allocator, leave
                batch.prefixes = cand = batch.prefix_candidates(cfg.rollout.max_turns - cfg.allocation.min_turns_left)
                batch.v_prefix = self._predict(batch, cand.node, allocator, replay=True)  # score prefixes
                batch.continuations = allocator.plan_prefixes(
                    batch.v_prefix, cand.r.to(batch.v_prefix), cand.group.to(batch.v_prefix.device), batch.rollouts, gen
                )
                # Budget no prefix could take: fresh rollouts, i.e. continuations from the root (node 0).
                batch.root_continuations = allocator.plan_root_continuations(
                    batch.rollouts, batch.continuations.cpu(), gen
                )
                with timer("expand"):  # expand
                    batch.grow(self.rollouts.expand(batch.trees, batch.branch_points(), seed=2 * step + 1))
                with timer("credit"):  # credit
                    batch.node_ell = self._probe(batch)
                    probe_bad = self._credit(batch)
                with timer("train"), self.rollouts.paused():  # learn
                    batch.update = self.learner.train_step(batch.packed, batch.advantages, routing=self._routes(batch))
                with timer("predictor"):  # fit predictor
                    fit = self.predictor.fit_step(batch.packed, batch.update.hidden, batch.update.trees, self.dp_group)
                with timer("weight_sync"):  # sync
                    self.learner.sync_weights(self.rollouts.engine)
            self._plot_predictor(fit.calibration)  # telemetry, outside the step's time
            metrics = batch.update.metrics | fit.metrics | self._credit_accuracy(batch) | probe_bad
            metrics |= (
                tree_metrics(batch.packed, batch.eval_groups())
                | self.rollouts.step_metrics()
                | timer.seconds
                | self.gpu.sample()
            )
            metrics |= self._throughput(batch.packed, timer.seconds["time/step_s"])
            spent = int(batch.rollouts.sum() + batch.continuations.sum() + batch.root_continuations.sum())
            metrics |= (
                {
                    "alloc/fallback": float(allocator is not self.allocator),
                    "alloc/generated_trajectories": float(spent),  # dapo: its dropped groups' included
                    "alloc/budget_unspent": float(allocator.trajectories_per_step - spent),
                    "alloc/root_continuations": float(batch.root_continuations.sum()),
                    "data/prompt_hash": _hash(tasks),
                }
                | allocator.metrics()
                | self.memory.metrics()
            )
            metrics |= self.guard.update(metrics)  # the smoothed held-out skill decides the next step
            self.use_fallback = self.guard.fallback
            self.step = step + 1
            metrics |= self._validate()
            self.sink.log(step, metrics, tag=f"[{allocator.name}] ")
            saved = self._maybe_checkpoint()
            stop = self.stops.check(step, metrics)
            if stop is not None and self.step < cfg.steps:  # the last step ends the run anyway
                if not saved and cfg.checkpoint.dir is not None:
                    self._checkpoint()
                log.warning("%s", stop.message)
                report_exit(stop)
                return stop
        if cfg.checkpoint.export_hf_at_end:
            self.export_hf(Path(cfg.telemetry.out_dir) / "hf")
        return None

    # --- components' glue -------------------------------------------------------------
    def _routes(self, batch: StepBatch) -> Optional[torch.Tensor]:
        """(T, L, k) the rollout engine's MoE routes of the step's layout, for the learner to replay
        (None unless `model.moe_routing_replay: rollout` on an MoE policy)."""
        if not self.learner.replays_routes:
            return None
        m = self.learner.model_cfg
        return packed_routes(batch.trees, batch.packed, m.num_layers, m.moe_router_topk)

    def _throughput(self, packed: PackedTrees, step_s: float) -> dict[str, float]:
        g = self.learner.groups
        return throughput_metrics(
            packed,
            step_s,
            self.learner.model_cfg,
            world_size=g.world_size,
            replicas=self.rollouts.layout.num_replicas,
            epochs=self.cfg.optim.epochs_per_step,
            device=g.device,
        )

    def _predict(
        self, batch: StepBatch, nodes: torch.Tensor, allocator: Allocator, replay: bool = False
    ) -> torch.Tensor:
        """(S,) float64 predicted success of `nodes` of the step's layout, on the learner's device
        (split over data-parallel ranks: `Learner.score_nodes`; with `replay`, the policy forward
        replays the engine's MoE routes, as the predictor's training states do); zeros, with no
        forward at all, for an allocator that does not read them."""
        if not allocator.uses_predictor:
            return torch.zeros(nodes.numel(), dtype=torch.float64, device=self.learner.groups.device)
        hidden = self.predictor.needs_policy_hidden
        routing = self._routes(batch) if replay and hidden else None
        return self.learner.score_nodes(batch.packed, nodes, self.predictor.predict, hidden, routing=routing)

    def _probe(self, batch: StepBatch) -> Optional[torch.Tensor]:
        """TRACE-C's (N,) probe values ℓ̄ on the step's final layout, when credit is enabled."""
        if not self.cfg.credit.enabled:
            return None
        return self.learner.probe(batch.packed, batch.trees, self._encode, self.cfg.credit.answer_template)

    def _credit(self, batch: StepBatch) -> dict[str, float]:
        """The step's advantages; with TRACE-C, `credit/probe_nonfinite`, the boundaries whose probe
        value is not finite. A step with any trains on nothing: its advantages are NaN, so the
        learner's guard skips the update (`loss/skipped`) instead of reading zero credit there."""
        cfg, ell = self.cfg, batch.node_ell
        bad = None if ell is None else nonfinite_probes(batch.packed, batch.trees, ell)
        if bad is not None and bool(bad.any()):
            ell = torch.where(bad.to(ell.device), 0.0, ell)  # finite, so that the advantages can be formed at all
        batch.advantages = compute_advantages(batch.packed, batch.trees, cfg.advantage, cfg.credit, ell)
        if bad is None:
            return {}
        if bool(bad.any()):
            log.warning("step %d: %d probe values are not finite; the update is skipped", batch.step, int(bad.sum()))
            nan = torch.full_like(batch.advantages.advantages, float("nan"))
            batch.advantages = dataclasses.replace(batch.advantages, advantages=nan)
        return {"credit/probe_nonfinite": float(bad.sum())}

    def _credit_accuracy(self, batch: StepBatch) -> dict[str, float]:
        """`credit/auc`, ... of the probe's turn credit where the environment labels its turns."""
        return env_credit_accuracy(self.env, batch.packed, batch.trees, batch.node_ell, self.cfg.credit)

    def _plot_predictor(self, cal: Optional[Calibration]) -> None:
        """The reliability curve of the newest fit, saved every 10 steps and after the last."""
        last = self.step == self.cfg.steps - 1
        if cal is not None and self.is_main and cal.num_samples and (self.step % 10 == 0 or last):
            plot_reliability(
                cal,
                Path(self.cfg.telemetry.out_dir) / "reliability.png",
                title=f"step {self.step}: predictor on the newest trees",
            )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    # --- checkpoints ---------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {
            "trainer_step": self.step,
            "sampler": dataclasses.asdict(self.sampler.state),
            "use_fallback": self.use_fallback,
            "guard": self.guard.state_dict(),
            "memory": self.memory.state_dict(),
            "config": to_dict(self.cfg),
        }

    def _maybe_checkpoint(self) -> bool:
        """Checkpoint when the step is due (`every_steps`, the last step); whether it did."""
        ck = self.cfg.checkpoint
        if ck.dir is None or (self.step % ck.every_steps and self.step != self.cfg.steps):
            return False
        self._checkpoint()
        return True

    def _checkpoint(self) -> None:
        ck = self.cfg.checkpoint
        state = self.predictor.state_dict()
        # Rank 0 writes the predictor beside the step dir inside the save, before `latest` moves (so a
        # kill never pairs it with another step); it is in the step's manifest and pruned with it.
        # A failed write raises CheckpointError after the partial files are removed: the run stops.
        self.learner.save(
            Path(ck.dir),
            self.step,
            self._state(),
            extras={f"predictor_{self.step:08d}.pt": lambda path: torch.save(state, path)},
            keep_last=ck.keep_last,
            keep_every=ck.keep_every,
            rank_state={"predictor_fit": self.predictor.fit_state()},  # per rank: its replay share
        )

    def _resume(self) -> None:
        ck = self.cfg.checkpoint
        if ck.dir is None or not ck.resume:
            return
        state = self.learner.load_latest(ck.dir)  # the newest intact checkpoint (docs/operations.md)
        if state is None:
            return
        self.step = int(state["trainer_step"])
        self.sampler = PromptSampler(len(self.tasks), self.cfg.seed, SamplerState(**state["sampler"]))
        self.use_fallback = bool(state["use_fallback"])
        self.guard.load_state_dict(state["guard"])
        if "memory" in state:  # checkpoints before the prompt memory have none
            self.memory.load_state_dict(state["memory"])
        pred = Path(ck.dir) / f"predictor_{self.step:08d}.pt"
        self.predictor.load_state_dict(torch.load(pred, map_location=self.learner.groups.device))
        rank_state = state["rank_state"] or {}
        if "predictor_fit" in rank_state:
            self.predictor.load_fit_state(rank_state["predictor_fit"])
        else:  # another world size (the replay shares differ) or an older checkpoint
            log.warning("the predictor resumes with a fresh optimiser and an empty replay window")
        self.learner.sync_weights(self.rollouts.engine)
        log.info("resumed from %s at step %d", Path(ck.dir) / f"step_{self.step:08d}", self.step)

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
        self.stops.close()
        self.sink.close()
        self.rollouts.close()
        self.env.close()
        from trace_mega.learner.parallel import destroy_parallel

        destroy_parallel()


def check_component_names(cfg: TrainConfig) -> None:
    """Every registry name of `cfg` (and the environment's options), checked where the components are
    built: a ConfigError naming the field and the valid names, before anything is started."""
    ALLOCATORS.check(cfg.allocation.name, "allocation.name")
    check_env(cfg.env.name, cfg.env.options)
    ENGINES.check(cfg.rollout.engine, "rollout.engine")
    ADVANTAGES.check(cfg.advantage.name, "advantage.name")
    LOSSES.check(cfg.loss.name, "loss.name")


def _hash(tasks) -> float:
    """A stable number identifying the step's prompts (checks the data order after a resume)."""
    digest = hashlib.sha1("|".join(t.task_id for t in tasks).encode()).hexdigest()
    return float(int(digest[:12], 16))
