"""torchrun worker: MoE rollout routing replay (R3) in the learner against an HF forward with forced routes.

argv: HF_DIR OUT_JSON TP EP PP NOISE MICRO_BATCH_TOKENS [RECOMPUTE]

The rollout engine (a torch engine on the same checkpoint, its routers perturbed by NOISE x their
std, so it routes some tokens elsewhere) generates small trees and captures its routes. The
learner's log-probs with and without replay are compared with a plain HF forward of every path
whose routers are forced to the engine's experts (weights from the unperturbed router, as the
learner's replay takes them). The first rank of the last pipeline stage (where the log-probs are)
writes the differences, the predictor-scoring check, the replay metrics (the replay probe on) and
the k3 of the replayed and the own-routing log-probs against the engine's as JSON. Every rank saves its weights after the
replayed update to OUT_JSON.rank<r>.pt; RECOMPUTE=1 turns on activation recompute.
"""

import json
import sys

import torch

from trace_mega.config import LossConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from trace_mega.learner.learner import Learner
from trace_mega.learner.optim import forward_only
from trace_mega.learner.parallel import destroy_parallel
from trace_mega.objective.advantages import compute_advantages
from trace_mega.rollout.engines import SamplingParams, TorchEngine
from trace_mega.rollout.engines.routing import NO_ROUTE, attach_routes, packed_routes, routers_of
from trace_mega.rollout.tree import Node, RolloutTree, pack


def rollout_trees(hf_dir: str, noise: float) -> list[RolloutTree]:
    """Two trees (two first turns per prompt, one second turn below the first) with engine routes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for r in routers_of(model):
            r.weight.add_(noise * r.weight.std() * torch.randn(r.weight.shape, generator=g))
    eng = TorchEngine(model, capture_routing=True, eos_token_ids=[])
    trees = []
    for i, prompt in enumerate([[5, 6, 7, 8, 9, 10], [20, 21, 22, 23]]):
        tree = RolloutTree(f"p{i}", prompt)
        firsts = []
        for k in range(2):
            (c,) = eng.generate([prompt], SamplingParams(1.0, max_new_tokens=6, seed=10 * i + k))
            nid = tree.add_node(0, Node(0, c.token_ids + [3, 4], [1] * 6 + [0, 0], c.logprobs + [0.0, 0.0]))
            attach_routes(tree, nid, c.routing)
            firsts.append((nid, c))
        for j, (nid, c) in enumerate(firsts):
            (c2,) = eng.generate([prompt + c.token_ids + [3, 4]], SamplingParams(1.0, max_new_tokens=5, seed=99 + j))
            leaf = tree.add_path(nid, [Node(0, c2.token_ids, [1] * 5, c2.logprobs)], reward=float(j))
            attach_routes(tree, leaf, c2.routing)
        trees.append(tree)
    return trees


def forced_logprobs(hf_dir: str, trees, packed, routes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T,) log-probs of the loss tokens from the unperturbed HF model with its routers forced to
    `routes` (own top-k where NO_ROUTE), path by path; and (T, L, k) its own routes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    forced: dict[str, torch.Tensor] = {}
    own_routes: list[torch.Tensor] = []

    def hook(layer):
        def fn(module, inputs, output):
            logits, _, own = output
            own_routes.append(own)
            want = forced["routes"][:, layer].long()
            experts = torch.where(want[:, :1] >= 0, want, own)
            picked = logits.gather(1, experts)
            weights = (
                torch.softmax(picked.float(), -1)
                if module.norm_topk_prob
                else torch.softmax(logits, -1).gather(1, experts)
            )
            return logits, weights.to(logits.dtype), experts

        return fn

    for layer, r in enumerate(routers_of(model)):
        r.register_forward_hook(hook(layer))
    lp = torch.zeros(packed.num_tokens)
    own = torch.full(routes.shape, NO_ROUTE, dtype=torch.long)
    flat = packed.flatten()
    for row in range(flat.tokens.shape[0]):
        n = int(flat.lengths[row])
        idx = flat.packed_index[row, :n]
        forced["routes"] = routes[idx]
        own_routes.clear()
        with torch.no_grad():
            logits = model(input_ids=flat.tokens[row, :n][None]).logits[0].float()  # (n, V)
        own[idx] = torch.stack(own_routes, dim=1)
        logp = torch.log_softmax(logits[:-1], -1).gather(1, flat.tokens[row, 1:n, None])[:, 0]  # token j+1
        loss = packed.loss_mask[idx[1:]]
        lp[idx[1:][loss]] = logp[loss]
    return lp, own


def main() -> None:
    hf_dir, out_json = sys.argv[1], sys.argv[2]
    tp, ep, pp, noise, micro = (
        int(sys.argv[3]),
        int(sys.argv[4]),
        int(sys.argv[5]),
        float(sys.argv[6]),
        int(sys.argv[7]),
    )
    recompute = len(sys.argv) > 8 and sys.argv[8] == "1"
    cfg = TrainConfig(
        model=ModelConfig(hf_checkpoint=hf_dir, moe_routing_replay="rollout", moe_replay_probe=True),
        parallel=ParallelConfig(
            device="cpu",
            tensor_model_parallel_size=tp,
            expert_model_parallel_size=ep,
            pipeline_model_parallel_size=pp,
            micro_batch_tokens=micro,
            recompute_activations=recompute,
        ),
        optim=OptimConfig(lr=1e-3, clip_grad_norm=0.0),
        loss=LossConfig(kl_coef=0.01),  # builds the frozen reference, which must route on its own
    )
    learner = Learner(cfg)
    trees = rollout_trees(hf_dir, noise)
    packed = pack(trees)
    L, k = learner.model_cfg.num_layers, learner.model_cfg.moe_router_topk
    routes = packed_routes(trees, packed, L, k)
    replayed = learner.old_logprobs(packed, routing=routes)
    own = learner.old_logprobs(packed)
    # The reference ignores the routes it is handed (no replays installed on it) and, at the
    # initial weights, equals the policy routing on its own.
    ref_in = [learner._batch(packed, routing=routes), learner._batch(packed)]
    ref = [h[0, : packed.num_tokens] for h in forward_only(learner.reference, ref_in)]
    policy_hidden = learner.hidden_states(packed)

    # The predictor's scoring (`score_nodes`, split over DP) replays the routes it is handed: a node's
    # score here is the sum of its tokens' hidden states, from the replayed forward or the own one.
    def node_sums(layout, hidden):
        return torch.zeros(layout.num_nodes, dtype=torch.float64).index_add_(
            0, layout.token_node, hidden.sum(-1).double()
        )

    nodes = torch.arange(packed.num_nodes)
    scored = learner.score_nodes(packed, nodes, lambda sub, local, h: node_sums(sub, h)[local], True, routing=routes)
    want_replayed = node_sums(packed, learner.hidden_states(packed, routes))
    want_own = node_sums(packed, policy_hidden)
    forced, hf_own = forced_logprobs(hf_dir, trees, packed, routes)
    mask = packed.loss_mask & (packed.prev_index >= 0)

    def k3(lp: torch.Tensor) -> float:  # k3 KL of the engine's sampling log-probs against `lp`
        x = (lp.double() - packed.behaviour_logprobs.double())[packed.loss_mask]
        return float((x.exp() - 1 - x).mean())

    given = routes[..., 0] >= 0  # (T, L)
    same = (routes.sort(-1).values == hf_own.sort(-1).values).all(-1) & given
    adv = compute_advantages(packed, trees, cfg.advantage)
    metrics = learner.train_step(packed, adv, routing=routes).metrics
    g = learner.groups
    weights = {n: p.detach().clone() for n, p in learner.policy.named_parameters()}
    torch.save(weights, f"{out_json}.rank{torch.distributed.get_rank()}.pt")
    if g.is_last_stage and g.tp_rank == 0 and g.dp_rank == 0:
        with open(out_json, "w") as f:
            json.dump(
                {
                    "replay_vs_forced": float((replayed - forced)[mask].abs().max()),
                    "own_vs_forced": float((own - forced)[mask].abs().max()),
                    "reference_routes_on_its_own": bool(torch.equal(ref[0], ref[1]))
                    and float((ref[1] - policy_hidden).abs().max()) < 1e-5,
                    "score_vs_replayed": float((scored - want_replayed).abs().max()),
                    "score_own_gap": float((want_own - want_replayed).abs().max()),
                    "loss_tokens": int(mask.sum()),
                    "routed_tokens": int(given[:, 0].sum()),
                    "unrouted_tokens": int((~given[:, 0]).sum()),
                    "expected_agreement": float(same.sum() / given.sum()),
                    "metrics": metrics,
                    "k3_replayed": k3(replayed),
                    "k3_own": k3(own),
                },
                f,
            )
    destroy_parallel()


if __name__ == "__main__":
    main()
