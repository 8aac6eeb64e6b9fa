#!/usr/bin/env python3
"""PyTorch SDPA (flash / cuDNN / efficient backends) on the same grid as examples/bench.rs,
printing the same JSON keys, with impl = torch-flash, torch-cudnn, torch-efficient, torch-math.

TFLOP/s = 4*B*H*Nq*Nk*D / time (2*B*H*Nq*Nk*(D + Dv) with --dv; halved for causal); bwd counts
2.5x, fwd_bwd 3.5x.
Timing: CUDA events, warm-up first, median of --iters runs.
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "torch-flash": SDPBackend.FLASH_ATTENTION,
    "torch-cudnn": SDPBackend.CUDNN_ATTENTION,
    "torch-efficient": SDPBackend.EFFICIENT_ATTENTION,
    # unfused (S and P in memory): what PyTorch falls back to for shapes no fused backend takes
    "torch-math": SDPBackend.MATH,
}


def ints(s):
    return [int(x) for x in s.split(",")]


WARM_UP_S = 0.05  # as examples/bench.rs WARM_UP_MS: clocks come back up after --rest-ms


def timed(fn, iters):
    warm = time.time()
    while True:
        fn()
        torch.cuda.synchronize()
        if time.time() - warm >= WARM_UP_S:
            break
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="torch-flash,torch-cudnn")
    ap.add_argument("--mode", default="fwd,bwd,fwd_bwd")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--hdim", default="64,128")
    ap.add_argument("--heads", default="16")
    ap.add_argument("--hkv", type=int)
    ap.add_argument("--dv", type=int, help="v's head dim (MLA), when it differs from q's and k's")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--nq", type=int)
    ap.add_argument("--causal", default="both")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rest-ms", type=int, default=0,
                    help="idle this long before each point (examples/bench.rs --rest-ms says why)")
    ap.add_argument("--stamp", action="store_true", help="print each point's start / end (Unix s) to stderr, as examples/bench.rs --stamp")
    a = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    causals = [False, True] if a.causal == "both" else [a.causal == "true"]
    for b_arg in ints(a.batch):
        for h_arg in ints(a.heads):
            for d in ints(a.hdim):
                for nk in ints(a.seqlens):
                    for causal in causals:
                        nq = a.nq or nk
                        b = max(1, a.tokens // nk) if a.tokens else b_arg
                        h = a.hidden // d if a.hidden else h_arg
                        hkv = a.hkv or h
                        # SDPA wants (B, H, N, D); GQA through enable_gqa.
                        q = torch.randn(b, h, nq, d, device="cuda", dtype=dtype, requires_grad=True)
                        k = torch.randn(b, hkv, nk, d, device="cuda", dtype=dtype, requires_grad=True)
                        dv = a.dv or d
                        v = torch.randn(b, hkv, nk, dv, device="cuda", dtype=dtype, requires_grad=True)
                        dout = torch.randn(b, h, nq, dv, device="cuda", dtype=dtype)
                        # SDPA's is_causal is top-left aligned; ours is bottom-right. They agree
                        # when nq == nk, the only causal shapes of this grid.
                        is_causal = causal and nq == nk
                        flops = 2.0 * b * h * nq * nk * (d + dv) * (0.5 if causal else 1.0)
                        for impl in a.impl.split(","):
                            for mode in a.mode.split(","):
                                if a.rest_ms:
                                    torch.cuda.synchronize()
                                    time.sleep(a.rest_ms / 1e3)
                                try:
                                    with sdpa_kernel([BACKENDS[impl]]):
                                        def fwd():
                                            with torch.no_grad():
                                                F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=hkv != h)
                                        out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=hkv != h)

                                        def bwd():
                                            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

                                        def fwd_bwd():
                                            o = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=hkv != h)
                                            torch.autograd.grad(o, (q, k, v), dout)
                                        torch.cuda.reset_peak_memory_stats()
                                        base = torch.cuda.memory_allocated()
                                        t0 = time.time()
                                        ms = timed({"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd_bwd}[mode], a.iters)
                                        if a.stamp:
                                            print(f"point {impl} {mode} {nk} {str(causal).lower()} {d} {t0:.3f} {time.time():.3f}",
                                                  file=sys.stderr, flush=True)
                                        peak = (torch.cuda.max_memory_allocated() - base) / 1e6
                                        del out
                                except Exception as e:  # a backend may not support a shape
                                    print(json.dumps({"impl": impl, "mode": mode, "error": str(e)[:200]}), flush=True)
                                    continue
                                mult = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]
                                kv_bytes = b * nk * hkv * (d + dv) * q.element_size()
                                print(json.dumps({
                                    "impl": impl, "mode": mode, "causal": causal, "dtype": a.dtype,
                                    "b": b, "h": h, "hkv": hkv, "nq": nq, "nk": nk, "d": d, "dv": dv,
                                    "ms": ms, "tflops": flops * mult / (ms * 1e-3) / 1e12, "peak_mb": peak,
                                    "kv_tbps": kv_bytes / (ms * 1e-3) / 1e12,
                                }), flush=True)


if __name__ == "__main__":
    main()
