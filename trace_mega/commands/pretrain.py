"""`trace-mega pretrain`: a short, deterministic warm start that teaches the tiny policy to read.

TRACE-C's reference must be able to read observations: its gold-answer
likelihood can only rise on evidence-gathering turns if it knows what a
revealed value means. A real user starts RL from a pretrained model; here the
tiny policy is trained as a language model on generated transcripts of the
environment's format, then saved as an HF checkpoint that the trainer loads
through `model.hf_checkpoint` as both the policy's initialisation and the frozen
reference (the reference is a copy of the initial policy, `Learner`).

Transcripts come from the real agent loop (the same rendering as RL rollouts)
driven by a **transcript policy** engine that sees only the context, never the
store. For ``synthetic_search`` (`SearchTranscriptEngine`): each turn it answers
with probability `answer_prob` (always on the last allowed turn), else looks up
a key — one already mentioned in the context with probability
`mentioned_key_prob`, else any key uniformly. Its answer is the correct value
when the context resolves the asked key (the chain of revealed facts from it
ends in a value), else a uniformly random digit. So the transcripts teach the
format, reading (copy the value a resolved chain ends in) and nothing about
the optimal search (lookups are random, answers come at random times).

For ``synthetic_tools`` (`WalkTranscriptEngine`, the allocation demo's warm
start): a partly competent walker. Each turn it takes the right action with
probability `correct_action_prob` (on the goal it answers, off the goal it
moves towards it), else on the goal a random move, off the goal an early
answer with probability `answer_prob` or a move away. It reads its cell from
the last observation and ignores the ice level, so the warm policy starts
where RL of a real LLM starts (paper Fig. 2a): dry tasks solved most of the
time, the iciest nearly never, the level visible only in the prompt.

The loss is the mean next-token negative log-likelihood of the transcripts —
every token with `loss_on_observations` (the default: a repeated lookup shows
a fact again, so predicting observations teaches copying from the context), or
only the transcript policy's own tokens (actions and answers) — through the
learner's packed forward and fused log-prob kernel.

Deterministic: the initialisation, the stores and the transcript policy are
seeded from `PretrainConfig.seed`, so the same config gives identical weights
on the same number of CPU threads. Another thread count sums PyTorch's
intra-op reductions in another order: `pretrain_levels` for 40 steps under
OMP_NUM_THREADS=1 and 2 differs by up to 0.02 in a weight, and RL runs from the
two warm starts part ways (docs/allocation.md "The warm start").
Results are cached under `cache_dir/<sha256 of the config>[:16]` and reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from trace_mega.config import EnvConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, require, to_dict
from trace_mega.envs import build_env
from trace_mega.envs.synthetic import ANSWER_DONE, MOVE_LEFT, MOVE_RIGHT
from trace_mega.envs.synthetic_search import ANSWER_CLOSE, ANSWER_OPEN, DIGITS, KEYS, lookup_token
from trace_mega.registry import Registry
from trace_mega.rollout.engines.base import Completion, Engine, SamplingParams

__all__ = [
    "TRANSCRIPT_POLICIES",
    "SearchTranscriptEngine",
    "WalkTranscriptEngine",
    "config_hash",
    "pretrain",
    "resolve_in_context",
]

log = logging.getLogger("trace_mega")


@dataclass
class PretrainConfig:
    """The warm start (`trace-mega pretrain`, trace_mega/commands/pretrain.py): the tiny policy trained as a
    language model on generated transcripts of an environment, saved as an HF checkpoint."""

    seed: int = 0
    """Seed of the initialisation, the transcript stores and the transcript policy."""
    steps: int = 400
    """Optimiser steps."""
    episodes_per_step: int = 32
    """Transcripts (one episode each, a fresh hidden store) per optimiser step."""
    micro_batch_episodes: Optional[int] = None
    """Transcripts packed into one micro-batch (its tree mask is quadratic in the micro-batch's tokens); None: all
    of a step's in one."""
    num_stores: int = 4096
    """Distinct generated tasks the transcripts cycle through (from a seed stream other than the environment's
    own train / test tasks)."""
    answer_prob: float = 0.3
    """Per turn, probability that the transcript policy answers now (synthetic_search: else it looks a key up;
    synthetic_tools: on a turn off the goal that does not take the right action, else it moves away)."""
    mentioned_key_prob: float = 0.5
    """synthetic_search: probability that a lookup picks a key already mentioned in the context (else any key,
    uniformly)."""
    correct_action_prob: float = 0.7
    """synthetic_tools: per turn, probability that the walker takes the right action (on the goal: answer; off it:
    a move towards the goal)."""
    max_turns: int = 6
    """Most turns per transcript; the last allowed turn always answers."""
    loss_on_observations: bool = True
    """Language-model loss on every token (prompt and observations too: a repeated lookup shows a fact again,
    which teaches copying from the context); False: only the transcript policy's own tokens."""
    env: EnvConfig = field(default_factory=lambda: EnvConfig(name="synthetic_search"))
    """Environment whose format the transcripts follow (its options shape the generated stores)."""
    model: ModelConfig = field(default_factory=lambda: ModelConfig(vocab_size=None))
    """Architecture of the tiny policy (vocab_size None: the environment tokenizer's size)."""
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig(device="cpu"))
    """Where it trains."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-3, warmup_steps=20))
    """Optimiser of the language-model loss."""
    cache_dir: str = "runs/pretrain_cache"
    """Checkpoints are cached under cache_dir/<hash of every other field>; not part of the hash."""

    def validate(self) -> None:
        require(self.steps >= 1, "steps", "must be >= 1")
        require(self.episodes_per_step >= 1, "episodes_per_step", "must be >= 1")
        require(self.num_stores >= 1, "num_stores", "must be >= 1")
        require(
            self.micro_batch_episodes is None or self.micro_batch_episodes >= 1,
            "micro_batch_episodes",
            "must be >= 1 or null",
        )
        require(0.0 < self.answer_prob <= 1.0, "answer_prob", "must be in (0, 1]")
        require(0.0 <= self.mentioned_key_prob <= 1.0, "mentioned_key_prob", "must be in [0, 1]")
        require(0.0 <= self.correct_action_prob <= 1.0, "correct_action_prob", "must be in [0, 1]")
        require(self.max_turns >= 1, "max_turns", "must be >= 1")
        require(self.model.hf_checkpoint is None, "model.hf_checkpoint", "the warm start trains from scratch")


CACHE_VERSION = 2
"""Bumped when the transcript format or the training recipe changes (part of the cache key)."""

KEYED_ONLY_OFF_DEFAULT = {
    ("parallel", "recompute_activations"): False,
    ("optim", "contrasted_trees_per_mini_batch"): 0,
    ("model", "moe_replay_probe"): False,
}
"""Fields added after CACHE_VERSION 2 whose default reproduces the earlier training: at that default
they stay out of the key, so the warm starts cached before them are still found."""

TRANSCRIPT_POLICIES: Registry[type[Engine]] = Registry("transcript policy")


def resolve_in_context(words: list[str], target: str) -> Optional[str]:
    """The value the context's revealed facts give `target` (following pointers), or None.

    `words` is the context split on whitespace; facts are ``k is v`` / ``k is same as j``.
    """
    facts: dict[str, tuple[str, str]] = {}
    for i, w in enumerate(words):
        if w == "is" and 0 < i and words[i - 1] in KEYS and i + 1 < len(words):
            if words[i + 1] in DIGITS:
                facts[words[i - 1]] = ("value", words[i + 1])
            elif words[i + 1 : i + 3] == ["same", "as"] and i + 3 < len(words) and words[i + 3] in KEYS:
                facts[words[i - 1]] = ("pointer", words[i + 3])
    key, hops = target, 0
    while key in facts and hops <= len(KEYS):
        kind, x = facts[key]
        if kind == "value":
            return x
        key, hops = x, hops + 1
    return None


class _TranscriptEngine(Engine):
    """A fixed transcript policy as an `Engine`: one turn from the decoded prefix, seeded by the request."""

    def __init__(self, tokenizer: Any, cfg: PretrainConfig) -> None:
        super().__init__()
        self.tok, self.cfg = tokenizer, cfg

    @staticmethod
    def env_options(cfg: PretrainConfig) -> dict[str, Any]:
        """Options of the environment the transcripts are generated in (another seed stream than RL's)."""
        return {**cfg.env.options, "seed": 10_007 + cfg.seed}

    def _turn(self, prefix: list[int], rng: random.Random) -> list[int]:
        raise NotImplementedError

    def generate(self, prefixes: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        out = []
        for i, prefix in enumerate(prefixes):
            # Seeded by the request's seed and its prefix: the same episode, the same transcript.
            digest = hashlib.sha256(repr((sampling.request_seed(i), prefix)).encode()).digest()
            ids = self._turn(prefix, random.Random(int.from_bytes(digest[:8], "little")))
            out.append(Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop"))
        return out

    def update_weights(self, named_tensors) -> None:
        for _ in named_tensors:  # a fixed policy: nothing to load
            pass


@TRANSCRIPT_POLICIES.register("synthetic_search")
class SearchTranscriptEngine(_TranscriptEngine):
    """The transcript policy of ``synthetic_search`` (module docstring); reads only the prefix."""

    def __init__(self, tokenizer: Any, cfg: PretrainConfig) -> None:
        super().__init__(tokenizer, cfg)
        self.lookup_ids = {k: tokenizer.convert_tokens_to_ids(lookup_token(k)) for k in KEYS}
        self.answer_ids = [tokenizer.convert_tokens_to_ids(t) for t in (ANSWER_OPEN, ANSWER_CLOSE)]
        self.digit_ids = {d: tokenizer.convert_tokens_to_ids(d) for d in DIGITS}

    def _turn(self, prefix: list[int], rng: random.Random) -> list[int]:
        words = self.tok.decode(prefix, skip_special_tokens=True).split()
        target = words[words.index("find") + 1]
        turns_done = words.count("<tool_response>")
        if turns_done + 1 >= self.cfg.max_turns or rng.random() < self.cfg.answer_prob:
            value = resolve_in_context(words, target)
            value = value if value is not None else rng.choice(DIGITS)
            return [self.answer_ids[0], self.digit_ids[value], self.answer_ids[1]]
        mentioned = [w for w in dict.fromkeys(words[words.index("find") + 1 :]) if w in KEYS]
        pool = mentioned if mentioned and rng.random() < self.cfg.mentioned_key_prob else KEYS
        return [self.lookup_ids[rng.choice(pool)]]

    @staticmethod
    def env_options(cfg: PretrainConfig) -> dict[str, Any]:
        # Fresh stores, none of them an RL task: transcripts teach reading, not the answers.
        return {**cfg.env.options, "num_tasks": cfg.num_stores, "num_test_tasks": 0, "seed": 10_007 + cfg.seed}


@TRANSCRIPT_POLICIES.register("synthetic_levels")
@TRANSCRIPT_POLICIES.register("synthetic_tools")
class WalkTranscriptEngine(_TranscriptEngine):
    """The partly competent walker of ``synthetic_tools`` (module docstring); reads only the prefix."""

    def __init__(self, tokenizer: Any, cfg: PretrainConfig) -> None:
        super().__init__(tokenizer, cfg)
        self.ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (MOVE_LEFT, MOVE_RIGHT, ANSWER_DONE)}

    def _turn(self, prefix: list[int], rng: random.Random) -> list[int]:
        words = self.tok.decode(prefix, skip_special_tokens=True).split()
        goal = int(words[words.index("goal") + 1])
        # The cell: the last observation's `at X`, else the start.
        at = [i for i, w in enumerate(words) if w == "at"]
        cell = int(words[at[-1] + 1]) if at else int(words[words.index("start") + 1])
        towards = MOVE_RIGHT if goal > cell else MOVE_LEFT
        away = MOVE_LEFT if towards == MOVE_RIGHT else MOVE_RIGHT
        if words.count("<tool_response>") + 1 >= self.cfg.max_turns:
            action = ANSWER_DONE  # the last allowed turn answers
        elif rng.random() < self.cfg.correct_action_prob:
            action = ANSWER_DONE if cell == goal else towards
        elif cell == goal:
            action = rng.choice((MOVE_LEFT, MOVE_RIGHT))
        else:
            action = ANSWER_DONE if rng.random() < self.cfg.answer_prob else away
        return [self.ids[action]]


def config_hash(cfg: PretrainConfig) -> str:
    """Cache key: sha256 over every field but `cache_dir` (and `KEYED_ONLY_OFF_DEFAULT` fields at
    their default), plus `CACHE_VERSION`."""
    data = to_dict(cfg)
    data.pop("cache_dir", None)
    for (section, name), default in KEYED_ONLY_OFF_DEFAULT.items():
        if data[section].get(name) == default:
            del data[section][name]
    blob = json.dumps({"version": CACHE_VERSION, "config": data}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _train_config(cfg: PretrainConfig, vocab_size: int) -> TrainConfig:
    model = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or vocab_size)
    return TrainConfig(seed=cfg.seed, model=model, parallel=cfg.parallel, optim=cfg.optim)


def _lm_loss(learner):
    from trace_mega.learner.models import output_weight
    from trace_mega.ops.logprobs import packed_token_logprobs

    def loss_fn(hidden: torch.Tensor, batch: dict):
        mb = batch["packed"]
        h = hidden[0, : mb.num_tokens]  # (T, H)
        lp = packed_token_logprobs(
            h,
            output_weight(learner.chunks[0]),
            mb,
            tp_group=learner.groups.pgs.tp,
            vocab_start=learner.groups.tp_rank * output_weight(learner.chunks[0]).shape[0],
            reduce_grad_hidden=not learner.policy.config.sequence_parallel,
        )
        mask = mb.loss_mask.to(lp.device).float()
        return -(lp * mask).sum(), mask.sum(), {}

    return loss_fn


def _inputs(packed, device: torch.device, multiple: int):
    """(1, T) ids / positions and the tree mask of a whole packed batch, padded to `multiple` tokens."""
    from trace_mega.ops.attention import tree_attention_mask

    pad = (-packed.num_tokens) % multiple
    n = packed.num_nodes  # padding: one extra node that sees only itself
    tokens = torch.cat([packed.tokens, packed.tokens.new_zeros(pad)])
    positions = torch.cat([packed.position_ids, torch.arange(pad)])
    node = torch.cat([packed.token_node, torch.full((pad,), n)])
    node_exit = torch.cat([packed.token_node_exit, torch.full((pad,), n)])
    return (
        tokens[None].to(device),
        positions[None].to(device),
        tree_attention_mask(node.to(device), node_exit.to(device)),
    )


def pretrain(cfg: PretrainConfig, *, force: bool = False) -> Path:
    """The cached warm-start checkpoint directory of `cfg` (trained now unless cached or `force`)."""
    out = Path(cfg.cache_dir) / config_hash(cfg)
    if (out / "pretrain.json").exists() and not force:
        log.info("pretrain: cached checkpoint %s", out)
        return out
    if cfg.env.name not in TRANSCRIPT_POLICIES:
        raise ValueError(
            f"pretrain: no transcript policy for environment {cfg.env.name!r}; "
            f"valid: {', '.join(TRANSCRIPT_POLICIES.names())}"
        )
    from trace_mega.config import RolloutConfig
    from trace_mega.learner.learner import Learner
    from trace_mega.learner.optim import train_step
    from trace_mega.learner.parallel import destroy_parallel
    from trace_mega.rollout.agent_loop import AgentLoop
    from trace_mega.rollout.tree import pack

    t0 = time.perf_counter()
    policy = TRANSCRIPT_POLICIES.get(cfg.env.name)
    env = build_env(cfg.env.name, **policy.env_options(cfg))
    tok = env.tokenizer
    tasks = env.tasks("train")
    learner = Learner(_train_config(cfg, len(tok)))
    rollout_cfg = RolloutConfig(max_turns=cfg.max_turns, max_new_tokens_per_turn=3, max_total_tokens=4096)
    loop = AgentLoop(env, policy(tok, cfg), tok, rollout_cfg)
    order = random.Random(cfg.seed).sample(range(len(tasks)), len(tasks))
    losses = []
    try:
        for step in range(cfg.steps):
            batch = [
                tasks[order[(step * cfg.episodes_per_step + j) % len(tasks)]] for j in range(cfg.episodes_per_step)
            ]
            trees = loop.rollout(batch, [1] * len(batch), seed=cfg.seed * 1_000_003 + step)
            AgentLoop.release(trees)
            per = cfg.micro_batch_episodes or len(trees)
            micro = []
            for i in range(0, len(trees), per):  # the tree mask is quadratic in a micro-batch's tokens
                packed = pack(trees[i : i + per])
                if cfg.loss_on_observations:  # every token but a sequence's first is a next-token target
                    packed.loss_mask = packed.prev_index >= 0
                ids, pos, mask = _inputs(packed, learner.groups.device, learner.groups.tp_size)
                micro.append({"input_ids": ids, "position_ids": pos, "tree_mask": mask, "packed": packed})
            metrics = train_step(
                learner.chunks,
                learner.optimizer,
                learner.scheduler,
                micro,
                _lm_loss(learner),
                learner.groups,
                output="hidden",
            )
            losses.append(metrics["loss"])
            if step % 50 == 0 or step == cfg.steps - 1:
                log.info("pretrain step %d/%d: nll %.4f", step, cfg.steps, metrics["loss"])
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        learner.save_hf(tmp)
        if learner.groups.rank == 0:
            tok.save_pretrained(tmp)
            record = {
                "config": to_dict(cfg),
                "hash": config_hash(cfg),
                "nll_first": losses[0],
                "nll_last10": sum(losses[-10:]) / len(losses[-10:]),
                "seconds": time.perf_counter() - t0,
            }
            (tmp / "pretrain.json").write_text(json.dumps(record, indent=1))
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)  # atomic: a half-written checkpoint is never served from the cache
    finally:
        loop.close()
        destroy_parallel()
    log.info("pretrain: wrote %s in %.1f s", out, time.perf_counter() - t0)
    return out
