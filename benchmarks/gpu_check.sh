#!/usr/bin/env bash
# One prepared run for a lent GPU machine (about 10 minutes): CUDA build, the GPU tests, then the
# GPU benchmark. Output goes to stdout and, when $OUT is set, to $OUT/gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${OUT:-/tmp}/gpu_check.log
{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || true
  # editable metadata install: mask_replay.cli lives in the top-level cli/ folder (setup.py package_dir)
  MASK_REPLAY_SKIP_EXT=1 $PY -m pip install -q --no-build-isolation --no-deps -e . || exit 1
  MASK_REPLAY_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
    $PY setup.py -q build_ext --inplace || exit 1
  $PY -c "import mask_replay; print(mask_replay.build_info())"
  HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} timeout 360 \
    $PY -m pytest -q -m cuda -p no:cacheprovider tests -q
  timeout 150 $PY benchmarks/bench_capture_cuda.py --iters 100
  timeout 120 $PY benchmarks/bench_replay.py --device cuda
} 2>&1 | tee "$LOG"
