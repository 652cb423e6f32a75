"""Training on a packed tree == training on its flattened paths: same loss, same gradients.

The packed stream stores each shared prefix once (tree attention, per-path position ids,
per_leaf token weights); the flattened batch repeats it once per trajectory (plain causal
rows, every token weight 1). With the same per-token advantages and behaviour log-probs
the two losses and all parameter gradients agree within 1e-5 (fp32), for the token-,
sequence- and prompt-level PPO-clip aggregations and GSPO. Two models: a pure-torch
transformer defined here (in-process) and the learner's Megatron-Core `TreeGPTModel`
(TP=1, in a subprocess so megatron's global state stays out of this test process).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trace_mega.config import AdvantageConfig, LossConfig
from trace_mega.kernels.tree_attention_ref import tree_mask
from trace_mega.objective.advantages import compute_advantages
from trace_mega.objective.losses import compute_loss, resolve_clip
from trace_mega.ops.logprobs import flat_token_logprobs, packed_token_logprobs
from trace_mega.rollout.tree import Node, RolloutTree, pack

VOCAB = 50
LOSS_CASES = [
    ("ppo_clip_token", None),
    ("ppo_clip_token", "sequence_mean"),
    ("ppo_clip_token", "prompt_mean"),
    ("gspo", None),
]


def make_trees(seed=0):
    """Two rollout trees with branch points at the root and mid-trajectory (prompt/observation tokens masked)."""
    g = torch.Generator().manual_seed(seed)

    def turn(n_gen, n_obs=0):
        ids = torch.randint(0, VOCAB, (n_gen + n_obs,), generator=g).tolist()
        return Node(0, ids, [1] * n_gen + [0] * n_obs, [0.0] * (n_gen + n_obs))

    a = RolloutTree("a", torch.randint(0, VOCAB, (5,), generator=g).tolist())
    x = a.add_node(0, turn(3, 2))
    a.add_path(x, [turn(4)], 1.0)
    y = a.add_node(x, turn(2, 3))
    a.add_path(y, [turn(3)], 0.0)
    a.add_path(y, [turn(2)], 1.0)
    a.add_path(0, [turn(3, 1), turn(2)], 0.0)
    b = RolloutTree("b", torch.randint(0, VOCAB, (4,), generator=g).tolist())
    b.add_path(0, [turn(3, 2), turn(2)], 1.0)
    b.add_path(0, [turn(4)], 0.0)
    b.add_path(0, [turn(1, 1), turn(3)], 0.0)
    return [a, b]


def prepare(trees):
    """Packed batch with `tree` advantages and per_leaf token weights (the flattened-equivalent weights)."""
    p = pack(trees)
    return compute_advantages(p, trees, AdvantageConfig(name="tree", shared_token_weight="per_leaf")).loss_batch(p)


def flat_loss(lp, batch, f, name, agg):
    """The flattened-path loss written out directly: (L, S) rows, every token weight 1."""
    p = batch.packed
    eps = resolve_clip(LossConfig(name=name))
    idx, m = f.packed_index.clamp(min=0), f.loss_mask
    mf = m.float()
    x = torch.where(m, lp - f.behaviour_logprobs, 0.0)  # (L, S)
    A = torch.where(m, batch.advantages[idx], 0.0)
    n = mf.sum(1)
    if name == "gspo":
        s = torch.exp((x * mf).sum(1) / n).detach()[:, None] * torch.exp(x - x.detach())
        term = torch.minimum(s * A, s.clamp(1 - eps[0], 1 + eps[1]) * A)
        return -((term * mf).sum(1) / n).mean()
    r = torch.exp(x)
    ell = -torch.minimum(r * A, r.clamp(1 - eps[0], 1 + eps[1]) * A) * mf
    if agg is None:
        return ell.sum() / mf.sum()
    if agg == "sequence_mean":
        return (ell.sum(1) / n).mean()
    tree = p.node_tree[f.leaf_node]
    return torch.stack([ell[tree == b].sum() / mf[tree == b].sum() for b in range(p.num_trees)]).mean()


def compare(model_packed, model_flat, weight, params, b):
    """{case: (|Δloss|, max |Δgrad|)} between packed and flattened training of `params` on the loss input `b`."""
    p = b.packed
    f = p.flatten()
    with torch.no_grad():  # behaviour log-probs: the current policy, perturbed so some ratios clip
        lp0 = packed_token_logprobs(model_packed(p), weight(), p)
        noise = 0.3 * torch.sin(torch.arange(p.num_tokens, dtype=torch.float32) * 1.7)
        p.behaviour_logprobs = torch.where(p.loss_mask, lp0 + noise, 0.0)
    f.behaviour_logprobs = torch.where(f.loss_mask, p.behaviour_logprobs[f.packed_index.clamp(min=0)], 0.0)
    out = {}
    for name, agg in LOSS_CASES:
        cfg = LossConfig(name=name, aggregation=agg)
        lp = packed_token_logprobs(model_packed(p), weight(), p)
        packed = compute_loss(lp, b, cfg).loss
        gp = torch.autograd.grad(packed, params)
        flp = flat_token_logprobs(model_flat(f), weight(), f)
        flat = flat_loss(flp, b, f, name, agg)
        gf = torch.autograd.grad(flat, params)
        out[f"{name}/{agg}"] = (
            abs(packed.item() - flat.item()),
            max((a - b).abs().max().item() for a, b in zip(gp, gf)),
            max(b.abs().max().item() for b in gf),
        )
    return out


class TinyTreeLM(torch.nn.Module):
    """Pre-norm transformer on token ids with learned position embeddings and a boolean attention mask."""

    def __init__(self, vocab=VOCAB, hidden=32, heads=4, layers=2, max_pos=64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.pos = torch.nn.Embedding(max_pos, hidden)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(hidden, heads, 2 * hidden, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = torch.nn.LayerNorm(hidden)

    def forward(self, ids, pos, allowed):  # (B, T), (B, T), (B, T, T) True = may attend
        h = self.emb(ids) + self.pos(pos)
        heads = self.layers[0].self_attn.num_heads
        mask = (~allowed).repeat_interleave(heads, 0)  # (B*heads, T, T), True = blocked
        for layer in self.layers:
            h = layer(h, src_mask=mask)
        return self.norm(h)  # (B, T, H)


def test_packed_equals_flattened_pure_torch_model():
    torch.manual_seed(0)
    model = TinyTreeLM()
    trees = make_trees()
    b = prepare(trees)
    p = b.packed
    assert p.compression_ratio() > 1.4

    def packed_fwd(p):
        return model(p.tokens[None], p.position_ids[None], tree_mask(p.token_node[None], p.token_node_exit[None]))[0]

    def flat_fwd(f):
        L, S = f.tokens.shape
        causal = torch.ones(S, S, dtype=torch.bool).tril().expand(L, S, S)
        return model(f.tokens, f.position_ids, causal)

    res = compare(packed_fwd, flat_fwd, lambda: model.emb.weight, list(model.parameters()), b)
    for case, (dloss, dgrad, gmax) in res.items():
        assert dloss < 1e-5, (case, dloss)
        assert dgrad < 1e-5, (case, dgrad)
        assert gmax > 1e-4, case  # the gradients are not trivially zero


def megatron_worker(out_path: str) -> None:
    """Run the comparison with the learner's TreeGPTModel (TP=1); write the results as JSON."""
    from trace_mega.config import ModelConfig, ParallelConfig
    from trace_mega.learner.models import build_model, forward_packed, output_weight
    from trace_mega.learner.parallel import destroy_parallel, init_parallel
    from trace_mega.ops.attention import tree_attention_mask

    torch.set_num_threads(1)
    par = ParallelConfig(device="cpu")
    groups = init_parallel(par, seed=0)
    mcfg = ModelConfig(
        vocab_size=VOCAB,
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=8,
        max_position_embeddings=64,
        attention_backend="sdpa",
    )
    model = build_model(mcfg, par, groups.pgs, groups.device, 0, 1)
    b = prepare(make_trees())

    def packed_fwd(p):
        mask = tree_attention_mask(p.token_node[None], p.token_node_exit[None])
        return forward_packed(model, p.tokens[None], p.position_ids[None], mask, output="hidden")[0]

    def flat_fwd(f):
        return forward_packed(model, f.tokens, f.position_ids, None, output="hidden")

    params = [q for q in model.parameters() if q.requires_grad]
    res = compare(packed_fwd, flat_fwd, lambda: output_weight(model), params, b)
    Path(out_path).write_text(json.dumps(res))
    destroy_parallel()


@pytest.mark.slow
def test_packed_equals_flattened_megatron_model(tmp_path):
    out = tmp_path / "res.json"
    proc = subprocess.run(
        [sys.executable, __file__, str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert set(res) == {f"{n}/{a}" for n, a in LOSS_CASES}
    for case, (dloss, dgrad, gmax) in res.items():
        assert dloss < 1e-5, (case, dloss)
        assert dgrad < 1e-5, (case, dgrad)
        assert gmax > 1e-4 and math.isfinite(gmax), case


if __name__ == "__main__":
    megatron_worker(sys.argv[1])
