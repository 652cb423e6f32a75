"""Tree attention kernel vs its references (SDPA + materialised mask, flex_attention).

Runs under TRITON_INTERPRET=1 on CPU (tests/conftest.py sets it before the
kernel module is imported).  Interpreter cost grows with program count, so
shapes stay small and most cases use 32-wide tiles to get several tiles per
axis (odd T exercises the ragged last tile).
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trace_mega.kernels.tree_attention as ta
from trace_mega.kernels.tree_attention import tile_skip_stats, tree_attention, tree_attention_tiled
from trace_mega.kernels.tree_attention_ref import tree_attention_flex, tree_attention_reference, tree_layout, tree_mask

# ----------------------------------------------------------------- tree shapes


def _chain(n_nodes: int, seed: int):
    rng = random.Random(seed)
    return list(range(-1, n_nodes - 1)), [rng.randint(1, 9) for _ in range(n_nodes)]


def _fanout(n_leaves: int, root_len: int, seed: int):
    rng = random.Random(seed)
    return [-1] + [0] * n_leaves, [root_len] + [rng.randint(1, 3) for _ in range(n_leaves)]


def _empty_branches():
    # 0: prompt; 1 (empty) has children 2, 3 (3 empty leaf); 4 empty internal with
    # child 5; 6 empty leaf under root; 7 under 5.  Exits must skip the empty ids.
    parents = [-1, 0, 1, 1, 0, 4, 0, 5]
    lengths = [9, 0, 6, 0, 0, 7, 0, 5]
    return parents, lengths


def _forest():
    # three trees in one stream: a branched tree, a single node, a small chain
    parents = [-1, 0, 1, 1, 0, -1, -1, 6, 7]
    lengths = [11, 5, 4, 6, 8, 13, 7, 3, 9]
    return parents, lengths


CASES = {
    "single37": ([-1], [37]),
    "single100": ([-1], [100]),
    "deep_chain": _chain(20, seed=1),
    "wide_fanout": _fanout(40, root_len=12, seed=2),
    "empty_branches": _empty_branches(),
    "forest": _forest(),
}


def _tokens(layouts, pad_to: int | None = None, interior_pad: int = 0):
    """(B, T) int64 token_node / token_node_exit from per-row (parents, lengths), padded with -1."""
    rows = [tree_layout(p, l) for p, l in layouts]
    if interior_pad:
        # padding between two halves of the stream (e.g. alignment padding between trees)
        rows = [
            (
                n[: len(n) // 2] + [-1] * interior_pad + n[len(n) // 2 :],
                e[: len(e) // 2] + [-7] * interior_pad + e[len(e) // 2 :],
            )
            for n, e in rows
        ]
    T = max(len(n) for n, _ in rows) if pad_to is None else pad_to
    tn = torch.full((len(rows), T), -1, dtype=torch.int64)
    te = torch.full((len(rows), T), -1, dtype=torch.int64)
    for b, (n, e) in enumerate(rows):
        tn[b, : len(n)] = torch.tensor(n)
        te[b, : len(e)] = torch.tensor(e)
    return tn, te


def _qkv(B, T, Hq, Hkv, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, T, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, T, Hkv, D, generator=g).to(dtype)
    do = torch.randn(B, T, Hq, D, generator=g).to(dtype)
    return q, k, v, do


def _fwd_bwd(fn, q, k, v, do, tn, te, **kw):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    o = fn(q, k, v, tn, te, **kw)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def _ref32(q, k, v, do, tn, te, **kw):
    """fp32 SDPA reference on the (possibly low-precision) inputs."""
    return _fwd_bwd(tree_attention_reference, q.float(), k.float(), v.float(), do.float(), tn, te, **kw)


def _assert_close(got, want, atol, rtol, names=("o", "dq", "dk", "dv")):
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------- the mask


def test_tree_mask_matches_bruteforce_rule():
    tn, te = _tokens([_empty_branches(), _forest()], interior_pad=3)
    m = tree_mask(tn, te)
    B, T = tn.shape
    for b in range(B):
        for i in range(T):
            for j in range(T):
                ni, nj, ej = int(tn[b, i]), int(tn[b, j]), int(te[b, j])
                want = ni >= 0 and nj >= 0 and nj <= ni <= ej and j <= i
                assert bool(m[b, i, j]) == want, (b, i, j)
    # every real token attends itself; padding has empty rows and columns
    real = tn >= 0
    assert torch.equal(torch.diagonal(m, dim1=1, dim2=2), real)
    assert not m[~real].any() and not m.transpose(1, 2)[~real].any()


def test_tree_layout_matches_rollout_pack():
    from trace_mega.rollout.tree import Node, RolloutTree, pack

    parents, lengths = _empty_branches()
    tree = RolloutTree("p", list(range(lengths[0])))
    for n in range(1, len(parents)):
        toks = list(range(lengths[n]))
        tree.add_node(parents[n], Node(-1, toks, [1] * len(toks), [0.0] * len(toks)))
    for leaf in tree.leaves():
        tree.nodes[leaf].reward = 1.0
    packed = pack([tree, tree])
    tn, te = tree_layout(parents + [p + len(parents) if p >= 0 else -1 for p in parents], lengths * 2)
    assert packed.token_node.tolist() == tn
    assert packed.token_node_exit.tolist() == te


# ----------------------------------------------------------------- fp32 fwd + bwd


@pytest.mark.parametrize("case", list(CASES))
def test_fp32_matches_sdpa_reference(case):
    tn, te = _tokens([CASES[case]])
    q, k, v, do = _qkv(1, tn.shape[1], 4, 2, 16, seed=hash(case) % 1000)
    got = _fwd_bwd(tree_attention_tiled, q, k, v, do, tn, te, block_m=32, block_n=32)
    _assert_close(got, _ref32(q, k, v, do, tn, te), atol=1e-4, rtol=1e-4)


def test_single_node_is_plain_causal_attention():
    """Independent of tree_mask: one node (token_node = token_node_exit = 0) is causal SDPA."""
    tn = torch.zeros(2, 37, dtype=torch.long)
    q, k, v, _ = _qkv(2, 37, 4, 2, 16, seed=21)
    got = tree_attention_tiled(q, k, v, tn, tn, block_m=16, block_n=32)
    kk, vv = (x.transpose(1, 2).repeat_interleave(2, dim=1) for x in (k, v))  # (B, Hq, T, D)
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, is_causal=True)
    torch.testing.assert_close(got, want.transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (4, 2, 64), (4, 1, 16), (4, 1, 64), (2, 1, 40)])
def test_fp32_gqa_and_head_dims(hq, hkv, d):
    tn, te = _tokens([_chain(14, seed=3), _forest()])  # B=2, different trees per row
    q, k, v, do = _qkv(2, tn.shape[1], hq, hkv, d, seed=d + hkv)
    got = _fwd_bwd(tree_attention_tiled, q, k, v, do, tn, te, block_m=32, block_n=32)
    _assert_close(got, _ref32(q, k, v, do, tn, te), atol=1e-4, rtol=1e-4)


def test_fp32_default_tiles_custom_scale_and_rectangular_tiles():
    tn, te = _tokens([_fanout(30, 20, seed=4), _empty_branches()], pad_to=83)
    q, k, v, do = _qkv(2, 83, 4, 2, 16, seed=5)
    want = _ref32(q, k, v, do, tn, te, scale=0.3)
    _assert_close(_fwd_bwd(tree_attention, q, k, v, do, tn, te, scale=0.3), want, atol=1e-4, rtol=1e-4)
    got = _fwd_bwd(tree_attention_tiled, q, k, v, do, tn, te, scale=0.3, block_m=32, block_n=16)
    _assert_close(got, want, atol=1e-4, rtol=1e-4)
    got = _fwd_bwd(tree_attention_tiled, q, k, v, do, tn, te, scale=0.3, block_m=16, block_n=32)
    _assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_int32_token_arrays_and_noncontiguous_sbhd_inputs():
    # Megatron keeps activations as (T, B, H, D); the leaf may pass transposed views
    tn, te = _tokens([_forest(), _chain(8, seed=6)])
    T = tn.shape[1]
    q, k, v, do = _qkv(2, T, 4, 2, 16, seed=7)
    qs, ks, vs = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v))
    assert not qs.is_contiguous()
    got = _fwd_bwd(tree_attention_tiled, qs, ks, vs, do, tn.int(), te.int(), block_m=32, block_n=32)
    _assert_close(got, _ref32(q, k, v, do, tn, te), atol=1e-4, rtol=1e-4)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), n_nodes=st.integers(1, 12), hkv=st.sampled_from([1, 2]))
def test_fp32_random_forests(seed, n_nodes, hkv):
    rng = random.Random(seed)
    parents = [-1] + [rng.randrange(i) if rng.random() > 0.15 else -1 for i in range(1, n_nodes)]
    lengths = [rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(n_nodes)]
    lengths[0] = max(lengths[0], 1)
    tn, te = _tokens([(parents, lengths)], pad_to=sum(lengths) + rng.randint(0, 5))
    q, k, v, do = _qkv(1, tn.shape[1], 2, hkv, 16, seed=seed)
    got = _fwd_bwd(tree_attention_tiled, q, k, v, do, tn, te, block_m=16, block_n=16)
    _assert_close(got, _ref32(q, k, v, do, tn, te), atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------- low precision

# Kernel accumulates in fp32; the error is the inputs/outputs' rounding (and, under
# the interpreter, truncating fp32 -> bf16 stores).  Reference: fp32 SDPA on the
# same rounded inputs.
_TOL = {torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["deep_chain", "forest"])
def test_half_precision_forward_and_backward(dtype, case):
    tn, te = _tokens([CASES[case]], pad_to=len(tree_layout(*CASES[case])[0]) + 3)
    q, k, v, do = _qkv(1, tn.shape[1], 4, 2, 64, dtype=dtype, seed=11)
    got = _fwd_bwd(tree_attention_tiled, q, k, v, do, tn, te, block_m=32, block_n=32)
    assert all(x.dtype == dtype for x in got)
    want = _ref32(q, k, v, do, tn, te)
    atol, rtol = _TOL[dtype]
    _assert_close(got[:1], want[:1], atol=atol, rtol=rtol)
    # gradients are sums over many keys/queries: scale the tolerance with their magnitude
    for name, a, b in zip(("dq", "dk", "dv"), got[1:], want[1:]):
        torch.testing.assert_close(
            a.float(), b, atol=atol * max(1.0, b.abs().max().item()), rtol=rtol, msg=lambda m: f"{name}: {m}"
        )


# ----------------------------------------------------------------- flex peer


@pytest.mark.parametrize("hkv", [4, 1])
def test_flex_attention_peer_agrees(hkv):
    tn, te = _tokens([_fanout(25, 30, seed=8), _forest()], pad_to=130)
    q, k, v, _ = _qkv(2, 130, 4, hkv, 16, seed=12)
    flex = tree_attention_flex(q, k, v, tn, te)
    ref = tree_attention_reference(q, k, v, tn, te)
    got = tree_attention_tiled(q, k, v, tn, te, block_m=64, block_n=64)
    torch.testing.assert_close(flex, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, flex, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------- padding


def test_padding_is_inert():
    """Padding tokens: output 0, zero grads, and inserting them changes nothing else."""
    parents, lengths = _forest()
    tn0, te0 = _tokens([(parents, lengths)])
    tn, te = _tokens([(parents, lengths)], interior_pad=5)
    tn = torch.cat([tn, torch.full((1, 6), -1)], 1)  # and a tail
    te = torch.cat([te, torch.full((1, 6), 3)], 1)  # garbage exits on padding are ignored
    pad = tn[0] < 0
    T = tn.shape[1]
    q, k, v, do = _qkv(1, T, 4, 2, 16, seed=13)
    # NaN-free but large garbage in padded q/k/v must not leak anywhere
    for x in (q, k, v):
        x[0, pad] = 1e4
    o, dq, dk, dv = _fwd_bwd(tree_attention_tiled, q, k, v, do, tn, te, block_m=32, block_n=32)
    assert torch.all(o[0, pad] == 0) and torch.all(dq[0, pad] == 0)
    assert torch.all(dk[0, pad] == 0) and torch.all(dv[0, pad] == 0)
    real = ~pad
    compact = _fwd_bwd(tree_attention_reference, q[:, real], k[:, real], v[:, real], do[:, real], tn0, te0)
    _assert_close((o[:, real], dq[:, real], dk[:, real], dv[:, real]), compact, atol=1e-4, rtol=1e-4)
    _assert_close((o, dq, dk, dv), _ref32(q, k, v, do, tn, te), atol=1e-4, rtol=1e-4)


def test_all_padding_batch_row():
    tn, te = _tokens([_chain(5, seed=9)])
    tn = torch.cat([tn, torch.full_like(tn, -1)])  # row 1 is entirely padding
    te = torch.cat([te, torch.full_like(te, -1)])
    q, k, v, do = _qkv(2, tn.shape[1], 2, 2, 16, seed=14)
    got = _fwd_bwd(tree_attention_tiled, q, k, v, do, tn, te, block_m=16, block_n=16)
    assert all(torch.all(x[1] == 0) for x in got)
    _assert_close(got, _ref32(q, k, v, do, tn, te), atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------- tile skipping


def _dense_tiles(tn, te, bm, bn):
    """(B, nQ, nK) bool pair (any allowed entry in the tile, every entry of a full tile allowed)."""
    m = tree_mask(tn, te)
    B, T = tn.shape
    nq, nk = -(-T // bm), -(-T // bn)
    need = torch.zeros(B, nq, nk, dtype=torch.bool)
    full = torch.zeros(B, nq, nk, dtype=torch.bool)
    for a in range(nq):
        for c in range(nk):
            blk = m[:, a * bm : (a + 1) * bm, c * bn : (c + 1) * bn].flatten(1)
            need[:, a, c] = blk.any(1)
            full[:, a, c] = blk.all(1) & (blk.shape[1] == bm * bn)
    return need, full


@pytest.mark.parametrize("case", ["wide_fanout", "forest", "empty_branches", "deep_chain"])
def test_tile_skip_rule_is_sound(case):
    """No tile pair holding an allowed entry is skipped; no pair run without the mask has a masked entry."""
    tn, te = _tokens([CASES[case], _chain(6, seed=10)], interior_pad=4)
    for bm, bn in [(16, 16), (32, 16), (16, 32)]:
        need, full = _dense_tiles(tn, te, bm, bn)
        stats = tile_skip_stats(tn, te, bm, bn, return_masks=True)
        visited, unmasked = stats["visited_mask"], stats["unmasked_mask"]
        assert not (need & ~visited).any(), "a tile with allowed pairs would be skipped"
        assert not (unmasked & ~full).any(), "a tile with masked pairs would run unmasked"
        assert stats["visited"] == int(visited.sum()) >= int(need.sum())
        assert stats["unmasked"] == int(unmasked.sum())
        assert stats["causal"] >= stats["visited"] >= stats["unmasked"]


@pytest.mark.parametrize("by_key", [False, True])
def test_tile_plan_lists_exactly_the_visited_tiles(by_key):
    """The kernels' block-sparse plan: per row, the visited column tiles ascending, with mask flags."""
    tn, te = _tokens([_forest(), _fanout(20, 10, seed=3)], interior_pad=3)
    cnt, idx, part = ta._tile_plan(tn, te, 16, 32, by_key=by_key)
    st = tile_skip_stats(tn, te, 16, 32, return_masks=True)
    vis, unm = st["visited_mask"], st["unmasked_mask"]  # (B, nQ, nK)
    if by_key:
        vis, unm = vis.transpose(1, 2), unm.transpose(1, 2)
    assert cnt.dtype == idx.dtype == part.dtype == torch.int32 and idx.shape == vis.shape
    assert (
        int(cnt.sum()) == st["visited"]
        and int((part == 0).logical_and(torch.arange(idx.shape[-1]) < cnt[..., None]).sum()) == st["unmasked"]
    )
    for b in range(vis.shape[0]):
        for r in range(vis.shape[1]):
            n = int(cnt[b, r])
            cols = idx[b, r, :n].long()
            assert cols.tolist() == vis[b, r].nonzero().flatten().tolist()
            assert part[b, r, :n].bool().tolist() == (~unm[b, r])[cols].tolist()


def test_correctness_cases_exercise_unmasked_tiles():
    # the fast path (no mask evaluated) must actually run in the fp32 correctness tests above
    tn, te = _tokens([CASES["deep_chain"]])
    assert tile_skip_stats(tn, te, 32, 32)["unmasked"] > 0
    tn, te = _tokens([_fanout(30, 20, seed=4), _empty_branches()], pad_to=83)
    assert tile_skip_stats(tn, te, 32, 16)["unmasked"] > 0
    assert tile_skip_stats(tn, te, 64, 32)["unmasked"] == 0  # 64-row tiles straddle nodes or T


def test_tile_skip_stats_skips_sibling_tiles():
    # two big sibling subtrees: the second one's query tiles skip all of the first one's keys
    tn, te = _tokens([([-1, 0, 0], [16, 64, 64])])
    s = tile_skip_stats(tn, te, 16, 16)
    assert s["causal"] == 9 * 10 // 2  # 144 tokens = 9 tiles: the lower triangle with diagonal
    # query tiles 5..8 (node 2) skip key tiles 1..4 (node 1): 4 * 4 pairs
    assert s["causal"] - s["visited"] == 16
    assert s["skipped_frac"] == pytest.approx(16 / s["causal"])


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter's max over poisoned rows
def test_kernels_really_skip_masked_tiles():
    """NaN-poison inputs in tiles that another tile may not see.

    A visited-but-masked tile still multiplies P=0 (or dS=0) by the poisoned
    values and turns the whole output tile into NaN, so finite, correct
    outputs prove the forward, dQ and dK/dV kernels never loaded that tile.
    """
    # node 1 and node 2 are siblings of 32 tokens each after a 32-token prompt;
    # with 32-wide tiles, node 1 = tile 1 and node 2 = tile 2
    tn, te = _tokens([([-1, 0, 0], [32, 32, 32])])
    q, k, v, do = _qkv(1, 96, 2, 1, 16, seed=15)
    node1, node2 = slice(32, 64), slice(64, 96)

    # (a) poisoned keys/values of node 1: forward and dQ of node 2's queries are clean
    pk, pv = k.clone(), v.clone()
    pk[:, node1], pv[:, node1] = float("nan"), float("nan")
    o, dq, _, _ = _fwd_bwd(tree_attention_tiled, q, pk, pv, do, tn, te, block_m=32, block_n=32)
    assert torch.isnan(o[:, node1]).all()  # node 1 really sees its own poison
    want = _ref32(q, k, v, do, tn, te)
    torch.testing.assert_close(o[:, node2], want[0][:, node2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dq[:, node2], want[1][:, node2], atol=1e-4, rtol=1e-4)

    # (b) poisoned queries/output grads of node 2: dK/dV of node 1's keys are clean
    pq, pdo = q.clone(), do.clone()
    pq[:, node2], pdo[:, node2] = float("nan"), float("nan")
    _, _, dk, dv = _fwd_bwd(tree_attention_tiled, pq, k, v, pdo, tn, te, block_m=32, block_n=32)
    assert torch.isnan(dk[:, :32]).all()  # the root's keys are seen by node 2
    torch.testing.assert_close(dk[:, node1], want[2][:, node1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dv[:, node1], want[3][:, node1], atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------- API edges


def test_input_validation():
    tn, te = _tokens([([-1], [8])])
    q, k, v, _ = _qkv(1, 8, 4, 3, 16)
    with pytest.raises(ValueError, match="GQA"):
        tree_attention(q, k, v, tn, te)
    q, k, v, _ = _qkv(1, 8, 4, 2, 16)
    with pytest.raises(ValueError, match="dtype"):
        tree_attention(q, k.half(), v, tn, te)
    with pytest.raises(ValueError, match="token_node"):
        tree_attention(q, k, v, tn[:, :5], te[:, :5])
    with pytest.raises(ValueError, match="integer"):
        tree_attention(q, k, v, tn.float(), te)
    with pytest.raises(ValueError, match="powers of two"):
        tree_attention_tiled(q, k, v, tn, te, block_m=24)


@pytest.mark.parametrize("b,t", [(1, 0), (0, 5)])
def test_empty_inputs(b, t):
    tn = torch.zeros(b, t, dtype=torch.long)
    q, k, v, do = _qkv(b, t, 2, 1, 16)
    o, dq, dk, dv = _fwd_bwd(tree_attention, q, k, v, do, tn, tn)
    assert o.shape == q.shape and dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_cpu_without_interpreter_falls_back_to_reference(monkeypatch):
    monkeypatch.setattr(ta, "_INTERPRET", False)
    monkeypatch.setattr(ta, "_warned_fallback", False)
    tn, te = _tokens([_forest()])
    q, k, v, do = _qkv(1, tn.shape[1], 2, 1, 16, seed=16)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        got = _fwd_bwd(tree_attention, q, k, v, do, tn, te)
    assert any("TRITON_INTERPRET" in str(w.message) for w in rec)
    _assert_close(got, _ref32(q, k, v, do, tn, te), atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------- benchmark


def test_benchmark_quick_run(tmp_path):
    """The benchmark runs, its analytic counts are consistent, and its spot-check passes."""
    from trace_mega.commands.cli import load_benchmark

    out = tmp_path / "b.json"
    res = load_benchmark("tree_attention").main(["--quick", "--json", str(out)])
    assert out.exists() and res["spot_check"]["ok"]
    (row,) = res["work"]
    assert row["packed_tokens"] < row["flat_tokens"]
    assert row["fwd_gflop_packed"] < row["fwd_gflop_flat_causal"]
    assert row["fwd_gflop_packed"] <= row["fwd_gflop_kernel_executed"] <= row["fwd_gflop_packed_dense_causal"]
    assert 0.0 < row["tiles_skipped_frac"] < 1.0


# ----------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (8, 8, 128)])
def test_gpu_matches_references(dtype, hq, hkv, d):
    rng = random.Random(0)
    layouts = []
    for _ in range(2):
        parents, lengths = [-1], [500]
        for _ in range(6):  # 6 bare rollouts of 4 turns plus branches
            p = 0
            for _ in range(4):
                parents.append(p)
                lengths.append(rng.randint(20, 120))
                p = len(parents) - 1
        for _ in range(6):
            parents.append(rng.randrange(1, len(parents)))
            lengths.append(rng.choice([0, 40, 150]))
        layouts.append((parents, lengths))
    tn, te = _tokens(layouts)
    tn, te = tn.cuda(), te.cuda()
    q, k, v, do = (x.cuda() for x in _qkv(2, tn.shape[1], hq, hkv, d, dtype=dtype, seed=17))
    got = _fwd_bwd(tree_attention, q, k, v, do, tn, te)
    want = _ref32(q, k, v, do, tn, te)
    atol, rtol = {torch.float32: (2e-4, 2e-4), **_TOL}[dtype]
    _assert_close(got[:1], want[:1], atol=atol, rtol=rtol)
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a.float(), b, atol=atol * max(1.0, b.abs().max().item()), rtol=rtol)
    flex = tree_attention_flex(q.float(), k.float(), v.float(), tn, te)
    torch.testing.assert_close(got[0].float(), flex, atol=atol, rtol=rtol)
