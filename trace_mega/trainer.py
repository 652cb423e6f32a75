"""The TRACE training loop (SPEC §3.4), top to bottom in `Trainer.train`.

One step: candidate prompts → predictor(roots) → plan_roots → bare rollouts →
predictor(every prefix, one packed pass) → plan_prefixes → continuations from
the chosen prefixes (prefix KV reused by the engine) → trees → predictor
update → TRACE-C probe (when enabled) → advantages → learner step → in-memory
weight sync to the engine.

Which allocator, advantage estimator, environment and engine run is chosen by
name in the config; every allocator spends the same trajectory budget.
Distributed runs (torchrun): every rank joins the model forwards (they are TP
collectives); rank 0 owns the engine, the environment episodes and the
allocation decisions, and broadcasts the trees.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from trace_mega.allocation import build_allocator
from trace_mega.config import TrainConfig, to_dict
from trace_mega.envs import build_env
from trace_mega.envs.react import ReactScaffold
from trace_mega.learner.advantages import compute_advantages
from trace_mega.learner.learner import Learner, hf_config
from trace_mega.predictor import build_predictor, plot_reliability, predictor_samples
from trace_mega.rollout.agent_loop import AgentLoop
from trace_mega.rollout.engines import ENGINES, Engine, TorchEngine
from trace_mega.rollout.tree import PackedTrees, RolloutTree, pack
from trace_mega.sampler import PromptSampler, SamplerState
from trace_mega.step_data import prefix_candidates, share_trees, tree_metrics
from trace_mega.telemetry import GpuProbe, MetricsSink, PhaseTimer

log = logging.getLogger("trace_mega")

# When the predictor is worse than a constant, the next step allocates without it.
_FALLBACK = {"trace": "treepo", "trace_global": "treepo", "pcl": "uniform"}


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        self.env = build_env(cfg.env.name, **cfg.env.options)
        self.tasks = self.env.tasks("train")
        self.tokenizer = self._tokenizer(cfg)
        if cfg.model.vocab_size is None:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=len(self.tokenizer)))
        elif cfg.model.hf_checkpoint is None and len(self.tokenizer) > cfg.model.vocab_size:
            raise ValueError(f"model.vocab_size {cfg.model.vocab_size} < tokenizer size {len(self.tokenizer)}")
        self.cfg = cfg
        self.learner = Learner(cfg)
        self.is_main = self.learner.groups.rank == 0
        self.scaffold = ReactScaffold(self.tokenizer)
        # vLLM loads its first weights from a directory; a randomly initialised policy is
        # written once (collective), every later update goes through memory.
        init_dir = cfg.model.hf_checkpoint
        if cfg.rollout.engine != "torch" and init_dir is None:
            init_dir = str(self.learner.save_hf(Path(cfg.telemetry.out_dir) / "hf_init"))
        self.engine = self._engine(init_dir) if self.is_main else None
        self.agent = (AgentLoop(self.env, self.engine, self.tokenizer, cfg.rollout, tool_timeout_s=cfg.env.tool_timeout_s,
                                max_tool_calls_per_turn=cfg.env.max_tool_calls_per_turn)
                      if self.is_main else None)
        # On GPU the solvers run on the predictions' device without host syncs: no input
        # validation and a static prefix-table width (the most prefixes one prompt can have).
        on_gpu = self.learner.groups.device.type == "cuda"
        sync_free = dict(check=False, max_group_size=cfg.allocation.rollouts_per_prompt_max * cfg.rollout.max_turns)
        alloc_kw = sync_free if on_gpu else {}
        self.allocator = build_allocator(cfg.allocation, **alloc_kw)
        fallback = _FALLBACK.get(cfg.allocation.name, cfg.allocation.name)
        self.fallback = build_allocator(dataclasses.replace(cfg.allocation, name=fallback), **alloc_kw)
        self.predictor = build_predictor(cfg.predictor, hidden_size=self.learner.hidden_size,
                                         vocab_size=self.learner.model_cfg.vocab_size).to(self.learner.groups.device)
        self.sampler = PromptSampler(len(self.tasks), cfg.seed)
        self.sink = MetricsSink(cfg.telemetry.out_dir, tensorboard=cfg.telemetry.tensorboard, enabled=self.is_main)
        self.gpu = GpuProbe()
        self.replay: collections.deque = collections.deque(maxlen=cfg.predictor.replay_steps - 1)
        self.step = 0
        self.use_fallback = False
        self._sync_weights()  # the engine starts from the learner's initial weights
        self._resume()

    # --- the loop ------------------------------------------------------------------
    def train(self) -> None:
        cfg = self.cfg
        steps = range(self.step, cfg.steps)
        for step in tqdm(steps, desc="train", disable=not (self.is_main and cfg.telemetry.progress_bars)):
            # A CPU generator: the allocators draw on the host and move the draws to v's device.
            timer, gen = PhaseTimer(), torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            stats0 = dataclasses.asdict(self.agent.stats) if self.is_main else {}
            allocator = self.fallback if self.use_fallback else self.allocator
            with timer("step"):
                tasks = [self.tasks[i] for i in self.sampler.next(cfg.allocation.prompts_per_step)]   # 1
                roots = [RolloutTree(t.task_id, self.scaffold.prompt_ids(t)) for t in tasks]
                v_root = self._score(pack(roots), None)                                                # 2
                m = allocator.plan_roots(v_root, gen).cpu()                                            # 3
                self.env.reseed(cfg.seed * 1_000_003 + step)
                with timer("rollout"):                                                                  # 4
                    trees = share_trees(self.agent.rollout(tasks, m.tolist(), seed=2 * step) if self.is_main else None)
                bare = pack(trees)
                cand = prefix_candidates(bare)                                                         # 5
                v_pref = self._score(bare, cand.node)                                                  # 6
                k = allocator.plan_prefixes(v_pref, cand.r.to(v_pref), cand.group.to(v_pref.device), m, gen)  # 7
                with timer("expand"):                                                                   # 8
                    if self.is_main:
                        self.agent.expand(trees, cand.branch_points(k.cpu()), seed=2 * step + 1)
                        AgentLoop.release(trees)
                trees = share_trees([t for t, mi in zip(trees, m.tolist()) if mi > 0])                 # 9
                packed = pack(trees)
                with timer("predictor"):                                                                # 10
                    metrics = self._fit_predictor(packed)
                with timer("credit"):
                    node_ell = self._probe(trees, packed)
                compute_advantages(packed, trees, cfg.advantage, cfg.credit, node_ell)                 # 11
                with timer("train"):
                    self._engine_sleep(True)  # free the engine's accelerator memory while training
                    metrics |= self.learner.train_step(trees, packed)
                    self._engine_sleep(False)
                with timer("weight_sync"):
                    self._sync_weights()
            metrics |= tree_metrics(packed) | self._rollout_metrics(stats0) | timer.seconds | self.gpu.sample()
            metrics |= {"alloc/fallback": float(allocator is self.fallback), "data/prompt_hash": _hash(tasks)}
            # NaN (no previous fit to compare with) never triggers the fallback; allocators
            # that ignore the predictor (uniform, treepo) have none.
            self.use_fallback = (cfg.predictor.fallback_to_uniform and cfg.allocation.name in _FALLBACK
                                 and metrics.get("predictor/skill", 0.0) < 0.0)
            self.sink.log(step, metrics, tag=f"[{allocator.name}] ")
            self.step = step + 1
            self._maybe_checkpoint()

    # --- components' glue -------------------------------------------------------------
    def _score(self, packed: PackedTrees, nodes: Optional[torch.Tensor]) -> torch.Tensor:
        """Predicted success of `nodes` (default: the roots) of `packed`, one batched pass."""
        if nodes is None:
            nodes = torch.nonzero(packed.node_parent < 0).flatten()
        if nodes.numel() == 0:
            return torch.zeros(0, dtype=torch.float64, device=self.learner.groups.device)
        hidden = self.learner.hidden_states(packed) if self.predictor.needs_policy_hidden else None
        return self.predictor.predict(packed, nodes, hidden).double()  # stays on the device for the solvers

    def _fit_predictor(self, packed: PackedTrees) -> dict[str, Any]:
        samples = predictor_samples(packed, self.cfg.predictor.prefix_sample_fraction)
        hidden = self.learner.hidden_states(packed) if self.predictor.needs_policy_hidden else None
        out = self.predictor.fit(packed, samples, hidden, replay=list(self.replay))
        if self.replay.maxlen:
            self.replay.append((packed, samples, hidden))
        cal = out.pop("_calibration", None)
        last = self.step == self.cfg.steps - 1
        if cal is not None and self.is_main and cal.num_samples and (self.step % 10 == 0 or last):
            plot_reliability(cal, Path(self.cfg.telemetry.out_dir) / "reliability.png",
                             title=f"step {self.step}: predictor on the newest trees")
        return out

    def _probe(self, trees: list[RolloutTree], packed: PackedTrees) -> Optional[torch.Tensor]:
        if not self.cfg.credit.enabled:
            return None
        encode = lambda s: self.tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
        return self.learner.probe(trees, encode, self.cfg.credit.answer_template).for_packed(packed)

    def _engine_sleep(self, sleep: bool) -> None:
        if self.engine is not None:
            self.engine.sleep() if sleep else self.engine.wake_up()

    def _sync_weights(self) -> None:
        """In-memory weight update of the engine (export is collective: every rank iterates)."""
        weights = self.learner.export_weights()
        if self.is_main:
            self.engine.update_weights(weights)
        else:
            for _ in weights:
                pass

    def _rollout_metrics(self, before: dict[str, float]) -> dict[str, float]:
        """This step's agent-loop counters (bare rollouts + continuations)."""
        if not self.is_main:
            return {}
        now = dataclasses.asdict(self.agent.stats)
        d = {k: now[k] - before[k] for k in now}
        return {"rollout/generated_tokens": d["generated_tokens"], "rollout/prefill_tokens_saved": d["cached_prefix_tokens"],
                "rollout/prefix_tokens": d["prefix_tokens"], "rollout/tool_calls": d["tool_calls"],
                "rollout/parse_errors": d["parse_errors"], "rollout/tool_timeouts": d["tool_timeouts"],
                "rollout/truncated": d["truncated_episodes"], "rollout/generate_s": d["generate_s"],
                "rollout/tool_s": d["tool_s"]}

    def _tokenizer(self, cfg: TrainConfig):
        """The checkpoint's tokenizer, else the one the environment ships (synthetic envs)."""
        if cfg.model.hf_checkpoint:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(cfg.model.hf_checkpoint)
        tok = getattr(self.env, "tokenizer", None)
        if tok is None:
            raise ValueError(f"environment {cfg.env.name!r} ships no tokenizer: set model.hf_checkpoint")
        return tok

    def _engine(self, init_dir: Optional[str]) -> Engine:
        rc = self.cfg.rollout
        if rc.engine == "torch":
            return TorchEngine(hf_config(self.learner.model_cfg), device=self.learner.groups.device,
                               enable_prefix_caching=rc.enable_prefix_caching,
                               eos_token_ids=[self.tokenizer.eos_token_id])
        extra = {} if rc.kv_block_size_tokens is None else {"block_size": rc.kv_block_size_tokens}
        return ENGINES.get(rc.engine)(init_dir, enable_prefix_caching=rc.enable_prefix_caching,
                                      gpu_memory_utilization=rc.gpu_memory_utilization,
                                      max_model_len=rc.max_total_tokens, seed=self.cfg.seed,
                                      eos_token_ids=[self.tokenizer.eos_token_id], **extra)

    # --- checkpoints ---------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {"trainer_step": self.step, "sampler": dataclasses.asdict(self.sampler.state),
                "use_fallback": self.use_fallback, "config": to_dict(self.cfg)}

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
        pred = Path(ck.dir) / f"predictor_{self.step:08d}.pt"
        self.predictor.load_state_dict(torch.load(pred, map_location=self.learner.groups.device))
        self._sync_weights()
        log.info("resumed from %s at step %d", ck.dir, self.step)

    # --- evaluation and teardown ------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, split: str = "test", samples_per_task: int = 4) -> dict[str, float]:
        """Mean reward of `samples_per_task` rollouts per task of `split` with the current policy."""
        tasks = self.env.tasks(split)
        trees = share_trees(self.agent.rollout(tasks, [samples_per_task] * len(tasks), seed=10**6)
                            if self.is_main else None)
        return {f"eval/{split}/reward": tree_metrics(pack(trees))["reward/mean"], "eval/tasks": float(len(tasks))}

    def close(self) -> None:
        self.sink.close()
        if self.agent is not None:
            self.agent.close()
        if self.engine is not None:
            self.engine.close()
        self.env.close()
        from trace_mega.learner.parallel import destroy_parallel

        destroy_parallel()


def _hash(tasks) -> float:
    """A stable number identifying the step's prompts (checks the data order after a resume)."""
    digest = hashlib.sha1("|".join(t.task_id for t in tasks).encode()).hexdigest()
    return float(int(digest[:12], 16))
