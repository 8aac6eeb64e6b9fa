#!/usr/bin/env python3
"""The FP8 (e4m3) forward of the sm_90a kernels, checked and timed without Rust, through
bench/kernel_check.py's library and harness.

Check: e4m3 q, k, v with f32 descales (FlashAttention-3's (B, Hkv) descales, or one per query
head for q), our cf_fwd (o in bf16 or f16, lse) against the f64 reference on the dequantized
inputs. Tolerance: 2x the error of the naive FP8 computation (f32 math on the same inputs with
the unnormalised P rounded to e4m3 before P V, FlashAttention-3's recipe) plus one output
rounding (lse: plus 2^-11 of its size, the FP8 MMA's accumulation); NaN fails; outputs and the
workspace are NaN-poisoned before every call.
Bench: TFLOP/s of our e4m3 forward (its V transpose included) against our bf16 forward and
cuDNN's bf16 SDPA on the same shapes (B*N = 16384, hidden 2048, CUDA events, median of 20), and
with --cudnn-fp8 against cuDNN's own FP8 forward (cudnn-frontend's sdpa_fp8, carried as a wheel:
it is not in the device image) on the same e4m3 tensors, with the mean SM clock of each timing
(NVML, sampled every 2 ms) and the share of the e4m3 tensor-core peak at that clock.

  python3 bench/fp8_check.py [--no-build] [--bench] [--filter S]
"""
import argparse
import ctypes
import math
import os
import sys
import time
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_check as kc  # noqa: E402

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
OUT_DT = {"bf16": (torch.bfloat16, kc.CF_BF16), "f16": (torch.float16, kc.CF_F16)}


def quantize(c, x, groups, side):
    """x [b, s, H, d] (or varlen [total, H, d]; side "q" or "k" picks the lengths) -> (e4m3 data,
    descale (B, groups) f32, dequantized f32): one descale per (sequence, group of H / groups
    consecutive heads)."""
    H = x.shape[-2]
    per = H // groups
    lens = [a if side == "q" else b for a, b in c.varlen] if c.varlen else None
    xs = [x[i] for i in range(c.b)] if not c.varlen else list(torch.split(x, lens, 0))
    ds = torch.ones(c.b, groups, dtype=torch.float32, device=x.device)
    for i, xi in enumerate(xs):  # xi [s, H, d]
        if xi.numel():
            amax = xi.float().abs().reshape(xi.shape[0], groups, per, -1).amax(dim=(0, 2, 3))
            ds[i] = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    rows = []
    for i, xi in enumerate(xs):
        rows.append(ds[i].repeat_interleave(per)[None, :, None].expand(xi.shape[0], H, 1))
    row = torch.stack(rows) if not c.varlen else torch.cat(rows)
    q8 = (x.float() / row).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q8, ds, q8.float() * row


def descale_arg(ds, heads):
    """CfDescale for descales (B, G) of a tensor indexed by `heads` heads (query heads for q)."""
    d = kc.CfDescale()
    if ds is not None:
        d.ptr, d.batch_stride, d.head_div = ds.data_ptr(), ds.stride(0), heads // ds.shape[1]
    return d


class Fp8Case(kc.Case):
    def __init__(self, name, out="bf16", q_groups="kv", descales=True, kgrow=None, vnan=None, **kw):
        super().__init__(name, out, bwd=False, **kw)
        self.q_groups, self.descales = q_groups, descales
        # packed varlen key rows whose V is set to e4m3 NaN (and to 0 in the reference): rows
        # that no query of their own sequence sees (a window), but that the previous sequence's
        # last key block reads past its end, where V^T must be written as zeros (P is 0 there,
        # and 0 * NaN would poison that sequence's rows)
        self.vnan = vnan
        assert vnan is None or self.varlen
        # (first, last, factor): keys [first, last) scaled by factor ramping down to 1 at key
        # `last`, so that the scores' max rises as the kernel walks the keys backwards (the last
        # key block first): the online softmax rescales O and l by large corrections at every
        # block (a lazy softmax tried on 2026-11-27 (commit 338d0cf) had to redo such blocks)
        self.kgrow = kgrow
        assert kgrow is None or not self.varlen, "kgrow scales the key axis of [b, s, h, d] inputs"


def cases():
    C = Fp8Case
    out = []
    for d in (64, 128, 256):
        out += [C(f"d{d}", d=d), C(f"d{d}-causal", d=d, wr=0),
                C(f"d{d}-1023", b=1, h=2, sq=1023, d=d, wr=0)]
    out += [
        C("d96", d=96), C("d192-causal", d=192, wr=0), C("d16", d=16), C("d48", d=48, wr=0),
        C("one", b=1, h=2, sq=1, d=128), C("s17", sq=17, d=128), C("s17-d256", sq=17, d=256, wr=0),
        C("sq113-sk17-causal", sq=113, sk=17, d=128, wr=0),  # rows that see no key
        C("sq17-sk1023", sq=17, sk=1023, d=128), C("sq17-sk1023-causal", sq=17, sk=1023, d=256, wr=0),
        C("gqa-8-2", h=8, hkv=2, d=128, wr=0), C("mqa-4-1", h=4, hkv=1, d=256),
        C("q-per-head", h=8, hkv=2, d=128, q_groups="h"),
        C("window", sq=300, d=128, wl=32, wr=8), C("window-left", sq=300, d=256, wl=64, wr=-1),
        C("softcap", d=128, softcap=30.0, qmul=4.0), C("alibi-bh", d=128, alibi="bh", wr=0),
        C("alibi-h-d256", d=256, alibi="h"),
        C("f16-out", out="f16", d=128, wr=0), C("f16-out-d256", out="f16", d=256),
        C("no-descales", d=128, descales=False), C("bhsd", d=128, layout="bhsd", wr=0),
        C("varlen", h=4, d=128, varlen=[(1, 1), (17, 200), (113, 113), (300, 129)]),
        C("varlen-causal", h=8, hkv=2, d=128, wr=0, varlen=[(5, 300), (130, 130), (1, 0), (64, 257)]),
        C("varlen-d256", h=4, d=256, varlen=[(200, 17), (129, 385), (33, 1)], wr=0),
        # NaN in V rows 200, 201 (keys 0, 1 of the second sequence, outside its window): the
        # first sequence's last key block (keys 128..255 of a 200-key sequence) reads them
        C("varlen-nan-v", h=4, d=128, wl=32, wr=0, varlen=[(17, 200), (5, 600)], vnan=[200, 201]),
        C("varlen-nan-v-d256", h=4, d=256, wl=32, wr=0, varlen=[(17, 200), (5, 600)], vnan=[200, 201]),
        C("big", b=1, h=4, sq=2048, d=128, wr=0),
        # from 4096 queries and keys the d <= 128 tile runs 192-key blocks (fwd_fp8_long)
        C("long-causal", b=1, h=2, sq=4133, d=128, wr=0), C("long-sq-sk", b=1, h=2, sq=4096, sk=4385, d=96),
        C("long-varlen", h=2, hkv=1, d=128, wr=0, varlen=[(4100, 4200), (17, 385), (4096, 4097), (300, 1)]),
        # rising maxima: the max rises by 2^8 and more at every 256-key block / a sink of 16 keys
        # at the start
        C("long-rising", b=1, h=2, sq=4133, d=128, kgrow=(0, 4133, 48.0)),
        C("long-rising-causal", b=1, h=2, sq=4133, d=128, wr=0, kgrow=(0, 4133, 48.0)),
        C("long-sink", b=1, h=2, sq=4096, sk=4385, d=128, kgrow=(0, 16, 12.0)),
    ]
    return out


def run_fp8(c, q8, k8, v8, dq, dk, dv, slopes, cu_q, cu_k):
    """Our e4m3 forward: (o, lse), poisoned before the call."""
    dev = q8.device
    dt = OUT_DT[c.dtype][0]
    o = torch.full(q8.shape, float("nan"), dtype=dt, device=dev)
    total_q = q8.shape[0] if c.varlen else c.b * c.sq
    lse = (torch.full((c.h, total_q), float("nan"), device=dev) if c.varlen
           else torch.full((c.b, c.h, c.sq), float("nan"), device=dev))
    fp = kc.fwd_params(c, q8, k8, v8, o, lse, slopes, cu_q, cu_k)
    fp.dtype, fp.o_dtype = kc.CF_E4M3, OUT_DT[c.dtype][1]
    fp.q_descale, fp.k_descale, fp.v_descale = descale_arg(dq, c.h), descale_arg(dk, c.hkv), descale_arg(dv, c.hkv)
    kc.check(kc.lib.cf_fwd_check(ctypes.byref(fp)), "cf_fwd_check")
    ws = kc.fwd_workspace(fp, dev)
    kc.check(kc.call_fwd(fp, ws, torch.cuda.current_stream().cuda_stream), "cf_fwd(e4m3)")
    torch.cuda.synchronize()
    return o, lse


def cu_of(c, dev):
    if not c.varlen:
        return None, None
    cq = torch.tensor([0] + list(torch.tensor([a for a, _ in c.varlen]).cumsum(0)), dtype=torch.int32, device=dev)
    ck = torch.tensor([0] + list(torch.tensor([b for _, b in c.varlen]).cumsum(0)), dtype=torch.int32, device=dev)
    return cq, ck


def run_case(c, dev, gen):
    q, k, v, _, slopes = kc.make_inputs(c, dev, gen)  # bf16 / f16 values, any layout
    if c.kgrow:
        first, last, factor = c.kgrow
        f = torch.ones(k.shape[1], device=dev)
        f[first:last] = torch.linspace(factor, 1.0, last - first, device=dev)
        k = (k.float() * f[None, :, None, None]).to(k.dtype)
    qg = c.hkv if c.q_groups == "kv" else c.h
    q8, dq, qd = quantize(c, q, qg, "q")
    k8, dk, kd = quantize(c, k, c.hkv, "k")
    v8, dv, vd = quantize(c, v, c.hkv, "k")
    if c.vnan:
        rows = torch.tensor(c.vnan, device=dev)
        v8[rows] = float("nan")
        vd[rows] = 0.0
    if not c.descales:  # plain casts: randn values are far inside e4m3's range
        q8, k8, v8 = (x.float().to(E4M3) for x in (q, k, v))
        qd, kd, vd = (x.float() for x in (q8, k8, v8))
        dq = dk = dv = None
    if c.layout == "bhsd":  # keep the strided [b, h, s, d] storage
        q8, k8, v8 = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q8, k8, v8))
    cu_q, cu_k = cu_of(c, dev)
    o, lse = run_fp8(c, q8, k8, v8, dq, dk, dv, slopes, cu_q, cu_k)
    zero = torch.zeros_like(qd)
    ref = kc.reference(c, qd, kd, vd, zero, slopes, torch.float64, False)
    naive = kc.reference(c, qd, kd, vd, zero, slopes, torch.float32, False,
                         p_quant=lambda e: e.to(E4M3).to(e.dtype))
    e_o, n_o = kc.maxerr(kc.split_like(c, o, "q"), ref[0]), kc.maxerr(naive[0], ref[0])
    e_l, n_l = kc.lse_err(kc.split_lse(c, lse), ref[1]), kc.lse_err(naive[1], ref[1])
    tol_o = 2 * n_o + 2.0 ** -8 * max(kc.absmax(ref[0]), 1e-3)
    # Hopper's FP8 MMA accumulates with fewer bits than f32 (about 2^-13 relative to the running
    # sum: DeepSeek-V3 measured ~14 bits), so S, and with it lse, carries an error relative to the
    # logits' size that the f32 naive computation does not have
    lmax = max([r[torch.isfinite(r)].abs().max().item() for r in ref[1] if torch.isfinite(r).any()] + [0.0])
    tol_l = 2 * n_l + 2.0 ** -11 * (1.0 + lmax)
    ok = e_o == e_o and e_o <= tol_o and e_l == e_l and e_l <= tol_l
    rel = (sum(((a.double() - r).norm() ** 2).item() for a, r in zip(kc.split_like(c, o, "q"), ref[0])) /
           max(sum((r.norm() ** 2).item() for r in ref[0]), 1e-30)) ** 0.5
    worst = max(e_o / tol_o if e_o == e_o else math.inf, e_l / tol_l if e_l == e_l else math.inf)
    return ok, worst, f"o:{e_o:.2e}/{tol_o:.1e} lse:{e_l:.2e}/{tol_l:.1e} |err|/|ref|={rel:.2e}"


def bench_setup(dev, d, causal, N):
    """(call, fl): one e4m3 forward of the bench grid point and its flop count."""
    B, H = 16384 // N, 2048 // d
    c = Fp8Case("bench", b=B, h=H, sq=N, d=d, wr=(0 if causal else -1))
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, _, _ = kc.make_inputs(c, dev, g)
    q8, dq, _ = quantize(c, q, H, "q")
    k8, dk, _ = quantize(c, k, H, "k")
    v8, dv, _ = quantize(c, v, H, "k")
    o8 = torch.empty(q.shape, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(B, H, N, device=dev)
    fp = kc.fwd_params(c, q8, k8, v8, o8, lse, None, None, None)
    fp.dtype, fp.o_dtype = kc.CF_E4M3, kc.CF_BF16
    fp.q_descale, fp.k_descale, fp.v_descale = descale_arg(dq, H), descale_arg(dk, H), descale_arg(dv, H)
    stream = torch.cuda.current_stream().cuda_stream
    keep = (q8, k8, v8, dq, dk, dv, o8, lse)
    wss = {}  # workspace per loaded library (fp8_ab.py: builds may need different sizes)

    def call():
        _ = keep
        if id(kc.lib) not in wss:
            wss[id(kc.lib)] = kc.fwd_workspace(fp, dev)
        return kc.call_fwd(fp, wss[id(kc.lib)], stream)
    call.e4m3 = (q8, k8, v8)
    return call, (q, k, v, lse, o8), 4 * B * H * N * N * d * (0.5 if causal else 1.0)


def bf16_calls(dev, d, causal, N, inputs):
    """The same point's 16-bit references on bench_setup's inputs (q, k, v, lse, _): our bf16
    forward, and PyTorch's SDPA call on (B, H, N, D) copies (run it inside sdpa_kernel)."""
    import torch.nn.functional as F
    q, k, v, lse, _ = inputs
    c = Fp8Case("bench", b=16384 // N, h=2048 // d, sq=N, d=d, wr=(0 if causal else -1))
    o = torch.empty_like(q)
    fb = kc.fwd_params(c, q, k, v, o, lse, None, None, None)
    wb = kc.fwd_workspace(fb, dev)
    stream = torch.cuda.current_stream().cuda_stream
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))

    def ours():
        _ = o
        return kc.call_fwd(fb, wb, stream)
    return ours, lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)


FP8_FLOP_PER_SM_CLOCK = 8192  # H100: 4 tensor cores x 1024 dense e4m3 FMA a clock


class ClockSampler:
    """Mean SM clock (MHz) while the block runs: NVML read every 2 ms on a thread."""

    def __enter__(self):
        import threading
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        self.mhz, self._stop = [], threading.Event()

        def loop():
            while not self._stop.is_set():
                self.mhz.append(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
                time.sleep(0.002)
        self._t = threading.Thread(target=loop, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    def mean(self):
        return sum(self.mhz) / max(len(self.mhz), 1)


def timed_with_clock(fn):
    """(median seconds, mean SM MHz over the timing) of kc.median_cuda_time(fn)."""
    with ClockSampler() as cs:
        t = kc.median_cuda_time(fn)
    return t, cs.mean()


def cudnn_fp8_call(d, causal, q8, k8, v8, check):
    """cuDNN's FP8 forward on our (B, N, H, D) e4m3 tensors: cudnn-frontend's sdpa_fp8 with
    per-tensor descales of 1 and an e4m3 output (what cuDNN offers on Hopper), same strides.
    With check, its output is compared once with f32 attention on the raw e4m3 values of the
    first (batch, head), so that the timing is known to be of a real attention."""
    import cudnn
    B, N, H, _ = q8.shape
    dims, strides = (B, H, N, d), (N * H * d, d, H * d, 1)
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
    tq, tk, tv = (graph.tensor(name=n, dim=dims, stride=strides, data_type=cudnn.data_type.FP8_E4M3)
                  for n in ("q", "k", "v"))
    scalars = [graph.tensor(name=n, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.FLOAT)
               for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")]
    o_t, _, amax_s_t, amax_o_t = graph.sdpa_fp8(q=tq, k=tk, v=tv, descale_q=scalars[0], descale_k=scalars[1],
                                               descale_v=scalars[2], descale_s=scalars[3], scale_s=scalars[4],
                                               scale_o=scalars[5], is_inference=True, attn_scale=1.0 / math.sqrt(d),
                                               use_causal_mask=causal, name="sdpa_fp8")
    o_t.set_output(True).set_dim(dims).set_stride(strides).set_data_type(cudnn.data_type.FP8_E4M3)
    for t in (amax_s_t, amax_o_t):
        t.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(cudnn.data_type.FLOAT)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    dev = q8.device
    o = torch.empty_like(q8)
    ones = [torch.ones(1, 1, 1, 1, device=dev) for _ in range(6)]
    amax = [torch.empty(1, 1, 1, 1, device=dev) for _ in range(2)]
    pack = {tq: q8, tk: k8, tv: v8, o_t: o, amax_s_t: amax[0], amax_o_t: amax[1]}
    pack.update(zip(scalars, ones))
    ws = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=dev)

    def call():
        graph.execute(pack, ws)
    if check:
        call()
        qf, kf, vf = (x[0, :, 0].float() for x in (q8, k8, v8))
        s_ = qf @ kf.T / math.sqrt(d)
        if causal:
            s_ = s_.masked_fill(torch.ones(N, N, dtype=torch.bool, device=dev).triu(1), float("-inf"))
        ref = torch.softmax(s_, -1) @ vf
        rel = ((o[0, :, 0].float() - ref).norm() / ref.norm()).item()
        print(f"cuDNN FP8 check D={d} causal={int(causal)} N={N}: |err|/|ref| = {rel:.3f}", flush=True)
        if not rel < 0.1:
            raise RuntimeError(f"cuDNN FP8 output off: {rel}")
    return call


def bench(dev, dims):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    for d in dims:
        for causal in (False, True):
            for N in (512, 1024, 2048, 4096, 8192, 16384):
                call8, inputs, fl = bench_setup(dev, d, causal, N)
                t8 = kc.median_cuda_time(call8)
                kc.check(call8(), "cf_fwd(e4m3)")
                call16, sdpa = bf16_calls(dev, d, causal, N, inputs)
                tb = kc.median_cuda_time(call16)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    tc = kc.median_cuda_time(sdpa)
                rows.append((d, int(causal), N, fl / t8 / 1e12, fl / tb / 1e12, fl / tc / 1e12))
                print(f"D={d} causal={int(causal)} N={N:5d}: e4m3 {rows[-1][3]:6.0f}  bf16 {rows[-1][4]:6.0f}  "
                      f"cudnn-bf16 {rows[-1][5]:6.0f} TF/s  e4m3/bf16 {tb / t8:.2f}  e4m3/cudnn {tc / t8:.2f}",
                      flush=True)
    return rows


def bench_cudnn_fp8(dev, dims, ns, rounds):
    """Ours e4m3 against cuDNN's FP8 forward, same e4m3 tensors, alternating for `rounds`
    rounds: TF/s, mean SM clock and the share of the e4m3 peak at that clock."""
    props = torch.cuda.get_device_properties(dev)
    lines = []
    for d in dims:
        for causal in (False, True):
            for N in ns:
                call8, _, fl = bench_setup(dev, d, causal, N)
                kc.check(call8(), "cf_fwd(e4m3)")
                try:
                    impls = (("ours-e4m3", call8), ("cudnn-e4m3", cudnn_fp8_call(d, causal, *call8.e4m3, check=(N == ns[0]))))
                except Exception as e:  # noqa: BLE001 (no frontend, or no cuDNN engine for the point)
                    print(f"cuDNN FP8 D={d} causal={int(causal)} N={N}: {type(e).__name__}: {e}", flush=True)
                    impls = (("ours-e4m3", call8),)
                for r in range(rounds):
                    for name, fn in impls:
                        t, mhz = timed_with_clock(fn)
                        tf = fl / t / 1e12
                        peak = FP8_FLOP_PER_SM_CLOCK * props.multi_processor_count * mhz * 1e6 / 1e12
                        lines.append(f"fp8-vs-cudnn D={d} causal={int(causal)} N={N} round={r} {name} "
                                     f"{tf:.0f} TF/s sm_clock {mhz:.0f} MHz peak_share {tf / peak:.3f}")
                        print(lines[-1], flush=True)
    return lines


def sustained(dev, dims, seconds):
    """The 16k points under sustained load (kernel_check.sustained_cuda_time), each after a 2 s
    rest: e4m3, our bf16 and cuDNN's bf16 forward, TF/s."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    lines = []
    for d in dims:
        for causal in (False, True):
            N = 16384
            call8, inputs, fl = bench_setup(dev, d, causal, N)
            call16, sdpa = bf16_calls(dev, d, causal, N, inputs)
            ts = []
            for fn, ctx in ((call8, nullcontext()), (call16, nullcontext()), (sdpa, sdpa_kernel(SDPBackend.CUDNN_ATTENTION))):
                torch.cuda.synchronize()
                time.sleep(2.0)
                with ctx:
                    ts.append(kc.sustained_cuda_time(fn, seconds))
            lines.append(f"sustained D={d} causal={int(causal)} N={N}: e4m3 {fl / ts[0] / 1e12:.0f}  bf16 "
                         f"{fl / ts[1] / 1e12:.0f}  cudnn-bf16 {fl / ts[2] / 1e12:.0f} TF/s")
            print(lines[-1], flush=True)
    return lines


def plot(rows, path):
    """TFLOP/s against N per (D, causal): ours e4m3, ours bf16, cuDNN bf16 (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: plot skipped")
        return
    keys = sorted({(d, cz) for d, cz, *_ in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.6), squeeze=False)
    for ax, (d, cz) in zip(axes[0], keys):
        pts = [r for r in rows if (r[0], r[1]) == (d, cz)]
        ns = [r[2] for r in pts]
        for i, label in ((3, "ours e4m3"), (4, "ours bf16"), (5, "cuDNN bf16")):
            ax.plot(ns, [r[i] for r in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"D={d} {'causal' if cz else 'non-causal'}")
        ax.set_xlabel("N")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--filter", default="")
    ap.add_argument("--dims", default="128,256", help="head dims of --bench")
    ap.add_argument("--one", default="", help="N,D,causal: one e4m3 forward (for ncu), then exit")
    ap.add_argument("--cudnn-fp8", default="",
                    help="with --bench: N list (e.g. 2048,8192,16384) for ours e4m3 against cuDNN's FP8 forward, "
                         "instead of the bf16 grid")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of --cudnn-fp8")
    ap.add_argument("--sustain", type=float, default=0,
                    help="with --bench: also time the 16k points under sustained load (seconds per timing)")
    args = ap.parse_args()
    if not args.no_build:
        kc.build(["-gencode=arch=compute_90a,code=sm_90a"])
    kc.load_lib()
    dev = torch.device("cuda")
    if args.one:
        n, d, causal = (int(x) for x in args.one.split(","))
        call, _, _ = bench_setup(dev, d, bool(causal), n)
        kc.check(call(), "cf_fwd(e4m3)")
        torch.cuda.synchronize()
        return
    gen = torch.Generator(device=dev).manual_seed(4321)
    n_fail = 0
    lines = []
    for c in cases():
        if args.filter not in c.name:
            continue
        try:
            ok, worst, detail = run_case(c, dev, gen)
        except Exception as e:  # noqa: BLE001
            ok, worst, detail = False, math.inf, f"EXCEPTION {type(e).__name__}: {e}"
        n_fail += not ok
        lines.append(f"{'PASS' if ok else 'FAIL'} fp8 {c.name:22s} worst={worst:5.2f} {detail}")
        print(lines[-1], flush=True)
    print(f"fp8 check: {len(lines) - n_fail} passed, {n_fail} failed", flush=True)
    rows = []
    if args.bench:
        dims = [int(x) for x in args.dims.split(",")]
        if args.cudnn_fp8:  # instead of the bf16 grid
            lines += bench_cudnn_fp8(dev, dims, [int(x) for x in args.cudnn_fp8.split(",")], args.rounds)
        else:
            rows = bench(dev, dims)
        lines += [f"D={d} causal={cz} N={n} e4m3={a:.0f} bf16={b:.0f} cudnn={c_:.0f}" for d, cz, n, a, b, c_ in rows]
        if args.sustain:
            lines += sustained(dev, dims, args.sustain)
    if rows and kc.OUT:
        plot(rows, os.path.join(kc.OUT, "fp8_forward.png"))
    if kc.OUT:
        with open(os.path.join(kc.OUT, "fp8_check.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    sys.exit(1 if n_fail else 0)


if __name__ == "__main__":
    main()
