#!/usr/bin/env bash
# Device side: why the SM clock drops during a point. Runs one grid point (bf16, B·N = 16384,
# hidden 2048; MODE, N, D, CAUSAL below) for ours and PyTorch's cuDNN backend in turns, ROUNDS
# times, each from a rested card, while nvidia-smi samples the SM clock, power and the active
# clock-event reasons every 20 ms. Prints per implementation and round: TF/s, the SM clock over
# the point (median / min) and how many samples carried each reason (power cap, hardware
# slowdown, power brake, thermal). Needs gpu-pack (scripts/gpu-build.sh).
#   MODE=fwd N=16384 D=128 CAUSAL=false ROUNDS=3 ITERS=60 bash experiments/clock_events.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device-prelude.sh
mode=${MODE:-fwd}
n=${N:-16384}
d=${D:-128}
causal=${CAUSAL:-false}
rounds=${ROUNDS:-3}
iters=${ITERS:-60}
point=(--tokens 16384 --hidden 2048 --hdim "$d" --seqlens "$n" --causal "$causal" --dtype bf16
  --rest-ms "${REST_MS:-800}" --stamp --mode "$mode" --iters "$iters")
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active \
  --format=csv,noheader,nounits -lms 20 > "$OUT/events.csv" 2>&1 &
smi=$!
: > "$OUT/events_stamps.txt"
: > "$OUT/events.jsonl"
for ((round = 1; round <= rounds; round++)); do
  gpu-bin/bench --device cuda --impl flash "${point[@]}" 2>>"$OUT/events_stamps.txt" | grep '^{' >> "$OUT/events.jsonl"
  python3 bench/sdpa.py --impl torch-cudnn "${point[@]}" 2>>"$OUT/events_stamps.txt" >> "$OUT/events.jsonl"
done
sleep 0.2
kill $smi
python3 - "$OUT/events.csv" "$OUT/events_stamps.txt" "$OUT/events.jsonl" <<'PY'
import json, statistics, sys
sys.path.insert(0, "bench")
import clocks

# nvidia-smi's clocks_event_reasons bits (nvml.h, nvmlClocksEventReason*)
REASONS = {0x4: "sw-power-cap", 0x8: "hw-slowdown", 0x20: "sw-thermal", 0x40: "hw-thermal", 0x80: "hw-power-brake"}
samples = []  # (Unix s, SM MHz, power W, reasons bit mask)
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    try:
        (t, mhz, watts), bits = clocks.samples_of([line])[0], int(f[3], 16)
    except (IndexError, ValueError):
        continue
    samples.append((t, mhz, watts, bits))
tf = {}
for l in open(sys.argv[3]):
    if l.startswith("{"):
        r = json.loads(l)
        tf.setdefault(r["impl"], []).append(r.get("tflops", float("nan")))
seen = {}
print("| impl | round | TF/s | SM MHz median / min | power W max | samples | " + " | ".join(REASONS.values()) + " | other bits |")
print("|---|---|---|---|---|---|" + "---|" * (len(REASONS) + 1))
for l in open(sys.argv[2]):
    f = l.split()
    if not f or f[0] != "point":
        continue
    impl, a, b = f[1], float(f[6]), float(f[7])
    k = seen[impl] = seen.get(impl, -1) + 1
    pts = [s for s in samples if a <= s[0] <= b]
    if not pts:
        continue
    mhz = [s[1] for s in pts]
    counts = [sum(1 for s in pts if s[3] & bit) for bit in REASONS]
    other = 0  # any other reason but "idle" (0x1)
    for s in pts:
        other |= s[3] & ~(0x1 | sum(REASONS))
    print(f"| {impl} | {k + 1} | {tf.get(impl, [float('nan')] * (k + 1))[k]:.0f} | {statistics.median(mhz):.0f} / {min(mhz):.0f} | "
          f"{max(s[2] for s in pts):.0f} | {len(pts)} | " + " | ".join(str(c) for c in counts) + f" | {other:#x} |")
PY
