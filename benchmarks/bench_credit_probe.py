"""Benchmark: the TRACE-C reference probe in ONE packed forward vs one forward per boundary.

A trajectory of T tokens (prompt, K tool turns, a final answer turn) is probed at its
K + 1 boundaries S_0 … S_K with `template + y*`:

* packed   — `trace_mega.credit.probe.reference_probe`: the trajectory (less its final
  answer turn, which no probe needs) plus K + 1 probe leaves in one stream with the tree
  mask, |S_K| + (K+1)·|probe| tokens, one forward;
* separate — the obvious baseline: K + 1 causal forwards over S_k + template + y*,
  Σ_k (|S_k| + |probe|) tokens.

Both run the same frozen reference (a tiny random transformers Qwen3, fp32, eval, no
grad) on CPU; the table reports tokens processed, best-of-`repeats` wall time,
speedups, and max |Δℓ̄| between the methods (they must agree, fp32).

Usage::

    python benchmarks/bench_credit_probe.py [--T 1024] [--answer-len 8] [--ks 2,4,8,16]
                                            [--repeats 3] [--json PATH]

`main(argv) -> dict` is importable; results go to bench_results/cpu/bench_credit_probe.json
by default.
"""

from __future__ import annotations

import torch
from harness import RESULTS, parser, print_table, timeit, write_json

from trace_mega.credit.probe import answer_token_ids, build_probe_batch, hf_packed_forward, reference_probe
from trace_mega.rollout.tree import Node, RolloutTree

TEMPLATE_LEN = 4


def make_trajectory(T: int, K: int, answer_len: int, vocab: int, seed: int):
    """(tree, tokenize) — one path of K tool turns and a final turn, T tokens in all, and a toy
    tokenizer that maps the template / gold strings to fixed random ids."""
    g = torch.Generator().manual_seed(seed)
    prompt = T // (K + 2)
    turn = (T - prompt) // (K + 1)
    ids = torch.randint(0, vocab, (T,), generator=g).tolist()
    tree = RolloutTree("bench", ids[:prompt], gold_answer="G" * answer_len)
    nid, pos = 0, prompt
    for k in range(K + 1):
        n = turn if k < K else T - pos  # the final turn takes the remainder
        kind = "tool" if k < K else "final"
        nid = tree.add_node(nid, Node(nid, ids[pos : pos + n], [1] * n, [0.0] * n, kind=kind))
        pos += n
    tree.nodes[nid].reward = 1.0
    tmpl_ids = torch.randint(0, vocab, (TEMPLATE_LEN,), generator=g).tolist()
    gold_ids = torch.randint(0, vocab, (answer_len,), generator=g).tolist()

    def tokenize(s: str) -> list[int]:  # "T" = the template, "G" * n = the gold answer
        return (tmpl_ids if s.startswith("T") else []) + gold_ids[: s.count("G")]

    return tree, tokenize


def separate_probe(model, tree: RolloutTree, tokenize) -> tuple[torch.Tensor, int]:
    """(ℓ̄ per boundary, tokens processed) with one causal forward per boundary."""
    tmpl, gold = answer_token_ids(tokenize, "T", tree.gold_answer)
    out, tokens = [], 0
    for b in [i for i, n in enumerate(tree.nodes) if i == 0 or n.kind != "final"]:
        ids = tree.prefix_token_ids(b) + tmpl + gold
        tokens += len(ids)
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        n = len(ids)
        out.append(sum(logp[n - len(gold) - 1 + j, gold[j]] for j in range(len(gold))) / len(gold))
    return torch.stack(out), tokens


def tiny_reference(vocab: int, hidden: int, layers: int, max_pos: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=max_pos,
    )
    return Qwen3ForCausalLM(cfg).eval()


@torch.no_grad()
def run(T: int, answer_len: int, ks: list[int], repeats: int, vocab: int, hidden: int, layers: int) -> dict:
    model = tiny_reference(vocab, hidden, layers, max_pos=T + 64)
    fwd = hf_packed_forward(model)
    rows = []
    for K in ks:
        tree, tokenize = make_trajectory(T, K, answer_len, vocab, seed=K)
        answers = [answer_token_ids(tokenize, "T", tree.gold_answer)]
        packed_tokens = build_probe_batch([tree], answers).packed.num_tokens
        ell_packed = reference_probe(fwd, [tree], tokenize, "T").ell[0]
        ell_packed = ell_packed[~torch.isnan(ell_packed)]
        ell_sep, sep_tokens = separate_probe(model, tree, tokenize)
        # best of `repeats`; the two ℓ̄ computations above were the warm-up
        t_packed = timeit(lambda: reference_probe(fwd, [tree], tokenize, "T"), reps=repeats, warmup=0, reduce="min")
        t_sep = timeit(lambda: separate_probe(model, tree, tokenize), reps=repeats, warmup=0, reduce="min")
        rows.append(
            {
                "K": K,
                "probes": K + 1,
                "T": T,
                "answer_len": answer_len,
                "packed_tokens": packed_tokens,
                "separate_tokens": sep_tokens,
                "token_ratio": sep_tokens / packed_tokens,
                "packed_s": t_packed,
                "separate_s": t_sep,
                "speedup": t_sep / t_packed,
                "max_abs_diff_ell": float((ell_packed - ell_sep).abs().max()),
            }
        )
    return {
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "model": {
            "kind": "transformers Qwen3 (random init, fp32, sdpa)",
            "vocab": vocab,
            "hidden": hidden,
            "layers": layers,
        },
        "template_len": TEMPLATE_LEN,
        "repeats": repeats,
        "rows": rows,
    }


def main(argv=None) -> dict:
    ap = parser(__doc__, RESULTS / "cpu" / "bench_credit_probe.json")
    ap.add_argument("--T", type=int, default=1024, help="trajectory tokens")
    ap.add_argument("--answer-len", type=int, default=8, help="|y*| gold-answer tokens")
    ap.add_argument("--ks", default="2,4,8,16", help="tool boundaries K (comma-separated)")
    ap.add_argument("--repeats", type=int, default=3, help="timing repeats (best is reported)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args(argv)
    res = run(
        args.T,
        args.answer_len,
        [int(k) for k in args.ks.split(",")],
        args.repeats,
        args.vocab,
        args.hidden,
        args.layers,
    )
    print_table(
        res["rows"],
        [
            ("K", "K", "d"),
            ("probes", "probes", "d"),
            ("packed_tokens", "packed tok", "d"),
            ("separate_tokens", "separate tok", "d"),
            ("token_ratio", "tok ratio", ".2f"),
            ("packed_s", "packed s", ".4f"),
            ("separate_s", "separate s", ".4f"),
            ("speedup", "speedup", ".2f"),
            ("max_abs_diff_ell", "max|dl|", ".1e"),
        ],
    )
    write_json(res, args.json)
    return res


if __name__ == "__main__":
    main()
