"""FlashAttention-style tree attention over a packed rollout tree (Triton).

The packed layout is described in docs/PACKING.md.  Query token i attends key
token j iff

    token_node[j] <= token_node[i] <= token_node_exit[j]   and   j <= i

i.e. j's node is i's node or one of its ancestors, and j is not after i.  The
mask is evaluated on the fly inside each (query tile, key tile) from the two
per-token int arrays; no O(T^2) mask is ever stored.

Padding: a token with ``token_node < 0`` attends nothing and is attended by
nothing; its output row is 0 and it gets zero gradient (its
``token_node_exit`` is ignored).

Tile skipping: per tile, a few torch reductions give min/max of token_node
and of token_node_exit over its tokens (O(T/BLOCK) numbers).  A key tile K is
skipped for a query tile Q when it starts after Q's last row (causal), when
``max_exit(K) < min_node(Q)`` (every key node's subtree ends before the first
query node) or when ``min_node(K) > max_node(Q)`` (every key node comes after
every query node in pre-order, so none is an ancestor).  A visited tile whose
keys all precede its queries with ``max_node(K) <= min_node(Q)`` and
``max_node(Q) <= min_exit(K)`` (and no padding) is fully visible and runs
without evaluating the mask.  These decisions are made on the device before
the launch into a block-sparse plan (per query tile: how many key tiles, which,
and whether masked; like a flex_attention BlockMask, O((T/BLOCK)^2) small ints,
no host sync), so a kernel's loop touches only the tiles it needs instead of
testing every causal tile.  :func:`tile_skip_stats` reports the same plan.

Backward is FlashAttention-2 style: the forward stores the log-sum-exp per
row (base 2), the backward recomputes P per tile; dK/dV come from key-tile
programs that loop over the query tiles of every query head in their GQA
group (no atomics: each program owns its kv head), dQ from query-tile
programs.  All accumulation is fp32; bf16/fp16 inputs are cast to fp32 after
every load under the interpreter (it carries bf16 as raw bits), and fed to
``tl.dot`` natively on GPU.

Public API (the Megatron core-attention leaf calls :func:`tree_attention`)::

    tree_attention(q, k, v, token_node, token_node_exit, *, scale=None)
    tree_attention_tiled(..., block_m=None, block_n=None)  # same, explicit tiles
    tile_skip_stats(token_node, token_node_exit, block_m, block_n)

The references (SDPA with the materialised mask, flex_attention, the mask itself)
are in ``tree_attention_ref.py``.

CPU: the kernels run under Triton's interpreter when ``TRITON_INTERPRET=1``
was set before this module was imported.  Without it (a plain CPU run, e.g.
the CPU demo), :func:`tree_attention` computes the same function with the
SDPA reference (materialised mask) and warns once.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from trace_mega.kernels._triton_env import interpreting
from trace_mega.kernels.tree_attention_ref import tree_attention_reference

__all__ = ["tree_attention", "tree_attention_tiled", "tile_skip_stats"]

_INTERPRET = interpreting()  # fixed at import, as for the @triton.jit decorators below

_I32_MAX = 2147483647


# --------------------------------------------------------------------------- kernels
#
# Every kernel walks a block-sparse plan built on the host (see _tile_plan):
# for each of its rows (a query tile, or a key tile in dK/dV) a count and the
# ascending indices of the column tiles to visit, each with a "partial" flag
# (0: every key visible to every query, no mask evaluated).  Tiles not in the
# plan are never loaded.


@triton.jit
def _tree_attn_fwd(
    Q, K, V, O, LSE, TN, TE, CNT, IDX, PART,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    T, NQB, NKB, HQ, GROUP, D, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program = one query tile of one (batch, query head); online softmax over its planned key tiles."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    h = pid_bh % HQ
    hk = h // GROUP  # GQA: query head h reads kv head h // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    offs_d = tl.arange(0, BLOCK_D)  # (BD,)
    m_in = offs_m < T
    d_in = offs_d < D

    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m.to(tl.int64)[:, None] * stride_qt
                + offs_d[None, :], mask=m_in[:, None] & d_in[None, :], other=0.0)  # (BM, BD)
    if UPCAST:
        q = q.to(tl.float32)
    qn = tl.load(TN + b * T + offs_m, mask=m_in, other=-1)  # (BM,) node ids, -1 = padding
    q_ok = qn >= 0

    # finite "-inf" start so a row whose first visited tile is fully masked
    # gets alpha = exp2(0) = 1 and p = 0 instead of inf - inf = NaN
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # (BM, BD)

    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    plan = (b * NQB + pid_m) * NKB  # this query tile's row of the plan
    n_tiles = tl.load(CNT + b * NQB + pid_m)
    for it in range(0, n_tiles):
        start_n = tl.load(IDX + plan + it) * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)  # (BN,)
        n_in = offs_n < T
        kv_mask = n_in[:, None] & d_in[None, :]
        k = tl.load(k_base + offs_n.to(tl.int64)[:, None] * stride_kt + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # (BN, BD)
        v = tl.load(v_base + offs_n.to(tl.int64)[:, None] * stride_vt + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # (BN, BD)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BM, BN), log2 units
        if tl.load(PART + plan + it) != 0:
            kn = tl.load(TN + b * T + offs_n, mask=n_in, other=-1)
            ke = tl.load(TE + b * T + offs_n, mask=n_in, other=-1)
            allowed = ((kn[None, :] <= qn[:, None]) & (qn[:, None] <= ke[None, :])
                       & (offs_n[None, :] <= offs_m[:, None]) & (kn[None, :] >= 0) & q_ok[:, None])
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])  # (BM, BN); 0 where masked
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            pv = tl.dot(p, v, input_precision=PRECISION)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has_key = l_i > 0.0  # False only for padding rows
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    tl.store(O + b * stride_ob + h * stride_oh + offs_m.to(tl.int64)[:, None] * stride_ot
             + offs_d[None, :], out.to(O.dtype.element_ty), mask=m_in[:, None] & d_in[None, :])
    # any finite LSE works for empty rows: the backward masks their P to 0
    lse = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), 0.0)
    tl.store(LSE + (b * HQ + h) * T + offs_m, lse, mask=m_in)


@triton.jit
def _tree_attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, TN, TE, CNT, IDX, PART,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_dkb, stride_dkt, stride_dkh,
    stride_dvb, stride_dvt, stride_dvh,
    T, NQB, NKB, HQ, HKV, GROUP, D, qk_scale, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program = one key tile of one (batch, kv head); loops over its group's query heads and
    the query tiles planned for this key tile (the transposed plan)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    hk = pid_bh % HKV

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    offs_d = tl.arange(0, BLOCK_D)
    n_in = offs_n < T
    d_in = offs_d < D
    kv_mask = n_in[:, None] & d_in[None, :]
    k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n.to(tl.int64)[:, None] * stride_kt
                + offs_d[None, :], mask=kv_mask, other=0.0)  # (BN, BD)
    v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n.to(tl.int64)[:, None] * stride_vt
                + offs_d[None, :], mask=kv_mask, other=0.0)  # (BN, BD)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    kn = tl.load(TN + b * T + offs_n, mask=n_in, other=-1)
    ke = tl.load(TE + b * T + offs_n, mask=n_in, other=-1)
    k_ok = kn >= 0

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    plan = (b * NKB + pid_n) * NQB  # this key tile's row of the transposed plan
    n_tiles = tl.load(CNT + b * NKB + pid_n)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        row_base = (b * HQ + h) * T
        for it in range(0, n_tiles):
            offs_m = tl.load(IDX + plan + it) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
            m_in = offs_m < T
            qd_mask = m_in[:, None] & d_in[None, :]
            q = tl.load(q_base + offs_m.to(tl.int64)[:, None] * stride_qt + offs_d[None, :],
                        mask=qd_mask, other=0.0)  # (BM, BD)
            do = tl.load(do_base + offs_m.to(tl.int64)[:, None] * stride_dot + offs_d[None, :],
                         mask=qd_mask, other=0.0)  # (BM, BD)
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(LSE + row_base + offs_m, mask=m_in, other=0.0)  # (BM,)
            delta = tl.load(DELTA + row_base + offs_m, mask=m_in, other=0.0)  # (BM,)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BM, BN)
            if tl.load(PART + plan + it) != 0:
                qn = tl.load(TN + b * T + offs_m, mask=m_in, other=-1)
                allowed = ((kn[None, :] <= qn[:, None]) & (qn[:, None] <= ke[None, :])
                           & (offs_n[None, :] <= offs_m[:, None]) & k_ok[None, :] & (qn[:, None] >= 0))
                # mask before exp2 so masked garbage scores cannot overflow to inf
                s = tl.where(allowed, s, float("-inf"))
            p = tl.exp2(s - lse[:, None])  # (BM, BN) softmax probs
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BM, BN)
            ds = p * (dp - delta[:, None])  # dL/d(logits), before the scale
            if UPCAST:
                dv += tl.dot(tl.trans(p), do, input_precision=PRECISION)
                dk += tl.dot(tl.trans(ds), q, input_precision=PRECISION)
            else:
                dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    dk = dk * sm_scale
    tl.store(DK + b * stride_dkb + hk * stride_dkh + offs_n.to(tl.int64)[:, None] * stride_dkt
             + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * stride_dvb + hk * stride_dvh + offs_n.to(tl.int64)[:, None] * stride_dvt
             + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _tree_attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ, TN, TE, CNT, IDX, PART,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_dqb, stride_dqt, stride_dqh,
    T, NQB, NKB, HQ, GROUP, D, qk_scale, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program = one query tile of one (batch, query head); accumulates dQ over its planned key tiles."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    h = pid_bh % HQ
    hk = h // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_in = offs_m < T
    d_in = offs_d < D
    qd_mask = m_in[:, None] & d_in[None, :]
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m.to(tl.int64)[:, None] * stride_qt
                + offs_d[None, :], mask=qd_mask, other=0.0)  # (BM, BD)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m.to(tl.int64)[:, None] * stride_dot
                 + offs_d[None, :], mask=qd_mask, other=0.0)  # (BM, BD)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    qn = tl.load(TN + b * T + offs_m, mask=m_in, other=-1)
    q_ok = qn >= 0
    lse = tl.load(LSE + (b * HQ + h) * T + offs_m, mask=m_in, other=0.0)
    delta = tl.load(DELTA + (b * HQ + h) * T + offs_m, mask=m_in, other=0.0)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    plan = (b * NQB + pid_m) * NKB
    n_tiles = tl.load(CNT + b * NQB + pid_m)
    for it in range(0, n_tiles):
        offs_n = tl.load(IDX + plan + it) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
        n_in = offs_n < T
        kv_mask = n_in[:, None] & d_in[None, :]
        k = tl.load(k_base + offs_n.to(tl.int64)[:, None] * stride_kt + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # (BN, BD)
        v = tl.load(v_base + offs_n.to(tl.int64)[:, None] * stride_vt + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BM, BN)
        if tl.load(PART + plan + it) != 0:
            kn = tl.load(TN + b * T + offs_n, mask=n_in, other=-1)
            ke = tl.load(TE + b * T + offs_n, mask=n_in, other=-1)
            allowed = ((kn[None, :] <= qn[:, None]) & (qn[:, None] <= ke[None, :])
                       & (offs_n[None, :] <= offs_m[:, None]) & (kn[None, :] >= 0) & q_ok[:, None])
            s = tl.where(allowed, s, float("-inf"))
        p = tl.exp2(s - lse[:, None])  # (BM, BN)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])  # (BM, BN)
        if UPCAST:
            dq += tl.dot(ds, k, input_precision=PRECISION)
        else:
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m.to(tl.int64)[:, None] * stride_dqt
             + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=qd_mask)


# --------------------------------------------------------------------------- host side


def _tile_stats(token_node: torch.Tensor, token_node_exit: torch.Tensor, block: int) -> torch.Tensor:
    """Per-tile node statistics, (B, cdiv(T, block), 5) int64.

    Fields: 0 ``lo`` = min node over non-padding tokens (INT32_MAX if none),
    1 ``hi`` = max node (-1 if none), 2 ``exit_hi`` = max exit (-1 if none),
    3 ``raw_lo`` = min node counting padding and positions past T as -1,
    4 ``exit_lo`` = min exit, padding / past-T as -1.  Fields 0-2 decide
    skipping; 3-4 detect tiles that need no mask.
    """
    B, T = token_node.shape
    nb = triton.cdiv(T, block)
    pad = nb * block - T
    valid = token_node >= 0
    tiles = lambda x, fill: F.pad(x, (0, pad), value=fill).view(B, nb, block)  # noqa: E731  (B, nb, block)
    node = torch.where(valid, token_node, -1)
    ex = torch.where(valid, token_node_exit, -1)
    return torch.stack([
        tiles(torch.where(valid, token_node, _I32_MAX), _I32_MAX).amin(-1),
        tiles(node, -1).amax(-1),
        tiles(ex, -1).amax(-1),
        tiles(node, -1).amin(-1),
        tiles(ex, -1).amin(-1),
    ], dim=-1).long()


def _tile_masks(token_node, token_node_exit, block_m: int, block_n: int):
    """(causal, visited, unmasked), each (B, nQ, nK) bool, for query tiles of block_m rows and key tiles
    of block_n.

    visited: the key tile does not start after the query tile's last row, and
    ``max_exit(K) >= min_node(Q)`` and ``min_node(K) <= max_node(Q)`` (otherwise no key node
    can be an ancestor of, or equal to, a query node).  unmasked: visited, every key before
    every query, ``max_node(K) <= min_node(Q)``, ``max_node(Q) <= min_exit(K)`` and no padding
    in either tile, so every entry is allowed.  O((T/BM) * (T/BN)) booleans, no O(T^2).
    """
    B, T = token_node.shape
    dev = token_node.device
    qs = _tile_stats(token_node, token_node_exit, block_m)[:, :, None, :]  # (B, nQ, 1, 5)
    ks = _tile_stats(token_node, token_node_exit, block_n)[:, None, :, :]  # (B, 1, nK, 5)
    nq, nk = qs.shape[1], ks.shape[2]
    q_start = torch.arange(nq, device=dev)[:, None] * block_m
    q_end = torch.clamp(q_start + block_m, max=T)  # exclusive end of each query tile
    k_start = torch.arange(nk, device=dev)[None, :] * block_n
    causal = (k_start < q_end)[None].expand(B, nq, nk)  # (B, nQ, nK)
    visited = causal & (ks[..., 2] >= qs[..., 0]) & (ks[..., 0] <= qs[..., 1])
    unmasked = (visited & (k_start + block_n <= q_start)[None] & (ks[..., 1] <= qs[..., 3])
                & (qs[..., 1] <= ks[..., 4]) & (qs[..., 3] >= 0))
    return causal, visited, unmasked


def _tile_plan(token_node, token_node_exit, block_m: int, block_n: int, *, by_key: bool = False):
    """Block-sparse plan for the kernels: (count, index, partial), all int32 contiguous.

    Rows are query tiles (``by_key=False``: forward and dQ) or key tiles (``by_key=True``:
    dK/dV); ``count[b, r]`` is how many column tiles row r visits, ``index[b, r, :count]``
    their indices in ascending order and ``partial[b, r, :count]`` 1 where the mask must be
    evaluated.  Built with device ops only (no host sync), like a flex_attention BlockMask.
    """
    _, visited, unmasked = _tile_masks(token_node, token_node_exit, block_m, block_n)
    if by_key:
        visited, unmasked = visited.transpose(1, 2), unmasked.transpose(1, 2)
    # stable sort on "not visited" moves the visited columns to the front, in ascending order
    order = torch.argsort((~visited).to(torch.uint8), dim=-1, stable=True)  # (B, rows, cols)
    partial = (~unmasked).gather(-1, order)
    return (visited.sum(-1).to(torch.int32).contiguous(), order.to(torch.int32).contiguous(),
            partial.to(torch.int32).contiguous())


def tile_skip_stats(token_node, token_node_exit, block_m: int = 64, block_n: int = 64, *,
                    return_masks: bool = False) -> dict:
    """Count the (query tile, key tile) pairs the kernels visit (the same plan they run).

    Returns ints: ``total`` (all B * nQ * nK pairs), ``causal`` (pairs not
    entirely after the query tile), ``visited`` (causal pairs surviving the
    node-range test), ``unmasked`` (visited pairs the kernels run without
    evaluating the mask: every key visible to every query) and the float
    ``skipped_frac`` = 1 - visited / causal.  With ``return_masks`` also the
    (B, nQ, nK) bool tensors ``visited_mask`` and ``unmasked_mask``.
    """
    token_node = torch.as_tensor(token_node).to(torch.int64)
    token_node_exit = torch.as_tensor(token_node_exit).to(torch.int64)
    if token_node.dim() == 1:
        token_node, token_node_exit = token_node[None], token_node_exit[None]
    causal, visited, unmasked = _tile_masks(token_node, token_node_exit, block_m, block_n)
    n_causal, n_visited = int(causal.sum()), int(visited.sum())
    out = {"total": causal.numel(), "causal": n_causal, "visited": n_visited, "unmasked": int(unmasked.sum()),
           "skipped_frac": 1.0 - n_visited / max(n_causal, 1)}
    if return_masks:
        out.update(visited_mask=visited, unmasked_mask=unmasked)
    return out


def _default_blocks(head_dim: int, device: torch.device) -> dict:
    """Tile config: one config (the interpreter cannot autotune), large tiles on CPU."""
    if device.type != "cuda":
        # the interpreter pays ~1 ms per op per program: few, large tiles
        return {"fwd": (64, 64, 4, 1), "bwd": (64, 64, 4, 1)}
    if head_dim <= 64:
        return {"fwd": (128, 64, 4, 3), "bwd": (64, 64, 4, 2)}
    if head_dim <= 128:
        return {"fwd": (128, 64, 8, 3), "bwd": (64, 64, 8, 2)}
    return {"fwd": (64, 32, 8, 2), "bwd": (32, 32, 8, 1)}


def _precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: only matters for fp32 operands (the interpreter ignores it)."""
    if dtype != torch.float32:
        return "tf32"  # Triton's default; irrelevant for 16-bit operands
    # fp32 runs on tf32 tensor cores only when the user allowed it for matmuls, as torch does
    return "tf32" if not _INTERPRET and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _lastdim_contig(x: torch.Tensor) -> torch.Tensor:
    # kernels address (b, t, h) through strides but assume unit stride along D
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_inputs(q, k, v, token_node, token_node_exit):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (B, T, H, D)")
    B, T, Hq, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
        raise ValueError(f"k, v must be (B, T, Hkv, D) matching q {tuple(q.shape)}, "
                         f"got {tuple(k.shape)} / {tuple(v.shape)}")
    if k.shape[2] == 0 or Hq % k.shape[2] != 0:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={k.shape[2]} (GQA)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q, k, v must share one dtype of fp32/bf16/fp16, got {q.dtype}/{k.dtype}/{v.dtype}")
    if tuple(token_node.shape) != (B, T) or tuple(token_node_exit.shape) != (B, T):
        raise ValueError(f"token_node / token_node_exit must be (B, T)=({B}, {T}), got "
                         f"{tuple(token_node.shape)} / {tuple(token_node_exit.shape)}")
    if token_node.dtype.is_floating_point or token_node_exit.dtype.is_floating_point:
        raise ValueError("token_node / token_node_exit must be integer tensors")
    if not (q.device == k.device == v.device == token_node.device == token_node_exit.device):
        raise ValueError("all inputs must be on one device")


def _forward(q, k, v, tn, te, scale, bm, bn, warps, stages):
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    o = torch.empty((B, T, Hq, D), dtype=q.dtype, device=q.device)  # (B, T, Hq, D)
    lse = torch.empty((B, Hq, T), dtype=torch.float32, device=q.device)  # base-2 log-sum-exp
    if o.numel() == 0:  # nothing to launch (B, T, H or D is 0)
        return o, lse
    cnt, idx, part = _tile_plan(tn, te, bm, bn)  # (B, nQ), (B, nQ, nK) x2
    grid = (triton.cdiv(T, bm), B * Hq)
    _tree_attn_fwd[grid](
        q, k, v, o, lse, tn, te, cnt, idx, part,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        T, idx.shape[1], idx.shape[2], Hq, Hq // Hkv, D, scale * math.log2(math.e),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=max(16, triton.next_power_of_2(D)),
        UPCAST=_INTERPRET, PRECISION=_precision(q.dtype), num_warps=warps, num_stages=stages,
    )
    return o, lse


def _backward(do, q, k, v, o, lse, tn, te, scale, bm, bn, warps, stages, need_dq, need_dkv):
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    block_d = max(16, triton.next_power_of_2(D))
    # FA2 preprocessing: delta_i = sum_d dO_i * O_i  (B, Hq, T) fp32
    delta = (do.float() * o.float()).sum(-1).transpose(1, 2).contiguous()
    qk_scale = scale * math.log2(math.e)
    common = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, UPCAST=_INTERPRET,
                  PRECISION=_precision(q.dtype), num_warps=warps, num_stages=stages)
    dq = dk = dv = None
    if q.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if need_dkv:
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        cnt, idx, part = _tile_plan(tn, te, bm, bn, by_key=True)  # (B, nK), (B, nK, nQ) x2
        _tree_attn_bwd_dkdv[(triton.cdiv(T, bn), B * Hkv)](
            q, k, v, do, lse, delta, dk, dv, tn, te, cnt, idx, part,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            do.stride(0), do.stride(1), do.stride(2),
            dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2),
            T, idx.shape[2], idx.shape[1], Hq, Hkv, Hq // Hkv, D, qk_scale, scale, **common,
        )
    if need_dq:
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        cnt, idx, part = _tile_plan(tn, te, bm, bn)  # (B, nQ), (B, nQ, nK) x2
        _tree_attn_bwd_dq[(triton.cdiv(T, bm), B * Hq)](
            q, k, v, do, lse, delta, dq, tn, te, cnt, idx, part,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            do.stride(0), do.stride(1), do.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2),
            T, idx.shape[1], idx.shape[2], Hq, Hq // Hkv, D, qk_scale, scale, **common,
        )
    return dq, dk, dv


class _TreeAttentionFn(torch.autograd.Function):
    """autograd wrapper: Triton forward (saves O and LSE), Triton FA2 backward."""

    @staticmethod
    def forward(ctx, q, k, v, tn, te, scale, fwd_cfg, bwd_cfg):
        o, lse = _forward(q, k, v, tn, te, scale, *fwd_cfg)
        ctx.save_for_backward(q, k, v, o, lse, tn, te)
        ctx.scale = scale
        ctx.bwd_cfg = bwd_cfg
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, tn, te = ctx.saved_tensors
        need_dq, need_dk, need_dv = ctx.needs_input_grad[:3]
        dq, dk, dv = _backward(_lastdim_contig(do), q, k, v, o, lse, tn, te, ctx.scale,
                               *ctx.bwd_cfg, need_dq, need_dk or need_dv)
        return dq, dk if need_dk else None, dv if need_dv else None, None, None, None, None, None


_warned_fallback = False


def tree_attention_tiled(q, k, v, token_node, token_node_exit, *, scale: float | None = None,
                         block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """:func:`tree_attention` with explicit tile sizes (powers of two >= 16), for tests and tuning.

    ``block_m`` / ``block_n`` set the query / key tile in forward and backward;
    ``None`` takes the default for the device and head dim.
    """
    global _warned_fallback
    _check_inputs(q, k, v, token_node, token_node_exit)
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if q.device.type != "cuda" and not _INTERPRET:
        if not _warned_fallback:
            warnings.warn("tree_attention on CPU without TRITON_INTERPRET=1: using the SDPA "
                          "reference (materialised O(T^2) mask)", RuntimeWarning, stacklevel=2)
            _warned_fallback = True
        return tree_attention_reference(q, k, v, token_node, token_node_exit, scale=scale)
    cfg = _default_blocks(D, q.device)
    fwd_cfg, bwd_cfg = list(cfg["fwd"]), list(cfg["bwd"])
    for c in (fwd_cfg, bwd_cfg):
        c[0] = block_m or c[0]
        c[1] = block_n or c[1]
        if min(c[0], c[1]) < 16 or c[0] & (c[0] - 1) or c[1] & (c[1] - 1):
            raise ValueError(f"block sizes must be powers of two >= 16, got {c[0]}, {c[1]}")
    tn = token_node.to(torch.int32).contiguous()  # node ids fit int32
    te = token_node_exit.to(torch.int32).contiguous()
    return _TreeAttentionFn.apply(_lastdim_contig(q), _lastdim_contig(k), _lastdim_contig(v),
                                  tn, te, scale, tuple(fwd_cfg), tuple(bwd_cfg))


def tree_attention(q, k, v, token_node, token_node_exit, *, scale: float | None = None) -> torch.Tensor:
    """Attention over a packed rollout tree (rule in the module docstring), differentiable in q, k, v.

    Args:
        q: (B, T, Hq, D) fp32/bf16/fp16.
        k, v: (B, T, Hkv, D), same dtype, ``Hq % Hkv == 0`` (GQA: query head h uses kv head
            ``h // (Hq // Hkv)``).
        token_node, token_node_exit: (B, T) int32/int64; negative ``token_node`` = padding.
        scale: softmax scale, default ``1 / sqrt(D)``.

    Returns:
        (B, T, Hq, D) in q's dtype; padding rows are 0.
    """
    return tree_attention_tiled(q, k, v, token_node, token_node_exit, scale=scale)
