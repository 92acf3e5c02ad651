#!/usr/bin/env bash
# GPU smoke: one short real job per system (experiment=gpu_smoke, conf/smoke/), then one
# table of what ran where. Needs CUDA; run from the repository root in an installed env
# (`pip install -e ".[dev]"`). Budget: under 8 minutes on one GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/runs/gpu_smoke}
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_smoke: no CUDA device visible (torch.cuda.is_available() is false); nothing run" >&2
  exit 2
fi
start=$(date +%s)
set +e
timeout 480 python -m bench --multirun experiment=gpu_smoke "results_dir=$out" progress=false
rc=$?
set -e
python -m bench.gpu_smoke "$out"
echo "gpu_smoke took $(( $(date +%s) - start )) s (sweep exit $rc)"
exit "$rc"
