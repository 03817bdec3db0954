#!/usr/bin/env bash
# The first run on a lent GPU machine, bounded: one call of at most 570 s gets the most information
# even when something fails. Run from the repository root:
#
#     bash benchmarks/gpu_check.sh            (BUDGET=530 seconds, results under $OUT or ./gpu_out)
#
# Order, by information per second: versions; CUDA build; import check; quick self-test (every op
# against the CPU kernels, stops at the first CUDA error naming its case); the CUDA-marked tests, one
# pytest process per file (a sticky illegal-address error fails only its own file); compute-sanitizer
# memcheck on the quick self-test; profile and benchmark; the capture test matrix; the full self-test.
# Each step runs under min(its limit, time left) and is skipped when less than its minimum is left.
# Every log goes to $OUT; $OUT/summary.txt (one line per step and the key results) is printed last.
# Without a GPU the GPU steps are skipped with a line saying so (the quick self-test then runs the
# CPU kernels against the references), so the script can be dry-run anywhere:
#     BUDGET=60 PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh
set -uo pipefail
shopt -s globstar nullglob
cd "$(dirname "$0")/.." || exit 1

PY=${PYTHON:-python3}
BUDGET=${BUDGET:-530}
RESERVE=8  # seconds kept for the summary
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT/junit" && OUT=$(cd "$OUT" && pwd)
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
START=$SECONDS
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} TORCH_SHOW_CPP_STACKTRACES=1

note() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $((BUDGET - (SECONDS - START) - RESERVE)); }

# step NAME LIMIT MIN LOG CMD...: CMD under min(LIMIT, time left), output to LOG; skipped when less
# than MIN seconds are left. Returns CMD's status (99 when skipped, 124/137 on a timeout).
step() {
  local name=$1 limit=$2 min=$3 log=$4 t0=$SECONDS rc
  shift 4
  local avail
  avail=$(left)
  if [ "$avail" -lt "$min" ]; then
    note "SKIP    $name: budget (${avail}s left, needs ${min}s)"
    return 99
  fi
  [ "$limit" -gt "$avail" ] && limit=$avail
  echo "=== $name (limit ${limit}s): $*" >>"$log"
  timeout -k 5 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  local took=$((SECONDS - t0)) state
  case $rc in
    0) state="ok     " ;;
    124|137) state="TIMEOUT" ;;
    *) state="FAIL   " ;;
  esac
  note "$state $name: rc=$rc ${took}s (limit ${limit}s) -> ${log#"$OUT"/}"
  return $rc
}

finish() {
  {
    echo
    echo "---- key results ----"
    grep -hE "^selftest (PASSED|FAILED)|^stopped at" "$OUT"/selftest_*.log 2>/dev/null
    grep -hE "^(FAIL|ERR ) " "$OUT"/selftest_*.log 2>/dev/null | head -15
    for log in "$OUT"/pytest_*.log; do
      local last
      last=$(grep -E "^=+ .*(passed|failed|error|skipped|deselected|no tests ran).* =+$" "$log" | tail -1)
      echo "$(basename "$log" .log): ${last:-no pytest summary (killed or crashed: see the end of the log)}"
    done
    grep -hE "^(FAILED|ERROR) " "$OUT"/pytest_*.log 2>/dev/null | sort -u | head -30
    grep -hE "ERROR SUMMARY|Invalid .*(read|write)" "$OUT"/memcheck.log 2>/dev/null | head -8
    grep -hE "^gpu_profile:|FAILED" "$OUT"/profile.log 2>/dev/null | head -5
    echo "total $((SECONDS - START))s of a ${BUDGET}s budget; logs in $OUT"
  } >>"$SUMMARY"
  echo
  echo "==================== summary ($SUMMARY) ===================="
  cat "$SUMMARY"
}
trap 'note "INTERRUPTED"; finish; exit 130' INT TERM

# ---- 0. versions (cheap; tells what machine this was) --------------------------------------------
# `python -m mask_replay` needs mask_replay.cli, which an install maps to the top-level cli/ folder
# (setup.py package_dir); a bare copy of the tree has no install, so link it as the worktrees do.
if [ ! -e mask_replay/cli ]; then
  ln -s ../cli mask_replay/cli && note "linked mask_replay/cli -> ../cli (no install here)"
fi
NVCC=$(command -v nvcc || true)
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
if [ -z "${CUDA_HOME:-}" ] && [ -n "$NVCC" ]; then
  CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
  export CUDA_HOME
fi
[ -n "${CUDA_HOME:-}" ] && export PATH="$CUDA_HOME/bin:$PATH"
HAVE_GPU=$(timeout 60 "$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,compute_cap,clocks.max.sm,driver_version --format=csv 2>&1 || true
  [ -n "$NVCC" ] && "$NVCC" --version | tail -2
  echo "CUDA_HOME=${CUDA_HOME:-unset} nproc=$(nproc) python=$PY"
  timeout 60 "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" 2>&1
  command -v compute-sanitizer || echo "compute-sanitizer: not on PATH"
  "$PY" -c "import pytest_timeout" 2>/dev/null && echo "pytest-timeout: yes" || echo "pytest-timeout: no"
  git rev-parse HEAD 2>/dev/null && git status --short 2>/dev/null | head -20
} >"$OUT/env.txt" 2>&1
note "machine: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true) $(nproc) cores"
[ "$HAVE_GPU" = 1 ] || note "no GPU visible to torch: the GPU steps are skipped (dry run)"

gpu_step() {  # step, or a SKIP line when there is no GPU
  if [ "$HAVE_GPU" != 1 ]; then
    note "SKIP    $1: no GPU"
    return 99
  fi
  step "$@"
}

# ---- 1. build (about 70-100 s on 16 cores) --------------------------------------------------------
ARCH=${TORCH_CUDA_ARCH_LIST:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1)}
if ! gpu_step build 240 60 "$OUT/build.log" env MASK_REPLAY_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST="${ARCH:-9.0}" \
    MAX_JOBS=16 "$PY" setup.py build_ext --inplace; then
  if [ "$HAVE_GPU" = 1 ]; then
    tail -30 "$OUT/build.log" >>"$SUMMARY"
    note "build failed: nothing else can run"
    finish
    exit 1
  fi
fi

# ---- 2. import check ------------------------------------------------------------------------------
step import 60 15 "$OUT/import.log" "$PY" -c "
import mask_replay, torch
info = mask_replay.build_info()
print(info)
assert info['cuda'] or not torch.cuda.is_available(), 'a GPU is visible but the CUDA kernels were not built'"

# ---- 3. quick self-test (CUDA: every op against the CPU kernels; CPU: against the references) -----
step selftest_quick 150 30 "$OUT/selftest_quick.log" "$PY" -m mask_replay selftest --quick

# ---- 4. CUDA-marked tests, one pytest process per file --------------------------------------------
PYTEST=(-m pytest -p no:cacheprovider -m cuda -v -rA --tb=short --durations=5 --hypothesis-seed=0)
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST+=(--timeout=90)  # an unknown flag would run no test
pytest_file() {  # pytest_file FILE LIMIT [extra pytest args]: one file in its own process
  local f=$1 limit=$2 name
  shift 2
  name=$(basename "$f" .py)${PYTEST_TAG:-}
  gpu_step "tests $f${PYTEST_TAG:-}" "$limit" "${PYTEST_MIN:-20}" "$OUT/pytest_$name.log" \
    "$PY" "${PYTEST[@]}" --junitxml="$OUT/junit/$name.xml" "$@" "$f"
}
# The capture matrix (test_matches_cpu, about 200 cases, mostly what the self-test covers) runs later.
PYTEST_TAG=_edge pytest_file tests/test_capture_cuda.py 120 -k "not test_matches_cpu"
FILES=()
for f in tests/**/test_*.py; do
  [ "$f" = tests/test_capture_cuda.py ] && continue
  if grep -q "mark\.cuda" "$f"; then FILES+=("$f"); fi  # files without a CUDA test are not started
done
for f in "${FILES[@]}"; do pytest_file "$f" 90; done

# ---- 5. memcheck on the quick self-test -----------------------------------------------------------
if command -v compute-sanitizer >/dev/null; then
  gpu_step memcheck 120 40 "$OUT/memcheck.log" compute-sanitizer --tool memcheck --print-limit 20 \
    --error-exitcode 3 "$PY" -m mask_replay selftest --device cuda --quick
else
  note "SKIP    memcheck: compute-sanitizer not on PATH"
fi

# ---- 6. profile and benchmark ---------------------------------------------------------------------
gpu_step profile 120 40 "$OUT/profile.log" "$PY" benchmarks/gpu_profile.py --iters 30 --json "$OUT/profile.json"
gpu_step bench_capture_cuda 60 30 "$OUT/bench_capture_cuda.log" "$PY" benchmarks/bench_capture_cuda.py --iters 50

# ---- 7. if time allows: the capture matrix, then the full self-test -------------------------------
PYTEST_TAG=_matrix PYTEST_MIN=60 pytest_file tests/test_capture_cuda.py 150 --maxfail=25 -k test_matches_cpu
if [ "$HAVE_GPU" = 1 ]; then
  step selftest_full 300 120 "$OUT/selftest_full.log" "$PY" -m mask_replay selftest --device cuda
else
  step selftest_full 300 60 "$OUT/selftest_full.log" "$PY" -m mask_replay selftest
fi

finish
