#!/usr/bin/env python3
"""Block-sparse results from JSON lines of examples/block_sparse_bench.rs (impl flash) and
bench/flex_block_sparse.py (impl flex, torch-sdpa), in any files, mixed: draws time against
density for the `density` sweep (forward and backward panels, log-log, ours vs FlexAttention,
each one's dense time as a dashed line) to a PNG, and prints a markdown table of the other
patterns (ours ms, flex ms, flex / ours). A point timed several times keeps its fastest run,
as bench/plot.py does. The table is printed even when matplotlib is missing.

usage: plot_block_sparse.py FILE... [--out bench/results/block-sparse-density.png]
"""
import argparse
import json
import os
import sys

ORDER = ["dense", "dense_causal", "document", "prefix_lm", "window_global", "chunked", "topk", "density"]
LABELS = {"flash": "candle-flash", "flex": "FlexAttention", "torch-sdpa": "SDPA (dense)"}
SHAPE = ("dtype", "b", "h", "n", "d")


def load(paths):
    """The fastest row of each point, and the points that only errored."""
    best, errors = {}, {}
    for path in paths:
        for line in open(path):
            line = line.strip()
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if "pattern" not in r:
                continue
            key = (r.get("impl"), r["pattern"], r.get("mode"), r.get("k")) + tuple(r.get(f) for f in SHAPE)
            if "error" in r:
                errors[key] = r["error"]
            elif key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    return best, {k: e for k, e in errors.items() if k not in best}


def table(best, errors):
    """pattern | mode | ours ms | flex ms | flex / ours, for every pattern but the density sweep."""
    points = {}
    for key in list(best) + list(errors):
        impl, pattern, mode, _k = key[:4]
        if pattern != "density" and impl in ("flash", "flex"):
            points.setdefault((pattern, mode) + key[4:], {})[impl] = best[key]["ms"] if key in best else None
    shapes = {p[2:] for p in points}
    extra = len(shapes) > 1  # files with several shapes: say which row is which
    head = "| pattern | mode | " + ("dtype | b | h | n | d | " if extra else "") + "ours ms | flex ms | flex / ours |"
    print(head)
    print("|" + "---|" * head.count(" | ") + "---|")
    rank = lambda p: (ORDER.index(p[0]) if p[0] in ORDER else len(ORDER), p[0], p[1] != "fwd", p[2:])
    for p in sorted(points, key=rank):
        v = points[p]
        ms = lambda impl: ("error" if v[impl] is None else f"{v[impl]:.3f}") if impl in v else "-"
        ratio = f"{v['flex'] / v['flash']:.2f}" if v.get("flash") and v.get("flex") else "-"
        cols = " | ".join(str(x) for x in p[2:]) + " | " if extra else ""
        print(f"| {p[0]} | {p[1]} | {cols}{ms('flash')} | {ms('flex')} | {ratio} |")
    if not points:
        print("(no rows of the fixed patterns)")
    if shapes:
        print("\nshape: " + "; ".join(", ".join(f"{f} {x}" for f, x in zip(SHAPE, s)) for s in sorted(shapes, key=str)))


def plot(best, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        sys.exit(f"matplotlib is not installed (pip install matplotlib): no plot written to {out}")
    rows = list(best.values())
    sweep = [r for r in rows if r["pattern"] == "density"]
    if not sweep:
        sys.exit("no rows of the density pattern: no plot written")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, mode in zip(axes, ("fwd", "bwd")):
        for impl, style in (("flash", "o-"), ("flex", "s-")):
            pts = sorted((100 * r["density"], r["ms"]) for r in sweep if r["impl"] == impl and r["mode"] == mode)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=LABELS[impl])
        for impl, color in (("flash", "C0"), ("flex", "C1"), ("torch-sdpa", "C2")):
            dense = [r["ms"] for r in rows if r["impl"] == impl and r["pattern"] == "dense" and r["mode"] == mode]
            if dense:
                label = LABELS[impl] if impl == "torch-sdpa" else f"{LABELS[impl]} dense"
                ax.axhline(min(dense), color=color, ls="--", lw=1, label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        xs = sorted({100 * r["density"] for r in sweep})
        ax.set_xticks(xs, [f"{x:.3g}" for x in xs])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("density (% of the 128 x 128 blocks visited)")
        ax.set_ylabel("ms")
        ax.set_title({"fwd": "forward", "bwd": "backward"}[mode])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    r0 = sweep[0]
    fig.suptitle(f"block-sparse attention: {r0['dtype']}, B={r0['b']}, H={r0['h']}, N={r0['n']}, D={r0['d']}, "
                 "random key blocks per query block")
    fig.tight_layout()
    if os.path.dirname(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"\nwrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="JSON lines (both impls, mixed)")
    ap.add_argument("--out", default="bench/results/block-sparse-density.png")
    a = ap.parse_args()
    best, errors = load(a.files)
    table(best, errors)
    plot(best, a.out)


if __name__ == "__main__":
    main()
