#!/usr/bin/env python3
"""Where a forward step's time goes: a build with -DCF_FWD_TRACE records clock64() at eight
points of each key block of CTA 0's first tile (sm90/fwd.cu, FwdMainloop::run), per consumer
warpgroup. Prints, per configuration, the mean cycles of each phase over the steady-state
blocks (first 4 and those past the tile's end dropped):
  data   waiting for K(j) / V(j-1) (the producer / TMA)
  turn   waiting for the other warpgroup's GEMM issue (ping-pong)
  iss_S  issuing S(j)
  iss_PV issuing P V(j-1) (and passing the turn)
  S      waiting for S(j) after the issue (the tensor-core queue)
  smax   mask + online softmax of block j
  PV     waiting for P(j-1) V(j-1) after the softmax
  tail   O rescale + conversion of P (up to the next block's first event)
The serial step of e4m3 blocks wider than 224 keys (kSerialPV) has its own eight points; with
--serial the phases are named for it:
  data   waiting for V(j-1) and K(j)
  turn   waiting for the other warpgroup's GEMM issue (ping-pong)
  iss_PV issuing P V(j-1)
  PV     waiting for P V(j-1) to complete (and releasing V)
  iss_S  issuing S(j) (and passing the turn)
  S      waiting for S(j)
  smax   mask + online softmax of block j
  tail   O rescale + conversion of P (up to the next block's first event)
usage: CF_BUILD_DIR=bench/out_trace fwd_trace.py [--serial] [dtype,d,causal,N ...] (dtype bf16 / f16 / e4m3)"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import kernel_check as kc
import torch

kc.load_lib()
NB, NE = 64, 8
read_trace = kc.trace_reader("cf_fwd_trace_read", (4, NB, NE))
dev = torch.device("cuda")
serial = "--serial" in sys.argv
points = [a for a in sys.argv[1:] if a != "--serial"] or ["e4m3,128,0,16384", "bf16,128,0,16384", "bf16,64,0,2048", "bf16,256,0,16384"]
names = (["data", "turn", "iss_PV", "PV", "iss_S", "S", "smax", "tail", "step"] if serial else
         ["data", "turn", "iss_S", "iss_PV", "S", "smax", "PV", "tail", "step"])
print(f"{'point':22s} wg " + " ".join(f"{n:>6s}" for n in names) + "   (cycles per key block, mean)")
for pt in points:
    dt, d, causal, N = pt.split(",")
    d, causal, N = int(d), bool(int(causal)), int(N)
    if dt == "e4m3":
        import fp8_check as f8
        call, _, _ = f8.bench_setup(dev, d, causal, N)
    else:
        c = kc.Case("trace", dt, b=16384 // N, h=2048 // d, sq=N, d=d, wl=-1, wr=(0 if causal else -1))
        q, k, v, _, o, fp, ws, stream = kc.bench_setup(c, dev)
        keep = (q, k, v, o, ws)
        call = lambda: (keep, kc.call_fwd(fp, ws, stream))[1]  # noqa: E731
    for _ in range(3):  # warm up, then the probed call
        kc.check(call(), "cf_fwd")
    read_trace()  # clears what the warm-up calls recorded
    kc.check(call(), "cf_fwd")
    t = read_trace()
    for wg in range(4):
        rows = [j for j in range(4, NB - 1) if t[wg, j, 0] > 0 and t[wg, j + 1, 0] > 0 and t[wg, j, 7] > 0]
        if not rows:
            continue
        ph = torch.stack([torch.stack([t[wg, j, e + 1] - t[wg, j, e] for e in range(7)] +
                                      [t[wg, j + 1, 0] - t[wg, j, 7], t[wg, j + 1, 0] - t[wg, j, 0]])
                          for j in rows]).mean(0)
        print(f"{pt:22s} {wg}  " + " ".join(f"{x:6.0f}" for x in ph.tolist()) + f"   ({len(rows)} blocks)", flush=True)
