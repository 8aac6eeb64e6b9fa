#!/usr/bin/env python3
"""Our CPU attention against PyTorch's CPU SDPA (the flash backend,
`_scaled_dot_product_flash_attention_for_cpu`), back to back, same thread count.

For every point (dtype, N, causal, mode) of every round: ours (examples/bench.rs in a
subprocess, RAYON_NUM_THREADS=threads), then torch (torch.set_num_threads(threads), in this
process), each timed as the median of --iters runs after a warm-up. Per point the ratio is
torch_ms / ours_ms (> 1: ours faster); the table gives the median over rounds and the range
(min-max of the per-round ratios), because the machine is shared and noisy. B=1, H=8, D=64 by
default; fwd_bwd is the forward followed by the backward with a given output gradient on both
sides (torch.autograd.grad).

usage (torch from PyPI in a scratch venv outside the repo; CUDA is never used):
    python3 -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch matplotlib
    cargo build --release --example bench
    /tmp/torchvenv/bin/python bench/cpu_vs_torch.py --bench target/release/examples/bench \
        --rounds 3 --out bench/results/cpu-vs-torch-<cpu-kind>   (e.g. -zen4, -xeon-amx)

Writes OUT.jsonl (every timing), OUT.md (the ratio table) and OUT.png (ratio against N).
"""
import argparse
import json
import os
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def cpu_description():
    """The CPU's model name and the features that pick our kernels (AMX, AVX-512 BF16 / F, AVX2),
    from /proc/cpuinfo: results differ by machine, and the table should say which ran it."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return "CPU unknown"
    model = next((l.split(":", 1)[1].strip() for l in info.splitlines() if l.startswith("model name")), "CPU unknown")
    flags = next((l.split(":", 1)[1].split() for l in info.splitlines() if l.startswith("flags")), [])
    isa = [name for flag, name in [("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512F"),
                                   ("avx2", "AVX2")] if flag in flags]
    return f"{model} ({', '.join(isa) or 'no AVX2'})"


def torch_ms(dtype, n, causal, mode, iters, b, h, d):
    dt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    q, k, v, dout = (torch.randn(b, h, n, d, dtype=dt) for _ in range(4))
    grad = mode == "fwd_bwd"
    for t in (q, k, v):
        t.requires_grad_(grad)
    scale = 1.0 / d**0.5

    def run():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            if grad:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
                torch.autograd.grad(o, (q, k, v), dout)
            else:
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    run()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def ours_ms(bench, dtype, n, causal, mode, iters, b, h, d, threads):
    cmd = [bench, "--device", "cpu", "--impl", "flash", "--mode", mode, "--seqlens", str(n),
           "--causal", str(causal).lower(), "--dtype", dtype, "--iters", str(iters),
           "--batch", str(b), "--heads", str(h), "--hdim", str(d)]
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    for line in res.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)["ms"]
    raise RuntimeError(f"no result from {' '.join(cmd)}:\n{res.stdout}\n{res.stderr}")


def iters_for(iters, n):
    """Runs per point: `iters` from N = 2048 up, more below (the work falls as N^2), so that a
    point of a fraction of a millisecond is not timed on its first, cold calls."""
    return min(200, max(iters, round(iters * (2048 / n) ** 2)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", default="target/release/examples/bench")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3,
                    help="runs per point at N >= 2048; shorter points get iters * (2048/N)^2 (at most 200),"
                         " the same on both sides, so that each point is timed in steady state")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--seqlens", default="256,1024,2048,4096")
    ap.add_argument("--modes", default="fwd,fwd_bwd")
    ap.add_argument("--causal", default="false,true")
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--h", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--label", default="", help="recorded with every timing (e.g. the ISA forced)")
    ap.add_argument("--out", default="/tmp/cpu-vs-torch")  # a record: bench/results/cpu-vs-torch-<cpu-kind>
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    points = [(dt, n, c == "true", m) for dt in a.dtypes.split(",") for m in a.modes.split(",")
              for n in map(int, a.seqlens.split(",")) for c in a.causal.split(",")]
    rows = []
    with open(a.out + ".jsonl", "w") as log:
        for rnd in range(a.rounds):
            for dt, n, causal, mode in points:
                iters = iters_for(a.iters, n)
                ours = ours_ms(a.bench, dt, n, causal, mode, iters, a.b, a.h, a.d, a.threads)
                theirs = torch_ms(dt, n, causal, mode, iters, a.b, a.h, a.d)
                flops = 4.0 * a.b * a.h * n * n * a.d * (0.5 if causal else 1.0) * (3.5 if mode == "fwd_bwd" else 1.0)
                row = {"round": rnd, "dtype": dt, "n": n, "causal": causal, "mode": mode, "ours_ms": ours,
                       "torch_ms": theirs, "ratio": theirs / ours, "ours_gflops": flops / ours / 1e6,
                       "torch_gflops": flops / theirs / 1e6, "threads": a.threads, "label": a.label,
                       "torch": torch.__version__}
                rows.append(row)
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(f"round {rnd} {dt} N={n} causal={causal} {mode}: ours {ours:.2f} ms, torch {theirs:.2f} ms,"
                      f" ratio {theirs / ours:.2f}", flush=True)
    table = ratio_table(rows, a)
    open(a.out + ".md", "w").write(table)
    print(table)
    plot(rows, a.out + ".png", a)


def summarise(rows):
    by = {}
    for r in rows:
        by.setdefault((r["dtype"], r["mode"], r["causal"], r["n"]), []).append(r)
    return by


def ratio_table(rows, a):
    lines = [f"torch {torch.__version__} CPU SDPA (flash backend) vs ours, {a.threads} threads, B={a.b}, H={a.h}, "
             f"D={a.d}, {a.rounds} rounds back to back, median of {a.iters} runs each (more below N = 2048: iters_for), "
             f"{cpu_description()}{', ' + a.label if a.label else ''}."
             " ratio = torch time / our time (> 1: ours faster): median over rounds [min-max].", "",
             "| dtype | mode | causal | N | ours GFLOP/s | torch GFLOP/s | ratio | range | target |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (dt, mode, causal, n), rs in sorted(summarise(rows).items()):
        ratios = [r["ratio"] for r in rs]
        med = statistics.median(ratios)
        target = 1.2 if n >= 1024 else 1.0
        lines.append(f"| {dt} | {mode} | {causal} | {n} | {statistics.median(r['ours_gflops'] for r in rs):.1f} | "
                     f"{statistics.median(r['torch_gflops'] for r in rs):.1f} | {med:.2f} | "
                     f"{min(ratios):.2f}-{max(ratios):.2f} | {'met' if med >= target else 'MISSED'} (>= {target}) |")
    return "\n".join(lines) + "\n"


def plot(rows, path, a):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    by = summarise(rows)
    dtypes = sorted({k[0] for k in by})
    modes = sorted({k[1] for k in by})
    fig, axes = plt.subplots(len(dtypes), len(modes), figsize=(5 * len(modes), 3.6 * len(dtypes)), squeeze=False)
    for i, dt in enumerate(dtypes):
        for j, mode in enumerate(modes):
            ax = axes[i][j]
            for causal in (False, True):
                pts = sorted((k[3], [r["ratio"] for r in v]) for k, v in by.items()
                             if k[0] == dt and k[1] == mode and k[2] == causal)
                if not pts:
                    continue
                ns = [p[0] for p in pts]
                med = [statistics.median(p[1]) for p in pts]
                lo = [m - min(p[1]) for m, p in zip(med, pts)]
                hi = [max(p[1]) - m for m, p in zip(med, pts)]
                ax.errorbar(ns, med, yerr=[lo, hi], marker="o", capsize=3, label="causal" if causal else "full")
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.axhline(1.2, color="gray", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{dt} {mode}")
            ax.set_xlabel("N")
            ax.set_ylabel("torch time / ours")
            ax.legend()
    fig.suptitle(f"candle-flash CPU vs torch {torch.__version__} SDPA, {a.threads} threads, B={a.b} H={a.h} D={a.d}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
