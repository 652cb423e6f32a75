"""Fused token log-probs vs the materialised reference (both backends, vocab-parallel).

The Triton path runs under TRITON_INTERPRET=1 on CPU (set by tests/conftest.py), so
shapes are small and blocks large; the same tests run natively on a GPU via `-m gpu`.
"""

import os
import socket

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import trace_mega.kernels.token_logprobs as tlp
from trace_mega.kernels._triton_env import env_without_interpreter
from trace_mega.kernels.token_logprobs import token_logprobs
from trace_mega.kernels.token_logprobs_ref import token_logprobs_reference

BACKENDS = ["triton", "triton_dz", "torch"]
TP_BACKENDS = ["triton", "torch"]  # the TP combine / all-reduce is backend-independent
# (forward atol, gradient tolerance relative to the largest reference gradient)
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1e-4, 2e-2)}


def _problem(T, V, H, dtype, scale=0.3, seed=0, ignore=(3,)):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * scale).to(dtype)
    y = torch.randint(0, V, (T,), generator=g)
    for i in ignore:
        if i < T:
            y[i] = -100
    return h, w, y


def _run(fn, h, w, y, g_lp, g_ent, **kw):
    """Forward + backward of fn; returns (lp, ent, dh, dw) as fp32."""
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    out = fn(h, w, y, **kw)
    lp, ent = out if isinstance(out, tuple) else (out, None)
    loss = (lp * g_lp).sum()
    if ent is not None and g_ent is not None:
        loss = loss + (ent * g_ent).sum()
    loss.backward()
    return lp, ent, h.grad.float(), w.grad.float()


def _ref(h, w, y, g_lp, g_ent, **kw):
    """fp32 reference on the (exactly representable) upcast inputs."""
    return _run(token_logprobs_reference, h.float(), w.float(), y, g_lp, g_ent, **kw)


def _close_grad(a, b, rtol):
    scale = b.abs().max().clamp(min=1e-6)
    assert (a - b).abs().max() <= rtol * scale, float((a - b).abs().max() / scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_entropy,temperature", [(True, 0.7), (False, 1.0), (True, 1.3)])
def test_matches_reference(backend, dtype, with_entropy, temperature):
    T, V, H = 37, 1000, 48  # odd everything: partial token block, partial vocab chunk
    h, w, y = _problem(T, V, H, dtype)
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)
    kw = dict(with_entropy=with_entropy, temperature=temperature)
    chunk = {"triton": 256, "triton_dz": 384, "torch": 300}[backend]  # several, uneven chunks
    lp, ent, dh, dw = _run(token_logprobs, h, w, y, g_lp, g_ent, backend=backend, chunk_size=chunk, **kw)
    lr, er, dhr, dwr = _ref(h, w, y, g_lp, g_ent, **kw)
    fa, gr = TOL[dtype]
    assert lp.dtype == torch.float32 and lp.shape == (T,)
    torch.testing.assert_close(lp, lr, atol=fa, rtol=0)
    if with_entropy:
        assert ent.dtype == torch.float32
        torch.testing.assert_close(ent, er, atol=fa, rtol=0)
    assert dh.abs().max() > 0 and dw.abs().max() > 0
    _close_grad(dh, dhr, gr)
    _close_grad(dw, dwr, gr)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_vs_materialised_bf16_reference(backend):
    """Against the baseline as a bf16 model computes it (bf16 logits): looser."""
    T, V, H = 29, 700, 40
    h, w, y = _problem(T, V, H, torch.bfloat16)
    lp = token_logprobs(h, w, y, backend=backend)
    lr = token_logprobs_reference(h, w, y)  # bf16 matmul, fp32 log-softmax
    torch.testing.assert_close(lp, lr, atol=0.1, rtol=0.02)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignore_index(backend):
    T, V, H = 20, 300, 24
    h, w, y = _problem(T, V, H, torch.float32, ignore=())
    ign = torch.tensor([0, 5, 19])
    y[ign] = torch.tensor([-100, -1, -7])
    g_lp, g_ent = torch.ones(T), torch.ones(T)
    lp, ent, dh, dw = _run(token_logprobs, h, w, y, g_lp, g_ent, backend=backend, with_entropy=True)
    assert torch.all(lp[ign] == 0) and torch.all(ent[ign] == 0)
    assert torch.all(dh[ign] == 0)
    keep = torch.ones(T, dtype=torch.bool)
    keep[ign] = False
    assert torch.all(dh[keep].abs().sum(1) > 0)
    # the weight gradient equals the one from the non-ignored rows alone
    _, _, _, dw_keep = _run(
        token_logprobs, h[keep], w, y[keep], g_lp[keep], g_ent[keep], backend=backend, with_entropy=True
    )
    torch.testing.assert_close(dw, dw_keep, atol=1e-5, rtol=1e-5)
    # everything ignored: zeros everywhere, no NaN
    lp, ent, dh, dw = _run(
        token_logprobs, h, w, torch.full((T,), -100), g_lp, g_ent, backend=backend, with_entropy=True
    )
    assert torch.all(lp == 0) and torch.all(ent == 0) and torch.all(dh == 0) and torch.all(dw == 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T,V,H", [(1, 17, 5), (65, 513, 130), (3, 2, 1)])
def test_odd_shapes(backend, T, V, H):
    """Shapes below one block, just above a block boundary, and degenerate H / V."""
    h, w, y = _problem(T, V, H, torch.float32, ignore=())
    g_lp, g_ent = torch.randn(T), torch.randn(T)
    got = _run(token_logprobs, h, w, y, g_lp, g_ent, backend=backend, with_entropy=True)
    ref = _ref(h, w, y, g_lp, g_ent, with_entropy=True)
    for a, b in zip(got[:2], ref[:2]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    for a, b in zip(got[2:], ref[2:]):
        _close_grad(a, b, 1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs_and_partial_grads(backend):
    """Non-contiguous hidden/weight views; only the logprob output used; grad of one input."""
    T, V, H = 19, 333, 32
    big_h = torch.randn(T, 2 * H)
    big_w = torch.randn(H, V) * 0.3
    h, w = big_h[:, ::2], big_w.t()  # strided (T, H) and transposed (V, H) views
    y = torch.randint(0, V, (T,))
    hh = h.clone().requires_grad_()
    lp, ent = token_logprobs(hh, w, y, backend=backend, with_entropy=True)
    lp.sum().backward()  # entropy output unused -> its gradient is None
    hr = h.clone().requires_grad_()
    lr = token_logprobs_reference(hr, w, y)
    lr.sum().backward()
    torch.testing.assert_close(lp, lr, atol=1e-4, rtol=0)
    _close_grad(hh.grad, hr.grad, 1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_extreme_logits_are_stable(backend):
    T, V, H = 16, 400, 16
    h, w, y = _problem(T, V, H, torch.float32, scale=40.0, ignore=())  # |logits| ~ 1e2-1e3
    lp, ent, dh, dw = _run(token_logprobs, h, w, y, torch.ones(T), torch.ones(T), backend=backend, with_entropy=True)
    lr, er, dhr, dwr = _ref(h, w, y, torch.ones(T), torch.ones(T), with_entropy=True)
    for t in (lp, ent, dh, dw):
        assert torch.isfinite(t).all()
    torch.testing.assert_close(lp, lr, atol=2e-3, rtol=1e-5)
    torch.testing.assert_close(ent, er, atol=2e-3, rtol=1e-4)
    _close_grad(dh, dhr, 1e-3)


@settings(max_examples=25, deadline=None)
@given(
    T=st.integers(1, 24),
    V=st.integers(1, 200),
    H=st.integers(1, 20),
    chunk=st.integers(1, 64),
    temp=st.floats(0.25, 4.0),
    seed=st.integers(0, 1000),
)
def test_torch_path_property(T, V, H, chunk, temp, seed):
    """Chunked torch path == reference for arbitrary shapes and chunkings."""
    h, w, y = _problem(T, V, H, torch.float32, seed=seed, ignore=(seed % 5,))
    g_lp, g_ent = torch.randn(T), torch.randn(T)
    got = _run(
        token_logprobs, h, w, y, g_lp, g_ent, backend="torch", chunk_size=chunk, with_entropy=True, temperature=temp
    )
    ref = _ref(h, w, y, g_lp, g_ent, with_entropy=True, temperature=temp)
    for a, b in zip(got[:2], ref[:2]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
    for a, b in zip(got[2:], ref[2:]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


class _MaxBytes(TorchDispatchMode):
    """Records the largest tensor (in bytes) any aten op produces: the materialisation check.

    Bytes, not elements: the Triton interpreter copies argument storages as uint8 views.
    """

    def __init__(self):
        super().__init__()
        self.max_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_bytes = max(self.max_bytes, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_never_materialises_full_logits(backend):
    T, V, H, chunk = 64, 4096, 16, 512  # T*V = 262144 >> max(V*H, T*chunk) = 65536
    h, w, y = _problem(T, V, H, torch.float32)
    h.requires_grad_()
    w.requires_grad_()
    with _MaxBytes() as mode:
        lp, ent = token_logprobs(h, w, y, backend=backend, chunk_size=chunk, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
    assert mode.max_bytes <= 4 * max(V * H, T * chunk, T * H), mode.max_bytes  # fp32
    with _MaxBytes() as ref_mode:  # the check can fail: the reference trips it
        token_logprobs_reference(h, w, y).sum().backward()
    assert ref_mode.max_bytes >= 4 * T * V


def test_dispatch_and_validation():
    h, w, y = _problem(8, 50, 8, torch.float32)
    if tlp._INTERPRET:
        assert tlp._pick_backend(h, w, "auto") == "triton"
        big = torch.empty(tlp.INTERPRET_MAX_ELEMS // 50 + 1, 8)
        assert tlp._pick_backend(big, w, "auto") == "torch"
    else:
        assert tlp._pick_backend(h, w, "auto") == "torch"
    with pytest.raises(ValueError):
        token_logprobs(h, w, torch.full((8,), 50))  # target == V
    with pytest.raises(ValueError):
        token_logprobs(h, w, y, temperature=0.0)
    with pytest.raises(ValueError):
        token_logprobs(h, w[:, :4], y)
    with pytest.raises(ValueError):
        token_logprobs(h, w, y[:4])
    with pytest.raises(ValueError):
        token_logprobs(h, w, y, backend="cuda")
    with pytest.raises(ValueError):
        token_logprobs(h, w, y, vocab_start=10)


# ----------------------------------------------------------------------------------
# vocab-parallel: 2 gloo processes
# ----------------------------------------------------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank, world, port, split, backend, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        T, V, H = 37, 1000, 48
        h, w, y = _problem(T, V, H, torch.float32)
        g_lp, g_ent = (
            torch.randn(T, generator=torch.Generator().manual_seed(5)),
            torch.randn(T, generator=torch.Generator().manual_seed(6)),
        )
        lo, hi = (0, split) if rank == 0 else (split, V)
        out = {}
        for reduce in (True, False):
            hh = h.clone().requires_grad_()
            ws = w[lo:hi].clone().requires_grad_()
            lp, ent = token_logprobs(
                hh,
                ws,
                y,
                tp_group=dist.group.WORLD,
                vocab_start=lo,
                with_entropy=True,
                temperature=0.9,
                backend=backend,
                reduce_grad_hidden=reduce,
            )
            ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
            out[reduce] = (lp.detach(), ent.detach(), hh.grad.clone(), ws.grad.clone())
        results[rank] = {"out": out, "lo": lo, "hi": hi}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("backend", TP_BACKENDS)
def test_vocab_parallel_two_gloo_ranks(backend):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        # uneven split: 487 rows on rank 0, 513 on rank 1 (not a block multiple either)
        mp.start_processes(
            _tp_worker, args=(2, _free_port(), 487, backend, results), nprocs=2, join=True, start_method="spawn"
        )
        results = dict(results)
    T, V, H = 37, 1000, 48
    h, w, y = _problem(T, V, H, torch.float32)
    g_lp, g_ent = (
        torch.randn(T, generator=torch.Generator().manual_seed(5)),
        torch.randn(T, generator=torch.Generator().manual_seed(6)),
    )
    lr, er, dhr, dwr = _ref(h, w, y, g_lp, g_ent, with_entropy=True, temperature=0.9)
    partial_dh = []
    for rank in (0, 1):
        r = results[rank]
        lp, ent, dh, dws = r["out"][True]
        torch.testing.assert_close(lp, lr, atol=1e-4, rtol=0)  # every rank: full outputs
        torch.testing.assert_close(ent, er, atol=1e-4, rtol=0)
        _close_grad(dh, dhr, 1e-4)  # all-reduced over the group
        _close_grad(dws, dwr[r["lo"] : r["hi"]], 1e-4)  # the local shard's rows
        lp2, _, dh2, dws2 = r["out"][False]
        torch.testing.assert_close(lp2, lp)
        torch.testing.assert_close(dws2, dws)
        partial_dh.append(dh2)
    # without the reduction each rank holds its shard's share; the shares sum to the total
    assert (partial_dh[0] - dhr).abs().max() > 1e-3
    _close_grad(partial_dh[0] + partial_dh[1], dhr, 1e-4)


# ----------------------------------------------------------------------------------
# GPU (native Triton): realistic sizes, memory bound
# ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "triton_dz"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matches_reference(dtype, backend):
    T, V, H = 1031, 32003, 512
    h, w, y = (t.cuda() for t in _problem(T, V, H, dtype, scale=0.05))
    g_lp, g_ent = torch.randn(T, device="cuda"), torch.randn(T, device="cuda")
    lp, ent, dh, dw = _run(token_logprobs, h, w, y, g_lp, g_ent, with_entropy=True, temperature=0.8, backend=backend)
    lr, er, dhr, dwr = _ref(h, w, y, g_lp, g_ent, with_entropy=True, temperature=0.8)
    atol = 2e-3 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(lp, lr, atol=atol, rtol=0)
    torch.testing.assert_close(ent, er, atol=atol, rtol=0)
    _close_grad(dh, dhr, 1e-3 if dtype == torch.float32 else 3e-2)
    _close_grad(dw, dwr, 1e-3 if dtype == torch.float32 else 3e-2)


@pytest.mark.gpu
def test_gpu_peak_memory_below_logits():
    T, V, H = 4096, 131072, 1024
    h, w, y = (t.cuda() for t in _problem(T, V, H, torch.bfloat16, scale=0.05))
    h.requires_grad_()
    w.requires_grad_()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    token_logprobs(h, w, y).sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # fp32 dW/dH accumulators + bf16 grads: ~ 6 * (V + T) * H bytes = 0.8 GiB, whereas one
    # fp32 [T, V] logits tensor is 2 GiB (the reference holds ~3 of them)
    assert peak < T * V * 4 / 2, peak


# ----------------------------------------------------------------------------------
# GPU code paths without a GPU: compile the exact sm_90 configurations (ptxas)
# ----------------------------------------------------------------------------------
def _aot_compile(module):
    """Run `module.aot_compile_check()` in a fresh process without the interpreter."""
    import subprocess
    import sys

    env = env_without_interpreter()
    code = (
        f"import {module} as m; ks = m.aot_compile_check(); "
        "assert all(k.asm['cubin'] for k in ks.values()); print(len(ks))"
    )
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return int(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_gpu_kernels_compile_for_sm90():
    """The interpreter never runs the native-dtype (non-UPCAST) paths; ptxas must accept them."""
    # (fwd, atomic bwd, dz bwd) x (bf16, fp32) x (entropy or not)
    assert _aot_compile("trace_mega.kernels.token_logprobs") == 12


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["hidden", "weight"])
def test_grad_of_one_input_only(backend, which):
    """Frozen output layer (TRACE-C reference probe) or frozen hidden: the other grad is exact."""
    T, V, H = 21, 600, 24
    h, w, y = _problem(T, V, H, torch.float32)
    hh = h.clone().requires_grad_(which == "hidden")
    ww = w.clone().requires_grad_(which == "weight")
    lp, ent = token_logprobs(hh, ww, y, backend=backend, with_entropy=True)
    (lp.sum() + 0.5 * ent.sum()).backward()
    _, _, dhr, dwr = _ref(h, w, y, torch.ones(T), torch.full((T,), 0.5), with_entropy=True)
    if which == "hidden":
        assert ww.grad is None
        _close_grad(hh.grad, dhr, 1e-4)
    else:
        assert hh.grad is None
        _close_grad(ww.grad, dwr, 1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_stream(backend):
    h = torch.randn(0, 8, requires_grad=True)
    w = torch.randn(50, 8, requires_grad=True)
    lp, ent = token_logprobs(h, w, torch.empty(0, dtype=torch.long), backend=backend, with_entropy=True)
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert h.grad.shape == (0, 8) and torch.all(w.grad == 0)


# ----------------------------------------------------------------------------------
# Padded vocabulary (V not divisible by TP): the padding rows are not part of the model
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_padded_vocab_rows_are_excluded_and_get_no_gradient(backend):
    T, V, H = 23, 97, 32
    h, w, y = _problem(T, V, H, torch.float32)
    g_lp, g_ent = torch.randn(T), torch.randn(T)
    w_pad = torch.cat([w, torch.zeros(1, H)])  # the TP padding row (zeros: logit 0)
    lr, er, dhr, dwr = _ref(h, w, y, g_lp, g_ent, with_entropy=True)
    lp, ent, dh, dw = _run(token_logprobs, h, w_pad, y, g_lp, g_ent, with_entropy=True, backend=backend, vocab_size=V)
    torch.testing.assert_close(lp, lr, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, er, atol=1e-5, rtol=0)
    _close_grad(dh, dhr, 1e-4)
    _close_grad(dw[:V], dwr, 1e-4)
    assert dw[V:].abs().max() == 0  # no gradient to the padding
    # without the true vocab the zero row joins the softmax: the error this guards against
    bad = token_logprobs(h, w_pad, y, backend=backend)
    assert (bad - lr).abs().max() > 1e-3


def _padded_tp_worker(rank, world, port, backend, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        T, V, H = 29, 97, 32
        h, w, y = _problem(T, V, H, torch.float32)
        g_lp, g_ent = (
            torch.randn(T, generator=torch.Generator().manual_seed(5)),
            torch.randn(T, generator=torch.Generator().manual_seed(6)),
        )
        per = -(-V // world)  # 49 rows per rank: rank 1 holds 48 real rows and 1 padding row
        w_pad = torch.cat([w, torch.zeros(per * world - V, H)])
        ws = w_pad[rank * per : (rank + 1) * per].clone().requires_grad_()
        hh = h.clone().requires_grad_()
        lp, ent = token_logprobs(
            hh,
            ws,
            y,
            tp_group=dist.group.WORLD,
            vocab_start=rank * per,
            with_entropy=True,
            backend=backend,
            vocab_size=V,
        )
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        results[rank] = (lp.detach(), ent.detach(), hh.grad.clone(), ws.grad.clone())
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("backend", TP_BACKENDS)
def test_tp2_odd_vocab_matches_the_unpadded_reference(backend):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _padded_tp_worker, args=(2, _free_port(), backend, results), nprocs=2, join=True, start_method="spawn"
        )
        results = dict(results)
    T, V, H = 29, 97, 32
    h, w, y = _problem(T, V, H, torch.float32)
    g_lp, g_ent = (
        torch.randn(T, generator=torch.Generator().manual_seed(5)),
        torch.randn(T, generator=torch.Generator().manual_seed(6)),
    )
    lr, er, dhr, dwr = _ref(h, w, y, g_lp, g_ent, with_entropy=True)
    for rank in (0, 1):
        lp, ent, dh, dws = results[rank]
        torch.testing.assert_close(lp, lr, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, er, atol=1e-5, rtol=0)
        _close_grad(dh, dhr, 1e-4)
    _close_grad(torch.cat([results[0][3], results[1][3][:-1]]), dwr, 1e-4)
    assert results[1][3][-1].abs().max() == 0
