#!/usr/bin/env python3
"""The SM clock and power that each benchmark point ran at.

Matches `point IMPL MODE NK CAUSAL D START END` lines (examples/bench.rs --stamp, bench/sdpa.py
--stamp) with nvidia-smi samples (`--query-gpu=timestamp,clocks.sm,power.draw --format=csv,
noheader,nounits -lms 50`) and prints, per implementation, the spread of the points' mean SM
clocks: an H100 under sustained load sits at its power cap 10-20% below its top clock, so two
implementations compare fairly only at the same clocks (bench/NOTES.md, 2026-11-27, commit 378b375).

Usage: clocks.py SMI_CSV STAMP_FILE...
"""
import datetime
import statistics
import sys
import time
from collections import defaultdict


def samples(path):
    """nvidia-smi `--format=csv,noheader,nounits` lines whose first column is the timestamp, as
    tuples (Unix seconds, then every further column as a float: clocks.sm, power.draw, ... in
    the query's order; a column that is not a number ends the tuple)."""
    return samples_of(open(path))


def samples_of(lines):
    """`samples` of an iterable of lines."""
    out = []
    for line in lines:
        f = [x.strip() for x in line.split(",")]
        try:
            day, frac = f[0].rsplit(".", 1)
            t = time.mktime(datetime.datetime.strptime(day, "%Y/%m/%d %H:%M:%S").timetuple()) + float("0." + frac)
        except (ValueError, IndexError):
            continue
        row = [t]
        for x in f[1:]:
            try:
                row.append(float(x))
            except ValueError:
                break
        if len(row) >= 3:
            out.append(tuple(row))
    return out


def stamps(path):
    """The `point ...` lines of a stamp file as (impl, mode, nk, causal, d, start, end)."""
    out = []
    for line in open(path):
        if line.startswith("point "):
            _, impl, mode, nk, causal, d, t0, t1 = line.split()
            out.append((impl, mode, int(nk), causal == "true", int(d), float(t0), float(t1)))
    return out


def main():
    smi = samples(sys.argv[1])
    per_impl = defaultdict(list)
    for path in sys.argv[2:]:
        for impl, mode, nk, causal, d, t0, t1 in stamps(path):
            w = [s for s in smi if t0 <= s[0] <= t1]
            if w:
                point = f"{mode} d={d} N={nk} causal={str(causal).lower()}"
                per_impl[impl].append((statistics.mean(s[1] for s in w), max(s[2] for s in w), point))
    print("| impl | points sampled | SM MHz: min / median / max | lowest point | power W: max |")
    print("|---|---|---|---|---|")
    for impl, pts in sorted(per_impl.items()):
        mhz = sorted(p[0] for p in pts)
        low = min(pts)
        print(f"| {impl} | {len(pts)} | {mhz[0]:.0f} / {statistics.median(mhz):.0f} / {mhz[-1]:.0f} | {low[2]} ({low[0]:.0f}) | {max(p[1] for p in pts):.0f} |")


if __name__ == "__main__":
    main()
