// Hopper (sm_90a) warpgroup MMA building blocks: the shared-memory layout wgmma reads, its
// matrix descriptors, the fence / commit / wait protocol, and loaders into that layout.
//
// Layout ("panels"): a [R][C] tile of 16-bit elements (C a multiple of 64) is stored as C/64
// panels, each a row-major [R][64] array with 128-byte rows, the tile base 1024-byte aligned.
// The 16-byte chunk j (8 elements) of row r sits at chunk j ^ (r & 7) of its row: exactly the
// hardware's 128-byte swizzle (byte address bits [4,7) ^= bits [7,10)), so one layout serves
//   K-major operands  (A = [M][K], B = [N][K]: rows are M/N, K runs along the row), and
//   MN-major operands (stored [K][M] / [K][N]: rows are K, M/N runs along the row).
// Descriptors (PTX ISA "matrix descriptor"; CUTLASS's GmmaDescriptor documents the fields):
//   K-major:  start = panel (k/64) + 32 bytes per k16 step inside the row; SBO = 1024 (next 8
//             rows); LBO unused for swizzled K-major layouts.
//   MN-major: start = base + 16 rows per k16 step; SBO = 1024 (next 8 K rows); LBO = panel
//             stride (next 64 M/N columns).
//
// Accumulators of m64nNk16: warp w of the warpgroup owns rows 16w..16w+15; register 4j+e of a
// lane is the mma.sync C fragment element e of n8 tile j (row g / g+8, columns 8j + 2q + {0,1}).
// A from registers: the mma.sync m16k16 A fragment of the warp's 16 rows.
#pragma once
#include "../common/tile.cuh"
#include "wgmma_ops.cuh"

namespace cf {

constexpr int kPanelRowBytes = 128;

// Byte offset of element (r, c) of an R-row panel tile.
__device__ __forceinline__ uint32_t panel_offset(int R, int r, int c) {
    return (uint32_t)((c >> 6) * R * kPanelRowBytes + r * kPanelRowBytes +
                      ((((c & 63) >> 3) ^ (r & 7)) << 4) + ((c & 7) << 1));
}

// An m64 accumulator slice's NJ n8 tiles (one warp's rows r0 = 16 w + lane / 4 and r0 + 8,
// columns col0 + 8 j + 2 (lane % 4)) rounded to T into an R-row panel tile at byte address `tile`
// (the forwards' output staging, 4 bytes a store).
template <typename T, int NJ>
__device__ __forceinline__ void stage_acc_rows(unsigned char* tile, int R, int r0, int col0, const float* acc, int q4) {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r)
            *reinterpret_cast<uint32_t*>(tile + panel_offset(R, r0 + 8 * r, col0 + 8 * j + 2 * q4)) =
                pack2<T>(acc[4 * j + 2 * r], acc[4 * j + 2 * r + 1]);
}

// An m64nN accumulator (N = 16 PS: a thread's 8 PS values, n8 tile t at 4 t) as the 16-bit A
// fragments of PS k16 steps (the RS wgmma's P): register i of step ks holds tile 2 ks + (i >> 1),
// row g + 8 (i & 1).
template <typename T, int PS>
__device__ __forceinline__ void acc_to_a_frags(const float* s, uint32_t (&a)[PS][4]) {
#pragma unroll
    for (int ks = 0; ks < PS; ++ks) {
        a[ks][0] = pack2<T>(s[8 * ks + 0], s[8 * ks + 1]);
        a[ks][1] = pack2<T>(s[8 * ks + 2], s[8 * ks + 3]);
        a[ks][2] = pack2<T>(s[8 * ks + 4], s[8 * ks + 5]);
        a[ks][3] = pack2<T>(s[8 * ks + 6], s[8 * ks + 7]);
    }
}

__device__ __forceinline__ uint64_t gmma_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);  // 1 = 128-byte swizzle
}
// The descriptor of `d`'s start address plus `bytes` (a multiple of 16): the start-address field
// (bits 0-13, address >> 4) gains bytes >> 4 in the low word alone. Exact because every shared
// address is below 2^18 (228 KB), so the field never carries into the next one. Building each
// k16 step's descriptor this way from one base per tile costs one integer add; re-deriving it
// from the address (mask, shift, or-in) cost ~5 dependent instructions before every HGMMA
// (bench/NOTES.md, 2026-11-27, commit 17d890a: 12-16 instructions between HGMMAs, cuDNN's 8).
__device__ __forceinline__ uint64_t desc_advance(uint64_t d, uint32_t bytes) {
    const uint32_t lo = (uint32_t)d + (bytes >> 4), hi = (uint32_t)(d >> 32);
    return ((uint64_t)hi << 32) | lo;
}
// K-major operand: a panel tile with R rows (M or N), k16 step ks. kAdvance = false derives the
// descriptor from the step's address instead (the same value; kept for the one kernel that
// measured faster with it, config.cuh BwdSm90Traits::kDescAdvance).
template <bool kAdvance = true>
__device__ __forceinline__ uint64_t desc_k_major(uint32_t tile, int R, int ks) {
    const uint32_t off = (ks >> 2) * R * kPanelRowBytes + (ks & 3) * 32;
    if constexpr (kAdvance) return desc_advance(gmma_desc(tile, 16, 1024), off);
    else return gmma_desc(tile + off, 16, 1024);
}
// MN-major operand: a panel tile with R rows (K), k16 step ks; M/N panels R*128 bytes apart.
template <bool kAdvance = true>
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t tile, int R, int ks) {
    const uint32_t off = ks * 16 * kPanelRowBytes;
    if constexpr (kAdvance) return desc_advance(gmma_desc(tile, R * kPanelRowBytes, 1024), off);
    else return gmma_desc(tile + off, R * kPanelRowBytes, 1024);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy writes to shared memory (st.shared, cp.async) become visible to wgmma (async
// proxy) only after this fence (then a barrier between the writing and the reading threads).
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving accesses of accumulator registers across wgmma issue / wait.
template <int N>
__device__ __forceinline__ void reg_fence(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void reg_fence(uint32_t (&a)[N]) {  // register A fragments
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i])::"memory");
}
template <int M, int N>
__device__ __forceinline__ void reg_fence(uint32_t (&a)[M][N]) {
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
        for (int j = 0; j < N; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}

// d (+)= A * B for one k16 step (N/2 accumulators per thread). TA / TB: operand is MN-major.
template <int N, typename T, int TA, int TB>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d) {
#define CF_WG_SS(n)                                                                          \
    if constexpr (N == n) {                                                                  \
        if constexpr (std::is_same<T, __half>::value) wgmma_ss_m64n##n##_f16<TA, TB>(d, da, db, scale_d); \
        else wgmma_ss_m64n##n##_bf16<TA, TB>(d, da, db, scale_d);                            \
    }
    CF_WG_SS(32) CF_WG_SS(64) CF_WG_SS(80) CF_WG_SS(96) CF_WG_SS(112) CF_WG_SS(128) CF_WG_SS(144)
    CF_WG_SS(160) CF_WG_SS(176) CF_WG_SS(192) CF_WG_SS(256)
#undef CF_WG_SS
}
template <int N, typename T, int TB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db, int scale_d) {
#define CF_WG_RS(n)                                                                          \
    if constexpr (N == n) {                                                                  \
        if constexpr (std::is_same<T, __half>::value) wgmma_rs_m64n##n##_f16<TB>(d, a, db, scale_d); \
        else wgmma_rs_m64n##n##_bf16<TB>(d, a, db, scale_d);                                 \
    }
    CF_WG_RS(32) CF_WG_RS(64) CF_WG_RS(80) CF_WG_RS(96) CF_WG_RS(112) CF_WG_RS(128) CF_WG_RS(144)
    CF_WG_RS(160) CF_WG_RS(176) CF_WG_RS(192) CF_WG_RS(256)
#undef CF_WG_RS
}
// Four 8 x 8 matrices of 16-bit pairs (stmatrix): register i of a lane holds row lane / 4,
// columns 2 (lane % 4) + {0, 1} of matrix i; lane 8i + r gives the address of row r of matrix i
// (16 bytes).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}
// Four 8 x 8 matrices of 16-bit pairs, stored transposed (stmatrix .trans): register i of a lane
// holds row lane / 4, columns 2 (lane % 4) + {0, 1} of matrix i (the mma.sync fragment, low half
// first); lane 8i + r gives the address of row r of stored matrix i, which receives column r of
// the fragment (16 bytes).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

// e4m3 (k32 steps; both operands K-major): d (+)= A * B.
template <int N>
__device__ __forceinline__ void wgmma_ss_e4m3(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d) {
    static_assert(N == 64 || N == 128 || N == 160 || N == 192 || N == 224 || N == 256, "generated e4m3 widths");
    if constexpr (N == 64) wgmma_ss_m64n64_e4m3(d, da, db, scale_d);
    else if constexpr (N == 128) wgmma_ss_m64n128_e4m3(d, da, db, scale_d);
    else if constexpr (N == 160) wgmma_ss_m64n160_e4m3(d, da, db, scale_d);
    else if constexpr (N == 192) wgmma_ss_m64n192_e4m3(d, da, db, scale_d);
    else if constexpr (N == 224) wgmma_ss_m64n224_e4m3(d, da, db, scale_d);
    else wgmma_ss_m64n256_e4m3(d, da, db, scale_d);
}
template <int N>
__device__ __forceinline__ void wgmma_rs_e4m3(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db, int scale_d) {
    static_assert(N == 64 || N == 128 || N == 160 || N == 192 || N == 224 || N == 256, "generated e4m3 widths");
    if constexpr (N == 64) wgmma_rs_m64n64_e4m3(d, a, db, scale_d);
    else if constexpr (N == 128) wgmma_rs_m64n128_e4m3(d, a, db, scale_d);
    else if constexpr (N == 160) wgmma_rs_m64n160_e4m3(d, a, db, scale_d);
    else if constexpr (N == 192) wgmma_rs_m64n192_e4m3(d, a, db, scale_d);
    else if constexpr (N == 224) wgmma_rs_m64n224_e4m3(d, a, db, scale_d);
    else wgmma_rs_m64n256_e4m3(d, a, db, scale_d);
}

// Four f32 -> one register of e4m3 (x0 in the lowest byte: the lowest k of an 8-bit A
// fragment), round to nearest, saturated to +-448.
__device__ __forceinline__ uint32_t pack_e4m3x4(float x0, float x1, float x2, float x3) {
    uint16_t lo, hi;
    // cvt...e4m3x2 d, a, b puts a in the upper byte, b in the lower
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(x1), "f"(x0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(x3), "f"(x2));
    return (uint32_t)lo | ((uint32_t)hi << 16);
}

// ---- warp specialisation: mbarriers (shared memory, 8 bytes each), register reallocation and
// named barriers. A producer signals "stage full" with cp.async-tracking arrivals; consumers
// signal "stage empty" with plain arrivals; both sides wait on the phase parity.
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// One arrival once all cp.async issued so far by this thread have landed (.noinc: the arrival
// is one of the `count` given at init, not an extra pending one).
__device__ __forceinline__ void mbar_arrive_cp_async(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Blocks until the phase with the given parity has completed (a fresh barrier counts its
// preceding phase, parity 1, as completed: a producer's first wait on "empty" passes).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT;\n"
        "}\n" ::"r"(bar), "r"(parity) : "memory");
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// named_bar_sync that also returns whether any of the threads passed `pred` (bar.red.or).
__device__ __forceinline__ bool named_bar_any(int id, int threads, bool pred) {
    uint32_t any;
    asm volatile(
        "{\n"
        ".reg .pred in, out;\n"
        "setp.ne.u32 in, %1, 0;\n"
        "bar.red.or.pred out, %2, %3, in;\n"
        "selp.u32 %0, 1, 0, out;\n"
        "}\n"
        : "=r"(any)
        : "r"((uint32_t)pred), "r"(id), "r"(threads)
        : "memory");
    return any != 0;
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// cp.async of rows [0, ROWS) x chunks [0, C) of a row-major global tile into a panel tile.
// Rows >= valid_rows and chunks >= valid_chunks are zero-filled; `fallback` is any valid
// global address for the masked copies. 8 threads per row (one panel row of 8 chunks each).
// kRolled: one row pass at a time (fewer live registers; for producers whose main path is TMA).
template <int ROWS, int C, int NTHREADS, bool kRolled = false, typename T>
__device__ __forceinline__ void load_panels(T* s, const T* g, int64_t row_stride, int valid_rows,
                                            int valid_chunks, int tid, const void* fallback) {
    static_assert(C % 8 == 0, "panel tiles hold whole 64-element panels");
    constexpr int RP = NTHREADS / 8;  // rows per pass
    static_assert(RP % 8 == 0 && ROWS % RP == 0, "row step must keep the swizzle");
    const int r0 = tid >> 3, j = tid & 7;
    const uint32_t dst0 = smem_addr(s) + r0 * kPanelRowBytes + ((j ^ (r0 & 7)) << 4);
    const T* src = g + r0 * row_stride + j * 8;
    auto pass = [&](int ps) {
        const int r = r0 + ps * RP;
#pragma unroll
        for (int p = 0; p < C / 8; ++p) {
            const bool ok = r < valid_rows && p * 8 + j < valid_chunks;
            cp_async_16(dst0 + (p * ROWS + ps * RP) * kPanelRowBytes,
                        ok ? static_cast<const void*>(src + (int64_t)ps * RP * row_stride + p * 64) : fallback, ok);
        }
    };
    if constexpr (kRolled) {
#pragma unroll 1
        for (int ps = 0; ps < ROWS / RP; ++ps) pass(ps);
    } else {
#pragma unroll
        for (int ps = 0; ps < ROWS / RP; ++ps) pass(ps);
    }
}

// load_panels by one warp (a producer warp's fallback when TMA cannot load a tile): chunk c of
// row r at lane-strided positions; the same zero fill. kRolled: one copy per iteration (a
// producer warpgroup at 24 registers spilled with the loop unrolled 4 times).
template <int ROWS, int C, bool kRolled = false, typename T>
__device__ __forceinline__ void load_panels_warp(T* s, const T* g, int64_t row_stride, int valid_rows, int valid_chunks,
                                                 int lane, const void* fallback) {
    static_assert(C % 8 == 0 && (ROWS * C) % 32 == 0, "panel tiles hold whole 64-element panels");
    const uint32_t base = smem_addr(s);
#pragma unroll(kRolled ? 1 : 4)
    for (int idx = lane; idx < ROWS * C; idx += 32) {
        const int r = idx / C, c = idx % C;
        const bool ok = r < valid_rows && c < valid_chunks;
        cp_async_16(base + (c >> 3) * ROWS * kPanelRowBytes + r * kPanelRowBytes + (((c & 7) ^ (r & 7)) << 4),
                    ok ? static_cast<const void*>(g + (int64_t)r * row_stride + c * 8) : fallback, ok);
    }
}

// load_panels with rows gathered (paged K/V): row r at row_ptr(r), called only for r <
// valid_rows; one row pass at a time (see load_tile_rows: the producer runs at 40 / 56 registers).
template <int ROWS, int C, int NTHREADS, typename T, typename RowPtr>
__device__ __forceinline__ void load_panels_rows(T* s, RowPtr row_ptr, int valid_rows, int valid_chunks, int tid,
                                                 const void* fallback) {
    constexpr int RP = NTHREADS / 8;
    static_assert(C % 8 == 0 && RP % 8 == 0 && ROWS % RP == 0, "as load_panels");
    const int r0 = tid >> 3, j = tid & 7;
    const uint32_t dst0 = smem_addr(s) + r0 * kPanelRowBytes + ((j ^ (r0 & 7)) << 4);
#pragma unroll 1
    for (int ps = 0; ps < ROWS / RP; ++ps) {
        const int r = r0 + ps * RP;
        const bool row_ok = r < valid_rows;
        const T* src = (row_ok ? row_ptr(r) : static_cast<const T*>(fallback)) + j * 8;
#pragma unroll
        for (int p = 0; p < C / 8; ++p) {
            const bool ok = row_ok && p * 8 + j < valid_chunks;
            cp_async_16(dst0 + (p * ROWS + ps * RP) * kPanelRowBytes, ok ? static_cast<const void*>(src + p * 64) : fallback,
                        ok);
        }
    }
}

// load_panels / load_panels_rows as a type (see TileLoader in tile.cuh).
template <int C, int NTHREADS, bool kRolled = false>
struct PanelLoader {
    template <int ROWS, typename T>
    __device__ __forceinline__ static void load(T* s, const T* g, int64_t row_stride, int valid_rows,
                                                int valid_chunks, int tid, const void* fallback) {
        load_panels<ROWS, C, NTHREADS, kRolled>(s, g, row_stride, valid_rows, valid_chunks, tid, fallback);
    }
    template <int ROWS, typename T, typename RowPtr>
    __device__ __forceinline__ static void gather(T* s, RowPtr row_ptr, int valid_rows, int valid_chunks, int tid,
                                                  const void* fallback) {
        load_panels_rows<ROWS, C, NTHREADS>(s, row_ptr, valid_rows, valid_chunks, tid, fallback);
    }
};

}  // namespace cf
