// Small, named tile helpers shared by the forward and backward kernels: PTX wrappers for
// cp.async / ldmatrix / mma.sync (m16n8k16, f32 accumulators), the shared-memory swizzle, the
// warp-level GEMM building blocks and quad (4-lane) row reductions.
//
// Fragment conventions (PTX ISA, mma.m16n8k16 with .row.col):
//   lane = 4*g + q  (g = lane>>2 in 0..7, q = lane&3)
//   C/D (16x8 f32):  c[0],c[1] -> row g,   cols 2q, 2q+1;   c[2],c[3] -> row g+8, same cols
//   A   (16x16):     a[0] rows 0-7 k 0-7, a[1] rows 8-15 k 0-7, a[2] rows 0-7 k 8-15,
//                    a[3] rows 8-15 k 8-15 (each register: 2 consecutive k at row g, k=2q)
//   B   (16x8, "col"): b[0] k 0-7, b[1] k 8-15 (each register: k = 2q, 2q+1 at column n = g)
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>
#include <type_traits>

namespace cf {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---------------------------------------------------------------- swizzled shared tiles
// A tile row holds C chunks of 16 bytes (8 half-precision elements). Returns the chunk index of
// (row, chunk) in shared memory. The XOR spreads the 8 rows that one ldmatrix phase (or one
// 16-byte store phase) touches over the 8 distinct 16-byte bank groups.
//
// f32 tiles (kElemBytes = 4) XOR chunk bits 1-2 only, with ((row >> 1) & 1, (row ^ row >> 2) & 1):
// the 3xTF32 fragment reads (below) are then conflict-free both ways a tile is read: 8-byte pairs
// along a row (rows 4j..4j+3 x 2 chunks of one k-step) and single floats down a column (rows of
// one parity among 8 x 2 chunks), where the 16-bit XOR with (row & 7) is conflict-free for the
// second only.
template <typename T> constexpr int kChunkElems = 16 / (int)sizeof(T);  // elements per 16-byte chunk
template <typename T> constexpr int kMmaK = 32 / (int)sizeof(T);        // k of one mma (2 chunks): 16, or 8 (tf32)
template <int C, int kElemBytes = 2>
__device__ __forceinline__ int swz(int row, int chunk) {
    static_assert(C % 4 == 0, "a swizzled row must hold a multiple of 4 chunks (64 bytes)");
    if constexpr (kElemBytes == 4) {
        static_assert(C % 8 == 0, "f32 tiles: rows of whole 128 bytes");
        return row * C + (chunk ^ ((((row >> 1) & 1) << 2) | (((row ^ (row >> 2)) & 1) << 1)));
    } else if constexpr (C % 8 == 0) {
        return row * C + (chunk ^ (row & 7));
    } else {  // rows of 64 or 192 bytes: row parity already picks the bank half
        return row * C + (chunk ^ ((row >> 1) & 3));
    }
}

// ---------------------------------------------------------------- cp.async
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool pred) {
    const int n = pred ? 16 : 0;  // 0 -> the 16 bytes are zero-filled, nothing is read
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool pred) {
    const int n = pred ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Loads rows [0, ROWS) x chunks [0, C) of a row-major global tile into a swizzled shared tile.
// Rows >= valid_rows and chunks >= valid_chunks are zero-filled (never read); `fallback` is any
// valid global address used for the masked copies.
// Mapping: TPR threads per row (8, or 4 when C % 8 == 4); thread tid takes row tid / TPR (+ RP
// per pass) and chunks tp + TPR*k (tp = tid % TPR). With RP a multiple of 8 the swizzle of all
// its copies is one lane constant, so each copy is base + immediate (few live registers).
template <int C>
struct TileMap {
    static constexpr int kTpr = (C % 8 == 0) ? 8 : 4;
    static constexpr int kChunksPerThread = C / kTpr;
};
template <int ROWS, int C, int NTHREADS, typename T>
__device__ __forceinline__ void load_tile(T* s, const T* g, int64_t row_stride, int valid_rows,
                                          int valid_chunks, int tid, const void* fallback) {
    constexpr int TPR = TileMap<C>::kTpr, KC = TileMap<C>::kChunksPerThread;
    constexpr int RP = NTHREADS / TPR;
    constexpr int kPasses = (ROWS + RP - 1) / RP;
    static_assert(RP % 8 == 0, "row step must keep the swizzle");
    constexpr int E = kChunkElems<T>;
    const int r0 = tid / TPR, tp = tid % TPR;
    const uint32_t dst0 = smem_addr(s) + (r0 * C + (tp ^ (swz<C, sizeof(T)>(r0, 0) - r0 * C))) * 16;
    const T* src = g + r0 * row_stride + tp * E;
    const int64_t step = RP * row_stride;
#pragma unroll
    for (int ps = 0; ps < kPasses; ++ps) {
        const int r = r0 + ps * RP;
        if (ROWS % RP == 0 || r < ROWS) {
#pragma unroll
            for (int k = 0; k < KC; ++k) {
                const bool ok = r < valid_rows && tp + TPR * k < valid_chunks;
                cp_async_16(dst0 + (ps * RP * C + TPR * k) * 16,
                            ok ? static_cast<const void*>(src + TPR * k * E) : fallback, ok);
            }
        }
        src += step;
    }
}

// load_tile with rows gathered (paged K/V), into N tiles that share their rows (K and V of the
// same keys: one page lookup serves both). row_ptrs(r, src) sets src[i], the start of row r of
// tile i; it is called only for rows r < valid_rows (a page lookup must not run past its
// sequence's table entries). Kept apart from load_tile, whose strided form the register-bound
// kernels need as it is (routing it through a row function made the sm80 forward spill).
// kUnroll = false: one row pass at a time, so the lookups of several rows are never live
// together (kernels at their register limit); true: all lookups in flight at once (latency).
template <int ROWS, int C, int NTHREADS, bool kUnroll, int N, typename T, typename RowPtrs>
__device__ __forceinline__ void load_tile_rows(T* const (&s)[N], RowPtrs row_ptrs, int valid_rows, int valid_chunks,
                                               int tid, const void* fallback) {
    constexpr int TPR = TileMap<C>::kTpr, KC = TileMap<C>::kChunksPerThread;
    constexpr int RP = NTHREADS / TPR;
    constexpr int kPasses = (ROWS + RP - 1) / RP;
    constexpr int E = kChunkElems<T>;
    const int r0 = tid / TPR, tp = tid % TPR;
    const int chunk0 = r0 * C + (tp ^ (swz<C, sizeof(T)>(r0, 0) - r0 * C));
#pragma unroll(kUnroll ? kPasses : 1)
    for (int ps = 0; ps < kPasses; ++ps) {
        const int r = r0 + ps * RP;
        if (ROWS % RP != 0 && r >= ROWS) break;
        const bool row_ok = r < valid_rows;
        const T* src[N];
#pragma unroll
        for (int i = 0; i < N; ++i) src[i] = static_cast<const T*>(fallback);
        if (row_ok) row_ptrs(r, src);
#pragma unroll
        for (int i = 0; i < N; ++i)
#pragma unroll
            for (int k = 0; k < KC; ++k) {
                const bool ok = row_ok && tp + TPR * k < valid_chunks;
                cp_async_16(smem_addr(s[i]) + (chunk0 + ps * RP * C + TPR * k) * 16,
                            ok ? static_cast<const void*>(src[i] + tp * E + TPR * k * E) : fallback, ok);
            }
    }
}

// load_tile / load_tile_rows as a type (for code shared between kernels of different shared
// layouts: SeqInfo::load_keys, DkdvWork).
template <int C, int NTHREADS>
struct TileLoader {
    template <int ROWS, typename T>
    __device__ __forceinline__ static void load(T* s, const T* g, int64_t row_stride, int valid_rows,
                                                int valid_chunks, int tid, const void* fallback) {
        load_tile<ROWS, C, NTHREADS>(s, g, row_stride, valid_rows, valid_chunks, tid, fallback);
    }
    template <int ROWS, typename T, typename RowPtr>
    __device__ __forceinline__ static void gather(T* s, RowPtr row_ptr, int valid_rows, int valid_chunks, int tid,
                                                  const void* fallback) {
        T* const dst[1] = {s};
        load_tile_rows<ROWS, C, NTHREADS, false>(
            dst, [&](int r, const T* (&src)[1]) { src[0] = row_ptr(r); }, valid_rows, valid_chunks, tid, fallback);
    }
    // Two tiles of the same rows, every lookup in flight at once (SeqInfo::load_kv).
    template <int ROWS, typename T, typename RowPtrs>
    __device__ __forceinline__ static void gather2(T* s0, T* s1, RowPtrs row_ptrs, int valid_rows, int valid_chunks,
                                                   int tid, const void* fallback) {
        T* const dst[2] = {s0, s1};
        load_tile_rows<ROWS, C, NTHREADS, true>(dst, row_ptrs, valid_rows, valid_chunks, tid, fallback);
    }
};

// ---------------------------------------------------------------- ldmatrix / mma
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
    if constexpr (std::is_same<T, __half>::value) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        static_assert(std::is_same<T, __nv_bfloat16>::value, "f16 or bf16 only");
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Two floats -> one register of two 16-bit values (lo in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    if constexpr (std::is_same<T, __half>::value) {
        union { __half2 h; uint32_t u; } v;
        v.h = __floats2half2_rn(lo, hi);
        return v.u;
    } else {
        union { __nv_bfloat162 h; uint32_t u; } v;
        v.h = __floats2bfloat162_rn(lo, hi);
        return v.u;
    }
}

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
    return __bfloat162float(x);
}
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// SIMT kernels: rows [0, ROWS) x columns [0, cols) of a global tensor of element type T (row r
// at row(r), called only for r < valid_rows) into a padded f32 shared tile [ROWS][ld] (ld =
// cols + 1, or a wider row of a tile shared with another tensor: column reads by row-parallel
// threads then hit distinct banks); rows >= valid_rows are zero.
template <int ROWS, int NTHREADS, typename T, typename RowPtr>
__device__ __forceinline__ void load_rows_as_f32(float* s, RowPtr row, int valid_rows, int cols, int ld, int tid) {
    for (int idx = tid; idx < ROWS * cols; idx += NTHREADS) {
        const int r = idx / cols, c = idx % cols;
        s[r * ld + c] = r < valid_rows ? to_float<T>(row(r)[c]) : 0.f;
    }
}

// a . b over n floats (n a multiple of 4; a, b 16-byte aligned shared rows): float4 reads, four
// accumulation chains (one load instruction per two FMAs instead of two per FMA, and four
// FMAs in flight), for the SIMT kernels' row-parallel dot products.
__device__ __forceinline__ float simt_dot(const float* a, const float* b, int n) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    const float4* a4 = reinterpret_cast<const float4*>(a);
    const float4* b4 = reinterpret_cast<const float4*>(b);
#pragma unroll 4
    for (int c = 0; c < (n >> 2); ++c) {
        const float4 x = a4[c], y = b4[c];
        acc.x = fmaf(x.x, y.x, acc.x);
        acc.y = fmaf(x.y, y.y, acc.y);
        acc.z = fmaf(x.z, y.z, acc.z);
        acc.w = fmaf(x.w, y.w, acc.w);
    }
    return (acc.x + acc.y) + (acc.z + acc.w);
}

// ---------------------------------------------------------------- math
__device__ __forceinline__ float ex2(float x) {  // 2^x, -inf -> +0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
// Reductions over the kLanes consecutive lanes that hold one row (4 for the mma accumulator
// layouts, 8 for the f32 SIMT kernels).
template <int kLanes>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
    for (int o = 1; o < kLanes; o <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
template <int kLanes>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
    for (int o = 1; o < kLanes; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
__device__ __forceinline__ float quad_max(float x) { return group_max<4>(x); }
__device__ __forceinline__ float quad_sum(float x) { return group_sum<4>(x); }
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// ---------------------------------------------------------------- swizzled addressing
// An ldmatrix lane reads logical chunk cc + u of row r_lane + rc, where rc (a multiple of 8) and
// cc are compile-time after unrolling, r_lane and u are per lane/warp, and cc & u == 0 (so
// cc + u == cc | u). The swizzle XORs only the low 3 bits, so the physical chunk is
// (cc & ~7) + (u & ~7) + ((cc & 7) ^ y) with the lane constant y = (u & 7) ^ xor(r_lane): every
// address is a per-lane base + ((cc & 7) ^ y) * 16 + an immediate, i.e. at most 4 live address
// registers per operand after unrolling.
template <int C>
struct SwzPtr {
    uint32_t base;
    int y;
    __device__ __forceinline__ SwzPtr(const void* tile, int r_lane, int u) {
        base = smem_addr(tile) + (r_lane * C + (u & ~7)) * 16;
        y = (u & 7) ^ (swz<C>(r_lane, 0) - r_lane * C);
    }
    __device__ __forceinline__ uint32_t at(int rc, int cc) const {
        return base + (rc * C + (cc & ~7)) * 16 + (((cc & 7) ^ y) << 4);
    }
};

// ---------------------------------------------------------------- f32 on tensor cores (3xTF32)
// f32 operands run on mma.m16n8k8 .tf32 (sm_80+), each value split as x = big + small, both
// rounded to tf32 (11 significant bits): a b ~ a_big b_big + a_big b_small + a_small b_big, the
// 3xTF32 recipe of CUTLASS (OpMultiplyAddFastF32, what PyTorch's f32 memory-efficient attention
// runs). What it drops (a_small b_small, small's rounding) is ~2^-22 relative: f32-level error at
// 3 tensor-core products per product, provided the accumulation rounds (mma3_tf32 kFold, kStaged
// below).
// Fragments (m16n8k8 .row.col, lane = 4g + q): A a[0] (row g, k q), a[1] (g+8, q), a[2] (g, q+4),
// a[3] (g+8, q+4); B b[0] (k q, col g), b[1] (k q+4, col g); C as for m16n8k16.
// k order: in each k-step of 8, fragment index q stands for element 2q and q+4 for 2q+1 (A and B
// agree, so the sum is the same). Then a C fragment (columns 2q, 2q+1) is an A fragment as it is
// (P V, dS K: c_to_a), a row-major operand is read as 8-byte pairs, a transposed one as single
// floats, all conflict-free with the f32 swizzle (swz above).
// Column offsets of B operands (u, cc0, PSTRIDE) and of transposed A operands (a_chunk0) count
// 8-column units, as the 16-bit kernels' chunks do, so the kernels' index math is shared.
// The split, in integer operations on the bit patterns (cvt.rna.tf32.f32 compiles to a finiteness
// test plus a predicated add, and the split needs two): the mma reads a tf32 operand's top 19 bits
// and ignores the low 13, so adding half a tf32 ulp (0x1000) to the pattern rounds to nearest
// (ties away) when the mma truncates; big's exact value (those top bits) gives small = x - big
// exactly in f32, rounded the same way. 4 operations per value. Only for finite |x| < 2^128 (1 -
// 2^-12): larger ones (and inf) come out as NaN instead of inf, which no finite attention input
// reaches.
template <int N>
struct Tf32Split {
    uint32_t big[N], small[N];
    Tf32Split() = default;
    __device__ __forceinline__ explicit Tf32Split(const float (&x)[N]) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            big[i] = __float_as_uint(x[i]) + 0x1000u;
            small[i] = __float_as_uint(x[i] - __uint_as_float(big[i] & 0xffffe000u)) + 0x1000u;
        }
    }
};
__device__ __forceinline__ void mma1688_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// acc[MT][NT] += A B over one k-step, 3xTF32, with B fragments load_b(nt) taken kF32Group n8
// tiles at a time (all of them at once: 4 registers per tile, too many at d = 128): per group
// the small terms first, each pass over the group's tiles before the next (consecutive mmas
// never chain on one accumulator).
// kFold, for a product whose k range is one call's (S = Q K^T, dP = dO V^T, atomic dQ): the
// three products go into zeroed registers, added to acc once (round to nearest). The tensor
// cores add into their accumulator with truncation, three times per k-step; on the running sum
// that biased error grew with d (d = 256 causal: O 3x, dQ 9x the error of exact f32 against f64;
// folded: 0.5-1.4x, bench/NOTES.md, 2026-11-26, commit d223264). Two m tiles: groups of 2 n8 tiles
// (fewer live partial sums).
constexpr int kF32Group = 4;
constexpr int f32_group(int nt) { return nt % kF32Group == 0 ? kF32Group : nt % 3 == 0 ? 3 : nt % 2 == 0 ? 2 : 1; }
template <bool kFold, int MT, int NT, typename LoadB>
__device__ __forceinline__ void mma3_tf32(float (&acc)[MT][NT][4], const Tf32Split<4> (&a)[MT], LoadB load_b) {
    constexpr int G = kFold && MT >= 2 ? (NT % 2 == 0 ? 2 : 1) : f32_group(NT);
#pragma unroll
    for (int n0 = 0; n0 < NT; n0 += G) {
        Tf32Split<2> b[G];
#pragma unroll
        for (int j = 0; j < G; ++j) b[j] = load_b(n0 + j);
        // the three passes into x[mt][off + j]: acc itself, or the zeroed partial sums (kFold)
        auto passes = [&](auto& x, int off) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < G; ++j) mma1688_tf32(x[mt][off + j], a[mt].small, b[j].big[0], b[j].big[1]);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < G; ++j) mma1688_tf32(x[mt][off + j], a[mt].big, b[j].small[0], b[j].small[1]);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < G; ++j) mma1688_tf32(x[mt][off + j], a[mt].big, b[j].big[0], b[j].big[1]);
        };
        if constexpr (kFold) {
            float part[MT][G][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < G; ++j) part[mt][j][0] = part[mt][j][1] = part[mt][j][2] = part[mt][j][3] = 0.f;
            passes(part, 0);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < G; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[mt][n0 + j][e] += part[mt][j][e];
        } else {
            passes(acc, n0);
        }
    }
}
// Element (row, col) of a swizzled f32 tile with C chunks per row.
template <int C>
__device__ __forceinline__ int f32_at(int row, int col) {
    return swz<C, 4>(row, col >> 2) * 4 + (col & 3);
}
// A lane's reads of a swizzled f32 tile, as SwzPtr does for ldmatrix: row r_lane + rc (rc a
// compile-time multiple of 8), chunk cc + u (cc compile-time and even, u in {0, 1} per lane),
// float `word` of the chunk. The XOR y of r_lane touches chunk bits 1-2 only, so the chunk is
// (cc & ~7) + ((cc & 7) ^ y) + u: a per-lane base plus immediates after unrolling.
template <int C>
struct F32Ptr {
    uint32_t base;
    int y;
    __device__ __forceinline__ F32Ptr(const float* tile, int r_lane, int u, int word) {
        base = smem_addr(tile) + (r_lane * C + u) * 16 + word * 4;
        y = swz<C, 4>(r_lane, 0) - r_lane * C;
    }
    __device__ __forceinline__ uint32_t at(int rc, int cc) const {
        return base + (rc * C + (cc & ~7)) * 16 + (((cc & 7) ^ y) << 4);
    }
};
__device__ __forceinline__ float2 lds_f32x2(uint32_t addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
    return v;
}
__device__ __forceinline__ float lds_f32(uint32_t addr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
    return v;
}
// Row-major operands ([m][k] A, [n][k] B) read as 8-byte pairs: lane (g, q) reads row g (+ 8 for
// A's second half), elements 8 ks + 2q, 2q + 1 = chunk 2 ks + (q >> 1), words 2 (q & 1), +1.
template <int C>
struct F32Rows {
    F32Ptr<C> p;
    __device__ __forceinline__ F32Rows(const float* tile, int row0, int lane)
        : p(tile, row0 + (lane >> 2), (lane & 3) >> 1, 2 * (lane & 1)) {}
    __device__ __forceinline__ Tf32Split<4> a(int rc, int ks) const {
        const float2 lo = lds_f32x2(p.at(rc, 2 * ks)), hi = lds_f32x2(p.at(rc + 8, 2 * ks));
        const float x[4] = {lo.x, hi.x, lo.y, hi.y};
        return Tf32Split<4>(x);
    }
    __device__ __forceinline__ Tf32Split<2> b(int rc, int ks) const {
        const float2 v = lds_f32x2(p.at(rc, 2 * ks));
        const float x[2] = {v.x, v.y};
        return Tf32Split<2>(x);
    }
};
// Operands read down columns ([k][n] B, [k][m] A): lane (g, q) reads rows 8 ks + 2q and 2q + 1,
// column col + g = chunk col / 4 + (g >> 2), word g & 3 (col: a compile-time multiple of 8).
template <int C>
struct F32Cols {
    F32Ptr<C> even, odd;
    __device__ __forceinline__ F32Cols(const float* tile, int lane)
        : even(tile, 2 * (lane & 3), (lane >> 4) & 1, (lane >> 2) & 3),
          odd(tile, 2 * (lane & 3) + 1, (lane >> 4) & 1, (lane >> 2) & 3) {}
    __device__ __forceinline__ Tf32Split<2> b(int ks, int col) const {
        const float x[2] = {lds_f32(even.at(8 * ks, col >> 2)), lds_f32(odd.at(8 * ks, col >> 2))};
        return Tf32Split<2>(x);
    }
    __device__ __forceinline__ Tf32Split<4> a(int ks, int col) const {
        const float x[4] = {lds_f32(even.at(8 * ks, col >> 2)), lds_f32(even.at(8 * ks, (col >> 2) + 2)),
                            lds_f32(odd.at(8 * ks, col >> 2)), lds_f32(odd.at(8 * ks, (col >> 2) + 2))};
        return Tf32Split<4>(x);
    }
};
// A fragments held as C fragments (c_to_a<..., float>: the bits of P / dS, k order above).
__device__ __forceinline__ Tf32Split<4> f32_a_regs(const uint32_t (&a)[4]) {
    const float x[4] = {__uint_as_float(a[0]), __uint_as_float(a[1]), __uint_as_float(a[2]), __uint_as_float(a[3])};
    return Tf32Split<4>(x);
}

// acc[MT][NT] += sum over KS k-steps of A B, with fragments load_a(mt, ks) and load_b(nt, ks).
// The k loop unrolls by at most kF32Unroll (fully unrolled, the hoisted fragment loads, twice
// the registers of 16-bit ones, spill); kFull: fully (A fragments indexed by ks in registers).
// kStaged: for products summed over a whole sequence (P V, dV, dK, deterministic dQ). The tensor
// cores add into the accumulator with truncation, so over thousands of k-steps 3xTF32 drifts
// from f32 (measured: 2-3x the error of exact f32 at 1k rows); staged, every n8 group sums the
// KS k-steps into zeroed registers and adds them to acc once (round to nearest), as CUTLASS's
// 3xTF32 mainloop does. A fragments are then loaded once per group. Otherwise (one call's k
// range) each k-step is folded into acc (mma3_tf32 kFold).
constexpr int kF32Unroll = 2;
template <int MT, int NT, int KS, int KUNROLL, bool kStaged, typename LoadA, typename LoadB>
__device__ __forceinline__ void f32_gemm(float (&acc)[MT][NT][4], LoadA load_a, LoadB load_b) {
    if constexpr (!kStaged) {
        // two m tiles: one k-step at a time (unrolled by 2, the d = 64 forward spilled 16 bytes)
        constexpr int U = MT >= 2 ? 1 : (KUNROLL < kF32Unroll ? KUNROLL : kF32Unroll);
#pragma unroll(U)
        for (int ks = 0; ks < KS; ++ks) {
            Tf32Split<4> a[MT];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) a[mt] = load_a(mt, ks);
            mma3_tf32<true>(acc, a, [&](int nt) { return load_b(nt, ks); });
        }
    } else {
        constexpr int G = f32_group(NT);
#pragma unroll
        for (int n0 = 0; n0 < NT; n0 += G) {
            float part[MT][G][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < G; ++j) part[mt][j][0] = part[mt][j][1] = part[mt][j][2] = part[mt][j][3] = 0.f;
#pragma unroll(KUNROLL < kF32Unroll ? KUNROLL : kF32Unroll)
            for (int ks = 0; ks < KS; ++ks) {
                Tf32Split<4> a[MT];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) a[mt] = load_a(mt, ks);
                mma3_tf32<false>(part, a, [&](int j) { return load_b(n0 + j, ks); });
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < G; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[mt][n0 + j][e] += part[mt][j][e];
        }
    }
}

// The f32 forms of the warp GEMMs below (same arguments; column units as said above).
template <int MT, int NT, int KS, int CA, int CB, int KUNROLL>
__device__ __forceinline__ void gemm_abt_f32(float (&acc)[MT][NT][4], const float* sA, int a_row0, const float* sB,
                                             int b_row0, int lane) {
    const F32Rows<CA> pa(sA, a_row0, lane);
    const F32Rows<CB> pb(sB, b_row0, lane);
    f32_gemm<MT, NT, KS, KUNROLL, false>(acc, [&](int mt, int ks) { return pa.a(16 * mt, ks); },
                                         [&](int nt, int ks) { return pb.b(8 * nt, ks); });
}
// B columns of n8 tile nt: 8 * (c0 + PSTRIDE * (nt / 2)) + 8 * (nt % 2) + [0, 8).
template <int PSTRIDE>
__device__ __forceinline__ int f32_b_col(int c0, int nt) {
    return 8 * (c0 + PSTRIDE * (nt >> 1)) + 8 * (nt & 1);
}
template <int MT, int NT, int KS, int CB, int PSTRIDE>
__device__ __forceinline__ void gemm_rs_b_f32(float (&acc)[MT][NT][4], const uint32_t (&ar)[MT][KS][4], const float* sB,
                                              int b_row0, int u, int lane) {
    const F32Cols<CB> pb(sB + b_row0 * CB * 4, lane);  // b_row0: a multiple of 8 (the swizzle repeats)
    f32_gemm<MT, NT, KS, KS, true>(acc, [&](int mt, int ks) { return f32_a_regs(ar[mt][ks]); },
                                   [&](int nt, int ks) { return pb.b(ks, f32_b_col<PSTRIDE>(u, nt)); });
}
template <int MT, int NT, int KS, int CA, int CB, int PSTRIDE>
__device__ __forceinline__ void gemm_ab_f32(float (&acc)[MT][NT][4], const float* sA, int a_row0, const float* sB, int u,
                                            int cc0, int lane) {
    const F32Rows<CA> pa(sA, a_row0, lane);
    const F32Cols<CB> pb(sB, lane);
    f32_gemm<MT, NT, KS, kF32Unroll, false>(acc, [&](int mt, int ks) { return pa.a(16 * mt, ks); },
                                            [&](int nt, int ks) { return pb.b(ks, f32_b_col<PSTRIDE>(cc0 + u, nt)); });
}
template <int MT, int NT, int KS, int CA, int CB, int PSTRIDE, int KUNROLL>
__device__ __forceinline__ void gemm_at_b_f32(float (&acc)[MT][NT][4], const float* sX, int a_chunk0, const float* sB,
                                              int u, int lane) {
    const F32Cols<CA> pa(sX, lane);
    const F32Cols<CB> pb(sB, lane);
    f32_gemm<MT, NT, KS, KUNROLL, true>(acc, [&](int mt, int ks) { return pa.a(ks, 8 * a_chunk0 + 16 * mt); },
                                        [&](int nt, int ks) { return pb.b(ks, f32_b_col<PSTRIDE>(u, nt)); });
}

// ---------------------------------------------------------------- warp GEMMs
// acc[MT][NT] (+)= A * B^T, A = rows [a_row0, a_row0 + 16*MT) of a swizzled tile with CA chunks
// per row, B = rows [b_row0, b_row0 + 8*NT) of a swizzled tile with CB chunks per row; the
// reduction runs over k = [0, 16*KS) (the first 2*KS chunks of both). a_row0, b_row0: multiples of 8.
template <int MT, int NT, int KS, int CA, int CB, typename T, int KUNROLL = KS>
__device__ __forceinline__ void gemm_abt_16(float (&acc)[MT][NT][4], const T* sA, int a_row0,
                                         const T* sB, int b_row0, int lane) {
    static_assert(NT % 2 == 0, "n tiles come in pairs (one ldmatrix.x4)");
    const SwzPtr<CA> pa(sA, a_row0 + (lane & 15), lane >> 4);
    const SwzPtr<CB> pb(sB, b_row0 + (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
    auto step = [&](int ks) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldsm_x4(a[mt], pa.at(mt * 16, 2 * ks));
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            uint32_t b[4];
            ldsm_x4(b, pb.at(np * 16, 2 * ks));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816<T>(acc[mt][2 * np], a[mt], b[0], b[1]);
                mma16816<T>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    };
    if constexpr (KUNROLL >= KS) {  // plain full unroll (the codegen the H100 runs were timed with)
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) step(ks);
    } else {
#pragma unroll KUNROLL
        for (int ks = 0; ks < KS; ++ks) step(ks);
    }
}

// B operand from a row-major [k][n] swizzled tile (CB chunks per row), read transposed: k rows
// b_row0 + 16*ks + [0, 16); the n columns come in pairs of n8 tiles (16 columns = 2 chunks):
// pair np covers chunks u + PSTRIDE*np + {0, 1}, where u (per warp, even, < PSTRIDE) selects
// this warp's pair when PSTRIDE/2 warps interleave over the columns.
template <int CB, int PSTRIDE>
struct BRowMajor {
    static_assert(PSTRIDE == 2 || PSTRIDE == 4 || PSTRIDE == 8, "pair stride");
    SwzPtr<CB> p;
    __device__ __forceinline__ BRowMajor(const void* tile, int b_row0, int u, int lane)
        : p(tile, b_row0 + (lane & 15), u + (lane >> 4)) {}
    // cc0: compile-time chunk offset, a multiple of PSTRIDE (selects a later group of pairs)
    __device__ __forceinline__ void load(uint32_t (&b)[4], int ks, int np, int cc0 = 0) const {
        ldsm_x4_t(b, p.at(ks * 16, cc0 + PSTRIDE * np));
    }
};

// acc[MT][NT] (+)= A * B, A in registers (A fragments, KS k-steps of 16), B row-major (above).
template <int MT, int NT, int KS, int CB, int PSTRIDE, typename T>
__device__ __forceinline__ void gemm_rs_b_16(float (&acc)[MT][NT][4], const uint32_t (&a)[MT][KS][4],
                                          const T* sB, int b_row0, int u, int lane) {
    static_assert(NT % 2 == 0, "n tiles come in pairs (one ldmatrix.x4)");
    const BRowMajor<CB, PSTRIDE> pb(sB, b_row0, u, lane);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            uint32_t b[4];
            pb.load(b, ks, np);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816<T>(acc[mt][2 * np], a[mt][ks], b[0], b[1]);
                mma16816<T>(acc[mt][2 * np + 1], a[mt][ks], b[2], b[3]);
            }
        }
    }
}

// acc[MT][NT] (+)= A * B, A = rows [a_row0, a_row0 + 16*MT) of a swizzled tile (CA chunks per
// row, k = [0, 16*KS)), B row-major (above).
template <int MT, int NT, int KS, int CA, int CB, int PSTRIDE, typename T>
__device__ __forceinline__ void gemm_ab_16(float (&acc)[MT][NT][4], const T* sA, int a_row0,
                                        const T* sB, int u, int cc0, int lane) {
    static_assert(NT % 2 == 0, "n tiles come in pairs (one ldmatrix.x4)");
    const SwzPtr<CA> pa(sA, a_row0 + (lane & 15), lane >> 4);
    const BRowMajor<CB, PSTRIDE> pb(sB, 0, u, lane);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldsm_x4(a[mt], pa.at(mt * 16, 2 * ks));
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            uint32_t b[4];
            pb.load(b, ks, np, cc0);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816<T>(acc[mt][2 * np], a[mt], b[0], b[1]);
                mma16816<T>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// acc[MT][NT] (+)= X^T * B: X = a row-major [k][m] swizzled tile (CA chunks per row) read
// transposed, m columns = chunks a_chunk0 + [0, 2*MT) (a_chunk0 & (2*mt) == 0 for all mt);
// B row-major (above); k rows [0, 16*KS). KUNROLL: unroll factor of the k loop (a full unroll
// lets the scheduler hoist every fragment load, which can cost more registers than there are).
template <int MT, int NT, int KS, int CA, int CB, int PSTRIDE, typename T, int KUNROLL = KS>
__device__ __forceinline__ void gemm_at_b_16(float (&acc)[MT][NT][4], const T* sX, int a_chunk0,
                                          const T* sB, int u, int lane) {
    static_assert(NT % 2 == 0, "n tiles come in pairs (one ldmatrix.x4)");
    const SwzPtr<CA> pa(sX, (lane & 7) + ((lane >> 4) << 3), a_chunk0 + ((lane >> 3) & 1));
    const BRowMajor<CB, PSTRIDE> pb(sB, 0, u, lane);
#pragma unroll KUNROLL
    for (int ks = 0; ks < KS; ++ks) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldsm_x4_t(a[mt], pa.at(ks * 16, 2 * mt));
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            uint32_t b[4];
            pb.load(b, ks, np);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816<T>(acc[mt][2 * np], a[mt], b[0], b[1]);
                mma16816<T>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// The element-generic entry points: 16-bit (ldmatrix + m16n8k16) or f32 (3xTF32) forms.
template <int MT, int NT, int KS, int CA, int CB, typename T, int KUNROLL = KS>
__device__ __forceinline__ void gemm_abt(float (&acc)[MT][NT][4], const T* sA, int a_row0, const T* sB, int b_row0,
                                         int lane) {
    if constexpr (std::is_same<T, float>::value)
        gemm_abt_f32<MT, NT, KS, CA, CB, KUNROLL>(acc, sA, a_row0, sB, b_row0, lane);
    else
        gemm_abt_16<MT, NT, KS, CA, CB, T, KUNROLL>(acc, sA, a_row0, sB, b_row0, lane);
}
template <int MT, int NT, int KS, int CB, int PSTRIDE, typename T>
__device__ __forceinline__ void gemm_rs_b(float (&acc)[MT][NT][4], const uint32_t (&a)[MT][KS][4], const T* sB,
                                          int b_row0, int u, int lane) {
    if constexpr (std::is_same<T, float>::value)
        gemm_rs_b_f32<MT, NT, KS, CB, PSTRIDE>(acc, a, sB, b_row0, u, lane);
    else
        gemm_rs_b_16<MT, NT, KS, CB, PSTRIDE, T>(acc, a, sB, b_row0, u, lane);
}
template <int MT, int NT, int KS, int CA, int CB, int PSTRIDE, typename T>
__device__ __forceinline__ void gemm_ab(float (&acc)[MT][NT][4], const T* sA, int a_row0, const T* sB, int u, int cc0,
                                        int lane) {
    if constexpr (std::is_same<T, float>::value)
        gemm_ab_f32<MT, NT, KS, CA, CB, PSTRIDE>(acc, sA, a_row0, sB, u, cc0, lane);
    else
        gemm_ab_16<MT, NT, KS, CA, CB, PSTRIDE, T>(acc, sA, a_row0, sB, u, cc0, lane);
}
template <int MT, int NT, int KS, int CA, int CB, int PSTRIDE, typename T, int KUNROLL = KS>
__device__ __forceinline__ void gemm_at_b(float (&acc)[MT][NT][4], const T* sX, int a_chunk0, const T* sB, int u,
                                          int lane) {
    if constexpr (std::is_same<T, float>::value)
        gemm_at_b_f32<MT, NT, KS, CA, CB, PSTRIDE, KUNROLL>(acc, sX, a_chunk0, sB, u, lane);
    else
        gemm_at_b_16<MT, NT, KS, CA, CB, PSTRIDE, T, KUNROLL>(acc, sX, a_chunk0, sB, u, lane);
}

// C fragments of a 16 x (kMmaK<T> * KS) f32 tile -> A fragments of KS k-steps (rounded to T), for
// P*V / dS*K. T = float: the same values, reordered (the k order of the 3xTF32 section).
template <int MT, int KS, typename T>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[MT][KS][4], const float (&c)[MT][KS * kMmaK<T> / 8][4]) {
    if constexpr (std::is_same<T, float>::value) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                a[mt][ks][0] = __float_as_uint(c[mt][ks][0]);
                a[mt][ks][1] = __float_as_uint(c[mt][ks][2]);
                a[mt][ks][2] = __float_as_uint(c[mt][ks][1]);
                a[mt][ks][3] = __float_as_uint(c[mt][ks][3]);
            }
    } else {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            a[mt][ks][0] = pack2<T>(c[mt][2 * ks][0], c[mt][2 * ks][1]);
            a[mt][ks][1] = pack2<T>(c[mt][2 * ks][2], c[mt][2 * ks][3]);
            a[mt][ks][2] = pack2<T>(c[mt][2 * ks + 1][0], c[mt][2 * ks + 1][1]);
            a[mt][ks][3] = pack2<T>(c[mt][2 * ks + 1][2], c[mt][2 * ks + 1][3]);
        }
    }
    }
}

// The epilogues' shared staging, for every element type: the pair (col, col + 1) of row `row`
// (col even) of a swizzled tile with C chunks per row, stored from f32 as T; and chunk c of row
// `row` (16 bytes) for the coalesced copies out.
template <typename T, int C>
__device__ __forceinline__ void stage_pair(T* tile, int row, int col, float lo, float hi) {
    constexpr int E = kChunkElems<T>;
    T* dst = tile + swz<C, sizeof(T)>(row, col / E) * E + col % E;
    if constexpr (std::is_same<T, float>::value) {
        *reinterpret_cast<float2*>(dst) = make_float2(lo, hi);
    } else {
        *reinterpret_cast<uint32_t*>(dst) = pack2<T>(lo, hi);
    }
}
template <typename T, int C>
__device__ __forceinline__ const uint4& staged_chunk(const T* tile, int row, int c) {
    return *reinterpret_cast<const uint4*>(tile + swz<C, sizeof(T)>(row, c) * kChunkElems<T>);
}

}  // namespace cf
