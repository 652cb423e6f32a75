"""torchrun worker: one `Learner.train_step` on fixed rollout trees; rank 0 writes its metrics as JSON.

argv: HF_DIR OUT_JSON TP SEQUENCE_PARALLEL(0|1)
"""

import dataclasses
import json
import sys

import torch

from trace_mega.config import AdvantageConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from trace_mega.learner.learner import Learner
from trace_mega.learner.parallel import destroy_parallel
from trace_mega.objective.advantages import compute_advantages
from trace_mega.rollout.tree import Node, RolloutTree, pack


def trees(vocab: int) -> list[RolloutTree]:
    g = torch.Generator().manual_seed(0)
    tok = lambda n: torch.randint(1, vocab, (n,), generator=g).tolist()  # noqa: E731
    turn = lambda gen, obs: Node(0, tok(gen + obs), [1] * gen + [0] * obs, [-1.0] * gen + [0.0] * obs)  # noqa: E731
    out = []
    for i in range(3):
        t = RolloutTree(f"p{i}", tok(5 + i))
        a = t.add_node(0, turn(3, 2))
        t.add_path(a, [turn(2, 3), turn(4, 0)], 1.0)
        t.add_path(a, [turn(3, 0)], 0.0)
        t.add_path(0, [turn(2, 1), turn(1, 0)], float(i % 2))
        out.append(t)
    return out


def update_of(batch: list[RolloutTree]):
    """(layout, tree advantages) of `batch`: what the trainer hands `Learner.train_step`."""
    packed = pack(batch)
    return packed, compute_advantages(packed, batch, AdvantageConfig(name="tree"))


def main() -> None:
    hf_dir, out_json, tp, sp = sys.argv[1], sys.argv[2], int(sys.argv[3]), bool(int(sys.argv[4]))
    cfg = TrainConfig(
        model=ModelConfig(hf_checkpoint=hf_dir),
        parallel=ParallelConfig(device="cpu", tensor_model_parallel_size=tp, sequence_parallel=sp),
        optim=OptimConfig(lr=1e-2, clip_grad_norm=0.0),
    )
    learner = Learner(cfg)
    batch = trees(learner.model_cfg.vocab_size)
    steps = []
    for i in range(2):  # the second step sees the weights the first one wrote
        steps.append(learner.train_step(*update_of(batch)).metrics)
    hidden = learner.hidden_states(pack(batch))
    # One forward per tree (a 1-token budget) must give the same hidden states as one for all.
    learner.cfg = dataclasses.replace(
        learner.cfg, parallel=dataclasses.replace(learner.cfg.parallel, micro_batch_tokens=1)
    )
    chunk_diff = float((learner.hidden_states(pack(batch)) - hidden).abs().max())
    # The next step's training forward runs under these weights: the hidden states it leaves for the
    # predictor are the same (one micro-batch per tree here).
    third = learner.train_step(*update_of(batch))
    train_hidden_diff = float((third.hidden - hidden).abs().max())
    if learner.groups.rank == 0:
        with open(out_json, "w") as f:
            json.dump(
                {
                    "steps": steps,
                    "hidden_sum": float(hidden.double().sum()),
                    "hidden_abs": float(hidden.double().abs().sum()),
                    "chunk_diff": chunk_diff,
                    "train_hidden_diff": train_hidden_diff,
                },
                f,
            )
    destroy_parallel()  # a live process group at interpreter exit can abort the process


if __name__ == "__main__":
    main()
