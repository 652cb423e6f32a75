"""Benchmark: batched boundary scoring vs per-prefix scoring and unfused gather+linear+sigmoid.

Kernel level (measured), forward and forward+backward, median of --reps runs:
  * per_prefix_loop -- one value-head call per prefix (P tiny calls): the kernel-level
    shadow of "one predictor forward per prefix";
  * unfused         -- kernels.boundary_scoring_ref.boundary_scores_reference: gather the
    (P, H) rows, matmul, add, sigmoid (separate ops, a (P, H) copy);
  * fused           -- boundary_scores (backend auto: Triton on GPU, the torch path on
    CPU -- where it IS the unfused ops, so on CPU the comparison is loop vs batched).
Model level (analytical): tokens the backbone encodes when each of the K prefixes of
every rollout is re-encoded separately vs the packed stream encoded once.

    python benchmarks/bench_boundary_scoring.py [--T 8192 --H 512 --P 1024] [--json out.json]
    trace-mega bench boundary_scoring [same options]
"""

from __future__ import annotations

import json

import torch
from harness import RESULTS, parser, print_table, timeit, write_json

H200_HBM_GBS = 4800.0


def model_level_tokens(rollouts, turns, prompt_len, turn_len):
    """Backbone tokens: re-encoding every prefix separately vs one packed pass."""
    per_prefix = rollouts * sum(prompt_len + k * turn_len for k in range(1, turns + 1))
    packed = rollouts * (prompt_len + turns * turn_len)
    return {
        "rollouts": rollouts,
        "turns": turns,
        "prompt_len": prompt_len,
        "turn_len": turn_len,
        "per_prefix_tokens": per_prefix,
        "packed_tokens": packed,
        "tokens_ratio": per_prefix / packed,
    }


def main(argv: list[str] | None = None) -> dict:
    from trace_mega.kernels.boundary_scoring import boundary_scores
    from trace_mega.kernels.boundary_scoring_ref import boundary_scores_reference

    p = parser(__doc__, None)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--T", type=int, default=None)
    p.add_argument("--H", type=int, default=None)
    p.add_argument("--P", type=int, default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    dev = args.device
    gpu = dev == "cuda"
    torch.set_num_threads(args.threads)
    T = args.T or (1024 if args.quick else (32768 if gpu else 8192))
    H = args.H or (256 if args.quick else (5120 if gpu else 512))
    P = args.P or (128 if args.quick else (4096 if gpu else 1024))
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    dt = getattr(torch, dtype)
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(T, H, device=dev, generator=g).to(dt)
    w = (torch.randn(H, device=dev, generator=g) / H**0.5).to(dt)
    b = torch.zeros((), device=dev, dtype=dt)
    pos = torch.sort(torch.randint(0, T, (P,), device=dev, generator=g)).values
    print(f"boundary_scoring benchmark on {dev}: T={T} H={H} P={P} {dtype}", flush=True)

    def loop(hh, ww, bb):
        # one call per prefix; the positions are host ints as a per-prefix caller has them
        return torch.stack([torch.sigmoid(hh[i].float() @ ww.float() + bb.float()) for i in pos_list])

    pos_list = pos.tolist()
    methods = {
        "per_prefix_loop": loop,
        "unfused": lambda hh, ww, bb: boundary_scores_reference(hh, pos, ww, bb),
        "fused": lambda hh, ww, bb: boundary_scores(hh, pos, ww, bb, validate=False),
    }
    ref = boundary_scores_reference(hidden, pos, w, b)
    rows = []
    eb = hidden.element_size()
    for mode in ("fwd", "fwd_bwd"):
        for name, fn in methods.items():
            hh, ww, bb = (t.detach().requires_grad_(mode == "fwd_bwd") for t in (hidden, w, b))

            def step():
                if mode == "fwd":
                    with torch.no_grad():
                        return fn(hh, ww, bb)
                hh.grad = ww.grad = bb.grad = None
                out = fn(hh, ww, bb)
                out.sum().backward()
                return out

            err = float((step().detach() - ref).abs().max())
            reps = max(1, args.reps // 2) if name == "per_prefix_loop" else args.reps
            sec = timeit(step, reps=reps, device=dev)
            # compulsory traffic: the P gathered rows (+ the dense dhidden in the backward)
            nbytes = P * H * eb + H * eb + 8 * P + (T * H * eb + P * H * eb) * (mode == "fwd_bwd")
            rows.append(
                {
                    "method": name,
                    "mode": mode,
                    "T": T,
                    "H": H,
                    "P": P,
                    "dtype": dtype,
                    "seconds": sec,
                    "eff_bandwidth_gbs": nbytes / sec / 1e9,
                    "max_abs_err_vs_ref": err,
                }
            )
            print(
                f"  {name:16s} {mode:8s} {sec * 1e3:10.3f} ms  {nbytes / sec / 1e9:8.2f} GB/s  err {err:.1e}",
                flush=True,
            )
    by = {(r["method"], r["mode"]): r for r in rows}
    for r in rows:
        r["speedup_vs_loop"] = by[("per_prefix_loop", r["mode"])]["seconds"] / r["seconds"]
        r["speedup_vs_unfused"] = by[("unfused", r["mode"])]["seconds"] / r["seconds"]
    print()
    print_table(
        [r | {"ms": r["seconds"] * 1e3} for r in rows],
        cols=[
            ("method", "method", "<"),
            ("mode", "mode", "<"),
            ("ms", "time ms", ".3f"),
            ("eff_bandwidth_gbs", "GB/s", ".2f"),
            ("speedup_vs_loop", "vs loop", ".1f"),
            ("speedup_vs_unfused", "vs unfused", ".2f"),
        ],
    )
    model = model_level_tokens(rollouts=64, turns=8, prompt_len=512, turn_len=256)
    print(
        f"\nmodel level: re-encoding each prefix = {model['per_prefix_tokens']} backbone "
        f"tokens vs {model['packed_tokens']} packed once ({model['tokens_ratio']:.1f}x), "
        f"for {model['rollouts']} rollouts x {model['turns']} turns"
    )
    summary = {
        f"{m}_{mode}_speedup_vs_loop": by[(m, mode)]["speedup_vs_loop"]
        for m in ("unfused", "fused")
        for mode in ("fwd", "fwd_bwd")
    }
    summary.update(
        {f"fused_{mode}_speedup_vs_unfused": by[("fused", mode)]["speedup_vs_unfused"] for mode in ("fwd", "fwd_bwd")}
    )
    if gpu:
        summary["fused_fwd_hbm_utilisation"] = by[("fused", "fwd")]["eff_bandwidth_gbs"] / H200_HBM_GBS
    print("summary:", json.dumps(summary, indent=1))
    out = {
        "op": "boundary_scoring",
        "device": dev,
        "config": vars(args) | {"T": T, "H": H, "P": P},
        "rows": rows,
        "model_level": model,
        "summary": summary,
        "fused_backend": "triton" if gpu else "torch (same ops as unfused on CPU)",
    }
    write_json(out, RESULTS / dev / "bench_boundary_scoring.json" if args.json is None else args.json)
    return out


if __name__ == "__main__":
    main()
