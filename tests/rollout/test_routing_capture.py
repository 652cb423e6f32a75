"""MoE routing capture in the torch engine (engines/routing.py): shapes, dtype, prefix sharing, and
equality with the routers' top-k of a plain HF forward of each request's whole sequence."""

import pytest
import torch
import transformers

from trace_mega.rollout.engines import SamplingParams, TorchEngine
from trace_mega.rollout.engines.routing import NO_ROUTE, attach_routes, packed_routes, route_dtype, routers_of
from trace_mega.rollout.tree import Node, RolloutTree, load_jsonl, pack, save_jsonl

LAYERS, EXPERTS, TOPK = 2, 8, 2


def tiny_moe(seed: int = 0):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        initializer_range=0.2,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def hf_routes(model, tokens: list[int]) -> torch.Tensor:
    """(len, L, k) each router's top-k experts in one plain forward of `tokens`."""
    got = []
    hooks = [r.register_forward_hook(lambda m, i, o: got.append(o[2])) for r in routers_of(model)]
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return torch.stack(got, dim=1)


def same_experts(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal expert sets per token and layer (top-k order is the score order; compare as sets)."""
    return torch.equal(a.long().sort(-1).values, b.long().sort(-1).values)


def turn(c, obs: list[int]) -> Node:
    return Node(0, c.token_ids + obs, [1] * len(c.token_ids) + [0] * len(obs), c.logprobs + [0.0] * len(obs))


PROMPTS = [[3, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8], [3, 4, 5, 9, 10], [40, 41, 42, 43]]


@pytest.mark.parametrize("caching", [True, False])
def test_captured_routes_equal_a_plain_forwards_router_topk(caching):
    model = tiny_moe()
    eng = TorchEngine(model, enable_prefix_caching=caching, max_batch_size=3, capture_routing=True)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=7, seeds=[1, 2, 3, 4])
    first = eng.generate(PROMPTS, sampling)
    # A second turn on top of the first: with caching its prefix routes come from the cache.
    second = eng.generate([p + c.token_ids + [50, 51] for p, c in zip(PROMPTS, first)], sampling)
    for prompts, comps in ((PROMPTS, first), ([p + c.token_ids + [50, 51] for p, c in zip(PROMPTS, first)], second)):
        for p, c in zip(prompts, comps):
            fed = p + c.token_ids[:-1]
            assert c.routing.dtype == route_dtype(EXPERTS) == torch.uint8
            assert c.routing.shape == (len(fed), LAYERS, TOPK)
            assert same_experts(c.routing, hf_routes(model, fed))
    if caching:
        assert sum(c.cached_prefix_tokens for c in second) > 0
    # Without capture nothing is recorded.
    plain = TorchEngine(model, capture_routing=False).generate(PROMPTS[:1], sampling)
    assert plain[0].routing is None


def test_cached_prefix_keeps_the_routes_of_its_first_computation():
    """Tokens served from the prefix cache are not recomputed: their routes are the ones stored
    when they were first computed, even if the router changed since (here: on purpose)."""
    model = tiny_moe()
    eng = TorchEngine(model, capture_routing=True)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=4)
    (a,) = eng.generate([PROMPTS[0]], sampling)
    with torch.no_grad():
        for r in routers_of(model):  # a different router: fresh computation would route differently
            r.weight.copy_(torch.randn_like(r.weight))
    (b,) = eng.generate([PROMPTS[0] + a.token_ids + [60]], sampling)
    n = len(PROMPTS[0]) + len(a.token_ids) - 1  # the tokens the cache held
    assert b.cached_prefix_tokens == n
    assert torch.equal(b.routing[:n], a.routing)
    assert not same_experts(b.routing[:n], hf_routes(model, PROMPTS[0] + a.token_ids[:-1]))


def test_routes_are_stored_once_per_node_and_laid_out_by_the_packed_stream(tmp_path):
    model = tiny_moe()
    eng = TorchEngine(model, capture_routing=True)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5, seed=0)
    prompt = [3, 4, 5, 6]
    tree = RolloutTree("p", prompt)
    (c1,) = eng.generate([prompt], sampling)
    mid = tree.add_node(0, turn(c1, [70, 71]))
    leaves = []
    for k in range(2):  # two continuations below `mid`: its tokens are routed by both, stored once
        (c2,) = eng.generate([prompt + c1.token_ids + [70, 71]], SamplingParams(1.0, max_new_tokens=5, seed=10 + k))
        leaf = tree.add_path(mid, [turn(c2, [])], reward=float(k))
        attach_routes(tree, mid, c1.routing)
        attach_routes(tree, leaf, c2.routing)
        leaves.append((leaf, c2))
    packed = pack([tree])
    routes = packed_routes([tree], packed, LAYERS, TOPK)
    assert routes.shape == (packed.num_tokens, LAYERS, TOPK) and routes.dtype == torch.int16
    for leaf, c2 in leaves:
        idx = packed.path_token_indices(packed.node_local.index((0, leaf)))
        path = prompt + c1.token_ids + [70, 71] + c2.token_ids
        n = len(path) - 1  # every token the engine fed; the trajectory's last one was never fed
        assert same_experts(routes[idx[:n]], hf_routes(model, path[:n]))
        assert (routes[idx[n:]] == NO_ROUTE).all()
    # The shared prefix holds one copy: the node's own rows, nothing per path.
    assert tree.nodes[mid].routing.shape == (len(tree.nodes[mid].token_ids), LAYERS, TOPK)
    # Routes live in memory only; the JSONL record round-trips without them.
    save_jsonl([tree], tmp_path / "t.jsonl")
    (back,) = load_jsonl(tmp_path / "t.jsonl")
    assert all(n.routing is None for n in back.nodes) and back.nodes[1].token_ids == tree.nodes[1].token_ids


def test_agent_loop_trees_hold_each_tokens_engine_routes():
    """Rollouts and continuations through the agent loop: every routed token of a path holds the
    experts a plain forward of the path picks; only the path's tail (never fed back) is unrouted."""
    from trace_mega.config import RolloutConfig
    from trace_mega.envs.synthetic import SyntheticToolsEnv
    from trace_mega.rollout.agent_loop import AgentLoop

    env = SyntheticToolsEnv(seed=0)
    tok = env.tokenizer
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        max_position_embeddings=256,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    rc = RolloutConfig(max_turns=4, max_new_tokens_per_turn=4, max_total_tokens=80)
    loop = AgentLoop(env, TorchEngine(model, capture_routing=True), tok, rc)
    trees = loop.rollout(env.tasks()[:2], [2, 2], seed=0)
    picks = [(i, n, 2) for i, t in enumerate(trees) for n in range(1, len(t.nodes)) if t.nodes[n].reward is None]
    loop.expand(trees, picks[:2], seed=1)
    packed = pack(trees)
    routes = packed_routes(trees, packed, LAYERS, TOPK)
    for g in packed.leaf_nodes.tolist():
        idx = packed.path_token_indices(g)
        routed = (routes[idx] != NO_ROUTE).all(-1).all(-1)
        n = int(routed.sum())
        # A routed prefix, then the unfed tail: inside the path's last turn (its last generated
        # token and what followed it, never fed back to the engine).
        size = lambda x: int(packed.node_end[x] - packed.node_start[x])  # noqa: E731
        last = size(g) or size(int(packed.node_parent[g]))  # an empty leaf: the turn before it
        assert routed[:n].all() and len(idx) - last <= n < len(idx)
        assert same_experts(routes[idx[:n]], hf_routes(model, packed.tokens[idx[:n]].tolist()))
