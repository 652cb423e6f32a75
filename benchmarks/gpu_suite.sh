#!/usr/bin/env bash
# GPU suite: every GPU test (`pytest -m gpu`) and every kernel benchmark
# (benchmarks/bench_*.py, whatever exists, each with `--json PATH`), each under its own
# time limit, the whole run under SUITE_BUDGET_S (default 470 s < 8 min). Results go to
# $OUT if set, else bench_results/gpu/: pytest_gpu.xml + .log, bench_<name>.json + .log,
# and summary.json (one entry per step: status ok|fail|timeout|skipped, rc, seconds).
# Exit status: 0 when every step is ok (or when skipped for lack of a GPU), else 1.
#
# Without a CUDA GPU it prints why and exits 0 (nothing run). `--dry-run` (works on
# CPU) instead lists the plan, collects the GPU tests and checks that every benchmark
# starts (`--help`), without running anything heavy.
#
#   bash benchmarks/gpu_suite.sh            # on a GPU machine
#   bash benchmarks/gpu_suite.sh --dry-run  # anywhere
set -u
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT_DIR=${OUT:-$ROOT/bench_results/gpu}
mkdir -p "$OUT_DIR"
BUDGET=${SUITE_BUDGET_S:-470}
PYTEST_LIMIT=${PYTEST_LIMIT_S:-170}
BENCH_LIMIT=${BENCH_LIMIT_S:-90}
START=$(date +%s)
STEPS="$OUT_DIR/.steps.jsonl"
: > "$STEPS"

# A python with torch: $PYTHON, then the repo venv, then python3 / python. On a GPU
# machine prefer one whose torch sees CUDA.
pick_python() {
  local c first=""
  for c in "${PYTHON:-}" "$ROOT/.venv/bin/python" python3 python; do
    [ -n "$c" ] || continue
    command -v "$c" >/dev/null 2>&1 || [ -x "$c" ] || continue
    "$c" -c "import torch" >/dev/null 2>&1 || continue
    [ -n "$first" ] || first=$c
    if "$c" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
      echo "$c"; return 0
    fi
  done
  [ -n "$first" ] && echo "$first" && return 1
  return 2
}
PY=$(pick_python); HAVE_GPU=$?
if [ $HAVE_GPU -eq 2 ]; then
  echo "gpu_suite: no python with torch found; nothing to run."
  exit 0
fi
if [ $HAVE_GPU -ne 0 ] && [ $DRY -eq 0 ]; then
  echo "gpu_suite: no CUDA GPU visible (torch.cuda.is_available() is False for $PY) -- skipping; nothing run."
  echo '{"status": "skipped", "reason": "no CUDA GPU"}' > "$OUT_DIR/summary.json"
  exit 0
fi
echo "gpu_suite: python=$PY out=$OUT_DIR budget=${BUDGET}s dry_run=$DRY"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"

# The package (kernels included) imports from the checkout itself; no install needed.
if ! "$PY" -c "import trace_mega.kernels.token_logprobs" >/dev/null 2>&1; then
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" -c "import trace_mega.kernels.token_logprobs" >/dev/null 2>&1 \
    || echo "gpu_suite: trace_mega.kernels does not import from $ROOT; steps will fail"
fi

remaining() { echo $(( BUDGET - ($(date +%s) - START) )); }

# run_step NAME LIMIT_S ARTIFACT CMD... : run with a time limit, record one summary line
run_step() {
  local name=$1 limit=$2 artifact=$3; shift 3
  local left; left=$(remaining)
  if [ "$left" -lt 15 ]; then
    echo "[$name] skipped: suite budget spent"
    printf '{"step": "%s", "status": "skipped", "rc": null, "seconds": 0, "artifact": "%s"}\n' \
      "$name" "$artifact" >> "$STEPS"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "[$name] (limit ${limit}s) $*"
  local t0 rc status; t0=$(date +%s)
  timeout --signal=TERM --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status=timeout ;;
    5) status=ok ;;  # pytest: no tests collected
    *) status=fail ;;
  esac
  local dt=$(( $(date +%s) - t0 ))
  tail -n 3 "$OUT_DIR/$name.log" | sed "s/^/  [$name] /"
  echo "[$name] $status rc=$rc ${dt}s"
  printf '{"step": "%s", "status": "%s", "rc": %d, "seconds": %d, "artifact": "%s"}\n' \
    "$name" "$status" "$rc" "$dt" "$artifact" >> "$STEPS"
}

# bench_trainer.py times the CPU demo config end to end (tiny model, CPU device): not a GPU measurement;
# bench_grad_noise.py trains the CPU demo for half an hour; bench_prompt_selection.py and
# bench_learning_per_trajectory.py read finished demo runs: measurements of the method, not of the device.
BENCHES=$(ls "$ROOT"/benchmarks/bench_*.py 2>/dev/null \
  | grep -v '/bench_trainer\.py$\|/bench_grad_noise\.py$\|/bench_prompt_selection\.py$\|/bench_learning_per_trajectory\.py$' \
  | sort)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
if [ $DRY -eq 1 ]; then
  export TRITON_INTERPRET=1
  run_step pytest_gpu_collect 120 "pytest_gpu_collect.log" \
    "$PY" -m pytest -m gpu --collect-only -q -p no:cacheprovider "$ROOT/tests"
  for b in $BENCHES; do
    n=$(basename "$b" .py)
    run_step "${n}_help" 60 "${n}_help.log" "$PY" "$b" --help
  done
  run_step sweep_help 60 "sweep_help.log" "$PY" -m trace_mega sweep --help
else
  run_step pytest_gpu "$PYTEST_LIMIT" "pytest_gpu.xml" \
    "$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT_DIR/pytest_gpu.xml" "$ROOT/tests"
  n_left=$(echo "$BENCHES" | wc -w)
  for b in $BENCHES; do
    n=$(basename "$b" .py)
    # fair share of what is left, capped at BENCH_LIMIT
    share=$(( $(remaining) / (n_left > 0 ? n_left : 1) ))
    lim=$BENCH_LIMIT; [ "$share" -lt "$lim" ] && lim=$share
    run_step "$n" "$lim" "$n.json" "$PY" "$b" --json "$OUT_DIR/$n.json"
    n_left=$(( n_left - 1 ))
  done
  # The sweep command on the GPU: the demo's tiny model on the device against its CPU run
  # (step time by phase, tokens/s per GPU, peak memory, mismatch): docs/learner.md "Scaling sweeps".
  run_step sweep_demo "$BENCH_LIMIT" "sweep/sweep.json" "$PY" -m trace_mega sweep --config demo_cpu --steps 3 \
    --out "$OUT_DIR/sweep" parallel.device=cpu,cuda allocation.prompts_per_step=8 telemetry.progress_bars=false
  # MoE routing replay on the device: the MoE demo (random init, engine bf16 with its fp32 head, learner fp32) with the
  # replay probe, so `moe/own_routing_k3` beside `mismatch/k3` gives replay's cut on CUDA kernels'
  # routing flips (docs/learner.md "MoE routing replay").
  run_step sweep_moe_probe "$BENCH_LIMIT" "sweep_moe/sweep.json" "$PY" -m trace_mega sweep --config demo_moe_cpu \
    --steps 6 --out "$OUT_DIR/sweep_moe" parallel.device=cuda model.moe_replay_probe=true \
    allocation.prompts_per_step=8 eval.every_steps=0 telemetry.progress_bars=false
fi

"$PY" - "$STEPS" "$OUT_DIR/summary.json" "$DRY" "$(( $(date +%s) - START ))" <<'EOF'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
summary = {"dry_run": sys.argv[3] == "1", "total_seconds": int(sys.argv[4]), "steps": steps,
           "all_ok": all(s["status"] == "ok" for s in steps)}
json.dump(summary, open(sys.argv[2], "w"), indent=1)
print(f"{'step':40s} {'status':8s} {'seconds':>7s}")
for s in steps:
    print(f"{s['step']:40s} {s['status']:8s} {s['seconds']:7d}")
print(f"gpu_suite: {'all ok' if summary['all_ok'] else 'SOME STEPS FAILED'}; wrote {sys.argv[2]}")
sys.exit(0 if summary["all_ok"] else 1)
EOF
rc=$?
rm -f "$STEPS"
exit $rc
