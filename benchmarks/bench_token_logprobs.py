"""Benchmark: fused token log-probs vs `log_softmax(hidden @ W.T).gather` (materialised).

CPU (default when no GPU): peak memory and time of each method, forward and
forward+backward, each measured in a FRESH subprocess:
    peak extra memory = VmHWM (process RSS high-water mark, reset through
    /proc/self/clear_refs right before the op) - VmRSS just before the op,
so imports and the inputs themselves are excluded and every method starts clean.
Methods: `reference` (kernels.token_logprobs_ref.token_logprobs_reference: the matmul's
(T, V) logits + the (T, V) log-softmax, and their gradients in the backward) and
`fused_torch` (the chunked PyTorch path; the Triton interpreter is far too slow at
this size). An analytical table of the largest live intermediates is printed for the
full-scale case T=16k, V=152k, H=5120 bf16 as well.

GPU (`--device cuda`, default when CUDA is available): median time (CUDA events),
torch.cuda.max_memory_allocated above the inputs, achieved TFLOP/s (useful FLOPs:
2TVH forward, 6TVH forward+backward) and effective bandwidth (compulsory bytes: read
hidden + weight, write the outputs/gradients) for `reference`, `fused_triton` (atomic
backward), `fused_triton_dz` (dz buffer + GEMM backward) and `fused_torch`, plus the
max |difference| of the fused log-probs from the reference.

    python benchmarks/bench_token_logprobs.py [--T 4096 --V 151936 --H 128] [--json out.json]
    trace-mega bench token_logprobs [same options]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from harness import RESULTS, parser, print_table, timed, timeit, write_json

from trace_mega.kernels._triton_env import env_without_interpreter

H200_PEAK = {"bf16_tflops": 989.0, "tf32_tflops": 494.0, "hbm_tbs": 4.8}  # dense, datasheet


# ----------------------------------------------------------------------------------
# analytical sizes of the largest simultaneously live intermediates (bytes, no inputs)
# ----------------------------------------------------------------------------------
def analytic_bytes(method, mode, T, V, H, eb, chunk):
    """Estimate of the peak extra bytes (intermediates + grads) of one method."""
    f4 = 4
    if method == "reference":
        up = T * V * f4 if eb != 4 else 0  # .float() of the (T, V) logits
        fwd = T * V * eb + up + T * V * f4  # logits, fp32 logits, log-softmax output
        if mode == "fwd":
            return fwd
        # backward: saved log-probs + gather's dense grad + log-softmax grad (+ cast), grads
        return 3 * T * V * f4 + (T * V * eb if eb != 4 else 0) + (T + V) * H * eb
    if method == "fused_triton_dz":
        # Triton statistics; backward: one (T, 8192) dz buffer in the input dtype + the
        # fp32 dh accumulator, a (T, H) GEMM output, dW in the weight dtype
        return 4 * T * f4 + ((T * 8192 * eb + T * H * (f4 + 2 * eb) + V * H * eb) if mode == "fwd_bwd" else 0)
    if method == "fused_triton":
        # (4, T) statistics; backward: fp32 atomic accumulators for dh, dW + their casts
        return 4 * T * f4 + ((T + V) * H * (f4 + eb) if mode == "fwd_bwd" else 0)
    # torch path: fp32 dh accumulator + cast; dW written per chunk in the weight dtype
    grads = T * H * (f4 + eb) + V * H * eb if mode == "fwd_bwd" else 0
    up = T * H * f4 if eb != 4 else 0  # fp32 copy of hidden
    # one (T, chunk) fp32 buffer in the forward, two in the backward (in-place ops)
    return up + (2 if mode == "fwd_bwd" else 1) * T * chunk * f4 + chunk * H * f4 + grads


# ----------------------------------------------------------------------------------
# CPU child: one method, one mode, fresh process
# ----------------------------------------------------------------------------------
def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _child(method, mode, T, V, H, dtype, chunk, threads):
    import torch

    from trace_mega.kernels.token_logprobs import token_logprobs
    from trace_mega.kernels.token_logprobs_ref import token_logprobs_reference

    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g).to(dt)
    w = (torch.randn(V, H, generator=g) / H**0.5).to(dt)
    y = torch.randint(0, V, (T,), generator=g)
    if mode == "fwd_bwd":
        h.requires_grad_()
        w.requires_grad_()
    if method == "reference":
        fn = lambda: token_logprobs_reference(h, w, y)  # noqa: E731
    else:
        fn = lambda: token_logprobs(h, w, y, backend="torch", chunk_size=chunk)  # noqa: E731
    rss0 = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS

    def run():
        if mode == "fwd":
            with torch.no_grad():
                return fn()
        out = fn()
        out.sum().backward()
        return out

    out, dt_s = timed(run)  # one call: the fresh process's peak memory is the measurement
    peak = _status_kb("VmHWM")
    print(
        json.dumps(
            {"peak_extra_bytes": (peak - rss0) * 1024, "seconds": dt_s, "checksum": float(out.detach().double().sum())}
        )
    )


def run_cpu(args):
    rows = []
    for mode in ("fwd", "fwd_bwd"):
        for method in ("reference", "fused_torch"):
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--_child",
                method,
                mode,
                str(args.T),
                str(args.V),
                str(args.H),
                args.dtype,
                str(args.chunk),
                str(args.threads),
            ]
            env = env_without_interpreter() | {"OMP_NUM_THREADS": str(args.threads)}
            res = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if res.returncode != 0:
                raise RuntimeError(f"{method}/{mode} failed:\n{res.stderr[-3000:]}")
            r = json.loads(res.stdout.strip().splitlines()[-1])
            eb = 2 if args.dtype in ("bfloat16", "float16") else 4
            rows.append(
                {
                    "method": method,
                    "mode": mode,
                    "T": args.T,
                    "V": args.V,
                    "H": args.H,
                    "dtype": args.dtype,
                    "seconds": r["seconds"],
                    "peak_extra_bytes": r["peak_extra_bytes"],
                    "analytic_bytes": analytic_bytes(method, mode, args.T, args.V, args.H, eb, args.chunk),
                    "checksum": r["checksum"],
                }
            )
            print(
                f"  measured {method:12s} {mode:8s} {r['seconds']:7.2f} s  {r['peak_extra_bytes'] / 2**20:9.1f} MiB",
                flush=True,
            )
    return rows


# ----------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------
def run_gpu(args):
    import torch

    from trace_mega.kernels.token_logprobs import token_logprobs
    from trace_mega.kernels.token_logprobs_ref import token_logprobs_reference

    dt = getattr(torch, args.dtype)
    eb = torch.tensor([], dtype=dt).element_size()
    T, V, H = args.T, args.V, args.H
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(T, H, device="cuda", generator=g).to(dt)
    w = (torch.randn(V, H, device="cuda", generator=g) / H**0.5).to(dt)
    y = torch.randint(0, V, (T,), device="cuda", generator=g)
    methods = {
        "reference": lambda hh, ww: token_logprobs_reference(hh, ww, y),
        "fused_triton": lambda hh, ww: token_logprobs(hh, ww, y, backend="triton"),
        "fused_triton_dz": lambda hh, ww: token_logprobs(hh, ww, y, backend="triton_dz"),
        "fused_torch": lambda hh, ww: token_logprobs(hh, ww, y, backend="torch", chunk_size=args.chunk),
    }
    with torch.no_grad():
        ref_lp = methods["reference"](h, w)
    rows = []
    for mode in ("fwd", "fwd_bwd"):
        for name, fn in methods.items():
            hh = h.detach().requires_grad_(mode == "fwd_bwd")
            ww = w.detach().requires_grad_(mode == "fwd_bwd")

            def step():
                if mode == "fwd":
                    with torch.no_grad():
                        return fn(hh, ww)
                hh.grad = ww.grad = None
                out = fn(hh, ww)
                out.sum().backward()
                return out

            out = step()  # warm-up (Triton compile)
            err = float((out.detach() - ref_lp).abs().max())
            del out
            hh.grad = ww.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            sec = timeit(step, reps=args.reps, warmup=0, device="cuda")  # warmed up above
            peak = torch.cuda.max_memory_allocated() - base
            flops = (2 if mode == "fwd" else 6) * T * V * H
            nbytes = (T + V) * H * eb + T * 4 + (T + V) * H * eb * (mode == "fwd_bwd")
            peak_tf = H200_PEAK["bf16_tflops" if eb == 2 else "tf32_tflops"]
            rows.append(
                {
                    "method": name,
                    "mode": mode,
                    "T": T,
                    "V": V,
                    "H": H,
                    "dtype": args.dtype,
                    "seconds": sec,
                    "peak_extra_bytes": peak,
                    "analytic_bytes": analytic_bytes(name, mode, T, V, H, eb, args.chunk),
                    "tflops": flops / sec / 1e12,
                    "mfu_vs_h200": flops / sec / 1e12 / peak_tf,
                    "eff_bandwidth_gbs": nbytes / sec / 1e9,
                    "max_abs_err_vs_ref": err,
                }
            )
            print(
                f"  {name:12s} {mode:8s} {sec * 1e3:9.2f} ms  {peak / 2**30:7.2f} GiB  "
                f"{rows[-1]['tflops']:7.1f} TFLOP/s  err {err:.2e}",
                flush=True,
            )
            hh.grad = ww.grad = None
            torch.cuda.empty_cache()
    return rows


def _table(rows, gpu):
    print()
    print_table(
        [
            r
            | {
                "ms": r["seconds"] * 1e3,
                "peak_mib": r["peak_extra_bytes"] / 2**20,
                "analytic_mib": r["analytic_bytes"] / 2**20,
            }
            for r in rows
        ],
        [
            ("method", "method", "<"),
            ("mode", "mode", "<"),
            ("ms", "time ms", ".1f"),
            ("peak_mib", "peak extra MiB", ".1f"),
            ("analytic_mib", "analytic MiB", ".1f"),
            *([("tflops", "TFLOP/s", ".1f"), ("eff_bandwidth_gbs", "GB/s", ".1f")] if gpu else []),
        ],
    )


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_child"]:
        a = argv[1:]
        return _child(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), a[5], int(a[6]), int(a[7]))
    import torch

    p = parser(__doc__, None)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--T", type=int, default=None)
    p.add_argument("--V", type=int, default=151936)
    p.add_argument("--H", type=int, default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--chunk", type=int, default=8192, help="vocab chunk of the torch path")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per child")
    p.add_argument("--reps", type=int, default=3, help="GPU timing repetitions")
    p.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    if args.quick:
        args.T, args.V, args.H = args.T or 512, 32000 if args.V == 151936 else args.V, args.H or 64
    # GPU: T=8192 keeps the 4-method run well inside its gpu_suite share; --T 16384 = full
    args.T = args.T or (8192 if gpu else 4096)
    args.H = args.H or (4096 if gpu else 128)
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    print(f"token_logprobs benchmark on {args.device}: T={args.T} V={args.V} H={args.H} {args.dtype}", flush=True)
    rows = run_gpu(args) if gpu else run_cpu(args)
    _table(rows, gpu)
    by = {(r["method"], r["mode"]): r for r in rows}
    fused = "fused_triton" if gpu else "fused_torch"
    summary = {}
    for mode in ("fwd", "fwd_bwd"):
        ref, fu = by[("reference", mode)], by[(fused, mode)]
        summary[f"{mode}_peak_memory_ratio"] = ref["peak_extra_bytes"] / max(fu["peak_extra_bytes"], 1)
        summary[f"{mode}_speedup"] = ref["seconds"] / fu["seconds"]
        if gpu:  # the alternative backward, for the choice of the default on hardware
            dz = by[("fused_triton_dz", mode)]
            summary[f"{mode}_triton_dz_peak_memory_ratio"] = ref["peak_extra_bytes"] / max(dz["peak_extra_bytes"], 1)
            summary[f"{mode}_triton_dz_speedup"] = ref["seconds"] / dz["seconds"]
    # the full-scale case, analytically (bf16 Qwen3-14B-like output layer)
    full = {
        f"{m}/{mode}": analytic_bytes(m, mode, 16384, 151936, 5120, 2, args.chunk)
        for m in ("reference", "fused_torch", "fused_triton", "fused_triton_dz")
        for mode in ("fwd", "fwd_bwd")
    }
    print("\nanalytic peak extra bytes at T=16384 V=151936 H=5120 bf16 (GiB):")
    for k, v in full.items():
        print(f"  {k:22s} {v / 2**30:8.2f}")
    print("\nsummary:", json.dumps(summary, indent=1))
    target_ok = summary["fwd_bwd_peak_memory_ratio"] >= 4 and summary["fwd_peak_memory_ratio"] >= 4
    print(f"target >= 4x lower peak memory: {'MET' if target_ok else 'NOT MET'}")
    out = {
        "op": "token_logprobs",
        "device": args.device,
        "method_of_memory": (
            "torch.cuda.max_memory_allocated - memory_allocated before"
            if gpu
            else "VmHWM - VmRSS in a fresh subprocess per method (clear_refs reset)"
        ),
        "config": vars(args),
        "rows": rows,
        "summary": summary,
        "analytic_full_scale_bytes": full,
        "target_4x_met": target_ok,
    }
    write_json(out, RESULTS / args.device / "bench_token_logprobs.json" if args.json is None else args.json)
    return out


if __name__ == "__main__":
    main()
