"""The TRACE-C probe: ℓ̄ at every tool boundary of every trajectory in ONE reference forward.

For a boundary S_k (the prompt, or the history after a non-final turn) the probe is

    ℓ̄_k = (1/|y*|) Σ_t log π_ref(y*_t | S_k, template, y*_{<t}).

Scoring K boundaries of one trajectory separately costs K forwards over ever longer
contexts (Σ_k |S_k| + K·|probe| ≈ K·T/2 tokens). Instead every boundary node of the
rollout tree gets one extra child node holding `template + y*`; the tree (without its
final-answer turns, which no probe needs) is packed as usual (docs/PACKING.md), so each
probe copy attends only to its own prefix (the tree attention rule), and one forward
over ≤ T + K·|probe| tokens gives every ℓ̄ as the mean log-prob of the gold tokens of
its probe node. The boundaries of a tree are
nodes, so a prefix shared by several trajectories is scored once, not once per path.

Model interface (`PackedForward`): `fn(tokens, position_ids, token_node,
token_node_exit)`, each (1, T) int64, returning hidden states (T, H) [or (1, T, H)] to be
paired with `output_weight` (the fused vocab-parallel log-prob kernel), or logits
(T, V) [or (1, T, V)] when `output_weight` is None. `trace_mega.learner.optim.megatron_packed_forward`
adapts the learner's `TreeGPTModel`; `hf_packed_forward` a transformers causal LM (explicit
4-D additive tree mask + position ids).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from trace_mega.ops.logprobs import packed_token_logprobs
from trace_mega.rollout.tree import Node, PackedTrees, RolloutTree, pack

__all__ = [
    "PackedForward",
    "ProbeBatch",
    "ProbeResult",
    "answer_token_ids",
    "boundary_nodes",
    "check_answer_length",
    "check_task_answers",
    "build_probe_batch",
    "run_probe",
    "reference_probe",
    "hf_packed_forward",
]

# (tokens, position_ids, token_node, token_node_exit), (1, T) each -> (T, H) hidden states or (T, V)
# logits (a leading batch dim of 1 allowed); None on a pipeline stage before the last.
PackedForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Optional[torch.Tensor]]


def answer_token_ids(tokenize: Callable[[str], list[int]], template: str, gold: str) -> tuple[list[int], list[int]]:
    """(template ids, gold ids) as the tokenizer splits `template + gold` together.

    The gold part is what follows the longest common prefix of tokenize(template + gold)
    and tokenize(template), so a template token that merges with the answer is scored
    as part of the answer rather than mis-tokenising the boundary.
    """
    full = tokenize(template + gold)
    head = tokenize(template)
    n = 0
    while n < min(len(full), len(head)) and full[n] == head[n]:
        n += 1
    if n == len(full):
        raise ValueError(f"gold answer {gold!r} tokenizes to nothing after the template")
    return full[:n], full[n:]


def check_answer_length(gold_ids: Sequence[int], gold: str, max_answer_tokens: Optional[int], where: str) -> None:
    """Refuse a gold answer longer than `max_answer_tokens` (None: no limit) with a message naming it.

    The probe's state value is the mean log-prob of the gold answer; for long or open
    answers that proxy is unreliable, so such answers are refused rather than scored.
    """
    if max_answer_tokens is not None and len(gold_ids) > max_answer_tokens:
        raise ValueError(
            f"{where}: gold answer {gold[:60]!r}{'...' if len(gold) > 60 else ''} is {len(gold_ids)} tokens, more "
            f"than credit.max_answer_tokens = {max_answer_tokens}; TRACE-C scores compact verifiable answers only "
            "(the mean log-prob of a long answer is an unreliable state value). Shorten the gold answers, raise "
            "credit.max_answer_tokens knowingly, or switch credit off for this environment."
        )


def check_task_answers(
    tasks: Sequence, tokenize: Callable[[str], list[int]], answer_template: str, max_answer_tokens: Optional[int]
) -> None:
    """Before training: every task (`trace_mega.envs.base.Task`) has a gold answer the probe will score."""
    for task in tasks:
        if task.gold_answer is None:
            raise ValueError(f"task {task.task_id!r} has no gold_answer: TRACE-C (credit.enabled) cannot probe it")
        gold_ids = answer_token_ids(tokenize, answer_template, task.gold_answer)[1]
        check_answer_length(gold_ids, task.gold_answer, max_answer_tokens, f"task {task.task_id!r}")


def boundary_nodes(tree: RolloutTree) -> list[int]:
    """Local ids after which a boundary S_k lies: the root and every turn that is not a final answer."""
    return [i for i, n in enumerate(tree.nodes) if i == 0 or n.kind != "final"]


def nonfinite_probes(packed: PackedTrees, trees: Sequence[RolloutTree], node_ell: torch.Tensor) -> torch.Tensor:
    """(N,) bool: the boundaries of `packed` (the layout of `trees`) whose ℓ̄ in `node_ell` (N,) is not
    finite, i.e. a broken reference forward. NaN also marks "no boundary here" (a final answer),
    which the credit reads as no δ, so such values would otherwise pass unseen as zero credit."""
    boundaries = [set(boundary_nodes(t)) for t in trees]
    at = torch.tensor([lid in boundaries[ti] for ti, lid in packed.node_local], dtype=torch.bool)
    return at & ~torch.isfinite(node_ell.cpu())


@dataclass
class ProbeBatch:
    packed: PackedTrees
    """The trees with one probe leaf per boundary; `loss_mask` marks the gold tokens to score."""
    probe_node: torch.Tensor
    """(Q,) global id, in `packed`, of each probe node."""
    boundary: list[tuple[int, int]]
    """(tree index, local id of the boundary node) of each probe."""


def build_probe_batch(trees: Sequence[RolloutTree], answers: Sequence[tuple[list[int], list[int]]]) -> ProbeBatch:
    """The boundary nodes of `trees`, each with a `template + gold` leaf child, packed.

    `answers[i]` = (template ids, gold ids) of tree i (see `answer_token_ids`). Final-answer
    turns are leaves after which no boundary lies, so no probe needs them and they are
    left out: the stream holds every boundary prefix once plus one probe per boundary.
    """
    if len(answers) != len(trees):
        raise ValueError(f"{len(trees)} trees but {len(answers)} answers")
    probe_trees, owner = [], {}
    for ti, (tree, (tmpl, gold)) in enumerate(zip(trees, answers)):
        if not gold:
            raise ValueError(f"tree {tree.prompt_id!r}: empty gold answer")
        keep = boundary_nodes(tree)
        new_id = {old: new for new, old in enumerate(keep)}
        if any(tree.nodes[i].children for i in range(len(tree)) if i not in new_id):
            raise ValueError(f"tree {tree.prompt_id!r}: a final-answer turn has children")
        t = copy.copy(tree)
        t.nodes = []
        for old in keep:
            n = copy.copy(tree.nodes[old])
            n.parent = new_id.get(n.parent, -1)
            n.children = [new_id[c] for c in n.children if c in new_id] + [len(keep) + len(t.nodes)]
            t.nodes.append(n)
        ids = tmpl + gold
        for old in keep:  # probe leaves get local ids len(keep) ... in the same order
            owner[(ti, len(t.nodes))] = old
            t.nodes.append(
                Node(
                    new_id[old],
                    list(ids),
                    [0] * len(tmpl) + [1] * len(gold),
                    [0.0] * len(ids),
                    kind="final",
                    reward=0.0,
                )
            )
        probe_trees.append(t)
    packed = pack(probe_trees)
    # Only the gold tokens of the probe nodes are scored, never the trees' own tokens.
    probe_g, boundary = [], []
    for g, key in enumerate(packed.node_local):
        if key in owner:
            probe_g.append(g)
            boundary.append((key[0], owner[key]))
    scored = torch.zeros(packed.num_nodes, dtype=torch.bool)
    scored[probe_g] = True
    packed.loss_mask = packed.loss_mask & scored[packed.token_node]
    return ProbeBatch(packed, torch.tensor(probe_g, dtype=torch.long), boundary)


@dataclass
class ProbeResult:
    ell: list[torch.Tensor]
    """Per tree, (len(tree),) fp32 ℓ̄ at the boundary after each local node, NaN where none (final turns)."""

    def for_packed(self, packed: PackedTrees) -> torch.Tensor:
        """(N,) ℓ̄ in the global node order of `packed` (packed from the same trees, same order)."""
        return torch.stack([self.ell[ti][lid] for ti, lid in packed.node_local]) if packed.num_nodes else torch.zeros(0)


@torch.no_grad()
def run_probe(
    model: PackedForward,
    batch: ProbeBatch,
    *,
    output_weight: Optional[torch.Tensor] = None,
    tp_group=None,
    vocab_start: int = 0,
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """(Q,) ℓ̄ of every probe of `batch` from one forward of the frozen reference.

    ℓ̄_q = Σ_{gold tokens t of probe q} logp_t / |y*|, logp_t under the logits at prev_index[t].
    """
    p = batch.packed
    out = model(p.tokens[None], p.position_ids[None], p.token_node[None], p.token_node_exit[None])
    if out is None:  # a pipeline stage before the last: its layers ran, the last stage has the values
        return torch.full((batch.probe_node.numel(),), float("nan"))
    out = out[0] if out.dim() == 3 else out  # (T, H) or (T, V)
    p = p.to(out.device)  # the model may run on an accelerator; the batch is built on the host
    if output_weight is not None:
        lp = packed_token_logprobs(
            out, output_weight, p, tp_group=tp_group, vocab_start=vocab_start, vocab_size=vocab_size
        )
    else:
        if tp_group is not None:
            raise ValueError("vocab-parallel probing needs hidden states and output_weight")
        sel = torch.nonzero(p.loss_mask & (p.prev_index >= 0)).squeeze(1)  # (M,)
        logp = torch.log_softmax(out.index_select(0, p.prev_index[sel]).float(), dim=-1)  # (M, V)
        lp = out.new_zeros(p.num_tokens, dtype=torch.float32).index_copy(
            0, sel, logp.gather(1, p.tokens[sel, None]).squeeze(1)
        )
    total = lp.new_zeros(p.num_nodes).index_add(0, p.token_node, lp.float())
    count = lp.new_zeros(p.num_nodes).index_add(0, p.token_node, p.loss_mask.float())
    return (total / count.clamp(min=1))[batch.probe_node.to(lp.device)].cpu()


def _chunks(trees: Sequence[RolloutTree], sizes: Sequence[int], max_tokens: Optional[int]) -> list[list[int]]:
    """Consecutive tree indices grouped so each group's probe stream stays within max_tokens."""
    if max_tokens is None:
        return [list(range(len(trees)))]
    groups, cur, used = [], [], 0
    for i, n in enumerate(sizes):
        if cur and used + n > max_tokens:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    return groups + ([cur] if cur else [])


def reference_probe(
    model: PackedForward,
    trees: Sequence[RolloutTree],
    tokenize: Callable[[str], list[int]],
    answer_template: str,
    *,
    output_weight: Optional[torch.Tensor] = None,
    tp_group=None,
    vocab_start: int = 0,
    max_tokens: Optional[int] = None,
    max_answer_tokens: Optional[int] = None,
    vocab_size: Optional[int] = None,
) -> ProbeResult:
    """ℓ̄ at every boundary of every tree, one forward per group of trees (≤ `max_tokens` packed tokens).

    A gold answer longer than `max_answer_tokens` tokens raises ValueError (`check_answer_length`);
    `vocab_size` (the true vocabulary) keeps the TP padding rows out of the log-softmax."""
    answers = []
    for tree in trees:
        if tree.gold_answer is None:
            raise ValueError(f"tree {tree.prompt_id!r} has no gold_answer to probe")
        answers.append(answer_token_ids(tokenize, answer_template, tree.gold_answer))
        check_answer_length(answers[-1][1], tree.gold_answer, max_answer_tokens, f"tree {tree.prompt_id!r}")
    sizes = [
        sum(len(t.nodes[b].token_ids) + sum(map(len, a)) for b in boundary_nodes(t)) for t, a in zip(trees, answers)
    ]  # probe-stream tokens of each tree
    ell = [torch.full((len(t),), float("nan")) for t in trees]
    for group in _chunks(trees, sizes, max_tokens):
        batch = build_probe_batch([trees[i] for i in group], [answers[i] for i in group])
        values = run_probe(
            model, batch, output_weight=output_weight, tp_group=tp_group, vocab_start=vocab_start, vocab_size=vocab_size
        )
        for (ti, lid), v in zip(batch.boundary, values):
            ell[group[ti]][lid] = v
    return ProbeResult(ell)


def hf_packed_forward(hf_model: torch.nn.Module) -> PackedForward:
    """`PackedForward` (logits) for a transformers causal LM, via an explicit 4-D additive tree mask.

    transformers 5 passes a 4-D `attention_mask` through unchanged (masking_utils), so the
    mask (1, 1, T, T) is 0 where the tree rule allows attention and the dtype's minimum
    elsewhere; `position_ids` are the per-path depths. Materialises O(T²): reference only.
    """
    from trace_mega.kernels.tree_attention_ref import tree_mask

    def forward(tokens, position_ids, token_node, token_node_exit):
        param = next(hf_model.parameters())
        allowed = tree_mask(token_node, token_node_exit).to(param.device)  # (1, T, T) bool
        mask = torch.zeros(allowed.shape, dtype=param.dtype, device=param.device)
        mask.masked_fill_(~allowed, torch.finfo(param.dtype).min)
        out = hf_model(
            input_ids=tokens.to(param.device), attention_mask=mask[:, None], position_ids=position_ids.to(param.device)
        )
        return out.logits[0]  # (T, V)

    return forward
