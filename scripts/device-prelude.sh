#!/usr/bin/env bash
# Device side, sourced from the repository root by every device script (scripts/gpu-run.sh,
# gpu-bench.sh, experiments/fwd_bwd_gap.sh, experiments/power_ab.sh, experiments/clock_events.sh): the result folder $OUT (when set,
# else /tmp/candle-flash-out), gpu-bin/ unpacked from gpu-pack/ (scripts/unpack-gpu-bin.sh) and
# the CUDA libraries' path for its binaries.
OUT=${OUT:-/tmp/candle-flash-out}
mkdir -p "$OUT"
source scripts/unpack-gpu-bin.sh
# shellcheck disable=SC1091
source gpu-bin/cuda-libs.sh >/dev/null
