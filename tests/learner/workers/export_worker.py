"""torchrun worker: the learner's log-probs of a fixed packed tree at a run's newest checkpoint.

Usage: export_worker.py CHECKPOINT_DIR OUT.pt
Rebuilds the run's Learner (its config, its TP / EP layout) from the checkpoint,
restores it, and writes (rank 0) the packed tree's tokens, loss mask, each
leaf's stream indices and the learner's per-token log-probs.
"""

import sys

import torch

from trace_mega.commands.export import find_checkpoint
from trace_mega.config import TrainConfig, load_config
from trace_mega.learner.checkpoint import trainer_state
from trace_mega.learner.learner import Learner
from trace_mega.learner.parallel import destroy_parallel
from trace_mega.rollout.tree import Node, RolloutTree, pack


def main() -> None:
    ck, out = sys.argv[1], sys.argv[2]
    cfg = load_config(TrainConfig, trainer_state(find_checkpoint(ck))["config"])
    learner = Learner(cfg)
    assert learner.load_latest(ck) is not None
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, cfg.model.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    turn = lambda n: Node(0, ids(n), [1] * n, [0.0] * n)  # noqa: E731
    tree = RolloutTree("t", ids(7))
    mid = tree.add_node(0, turn(5))
    tree.add_path(mid, [turn(4)], reward=1.0)
    tree.add_path(mid, [turn(3)], reward=0.0)
    tree.add_path(0, [turn(6)], reward=1.0)
    packed = pack([tree])
    lp = learner.old_logprobs(packed)
    if learner.groups.rank == 0:
        torch.save(
            {
                "tokens": packed.tokens,
                "loss_mask": packed.loss_mask,
                "logprobs": lp,
                "paths": [packed.path_token_indices(int(n)) for n in packed.leaf_nodes],
            },
            out,
        )
    destroy_parallel()


if __name__ == "__main__":
    main()
