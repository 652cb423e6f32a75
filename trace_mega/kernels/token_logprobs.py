"""Fused target-token log-probs (and entropy) from hidden states x output embedding.

Computes, for every token t of a packed stream,

    z[t, v]    = (hidden[t] . weight[v]) / temperature          (never stored as [T, V])
    lse[t]     = logsumexp_v z[t, v]
    logprob[t] = z[t, targets[t]] - lse[t]
    entropy[t] = lse[t] - sum_v softmax(z)[t, v] * z[t, v]

in vocab chunks with an online (max, sum-exp, sum p*z) recurrence: peak extra memory
O(T * chunk + T * H + V * H), not the O(T * V) fp32 logits of `token_logprobs_ref.py`.

Backends (chosen by `backend="auto"`):

* ``"triton"`` -- on CUDA, or on CPU under ``TRITON_INTERPRET=1`` for small problems.
  Forward: one program per token block loops over vocab chunks (tl.dot over H blocks)
  and keeps the online statistics in registers. Backward: one program per
  (token block, vocab block) tile recomputes the tile's logits, forms
  dz = g_lp * (onehot - p) - g_ent * p * (z - mu), and atomically accumulates
  dz @ W into dhidden and dz^T @ h into dweight (fp32 buffers). The fp32 atomics make
  the GPU gradients non-deterministic in the last bits (summation order).
* ``"triton_dz"`` -- the same forward; a backward without atomics: per vocab chunk a Triton
  kernel writes the (T, chunk) dz tile and two GEMMs form dh += dz @ W_c, dW_c = dz^T @ h
  (one (T, chunk) buffer). Opt-in, to time against the atomics on a GPU.
* ``"torch"`` -- pure-PyTorch chunks of ``chunk_size`` columns, same math and memory bound
  (the backward recomputes). Used on CPU without the interpreter, and under it when
  T * V_local > ``INTERPRET_MAX_ELEMS`` (the interpreter costs ~1 ms per op per program).

Vocab parallelism (``tp_group`` given): each rank holds rows
[vocab_start, vocab_start + V_local) of the output embedding and the full ``hidden``.
Each rank computes per-row shard statistics (max m_r, sum-exp s_r relative to m_r,
sum e^{z-m_r} z, and the target logit if the target is in its shard, else 0).
Forward: ONE all_gather of the packed (4, T) fp32 statistics, combined locally
(M = max_r m_r; s = sum_r s_r e^{m_r - M}; ...). Backward: ONE all_reduce(SUM) of dhidden
over ``tp_group``, skipped with ``reduce_grad_hidden=False`` (when an enclosing region,
e.g. sequence parallelism's, already reduces it). dweight stays local. Every rank returns
the same full (T,) outputs.

Ignore index: every NEGATIVE target (-100 included) gets logprob = entropy = 0 and no
gradient; others must lie in [0, V_global) (checked, one host sync, when tp_group=None).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from trace_mega.kernels._triton_env import HAS_TRITON, aot_compile, interpreting

if HAS_TRITON:  # optional at import time: the torch path must work without it
    import triton
    import triton.language as tl

_INTERPRET = interpreting()  # fixed at import, as for the @triton.jit decorators below

#: Under the interpreter, problems larger than this (T * V_local) go to the torch path.
INTERPRET_MAX_ELEMS = 1 << 18
#: Default vocab chunk (columns) of the torch path.
TORCH_CHUNK = 8192

__all__ = ["token_logprobs", "INTERPRET_MAX_ELEMS"]


# ----------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _fwd_stats_kernel(
        H_ptr, W_ptr, TGT_ptr, OUT_ptr,  # OUT: (4, T) fp32 = [max, sumexp, sum e*z, z_target]
        T, V, HD,
        stride_ht, stride_hh, stride_wv, stride_wh,
        inv_temp,
        WITH_ENT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        # local target column; out-of-shard / ignored rows never match a column
        tgt = tl.load(TGT_ptr + offs_t, mask=mask_t, other=-1)  # (BT,) int64
        h_row = offs_t.to(tl.int64) * stride_ht
        m = tl.full([BLOCK_T], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_T], tl.float32)
        a = tl.zeros([BLOCK_T], tl.float32)
        zt = tl.zeros([BLOCK_T], tl.float32)
        for v0 in range(0, V, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            mask_v = offs_v < V
            w_row = offs_v.to(tl.int64) * stride_wv
            acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
            for h0 in range(0, HD, BLOCK_H):
                offs_h = h0 + tl.arange(0, BLOCK_H)
                mask_h = offs_h < HD
                hb = tl.load(H_ptr + h_row[:, None] + offs_h[None, :] * stride_hh,
                             mask=mask_t[:, None] & mask_h[None, :], other=0.0)  # (BT, BH)
                wb = tl.load(W_ptr + w_row[None, :] + offs_h[:, None] * stride_wh,
                             mask=mask_h[:, None] & mask_v[None, :], other=0.0)  # (BH, BV)
                if UPCAST:  # interpreter: bf16 is raw uint16 unless cast
                    hb = hb.to(tl.float32)
                    wb = wb.to(tl.float32)
                acc = tl.dot(hb, wb, acc, input_precision=PREC)
            z = tl.where(mask_v[None, :], acc * inv_temp, float("-inf"))  # (BT, BV)
            m_new = tl.maximum(m, tl.max(z, axis=1))
            alpha = tl.exp(m - m_new)
            e = tl.exp(z - m_new[:, None])  # masked columns -> 0
            s = s * alpha + tl.sum(e, axis=1)
            if WITH_ENT:
                # zero the -inf first: e * z would be 0 * -inf = nan on masked columns
                a = a * alpha + tl.sum(e * tl.where(mask_v[None, :], z, 0.0), axis=1)
            # & mask_v: another shard's target id can fall on a padded (-inf) column
            hit = (offs_v[None, :] == tgt[:, None]) & mask_v[None, :]
            zt += tl.sum(tl.where(hit, z, 0.0), axis=1)
            m = m_new
        tl.store(OUT_ptr + offs_t, m, mask=mask_t)
        tl.store(OUT_ptr + T + offs_t, s, mask=mask_t)
        tl.store(OUT_ptr + 2 * T + offs_t, a, mask=mask_t)
        tl.store(OUT_ptr + 3 * T + offs_t, zt, mask=mask_t)

    @triton.jit
    def _dz_tile(
        H_ptr, W_ptr, TGT_ptr, LSE_ptr, MU_ptr, GLP_ptr, GENT_ptr,
        offs_t, offs_v, mask_t, mask_v, HD,
        stride_ht, stride_hh, stride_wv, stride_wh, inv_temp,
        WITH_ENT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        """d loss / d raw-logit for one (BT, BV) tile, fp32, 0 outside the masks."""
        h_row = offs_t.to(tl.int64) * stride_ht
        w_row = offs_v.to(tl.int64) * stride_wv
        # recompute the (BT, BV) logit tile
        acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
        for h0 in range(0, HD, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask_h = offs_h < HD
            hb = tl.load(H_ptr + h_row[:, None] + offs_h[None, :] * stride_hh,
                         mask=mask_t[:, None] & mask_h[None, :], other=0.0)
            wb = tl.load(W_ptr + w_row[None, :] + offs_h[:, None] * stride_wh,
                         mask=mask_h[:, None] & mask_v[None, :], other=0.0)
            if UPCAST:
                hb = hb.to(tl.float32)
                wb = wb.to(tl.float32)
            acc = tl.dot(hb, wb, acc, input_precision=PREC)
        z = acc * inv_temp  # (BT, BV)
        lse = tl.load(LSE_ptr + offs_t, mask=mask_t, other=0.0)
        glp = tl.load(GLP_ptr + offs_t, mask=mask_t, other=0.0)  # 0 on ignored rows
        tgt = tl.load(TGT_ptr + offs_t, mask=mask_t, other=-1)
        live = mask_t[:, None] & mask_v[None, :]
        p = tl.where(live, tl.exp(z - lse[:, None]), 0.0)
        onehot = (offs_v[None, :] == tgt[:, None]).to(tl.float32)
        dz = glp[:, None] * (onehot - p)
        if WITH_ENT:
            mu = tl.load(MU_ptr + offs_t, mask=mask_t, other=0.0)
            gent = tl.load(GENT_ptr + offs_t, mask=mask_t, other=0.0)
            # dH/dz = -p (z - mu), mu = sum p z
            dz -= gent[:, None] * p * (z - mu[:, None])
        return tl.where(live, dz * inv_temp, 0.0)  # d/d(raw logit) = d/dz / temperature

    @triton.jit
    def _bwd_kernel(
        H_ptr, W_ptr, TGT_ptr, LSE_ptr, MU_ptr, GLP_ptr, GENT_ptr, DH_ptr, DW_ptr,
        T, V, HD,
        stride_ht, stride_hh, stride_wv, stride_wh,
        inv_temp,
        WITH_ENT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
        NEED_DH: tl.constexpr, NEED_DW: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        """Atomic backward: dz tile -> dhidden += dz @ W_tile, dW += dz^T @ h_tile (fp32)."""
        pid_t = tl.program_id(0)
        pid_v = tl.program_id(1)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_t = offs_t < T
        mask_v = offs_v < V
        dz = _dz_tile(H_ptr, W_ptr, TGT_ptr, LSE_ptr, MU_ptr, GLP_ptr, GENT_ptr,
                      offs_t, offs_v, mask_t, mask_v, HD,
                      stride_ht, stride_hh, stride_wv, stride_wh, inv_temp,
                      WITH_ENT, UPCAST, PREC, BLOCK_T, BLOCK_V, BLOCK_H)
        if not UPCAST:
            dz_mm = dz.to(H_ptr.dtype.element_ty)  # tensor-core operand in the input dtype
        else:
            dz_mm = dz
        h_row = offs_t.to(tl.int64) * stride_ht
        w_row = offs_v.to(tl.int64) * stride_wv
        for h0 in range(0, HD, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask_h = offs_h < HD
            if NEED_DH:
                wb = tl.load(W_ptr + w_row[:, None] + offs_h[None, :] * stride_wh,
                             mask=mask_v[:, None] & mask_h[None, :], other=0.0)  # (BV, BH)
                if UPCAST:
                    wb = wb.to(tl.float32)
                dh = tl.dot(dz_mm, wb, input_precision=PREC)  # (BT, BH)
                tl.atomic_add(DH_ptr + offs_t[:, None].to(tl.int64) * HD + offs_h[None, :], dh,
                              mask=mask_t[:, None] & mask_h[None, :])
            if NEED_DW:
                hb = tl.load(H_ptr + h_row[:, None] + offs_h[None, :] * stride_hh,
                             mask=mask_t[:, None] & mask_h[None, :], other=0.0)  # (BT, BH)
                if UPCAST:
                    hb = hb.to(tl.float32)
                dw = tl.dot(tl.trans(dz_mm), hb, input_precision=PREC)  # (BV, BH)
                tl.atomic_add(DW_ptr + offs_v[:, None].to(tl.int64) * HD + offs_h[None, :], dw,
                              mask=mask_v[:, None] & mask_h[None, :])

    @triton.jit
    def _dz_kernel(
        H_ptr, W_ptr, TGT_ptr, LSE_ptr, MU_ptr, GLP_ptr, GENT_ptr, DZ_ptr,
        T, V, HD,
        stride_ht, stride_hh, stride_wv, stride_wh, stride_dz,
        inv_temp,
        WITH_ENT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        """Chunked backward, step 1: write the (T, V_chunk) dz of one vocab chunk."""
        pid_t = tl.program_id(0)
        pid_v = tl.program_id(1)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_t = offs_t < T
        mask_v = offs_v < V
        dz = _dz_tile(H_ptr, W_ptr, TGT_ptr, LSE_ptr, MU_ptr, GLP_ptr, GENT_ptr,
                      offs_t, offs_v, mask_t, mask_v, HD,
                      stride_ht, stride_hh, stride_wv, stride_wh, inv_temp,
                      WITH_ENT, UPCAST, PREC, BLOCK_T, BLOCK_V, BLOCK_H)
        tl.store(DZ_ptr + offs_t[:, None].to(tl.int64) * stride_dz + offs_v[None, :],
                 dz.to(DZ_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_v[None, :])


def _triton_cfg(dtype, backward):
    """(BLOCK_T, BLOCK_V, BLOCK_H, UPCAST, PREC, num_warps) for the backend in use."""
    if _INTERPRET:
        # few, large program instances: the interpreter's cost is per op per instance
        return 64, 512, 128, True, "ieee", 4
    # GPU: bf16/fp16 use tensor cores natively; fp32 uses 3xTF32 (close to fp32 accuracy,
    # three dots per tile, hence the smaller tiles). Chosen (not timed: no GPU was lent)
    # as the largest sm_90 tiles that compile without register spills -- see
    # `aot_compile_check` and docs/kernels.md.
    if dtype == torch.float32:
        return 64, 64, 32, False, "tf32x3", 8
    if backward:
        return 64, 128, 32, False, "tf32", 8
    return 64, 128, 64, False, "tf32", 8


def aot_compile_check(arch=90, dtypes=("bf16", "fp32")):
    """Compile the GPU configurations of both kernels for sm_<arch> without a GPU.

    Needs Triton's bundled ptxas, and the module imported WITHOUT TRITON_INTERPRET (the
    interpreter never runs the non-UPCAST code paths). Returns {name: compiled kernel};
    raises on any compile error.
    """
    torch_dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    out = {}
    for dt in dtypes:
        for bwd, fn in ((False, _fwd_stats_kernel), (True, _bwd_kernel), (True, _dz_kernel)):
            bt, bv, bh, upcast, prec, nw = _triton_cfg(torch_dt[dt], bwd)
            # dz: the GEMM operand dtype
            types = {name: (f"*{dt}" if name in ("H_ptr", "W_ptr", "DZ_ptr") else "*i64" if name == "TGT_ptr"
                            else "*fp32" if name.endswith("_ptr") else "fp32" if name == "inv_temp" else "i32")
                     for name in fn.arg_names}
            for ent in (True, False):
                consts = dict(WITH_ENT=ent, UPCAST=upcast, PREC=prec, BLOCK_T=bt, BLOCK_V=bv, BLOCK_H=bh)
                if fn is _bwd_kernel:
                    consts.update(NEED_DH=True, NEED_DW=True)
                out[f"{fn.__name__}[{dt},entropy={ent}]"] = aot_compile(fn, consts, types, arch=arch, num_warps=nw)
    return out


def _stats_triton(hidden, weight, t_local, inv_temp, with_entropy, block_v=None):
    T, HD = hidden.shape
    V = weight.shape[0]
    bt, bv, bh, upcast, prec, nw = _triton_cfg(hidden.dtype, backward=False)
    bv = block_v or bv
    out = torch.empty(4, T, dtype=torch.float32, device=hidden.device)  # (4, T)
    if T == 0:
        return out
    grid = (triton.cdiv(T, bt),)
    _fwd_stats_kernel[grid](
        hidden, weight, t_local, out, T, V, HD,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        float(inv_temp),
        WITH_ENT=with_entropy, UPCAST=upcast, PREC=prec,
        BLOCK_T=bt, BLOCK_V=bv, BLOCK_H=bh, num_warps=nw,
    )
    return out


def _grads_triton(hidden, weight, t_local, lse, mu, g_lp, g_ent, inv_temp, block_v=None,
                  need_dh=True, need_dw=True):
    T, HD = hidden.shape
    V = weight.shape[0]
    bt, bv, bh, upcast, prec, nw = _triton_cfg(hidden.dtype, backward=True)
    bv = block_v or bv
    dev = hidden.device
    # fp32 buffers for the atomics; a 1-element dummy pointer for an unneeded one
    dh = torch.zeros((T, HD) if need_dh else (1,), dtype=torch.float32, device=dev)  # (T, H)
    dw = torch.zeros((V, HD) if need_dw else (1,), dtype=torch.float32, device=dev)  # (V, H)
    with_ent = g_ent is not None
    ge = g_ent if with_ent else g_lp  # dummy pointer when unused
    if T == 0 or V == 0 or not (need_dh or need_dw):
        return dh, dw
    grid = (triton.cdiv(T, bt), triton.cdiv(V, bv))
    _bwd_kernel[grid](
        hidden, weight, t_local, lse, mu, g_lp, ge, dh, dw, T, V, HD,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        float(inv_temp),
        WITH_ENT=with_ent, UPCAST=upcast, PREC=prec, NEED_DH=need_dh, NEED_DW=need_dw,
        BLOCK_T=bt, BLOCK_V=bv, BLOCK_H=bh, num_warps=nw,
    )
    return dh, dw


#: vocab chunk of the "triton_dz" backward (the (T, chunk) dz buffer it materialises)
DZ_CHUNK = 8192


def _grads_triton_dz(hidden, weight, t_local, lse, mu, g_lp, g_ent, inv_temp, chunk=None,
                     need_dh=True, need_dw=True):
    """Chunked backward: Triton writes dz per vocab chunk, the GEMMs are plain matmuls.

    No atomics: per chunk `dh += dz @ W_c` and `dW_c = dz^T @ h` run as cuBLAS GEMMs
    (on GPU in the 16-bit input dtype with fp32 accumulation inside the GEMM; dh is
    accumulated across chunks in fp32). Extra memory: one (T, chunk) dz buffer.
    """
    T, HD = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    bt, bv, bh, upcast, prec, nw = _triton_cfg(hidden.dtype, backward=True)
    C = chunk or (512 if _INTERPRET else DZ_CHUNK)
    # GEMM operand dtype: the 16-bit input dtype on GPU; fp32 under the interpreter
    mm_dt = hidden.dtype if (not upcast and hidden.dtype in (torch.bfloat16, torch.float16)) \
        else torch.float32
    dh = torch.zeros((T, HD) if need_dh else (1,), dtype=torch.float32, device=dev)
    dw = torch.empty((V, HD) if need_dw else (1,), dtype=weight.dtype, device=dev)
    if T == 0 or V == 0 or not (need_dh or need_dw):
        return dh, (dw.zero_() if need_dw else dw)
    dz = torch.empty(T, min(C, V), dtype=mm_dt, device=dev)  # (T, C), reused per chunk
    h_mm = hidden.to(mm_dt)
    with_ent = g_ent is not None
    ge = g_ent if with_ent else g_lp
    for v0 in range(0, V, C):
        v1 = min(V, v0 + C)
        wc = weight[v0:v1]  # (C, H) view
        dzc = dz[:, : v1 - v0]  # (T, C') view, row stride C
        _dz_kernel[(triton.cdiv(T, bt), triton.cdiv(v1 - v0, bv))](
            hidden, wc, (t_local - v0).contiguous(), lse, mu, g_lp, ge, dzc, T, v1 - v0, HD,
            hidden.stride(0), hidden.stride(1), wc.stride(0), wc.stride(1), dzc.stride(0),
            float(inv_temp),
            WITH_ENT=with_ent, UPCAST=upcast, PREC=prec,
            BLOCK_T=bt, BLOCK_V=bv, BLOCK_H=bh, num_warps=nw,
        )
        if need_dh:
            if mm_dt == torch.float32:
                dh.addmm_(dzc, wc.float())
            else:
                dh += dzc @ wc.to(mm_dt)  # (T, H) 16-bit GEMM output, fp32 accumulation
        if need_dw:
            dw[v0:v1] = dzc.t() @ h_mm  # (C', H)
    return dh, dw


# ----------------------------------------------------------------------------------
# Chunked PyTorch path (same math, same memory bound)
# ----------------------------------------------------------------------------------
def _stats_torch(hidden, weight, t_local, inv_temp, with_entropy, chunk):
    """Per-row shard statistics (4, T): [max, sumexp rel. max, sum e*z rel. max, z_target].

    In-place ops keep ONE (T, chunk) fp32 buffer live (two with entropy).
    """
    T = hidden.shape[0]
    V = weight.shape[0]
    h = hidden.float()  # (T, H) fp32: accumulate like the kernel does (no copy if fp32)
    m = torch.full((T,), float("-inf"), device=hidden.device)
    s = torch.zeros(T, device=hidden.device)
    a = torch.zeros(T, device=hidden.device)
    zt = torch.zeros(T, device=hidden.device)
    rows = torch.arange(T, device=hidden.device)
    for v0 in range(0, V, chunk):
        v1 = min(V, v0 + chunk)
        z = h @ weight[v0:v1].float().t()  # (T, C) fp32, the only big buffer
        if inv_temp != 1.0:
            z.mul_(inv_temp)
        m_new = torch.maximum(m, z.amax(1))
        alpha = torch.exp(m - m_new)
        z.sub_(m_new[:, None])  # z - m_new <= 0
        inside = (t_local >= v0) & (t_local < v1)
        col = (t_local - v0).clamp(0, v1 - v0 - 1)
        zt += torch.where(inside, z[rows, col] + m_new, torch.zeros_like(zt))
        if with_entropy:
            e = z.exp()  # (T, C)
            # sum e * z_orig = sum e * (z - m_new) + m_new * sum e ; bmm: no (T, C) temp
            se = e.sum(1)
            a = a * alpha + torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).view(T) + m_new * se
        else:
            se = z.exp_().sum(1)
        s = s * alpha + se
        m = m_new
        del z
    return torch.stack([m, s, a, zt])


def _grads_torch(hidden, weight, t_local, lse, mu, g_lp, g_ent, inv_temp, chunk,
                 need_dh=True, need_dw=True):
    """(dhidden (T, H) fp32, dweight (V, H) in weight.dtype); two (T, chunk) fp32 buffers.

    Each chunk's dweight rows are complete after one chunk, so they are written straight
    in the weight's dtype (no (V, H) fp32 accumulator, unlike the atomics of the kernel).
    """
    T, HD = hidden.shape
    V = weight.shape[0]
    h = hidden.float()  # (T, H)
    dh = torch.zeros((T, HD) if need_dh else (1,), device=hidden.device)
    dw = torch.empty((V, HD) if need_dw else (1,), device=hidden.device, dtype=weight.dtype)
    if not (need_dh or need_dw):
        return dh, dw
    rows = torch.arange(T, device=hidden.device)
    for v0 in range(0, V, chunk):
        v1 = min(V, v0 + chunk)
        w = weight[v0:v1].float()  # (C, H)
        logp = h @ w.t()  # (T, C)
        if inv_temp != 1.0:
            logp.mul_(inv_temp)
        logp.sub_(lse[:, None])  # log p
        p = logp.exp()  # (T, C)
        if g_ent is not None:
            # dz = -p * (g_lp + g_ent * (z - mu)),  z - mu = log p + (lse - mu)
            logp.add_((lse - mu)[:, None]).mul_(g_ent[:, None]).add_(g_lp[:, None])
            dz = p.mul_(logp).neg_()
        else:
            dz = p.mul_(-g_lp[:, None])
        del logp
        inside = (t_local >= v0) & (t_local < v1)
        col = (t_local - v0).clamp(0, v1 - v0 - 1)
        dz[rows[inside], col[inside]] += g_lp[inside]  # + g_lp * onehot
        if inv_temp != 1.0:
            dz.mul_(inv_temp)
        if need_dh:
            dh.addmm_(dz, w)
        if need_dw and dw.dtype == torch.float32:
            torch.mm(dz.t(), h, out=dw[v0:v1])
        elif need_dw:
            dw[v0:v1] = dz.t() @ h  # (C, H) fp32 -> weight dtype
        del dz, p
    return dh, dw


# ----------------------------------------------------------------------------------
# autograd + dispatch
# ----------------------------------------------------------------------------------
# torch >= 2.13 deprecates all_gather_into_tensor for all_gather_single; older has only the former
_all_gather_fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather(out, inp, group):
    _all_gather_fn(out, inp, group=group)


def _combine(stats, tp_group):
    """Combine (4, T) shard statistics into global (lse, mu, z_target); 1 collective if TP."""
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        world = dist.get_world_size(tp_group)
        # concatenated form (R*4, T): the stacked form is not supported by gloo
        allst = torch.empty(world * 4, stats.shape[1], dtype=stats.dtype, device=stats.device)
        _all_gather(allst, stats.contiguous(), tp_group)
        m_r, s_r, a_r, zt_r = allst.view(world, 4, -1).unbind(1)  # each (R, T)
        M = m_r.amax(0)
        scale = torch.exp(m_r - M)  # (R, T)
        s = (s_r * scale).sum(0)
        a = (a_r * scale).sum(0)
        zt = zt_r.sum(0)  # only the owning shard contributed a nonzero
        m = M
    else:
        m, s, a, zt = stats.unbind(0)
    lse = m + torch.log(s)
    mu = a / s
    return lse, mu, zt


class _TokenLogprobsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start, tp_group, with_entropy,
                inv_temp, backend, chunk, reduce_grad_hidden):
        valid = targets >= 0  # (T,) bool
        # local column of the target; -1 (matches no column) for ignored rows. Targets of
        # other shards fall outside [0, V_local) and match nothing either.
        t_local = torch.where(valid, targets - vocab_start, torch.full_like(targets, -1))
        if backend in ("triton", "triton_dz"):
            stats = _stats_triton(hidden, weight, t_local, inv_temp, with_entropy,
                                  chunk if backend == "triton" else None)
        else:
            stats = _stats_torch(hidden, weight, t_local, inv_temp, with_entropy, chunk)
        lse, mu, zt = _combine(stats, tp_group)
        zero = torch.zeros_like(lse)
        lp = torch.where(valid, zt - lse, zero)
        ent = torch.where(valid, lse - mu, zero) if with_entropy else zero
        ctx.save_for_backward(hidden, weight, t_local, lse, mu, valid)
        ctx.cfg = (tp_group, with_entropy, inv_temp, backend, chunk, reduce_grad_hidden)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, t_local, lse, mu, valid = ctx.saved_tensors
        tp_group, with_entropy, inv_temp, backend, chunk, reduce_grad_hidden = ctx.cfg
        zero = torch.zeros_like(lse)
        g_lp = zero if g_lp is None else torch.where(valid, g_lp.float(), zero).contiguous()
        if with_entropy and g_ent is not None:
            g_ent = torch.where(valid, g_ent.float(), zero).contiguous()
        else:
            g_ent = None
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grads = {"triton": _grads_triton, "triton_dz": _grads_triton_dz,
                 "torch": _grads_torch}[backend]
        dh, dw = grads(hidden, weight, t_local, lse, mu, g_lp, g_ent, inv_temp, chunk,
                       need_dh=need_dh, need_dw=need_dw)
        # (every rank of tp_group must agree on needing dhidden: this is a collective)
        if (need_dh and tp_group is not None and reduce_grad_hidden
                and dist.get_world_size(tp_group) > 1):
            dist.all_reduce(dh, group=tp_group)  # every shard's contribution to dhidden
        dh = dh.to(hidden.dtype) if need_dh else None
        dw = dw.to(weight.dtype) if need_dw else None
        return dh, dw, None, None, None, None, None, None, None, None


def _pick_backend(hidden, weight, backend):
    if backend not in ("auto", "triton", "triton_dz", "torch"):
        raise ValueError("backend must be 'auto', 'triton', 'triton_dz' or 'torch', "
                         f"got {backend!r}")
    if backend != "auto":
        if backend != "torch" and not (HAS_TRITON and (hidden.is_cuda or _INTERPRET)):
            raise RuntimeError("backend='triton' needs CUDA or TRITON_INTERPRET=1 set "
                               "before importing trace_mega.kernels.token_logprobs")
        return backend
    if HAS_TRITON and hidden.is_cuda:
        return "triton"
    if HAS_TRITON and _INTERPRET and hidden.shape[0] * weight.shape[0] <= INTERPRET_MAX_ELEMS:
        return "triton"
    return "torch"


def token_logprobs(hidden, weight, targets, *, chunk_size=None, tp_group=None, vocab_start=0,
                   with_entropy=False, temperature=1.0, backend="auto",
                   reduce_grad_hidden=True, vocab_size=None):
    """Target-token log-probs (and entropy) of `softmax(hidden @ weight.T / temperature)`.

    Args:
        hidden: (T, H) float tensor (any float dtype; accumulation is fp32).
        weight: (V_local, H) output-embedding shard (V_local = V when tp_group is None).
        targets: (T,) int64 GLOBAL vocab ids; any negative id (e.g. -100) is ignored:
            logprob 0, entropy 0, no gradient.
        chunk_size: vocab columns per chunk. Torch path: default 8192. Triton path: the
            BLOCK_V tile (power of two >= 16), default 128 on GPU, 512 interpreted.
            "triton_dz": the vocab chunk of its (T, chunk) dz buffer (default 8192).
        tp_group: process group of the vocab-parallel shards, or None.
        vocab_start: first global vocab id held by this rank's ``weight``.
        with_entropy: also return the entropy of the (tempered) distribution.
        temperature: logits are divided by it (> 0).
        backend: "auto" | "triton" | "triton_dz" | "torch" (see the module docstring).
        reduce_grad_hidden: all-reduce dhidden over tp_group in the backward (default);
            False leaves each rank's partial dhidden for an enclosing reduction.
        vocab_size: the true GLOBAL vocabulary (None: every row of every shard is real). The
            rows at global ids >= vocab_size (the zero padding that makes the vocab divisible
            by TP) are excluded from the softmax and entropy and get no gradient.
    Returns:
        logprobs (T,) fp32, and entropy (T,) fp32 when ``with_entropy``; differentiable
        w.r.t. hidden and weight.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden (T, H) and weight (V, H); got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be ({hidden.shape[0]},), got {tuple(targets.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if tp_group is None and vocab_start != 0:
        raise ValueError("vocab_start != 0 needs a tp_group")
    targets = targets.long()
    if vocab_size is not None:
        # Padded rows are the shard's tail: keep the first `valid` rows (a view; its backward
        # writes zeros to the rest). A shard of padding only keeps 0 rows: its statistics are
        # (-inf, 0, 0, 0), which the TP combine weighs by exp(-inf) = 0.
        valid = min(weight.shape[0], max(0, int(vocab_size) - int(vocab_start)))
        weight = weight[:valid]
    if tp_group is None and targets.numel() and bool((targets >= weight.shape[0]).any()):
        raise ValueError(f"targets must be < V = {weight.shape[0]} (or negative = ignored)")
    be = _pick_backend(hidden, weight, backend)
    if be == "triton":
        if chunk_size is not None and (chunk_size < 16 or chunk_size & (chunk_size - 1)):
            raise ValueError("Triton chunk_size must be a power of two >= 16")
        chunk = chunk_size
    elif be == "triton_dz":
        chunk = chunk_size  # the dz buffer's vocab chunk (None: DZ_CHUNK)
    else:
        chunk = chunk_size or TORCH_CHUNK
    lp, ent = _TokenLogprobsFn.apply(hidden, weight, targets, int(vocab_start), tp_group,
                                     bool(with_entropy), 1.0 / float(temperature), be, chunk,
                                     bool(reduce_grad_hidden))
    return (lp, ent) if with_entropy else lp
