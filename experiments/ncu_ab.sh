#!/usr/bin/env bash
# Device side: kernel time and warp instructions of several builds of the kernel library at a
# few grid points, each measured by ncu at its locked clocks (one call per build and point, so
# the power cap and the card's clock drift do not enter; bench/NOTES.md, 2026-11-27, commit 17d890a).
# A change that only reorders work shows in the time, one that removes instructions in both.
#   BUILDS="base=bench/out/base new=bench/out/new" \
#   POINTS="8192 128 --bwd;16384 128 --bwd --causal;16384 128" bash experiments/ncu_ab.sh
# A point is experiments/one_fwd.py's arguments: N, D, then --bwd / --causal; the forward kernel
# (fwd_sm90) is measured unless --bwd names the dK/dV kernel (bwd_dkdv). Prints one line per
# build, point and metric; $OUT/ncu_ab.txt keeps them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/candle-flash-out}
mkdir -p "$OUT"
metrics=gpu__time_duration.sum,smsp__inst_executed.sum
IFS=';' read -r -a points <<< "${POINTS:-8192 128 --bwd;16384 128}"
for pt in "${points[@]}"; do
  read -r n d rest <<< "$pt"
  kernel=fwd_sm90
  [[ " $rest " == *" --bwd "* ]] && kernel=bwd_dkdv
  for b in $BUILDS; do
    name=${b%%=*}
    # shellcheck disable=SC2086
    CF_BUILD_DIR=${b#*=} ncu -k "regex:$kernel" --metrics "$metrics" --csv \
      python3 experiments/one_fwd.py --n "$n" --d "$d" $rest 2>/dev/null |
      grep -E 'gpu__time|inst_exec' |
      awk -F'","' -v b="$name" -v p="$pt" '{gsub(/"/, "", $NF); print p " | " b " | " $(NF-2) " " $NF}'
  done
done | tee "$OUT/ncu_ab.txt"
