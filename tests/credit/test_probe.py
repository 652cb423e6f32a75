"""TRACE-C probe: ℓ̄ at every boundary from ONE packed forward == K separate forwards (fp32, 1e-5)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trace_mega.config import AdvantageConfig, CreditConfig
from trace_mega.credit.probe import (
    answer_token_ids,
    boundary_nodes,
    build_probe_batch,
    hf_packed_forward,
    reference_probe,
)
from trace_mega.objective.advantages import compute_advantages
from trace_mega.rollout.tree import Node, RolloutTree, pack

VOCAB = 61
TEMPLATE = "=>"


def tokenize(s):
    """Characters to ids in [30, 61); the pair '=P' merges into one token (60) like a BPE merge."""
    out, i = [], 0
    while i < len(s):
        if s[i : i + 2] == "=P":
            out.append(60)
            i += 2
        else:
            out.append(30 + ord(s[i]) % 30)
            i += 1
    return out


def make_trees():
    g = torch.Generator().manual_seed(0)

    def turn(n, kind="tool"):
        ids = torch.randint(0, 30, (n,), generator=g).tolist()
        return Node(0, ids, [1] * n, [0.0] * n, kind=kind)

    a = RolloutTree("a", torch.randint(0, 30, (6,), generator=g).tolist(), gold_answer="Paris")
    x = a.add_node(0, turn(5))
    a.add_path(x, [turn(4), turn(3, "final")], 1.0)
    y = a.add_node(x, turn(6))
    a.add_path(y, [turn(2, "final")], 0.0)
    a.add_path(y, [turn(3)], 0.0)  # cut off after a tool call: its leaf is a boundary too
    a.add_path(0, [turn(4, "final")], 0.0)
    b = RolloutTree("b", torch.randint(0, 30, (4,), generator=g).tolist(), gold_answer="42")
    b.add_path(0, [turn(3), turn(5), turn(4), turn(2, "final")], 1.0)
    return [a, b]


def tiny_qwen3(seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    return Qwen3ForCausalLM(cfg).eval()


def separate_passes(logits_fn, trees):
    """The naive probe: one causal forward per boundary over S_k + template + y*."""
    out = []
    for tree in trees:
        tmpl, gold = answer_token_ids(tokenize, TEMPLATE, tree.gold_answer)
        ell = torch.full((len(tree),), float("nan"))
        for b in boundary_nodes(tree):
            ids = tree.prefix_token_ids(b) + tmpl + gold
            with torch.no_grad():
                logp = torch.log_softmax(logits_fn(torch.tensor([ids])).float(), -1)  # (S, V)
            n = len(ids)
            ell[b] = sum(logp[n - len(gold) - 1 + j, gold[j]] for j in range(len(gold))) / len(gold)
        out.append(ell)
    return out


def test_answer_token_ids_keeps_a_merged_boundary_token_in_the_answer():
    tmpl, gold = answer_token_ids(tokenize, "a=", "Paris")
    assert tmpl == tokenize("a") and gold == [60] + tokenize("aris")
    assert answer_token_ids(tokenize, "=>", "42") == (tokenize("=>"), tokenize("42"))
    with pytest.raises(ValueError, match="nothing"):
        answer_token_ids(tokenize, "ab", "")


def test_probe_batch_layout():
    trees = make_trees()
    answers = [answer_token_ids(tokenize, TEMPLATE, t.gold_answer) for t in trees]
    batch = build_probe_batch(trees, answers)
    K = [len(boundary_nodes(t)) for t in trees]
    assert K == [5, 4]  # a: root, x, x's tool child, y, the cut-off leaf; b: root and its three tool turns
    plain = pack(trees)
    probe_len = [len(tm) + len(gd) for tm, gd in answers]
    final_tokens = sum(len(n.token_ids) for t in trees for n in t.nodes if n.kind == "final")
    assert final_tokens > 0  # final-answer turns are dropped: no probe hangs below them
    assert batch.packed.num_tokens == plain.num_tokens - final_tokens + sum(k * n for k, n in zip(K, probe_len))
    assert len(batch.boundary) == batch.probe_node.numel() == sum(K)
    assert int(batch.packed.loss_mask.sum()) == sum(k * len(gd) for k, (_, gd) in zip(K, answers))
    # each probe node is a leaf below its boundary: the path to it is S_k + template + gold
    P = batch.packed
    for g, (ti, lid), (tm, gd) in zip(
        batch.probe_node.tolist(), batch.boundary, [answers[ti] for ti, _ in batch.boundary]
    ):
        assert P.tokens[P.path_token_indices(g)].tolist() == trees[ti].prefix_token_ids(lid) + tm + gd
        assert int(P.node_exit[g]) == g
    assert len(trees[0]) == 8 and trees[0].nodes[6].children == []  # the originals are untouched


def test_one_packed_pass_equals_separate_passes_hf_logits():
    model = tiny_qwen3()
    trees = make_trees()
    res = reference_probe(hf_packed_forward(model), trees, tokenize, TEMPLATE)
    ref = separate_passes(lambda ids: model(input_ids=ids).logits[0], trees)
    for got, want in zip(res.ell, ref):
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        ok = ~torch.isnan(want)
        assert (got[ok] - want[ok]).abs().max() < 1e-5
        assert want[ok].std() > 1e-3  # boundaries really differ
    # grouping trees into several forwards changes nothing
    chunked = reference_probe(hf_packed_forward(model), trees, tokenize, TEMPLATE, max_tokens=40)
    for a, b in zip(chunked.ell, res.ell):
        assert torch.allclose(a, b, atol=1e-6, equal_nan=True)


def test_hidden_state_path_with_the_fused_kernel():
    model = tiny_qwen3(seed=1)
    trees = make_trees()
    from trace_mega.kernels.tree_attention_ref import tree_mask

    def hidden_fwd(tokens, pos, node, node_exit):
        allowed = tree_mask(node, node_exit)[:, None]
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        return model.model(input_ids=tokens, attention_mask=mask, position_ids=pos).last_hidden_state[0]

    res = reference_probe(hidden_fwd, trees, tokenize, TEMPLATE, output_weight=model.lm_head.weight)
    ref = separate_passes(lambda ids: model(input_ids=ids).logits[0], trees)
    for got, want in zip(res.ell, ref):
        ok = ~torch.isnan(want)
        assert (got[ok] - want[ok]).abs().max() < 1e-5


def test_probe_feeds_trace_credit_advantages():
    model = tiny_qwen3()
    trees = make_trees()
    res = reference_probe(hf_packed_forward(model), trees, tokenize, TEMPLATE)
    p = pack(trees)
    ell = res.for_packed(p)
    finals = torch.tensor([trees[ti].nodes[lid].kind == "final" for ti, lid in p.node_local])
    assert torch.equal(torch.isnan(ell), finals)
    out = compute_advantages(p, trees, AdvantageConfig(name="tree"), CreditConfig(enabled=True), ell)
    assert torch.isfinite(out.advantages).all() and out.advantages.abs().sum() > 0


def test_missing_gold_answer_is_an_error():
    trees = make_trees()
    trees[1].gold_answer = None
    with pytest.raises(ValueError, match="gold_answer"):
        reference_probe(hf_packed_forward(tiny_qwen3()), trees, tokenize, TEMPLATE)


def megatron_worker(out_path):
    """ℓ̄ via the learner's TreeGPTModel (hidden states + vocab-parallel kernel path, TP=1) vs separate passes."""
    from trace_mega.config import ModelConfig, ParallelConfig
    from trace_mega.learner.models import build_model, forward_packed, output_weight
    from trace_mega.learner.optim import megatron_packed_forward
    from trace_mega.learner.parallel import destroy_parallel, init_parallel

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
        max_position_embeddings=128,
        attention_backend="sdpa",
    )
    model = build_model(mcfg, par, groups.pgs, groups.device, 0, 1).eval()
    trees = make_trees()
    # pad_multiple=16 exercises the padding node that TP > 1 needs (the stream is not a multiple of 16)
    res = reference_probe(
        megatron_packed_forward(model, pad_multiple=16),
        trees,
        tokenize,
        TEMPLATE,
        output_weight=output_weight(model),
        tp_group=groups.pgs.tp,
        vocab_start=0,
    )

    def logits(ids):
        pos = torch.arange(ids.shape[1])[None]
        return forward_packed(model, ids, pos, None, output="full_logits")[0]

    ref = separate_passes(logits, trees)
    answers = [answer_token_ids(tokenize, TEMPLATE, t.gold_answer) for t in trees]
    assert build_probe_batch(trees, answers).packed.num_tokens % 16 != 0
    diff = max(float((g[~torch.isnan(w)] - w[~torch.isnan(w)]).abs().max()) for g, w in zip(res.ell, ref))
    Path(out_path).write_text(json.dumps({"max_abs_diff": diff}))
    destroy_parallel()


@pytest.mark.slow
def test_one_packed_pass_equals_separate_passes_megatron(tmp_path):
    out = tmp_path / "res.json"
    proc = subprocess.run(
        [sys.executable, __file__, str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    diff = json.loads(out.read_text())["max_abs_diff"]
    assert math.isfinite(diff) and diff < 1e-5, diff


if __name__ == "__main__":
    megatron_worker(sys.argv[1])
