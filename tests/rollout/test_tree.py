"""RolloutTree operations, JSONL round trip, and the packed / flattened layouts."""

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_mega.rollout.tree import Node, RolloutTree, extend, load_jsonl, pack, save_jsonl


def turn(gen, obs=(), lp0=-0.5, kind="tool", **kw):
    """A turn node: generated tokens (loss 1, log-probs lp0, lp0-1, …) then observation tokens."""
    gen, obs = list(gen), list(obs)
    return Node(
        -1,
        gen + obs,
        [1] * len(gen) + [0] * len(obs),
        [lp0 - i for i in range(len(gen))] + [0.0] * len(obs),
        kind=kind,
        **kw,
    )


def hand_tree():
    """root(0) -> a(1) -> {b(2) -> leaf c(3) r=1, leaf d(4) r=1}, root -> e(5) -> {f(6) r=0, g(7) r=0}."""
    t = RolloutTree("p0", [1, 2, 3], prompt_text="hi", gold_answer="42")
    a = t.add_node(0, turn([10, 11], [12]))
    b = t.add_node(a, turn([20], [21, 22]))
    t.add_path(b, [turn([30], kind="final")], reward=1.0)
    t.add_path(a, [turn([40, 41], kind="final")], reward=1.0)
    e = t.add_node(0, turn([], []))  # a node with no tokens at all
    t.add_path(e, [turn([60], kind="final")], reward=0.0)
    t.add_path(
        e,
        [
            turn([70, 71], [72]),
        ],
        reward=0.0,
    )
    return t


def test_structure_queries_and_targets():
    t = hand_tree()
    assert t.leaves() == [3, 4, 6, 7]
    assert t.path(3) == [0, 1, 2, 3] and t.depth(3) == 3 and t.depth(0) == 0
    assert t.prefix_token_ids(2) == [1, 2, 3, 10, 11, 12, 20, 21, 22]
    count, total = t.descendant_stats()
    assert count == [4, 2, 1, 1, 1, 2, 1, 1] and total == [2.0, 2.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    t.validate()


def test_building_errors():
    t = hand_tree()
    with pytest.raises(ValueError, match="terminal"):
        t.add_node(3, turn([1]))
    with pytest.raises(IndexError):
        t.add_node(99, turn([1]))
    with pytest.raises(ValueError, match="at least one turn"):
        t.add_path(1, [], reward=1.0)
    with pytest.raises(ValueError, match="disagree"):
        Node(-1, [1, 2], [1], [0.0, 0.0])
    single = RolloutTree("p", [5])
    assert single.leaves() == [] and single.descendant_stats() == ([0], [0.0])
    t.nodes[7].reward = None
    with pytest.raises(ValueError, match="leaf 7"):
        t.descendant_stats()
    with pytest.raises(ValueError, match="leaf 7"):
        t.validate()


def test_jsonl_round_trip(tmp_path):
    t = hand_tree()
    t.nodes[3].info = {"finish_reason": "stop", "tool_calls": [{"name": "f", "arguments": {"x": [1, 2]}}]}
    t.nodes[1].logprobs = [-0.1234567890123, -1e-300, 0.0]  # full float precision must survive
    t.meta = {"env": "synthetic", "p": 0.3}
    other = RolloutTree("p1", [])
    path = tmp_path / "trees.jsonl"
    save_jsonl([t, other], path)
    back = load_jsonl(path)
    assert [b.to_dict() for b in back] == [t.to_dict(), other.to_dict()]
    assert back[0].descendant_stats() == t.descendant_stats()
    assert back[0].runtime == {}  # transient state is never serialised
    t.nodes[1].logprobs.pop()  # an inconsistent tree is refused before anything is written
    with pytest.raises(ValueError, match="node 1"):
        save_jsonl([t], tmp_path / "never.jsonl")
    assert not (tmp_path / "never.jsonl").exists()


def test_jsonl_bad_input(tmp_path):
    t = hand_tree()
    d = t.to_dict()
    d["nodes"][2]["parent"] = 5  # points at a node that does not list it
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(hand_tree().to_dict()) + "\n" + json.dumps(d) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_jsonl(path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1"):
        load_jsonl(path)


# --- random trees for the packing invariants ---------------------------------


def random_tree(rng: random.Random, name: str, max_nodes: int = 12) -> RolloutTree:
    t = RolloutTree(name, [rng.randrange(100) for _ in range(rng.randrange(0, 5))])
    open_nodes = [0]
    for _ in range(rng.randrange(1, max_nodes)):
        parent = rng.choice(open_nodes)
        n_gen, n_obs = rng.randrange(0, 4), rng.randrange(0, 3)
        node = turn(
            [rng.randrange(100) for _ in range(n_gen)], [rng.randrange(100) for _ in range(n_obs)], lp0=-rng.random()
        )
        nid = t.add_node(parent, node)
        open_nodes.append(nid)
    for nid in range(1, len(t)):
        if not t.nodes[nid].children:
            t.nodes[nid].reward = float(rng.random() < 0.5)
    return t


def brute_attend(tree_paths, i, j):
    """Token i may attend token j iff j lies on i's root-to-token path at or before i."""
    path = tree_paths[i]
    return j in path and path.index(j) <= path.index(i)


def check_pack(trees):
    p = pack(trees)
    T = p.num_tokens
    # each node's tokens stored once, contiguously, with the node's own data
    assert T == sum(len(n.token_ids) for t in trees for n in t.nodes)
    assert p.num_nodes == sum(len(t) for t in trees) and p.num_trees == len(trees)
    for g, (ti, lid) in enumerate(p.node_local):
        node = trees[ti].nodes[lid]
        s, e = int(p.node_start[g]), int(p.node_end[g])
        assert p.tokens[s:e].tolist() == node.token_ids
        assert p.loss_mask[s:e].tolist() == [bool(x) for x in node.loss_mask]
        assert torch.equal(p.behaviour_logprobs[s:e], torch.tensor(node.logprobs, dtype=torch.float32))
        assert (p.token_node[s:e] == g).all()
        assert int(p.node_tree[g]) == ti and int(p.node_depth[g]) == trees[ti].depth(lid)
        # descendants of g are exactly g+1 .. node_exit[g] (pre-order)
        desc = set()
        stack = list(trees[ti].nodes[lid].children)
        while stack:
            c = stack.pop()
            desc.add(c)
            stack += trees[ti].nodes[c].children
        off = int(p.tree_node_offset[ti])
        assert {p.node_local[x][1] for x in range(g + 1, int(p.node_exit[g]) + 1)} == desc
        assert all(p.node_local[x][0] == ti for x in range(g, int(p.node_exit[g]) + 1))
        assert off <= g < int(p.tree_node_offset[ti + 1])
        parent = trees[ti].nodes[lid].parent
        assert (int(p.node_parent[g]) == -1) == (parent == -1)
        if parent >= 0:
            assert p.node_local[int(p.node_parent[g])] == (ti, parent)
    # per-token path of stream indices, via the parent chain (brute force)
    paths = {}
    for g in range(p.num_nodes):
        chain = []
        x = g
        while x != -1:
            chain.append(x)
            x = int(p.node_parent[x])
        idx = [k for x in reversed(chain) for k in range(int(p.node_start[x]), int(p.node_end[x]))]
        for k in range(int(p.node_start[g]), int(p.node_end[g])):
            paths[k] = idx[: idx.index(k) + 1]
    assert torch.equal(p.token_node_exit, p.node_exit[p.token_node]) if T else True
    for i in range(T):
        assert int(p.position_ids[i]) == len(paths[i]) - 1
        assert int(p.prev_index[i]) == (paths[i][-2] if len(paths[i]) > 1 else -1)
        for j in range(T):
            rule = bool(p.token_node[j] <= p.token_node[i] <= p.token_node_exit[j]) and j <= i
            assert rule == brute_attend(paths, i, j), (i, j)
    # node_last_token vs a per-node walk up the parents
    last = p.node_last_token()
    for g in range(p.num_nodes):
        x, want = g, -1
        while x != -1:
            if p.node_end[x] > p.node_start[x]:
                want = int(p.node_end[x]) - 1
                break
            x = int(p.node_parent[x])
        assert int(last[g]) == want
    # leaves, descendant stats
    leaves = [(ti, lid) for ti, t in enumerate(trees) for lid in t.leaves()]
    assert sorted(p.node_local[int(g)] for g in p.leaf_nodes) == sorted(leaves)
    for g, (ti, lid) in enumerate(p.node_local):
        count, total = trees[ti].descendant_stats()
        assert int(p.node_leaf_count[g]) == count[lid] and float(p.node_reward_sum[g]) == total[lid]
    return p


def check_flatten(trees, p):
    """Flattened rows carry exactly the per-token data of the tree paths (built from the trees, not the pack)."""
    f = p.flatten()
    for row, g in enumerate(p.leaf_nodes.tolist()):
        ti, lid = p.node_local[g]
        t = trees[ti]
        path = t.path(lid)
        toks = [x for n in path for x in t.nodes[n].token_ids]
        mask = [bool(x) for n in path for x in t.nodes[n].loss_mask]
        lps = [x for n in path for x in t.nodes[n].logprobs]
        n = len(toks)
        assert int(f.lengths[row]) == n
        assert f.tokens[row, :n].tolist() == toks and (f.tokens[row, n:] == 0).all()
        assert f.loss_mask[row, :n].tolist() == mask and not f.loss_mask[row, n:].any()
        assert torch.equal(f.behaviour_logprobs[row, :n], torch.tensor(lps, dtype=torch.float32))
        assert f.position_ids[row, :n].tolist() == list(range(n))
        # packed_index maps each flat token back to the same data in the stream
        idx = f.packed_index[row, :n]
        assert (f.packed_index[row, n:] == -1).all()
        assert torch.equal(p.tokens[idx], f.tokens[row, :n])
        assert torch.equal(p.position_ids[idx], f.position_ids[row, :n])
        assert torch.equal(p.behaviour_logprobs[idx], f.behaviour_logprobs[row, :n])
    assert int(f.leaf_node.numel()) == p.leaf_nodes.numel()
    assert f.num_tokens == p.flattened_num_tokens()
    assert p.compression_ratio() == pytest.approx(f.num_tokens / max(1, p.num_tokens))


def test_pack_hand_tree():
    t = hand_tree()
    p = check_pack([t])
    check_flatten([t], p)
    # concrete layout: pre-order 0,1,2,3,4,5,6,7 (children in insertion order)
    assert p.node_exit.tolist() == [7, 4, 3, 3, 4, 7, 6, 7]
    assert p.node_start.tolist() == [0, 3, 6, 9, 10, 12, 12, 13]
    assert p.node_last_token().tolist() == [2, 5, 8, 9, 11, 2, 12, 15]
    # the empty node 5 hangs under the prompt: its children continue from the last prompt token
    assert p.prev_index[12].item() == 2 and p.position_ids[12].item() == 3


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3))
def test_pack_invariants_random(seed, num_trees):
    rng = random.Random(seed)
    trees = [random_tree(rng, f"t{k}") for k in range(num_trees)]
    p = check_pack(trees)
    check_flatten(trees, p)


def test_pack_edge_cases():
    p = pack([])
    assert p.num_tokens == 0 and p.num_nodes == 0 and p.num_trees == 0
    assert p.flatten().tokens.shape == (0, 0)
    root_only = RolloutTree("r", [4, 5])
    p = check_pack([root_only, hand_tree()])
    check_flatten([root_only, hand_tree()], p)
    assert p.leaf_nodes.numel() == 4  # the root-only tree contributes no trajectory
    moved = p.to("cpu")
    assert torch.equal(moved.tokens, p.tokens) and moved.node_local == p.node_local


def assert_same_layout(a, b):
    """Every field of two PackedTrees equal (tensors: same dtype and values)."""
    assert a.__dict__.keys() == b.__dict__.keys()
    for k, v in a.__dict__.items():
        w = b.__dict__[k]
        if isinstance(v, torch.Tensor):
            assert v.dtype == w.dtype and torch.equal(v, w), k
        else:
            assert v == w, k


def grow(rng: random.Random, trees, max_paths: int = 3) -> None:
    """Append continuations below random non-terminal nodes (what rollout / expand do)."""
    for t in trees:
        for _ in range(rng.randrange(0, max_paths + 1)):
            parent = rng.choice([i for i, n in enumerate(t.nodes) if n.reward is None])
            steps = [
                turn([rng.randrange(100) for _ in range(rng.randrange(0, 3))], [rng.randrange(100)] * rng.randrange(2))
                for _ in range(rng.randrange(1, 3))
            ]
            t.add_path(parent, steps, float(rng.random() < 0.5))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 3))
def test_extend_equals_a_fresh_pack(seed, num_trees):
    rng = random.Random(seed)
    trees = [
        random_tree(rng, f"t{k}") if rng.random() < 0.7 else RolloutTree(f"r{k}", [1, 2]) for k in range(num_trees)
    ]
    p = pack(trees)
    grow(rng, trees)
    grown = extend(p, trees)
    assert_same_layout(grown, pack(trees))
    grow(rng, trees)  # extended twice: roots -> bare rollouts -> continuations
    assert_same_layout(extend(grown, trees), pack(trees))


def test_extend_rejects_trees_that_did_not_only_grow():
    t = hand_tree()
    p = pack([t])
    with pytest.raises(ValueError, match="holds 1 trees, got 2"):
        extend(p, [t, hand_tree()])
    other = RolloutTree("p0", [1, 2])  # a different prompt length at node 0
    with pytest.raises(ValueError, match="with nodes appended"):
        extend(p, [other])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 4))
def test_select_equals_the_pack_of_the_subset(seed, num_trees):
    rng = random.Random(seed)
    trees = [random_tree(rng, f"t{k}") for k in range(num_trees)]
    p = pack(trees)
    keep = [i for i in range(num_trees) if rng.random() < 0.6]
    rng.shuffle(keep)
    sub = pack([trees[i] for i in keep])
    assert_same_layout(p.select(keep), sub)
    assert torch.equal(p.tokens[p.tree_tokens(keep)], sub.tokens)
    assert torch.equal(p.behaviour_logprobs[p.tree_tokens(keep)], sub.behaviour_logprobs)


def realistic_tree(
    rng: random.Random, name: str, bare: int, branches: int, turns: int, prompt_len: int, gen_len: int, obs_len: int
) -> RolloutTree:
    """`bare` rollouts of `turns` turns, each branched `branches` times at a uniformly chosen intermediate turn."""

    def episode(parent: int, first_turn: int) -> None:
        nid = parent
        for k in range(first_turn, turns + 1):
            final = k == turns
            g = max(1, int(rng.gauss(gen_len, gen_len / 4)))
            o = 0 if final else max(1, int(rng.gauss(obs_len, obs_len / 4)))
            node = turn([7] * g, [9] * o, kind="final" if final else "tool")
            if final:
                node.reward = float(rng.random() < 0.5)
            nid = t.add_node(nid, node)

    t = RolloutTree(name, [1] * prompt_len)
    for _ in range(bare):
        episode(0, 1)
        path = t.path(len(t) - 1)
        for _ in range(branches):
            at = rng.randrange(1, turns)  # branch after turn `at` (1..turns-1)
            episode(path[at], at + 1)
    return t


def test_compression_ratio_realistic_batch():
    """8 prompts x (8 bare rollouts x 4 branches) of 6-turn episodes; Qwen-scale turn lengths.

    Prompt 400 tokens (system + tool schemas + question), 120 generated and
    300 observation tokens per turn (multi-hop QA scale). Prints the ratio
    reported in docs/results/rollout.md ("Compression ratio").
    """
    rng = random.Random(0)
    trees = [
        realistic_tree(rng, f"q{i}", bare=8, branches=4, turns=6, prompt_len=400, gen_len=120, obs_len=300)
        for i in range(8)
    ]
    p = pack(trees)
    brute = sum(len(t.prefix_token_ids(leaf)) for t in trees for leaf in t.leaves())
    assert p.flattened_num_tokens() == brute
    ratio = p.compression_ratio()
    print(
        f"\nrealistic batch: {p.leaf_nodes.numel()} trajectories, packed {p.num_tokens} tokens, "
        f"flattened {brute} tokens, compression {ratio:.2f}x"
    )
    assert 2.0 < ratio < 3.0  # branches share on average half of a trajectory plus the prompt
