"""Prefill work and time with vs without prefix KV reuse on a tree-shaped rollout workload.

Workload (docs/design.md §3.4 steps 4-8, shapes scaled to a CPU): P prompts; per prompt
M bare multi-turn rollouts (each turn: the engine generates, then a fixed-length
"observation" is appended and the next turn continues the whole history); then
K continuations branched at a turn boundary of every bare rollout, each
running the remaining turns. The same seeded workload runs on an engine with
prefix caching and on one without; reported: prompt tokens, tokens actually
prefilled, tokens served from the cache, wall time, and whether the sampled
tokens were identical (the torch engine guarantees it; vLLM with per-request
seeds is expected to match too).

    python benchmarks/bench_prefix_reuse.py [--json PATH] [--quick] [--engines torch,vllm]

`main(argv) -> dict` is importable. The vLLM rows run when `vllm` is
importable (e.g. in .venv-vllm; set VLLM_CPU_KVCACHE_SPACE=1 on CPU).
"""

from __future__ import annotations

import os
import random
import tempfile

import torch
from harness import RESULTS, command_line, parser, print_table, timed, write_json

from trace_mega.rollout.engines import ENGINES, SamplingParams


def _tiny_model(args):
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
        initializer_range=0.2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _run_turns(
    engine, histories: list[list[int]], turns: int, args, seed: int, rng: random.Random, counts: dict[str, int]
):
    """Advance every history by `turns` (generate, then append an observation); returns completions per
    turn and adds the prompt / cached / generated token counts of every request to `counts`."""
    out = []
    for t in range(turns):
        sp = SamplingParams(temperature=1.0, max_new_tokens=args.gen, seed=seed + 1000 * t)
        comps = engine.generate(histories, sp)
        counts["prompt"] += sum(len(h) for h in histories)
        counts["cached"] += sum(c.cached_prefix_tokens for c in comps)
        counts["generated"] += sum(len(c.token_ids) for c in comps)
        out.append(comps)
        histories = [
            h + c.token_ids + [rng.randrange(args.vocab) for _ in range(args.obs)] for h, c in zip(histories, comps)
        ]
    return histories, out


def run_workload(engine, args) -> dict:
    """Bare rollouts then K branches per rollout at turn boundary `branch_turn`; returns counts, time, samples."""
    rng = random.Random(0)
    prompts = [[rng.randrange(args.vocab) for _ in range(args.prompt)] for _ in range(args.prompts)]
    # Warm-up outside the timing (first-call costs), then drop its caches (sleep/wake does
    # on both engines) and its counts, so both runs start alike.
    engine.generate(prompts[:1], SamplingParams(temperature=1.0, max_new_tokens=args.gen, seed=0))
    engine.sleep()
    engine.wake_up()
    counts = {"prompt": 0, "cached": 0, "generated": 0}
    bare_start = [p for p in prompts for _ in range(args.m)]

    def workload():
        # Bare rollouts, recording the history at the branch boundary.
        node_hist, first = _run_turns(engine, bare_start, args.branch_turn, args, 1, random.Random(1), counts)
        _, rest = _run_turns(engine, node_hist, args.turns - args.branch_turn, args, 2, random.Random(2), counts)
        branches = [h for h in node_hist for _ in range(args.k)]
        _, conts = _run_turns(engine, branches, args.turns - args.branch_turn, args, 3, random.Random(3), counts)
        return first + rest + conts

    turns, seconds = timed(workload)
    samples = [c.token_ids for turn in turns for c in turn]
    return {
        "prompt_tokens": counts["prompt"],
        "prefill_tokens": counts["prompt"] - counts["cached"],
        "cached_prefill_tokens": counts["cached"],
        "generated_tokens": counts["generated"],
        "seconds": round(seconds, 3),
        "samples": samples,
    }


def _engines(names: list[str], args, model, tmp: str):
    for name in names:
        for reuse in (True, False):
            if name == "torch":
                yield name, reuse, ENGINES.get("torch")(model, enable_prefix_caching=reuse)
            else:
                yield (
                    name,
                    reuse,
                    ENGINES.get("vllm")(
                        tmp,
                        dtype="float32",
                        enable_prefix_caching=reuse,
                        max_model_len=4096,
                        max_num_seqs=64,
                        block_size=32,
                    ),
                )


def main(argv=None) -> dict:
    ap = parser(__doc__, RESULTS / "bench_prefix_reuse.json")
    ap.add_argument("--quick", action="store_true", help="a smaller workload (tests, smoke runs)")
    ap.add_argument("--engines", default=None, help="comma list; default: torch, plus vllm when importable")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--m", type=int, default=8, help="bare rollouts per prompt")
    ap.add_argument("--k", type=int, default=4, help="continuations per bare rollout")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--branch-turn", type=int, default=1, help="branch after this many turns")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--gen", type=int, default=16, help="generated tokens per turn")
    ap.add_argument("--obs", type=int, default=24, help="observation tokens per turn")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1024)
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.m, args.k, args.turns, args.prompt, args.gen, args.obs, args.layers = 2, 2, 2, 2, 48, 6, 8, 2
    if not 0 < args.branch_turn < args.turns:
        ap.error("need 0 < --branch-turn < --turns")
    if args.engines is None:
        try:
            import vllm  # noqa: F401

            names = ["torch", "vllm"]
        except ImportError:
            names = ["torch"]
    else:
        names = args.engines.split(",")

    model = _tiny_model(args)
    rows, samples = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        if "vllm" in names:
            model.save_pretrained(tmp)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        for name, reuse, engine in _engines(names, args, model, tmp):
            res = run_workload(engine, args)
            engine.close()
            samples[(name, reuse)] = res.pop("samples")
            rows.append({"engine": name, "reuse": reuse, **res})
    for name in names:
        with_r = next(r for r in rows if r["engine"] == name and r["reuse"])
        without = next(r for r in rows if r["engine"] == name and not r["reuse"])
        with_r["prefill_avoided_frac"] = round(1 - with_r["prefill_tokens"] / without["prefill_tokens"], 4)
        with_r["speedup"] = round(without["seconds"] / max(with_r["seconds"], 1e-9), 3)
        with_r["samples_identical"] = samples[(name, True)] == samples[(name, False)]

    print_table(
        rows,
        [
            (c, c, "")
            for c in (
                "engine",
                "reuse",
                "prompt_tokens",
                "prefill_tokens",
                "cached_prefill_tokens",
                "generated_tokens",
                "seconds",
            )
        ],
    )
    for r in rows:
        if r["reuse"]:
            print(
                f"{r['engine']}: prefill avoided {100 * r['prefill_avoided_frac']:.1f}%, "
                f"speedup {r['speedup']}x, samples identical with/without reuse: {r['samples_identical']}"
            )
    result = {
        "command": command_line(__file__, argv),
        "workload": {
            k: getattr(args, k)
            for k in ("prompts", "m", "k", "turns", "branch_turn", "prompt", "gen", "obs", "layers", "hidden", "vocab")
        },
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
    }
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
