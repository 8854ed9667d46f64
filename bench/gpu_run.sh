#!/bin/bash
# Issue 25's GPU run, one command on the GPU machine (../shared/gpu/README.md), after `bash .gpu/a/install.sh`
# in the call before (the CUDA provider, carried as .gpu/a) and with .gpu/b carried in this one:
#
#     bash bench/gpu_run.sh              # logs and JSON under $OUT
#
# From a session here: `bash ../shared/gpu/prepare.sh` once (writes .gpu/a and .gpu/b, ignored by git), then two
# device calls back to back: `bash .gpu/a/install.sh` carrying .gpu/a, and `bash bench/gpu_run.sh` carrying .gpu/b
# (timeout_s 600: one device call may run 10 minutes). The tables to copy are at the end of step.log (markdown) and in forms.log.
#
# Parts, each under `timeout` and all within TOTAL_S seconds (default 550: a device call's 600 s, less margin):
#   0. bench/gpu_correctness.py, when it exists (issue 24's checks), capped at CORRECTNESS_S (240);
#   0b. tests/test_cuda.py five times over (issue 35: the CUDA tests pass 5 runs of 5), TESTS_S (60);
#   1. bench/bench_step_cuda.py: every model's step against PyTorch eager / torch.compile, STEP_S (180);
#   2. bench/bench_rewrites_cuda.py: the gradient forms per shape, FORMS_S (80);
#   3. bench/bench_rewrites_cuda.py --only-profile: where ResNet-18's step spends its time, PROFILE_S (50).
# Each part prints its elapsed time; a part cut by its cap keeps the rows it printed. STEP_ARGS and FORMS_ARGS
# add options to parts 1 and 2 (e.g. STEP_ARGS="--ort-option cudnn_conv_algo_search=HEURISTIC").
# `bash bench/gpu_run.sh --smoke` runs the same parts with tiny shapes on the CPU (no .gpu, any machine).
set -u
cd "$(dirname "$0")/.."
SMOKE=""
[[ "${1:-}" == "--smoke" ]] && SMOKE="--smoke"
OUT=${OUT:-/tmp/gpu_run_out}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-550}
CORRECTNESS_S=${CORRECTNESS_S:-240}
STEP_S=${STEP_S:-180}
FORMS_S=${FORMS_S:-80}
PROFILE_S=${PROFILE_S:-50}
TESTS_S=${TESTS_S:-60}
START=$SECONDS

if [[ -z "$SMOKE" ]]; then
  if [[ ! -f .gpu/b/env.sh ]]; then
    echo "error: no .gpu/b/env.sh: run bash ../shared/gpu/prepare.sh on the development machine and carry .gpu/b"
    exit 3
  fi
  # shellcheck disable=SC1091
  source .gpu/b/env.sh || exit 3       # onnxruntime-gpu and this checkout on PYTHONPATH; 3: run .gpu/a/install.sh
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

# run NAME CAP COMMAND...: COMMAND under `timeout` (CAP, or what is left of TOTAL_S when less), tee'd to $OUT/NAME.log
run() {
  local name=$1 cap=$2
  shift 2
  local left=$((TOTAL_S - (SECONDS - START)))
  (( cap > left )) && cap=$left
  if (( cap < 10 )); then
    echo "== $name: skipped, a cap of ${cap}s (${left}s of the ${TOTAL_S}s budget left)" | tee "$OUT/$name.log"
    return
  fi
  echo "== $name (cap ${cap}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$cap" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  local note=""
  (( rc == 124 || rc == 137 )) && note=", cut at its cap"
  echo "== $name: exit $rc$note, $((SECONDS - t0))s (total $((SECONDS - START))s)" | tee -a "$OUT/$name.log"
}

if [[ -f bench/gpu_correctness.py ]]; then
  run correctness "$CORRECTNESS_S" "$PYTHON" bench/gpu_correctness.py $SMOKE
fi
# five runs of the CUDA tests (skipped in --smoke: they skip without a GPU)
if [[ -z "$SMOKE" ]]; then
  run cuda_tests "$TESTS_S" bash -c 'for i in 1 2 3 4 5; do "$0" -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -n 3; done' "$PYTHON"
fi
# the issue's two hardest models first: a run cut short still has them
# shellcheck disable=SC2086  # $SMOKE, STEP_ARGS and FORMS_ARGS split into words on purpose
# no model starts in the part's last minute (a model takes up to a minute: torch.compile's)
run step "$STEP_S" "$PYTHON" bench/bench_step_cuda.py $SMOKE ${STEP_ARGS:-} \
  --budget-s $((STEP_S > 120 ? STEP_S - 60 : STEP_S / 2)) --json "$OUT/step.json" \
  resnet18_224_b64 transformer_d768 mlp_b2048 mlp_b64 cnn_b32 transformer_d256
# shellcheck disable=SC2086
run forms "$FORMS_S" "$PYTHON" bench/bench_rewrites_cuda.py $SMOKE ${FORMS_ARGS:-} --reps 10 --json "$OUT/forms.json"
run profile "$PROFILE_S" "$PYTHON" bench/bench_rewrites_cuda.py $SMOKE --only-profile --reps 10
echo "== all parts: $((SECONDS - START))s; logs in $OUT"
