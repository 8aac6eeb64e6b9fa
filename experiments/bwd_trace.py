#!/usr/bin/env python3
"""Where a backward step's time goes (the sm_90a d = 64 / 128 kernel, sm90/bwd.cuh): a build with
-DCF_BWD_TRACE records clock64() at twelve points of each step (query block) of the CTA at
blockIdx (1, 0, 0), per consumer warpgroup, in its bf16 instances. Prints the mean cycles of
each phase over the steady-state steps (the first 4 and the last dropped):
  data   waiting for the step's Q / dO / lse / dsum (and warp 0's lse / dsum copy of the next)
  issSd  issuing S^T and dP^T
  S      waiting for S^T (the tensor-core queue: both warpgroups' S^T, dP^T)
  P      P^T: exponentials and mask (while dP^T runs)
  dP     waiting for dP^T after P^T
  dS/iss dS^T, packing P^T / dS^T, issuing dV and dK
  stDS   dS^T to shared memory
  barDS  waiting for the other warpgroup's dS^T (named barrier)
  dQ     issuing dQ and waiting for every product of the step (dV, dK, dQ)
  stage  the dQ tile: wait for the previous reduction's read, stores, bulk reduction
  tail   release (up to the next step's first point)
usage: CF_BUILD_DIR=bench/out_btrace bwd_trace.py [d,causal,N ...]
(build: CF_BUILD_DIR=bench/out_btrace CF_NVCC_FLAGS="-DCF_BWD_TRACE" kernel_check.py --build-only)"""
import ctypes, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import kernel_check as kc
import torch

kc.load_lib()
NS, NE = 64, 12
read_trace = kc.trace_reader("cf_bwd_trace_read", (2, NS, NE))
dev = torch.device("cuda")
points = sys.argv[1:] or ["128,0,8192", "128,0,16384", "64,0,8192"]
# (name, from event, to event); "tail" ends at the next step's event 0
phases = [("data", 0, 1), ("issSd", 1, 2), ("S", 2, 3), ("P", 3, 4), ("dP", 4, 5), ("dS/iss", 5, 6),
          ("stDS", 6, 7), ("barDS", 7, 8), ("dQ", 8, 9), ("stage", 9, 10), ("tail", 10, 11)]
# The wide kernel (d = 192 / 256, sm90/bwd_wide.cuh; events 8 and 10 at d = 256 only): warpgroup 0
# computes S^T, waits for warpgroup 1's dP^T (xchg), P^T / dS^T (pds), stores them and issues the
# next step's loads (stPdS); warpgroup 1 computes dP^T, stores it (xchg) and waits (barDS).
narrow_phases = phases
wide_phases = [("data", 0, 1), ("SdP", 1, 2), ("rel", 2, 3), ("xchg", 3, 4), ("pds", 4, 5), ("stPdS", 5, 6),
               ("barDS", 6, 7), ("dVKQ", 7, 8), ("barRd", 8, 9), ("stage", 9, 10), ("-", 10, 11)]
print(f"{'point':16s} wg " + " ".join(f"{n:>6s}" for n in [p[0] for p in phases] + ["next", "step"]) +
      "   (cycles per step, mean)")
print(f"{'  (d >= 192)':16s}    " + " ".join(f"{n:>6s}" for n in [p[0] for p in wide_phases]))
for pt in points:
    d, causal, N = (int(x) for x in pt.split(","))
    phases = wide_phases if d >= 192 else narrow_phases
    c = kc.Case("trace", "bf16", b=16384 // N, h=2048 // d, sq=N, d=d, wl=-1, wr=(0 if causal else -1))
    q, k, v, do, o, fp, fws, stream = kc.bench_setup(c, dev)
    kc.check(kc.call_fwd(fp, fws, stream), "cf_fwd")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    bp = kc.bwd_params(fp, do, dq, dk, dv, False)
    ws = torch.empty(kc.lib.cf_bwd_workspace_size(ctypes.byref(bp)) // 4 + 64, dtype=torch.float32, device=dev)
    for _ in range(3):  # warm up, then the probed call
        kc.check(kc.lib.cf_bwd(ctypes.byref(bp), ws.data_ptr(), stream), "cf_bwd")
    read_trace()  # clears what the warm-up calls recorded
    kc.check(kc.lib.cf_bwd(ctypes.byref(bp), ws.data_ptr(), stream), "cf_bwd")
    t = read_trace()
    for wg in range(2):
        rows = [s for s in range(4, NS - 1) if t[wg, s + 1, 0] > 0 and (t[wg, s] > 0).all()]
        if not rows:
            print(f"{pt:16s} {wg}  (no complete steps)")
            continue
        ph = torch.stack([torch.stack([t[wg, s, b] - t[wg, s, a] for _, a, b in phases] +
                                      [t[wg, s + 1, 0] - t[wg, s, 11], t[wg, s + 1, 0] - t[wg, s, 0]])
                          for s in rows]).mean(0)
        print(f"{pt:16s} {wg}  " + " ".join(f"{x:6.0f}" for x in ph.tolist()) + f"   ({len(rows)} steps)", flush=True)
    # How far warpgroup 1's steps start after warpgroup 0's (same SM clock): 0 in lockstep, about
    # half a step when one's elementwise work runs under the other's products
    both = [s for s in range(4, NS - 1) if t[0, s, 0] > 0 and t[1, s, 0] > 0 and t[0, s + 1, 0] > 0]
    if both:
        lag = torch.stack([t[1, s, 0] - t[0, s, 0] for s in both]).double()
        step = torch.stack([t[0, s + 1, 0] - t[0, s, 0] for s in both]).double()
        print(f"{pt:16s}    warpgroup 1 starts its steps {lag.mean():.0f} cycles after warpgroup 0 "
              f"(min {lag.min():.0f}, max {lag.max():.0f}; {(lag / step).mean():.2f} of a step)", flush=True)
