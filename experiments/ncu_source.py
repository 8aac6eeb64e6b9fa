#!/usr/bin/env python3
"""Where a kernel's warps stall, per SASS instruction, from an ncu report's source page:
  ncu -k regex:bwd_dkdv_sm90 -c 1 --set full -o rep python3 experiments/one_fwd.py --n 8192 --d 128 --bwd
  ncu --import rep.ncu-rep --page source --csv --print-source sass > src.csv
  python3 experiments/ncu_source.py src.csv [top] [--mix]
Prints the stall-sample columns' totals, then the top instructions by samples with their
neighbours' share grouped by opcode class (HGMMA, barriers, shared/global memory, MUFU, ...).
--mix also prints the opcode mix with modifiers (static lines and executed instructions) and every
HGMMA line in program order: for a kernel we have no source of (cuDNN's), its product shapes and
operand forms (A from registers or a descriptor) show the tile structure (experiments/ref_kernels.sh)."""
import csv, re, sys
from collections import defaultdict

argv = [x for x in sys.argv[1:] if not x.startswith("--")]
mix = "--mix" in sys.argv
rows = list(csv.reader(open(argv[0], errors="replace")))
top = int(argv[1]) if len(argv) > 1 else 40
hdr_i = next(i for i, r in enumerate(rows) if any("Source" == c.strip() for c in r))
hdr = [c.strip() for c in rows[hdr_i]]
body = [r for r in rows[hdr_i + 1:] if len(r) == len(hdr)]
src = hdr.index("Source")
num = lambda x: float(x.replace(",", "")) if re.fullmatch(r"[-\d.,]+", x.strip() or "x") else 0.0
samp = next(i for i, c in enumerate(hdr) if c.startswith("Warp Stall Sampling (All"))
total = sum(num(r[samp]) for r in body) or 1.0
print(f"{len(body)} SASS lines, {total:.0f} stall samples")
cols = [i for i, c in enumerate(hdr) if c.startswith("stall_") or "Stall" in c and i != samp]
sums = sorted(((sum(num(r[i]) for r in body), hdr[i]) for i in cols), reverse=True)
for s, n in sums[:16]:
    if s > 0:
        print(f"  {n:60} {s:10.0f}")
klass = defaultdict(float)
def opclass(s):
    op = s.strip().split()[0] if s.strip() else ""
    if op.startswith("@"):
        op = s.strip().split()[1]
    return op.split(".")[0]
for r in body:
    klass[opclass(r[src])] += num(r[samp])
print("by opcode: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in sorted(klass.items(), key=lambda x: -x[1])[:18]))
print(f"top {top} instructions (share of samples):")
order = sorted(range(len(body)), key=lambda i: -num(body[i][samp]))[:top]
for i in sorted(order):
    r = body[i]
    print(f"  {i:5} {100 * num(r[samp]) / total:5.1f}%  {r[src].strip()[:110]}")

if mix:
    ex = next((i for i, c in enumerate(hdr) if c.startswith("Instructions Executed")), None)
    count = lambda r: num(r[ex]) if ex is not None else 0.0
    ops = defaultdict(lambda: [0, 0.0])
    for r in body:
        t = r[src].strip()
        if not t:
            continue
        op = t.split()[1] if t.startswith("@") else t.split()[0]
        ops[op][0] += 1
        ops[op][1] += count(r)
    allx = sum(v[1] for v in ops.values()) or 1.0
    print(f"opcode mix ({sum(v[0] for v in ops.values())} lines, {allx:.4g} warp instructions executed):")
    for op, (n, x) in sorted(ops.items(), key=lambda kv: -kv[1][1])[:60]:
        print(f"  {op:44} lines {n:5}  executed {x:12.4g}  {100 * x / allx:5.1f}%")
    print("HGMMA / QGMMA lines in program order (executed, text):")
    for i, r in enumerate(body):
        t = r[src].strip()
        if "GMMA" in t.split(" ", 2)[0] or (t.startswith("@") and "GMMA" in t.split()[1]):
            print(f"  {i:5} {count(r):10.4g}  {t[:120]}")
