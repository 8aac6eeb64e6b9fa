#!/usr/bin/env python3
"""PyTorch FlexAttention (flex_attention under torch.compile) on the block-sparse patterns of
examples/block_sparse_bench.rs, printing the same JSON keys with impl = "flex"; with --dense
also SDPA dense at the same N (impl = "torch-sdpa", patterns dense and dense_causal).

Same shapes, dtype and masks as the Rust bench: q, k, v (B, H, N, D) (SDPA's layout), scale
1/sqrt(D), blocks of 128. The element rules are mask_mods given to create_block_mask; topk and
density pick their key blocks with the same xorshift64 sequence as the Rust bench, so both visit
exactly the same blocks, and their BlockMask is built from the index lists with
BlockMask.from_kv_blocks (the listed blocks classified as causal's partial / full, as
candle-flash's from_block_indices does). build_ms: the mask builder alone, between two
synchronisations (the index lists already on the GPU).

visited_blocks counts the blocks computed (partial and full, times the broadcast batch / head
factor); tflops_visited = 4*D*128*128*visited_blocks / time, 2.5x for bwd.
Timing: CUDA events, warm-up first (the first call compiles), median of --iters runs, as
bench/sdpa.py; bwd times torch.autograd.grad alone, each run on a fresh forward (untimed,
finished before the start event) rather than on a retained graph: a compiled backward may
donate its saved buffers, which retain_graph=True is refused with.
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch._dynamo
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

BLOCK = 128
ALL = ["dense", "dense_causal", "document", "prefix_lm", "window_global", "chunked", "topk", "density"]
SEED = 0x9E3779B97F4A7C15
MASK64 = (1 << 64) - 1
TOPK = 8  # the diagonal block and 7 earlier ones
DOCUMENTS = 16
WINDOW = 1024
GLOBAL = 64
CHUNK = 2048
DENSITY_KS = [1, 2, 4, 8, 16, 32, 64, 128]
WARM_UP_S = 0.05  # as examples/bench.rs WARM_UP_MS

SDPA_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


class XorShift:
    """xorshift64 (13, 7, 17), bit for bit the Rust bench's."""

    def __init__(self, seed):
        self.x = seed & MASK64

    def next(self):
        x = self.x
        x ^= (x << 13) & MASK64
        x ^= x >> 7
        x ^= (x << 17) & MASK64
        self.x = x
        return x

    def pick(self, m, count):
        """`count` distinct values of range(m) (a partial Fisher-Yates shuffle)."""
        count = min(count, m)
        a = list(range(m))
        for i in range(count):
            j = i + self.next() % (m - i)
            a[i], a[j] = a[j], a[i]
        return a[:count]


def index_tensor(rows, heads, qb, width):
    """int32 (1, heads, qb, width) on the GPU, -1 past each row's picks."""
    flat = [-1] * (heads * qb * width)
    for r, row in enumerate(rows):
        flat[r * width:r * width + len(row)] = row
    return torch.tensor(flat, dtype=torch.int32).view(1, heads, qb, width).cuda()


def causal(b, h, q, kv):
    return q >= kv


def dense_to_ordered(m):
    """A dense block matrix (..., R, C) as counts (..., R) and ascending indices (..., R, C)."""
    m = m.to(torch.int32)
    return m.sum(-1).to(torch.int32), torch.argsort(m, dim=-1, descending=True, stable=True).to(torch.int32)


def from_indices(idx, is_causal, n):
    """The BlockMask of the key blocks listed in idx (1, H, Qb, k): with causal, the diagonal
    block partial (the mask_mod decides), earlier ones full, later ones dropped; else all full.
    The index lists are full width (Kb): from_kv_blocks transposes them for the backward
    through a dense matrix of that width."""
    _, h, qb, _ = idx.shape
    kb = (n + BLOCK - 1) // BLOCK
    picked = torch.zeros(1, h, qb, kb + 1, dtype=torch.bool, device=idx.device)
    # pads (-1) land in the extra column, dropped below
    picked.scatter_(-1, torch.where((idx >= 0) & (idx < kb), idx, kb).long(), True)
    picked = picked[..., :kb]
    if is_causal:
        qi = torch.arange(qb, device=idx.device)[:, None]
        ki = torch.arange(kb, device=idx.device)[None, :]
        partial, full = picked & (ki == qi), picked & (ki < qi)
    else:
        partial, full = torch.zeros_like(picked), picked
    kv_num, kv_idx = dense_to_ordered(partial)
    full_num, full_idx = dense_to_ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                    mask_mod=causal if is_causal else None, seq_lengths=(n, n))


def cases(pattern, n_arg, heads):
    """(n, k, kind, data) per case: kind "none" (no block mask), "mod" (data: a mask_mod for
    create_block_mask) or "idx" (data: (index tensor, causal) for from_indices)."""
    n = n_arg or (8192 if pattern == "prefix_lm" else 16384)
    blocks = (n + BLOCK - 1) // BLOCK
    if pattern == "dense":
        return [(n, None, "none", None)]
    if pattern == "dense_causal":
        return [(n, None, "mod", causal)]
    if pattern == "document":
        length = max(n // DOCUMENTS, 1)
        doc = torch.clamp(torch.arange(n, device="cuda") // length, max=DOCUMENTS - 1)

        def document(b, h, q, kv):
            return (doc[q] == doc[kv]) & (q >= kv)
        return [(n, None, "mod", document)]
    if pattern == "prefix_lm":
        prefix = n // 4

        def prefix_lm(b, h, q, kv):
            return (kv <= q) | (kv < prefix)
        return [(n, None, "mod", prefix_lm)]
    if pattern == "window_global":
        def window_global(b, h, q, kv):
            return ((kv <= q) & (q - kv <= WINDOW)) | (kv < GLOBAL)
        return [(n, None, "mod", window_global)]
    if pattern == "chunked":
        def chunked(b, h, q, kv):
            return (q // CHUNK == kv // CHUNK) & (kv <= q)
        return [(n, None, "mod", chunked)]
    if pattern == "topk":
        rng = XorShift(SEED)
        rows = [[q] + rng.pick(q, TOPK - 1) for _ in range(heads) for q in range(blocks)]
        return [(n, None, "idx", (index_tensor(rows, heads, blocks, TOPK), True))]
    if pattern == "density":
        out = []
        for k in [k for k in DENSITY_KS if k <= blocks]:
            rng = XorShift(SEED ^ k)
            rows = [rng.pick(blocks, k) for _ in range(heads * blocks)]
            out.append((n, k, "idx", (index_tensor(rows, heads, blocks, k), False)))
        return out
    raise ValueError(f"unknown pattern {pattern!r} (one of {','.join(ALL)})")


def timed(fn, iters, setup=None):
    """bench/sdpa.py's: warm-up calls for WARM_UP_S, then the median of iters CUDA-event times
    of fn(setup()) (setup untimed, finished before the start event)."""
    setup = setup or (lambda: None)
    warm = time.time()
    while True:
        fn(setup())
        torch.cuda.synchronize()
        if time.time() - warm >= WARM_UP_S:
            break
    times = []
    for _ in range(max(iters, 1)):
        arg = setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn(arg)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_mode(mode, attn, grads_of, dout, iters):
    """fwd: attn() without autograd. bwd: the backward alone, each timed run on a fresh forward
    graph (a compiled backward may donate its saved buffers, so no retain_graph)."""
    if mode == "fwd":
        def fwd(_):
            with torch.no_grad():
                attn()
        return timed(fwd, iters)
    return timed(lambda out: torch.autograd.grad(out, grads_of, dout), iters, setup=attn)


def dense_visited(n, is_causal, b, h):
    nb = (n + BLOCK - 1) // BLOCK
    per = nb * (nb + 1) // 2 if is_causal else nb * nb
    return b * h * per, per / (nb * nb)


def visited(bm, b, h):
    """Blocks computed for (b, h) and the mask's density (1 - sparsity)."""
    listed = bm.kv_num_blocks.sum().item()
    if bm.full_kv_num_blocks is not None:
        listed += bm.full_kv_num_blocks.sum().item()
    mb, mh = bm.kv_num_blocks.shape[0], bm.kv_num_blocks.shape[1]
    return int(listed) * (b // mb) * (h // mh), 1 - bm.sparsity() / 100


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--patterns", default="all", help="comma-separated, or all: " + ",".join(ALL))
    ap.add_argument("--modes", default="fwd,bwd")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--n", type=int, help="sequence length of every pattern (default: each pattern's own)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--dense", action="store_true", help="also SDPA dense (non-causal and causal) at the same N")
    ap.add_argument("--sdpa-backend", default="cudnn", choices=sorted(SDPA_BACKENDS))
    ap.add_argument("--compile-mode", default="default", help="torch.compile's mode for flex_attention")
    ap.add_argument("--kernel-backend", help="flex_attention kernel_options BACKEND (e.g. TRITON, FLASH); default: torch's choice")
    ap.add_argument("--compile-mask", action="store_true",
                    help="create_block_mask(_compile=True); its first (compiling) call is then not timed")
    a = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    patterns = ALL if a.patterns == "all" else [p.strip() for p in a.patterns.split(",")]
    for p in patterns:
        if p not in ALL:
            ap.error(f"unknown pattern {p!r} (one of {','.join(ALL)}, or all)")
    modes = [m.strip() for m in a.modes.split(",")]
    for m in modes:
        if m not in ("fwd", "bwd"):
            ap.error(f"unknown mode {m!r} (fwd or bwd)")
    b, h, d = a.batch, a.heads, a.hdim
    scale = 1.0 / math.sqrt(d)
    # Every pattern is a graph of its own (mask_mod, mask shapes), fwd and fwd+bwd each.
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    flex = torch.compile(flex_attention, dynamic=False, mode=None if a.compile_mode == "default" else a.compile_mode)
    kernel_options = {"BACKEND": a.kernel_backend} if a.kernel_backend else None
    mask_kwargs = {"_compile": True} if a.compile_mask else {}
    inputs = {}

    def get_inputs(n):
        if n not in inputs:
            inputs.clear()  # one N at a time on the GPU
            r = lambda: torch.randn(b, h, n, d, device="cuda", dtype=dtype)
            inputs[n] = (r().requires_grad_(), r().requires_grad_(), r().requires_grad_(), r())
        return inputs[n]

    def emit(row):
        print(json.dumps(row), flush=True)

    def base(impl, pattern, mode, n, k):
        row = {"impl": impl, "pattern": pattern, "mode": mode, "dtype": a.dtype, "b": b, "h": h, "n": n, "d": d}
        if k is not None:
            row["k"] = k
        return row

    def flops(vis, mode):
        return 4.0 * d * BLOCK * BLOCK * vis * (2.5 if mode == "bwd" else 1.0)

    for pattern in patterns:
        for n, k, kind, data in cases(pattern, a.n, h):
            q, kk, v, dout = get_inputs(n)
            try:
                build_ms, bm = None, None
                if kind != "none":
                    if kind == "mod":
                        build = lambda: create_block_mask(data, None, None, n, n, device="cuda", BLOCK_SIZE=BLOCK,
                                                          **mask_kwargs)
                        if a.compile_mask:
                            build()
                    else:
                        build = lambda: from_indices(data[0], data[1], n)
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    bm = build()
                    torch.cuda.synchronize()
                    build_ms = (time.perf_counter() - t) * 1e3
                    vis, density = visited(bm, b, h)
                else:
                    vis, density = dense_visited(n, False, b, h)
            except Exception as e:  # noqa: BLE001 -- reported per row, the run goes on
                for mode in modes:
                    emit({**base("flex", pattern, mode, n, k), "error": f"building the mask: {e}"[:300]})
                continue
            for mode in modes:
                row = {**base("flex", pattern, mode, n, k), "density": density, "visited_blocks": vis,
                       "build_ms": build_ms, "compile_mode": a.compile_mode}
                try:
                    call = lambda: flex(q, kk, v, block_mask=bm, scale=scale, kernel_options=kernel_options)
                    ms = time_mode(mode, call, (q, kk, v), dout, a.iters)
                except Exception as e:  # noqa: BLE001
                    emit({**row, "error": str(e)[:300]})
                    continue
                emit({**row, "ms": ms, "tflops_visited": flops(vis, mode) / (ms * 1e-3) / 1e12})
    if a.dense:
        n = a.n or 16384
        q, kk, v, dout = get_inputs(n)
        for is_causal in (False, True):
            vis, density = dense_visited(n, is_causal, b, h)
            pattern = "dense_causal" if is_causal else "dense"
            for mode in modes:
                row = {**base("torch-sdpa", pattern, mode, n, None), "density": density, "visited_blocks": vis,
                       "build_ms": None, "backend": a.sdpa_backend}
                try:
                    with sdpa_kernel([SDPA_BACKENDS[a.sdpa_backend]]):
                        sdpa = lambda: F.scaled_dot_product_attention(q, kk, v, is_causal=is_causal, scale=scale)
                        ms = time_mode(mode, sdpa, (q, kk, v), dout, a.iters)
                except Exception as e:  # noqa: BLE001 -- a backend may not take the shape / dtype
                    emit({**row, "error": str(e)[:300]})
                    continue
                emit({**row, "ms": ms, "tflops_visited": flops(vis, mode) / (ms * 1e-3) / 1e12})


if __name__ == "__main__":
    main()
