"""Batched predictor scoring at turn boundaries of a packed batch.

TRACE-A (docs/design.md §3.1, step 6 of §3.4) scores every prefix of every bare
rollout of a step with the predictor's value head. In the packed layout (docs/PACKING.md)
the predictor's backbone runs ONCE over the stream; the hidden state at the last token of
each prefix (a turn boundary) summarises that prefix. This op gathers those rows and
applies the value head ``Linear(H, 1)`` and a sigmoid in one kernel:

    logit[p] = hidden[positions[p]] . w + b          # fp32 accumulation
    score[p] = sigmoid(logit[p])                     # (P,) fp32

Backward (the predictor trains through it): dlogit = g_score * s (1 - s) + g_logit;
dhidden[positions[p]] += dlogit[p] * w (scattered with fp32 atomics -- repeated positions
accumulate), dw = sum_p dlogit[p] hidden[positions[p]], db = sum_p dlogit[p].

Backends (``backend="auto"``): the Triton kernels on CUDA, and on CPU under
``TRITON_INTERPRET=1`` for P <= ``INTERPRET_MAX_P``; otherwise a PyTorch path
(gather + mv + sigmoid under autograd, fp32): the reference in ``boundary_scoring_ref.py``,
which is also the natural CPU baseline. The gathered (P, H) rows are never materialised by
the Triton path (forward or backward).
"""

from __future__ import annotations

import torch

from trace_mega.kernels._triton_env import HAS_TRITON, aot_compile, interpreting
from trace_mega.kernels.boundary_scoring_ref import boundary_scores_reference

if HAS_TRITON:
    import triton
    import triton.language as tl

_INTERPRET = interpreting()  # fixed at import, as for the @triton.jit decorators below

#: Under the interpreter, more positions than this go to the torch path.
INTERPRET_MAX_P = 8192

__all__ = ["boundary_scores", "INTERPRET_MAX_P"]


def _flat_head(hidden, weight, bias):
    """Validate the value head; return (w (H,), b () tensor)."""
    H = hidden.shape[-1]
    if weight.shape not in ((H,), (1, H)):
        raise ValueError(f"value-head weight must be ({H},) or (1, {H}), got {tuple(weight.shape)}")
    w = weight.reshape(H)
    if bias is None:
        b = torch.zeros((), dtype=torch.float32, device=hidden.device)
    else:
        if bias.numel() != 1:
            raise ValueError(f"bias must be a scalar tensor, got shape {tuple(bias.shape)}")
        b = bias.reshape(())
    return w, b


if HAS_TRITON:

    @triton.jit
    def _fwd_kernel(
        H_ptr,
        POS_ptr,
        W_ptr,
        B_ptr,
        LOGIT_ptr,
        SCORE_ptr,
        P,
        HD,
        stride_ht,
        stride_hh,
        BLOCK_P: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs_p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
        mask_p = offs_p < P
        pos = tl.load(POS_ptr + offs_p, mask=mask_p, other=0)  # (BP,) int64 stream index
        row = pos.to(tl.int64) * stride_ht
        acc = tl.zeros([BLOCK_P], tl.float32)
        for h0 in range(0, HD, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask_h = offs_h < HD
            # .to(fp32) right after the load: bf16 is raw uint16 under the interpreter
            hb = tl.load(
                H_ptr + row[:, None] + offs_h[None, :] * stride_hh, mask=mask_p[:, None] & mask_h[None, :], other=0.0
            ).to(tl.float32)
            wb = tl.load(W_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)  # (BH,)
            acc += tl.sum(hb * wb[None, :], axis=1)
        logit = acc + tl.load(B_ptr).to(tl.float32)
        # overflow-free sigmoid: exp of a non-positive argument only
        e = tl.exp(-tl.abs(logit))
        score = tl.where(logit >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
        tl.store(LOGIT_ptr + offs_p, logit, mask=mask_p)
        tl.store(SCORE_ptr + offs_p, score, mask=mask_p)

    @triton.jit
    def _bwd_kernel(
        H_ptr,
        POS_ptr,
        W_ptr,
        DLOGIT_ptr,
        DH_ptr,
        DW_ptr,
        P,
        HD,
        stride_ht,
        stride_hh,
        NEED_DH: tl.constexpr,
        NEED_DW: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs_p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
        mask_p = offs_p < P
        pos = tl.load(POS_ptr + offs_p, mask=mask_p, other=0)
        row = pos.to(tl.int64) * stride_ht
        g = tl.load(DLOGIT_ptr + offs_p, mask=mask_p, other=0.0)  # (BP,) fp32
        for h0 in range(0, HD, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask_h = offs_h < HD
            m2 = mask_p[:, None] & mask_h[None, :]
            if NEED_DH:
                wb = tl.load(W_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
                # dhidden is a dense contiguous fp32 (T, H) buffer; repeats accumulate
                tl.atomic_add(
                    DH_ptr + pos.to(tl.int64)[:, None] * HD + offs_h[None, :], g[:, None] * wb[None, :], mask=m2
                )
            if NEED_DW:
                hb = tl.load(H_ptr + row[:, None] + offs_h[None, :] * stride_hh, mask=m2, other=0.0).to(tl.float32)
                tl.atomic_add(DW_ptr + offs_h, tl.sum(g[:, None] * hb, axis=0), mask=mask_h)


def _cfg():
    # interpreter: few, large program instances; GPU: small P tiles for parallelism
    return (256, 128, 4) if _INTERPRET else (32, 128, 4)


def aot_compile_check(arch=90, dtypes=("bf16", "fp32")):
    """Compile both GPU kernels for sm_<arch> without a GPU (Triton's bundled ptxas).

    The module must be imported without TRITON_INTERPRET. Returns {name: compiled kernel}.
    """
    bp, bh, nw = _cfg()
    out = {}
    for dt in dtypes:
        for fn, consts in (
            (_fwd_kernel, dict(BLOCK_P=bp, BLOCK_H=bh)),
            (_bwd_kernel, dict(NEED_DH=True, NEED_DW=True, BLOCK_P=bp, BLOCK_H=bh)),
        ):
            types = {
                name: (
                    f"*{dt}"
                    if name in ("H_ptr", "W_ptr", "B_ptr")
                    else "*i64"
                    if name == "POS_ptr"
                    else "*fp32"
                    if name.endswith("_ptr")
                    else "i32"
                )
                for name in fn.arg_names
            }
            out[f"{fn.__name__}[{dt}]"] = aot_compile(fn, consts, types, arch=arch, num_warps=nw)
    return out


class _BoundaryFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, positions, w, b):
        P = positions.shape[0]
        HD = hidden.shape[1]
        logits = torch.empty(P, dtype=torch.float32, device=hidden.device)
        scores = torch.empty_like(logits)
        bp, bh, nw = _cfg()
        if P:
            _fwd_kernel[(triton.cdiv(P, bp),)](
                hidden,
                positions,
                w,
                b,
                logits,
                scores,
                P,
                HD,
                hidden.stride(0),
                hidden.stride(1),
                BLOCK_P=bp,
                BLOCK_H=bh,
                num_warps=nw,
            )
        ctx.save_for_backward(hidden, positions, w, b, scores)
        return scores, logits

    @staticmethod
    def backward(ctx, g_score, g_logit):
        hidden, positions, w, b, scores = ctx.saved_tensors
        dlogit = torch.zeros_like(scores)  # (P,) fp32
        if g_score is not None:
            dlogit += g_score.float() * scores * (1.0 - scores)
        if g_logit is not None:
            dlogit += g_logit.float()
        need_dh, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        T, HD = hidden.shape
        dh = torch.zeros(T, HD, dtype=torch.float32, device=hidden.device) if need_dh else None
        dw = torch.zeros(HD, dtype=torch.float32, device=hidden.device) if need_dw else None
        P = positions.shape[0]
        if P and (need_dh or need_dw):
            bp, bh, nw = _cfg()
            dummy = dlogit  # pointer for an unused output
            _bwd_kernel[(triton.cdiv(P, bp),)](
                hidden,
                positions,
                w,
                dlogit.contiguous(),
                dh if need_dh else dummy,
                dw if need_dw else dummy,
                P,
                HD,
                hidden.stride(0),
                hidden.stride(1),
                NEED_DH=need_dh,
                NEED_DW=need_dw,
                BLOCK_P=bp,
                BLOCK_H=bh,
                num_warps=nw,
            )
        return (
            dh.to(hidden.dtype) if need_dh else None,
            None,
            dw.to(w.dtype) if need_dw else None,
            dlogit.sum().reshape(b.shape).to(b.dtype) if need_db else None,
        )


def _pick_backend(hidden, positions, backend):
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "triton" and not (HAS_TRITON and (hidden.is_cuda or _INTERPRET)):
        raise RuntimeError(
            "backend='triton' needs CUDA or TRITON_INTERPRET=1 set before importing trace_mega.kernels.boundary_scoring"
        )
    if backend != "auto":
        return backend
    if HAS_TRITON and (hidden.is_cuda or (_INTERPRET and positions.shape[0] <= INTERPRET_MAX_P)):
        return "triton"
    return "torch"


def boundary_scores(hidden, positions, weight, bias, *, return_logits=False, backend="auto", validate=True):
    """Value-head scores of the hidden states at turn-boundary stream positions.

    Args:
        hidden: (T, H) float tensor (any float dtype), the packed stream's hidden states.
        positions: (P,) int64 stream indices in [0, T); repeats allowed (their
            gradients accumulate).
        weight: (H,) or (1, H) value-head weight; bias: scalar tensor (shape () or (1,)),
            or None for no bias.
        return_logits: also return the pre-sigmoid logits (use them for a numerically
            stable BCE-with-logits loss).
        backend: "auto" | "triton" | "torch" (module docstring).
        validate: check 0 <= positions < T (one host sync); an out-of-range index would
            otherwise be an out-of-bounds read in the kernel.
    Returns:
        scores (P,) fp32 [and logits (P,) fp32]; differentiable w.r.t. hidden, weight, bias.
    """
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be (T, H), got {tuple(hidden.shape)}")
    if positions.dim() != 1:
        raise ValueError(f"positions must be (P,), got {tuple(positions.shape)}")
    positions = positions.long()
    if validate and positions.numel():
        lo, hi = positions.min().item(), positions.max().item()
        if lo < 0 or hi >= hidden.shape[0]:
            raise IndexError(f"positions must lie in [0, {hidden.shape[0]}), got [{lo}, {hi}]")
    w, b = _flat_head(hidden, weight, bias)
    be = _pick_backend(hidden, positions, backend)
    if be == "torch":
        return boundary_scores_reference(hidden, positions, weight, bias, return_logits=return_logits)
    scores, logits = _BoundaryFn.apply(hidden, positions.contiguous(), w.contiguous(), b.reshape(1).contiguous())
    return (scores, logits) if return_logits else scores
