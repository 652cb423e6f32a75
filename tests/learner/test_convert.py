"""HF <-> Megatron-Core conversion: log-prob parity with transformers and exact export (TP=1, TP=2/EP=2).

Qwen3 (dense), Qwen3-MoE, Qwen2 (QKV bias), Llama and a GeGLU Llama (hidden_act gelu), random init, fp32, on a plain
batch and on a packed tree (checked against each root-to-leaf path run alone).
"""

import pytest
import torch
from safetensors.torch import load_file
from workers.common import packed_tree, path_indices, save_tiny_hf, torchrun, tree_paths

from trace_mega.learner.convert import HFCheckpoint

pytestmark = pytest.mark.slow
KINDS = ("dense", "moe", "qwen2", "llama", "llama_gelu")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Tiny random Qwen3 + Qwen3-MoE saved to disk, shared inputs, and transformers' reference log-probs."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("convert")
    dirs = {k: save_tiny_hf(k, root / f"hf_{k}", seed=i) for i, k in enumerate(KINDS)}
    tree = packed_tree(seed=1)
    causal_ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    causal = {"input_ids": causal_ids, "position_ids": torch.arange(16).expand(2, 16)}
    torch.save({"tree": tree, "causal": causal}, root / "inputs.pt")
    ref = {}
    for kind, d in dirs.items():
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            causal_lp = hf(input_ids=causal_ids).logits.log_softmax(-1)
            # Tree reference: every root-to-leaf path run on its own as a plain sequence.
            tree_lp = torch.zeros(tree["input_ids"].shape[1], 128)
            for path in tree_paths():
                idx = path_indices(tree, path)
                tree_lp[idx] = hf(input_ids=tree["input_ids"][:, idx]).logits[0].log_softmax(-1)
        ref[kind] = {"causal": causal_lp, "tree": tree_lp[None]}
    return root, dirs, ref


def _run(root, dirs, tp, ep, tag):
    out = root / tag
    out.mkdir()
    models = [f"{k}={d}" for k, d in dirs.items()]
    torchrun(
        "parity_worker.py",
        tp,
        ["--tp", str(tp), "--ep", str(ep), "--inputs", str(root / "inputs.pt"), "--out", str(out), *models],
    )
    return out


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 2)], ids=["tp1", "tp2_ep2"])
def test_parity_and_export(setup, tp, ep):
    root, dirs, ref = setup
    out = _run(root, dirs, tp, ep, f"tp{tp}_ep{ep}")
    for kind in KINDS:
        got = torch.load(out / f"{kind}_logp.pt")
        assert got["head_diff"] <= 1e-5, f"{kind}: hidden @ output_weight != logits ({got['head_diff']:.2e})"
        for layout in ("causal", "tree"):
            diff = (got[layout] - ref[kind][layout]).abs().max().item()
            assert diff <= 1e-4, f"{kind} {layout} TP={tp}: max |dlogp| = {diff:.2e}"
        original = load_file(dirs[kind] / "model.safetensors")
        exported = HFCheckpoint(out / f"{kind}_export")
        assert exported.names() == sorted(original), f"{kind}: exported names differ"
        for name, tensor in original.items():
            assert torch.equal(exported.get(name), tensor), f"{kind}: {name} differs after export"
