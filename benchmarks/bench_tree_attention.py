"""Benchmark: tree attention on packed rollout trees vs the flattened baseline.

CPU (always): builds realistic rollout trees from simple specs with
``trace_mega.rollout.tree`` (``RolloutTree`` + ``pack``), and reports the
work avoided by packing:

* tokens: packed stream T vs flattened (one row per root-to-leaf path);
* attention FLOPs: allowed (query, key) pairs x 4*D*Hq for the packed tree
  (each pair = one QK^T and one PV multiply-add of length D) vs causal
  attention over every flattened path;
* tiles: (query tile, key tile) pairs the kernel visits vs the causal tile
  pairs of the packed stream (``skipped %`` = tiles dropped by the
  node-range test), how many visited tiles need no mask at all (every key
  visible to every query), and the FLOPs the kernel actually executes
  (visited tiles x BM*BN, masked entries included);
* a correctness spot-check of the Triton kernel (under the interpreter on
  CPU) against the SDPA reference and the flex_attention peer, on a small
  scenario.

GPU (when ``torch.cuda.is_available()``): times forward and forward+backward
of the kernel vs SDPA with the materialised mask, compiled flex_attention
with the tree block mask, and flattened causal SDPA (flash backend, one
padded row per path), with useful TFLOP/s (packed allowed pairs for the tree
methods, flattened causal pairs for the flattened one).

Usage::

    python benchmarks/bench_tree_attention.py [--json PATH] [--quick]

``main(argv) -> dict`` is importable; results go to
``bench_results/bench_tree_attention.json`` by default.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch
from harness import RESULTS, command_line, parser, print_table, timed, timeit, write_json

from trace_mega.kernels._triton_env import use_interpreter_without_cuda

# the kernel module must see the interpreter switch before its @triton.jit decorators run
use_interpreter_without_cuda()

from trace_mega.kernels.tree_attention import _default_blocks, tile_skip_stats, tree_attention  # noqa: E402
from trace_mega.kernels.tree_attention_ref import (  # noqa: E402
    tree_attention_flex,
    tree_attention_reference,
    tree_flex_block_mask,
    tree_mask,
)
from trace_mega.rollout.tree import Node, RolloutTree, pack  # noqa: E402


@dataclass
class TreeSpec:
    """A batch of rollout trees: per tree a prompt, bare rollouts of ReAct turns, and branches."""

    name: str
    trees: int
    prompt: int  # prompt tokens per tree
    rollouts: int  # bare rollouts from the root
    turns: int  # turns per trajectory
    turn_len: int  # mean tokens per turn (uniform in [turn_len/2, 3*turn_len/2])
    branches: int  # continuations branched at random internal turns, run to full depth


SCENARIOS = [
    TreeSpec("agentic 8x6x64 +4br", 1, 512, 8, 6, 64, 4),
    TreeSpec("agentic batch 4 trees", 4, 1024, 8, 8, 128, 8),
    TreeSpec("single-turn 16x256", 2, 2048, 16, 1, 256, 0),
    TreeSpec("deep 2x32x32 +16br", 1, 256, 2, 32, 32, 16),
]
SPOT = TreeSpec("spot-check", 2, 64, 4, 3, 16, 2)  # small enough for the interpreter
SPOT_QUICK = TreeSpec("spot-check quick", 1, 32, 3, 2, 12, 1)

# model dims used for the FLOP counts (a 7-8B GQA model)
HQ, HKV, HEAD_DIM = 32, 8, 128


def build_trees(spec: TreeSpec, seed: int = 0) -> list[RolloutTree]:
    """Random trees of the given shape (token ids are irrelevant to attention)."""
    rng = random.Random(seed)

    def turn() -> Node:
        n = rng.randint(max(1, spec.turn_len // 2), max(1, 3 * spec.turn_len // 2))
        return Node(-1, [0] * n, [1] * n, [0.0] * n)

    trees = []
    for t in range(spec.trees):
        tree = RolloutTree(f"{spec.name}/{t}", [0] * spec.prompt)
        for _ in range(spec.rollouts):
            tree.add_path(0, [turn() for _ in range(spec.turns)], reward=float(rng.random() > 0.5))
        for _ in range(spec.branches):
            internal = [i for i in range(1, len(tree)) if tree.nodes[i].reward is None and tree.depth(i) < spec.turns]
            if not internal:
                break
            at = rng.choice(internal)
            tree.add_path(at, [turn() for _ in range(spec.turns - tree.depth(at))], reward=float(rng.random() > 0.5))
        trees.append(tree)
    return trees


def work_stats(spec: TreeSpec, seed: int = 0) -> tuple[dict, object]:
    """Analytic work for one scenario (no O(T^2) mask: pairs come from path depths)."""
    packed = pack(build_trees(spec, seed))
    flat = packed.flatten()
    T = packed.num_tokens
    lengths = flat.lengths.to(torch.float64)
    # query i attends exactly the tokens on its root path up to itself: position_ids[i] + 1 keys
    pairs_packed = int((packed.position_ids + 1).sum())
    pairs_flat = int((lengths * (lengths + 1) / 2).sum())
    pairs_dense_causal = T * (T + 1) // 2
    bm, bn = _default_blocks(HEAD_DIM, torch.device("cuda"))["fwd"][:2]  # the GPU tiles
    tiles = tile_skip_stats(packed.token_node, packed.token_node_exit, bm, bn)
    per_pair = 4 * HEAD_DIM * HQ  # QK^T + PV, 2 FLOPs per multiply-add, all query heads
    row = {
        "scenario": spec.name,
        "spec": asdict(spec),
        "trees": spec.trees,
        "paths": int(flat.lengths.numel()),
        "packed_tokens": T,
        "flat_tokens": int(flat.lengths.sum()),
        "token_ratio": float(flat.lengths.sum()) / T,
        "fwd_gflop_packed": pairs_packed * per_pair / 1e9,
        "fwd_gflop_flat_causal": pairs_flat * per_pair / 1e9,
        "fwd_gflop_packed_dense_causal": pairs_dense_causal * per_pair / 1e9,
        "flop_ratio_flat_over_packed": pairs_flat / pairs_packed,
        "tile_block": [bm, bn],
        "tiles_causal": tiles["causal"],
        "tiles_visited": tiles["visited"],
        "tiles_unmasked": tiles["unmasked"],
        "tiles_skipped_frac": tiles["skipped_frac"],
        "fwd_gflop_kernel_executed": tiles["visited"] * bm * bn * per_pair / 1e9,
    }
    return row, packed


def spot_check(seed: int = 0, spec: TreeSpec = SPOT) -> dict:
    """Kernel (interpreter on CPU) vs SDPA reference and flex peer on a small scenario, fp32."""
    packed = pack(build_trees(spec, seed))
    tn, te = packed.token_node[None], packed.token_node_exit[None]  # (1, T)
    T = packed.num_tokens
    # cross-check the analytic pair count against the materialised mask
    assert int(tree_mask(tn, te).sum()) == int((packed.position_ids + 1).sum())
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, 4, 32, generator=g, requires_grad=True)
    k = torch.randn(1, T, 2, 32, generator=g, requires_grad=True)
    v = torch.randn(1, T, 2, 32, generator=g, requires_grad=True)
    do = torch.randn(1, T, 4, 32, generator=g)

    def fwd_bwd():
        o = tree_attention(q, k, v, tn, te)
        return o, torch.autograd.grad(o, (q, k, v), do)

    (o, grads), kernel_s = timed(fwd_bwd)
    ref = tree_attention_reference(q, k, v, tn, te)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    with torch.no_grad():  # flex has no CPU backward: feed it detached inputs
        flex = tree_attention_flex(q.detach(), k.detach(), v.detach(), tn, te)
    errs = {"o_vs_sdpa": (o - ref).abs().max().item(), "o_vs_flex": (o - flex).abs().max().item()}
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref_grads):
        errs[f"{name}_vs_sdpa"] = (a - b).abs().max().item()
    return {
        "tokens": T,
        "heads": "4q/2kv",
        "head_dim": 32,
        "dtype": "fp32",
        "interpreted": not torch.cuda.is_available(),
        "fwd_bwd_seconds": kernel_s,
        "max_abs_err": errs,
        "ok": max(errs.values()) < 1e-4,
    }


def gpu_timings(row: dict, packed, dtype=torch.bfloat16, device: str = "cuda") -> list[dict]:
    """fwd / fwd+bwd times of the kernel and its peers on one scenario (meant for CUDA)."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    dev = torch.device(device)
    T = packed.num_tokens
    tn, te = packed.token_node[None].to(dev), packed.token_node_exit[None].to(dev)
    mk = lambda h: torch.randn(1, T, h, HEAD_DIM, device=dev, dtype=dtype, requires_grad=True)  # noqa: E731
    q, k, v = mk(HQ), mk(HKV), mk(HKV)
    do = torch.randn_like(q)
    flex_c = torch.compile(flex_attention)
    bmask = tree_flex_block_mask(tn, te)
    flat = packed.flatten()
    L, S = flat.packed_index.shape
    idx = flat.packed_index.clamp(min=0).to(dev)  # (L, S) gather packed tokens into padded paths
    qf = q.detach()[0][idx].transpose(1, 2).contiguous().requires_grad_(True)  # (L, Hq, S, D)
    kf = k.detach()[0][idx].transpose(1, 2).repeat_interleave(HQ // HKV, 1).contiguous().requires_grad_(True)
    vf = v.detach()[0][idx].transpose(1, 2).repeat_interleave(HQ // HKV, 1).contiguous().requires_grad_(True)
    dof = torch.randn_like(qf)
    t = lambda x: x.transpose(1, 2)  # noqa: E731  (B, T, H, D) <-> (B, H, T, D)
    # name -> (fn(q, k, v) -> out, upstream grad, leaves, which FLOP count is "useful")
    methods = {
        "tree_attention (triton)": (lambda a, b, c: tree_attention(a, b, c, tn, te), do, (q, k, v), "packed"),
        "sdpa + mask": (lambda a, b, c: tree_attention_reference(a, b, c, tn, te), do, (q, k, v), "packed"),
        "flex_attention (compiled)": (
            lambda a, b, c: flex_c(t(a), t(b), t(c), block_mask=bmask, enable_gqa=True),
            t(do),
            (q, k, v),
            "packed",
        ),
        "flattened causal sdpa": (
            lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
            dof,
            (qf, kf, vf),
            "flat",
        ),
    }
    out = []
    for name, (fn, grad, leaves, layout) in methods.items():
        gflop = row["fwd_gflop_packed"] if layout == "packed" else row["fwd_gflop_flat_causal"]
        rec = {"scenario": row["scenario"], "method": name, "useful_gflop_fwd": gflop}
        detached = tuple(x.detach() for x in leaves)
        for key, run in (
            ("fwd", lambda: fn(*detached)),
            ("fwd_bwd", lambda: torch.autograd.grad(fn(*leaves), leaves, grad)),
        ):
            try:
                with torch.set_grad_enabled(key == "fwd_bwd"):
                    ms = 1e3 * timeit(run, reps=10, warmup=3, device=dev, reduce="mean")
                rec[f"{key}_ms"] = ms
                # backward = 5 GEMMs (QK^T recompute, dV, dP, dQ, dK) vs the forward's 2: f+b = 3.5x fwd
                rec[f"{key}_tflops"] = gflop * (1.0 if key == "fwd" else 3.5) / ms
            except Exception as e:  # e.g. OOM of the O(T^2) mask on big scenarios: record, keep going
                rec[f"{key}_error"] = f"{type(e).__name__}: {e}"[:200]
                rec["error"] = rec[f"{key}_error"][:60]
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        out.append(rec)
    return out


def main(argv=None) -> dict:
    ap = parser(__doc__, RESULTS / "bench_tree_attention.json")
    ap.add_argument("--quick", action="store_true", help="first scenario only, no GPU timing of big ones")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    scenarios = SCENARIOS[:1] if args.quick else SCENARIOS
    rows, packs = [], []
    for spec in scenarios:
        row, packed = work_stats(spec, args.seed)
        rows.append(row)
        packs.append(packed)
    print_table(
        rows,
        title=f"Work avoided by packing (FLOPs for Hq={HQ}, Hkv={HKV}, D={HEAD_DIM}; "
        f"tiles {rows[0]['tile_block'][0]}x{rows[0]['tile_block'][1]}):",
        cols=[
            ("scenario", "scenario", "<"),
            ("paths", "paths", "d"),
            ("packed_tokens", "packed T", "d"),
            ("flat_tokens", "flat tokens", "d"),
            ("token_ratio", "tok ratio", ".2f"),
            ("fwd_gflop_packed", "GF packed", ".1f"),
            ("fwd_gflop_flat_causal", "GF flat", ".1f"),
            ("flop_ratio_flat_over_packed", "FLOP ratio", ".2f"),
            ("fwd_gflop_packed_dense_causal", "GF causal", ".1f"),
            ("fwd_gflop_kernel_executed", "GF executed", ".1f"),
            ("tiles_causal", "tiles causal", "d"),
            ("tiles_visited", "tiles run", "d"),
            ("tiles_unmasked", "unmasked", "d"),
            ("tiles_skipped_frac", "skipped", ".1%"),
        ],
    )
    spot = spot_check(args.seed, SPOT_QUICK if args.quick else SPOT)
    print(
        f"\nSpot-check ({spot['tokens']} tokens, {spot['heads']}, D={spot['head_dim']}, fp32, "
        f"{'Triton interpreter' if spot['interpreted'] else 'GPU'}): "
        + ", ".join(f"{k}={v:.1e}" for k, v in spot["max_abs_err"].items())
        + f"  -> {'OK' if spot['ok'] else 'MISMATCH'}"
    )
    timings = []
    if torch.cuda.is_available():
        for row, packed in zip(rows, packs):
            timings += gpu_timings(row, packed)
        print_table(
            timings,
            title=f"\nGPU ({torch.cuda.get_device_name()}, bf16):",
            cols=[
                ("scenario", "scenario", "<"),
                ("method", "method", "<"),
                ("fwd_ms", "fwd ms", ".3f"),
                ("fwd_bwd_ms", "fwd+bwd ms", ".3f"),
                ("fwd_tflops", "fwd TF/s", ".1f"),
                ("fwd_bwd_tflops", "f+b TF/s", ".1f"),
                ("error", "error", "<"),
            ],
        )
    result = {
        "benchmark": "tree_attention",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "command": command_line(__file__, argv),
        "model": {"hq": HQ, "hkv": HKV, "head_dim": HEAD_DIM},
        "work": rows,
        "spot_check": spot,
        "gpu_timings": timings,
    }
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
