#!/usr/bin/env python3
"""The SM clock and power that each benchmark point ran at.

Matches `point IMPL MODE NK CAUSAL D START END` lines (examples/bench.rs --stamp, bench/sdpa.py
--stamp) with nvidia-smi samples (`--query-gpu=timestamp,clocks.sm,power.draw --format=csv,
noheader,nounits -lms 50`) and prints, per implementation, the spread of the points' mean SM
clocks: an H100 under sustained load sits at its power cap 10-20% below its top clock, so two
implementations compare fairly only at the same clocks (bench/NOTES.md, seventeenth session).

Usage: clocks.py SMI_CSV STAMP_FILE...
"""
import datetime
import statistics
import sys
import time
from collections import defaultdict


def samples(path):
    out = []
    for line in open(path):
        f = [x.strip() for x in line.split(",")]
        try:
            day, frac = f[0].rsplit(".", 1)
            t = time.mktime(datetime.datetime.strptime(day, "%Y/%m/%d %H:%M:%S").timetuple()) + float("0." + frac)
            out.append((t, float(f[1]), float(f[2])))
        except (ValueError, IndexError):
            pass
    return out


def main():
    smi = samples(sys.argv[1])
    per_impl = defaultdict(list)
    for path in sys.argv[2:]:
        for line in open(path):
            if not line.startswith("point "):
                continue
            _, impl, mode, nk, causal, d, t0, t1 = line.split()
            w = [s for s in smi if float(t0) <= s[0] <= float(t1)]
            if w:
                per_impl[impl].append((statistics.mean(s[1] for s in w), max(s[2] for s in w), f"{mode} d={d} N={nk} causal={causal}"))
    print("| impl | points sampled | SM MHz: min / median / max | lowest point | power W: max |")
    print("|---|---|---|---|---|")
    for impl, pts in sorted(per_impl.items()):
        mhz = sorted(p[0] for p in pts)
        low = min(pts)
        print(f"| {impl} | {len(pts)} | {mhz[0]:.0f} / {statistics.median(mhz):.0f} / {mhz[-1]:.0f} | {low[2]} ({low[0]:.0f}) | {max(p[1] for p in pts):.0f} |")


if __name__ == "__main__":
    main()
