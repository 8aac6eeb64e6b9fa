#!/usr/bin/env bash
# Device side, kernel level (no Rust): builds kernels/ into a shared library with nvcc, runs the
# kernel_check matrix on both kernel families (sm_90a wgmma and, with CANDLE_FLASH_DISABLE_SM90A=1,
# the sm_80 mma.sync kernels), the bad-seqlens cases under compute-sanitizer memcheck, and, when
# a baseline is carried (.baseline/kernels + .baseline/kernel_check_old.py: the previous
# revision's kernels and harness), the timing grid of both builds side by side.
#   bash scripts/gpu-kernels.sh [check|grid|all]   (on the GPU machine, with .baseline/ copied along)
# Env: CF_PREBUILT=1 (libraries built here and carried: bench/out*, .baseline/out), VARIANTS (more
# builds, checked and timed in the grid: "name=dir ...", each built here with
#   CF_BUILD_DIR=dir CF_NVCC_FLAGS="..." python3 bench/kernel_check.py --build-only
# or from another revision's kernels (CF_KDIR); the kernels' -DCF_* variant switches were removed,
# the variants are in git before commit 9991ad4), POINTS / DIMS / REPS (bench/grid.py).
# Making the baseline of revision REV (here, once; .baseline is listed in .git/info/exclude):
#   mkdir -p .git/info && echo /.baseline/ >> .git/info/exclude && rm -rf .baseline && mkdir .baseline &&
#   git archive REV kernels | tar -x -C .baseline && git show REV:bench/kernel_check.py > .baseline/kernel_check_old.py
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/candle-flash-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
what=${1:-all}
summary=()
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

# Both libraries, in parallel (each build is skipped when it is up to date). CF_PREBUILT=1: the
# libraries were built here (bench/kernel_check.py --build-only) and carried; no nvcc on the device.
if [ "${CF_PREBUILT:-0}" = 1 ]; then
  echo "prebuilt: $(ls -d bench/out*/ .baseline/out 2>/dev/null | tr '\n' ' ')" | tee "$OUT/build.log"
else
  python3 bench/kernel_check.py --build-only > "$OUT/build.log" 2>&1 &
  if [ -d .baseline/kernels ]; then
    CF_KDIR=.baseline/kernels CF_BUILD_DIR=.baseline/out python3 .baseline/kernel_check_old.py --build-only \
      > "$OUT/build_baseline.log" 2>&1 &
  fi
  wait
  tail -n 2 "$OUT/build.log"
fi

if [ "$what" = check ] || [ "$what" = all ]; then
  python3 bench/kernel_check.py --no-build --inspect > "$OUT/check.log" 2>&1
  summary+=("check (sm_90a):    rc=$? $(tail -n 1 "$OUT/check.log")")
  grep -E "SPILL|ptxas:" "$OUT/check.log" | head -5
  CANDLE_FLASH_DISABLE_SM90A=1 python3 bench/kernel_check.py --no-build > "$OUT/check_sm80.log" 2>&1
  summary+=("check (sm_80 path): rc=$? $(tail -n 1 "$OUT/check_sm80.log")")
  CANDLE_FLASH_DISABLE_TMA=1 python3 bench/kernel_check.py --no-build > "$OUT/check_no_tma.log" 2>&1
  summary+=("check (no TMA):     rc=$? $(tail -n 1 "$OUT/check_no_tma.log")")
  compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/kernel_check.py --no-build --bad-seqlens \
    > "$OUT/sanitizer_bad_seqlens.log" 2>&1
  summary+=("memcheck bad seqlens: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_bad_seqlens.log" | tail -n 1) $(grep -E 'passed' "$OUT/sanitizer_bad_seqlens.log" | tail -n 1)")
  CANDLE_FLASH_DISABLE_SM90A=1 compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/kernel_check.py \
    --no-build --bad-seqlens > "$OUT/sanitizer_bad_seqlens_sm80.log" 2>&1
  summary+=("memcheck bad seqlens (sm_80 path): rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_bad_seqlens_sm80.log" | tail -n 1)")
  compute-sanitizer --tool racecheck --error-exitcode 1 python3 bench/kernel_check.py --no-build --quick \
    > "$OUT/racecheck.log" 2>&1
  summary+=("racecheck quick:   rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck.log" | tail -n 1)")
  # Each variant build (VARIANTS, below) is checked too before the grid times it: the same cases
  # and the racecheck quick set.
  for v in ${VARIANTS:-}; do
    name=${v%%=*}; dir=${v#*=}; dir=${dir%%=*}
    CF_BUILD_DIR=$dir python3 bench/kernel_check.py --no-build --inspect > "$OUT/check_$name.log" 2>&1
    summary+=("check ($name):  rc=$? $(tail -n 1 "$OUT/check_$name.log")")
    CF_BUILD_DIR=$dir compute-sanitizer --tool racecheck --error-exitcode 1 python3 bench/kernel_check.py --no-build \
      --quick > "$OUT/racecheck_$name.log" 2>&1
    summary+=("racecheck quick ($name): rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck_$name.log" | tail -n 1)")
  done
fi

if { [ "$what" = grid ] || [ "$what" = all ]; } && [ -d .baseline/out ]; then
  # VARIANTS="v1=bench/out_v1 ...": more builds of this revision (CF_NVCC_FLAGS) timed beside it
  python3 bench/grid.py new=bench/out ${VARIANTS:-} old=.baseline/out=.baseline/kernel_check_old.py > "$OUT/grid.log" 2>&1
  summary+=("grid: rc=$?")
  cat "$OUT/grid.log"
fi
echo "==== summary ($(cat "$OUT/gpu.txt"))"
printf '%s\n' "${summary[@]}"
