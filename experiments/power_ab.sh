#!/usr/bin/env bash
# Device side: ours and cuDNN (PyTorch SDPA) at the same points under sustained load, each point
# its own process after a rest, with the SM clock and power sampled every 50 ms: the time per
# call, the clock and power it settles at, and the energy per call (steady power x time).
# Why: the H100 runs at its 700 W power cap under sustained attention (nvidia-smi: "SW power
# cap"), so a kernel's speed in a long run depends on its energy per call, not only on its
# cycles (bench/NOTES.md, 2026-11-27, commit 378b375).
# Usage: POINTS="64:16384:fwd 128:16384:bwd ..." REST=5 bash experiments/power_ab.sh (OUT=... for logs)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device-prelude.sh
points=${POINTS:-"64:16384:fwd 64:16384:bwd 128:16384:fwd 128:16384:bwd 128:4096:bwd"}
rest=${REST:-5}
secs=${SECS:-3}  # about how long each point runs
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu \
  --format=csv,noheader,nounits -lms 50 > "$OUT/smi-power.csv" 2>&1 &
smi=$!
: > "$OUT/power-points.txt"
: > "$OUT/power.jsonl"
for pt in $points; do
  IFS=: read -r d n mode <<< "$pt"
  # iterations for ~secs seconds at a rough rate (TF/s 450 fwd, 350 bwd)
  iters=$(python3 -c "
d, n, m = $d, $n, '$mode'
f = 4 * 16384 * n * 2048 * {'fwd': 1, 'bwd': 2.5, 'fwd_bwd': 3.5}[m]
print(max(20, int($secs / (f / {'fwd': 450e12, 'bwd': 350e12, 'fwd_bwd': 380e12}[m]))))")
  grid=(--tokens 16384 --hidden 2048 --hdim "$d" --seqlens "$n" --causal false --dtype bf16 --mode "$mode" --iters "$iters")
  for impl in ours cudnn; do
    sleep "$rest"
    if [ $impl = ours ]; then
      gpu-bin/bench --device cuda --impl flash "${grid[@]}" --stamp 2>>"$OUT/power-points.txt" | grep '^{' >> "$OUT/power.jsonl"
    else
      python3 bench/sdpa.py --impl torch-cudnn "${grid[@]}" --stamp 2>>"$OUT/power-points.txt" >> "$OUT/power.jsonl"
    fi
  done
done
kill $smi
python3 - "$OUT" <<'PY'
import json, sys
sys.path.insert(0, "bench")
from clocks import samples, stamps
out = sys.argv[1]
smi = samples(f"{out}/smi-power.csv")
rows = [json.loads(l) for l in open(f"{out}/power.jsonl") if l.startswith("{")]
print("%-6s %4s %6s %-5s %8s %7s %6s %6s %7s" % ("impl", "d", "N", "mode", "ms", "TF/s", "MHz", "W", "J/call"))
for r, s in zip(rows, stamps(f"{out}/power-points.txt")):
    t0, t1 = s[5], s[6]
    # the settled part: samples within 7% of the run's highest power (a cuDNN run idles while
    # it builds its plan, and nvidia-smi's power is an average over about a second)
    w = [x for x in smi if t0 <= x[0] <= t1 - 0.1]
    top = max((x[2] for x in w), default=0)
    w = [x for x in w if x[2] >= 0.93 * top]
    mhz = sum(x[1] for x in w) / len(w) if w else float("nan")
    pw = sum(x[2] for x in w) / len(w) if w else float("nan")
    print("%-6s %4d %6d %-5s %8.3f %7.1f %6.0f %6.0f %7.3f" % (r["impl"][:6], r["d"], r["nk"], r["mode"], r["ms"], r["tflops"], mhz, pw, pw * r["ms"] / 1e3))
PY
