"""torchrun worker: load tiny HF checkpoints into TreeGPTModel, write log-probs and an HF export.

Usage: parity_worker.py --tp N --ep N --inputs inputs.pt --out DIR KIND=HF_DIR [KIND=HF_DIR ...]
Writes (rank 0) DIR/<kind>_logp.pt {"tree": (1, T, V), "causal": (B, S, V)} log-softmax rows
and "head_diff" (max |hidden @ output_weight.T - vocab-parallel logits| over ranks),
and DIR/<kind>_export/ (save_hf).
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig

from trace_mega.config import ParallelConfig
from trace_mega.learner.convert import load_hf_into, save_hf
from trace_mega.learner.models import build_model, forward_packed, model_config_from_hf, output_weight
from trace_mega.learner.parallel import destroy_parallel, init_parallel
from trace_mega.ops.attention import tree_attention_mask


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("models", nargs="+")
    a = ap.parse_args()
    par = ParallelConfig(device="cpu", tensor_model_parallel_size=a.tp, expert_model_parallel_size=a.ep)
    g = init_parallel(par, seed=0)
    inputs = torch.load(a.inputs)
    tree, causal = inputs["tree"], inputs["causal"]
    for item in a.models:
        kind, hf_dir = item.split("=", 1)
        hf_config = AutoConfig.from_pretrained(hf_dir)
        mc = model_config_from_hf(hf_config, attention_backend="sdpa")
        net = build_model(mc, par, g.pgs, g.device, g.pp_rank, g.pp_size).eval()
        load_hf_into(net, hf_dir, g)
        with torch.no_grad():
            mask = tree_attention_mask(tree["token_node"], tree["token_node_exit"])
            tree_lp = forward_packed(net, tree["input_ids"], tree["position_ids"], mask, "full_logits").log_softmax(-1)
            causal_lp = forward_packed(
                net, causal["input_ids"], causal["position_ids"], None, "full_logits"
            ).log_softmax(-1)
            # The split LM head: hidden states x this rank's vocab-parallel weight == this rank's logits.
            hidden = forward_packed(net, tree["input_ids"], tree["position_ids"], mask, "hidden")
            shard = forward_packed(net, tree["input_ids"], tree["position_ids"], mask, "logits")
            head_diff = (hidden @ output_weight(net).t() - shard).abs().max()
            torch.distributed.all_reduce(head_diff, op=torch.distributed.ReduceOp.MAX)
        if g.rank == 0:
            torch.save({"tree": tree_lp, "causal": causal_lp, "head_diff": head_diff}, Path(a.out) / f"{kind}_logp.pt")
        save_hf(net, g, Path(a.out) / f"{kind}_export", hf_config)
    destroy_parallel()


if __name__ == "__main__":
    main()
