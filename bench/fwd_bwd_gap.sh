#!/usr/bin/env bash
# Device side: why the crate's fwd+bwd at one shape takes longer than its fwd plus its bwd
# (d = 64, 16k, non-causal: +6-15% in the ninth-twelfth sessions' gpu-bench runs, other
# shapes +-5%). Times the three modes in two orders, samples clocks / power meanwhile, and
# lists each mode's kernels with their durations under ncu. (Alone, the gap is ~1%: it needs the
# long history of the bench's grid in one process; bench/NOTES.md "Sixteenth session".)
# Usage: HDIM=64 N=16384 CAUSAL=false bash bench/fwd_bwd_gap.sh (OUT=... for the logs)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/candle-flash-out}
mkdir -p "$OUT"
source scripts/unpack-gpu-bin.sh
# shellcheck disable=SC1091
source gpu-bin/cuda-libs.sh >/dev/null
d=${HDIM:-64}; n=${N:-16384}; causal=${CAUSAL:-false}
shape=(--tokens 16384 --hidden 2048 --hdim "$d" --seqlens "$n" --causal "$causal" --dtype bf16)
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 200 > "$OUT/smi.csv" 2>&1 &
smi=$!
for order in fwd,bwd,fwd_bwd fwd_bwd,bwd,fwd fwd,bwd,fwd_bwd; do
  gpu-bin/bench --device cuda --impl flash --mode "$order" "${shape[@]}" --iters 20 2>>"$OUT/bench.err" \
    | grep '^{' | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l); print("%-8s %8.3f ms %6.1f TF/s" % (r["mode"], r["ms"], r["tflops"]))'
  echo "--"
done | tee "$OUT/gap.txt"
kill $smi
python3 - "$OUT/smi.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))[1:]
sm = [int(r[1].split()[0]) for r in rows if len(r) > 4 and r[1].strip().split()[0].isdigit()]
pw = [float(r[3].split()[0]) for r in rows if len(r) > 4 and r[3].strip().split()[0].replace('.', '').isdigit()]
if sm: print(f"SM clock MHz min {min(sm)} max {max(sm)}; power W max {max(pw):.0f}")
print("throttle reasons seen:", sorted({r[5].strip() for r in rows if len(r) > 5}))
PY
# Kernels of one timed call per mode (ncu keeps clocks at base, so compare the lists, not
# the totals with the timings above).
for mode in fwd bwd fwd_bwd; do
  echo "== ncu $mode"
  ncu --metrics gpu__time_duration.sum --csv gpu-bin/bench --device cuda --impl flash --mode "$mode" \
    "${shape[@]}" --iters 1 2>/dev/null | python3 -c '
import csv, sys
rows = [r for r in csv.reader(l for l in sys.stdin if l.startswith("\""))]
hdr = rows[0]; rows = rows[1:]
ki, vi = hdr.index("Kernel Name"), hdr.index("Metric Value")
ui = hdr.index("Metric Unit")
for r in rows: print("%12s %-8s %s" % (r[vi], r[ui], r[ki][:110]))'
done 2>&1 | tee "$OUT/ncu.txt"
