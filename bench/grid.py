#!/usr/bin/env python3
"""Timing grid: several builds of the kernels vs SDPA flash (FA2), forward and backward.
usage: grid.py name=libdir[=kernel_check.py] ...  (POINTS='bf16,64,1,512;...' selects points;
a name ending in _det times that build's deterministic backward)
A build of an older C interface is driven by that revision's kernel_check.py (third field), so a
new build and the previous one are timed side by side in one run."""
import ctypes, importlib.util, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # kernel_check.py
import kernel_check as kc
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F

libs, mods = {}, {}
for a in sys.argv[1:]:
    n, d, *mod = a.split("=")
    m = kc
    if mod:  # this build's own harness (its ctypes structs match its flash_api.h)
        spec = importlib.util.spec_from_file_location(f"kc_{n}", mod[0])
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
    m.LIB = os.path.join(d, "libcandle_flash_check.so")
    m.load_lib()
    libs[n], mods[n] = m.lib, m
names = list(libs)


def fwd_call(n, fp, ws, stream):
    """cf_fwd of build n (the workspace argument exists since the caller-provided scratch)."""
    if hasattr(mods[n], "call_fwd"):
        return libs[n].cf_fwd(ctypes.byref(fp), ws, stream)
    return libs[n].cf_fwd(ctypes.byref(fp), stream)
dev = torch.device("cuda")
REPS = int(os.environ.get("REPS", "10"))
FWD_ONLY = os.environ.get("FWD_ONLY") == "1"  # skip the backward timings (printed as nan)
BWD_ONLY = os.environ.get("BWD_ONLY") == "1"  # skip the forward timings (printed as nan)
NO_REF = os.environ.get("NO_REF") == "1"  # skip FA2 and cuDNN (printed as nan): builds against each other
ROUNDS = int(os.environ.get("ROUNDS", "1"))  # the builds' turns per point (see below)
# SUSTAIN=s: each timing is kernel_check.sustained_cuda_time over s seconds (the card at its power
# cap, bench/NOTES.md, 2026-11-27, commit 378b375) instead of a median of REPS calls
SUSTAIN = float(os.environ.get("SUSTAIN", "0"))


def timeit(fn, reps=REPS):
    if SUSTAIN:
        return kc.sustained_cuda_time(fn, SUSTAIN)
    return kc.median_cuda_time(fn, reps, warmup=2)


def references(q, k, v, do, H, HKV, causal, dt, d, N):
    """FA2's and cuDNN's forward and backward seconds (through SDPA) of a point; cuDNN nan where
    it refuses the shape."""
    rep_kv = lambda x: x.repeat_interleave(H // HKV, dim=2) if HKV != H else x  # noqa: E731
    qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, rep_kv(k), rep_kv(v)))
    dot = do.transpose(1, 2).contiguous()
    fwd = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)  # noqa: E731
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        t_sf = float("nan") if BWD_ONLY else timeit(fwd)
        ot = fwd()
        t_sb = float("nan") if FWD_ONLY else timeit(lambda: torch.autograd.grad(ot, (qt, kt, vt), dot, retain_graph=True))
    t_cf = t_cb = float("nan")  # cuDNN refuses some shapes (e.g. head dims on some versions)
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            t_cf = float("nan") if BWD_ONLY else timeit(fwd)
            oc = fwd()
            t_cb = float("nan") if FWD_ONLY else timeit(lambda: torch.autograd.grad(oc, (qt, kt, vt), dot, retain_graph=True))
    except RuntimeError as e:
        print(f"# cudnn refused {dt} d={d} causal={causal} N={N}: {str(e).splitlines()[0][:100]}", flush=True)
    return t_sf, t_sb, t_cf, t_cb


points = []
DIMS = tuple(int(x) for x in os.environ.get("DIMS", "64,128").split(","))  # e.g. DIMS=96,192,256
for dt in ("bf16", "f16"):
    for d in DIMS:
        for causal in (False, True):
            Ns = (512, 1024, 2048, 4096, 8192, 16384) if dt == "bf16" else (2048, 16384)
            for N in Ns:
                points.append((dt, d, causal, N))
# GQA=2048,8192,32768: the Llama-3-8B-like prefill points instead (B = 1, 32 query / 8 KV heads,
# d = 128, causal, bf16); SDPA runs them with K / V repeated to 32 heads (the same products)
GQA = [int(x) for x in os.environ.get("GQA", "").split(",") if x]
if GQA:  # GQA_CAUSAL=0: the same points without the mask
    points = [("bf16", 128, os.environ.get("GQA_CAUSAL", "1") != "0", n) for n in GQA]
if os.environ.get("POINTS"):
    sel = [tuple(x.split(",")) for x in os.environ["POINTS"].split(";")]
    points = [pt for pt in points if (pt[0], str(pt[1]), str(int(pt[2])), str(pt[3])) in sel]
hdr = f"{'dt':4} {'D':>3} {'c':>1} {'N':>5} | fwd TF/s: " + " ".join(f"{n:>6}" for n in names) + " fa2 cudnn | bwd TF/s: " + " ".join(f"{n:>6}" for n in names) + " fa2 cudnn | f+b ratio vs fa2 " + " ".join(names) + " | fwd ratio vs cudnn " + " ".join(names)
print(hdr, flush=True)
for dt, d, causal, N in points:
    B, H, HKV = (1, 32, 8) if GQA else (16384 // N, 2048 // d, 2048 // d)
    c = kc.Case("bench", dt, b=B, h=H, hkv=HKV, sq=N, d=d, wl=-1, wr=(0 if causal else -1))
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do, _ = kc.make_inputs(c, dev, g)
    o = torch.empty_like(q)
    lse = torch.empty(B, H, N, dtype=torch.float32, device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    fl = 4 * B * H * N * N * d * (0.5 if causal else 1.0)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fwd_fn, bwd_fn, keep = {}, {}, []
    for n in names:
        m = mods[n]
        fp = m.fwd_params(c, q, k, v, o, lse, None, None, None)
        fws = m.fwd_workspace(fp, dev) if hasattr(m, "fwd_workspace") else None
        fwp = fws.data_ptr() if fws is not None else None
        fwd_fn[n] = lambda n=n, fp=fp, fwp=fwp: fwd_call(n, fp, fwp, stream)
        # a build named *_det runs the backward in deterministic mode
        bp = kc.bwd_params(fp, do, dq, dk, dv, False, det=n.endswith("_det"), cls=m.CfBwdParams)
        if hasattr(bp, "total_q"):
            bp.total_q, bp.total_k = B * N, B * N
        ws = torch.empty(libs[n].cf_bwd_workspace_size(ctypes.byref(bp)) // 4 + 64, dtype=torch.float32, device=dev)
        bwd_fn[n] = lambda n=n, bp=bp, ws=ws: libs[n].cf_bwd(ctypes.byref(bp), ws.data_ptr(), stream)
        keep += [fp, fws, bp, ws]
    # The builds take turns over ROUNDS rounds (median of their per-round medians), so that a
    # drift of the clocks during the point (heat, power) does not favour the build timed first.
    rf, rb = {n: [] for n in names}, {n: [] for n in names}
    for _ in range(ROUNDS):
        for n in names:
            rf[n].append(float("nan") if BWD_ONLY else timeit(fwd_fn[n]))
            rb[n].append(float("nan") if FWD_ONLY else timeit(bwd_fn[n]))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    tf, tb = {n: med(rf[n]) for n in names}, {n: med(rb[n]) for n in names}
    del keep, fwd_fn, bwd_fn
    t_sf = t_sb = t_cf = t_cb = float("nan")
    if not NO_REF:
        t_sf, t_sb, t_cf, t_cb = references(q, k, v, do, H, HKV, causal, dt, d, N)
    T = lambda t, m=1.0: m * fl / t / 1e12
    print(f"{dt:4} {d:3} {int(causal)} {N:5} | " + " ".join(f"{T(tf[n]):6.0f}" for n in names) + f" {T(t_sf):3.0f} {T(t_cf):5.0f} | " + " ".join(f"{T(tb[n], 2.5):6.0f}" for n in names)
          + f" {T(t_sb, 2.5):3.0f} {T(t_cb, 2.5):5.0f} | " + " ".join(f"{(t_sf + t_sb) / (tf[n] + tb[n]):.2f}" for n in names)
          + " | " + " ".join(f"{t_cf / tf[n]:.2f}" for n in names), flush=True)
    del q, k, v, do, o, lse, dq, dk, dv
