"""Credit accuracy on `synthetic_search`: warm-started reference vs a random-init reference.

Rolls out a policy (default the warm start, `trace-mega pretrain`, loaded from
its HF checkpoint into the torch engine; `--policy` another HF checkpoint, e.g.
an RL-trained one) on the environment's tasks, then probes the SAME trees with
two frozen references — the warm start itself and a randomly initialised model
of the same architecture — and reports `credit/auc` (ROC-AUC of δ_k against the
environment's useful-turn labels), `credit/auc_R` (of R_k) and the mean δ per
class. Yardsticks: an **oracle reader** (ℓ̄ = 0 once the context resolves the
asked key, log 1/10 before) and the AUC of δ against **decisive** turns (those
after which the context first resolves the key). Useful turns are split into
chain **hops** (revealed a pointer of the gold chain, not its value) and
**value** reveals: the AUC of δ for value reveals vs the other turns (hops
left out), of R for hops vs the other turns (values left out), and the AUC of
R over a grid of look-ahead horizons and discounts. Also reports the policy's
reading accuracy: the fraction of correct answers among answers given after
the context resolved the asked key.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_credit_auc.py [--policy HF_DIR] [--tasks N] \
        [--rollouts N] [--json PATH] [key=value ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trace_mega.commands.pretrain import PretrainConfig, pretrain, resolve_in_context
    from trace_mega.config import RolloutConfig, TrainConfig, load_yaml
    from trace_mega.credit.metrics import credit_accuracy
    from trace_mega.credit.probe import ProbeResult, hf_packed_forward, reference_probe
    from trace_mega.envs import build_env
    from trace_mega.envs.synthetic_search import ANSWER_TEMPLATE
    from trace_mega.rollout.agent_loop import AgentLoop
    from trace_mega.rollout.engines import TorchEngine
    from trace_mega.rollout.tree import pack

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pretrain-config", default=str(ROOT / "configs" / "pretrain_search.yaml"))
    ap.add_argument(
        "--train-config",
        default=str(ROOT / "configs" / "credit_demo.yaml"),
        help="config whose credit settings (epsilon, lookahead_turns, gamma_td) score the turns",
    )
    ap.add_argument("--tasks", type=int, default=64, help="tasks rolled out")
    ap.add_argument("--rollouts", type=int, default=4, help="rollouts per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--policy",
        default=None,
        help="HF checkpoint that rolls out (default: the warm start), e.g. an RL-trained policy "
        "exported with checkpoint.export_hf_at_end; the references are the same either way",
    )
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the pretrain config")
    ap.add_argument("--json", default=str(ROOT / "bench_results" / "cpu" / "bench_credit_auc.json"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    pcfg = load_yaml(PretrainConfig, args.pretrain_config, args.overrides)
    ckpt = pretrain(pcfg)
    tok = AutoTokenizer.from_pretrained(ckpt)
    warm = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    torch.manual_seed(args.seed)
    random_ref = AutoModelForCausalLM.from_config(warm.config).eval()

    env = build_env(pcfg.env.name, **pcfg.env.options)
    tasks = env.tasks("train")[: args.tasks]
    rc = RolloutConfig(max_turns=pcfg.max_turns, max_new_tokens_per_turn=3, max_total_tokens=512)
    actor = (
        warm if args.policy is None else (AutoModelForCausalLM.from_pretrained(args.policy, dtype=torch.float32).eval())
    )
    engine = TorchEngine(actor, eos_token_ids=[tok.eos_token_id])
    with AgentLoop(env, engine, tok, rc) as loop:
        trees = loop.rollout(tasks, [args.rollouts] * len(tasks), seed=args.seed)
    AgentLoop.release(trees)
    packed = pack(trees)
    labels = [env.turn_labels(t) for t in trees]
    # The credit demo's settings (ε, look-ahead, γ_td): the AUCs are those the demo's trainer logs.
    credit = dataclasses.replace(load_yaml(TrainConfig, args.train_config).credit, enabled=True)
    if credit.answer_template != ANSWER_TEMPLATE:
        raise SystemExit(
            f"{args.train_config}: credit.answer_template must be {ANSWER_TEMPLATE!r} for synthetic_search"
        )
    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731

    # Decisive turns: the turn after which the context first resolves the asked key (the only turns a
    # reader's gold likelihood can rise on; the env's `useful` label also counts earlier chain hops).
    def resolved(t, i):
        words = tok.decode(t.prefix_token_ids(i), skip_special_tokens=True).split()
        return resolve_in_context(words, t.meta["chain"][0]) is not None

    res_at = [[resolved(t, i) for i in range(len(t))] for t in trees]
    decisive = [[None] + [r[i] and not r[n.parent] for i, n in enumerate(t.nodes) if i] for t, r in zip(trees, res_at)]

    # Useful turns split by what they revealed: a pointer of the gold chain only ("hop") or its value.
    def kinds(t):
        chain, out, seen = t.meta["chain"], [None] * len(t), [set() for _ in range(len(t))]
        for i in range(1, len(t)):
            calls = t.nodes[i].info.get("tool_calls", [])
            keys = [c["arguments"].get("key") for c in calls if c.get("name") == "lookup"]
            new = {k for k in keys if k in chain and k not in seen[t.nodes[i].parent]}
            seen[i] = seen[t.nodes[i].parent] | set(keys)
            out[i] = ("value" if chain[-1] in new else "hop") if new else "other"
        return out

    turn_kind = [kinds(t) for t in trees]
    # δ against useful value reveals only (hops left out) and R against useful hops only (value reveals left out).
    no_hops = [[None if k == "hop" else (None if k is None else k == "value") for k in ks] for ks in turn_kind]
    hops_only = [[None if k in (None, "value") else k == "hop" for k in ks] for ks in turn_kind]
    grid = [(h, g) for h in (1, 2, 3, 6) for g in (0.5, 0.9, 1.0)]

    def breakdown(ell):
        hop = credit_accuracy(packed, trees, ell, hops_only, credit)
        m = {
            "auc_value_vs_other": credit_accuracy(packed, trees, ell, no_hops, credit)["credit/auc"],
            "auc_hop_vs_other": hop["credit/auc"],
            "auc_R_hop_vs_other": hop["credit/auc_R"],
            "delta_hop": hop["credit/delta_useful"],
        }
        for h, g in grid:
            c = dataclasses.replace(credit, lookahead_turns=h, gamma_td=g)
            m[f"auc_R_h{h}_g{g}"] = credit_accuracy(packed, trees, ell, labels, c)["credit/auc_R"]
        return m

    rows = {}
    for name, model in (("warm_start", warm), ("random_init", random_ref)):
        t0 = time.perf_counter()
        with torch.no_grad():
            res = reference_probe(hf_packed_forward(model), trees, encode, credit.answer_template, max_tokens=4096)
        m = credit_accuracy(packed, trees, res.for_packed(packed), labels, credit)
        m["probe_s"] = time.perf_counter() - t0
        m["auc_decisive"] = credit_accuracy(packed, trees, res.for_packed(packed), decisive, credit)["credit/auc"]
        m.update(breakdown(res.for_packed(packed)))
        rows[name] = m

    # A yardstick reader that knows only the chain rule: the gold digit has probability 1 once the context
    # resolves the asked key, 1/10 before (uniform). Not a ceiling on value reveals: a gold digit seen before
    # its chain is resolved is already evidence (irrelevant keys never hold it), which the warm start uses.
    oracle = []
    for t in trees:
        ell = torch.full((len(t),), float("nan"))
        for i, node in enumerate(t.nodes):
            if i == 0 or node.kind != "final":
                ell[i] = 0.0 if res_at[len(oracle)][i] else math.log(0.1)
        oracle.append(ell)
    oracle_ell = ProbeResult(oracle).for_packed(packed)
    rows["oracle_reader"] = credit_accuracy(packed, trees, oracle_ell, labels, credit)
    rows["oracle_reader"]["auc_decisive"] = credit_accuracy(packed, trees, oracle_ell, decisive, credit)["credit/auc"]
    rows["oracle_reader"].update(breakdown(oracle_ell))

    # Reading accuracy of the rolling-out policy: answers given when the context resolved the asked key.
    resolved = correct = 0
    rewards = []
    for t in trees:
        for leaf in t.leaves():
            node = t.nodes[leaf]
            rewards.append(node.reward)
            if node.kind != "final":
                continue
            words = tok.decode(t.prefix_token_ids(t.nodes[leaf].parent), skip_special_tokens=True).split()
            if resolve_in_context(words, t.meta["chain"][0]) is not None:
                resolved += 1
                correct += int(node.reward > 0.5)
    out = {
        "checkpoint": str(ckpt),
        "policy": args.policy or str(ckpt),
        "trajectories": len(rewards),
        "reward_mean": sum(rewards) / len(rewards),
        "answers_after_resolution": resolved,
        "reading_accuracy": correct / max(resolved, 1),
        "turns_scored": rows["warm_start"]["credit/useful_turns"] + rows["warm_start"]["credit/other_turns"],
        "references": rows,
    }
    who = "the warm policy" if args.policy is None else args.policy
    print(
        f"{len(rewards)} trajectories of {who}, reward {out['reward_mean']:.3f}, reading accuracy "
        f"{out['reading_accuracy']:.3f} over {resolved} answers after the chain was resolved"
    )
    print(
        "| reference | credit/auc (δ) | credit/auc_R | mean δ useful | mean δ other | useful / other turns | "
        "AUC of δ, decisive turns |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, m in rows.items():
        m.setdefault("probe_s", 0.0)
        print(
            f"| {name} | {m['credit/auc']:.3f} | {m['credit/auc_R']:.3f} | {m['credit/delta_useful']:.3f} | "
            f"{m['credit/delta_other']:.3f} | {m['credit/useful_turns']:.0f} / {m['credit/other_turns']:.0f} | "
            f"{m['auc_decisive']:.3f} |"
        )
    n_kind = {k: sum(ks.count(k) for ks in turn_kind) for k in ("hop", "value", "other")}
    out["scored_turn_kinds"] = n_kind
    print(f"\nuseful turns split (all turns, answers included in other): {n_kind}")
    print(
        "| reference | mean δ, hops | AUC δ, hops vs other | AUC δ, value reveals vs other (hops left out) | "
        "AUC R, hops vs other (values left out) | " + " | ".join(f"AUC R h={h} γ={g}" for h, g in grid) + " |"
    )
    print("|---|---|---|---|---|" + "---|" * len(grid))
    for name, m in rows.items():
        print(
            f"| {name} | {m['delta_hop']:.3f} | {m['auc_hop_vs_other']:.3f} | {m['auc_value_vs_other']:.3f} | "
            f"{m['auc_R_hop_vs_other']:.3f} | " + " | ".join(f"{m[f'auc_R_h{h}_g{g}']:.3f}" for h, g in grid) + " |"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
