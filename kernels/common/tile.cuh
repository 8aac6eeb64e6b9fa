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
template <int C>
__device__ __forceinline__ int swz(int row, int chunk) {
    static_assert(C % 4 == 0, "a swizzled row must hold a multiple of 4 chunks (64 bytes)");
    if constexpr (C % 8 == 0) {
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
    const int r0 = tid / TPR, tp = tid % TPR;
    const uint32_t dst0 = smem_addr(s) + (r0 * C + (tp ^ (swz<C>(r0, 0) - r0 * C))) * 16;
    const T* src = g + r0 * row_stride + tp * 8;
    const int64_t step = RP * row_stride;
#pragma unroll
    for (int ps = 0; ps < kPasses; ++ps) {
        const int r = r0 + ps * RP;
        if (ROWS % RP == 0 || r < ROWS) {
#pragma unroll
            for (int k = 0; k < KC; ++k) {
                const bool ok = r < valid_rows && tp + TPR * k < valid_chunks;
                cp_async_16(dst0 + (ps * RP * C + TPR * k) * 16,
                            ok ? static_cast<const void*>(src + TPR * k * 8) : fallback, ok);
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
    const int r0 = tid / TPR, tp = tid % TPR;
    const int chunk0 = r0 * C + (tp ^ (swz<C>(r0, 0) - r0 * C));
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
                            ok ? static_cast<const void*>(src[i] + tp * 8 + TPR * k * 8) : fallback, ok);
            }
    }
}

// f32 SIMT kernels: rows [0, ROWS) x columns [0, d) of two global tensors (same row range; row r
// at a_row(r) / b_row(r), called only for r < valid_rows) into padded shared tiles [ROWS][ld]
// (ld = d + 1: column reads hit distinct banks); rows >= valid_rows are zero. sb == nullptr:
// only the first.
template <int ROWS, int NTHREADS, typename RowA, typename RowB>
__device__ __forceinline__ void load_rows_f32(float* sa, RowA a_row, float* sb, RowB b_row, int valid_rows, int d,
                                              int ld, int tid) {
    for (int idx = tid; idx < ROWS * d; idx += NTHREADS) {
        const int r = idx / d, c = idx % d;
        const bool ok = r < valid_rows;
        sa[r * ld + c] = ok ? a_row(r)[c] : 0.f;
        if (sb != nullptr) sb[r * ld + c] = ok ? b_row(r)[c] : 0.f;
    }
}
// Row-major tensors (row r at a + r * a_stride); b == nullptr: only the first.
template <int ROWS, int NTHREADS>
__device__ __forceinline__ void load_rows_f32(float* sa, const float* a, int64_t a_stride, float* sb, const float* b,
                                              int64_t b_stride, int valid_rows, int d, int ld, int tid) {
    load_rows_f32<ROWS, NTHREADS>(
        sa, [=](int r) { return a + r * a_stride; }, b != nullptr ? sb : nullptr, [=](int r) { return b + r * b_stride; },
        valid_rows, d, ld, tid);
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

// ---------------------------------------------------------------- warp GEMMs
// acc[MT][NT] (+)= A * B^T, A = rows [a_row0, a_row0 + 16*MT) of a swizzled tile with CA chunks
// per row, B = rows [b_row0, b_row0 + 8*NT) of a swizzled tile with CB chunks per row; the
// reduction runs over k = [0, 16*KS) (the first 2*KS chunks of both). a_row0, b_row0: multiples of 8.
template <int MT, int NT, int KS, int CA, int CB, typename T, int KUNROLL = KS>
__device__ __forceinline__ void gemm_abt(float (&acc)[MT][NT][4], const T* sA, int a_row0,
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
__device__ __forceinline__ void gemm_rs_b(float (&acc)[MT][NT][4], const uint32_t (&a)[MT][KS][4],
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
__device__ __forceinline__ void gemm_ab(float (&acc)[MT][NT][4], const T* sA, int a_row0,
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
__device__ __forceinline__ void gemm_at_b(float (&acc)[MT][NT][4], const T* sX, int a_chunk0,
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

// C fragments of a 16 x (16*KS) f32 tile -> A fragments (rounded to T), for P*V / dS*K.
template <int MT, int KS, typename T>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[MT][KS][4], const float (&c)[MT][2 * KS][4]) {
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

}  // namespace cf
