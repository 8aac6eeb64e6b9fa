#!/usr/bin/env python3
"""Draws TFLOP/s against N from benchmark JSON lines (examples/bench.rs and bench/sdpa.py):
one panel per (D, causal, mode), one line per implementation. Also prints the ratio table
(ours / each PyTorch backend present: flash, cuDNN, efficient) for every grid point.

Points timed in several rounds (interleaved with the other implementations, as
scripts/gpu-bench.sh does) keep each implementation's fastest round: the GPU's power cap moves
its clocks by ~10% over seconds, and one slow stretch would otherwise decide a point.

usage: plot.py bench.jsonl out.png [title]
"""
import json
import sys
from collections import defaultdict


def load(path):
    """The rows of the square grid points; a point timed in several rounds (gpu-bench.sh ROUNDS)
    keeps its fastest round, with `rounds` and `spread` (slowest / fastest time) added."""
    best, times = {}, defaultdict(list)
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            r = json.loads(line)
            if "error" not in r and r.get("nq") == r.get("nk"):
                k = tuple(r.get(f) for f in ("impl", "mode", "dtype", "d", "causal", "b", "h", "hkv", "nq", "nk"))
                times[k].append(r["ms"])
                if k not in best or r["ms"] < best[k]["ms"]:
                    best[k] = r
    for k, r in best.items():
        r["rounds"] = len(times[k])
        r["spread"] = max(times[k]) / min(times[k])
    return list(best.values())


TORCH = [("torch-flash", "FA2"), ("torch-cudnn", "cuDNN"), ("torch-efficient", "efficient")]


def ratio_table(rows):
    """One column pair (TF/s, ours / it) per PyTorch backend present (f32 has only efficient)."""
    key = lambda r: (r["mode"], r["d"], r["causal"], r["nk"], r["dtype"])
    by = defaultdict(dict)
    for r in rows:
        by[key(r)][r["impl"]] = r["tflops"]
    present = [(impl, name) for impl, name in TORCH if any(impl in v for v in by.values())]
    print("| mode | d | causal | N | dtype | ours TF/s | " + " | ".join(f"{n} TF/s" for _, n in present) + " | "
          + " | ".join(f"ours/{n}" for _, n in present) + " |")
    print("|---|---|---|---|---|---|" + "---|" * (2 * len(present)))
    for k in sorted(by):
        v = by[k]
        if "flash" not in v:
            continue
        ours = v["flash"]
        f = lambda x: f"{x:.0f}" if x else "-"
        rr = lambda x: f"{ours / x:.2f}" if x else "-"
        print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {k[4]} | {f(ours)} | "
              + " | ".join(f(v.get(i)) for i, _ in present) + " | " + " | ".join(rr(v.get(i)) for i, _ in present) + " |")


def spread_note(rows):
    """How far the rounds of one point lay apart (slowest / fastest), where there were several."""
    multi = [r for r in rows if r.get("rounds", 1) > 1]
    if not multi:
        return
    worst = sorted(multi, key=lambda r: -r["spread"])[:3]
    print(f"\nRounds per point: {max(r['rounds'] for r in multi)}; each implementation's fastest round is shown."
          " Largest spreads (slowest / fastest): "
          + ", ".join(f"{r['impl']} {r['mode']} d={r['d']} N={r['nk']}{' causal' if r['causal'] else ''} {r['spread']:.2f}"
                      for r in worst))


def plot(rows, out, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = sorted({(r["mode"], r["d"], r["causal"]) for r in rows})
    cols = 4
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.6 * nrows), squeeze=False)
    for ax, (mode, d, causal) in zip(axes.flat, panels):
        for impl in sorted({r["impl"] for r in rows}):
            pts = sorted((r["nk"], r["tflops"]) for r in rows if (r["mode"], r["d"], r["causal"], r["impl"]) == (mode, d, causal, impl))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{mode}, D={d}, {'causal' if causal else 'non-causal'}", fontsize=10)
        ax.set_xlabel("N")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    rows = load(sys.argv[1])
    ratio_table(rows)
    spread_note(rows)
    if len(sys.argv) > 2:
        plot(rows, sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "")
