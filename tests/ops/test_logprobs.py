"""packed_token_logprobs / flat_token_logprobs against the materialised log-softmax."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trace_mega.kernels.token_logprobs_ref import token_logprobs_reference
from trace_mega.ops.logprobs import flat_token_logprobs, packed_token_logprobs
from trace_mega.rollout.tree import Node, RolloutTree, pack

V, H = 37, 16


def _trees():
    g = torch.Generator().manual_seed(0)

    def node(n, gen=True):
        ids = torch.randint(0, V, (n,), generator=g).tolist()
        return Node(0, ids, [int(gen)] * n, [0.0] * n)

    a = RolloutTree("a", [1, 2, 3])
    x = a.add_node(0, node(3))
    a.add_path(x, [node(2)], 1.0)
    a.add_path(x, [node(4), node(2, gen=False), node(1)], 0.0)
    a.add_path(0, [node(3)], 0.0)
    b = RolloutTree("b", [4, 5])
    b.add_path(0, [node(2), node(3)], 1.0)
    return [a, b]


def _expected(hidden, weight, p, with_entropy):
    """Loop over stream tokens: log_softmax(W h[prev]) at the token, 0 off the loss mask."""
    lp = torch.zeros(p.num_tokens)
    ent = torch.zeros(p.num_tokens)
    for i in range(p.num_tokens):
        j = int(p.prev_index[i])
        if p.loss_mask[i] and j >= 0:
            r = token_logprobs_reference(hidden[j : j + 1], weight, p.tokens[i : i + 1], with_entropy=True)
            lp[i], ent[i] = r[0][0], r[1][0]
    return (lp, ent) if with_entropy else lp


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_logprobs_and_grads_match_reference(backend):
    p = pack(_trees())
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(p.num_tokens, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    lp, ent = packed_token_logprobs(hidden, weight, p, with_entropy=True, backend=backend)
    elp, eent = _expected(hidden, weight, p, True)
    assert torch.allclose(lp, elp, atol=1e-5) and torch.allclose(ent, eent, atol=1e-5)
    assert (lp[~p.loss_mask] == 0).all()
    coef = torch.linspace(0.5, 1.5, p.num_tokens)
    gh, gw = torch.autograd.grad((coef * (lp + 0.1 * ent)).sum(), (hidden, weight))
    eh, ew = torch.autograd.grad((coef * (elp + 0.1 * eent)).sum(), (hidden, weight))
    assert torch.allclose(gh, eh, atol=1e-5) and torch.allclose(gw, ew, atol=1e-5)
    # a branch point's last token predicts the first token of each child: its row gets both gradients
    x_last = int(p.node_end[1]) - 1
    assert (p.prev_index == x_last).sum() == 2 and gh[x_last].abs().sum() > 0


def test_custom_mask_and_temperature():
    p = pack(_trees())
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(p.num_tokens, H, generator=g), torch.randn(V, H, generator=g)
    mask = torch.ones(p.num_tokens, dtype=torch.bool)  # every token with a predecessor
    lp = packed_token_logprobs(hidden, weight, p, mask=mask, temperature=0.7)
    for i in (1, 5, p.num_tokens - 1):
        j = int(p.prev_index[i])
        ref = token_logprobs_reference(hidden[j : j + 1], weight, p.tokens[i : i + 1], temperature=0.7)
        assert torch.allclose(lp[i], ref[0], atol=1e-5)
    starts = p.prev_index < 0
    assert (lp[starts] == 0).all()  # a tree's first token has no predicting position


def test_flat_logprobs_equal_packed_on_the_same_hidden_states():
    p = pack(_trees())
    f = p.flatten()
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(p.num_tokens, H, generator=g), torch.randn(V, H, generator=g)
    # a tree-correct model gives each path's token the same hidden state in both layouts
    flat_hidden = hidden[f.packed_index.clamp(min=0)]  # (L, S, H)
    lp = packed_token_logprobs(hidden, weight, p)
    flp = flat_token_logprobs(flat_hidden, weight, f)
    assert torch.allclose(flp, torch.where(f.loss_mask, lp[f.packed_index.clamp(min=0)], 0.0), atol=1e-6)


def _tp_worker(rank, world, port, hidden, weight, p, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    shard = V // world + 1  # uneven split: the last rank holds fewer rows
    start = rank * shard
    w = weight[start : start + shard].clone().requires_grad_(True)
    h = hidden.clone().requires_grad_(True)
    lp, ent = packed_token_logprobs(h, w, p, tp_group=dist.group.WORLD, vocab_start=start, with_entropy=True)
    (lp.sum() + 0.5 * ent.sum()).backward()
    torch.save(
        {"lp": lp.detach(), "ent": ent.detach(), "gh": h.grad, "gw": w.grad, "start": start},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    dist.destroy_process_group()


def test_vocab_parallel_two_ranks_match_the_full_vocabulary(tmp_path):
    import socket

    p = pack(_trees())
    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(p.num_tokens, H, generator=g), torch.randn(V, H, generator=g)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork: the workers inherit the imported modules (spawn would re-import torch and triton)
    mp.start_processes(
        _tp_worker, args=(2, port, hidden, weight, p, str(tmp_path)), nprocs=2, join=True, start_method="fork"
    )
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    lp, ent = packed_token_logprobs(h, w, p, with_entropy=True)
    (lp.sum() + 0.5 * ent.sum()).backward()
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.allclose(r["lp"], lp, atol=1e-5) and torch.allclose(r["ent"], ent, atol=1e-5)
        assert torch.allclose(r["gh"], h.grad, atol=1e-5)  # dhidden all-reduced over the shards
        n = r["gw"].shape[0]
        assert torch.allclose(r["gw"], w.grad[r["start"] : r["start"] + n], atol=1e-5)
