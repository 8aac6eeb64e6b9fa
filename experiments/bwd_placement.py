#!/usr/bin/env python3
"""Does the backward's speed depend on where its buffers lie? (bench/NOTES.md, 2026-11-27,
commit 2031cb3: the crate's fwd+bwd / bwd at 16k run 9-17% slower after a long history of shapes in one
process than alone.) Times cf_bwd of one build with its workspace, and then dq / dk / dv, moved
by several offsets inside larger allocations; builds nothing.

usage: CF_BUILD_DIR=bench/out_x python3 experiments/bwd_placement.py
  (POINTS='64,0,16384;128,1,16384', OFFSETS='0,256,...' bytes, WHAT='workspace;dq,dk,dv', PASSES=1)
"""
import ctypes, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import kernel_check as kc
import torch

kc.load_lib()
lib = kc.lib
dev = torch.device("cuda")
OFFSETS = [int(x) for x in os.environ.get("OFFSETS", "0,256,4096,65536,1048576,2097408").split(",")]  # bytes
points = [tuple(int(x) for x in p.split(",")) for p in os.environ.get("POINTS", "64,0,16384;128,1,16384").split(";")]


def shifted(like, off):
    """A tensor shaped like `like` whose data starts `off` bytes into a larger allocation."""
    n = like.numel() * like.element_size()
    raw = torch.empty(n + off + 4096, dtype=torch.uint8, device=dev)
    return raw[off:off + n].view(like.dtype).view(like.shape), raw


print(f"{'d':>3} {'c':>1} {'N':>5} {'what':>10} " + " ".join(f"{o:>9}" for o in OFFSETS) + "   (bwd ms; offsets in bytes)", flush=True)
for d, causal, N in points:
    B, H = 16384 // N, 2048 // d
    c = kc.Case("bench", "bf16", b=B, h=H, hkv=H, sq=N, d=d, wl=-1, wr=(0 if causal else -1))
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do, _ = kc.make_inputs(c, dev, g)
    o = torch.empty_like(q)
    lse = torch.empty(B, H, N, dtype=torch.float32, device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    fp = kc.fwd_params(c, q, k, v, o, lse, None, None, None)
    fws = kc.fwd_workspace(fp, dev) if hasattr(kc, "fwd_workspace") else None
    lib.cf_fwd(ctypes.byref(fp), fws.data_ptr() if fws is not None else None, stream)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for what in os.environ.get("WHAT", "workspace;dq,dk,dv").split(";") * int(os.environ.get("PASSES", "1")):
        row = []
        for off in OFFSETS:
            keep = []
            if what == "dq,dk,dv":
                (dq_, r1), (dk_, r2), (dv_, r3) = shifted(dq, off), shifted(dk, off), shifted(dv, off)
                keep += [r1, r2, r3]
            else:
                dq_, dk_, dv_ = dq, dk, dv
            bp = kc.bwd_params(fp, do, dq_, dk_, dv_, False)
            if hasattr(bp, "total_q"):
                bp.total_q, bp.total_k = B * N, B * N
            size = lib.cf_bwd_workspace_size(ctypes.byref(bp))
            wraw = torch.empty(size + (off if what == "workspace" else 0) + 4096, dtype=torch.uint8, device=dev)
            wptr = wraw.data_ptr() + (off if what == "workspace" else 0)
            keep += [bp, wraw]
            row.append(1e3 * kc.median_cuda_time(lambda: lib.cf_bwd(ctypes.byref(bp), wptr, stream), 10, warmup=2))
            del keep
        print(f"{d:3} {causal:1} {N:5} {what:>10} " + " ".join(f"{t:9.3f}" for t in row), flush=True)
