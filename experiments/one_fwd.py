#!/usr/bin/env python3
"""One forward call of ours (kernel_check's library) and one each of SDPA's flash and cuDNN
backends on a grid point, for profilers: ncu -k regex:fwd_sm90 python3 experiments/one_fwd.py --n 512 --d 64 --causal
--bwd: also one backward of ours (after the forward) and of each backend:
  ncu -k regex:bwd_dkdv python3 experiments/one_fwd.py --n 8192 --d 256 --bwd
--refs-only: only the SDPA backends (no library needed: to read cuDNN's kernels' names, launch
shapes and SASS under ncu).
--dtype e4m3: one FP8 forward of ours (fp8_check's bench point) and, with --cudnn-fp8, one of
cuDNN's FP8 forward on the same e4m3 tensors (cudnn-frontend, see fp8_check.py):
  ncu --section SpeedOfLight python3 experiments/one_fwd.py --dtype e4m3 --n 16384 --d 128 --cudnn-fp8"""
import argparse, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import kernel_check as kc  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--n", type=int, default=512)
ap.add_argument("--d", type=int, default=64)
ap.add_argument("--causal", action="store_true")
ap.add_argument("--dtype", default="bf16")
ap.add_argument("--bwd", action="store_true")
ap.add_argument("--refs-only", action="store_true")
ap.add_argument("--cudnn-fp8", action="store_true")
a = ap.parse_args()
dev = torch.device("cuda")
if a.dtype == "e4m3":
    import fp8_check as f8  # noqa: E402
    kc.load_lib()
    call, _, _ = f8.bench_setup(dev, a.d, a.causal, a.n)
    kc.check(call(), "cf_fwd")
    if a.cudnn_fp8:
        cudnn_call = f8.cudnn_fp8_call(a.d, a.causal, *call.e4m3, check=False)
        cudnn_call()
    torch.cuda.synchronize()
    sys.exit(0)
B, H = 16384 // a.n, 2048 // a.d
c = kc.Case("one", a.dtype, b=B, h=H, sq=a.n, d=a.d, wl=-1, wr=(0 if a.causal else -1))
q, k, v, _, _ = kc.make_inputs(c, dev, torch.Generator(device=dev).manual_seed(0))


def ours():
    kc.load_lib()
    o = torch.empty_like(q)
    lse = torch.empty(B, H, a.n, dtype=torch.float32, device=dev)
    fp = kc.fwd_params(c, q, k, v, o, lse, None, None, None)
    assert kc.call_fwd(fp, kc.fwd_workspace(fp, dev), torch.cuda.current_stream().cuda_stream) == 0
    if a.bwd:
        do = torch.randn_like(q)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        bp = kc.bwd_params(fp, do, dq, dk, dv, False)
        bp.total_q, bp.total_k = B * a.n, B * a.n
        ws = torch.empty(kc.lib.cf_bwd_workspace_size(kc.ctypes.byref(bp)) // 4 + 64, dtype=torch.float32, device=dev)
        assert kc.lib.cf_bwd(kc.ctypes.byref(bp), ws.data_ptr(), torch.cuda.current_stream().cuda_stream) == 0


if not a.refs_only:
    ours()
qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_(a.bwd) for x in (q, k, v))
for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=a.causal)
        if a.bwd:
            out.backward(torch.randn_like(out))
torch.cuda.synchronize()
