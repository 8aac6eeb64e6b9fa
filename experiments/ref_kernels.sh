#!/usr/bin/env bash
# Device side: what the reference implementations launch for one grid point (PyTorch SDPA's
# flash and cuDNN backends, one forward and one backward each, experiments/one_fwd.py --refs-only),
# read with ncu: each kernel's name, grid, block, registers, shared memory and duration, then
# the SASS opcode mix of the longest kernels (experiments/ncu_source.py --mix: HGMMA shapes and
# operand forms give the tile structure, e.g. which products read A from registers).
#   N=8192 D=128 [CAUSAL=1] [TOP=2] [SKIP=pytorch_flash] bash experiments/ref_kernels.sh
# (SKIP: a regex of kernel names left out of the SASS pass; FA2, whose source we have, by default)
# Writes $OUT/ref_launch_<N>_<D>.txt and $OUT/ref_sass_<N>_<D>_<i>.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/candle-flash-out}
mkdir -p "$OUT"
N=${N:-8192}
D=${D:-128}
TOP=${TOP:-2}
args=(--refs-only --n "$N" --d "$D" --bwd)
[ "${CAUSAL:-0}" = 1 ] && args+=(--causal)
tag="${N}_${D}$([ "${CAUSAL:-0}" = 1 ] && echo c)"
launch="$OUT/ref_launch_$tag.txt"
ncu --section LaunchStats --section SpeedOfLight --csv --page details \
  python3 experiments/one_fwd.py "${args[@]}" > "$launch.csv" 2> "$OUT/ref_ncu_$tag.err"
python3 - "$launch.csv" "$TOP" "${SKIP:-pytorch_flash}" > "$launch" <<'EOF'
import csv, re, sys
from collections import OrderedDict
rows = [r for r in csv.reader(open(sys.argv[1], errors="replace")) if len(r) > 10]
hdr, body = rows[0], rows[1:]
col = {n: i for i, n in enumerate(hdr)}
kern = OrderedDict()
want = {"Duration": "dur", "Grid Size": "grid", "Block Size": "block", "Registers Per Thread": "regs",
        "Dynamic Shared Memory Per Block": "dsmem", "Static Shared Memory Per Block": "ssmem",
        "Compute (SM) Throughput": "sm%", "Memory Throughput": "mem%"}
for r in body:
    key = (r[col["ID"]], r[col["Kernel Name"]])
    m = r[col["Metric Name"]]
    e = kern.setdefault(key, {"grid": r[col["Grid Size"]], "block": r[col["Block Size"]]})
    if m in want:
        e[want[m]] = r[col["Metric Value"]] + " " + r[col["Metric Unit"]]
for (i, name), v in kern.items():
    print(f"[{i}] {name[:150]}")
    print("     " + "  ".join(f"{k}={v.get(k, '?')}" for k in want.values()))
def us(v):
    x, unit = v.get("dur", "0 us").split()[:2]
    x = float(x.replace(",", ""))
    return x / 1000 if unit == "ns" else x * 1000 if unit == "ms" else x
top = sorted((kv for kv in kern.items() if not re.search(sys.argv[3], kv[0][1])), key=lambda kv: -us(kv[1]))[: int(sys.argv[2])]
print("LONGEST " + " ||| ".join(name for (_, name), _ in top))
EOF
cat "$launch"
# The longest kernels' SASS, each from its own one-kernel report.
i=0
grep '^LONGEST ' "$launch" | sed 's/^LONGEST //' | sed 's/ ||| /\n/g' | while read -r name; do
  i=$((i + 1))
  base=$(echo "$name" | sed 's/[(<].*//' | tr -cd 'A-Za-z0-9_')
  rep="/tmp/ref_${tag}_$i"
  ncu --set full -k "regex:^${base}" -c 1 -f -o "$rep" python3 experiments/one_fwd.py "${args[@]}" > /dev/null 2>&1
  ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.csv" 2> /dev/null
  { echo "# $name"; python3 experiments/ncu_source.py "$rep.csv" 30 --mix; } > "$OUT/ref_sass_${tag}_$i.txt" 2>&1
  head -n 60 "$OUT/ref_sass_${tag}_$i.txt"
done
