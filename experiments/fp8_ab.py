#!/usr/bin/env python3
"""A/B of builds of the e4m3 forward: usage fp8_ab.py name=libdir ... (env DIMS, POINTS, REPS).
Each grid point is set up once (fp8_check.bench_setup) and every build runs on the same inputs,
interleaved over REPS rounds (median of each build's per-round medians); the first build's
output and lse are the reference the others must equal bit for bit (the same arithmetic in
another schedule), so a faster variant that changed a result is caught here. EXACT=0: builds
that group the keys differently (other key-block widths: other roundings of P and of the online
softmax) only print their largest difference; check each of them with fp8_check.py."""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import kernel_check as kc
import fp8_check as f8
import torch

libs = {}
for a in sys.argv[1:]:
    n, d = a.split("=")
    kc.LIB = os.path.join(d, "libcandle_flash_check.so")
    kc.load_lib()
    libs[n] = kc.lib
names = list(libs)
dev = torch.device("cuda")
dims = [int(x) for x in os.environ.get("DIMS", "128").split(",")]
ns = [int(x) for x in os.environ.get("NS", "512,1024,2048,4096,8192,16384").split(",")]
rounds = int(os.environ.get("ROUNDS", "3"))
exact = int(os.environ.get("EXACT", "1") != "0")
print("D causal N  " + "  ".join(f"{n:>8s}" for n in names) + "  (TF/s)  " +
      "  ".join(f"{n}/{names[0]}" for n in names[1:]), flush=True)
bad = 0
for d in dims:
    for causal in (False, True):
        for N in ns:
            call, (q, k, v, lse, o8), fl = f8.bench_setup(dev, d, causal, N)
            ref = None
            for n in names:  # results first: every build must give the first build's bits
                kc.lib = libs[n]
                o8.fill_(float("nan"))
                lse.fill_(float("nan"))
                kc.check(call(), f"cf_fwd(e4m3) {n}")
                torch.cuda.synchronize()
                if ref is None:
                    ref = (o8.clone(), lse.clone())
                elif not (torch.equal(o8, ref[0]) and torch.equal(lse, ref[1])):
                    bad += exact
                    print(f"  {'MISMATCH' if exact else 'differs:'} {n} at D={d} causal={int(causal)} N={N}: max |do| "
                          f"{(o8.float() - ref[0].float()).abs().max().item():.3g}", flush=True)
            ts = {n: [] for n in names}
            for _ in range(rounds):
                for n in names:
                    kc.lib = libs[n]
                    ts[n].append(kc.median_cuda_time(call))
            med = {n: sorted(ts[n])[len(ts[n]) // 2] for n in names}
            print(f"{d} {int(causal)} {N:5d}  " + "  ".join(f"{fl / med[n] / 1e12:8.0f}" for n in names) + "          " +
                  "  ".join(f"{med[names[0]] / med[n]:.3f}" for n in names[1:]), flush=True)
            del call, q, k, v, lse, o8
print(f"fp8 A/B: {bad} mismatches", flush=True)
sys.exit(1 if bad else 0)
