// TMA (the Tensor Memory Accelerator, `cp.async.bulk.tensor`) loads for the Hopper forward:
// tensor maps built on the host per call, passed to the kernel as a __grid_constant__ parameter,
// and the device side that issues the copies into the mbarrier pipelines of pipeline.cuh.
//
// A map views one tensor of the contract (flash_api.h) as [batches][heads][rows][d] with the
// tensor's own strides; its box is [box_rows][64 columns] with the 128-byte swizzle, which is
// exactly one panel of wgmma.cuh's layout (chunk j of row r at j ^ (r & 7), 1024-byte aligned),
// so a [R][D] tile is D / 64 copies. Columns past d and rows past the map's rows are zero-filled
// by the hardware (the zero-filled d padding of the head-dim tiles, the rows past seqlen of a
// batched tensor). Varlen tensors are one batch of `total` rows: rows past a sequence's end are
// the next sequence's, so key blocks that cross the end still load with cp.async (zero fill);
// query rows past the end only reach output rows that are never stored.
// Paged K/V keeps cp.async (a page table has no tensor-map form); so does every tensor whose map
// the driver refuses, and every call with CANDLE_FLASH_DISABLE_TMA=1.
#pragma once
#include <cuda.h>  // CUtensorMap and its enums (the encoder is reached through the runtime)
#include <cstdlib>
#include "../flash_api.h"
#include "wgmma.cuh"

namespace cf {

// The maps of one forward call (kernel parameter). q_ok / kv_ok = 0: that side loads with cp.async
// (f16 / bf16; the e4m3 kernel runs only with both maps, cf_fwd_check).
struct FwdTmaMaps {  // CUtensorMap is 64-byte aligned itself
    CUtensorMap q, k, v;
    int q_ok, kv_ok;
};

// The maps of one backward call (sm90/bwd.cuh): Q and dO by query blocks. ok = 0: cp.async.
struct BwdTmaMaps {
    CUtensorMap q, dout;
    int ok;
};

// ---------------------------------------------------------------- host
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled from the driver the runtime loaded (no link against libcuda), looked
// up once; null when unavailable (then everything loads with cp.async). Whether a call uses TMA
// at all is its plan's (FwdPlan::tma, BwdPlan::tma: plan.cu tma_enabled).
inline EncodeTiledFn tensor_map_encoder() {
    static const EncodeTiledFn fn = [] {
        void* f = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) !=
                cudaSuccess ||
            q != cudaDriverEntryPointSuccess) {
            (void)cudaGetLastError();
            return (EncodeTiledFn) nullptr;
        }
        return reinterpret_cast<EncodeTiledFn>(f);
    }();
    return fn;
}

// Bytes per element of a CfDType the TMA maps handle (f16 / bf16 / e4m3).
inline int tma_elem_bytes(int dtype) { return dtype == CF_E4M3 ? 1 : 2; }

// One tensor (element strides; f16 / bf16 / e4m3) as [batches][heads][rows][d] with
// [box_rows][128 bytes] boxes (one panel). False when the driver refuses it (a stride the
// hardware cannot address, say).
inline bool encode_rows_map(CUtensorMap& m, const void* base, int dtype, int d, int64_t rows, int heads,
                            int64_t batches, int64_t row_stride, int64_t head_stride, int64_t batch_stride,
                            int box_rows) {
    const EncodeTiledFn enc = tensor_map_encoder();
    if (enc == nullptr || base == nullptr || rows < 1 || heads < 1 || batches < 1) return false;
    const int64_t kB = tma_elem_bytes(dtype);
    // A dimension of extent 1 is never stepped: any legal stride (a multiple of 16 bytes) will do.
    if (heads == 1) head_stride = 16 / kB;
    if (batches == 1) batch_stride = 16 / kB;
    const cuuint64_t dims[4] = {(cuuint64_t)d, (cuuint64_t)rows, (cuuint64_t)heads, (cuuint64_t)batches};
    const cuuint64_t strides[3] = {(cuuint64_t)(row_stride * kB), (cuuint64_t)(head_stride * kB),
                                   (cuuint64_t)(batch_stride * kB)};
    const cuuint32_t box[4] = {(cuuint32_t)(kPanelRowBytes / kB), (cuuint32_t)box_rows, 1, 1};
    const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
    const CUtensorMapDataType type = dtype == CF_E4M3  ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                     : dtype == CF_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                        : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    return enc(&m, type, 4, const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The FP8 forward's transposed V (sm90/fwd.cu, Fp8VtLayout): e4m3 [batches][hkv][d][cols], keys
// along the rows, viewed as [block_keys][head-dim tile] boxes (block_keys = 128: one panel per
// d row; rows past d are zero-filled, like the head-dim padding of Q and K).
inline bool encode_vt_map(CUtensorMap& m, const void* base, int d, int64_t cols, int hkv, int64_t batches,
                          int block_keys, int d_tile) {
    const EncodeTiledFn enc = tensor_map_encoder();
    if (enc == nullptr || base == nullptr || cols < 1 || hkv < 1 || batches < 1) return false;
    const cuuint64_t dims[4] = {(cuuint64_t)cols, (cuuint64_t)d, (cuuint64_t)hkv, (cuuint64_t)batches};
    const cuuint64_t strides[3] = {(cuuint64_t)cols, (cuuint64_t)(cols * d), (cuuint64_t)(cols * d * hkv)};
    const cuuint32_t box[4] = {(cuuint32_t)block_keys, (cuuint32_t)d_tile, 1, 1};
    const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
    return enc(&m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void*>(base), dims, strides, box, elem_strides,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The maps of a forward call with BM-row query tiles and BN-row key tiles (f16 / bf16, and e4m3
// with V transposed in the kernel: q, k, v; e4m3 with the V^T pre-pass: q, k, and v = the
// transposed V in `vt` with `vt_cols` columns per (batch, KV head, d row), `d_tile` rows per box).
inline FwdTmaMaps make_fwd_tma_maps(const CfFwdParams& p, int block_m, int block_n, const void* vt = nullptr,
                                    int64_t vt_cols = 0, int d_tile = 0) {
    FwdTmaMaps m{};
    const bool vq = p.cu_seqlens_q != nullptr, vk = p.cu_seqlens_k != nullptr;
    m.q_ok = encode_rows_map(m.q, p.q, p.dtype, p.d, vq ? p.total_q : p.seqlen_q, p.h, vq ? 1 : p.b, p.q_row_stride,
                             p.q_head_stride, p.q_batch_stride, block_m);
    const bool k_ok = p.block_table == nullptr &&
                      encode_rows_map(m.k, p.k, p.dtype, p.d, vk ? p.total_k : p.seqlen_k, p.hkv, vk ? 1 : p.b,
                                      p.k_row_stride, p.k_head_stride, p.k_batch_stride, block_n);
    const bool v_ok = p.dtype == CF_E4M3 && vt != nullptr
                          ? encode_vt_map(m.v, vt, p.d, vt_cols, p.hkv, vk ? 1 : p.b, kPanelRowBytes, d_tile)
                          : p.block_table == nullptr && encode_rows_map(m.v, p.v, p.dtype, p.d,
                                                                        vk ? p.total_k : p.seqlen_k, p.hkv,
                                                                        vk ? 1 : p.b, p.v_row_stride, p.v_head_stride,
                                                                        p.v_batch_stride, block_n);
    m.kv_ok = k_ok && v_ok;
    return m;
}

// The maps of a backward call with BM-row query blocks (f16 / bf16).
inline BwdTmaMaps make_bwd_tma_maps(const CfBwdParams& p, int block_m) {
    BwdTmaMaps m{};
    const CfFwdParams& f = p.fwd;
    const bool vq = f.cu_seqlens_q != nullptr;
    const int64_t rows = vq ? f.total_q : f.seqlen_q, batches = vq ? 1 : f.b;
    m.ok = encode_rows_map(m.q, f.q, f.dtype, f.d, rows, f.h, batches, f.q_row_stride, f.q_head_stride, f.q_batch_stride,
                           block_m) &&
           encode_rows_map(m.dout, p.dout, f.dtype, f.d, rows, f.h, batches, p.do_row_stride, p.do_head_stride,
                           p.do_batch_stride, block_m);
    return m;
}

// ---------------------------------------------------------------- device
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The phase of `bar` also waits for `bytes` more bytes of asynchronous copies (complete_tx).
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Box (c0 = column, c1 = row, c2 = head, c3 = batch) of `map` into shared memory at dst; its
// bytes count down `bar`'s transaction count when they land.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
        "%5}], [%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// A [ROWS][D] panel tile (kElemBytes per element) from rows row0.. of (head, batch): one thread
// issues one box per 128-byte panel after raising the barrier's expected bytes (before its own
// arrival, so the phase cannot complete without them).
template <int ROWS, int D, int kElemBytes = 2>
__device__ __forceinline__ void tma_load_tile(uint32_t dst, const CUtensorMap* map, uint32_t bar, int64_t row0,
                                              int head, int batch) {
    constexpr int kPanelElems = kPanelRowBytes / kElemBytes;
    static_assert(D % kPanelElems == 0, "whole panels");
    mbar_expect_tx(bar, ROWS * D * kElemBytes);
#pragma unroll
    for (int pnl = 0; pnl < D / kPanelElems; ++pnl)
        tma_load_4d(dst + pnl * ROWS * kPanelRowBytes, map, bar, kPanelElems * pnl, (int)row0, head, batch);
}

// ---- bulk reductions (the backward's dQ): cp.reduce.async.bulk adds a contiguous shared-memory
// range into global memory element by element (f32 add, atomic per element against other
// reductions), tracked by the issuing thread's bulk groups.
__device__ __forceinline__ void bulk_reduce_add_f32(float* gdst, uint32_t ssrc, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gdst), "r"(ssrc),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// The source ranges of all but the newest N groups have been read (shared memory reusable).
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// All but the newest N groups have completed (their global writes done).
template <int N>
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- deterministic dQ (BwdWs::dq_sem): the bulk reductions into one (sequence, head, 64-row
// query block, warpgroup) part of dq_accum are made in key-block order, so that every element
// receives its f32 additions in the same order on every run. Each such part has a counter in
// global memory (zeroed before the launch) holding how many key blocks have added into it; the
// CTA of key block kb waits until it reads kb - (the first key block touching the query block),
// issues its reductions, and once they have completed adds 1. A CTA waits only for CTAs of lower
// key blocks of the same head, which the launch order (key block fastest, or DkdvCta's key block
// slowest) starts first, as FlashAttention-3's deterministic backward relies on too.
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// Orders global accesses of the generic proxy (the counters) against the async proxy's (the
// bulk reductions).
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }

// One warpgroup's turn-taking (its thread wt == 0 only, which issues the reductions). Counters
// are indices into BwdWs::dq_sem (32-bit: one register fewer than a pointer in the kernels' loops).
struct DqOrder {
    int pending = -1;  // counter of the part whose reductions were issued last, not yet signalled
    // The reductions issued since turn() have completed (wait for them): the next key block's turn.
    __device__ __forceinline__ void signal(int* counters) {
        if (pending >= 0) {
            bulk_wait<0>();
            fence_proxy_async_global();
            red_release_gpu_add(counters + pending, 1);
            pending = -1;
        }
    }
    // Before the first reduction into a part: signal the previous part, then wait for this one's turn.
    __device__ __forceinline__ void turn(int* counters, int counter, int before) {
        signal(counters);
        while (ld_acquire_gpu(counters + counter) < before) __nanosleep(32);
        fence_proxy_async_global();
        pending = counter;
    }
};

// One [64][64] f32 tile of dQ (the tiled dq_accum layout of common/bwd_work.cuh) from an m64
// accumulator slice: n8 tiles j0 .. j0 + 7 of `dq` (element 4j + 2r (+1): row r0 + 8r, column
// 8 (j - j0) + 2 q4 (+1)), r0 = 16 * warp + lane / 4 within the tile. Chunk c of row r sits at
// c ^ (r & 7): a warp's 8-byte stores then cover 8 distinct chunks, 2 wavefronts, no conflicts
// (plain row-major would put all 8 rows in the same banks: 8-way).
template <int NJ>
__device__ __forceinline__ void stage_dq_tile(const float (&dq)[4 * NJ], int j0, float* tile, int r0, int q4) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = r0 + 8 * r;
            *reinterpret_cast<float2*>(tile + row * 64 + ((j ^ (row & 7)) << 3) + 2 * q4) =
                make_float2(dq[4 * (j0 + j) + 2 * r], dq[4 * (j0 + j) + 2 * r + 1]);
        }
}

// A staged dQ tile out (the second half of reduce_dq_tile; bwd.cuh also calls it a step after the
// staging): publish the stores, then thread wt == 0 issues the bulk reduction of `bytes` into gdst.
__device__ __forceinline__ void flush_dq_tile(const float* tile, float* gdst, int wg_bar, int wt,
                                              uint32_t bytes = 64 * 64 * 4) {
    fence_async_smem();  // st.shared (generic proxy) -> bulk copy (async proxy)
    named_bar_sync(wg_bar, 128);
    if (wt == 0) {
        bulk_reduce_add_f32(gdst, smem_addr(tile), bytes);
        bulk_commit();
    }
}

// One warpgroup's dQ tile out: stage n8 tiles j0 .. j0 + 7 of `dq` into `tile` (stage_dq_tile),
// publish the stores to the async proxy and to the warpgroup (named barrier `wg_bar`, 128
// threads), then thread wt == 0 issues the 16 KB bulk reduction into `gdst` and commits it. The
// caller has made sure, before this, that the previous reduction from `tile` has read it
// (bulk_wait_read by thread 0, then the same barrier).
template <int NJ>
__device__ __forceinline__ void reduce_dq_tile(const float (&dq)[4 * NJ], int j0, float* tile, float* gdst, int wg_bar,
                                               int wt, int r0, int q4) {
    stage_dq_tile<NJ>(dq, j0, tile, r0, q4);
    flush_dq_tile(tile, gdst, wg_bar, wt);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace cf
