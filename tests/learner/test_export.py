"""`trace-mega export` and `checkpoint.export_hf_at_end` from TP = 2 runs (dense; MoE with EP = 2,
sequence parallel and a vocabulary padded for TP): the exported checkpoints load with
transformers and give the learner's log-probs.

Each case is a real torchrun/gloo `trace-mega train` run that checkpoints and exports at the
end; `trace-mega export` then rebuilds the policy at TP = EP = 1 from the checkpoint alone
(megatron reshards it), and a TP = 2 worker computes the learner's log-probs of a packed
tree at the same checkpoint.
"""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from workers.common import ROOT, free_port, torchrun

pytestmark = pytest.mark.slow
SMALL = [
    "allocation.prompts_per_step=8",
    "allocation.root_rollouts_per_step=12",
    "rollout.max_turns=4",
    "telemetry.tensorboard=false",
    "telemetry.progress_bars=false",
]
CASES = {
    "dense": [],
    # 39 tokens: padded to 40 at TP = 2; the export cuts the padding row off again.
    "moe": [
        "model.num_experts=4",
        "model.moe_router_topk=2",
        "model.moe_ffn_hidden_size=32",
        "model.vocab_size=39",
        "parallel.expert_model_parallel_size=2",
        "parallel.sequence_parallel=true",
    ],
}


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    return env


def _cli(*args, nproc=1, timeout=300):
    launcher = (
        [sys.executable]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-port",
            str(free_port()),
        ]
    )
    proc = subprocess.run(
        [*launcher, "-m", "trace_mega", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


def _tensors(hf_dir):
    out = {}
    for f in sorted(hf_dir.glob("model-*.safetensors")):
        out |= load_file(f)
    return out


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    run, ck = tmp / "run", tmp / "ck"
    _cli(
        "train",
        "--config",
        "demo_cpu",
        *SMALL,
        "steps=1",
        "parallel.tensor_model_parallel_size=2",
        f"telemetry.out_dir={run}",
        f"checkpoint.dir={ck}",
        "checkpoint.every_steps=1",
        "checkpoint.export_hf_at_end=true",
        *CASES[request.param],
        nproc=2,
    )
    _cli("export", "--run", str(run), "--out", str(tmp / "hf_cli"))  # finds the checkpoint through run/config.yaml
    torchrun("export_worker.py", 2, [str(ck), str(tmp / "learner.pt")])
    return request.param, tmp


def test_export_files_and_both_exports_agree(exported):
    kind, tmp = exported
    cli, end = tmp / "hf_cli", tmp / "run" / "hf"
    for d in (cli, end):
        for name in (
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "model.safetensors.index.json",
            "chat_template.jinja",
        ):
            assert (d / name).exists(), (d, name)
    a, b = _tensors(cli), _tensors(end)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[n], b[n]) for n in a)  # TP=1 resharded load == TP=2 gather
    vocab = 39 if kind == "moe" else 38
    assert a["model.embed_tokens.weight"].shape[0] == vocab
    if kind == "moe":
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in a and "model.layers.1.mlp.gate.weight" in a


def test_exported_checkpoint_gives_the_learners_logprobs(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    kind, tmp = exported
    ref = torch.load(tmp / "learner.pt")
    for hf_dir in (tmp / "hf_cli", tmp / "run" / "hf"):
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        assert type(model).__name__ == ("Qwen3MoeForCausalLM" if kind == "moe" else "Qwen3ForCausalLM")
        tok = AutoTokenizer.from_pretrained(hf_dir)
        assert tok.eos_token_id == model.config.eos_token_id == GenerationConfig.from_pretrained(hf_dir).eos_token_id
        worst, checked = 0.0, 0
        with torch.no_grad():
            for idx in ref["paths"]:
                ids = ref["tokens"][idx]
                hf_lp = model(input_ids=ids[None]).logits[0].log_softmax(-1)  # (S, V)
                mine = ref["logprobs"][idx]
                for j in range(1, len(idx)):
                    if ref["loss_mask"][idx[j]]:
                        worst = max(worst, abs(float(hf_lp[j - 1, ids[j]] - mine[j])))
                        checked += 1
        assert checked >= 18 and worst <= 1e-4, f"{kind} {hf_dir.name}: max |dlogp| = {worst:.2e}"
