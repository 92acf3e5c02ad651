#!/usr/bin/env bash
# The one-GPU check: every one-GPU preset (conf/experiment/gpu/, bench.gpu_check.GPU_PRESETS)
# and the GPU smoke (experiment=gpu_smoke), then one table: system, metric, ours, paper,
# device/backend. Installs nothing: run it from a checkout whose package is importable (an
# installed env, or PYTHONPATH=. with the dependencies present). Budget: under 7 minutes on one
# H100/H200-class GPU. Without CUDA it exits 2 with its reason.
#   bash .ci/gpu_check.sh [RESULTS] [PRESET ...]   (default RESULTS: results/runs/gpu_check)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/runs/gpu_check}
shift || true
presets=("$@")
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device visible (torch.cuda.is_available() is false); nothing run" >&2
  exit 2
fi
if [ ${#presets[@]} -eq 0 ]; then
  mapfile -t presets < <(python -c "from bench.gpu_check import GPU_PRESETS; print('\n'.join(GPU_PRESETS))")
fi
# Per-preset limits (s), each cut to what is left of the whole check's budget (GPU_CHECK_BUDGET_S,
# default 420 s, keeping 15 s for the table): a job past its limit leaves no record and the table
# says "missing", but the table is always printed, within the budget.
declare -A limit=([fisedit_sd15]=120 [fisedit_sd21_768]=75 [caraserve_7b]=60 [swiftdiffusion_sd15]=130
                  [ckpt_recovery]=170 [smoke]=150)
budget=${GPU_CHECK_BUDGET_S:-420}
export MLSYS_BENCH_NO_SWEEP_TABLE=1 PYTHONUNBUFFERED=1
start=$(date +%s)
rc=0
run_one() {  # name, then the bench arguments
  local name=$1; shift
  local left=$(( budget - 15 - ($(date +%s) - start) ))
  local t=${limit[$name]:-90}
  (( left < t )) && t=$left
  if (( t < 10 )); then echo "gpu_check: $name skipped (the ${budget} s budget is spent)"; rc=1; return; fi
  local t0=$(date +%s)
  echo "gpu_check: $name (limit ${t} s)"
  timeout "$t" python -m bench --multirun "$@" "results_dir=$out" progress=false \
    || { echo "gpu_check: $name exited $?"; rc=1; }
  echo "gpu_check: $name took $(( $(date +%s) - t0 )) s"
}
for p in "${presets[@]}"; do
  [ "$p" = smoke ] || run_one "$p" "experiment=gpu/$p"
done
[ "${GPU_CHECK_SMOKE:-1}" = 1 ] && run_one smoke experiment=gpu_smoke
echo
python -m bench.gpu_check "$out" || rc=1
echo "gpu_check took $(( $(date +%s) - start )) s (exit $rc)"
exit "$rc"
