#!/usr/bin/env bash
# Device side: why the crate's fwd+bwd at one shape takes longer than its fwd plus its bwd
# (d = 64, 16k, non-causal: +6-15% in the gpu-bench runs of 2026-11-26, commits f0052a2-b125200, other
# shapes +-5%). Times the three modes in two orders, samples clocks / power meanwhile, and
# lists each mode's kernels with their durations under ncu. (Alone, the gap is ~1%: it needs the
# long history of the bench's grid in one process; bench/NOTES.md, 2026-11-27, commit 2031cb3.)
# Usage: HDIM=64 N=16384 CAUSAL=false bash experiments/fwd_bwd_gap.sh (OUT=... for the logs)
# GRID=1: instead, the bench's whole grid in one process (where the gap shows), with the
# fwd_bwd calls split at an event between forward and backward (--split), once with the
# default allocation caching and once with --no-pool-cache, then the N = $N kernels of the
# bwd and fwd_bwd points under ncu (cuProfilerStart/Stop around those points only).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device-prelude.sh
d=${HDIM:-64}; n=${N:-16384}; causal=${CAUSAL:-false}
if [ "${CLOCKS:-0}" = 1 ]; then
  # The N = $N points alone, then inside the whole grid, then alone right after it and after a
  # rest, with the SM clock, power and temperature sampled every 50 ms: each point's mean clock.
  one=(--tokens 16384 --hidden 2048 --hdim "$d" --seqlens "$n" --causal false --dtype bf16
    --mode fwd,bwd,fwd_bwd --iters 10 --split --stamp)
  all=(--tokens 16384 --hidden 2048 --hdim "$d" --seqlens 512,1024,2048,4096,8192,16384 --causal both
    --dtype bf16 --mode fwd,bwd,fwd_bwd --iters 10 --split --stamp)
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader,nounits -lms 50 > "$OUT/smi-clocks.csv" 2>&1 &
  smi=$!
  sleep 1
  run() {  # label, bench arguments
    local label=$1; shift
    gpu-bin/bench --device cuda --impl flash "$@" 2>"$OUT/points-$label.txt" | grep '^{' > "$OUT/clk-$label.jsonl"
  }
  run alone-1 "${one[@]}"
  run grid "${all[@]}"
  run alone-2 "${one[@]}"
  sleep 20
  run alone-3 "${one[@]}"
  kill $smi
  python3 - "$OUT" "$n" <<'PY'
import json, sys
sys.path.insert(0, "bench")
from clocks import samples, stamps
out, n = sys.argv[1], int(sys.argv[2])
smi = samples(f"{out}/smi-clocks.csv")  # (t, MHz, W, C)
print("%-8s %-8s %6s %-5s %8s %18s %6s %5s %4s" % ("run", "mode", "N", "causal", "ms", "parts", "MHz", "W", "C"))
for label in ["alone-1", "grid", "alone-2", "alone-3"]:
    rows = {(r["mode"], r["nk"], r["causal"]): r for r in map(json.loads, open(f"{out}/clk-{label}.jsonl"))}
    for _, mode, nk, causal, _, t0, t1 in stamps(f"{out}/points-{label}.txt"):
        if nk != n:
            continue
        s = [x for x in smi if t0 <= x[0] <= t1]
        r = rows[(mode, nk, causal)]
        parts = "+".join("%.2f" % p for p in r["parts_ms"])
        mean = lambda i: sum(x[i] for x in s) / len(s) if s else float("nan")
        print("%-8s %-8s %6d %-5s %8.3f %18s %6.0f %5.0f %4.0f" % (label, mode, nk, causal, r["ms"], parts, mean(1), mean(2), mean(3)))
PY
  exit 0
fi
if [ "${GRID:-0}" = 1 ]; then
  grid=(--tokens 16384 --hidden 2048 --hdim "$d" --seqlens 512,1024,2048,4096,8192,16384 --causal both
    --dtype bf16 --mode fwd,bwd,fwd_bwd --iters 10 --split)
  for variant in cache no-cache; do
    extra=(); [ $variant = no-cache ] && extra=(--no-pool-cache)
    gpu-bin/bench --device cuda --impl flash "${grid[@]}" "${extra[@]}" 2>>"$OUT/bench.err" \
      | grep '^{' > "$OUT/grid-$variant.jsonl"
    echo "== grid, $variant: d = $d, N <= 1024 (host time) and N >= 4096"
    python3 - "$OUT/grid-$variant.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {(r["mode"], r["nk"], r["causal"]): r for r in rows}
for (mode, nk, causal), r in by.items():
    if nk < 4096:
        if nk <= 1024:  # short calls: how much of the measured time the host's enqueueing is
            print("%-8s %6d %-5s %8.3f ms  host %.3f ms" % (mode, nk, causal, r["ms"], r["host_ms"]))
        continue
    extra = ""
    if mode == "fwd_bwd":
        f, b = by[("fwd", nk, causal)]["ms"], by[("bwd", nk, causal)]["ms"]
        parts = " + ".join("%.3f" % p for p in r["parts_ms"])
        extra = "  parts %s  (fwd %.3f + bwd %.3f = %.3f: %+.1f%%)" % (parts, f, b, f + b, 100 * (r["ms"] / (f + b) - 1))
    print("%-8s %6d %-5s %8.3f ms  host %.3f ms%s" % (mode, nk, causal, r["ms"], r["host_ms"], extra))
PY
  done
  echo "== ncu: kernels of the bwd and fwd_bwd points at N = $n, non-causal, in the grid"
  ncu --profile-from-start off --metrics gpu__time_duration.sum --csv gpu-bin/bench --device cuda --impl flash \
    "${grid[@]}" --profile-point "bwd:$n:false,fwd_bwd:$n:false" 2>>"$OUT/bench.err" > "$OUT/ncu-grid.csv"
  python3 - "$OUT/ncu-grid.csv" <<'PY'
import csv, sys
from collections import defaultdict
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
hdr, rows = rows[0], rows[1:]
ki, vi = hdr.index("Kernel Name"), hdr.index("Metric Value")
# Launch order: the bwd point's calls come first (its warm-up runs for 50 ms, so their number
# varies with N), then fwd_bwd's: the first three durations are the bwd point's, the last three
# fwd_bwd's.
seq = [(r[ki][:90], float(r[vi].replace(",", ""))) for r in rows]
groups = defaultdict(list)
for i, (k, v) in enumerate(seq):
    groups[k].append((i, v))
for k, vs in groups.items():
    print("%-90s n=%3d first idx %4d  ns: %s" % (k, len(vs), vs[0][0], " ".join("%.0f" % v for _, v in vs[:3] + vs[-3:])))
PY
  exit 0
fi
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
