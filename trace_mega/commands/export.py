"""Trained policies as HF checkpoints: `trace-mega export` and `checkpoint.export_hf_at_end`.

An export directory holds what `transformers.AutoModelForCausalLM`,
`AutoTokenizer` and vLLM load: `model-0000X-of-0000Y.safetensors` with
`model.safetensors.index.json`, `config.json` (the source checkpoint's own
config when the run started from one, else the Qwen3 / Qwen3-MoE view of the
policy), the tokenizer files with its chat template, and
`generation_config.json` (the run's sampling temperature and top-p, its EOS).

`export_checkpoint` rebuilds the policy from a `dist_checkpointing` checkpoint
alone: the run's config is in the checkpoint's `trainer_state.json`, and only
the model weights are read, resharded by megatron from the saving run's
TP / EP layout to this process's (TP = EP = 1 unless launched under torchrun).
The vocabulary is padded as the saving run padded it, and cut back to the
true vocabulary in the export.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Optional

from trace_mega.config import ParallelConfig, TrainConfig, load_config, load_yaml
from trace_mega.learner.hf_files import policy_tokenizer, write_hf_extras

log = logging.getLogger("trace_mega")


def find_checkpoint(run: str | Path, step: Optional[int] = None) -> Path:
    """The checkpoint of `run` at `step` (default: the newest).

    `run` is a checkpoint root (`checkpoint.dir`: `latest`, `step_XXXXXXXX/`) or a run
    directory (`telemetry.out_dir`) whose `config.yaml` names the checkpoint root.
    """
    from trace_mega.learner.checkpoint import CheckpointError, checkpoint_name, latest_checkpoint, verify_checkpoint

    root = Path(run)
    if not (root / "latest").exists() and not any(root.glob("step_*")) and (root / "config.yaml").exists():
        ck = load_yaml(TrainConfig, root / "config.yaml").checkpoint.dir
        if ck is None:
            raise FileNotFoundError(f"{root}: the run wrote no checkpoints (checkpoint.dir is null)")
        root = Path(ck)
    if step is not None:
        path = root / checkpoint_name(step)
        if not (path / "trainer_state.json").exists():
            have = sorted(p.name for p in root.glob("step_*") if (p / "trainer_state.json").exists())
            raise FileNotFoundError(f"no complete checkpoint {path}; have: {', '.join(have) or 'none'}")
        problem = verify_checkpoint(path)
        if problem is not None:
            raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
        return path
    # The newest intact one: a damaged newer one is skipped with a warning (CheckpointError if none is).
    path = latest_checkpoint(root) if root.is_dir() else None
    if path is None:
        raise FileNotFoundError(f"no checkpoint under {root} (give a checkpoint.dir or a run dir with config.yaml)")
    return path


def export_checkpoint(run: str | Path, out_dir: str | Path, step: Optional[int] = None, device: str = "auto") -> Path:
    """Write the policy of `run`'s checkpoint (newest, or at `step`) as an HF checkpoint in `out_dir`."""
    from trace_mega.learner.checkpoint import load_model_weights, trainer_state
    from trace_mega.learner.convert import save_hf
    from trace_mega.learner.hf_files import policy_hf_config
    from trace_mega.learner.learner import resolve_model_config
    from trace_mega.learner.models import build_model
    from trace_mega.learner.parallel import destroy_parallel, init_parallel

    path = find_checkpoint(run, step)
    state = trainer_state(path)
    cfg = load_config(TrainConfig, state["config"])
    saved = cfg.parallel
    par = dataclasses.replace(ParallelConfig(), device=device, use_distributed_optimizer=False)
    g = init_parallel(par, seed=cfg.seed)
    try:
        if g.pp_size != 1:
            raise ValueError("export runs with PP = 1")
        model_cfg = resolve_model_config(cfg)
        net = build_model(model_cfg, par, g.pgs, g.device, 0, 1, vocab_multiple=saved.tensor_model_parallel_size).eval()
        load_model_weights(path, net)
        save_hf(net, g, out_dir, policy_hf_config(cfg, model_cfg))
        if g.rank == 0:
            write_hf_extras(out_dir, cfg, policy_tokenizer(cfg))
            (Path(out_dir) / "trace_mega_export.json").write_text(
                json.dumps(
                    {
                        "checkpoint": str(path.resolve()),
                        "step": state["step"],
                        "saved_layout": {
                            "tp": saved.tensor_model_parallel_size,
                            "ep": saved.expert_model_parallel_size,
                            "world_size": state["world_size"],
                        },
                    },
                    indent=1,
                )
            )
            log.info("exported %s (step %d) to %s", path, state["step"], out_dir)
    finally:
        destroy_parallel()
    return Path(out_dir)
