// Forward pass for Hopper (sm_90a): warpgroup MMA (wgmma), warp-specialised, same semantics as
// every other forward (flash_api.h; masks, logits and the online softmax from common/).
// Chosen by the plan (plan.cu) for head-dim tiles 64 / 96 / 128 / 192 / 256 when sm90a_available().
//
// Parts, in the order a CTA runs them:
//   FwdSharedStorage   shared memory as a struct; the launch asks for exactly its sizeof
//   FwdTileScheduler   (tile_scheduler.cuh) which tiles this CTA computes, persistent or not
//   FwdProducer        one warpgroup, loads only (Q and the K / V ring: TMA where tma.cuh
//                      allows, else cp.async)
//   FwdMainloop        consumer warpgroups: S = Q K^T, masking, online softmax, O += P V
//   FwdEpilogue        normalise, write lse, stage O in shared memory, 16-byte stores
//   PingPong           consumer warpgroups taking turns at the tensor cores
//
// Barrier protocol (all mbarriers in FwdSharedStorage; Pipeline in pipeline.cuh):
//   Loads: TMA (thread 0: expect_tx of the tile's bytes on the stage's full barrier, then the
//        boxes) or cp.async (every producer thread its share); either way every producer thread
//        then commits one cp.async-tracking arrival, so "full" completes when both the arrivals
//        and the bytes are in (tma.cuh says which tiles take which path).
//   Q    1-stage pipeline. Producer: acquire(tile count) -> load Q -> commit. Consumers:
//        wait(tile count) before the first S; release once they no longer read Q (after the
//        last S when O has its own buffer; after the epilogue's staging when O is staged in
//        Q's rows).
//   K, V kStages-stage pipelines with a shared buffer counter (the CTA's n-th key block uses
//        stage n % kStages of both). Producer order per tile: K(0), Q, then K(j), V(j-1) for
//        j = 1.., then V(last): the order the consumers need them in. Consumers release K(j)
//        as soon as S(j) has completed, V(j) once P(j) V(j) has.
//   Named barriers 1..kNWarpGroups (PingPong): warpgroup w issues its GEMMs after w-1 did.
//   The only CTA-wide barrier is the one after barrier initialisation; the producer runs
//   ahead by up to kStages key blocks and into the next tile.
// Per key block j (last one first), each consumer warpgroup (as in FlashAttention-3):
//   S(j) = Q K(j)^T (wgmma_ss) and O += P(j-1) V(j-1) (wgmma_rs, P from registers) are issued
//   back to back; the softmax of block j runs while the tensor cores finish P V; O is rescaled
//   by block j's correction after P(j-1) V(j-1) has completed, at the end of the step or
//   (Kt::kEarlyRescale, d = 256) in the next step between issuing S(j+1) and P(j) V(j).
// e4m3 inputs (Kt::kFp8; FlashAttention-3's FP8 forward): both products on 8-bit wgmma (k32),
// which reads both operands K-major. So V is transposed: by the producer warpgroup from raw V
// tiles (Kt::kVtInKernel, FwdVTranspose) or first, by a pre-pass (fp8_transpose_v_kernel, into
// the workspace: Fp8VtLayout in plan.cuh) whose V^T tiles the producer then loads; either
// way a V^T stage is [D][kBlockN keys] (128-key panels), the keys of each 32-key group in the
// order in which a thread's S accumulators become its 8-bit A fragment of P (fp8_vt_key), so P
// goes from registers into O += P V^T with no shuffle. S is scaled by q descale * k descale
// through the logit scale, O by the v descale in the epilogue, and P (in [0, 1]) is rounded to
// e4m3 unscaled. Every load is TMA.
// Barriers of the in-kernel transpose (kVtInKernel), per key block, all 128 producer threads:
//   wait vraw_bar (thread 0's arrival + the raw TMA bytes) and V^T's empty -> transpose ->
//   fence.proxy.async -> arrive on V^T's full (128 arrivals) -> producer named barrier
//   (kProducerBar: the raw tile is read) -> thread 0 issues the next raw block.
// The kernel body exists only in sm_90a code (wgmma); the same file also builds for sm_80 / PTX.
#include <cstddef>
#include <cstdint>
#include "../config.cuh"
#include "../plan.cuh"
#include "../launch.cuh"
#include "../common/softmax.cuh"
#include "pipeline.cuh"
#include "tile_scheduler.cuh"
#include "tma.cuh"

namespace cf {

#ifdef CF_FWD_TRACE
// Timeline probe (a build-time option for experiments/fwd_trace.py, never in the crate's build):
// clock64() at eight points of the mainloop's key-block loop (named in experiments/fwd_trace.py), taken by thread 0 of
// each consumer warpgroup of CTA 0 over the first kTraceBlocks key blocks of its first tile, so
// that a step's time can be split into waits (data, turn, products) and work (softmax).
constexpr int kTraceBlocks = 64, kTraceEvents = 8;
__device__ long long g_fwd_trace[4][kTraceBlocks][kTraceEvents];
#define CF_TRACE(on, wg, j, e)                                                            \
    do {                                                                                  \
        if ((on) && (threadIdx.x & 127) == 0 && (j) < kTraceBlocks) g_fwd_trace[wg][j][e] = clock64(); \
    } while (0)
#else
#define CF_TRACE(on, wg, j, e) \
    do {                       \
    } while (0)
#endif

template <typename T, int kElems, bool kPresent>
struct alignas(1024) OptionalTile {
    T data[kElems];
};
template <typename T, int kElems>
struct OptionalTile<T, kElems, false> {};

// Every tile is 1024-byte aligned: wgmma's 128-byte swizzle is anchored at 1024-byte boundaries.
template <typename Kt>
struct FwdSharedStorage {
    using T = typename Kt::Elem;
    using To = typename Kt::Out;
    static constexpr int kQElems = Kt::kBlockM * Kt::kHeadDimPad, kKVElems = Kt::kBlockN * Kt::kHeadDimPad;
    alignas(1024) T q[kQElems];
    alignas(1024) T k[Kt::kStages][kKVElems];
    alignas(1024) T v[Kt::kStages][Kt::kVtKeys * Kt::kHeadDimPad];  // e4m3: V^T tiles [D][kVtKeys]
    OptionalTile<To, kQElems, Kt::kSeparateO> o;  // own output staging buffer, else staged in q
    OptionalTile<T, Kt::kVRawBytes, Kt::kVtInKernel> vraw;  // e4m3 d = 128: V as loaded, [kBlockN][128]
    // Pipeline barriers (full, then empty, per pipeline), contiguous: all pipelines are
    // addressed from one base register.
    uint64_t q_bars[2][1];
    uint64_t k_bars[2][Kt::kStages];
    uint64_t v_bars[2][Kt::kStages];
    uint64_t vraw_bar;  // kVtInKernel: the raw V tile has landed (thread 0's arrival + its bytes)

    __device__ __forceinline__ To* o_staging() {
        if constexpr (Kt::kSeparateO) return o.data;
        else return q;  // T == To (config.cuh)
    }
};

// ---------------------------------------------------------------- e4m3: V^T
// Column order of the keys of a 32-key group in V^T (relative to its sequence's first key):
// position s holds key fp8_vt_key(s). A thread's S accumulators hold, per 32 keys, columns
// 2q + {0, 1} + 8i (i = 0..3) of rows g and g + 8; the 8-bit A fragment wants k = 4q + {0..3}
// (register 0 / 1, rows g / g + 8) and 16 + 4q + {0..3} (registers 2 / 3). Storing key
// 16h + 8(e >> 1) + 2q + (e & 1) at position 16h + 4q + e makes the two coincide.
__host__ __device__ constexpr int fp8_vt_key(int s) {
    return (s & 16) + 8 * ((s & 3) >> 1) + 2 * ((s & 15) >> 2) + (s & 1);
}
// Column of a sequence's key 0 in V^T (Fp8VtLayout).
__device__ __forceinline__ int64_t fp8_vt_col0(const SeqInfo& si) {
    return si.k_varlen ? fp8_vt_varlen_col0(si.k_row0, si.b) : 0;
}

// V (e4m3, the contract's addressing) -> V^T (Fp8VtLayout): CTA = kVtKeys keys x 64 columns of d
// of one (sequence, KV head), in halves of 64 keys (each thread has both halves' loads in flight
// before the barrier); zeros from the sequence's end to fp8_vt_padded_keys (the attention kernel
// loads whole key blocks; P is 0 there, V must not be NaN).
// Shared tile [key][d] with the 16-byte chunks of key row k XOR-swizzled by (k / 16) % 4: in the
// gather below, the four threads of a d row read keys 16 apart at the same d; unswizzled (any
// row pitch that keeps the chunks 16-byte aligned) those four reads hit one bank, a 4-way
// conflict on every byte read (ncu: 38 us for the 33.5 MB of V at B * N = 16384, H = 16,
// d = 128, i.e. 1.45 TB/s; ~8% of a 2k forward).
constexpr int kVtTile = 64;                       // keys of a half, columns of d of a CTA
// halves of 64 keys per CTA, whose loads a thread has in flight together (bench/NOTES.md "The V^T pre-pass")
constexpr int kVtHalves = 2;
constexpr int kVtKeys = kVtHalves * kVtTile;      // keys of a CTA (divides kFp8KeyPad)
static_assert(kFp8KeyPad % kVtKeys == 0, "padded key counts are whole CTAs");
__device__ __forceinline__ int fp8_vt_chunk(int key, int chunk) { return chunk ^ ((key >> 4) & 3); }
__global__ void __launch_bounds__(256) fp8_transpose_v_kernel(const CfFwdParams p, uint8_t* vt, int64_t cols) {
    __shared__ __align__(16) uint8_t tile[kVtKeys][kVtTile];  // [key][d], chunks swizzled
    const int b = blockIdx.z, hk = blockIdx.y % p.hkv, d0 = (blockIdx.y / p.hkv) * kVtTile;
    const int n0 = blockIdx.x * kVtKeys, tid = threadIdx.x;
    const SeqInfo si(p, b);
    const int padded = (int)fp8_vt_padded_keys(si.sk);
    if (n0 >= padded) return;
    {  // load: key n0 + 64 h + tid / 4, 16 bytes of d each
        uint4 x[kVtHalves];
#pragma unroll
        for (int h = 0; h < kVtHalves; ++h) {
            const int key = n0 + kVtTile * h + (tid >> 2), c = d0 + 16 * (tid & 3);
            x[h] = make_uint4(0, 0, 0, 0);
            if (key < si.sk && c < p.d)
                x[h] = *reinterpret_cast<const uint4*>(si.v<uint8_t>(p, hk) + (int64_t)key * p.v_row_stride + c);
        }
#pragma unroll
        for (int h = 0; h < kVtHalves; ++h) {
            const int k = kVtTile * h + (tid >> 2);
            *reinterpret_cast<uint4*>(&tile[k][16 * fp8_vt_chunk(k, tid & 3)]) = x[h];
        }
    }
    __syncthreads();
    // store: d row d0 + tid / 4, 16 consecutive positions of each half (4 per thread, 64 per row)
    const int r = tid >> 2;
    if (d0 + r >= p.d) return;
    const int64_t bb = si.k_varlen ? 0 : b;
    uint8_t* row = vt + ((bb * p.hkv + hk) * p.d + d0 + r) * cols + fp8_vt_col0(si) + n0;
#pragma unroll
    for (int h = 0; h < kVtHalves; ++h) {
        const int pos0 = kVtTile * h + 16 * (tid & 3);
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            uint32_t x = 0;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int pos = pos0 + 4 * i + e;  // within the CTA's keys; groups of 32 stay aligned
                const int k = (pos & ~31) + fp8_vt_key(pos & 31);
                x |= (uint32_t)tile[k][16 * fp8_vt_chunk(k, r >> 4) + (r & 15)] << (8 * e);
            }
            w[i] = x;
        }
        *reinterpret_cast<uint4*>(row + pos0) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// ---------------------------------------------------------------- e4m3: V^T in the kernel
// (Kt::kVtInKernel, the 128 head-dim tile; FlashAttention-3 and cuDNN transpose V on chip too.)
// The producer warpgroup turns a raw V tile, [BN keys][128 d] as TMA writes it (chunk c of key
// row k at c ^ (k & 7)), into a V^T stage: panels [128 d][128 positions] (chunk c of d row r at
// c ^ (r & 7)), position s of each 32-key group holding key fp8_vt_key(s), as the pre-pass writes
// it. One warp step moves 32 keys (group g) x 16 d (chunk column cc of the raw tile), 512 bytes;
// warp w takes the chunk columns w and w + 4 of every group.
//   ldmatrix.x4.trans: matrix i = keys 8i .. 8i + 7 of the group as 8 x 8 16-bit pairs; lane
//     (c, q) (c = lane / 4, q = lane % 4) receives d pair c, keys 8i + 2q (low half) and
//     8i + 2q + 1 (high half): bytes {k 2q: d 2c, d 2c + 1; k 2q + 1: d 2c, d 2c + 1}.
//   PRMT: row d = 16 cc + 2c gets keys {2q, 2q + 1, 8 + 2q, 9 + 2q} (x0, x1: bytes 0 and 2), which
//     are positions 4q .. 4q + 3 (fp8_vt_key), and keys 16 + the same (x2, x3): positions
//     16 + 4q ..; row 2c + 1 the odd bytes.
//   stmatrix.x4: matrix j, row r = 16 bytes (positions 16 (j & 1) ..) of one d row, held by
//     lanes 4r .. 4r + 3. Rows d 2 apart repeat the swizzle every 4, so matrix j takes the even
//     rows 2r of lanes r < 4 and the odd rows 2r + 1 of lanes r >= 4 (j < 2), or the other way
//     round (j >= 2): 8 distinct swizzled chunks, no bank conflict (the loads have none either).
// Keys at or past `lim` (a sequence's end inside the tile: another sequence's rows in a varlen
// tensor, TMA's zeros otherwise) are written as 0, as the pre-pass writes them (P is 0 there; V
// must not be NaN).
template <int BN>
struct FwdVTranspose {
    static constexpr int G = BN / 32;  // 32-key groups
    static_assert(BN % 32 == 0, "whole 32-key groups");
    // raw, vt: shared addresses (1024-byte aligned); ptid: thread within the producer warpgroup.
    static __device__ __forceinline__ void run(uint32_t raw, uint32_t vt, int lim, int ptid) {
        const int warp = ptid >> 5, lane = ptid & 31, lr = lane & 7, li = lane >> 3, q = lane & 3;
        const bool hi = lane >= 16;  // holds d pairs 4..7: its odd rows go to matrices 0 / 1
        const uint32_t sel_a = hi ? 0x7531u : 0x6420u, sel_b = hi ? 0x6420u : 0x7531u;
        // this lane's stmatrix row: matrix li, row lr (parity as above)
        const int dl = 2 * lr + ((li >> 1) ^ (lr >> 2));
        const uint32_t st_x = (uint32_t)(((li & 1) ^ (dl & 7)) << 4);  // chunk bits XORed per group
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int cc = warp + 4 * h;
            const uint32_t ld = raw + (8 * li + lr) * kPanelRowBytes + ((cc ^ lr) << 4);
            const uint32_t st = vt + (16 * cc + dl) * kPanelRowBytes;
#pragma unroll 2  // two steps in flight; fully unrolled, the 32-register producer spilled
            for (int g = 0; g < G; ++g) {
                uint32_t x[4];
                ldsm_x4_t(x, ld + g * 32 * kPanelRowBytes);
                if (lim < BN) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int k0 = 32 * g + 8 * i + 2 * q;
                        x[i] &= (k0 < lim ? 0x0000ffffu : 0u) | (k0 + 1 < lim ? 0xffff0000u : 0u);
                    }
                }
                const uint32_t w[4] = {__byte_perm(x[0], x[1], sel_a), __byte_perm(x[2], x[3], sel_a),
                                       __byte_perm(x[0], x[1], sel_b), __byte_perm(x[2], x[3], sel_b)};
                stmatrix_x4(st + (g >> 2) * 128 * kPanelRowBytes + (st_x ^ (uint32_t)((g & 3) << 5)), w);
            }
        }
    }
};

template <typename Kt>
struct FwdPipelines {
    using Storage = FwdSharedStorage<Kt>;
    static constexpr uint32_t kQ = offsetof(Storage, q_bars), kK = offsetof(Storage, k_bars), kV = offsetof(Storage, v_bars);
    uint32_t base;  // shared address of the storage
    __device__ __forceinline__ explicit FwdPipelines(Storage& ss) : base(smem_addr(&ss)) {}
    __device__ __forceinline__ Pipeline<1> q() const { return Pipeline<1>(base + kQ); }
    __device__ __forceinline__ Pipeline<Kt::kStages> k() const { return Pipeline<Kt::kStages>(base + kK); }
    __device__ __forceinline__ Pipeline<Kt::kStages> v() const { return Pipeline<Kt::kStages>(base + kV); }
};

// ---------------------------------------------------------------- producer
template <typename Kt>
struct FwdProducer {
    using T = typename Kt::Elem;
    // D: the tiles' columns (whole panels); columns from d on are loaded as zeros
    static constexpr int D = Kt::kHeadDimPad, BM = Kt::kBlockM, BN = Kt::kBlockN, C = D / 8, NPT = 128;
    // cp.async loads one row pass at a time from d = 128 up and in a 32-register producer: with
    // the TMA path beside them, fully unrolled passes spilled the 40-register producer (8 / 20
    // bytes at d = 128 / 256) and the 32-register one of the d = 64 192 x 128 tile (76 bytes).
    static constexpr bool kRolled = D >= 128 || Kt::kProducerRegs <= 32;
    static constexpr int kProducerBar = Kt::kNWarpGroups + 1;  // named barrier after PingPong's 1..NWG

    // Loads every tile of this CTA; ptid = thread index within the producer warpgroup. A tile
    // goes by TMA (thread 0 issues it) when the map exists and, for varlen keys, the block lies
    // inside the sequence; otherwise every producer thread issues its cp.async share. Either
    // way every producer thread commits once per buffer.
    static __device__ __forceinline__ void run(const CfFwdParams& p, const FwdTmaMaps& maps, int tail_groups,
                                               FwdSharedStorage<Kt>& ss, const FwdPipelines<Kt>& pl, int ptid) {
        const FwdTileScheduler<BM, BN, !Kt::kPersistent, Kt::kBlockMasks> sched(p, tail_groups);
        const int dch = p.d >> 3;
        uint32_t kv = 0, tcount = 0;  // key blocks and tiles loaded so far (pipeline counters)
        uint32_t nraw = 0;            // kVtInKernel: raw V tiles transposed so far (vraw_bar's phases)
        sched.for_each_loaded_tile(p, [&](const FwdTile& t) {
            const SeqInfo& si = t.si;
            const int hk = kv_head(p, t.h);
            const FwdTmaRows rows(si);
            const int64_t krow0 = rows.k_row0, qrow0 = rows.q_row0;
            const int kbatch = rows.k_batch, qbatch = rows.q_batch;
            // The cp.async path computes its head pointers when it runs (the producer works at 40
            // registers: nothing long-lived that the TMA path does not need).
            // kVtInKernel: raw V of key block j into ss.vraw (thread 0; one arrival and its bytes
            // complete vraw_bar's phase).
            const uint32_t raw_bar = smem_addr(&ss.vraw_bar);
            auto issue_raw_v = [&](int j) {
                if constexpr (Kt::kVtInKernel) {
                    if (ptid == 0) {
                        tma_load_tile<BN, D, 1>(smem_addr(ss.vraw.data), &maps.v, raw_bar,
                                                krow0 + t.template key_start<BN, Kt::kBlockMasks>(j), hk, kbatch);
                        mbar_arrive(raw_bar);
                    }
                }
            };
            auto load_kv = [&](bool is_k, int j) {
                const Pipeline<Kt::kStages> pipe = is_k ? pl.k() : pl.v();
                T* dst = is_k ? ss.k[pipe.stage(kv + j)] : ss.v[pipe.stage(kv + j)];
                const uint32_t n = kv + j;
                const int n0 = t.template key_start<BN, Kt::kBlockMasks>(j);
                pipe.producer_acquire(n);
                if constexpr (Kt::kVtInKernel) {
                    if (!is_k) {
                        // raw V(j) was issued after the previous transpose (or after Q): wait for
                        // it, transpose it into the V^T stage, publish the stage to wgmma (async
                        // proxy) and the consumers, then, once every producer thread has read the
                        // raw tile, issue the next one.
                        mbar_wait(raw_bar, nraw & 1);
                        FwdVTranspose<BN>::run(smem_addr(ss.vraw.data), smem_addr(dst), si.sk - n0, ptid);
                        fence_async_smem();
                        mbar_arrive(pipe.full_bar(n));
                        ++nraw;
                        named_bar_sync(kProducerBar, 128);
                        if (j + 1 < t.nblocks) issue_raw_v(j + 1);
                        return;
                    }
                }
                if constexpr (Kt::kFp8) {
                    // TMA only (cf_fwd_check). Key rows past a varlen sequence's end are the next
                    // sequence's: masked in S, and V^T is zero there (the pre-pass or FwdVTranspose).
                    if (ptid == 0) {
                        if (is_k) {
                            tma_load_tile<BN, D, 1>(smem_addr(dst), &maps.k, pipe.full_bar(n), krow0 + n0, hk, kbatch);
                        } else {
                            // one 128-key panel [D][128] per box (the last one may reach past the
                            // block: its columns are loaded, not multiplied)
                            mbar_expect_tx(pipe.full_bar(n), Kt::kVtKeys * D);
#pragma unroll
                            for (int pnl = 0; pnl < Kt::kVtKeys / 128; ++pnl)
                                tma_load_4d(smem_addr(dst) + pnl * D * kPanelRowBytes, &maps.v, pipe.full_bar(n),
                                            (int)(fp8_vt_col0(si) + n0 + 128 * pnl), 0, hk, kbatch);
                        }
                    }
                } else if (maps.kv_ok && (!si.k_varlen || n0 + BN <= si.sk)) {
                    if (ptid == 0)
                        tma_load_tile<BN, D>(smem_addr(dst), is_k ? &maps.k : &maps.v, pipe.full_bar(n), krow0 + n0, hk,
                                             kbatch);
                } else if (is_k) {
                    si.template load_keys<PanelLoader<C, NPT, kRolled>, BN>(p, dst, si.k<T>(p, hk), p.k_batch_stride,
                                                                   p.k_row_stride, n0, dch, ptid, p.k);
                } else {
                    si.template load_keys<PanelLoader<C, NPT, kRolled>, BN>(p, dst, si.v<T>(p, hk), p.v_batch_stride,
                                                                   p.v_row_stride, n0, dch, ptid, p.v);
                }
                pipe.producer_commit_cp_async(n);
            };
            auto load_k = [&](int j) { load_kv(true, j); };
            auto load_v = [&](int j) { load_kv(false, j); };
            // K(0) first: its stage may be free before the consumers release Q.
            load_k(0);
            pl.q().producer_acquire(tcount);
            if (Kt::kFp8 || maps.q_ok) {
                if (ptid == 0)
                    tma_load_tile<BM, D, Kt::kElemBytes>(smem_addr(ss.q), &maps.q, pl.q().full_bar(tcount), qrow0 + t.m0,
                                                         t.h, qbatch);
            } else if constexpr (!Kt::kFp8) {
                load_panels<BM, C, NPT, kRolled>(ss.q, si.q<T>(p, t.h) + (int64_t)t.m0 * p.q_row_stride, p.q_row_stride,
                                        si.sq - t.m0, dch, ptid, p.q);
            }
            pl.q().producer_commit_cp_async(tcount);
            if constexpr (Kt::kVtInKernel) issue_raw_v(0);
            for (int j = 1; j < t.nblocks; ++j) {
                load_k(j);
                load_v(j - 1);
            }
            load_v(t.nblocks - 1);
            kv += t.nblocks;
            ++tcount;
        });
        asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives its issuing thread
    }
};

// ---------------------------------------------------------------- ping-pong
// Warpgroup wg waits on named barrier 1 + wg, which the previous warpgroup (cyclically) arrives
// at once it has issued its GEMMs; the last warpgroup starts the rotation of each tile. Every
// wait is matched by exactly one arrival (the last warpgroup skips its final one of the tile),
// so no barrier is left half-complete.
template <typename Kt>
struct PingPong {
    static constexpr int NWG = Kt::kNWarpGroups;
    int wg;
    __device__ __forceinline__ void start_tile() const {
        if constexpr (Kt::kPingPong)
            if (wg == NWG - 1) named_bar_arrive(1, 256);
    }
    __device__ __forceinline__ void wait() const {
        if constexpr (Kt::kPingPong) named_bar_sync(1 + wg, 256);
    }
    __device__ __forceinline__ void pass(bool last_block) const {
        if constexpr (Kt::kPingPong)
            if (!(last_block && wg == NWG - 1)) named_bar_arrive(1 + (wg + 1) % NWG, 256);
    }
};

// ---------------------------------------------------------------- consumer mainloop
// One consumer warpgroup's work on one tile: its 64 query rows against every key block.
// Leaves O (unnormalised, m64nD accumulator layout) and the softmax statistics for the epilogue.
template <typename Kt>
struct FwdMainloop {
    using T = typename Kt::Elem;
    static constexpr int D = Kt::kHeadDim, BM = Kt::kBlockM, BN = Kt::kBlockN, S = Kt::kStages;
    static constexpr int NT = BN / 8;   // n8 tiles of S
    static constexpr int DT = D / 8;    // n8 tiles of O
    static constexpr int KK = Kt::kFp8 ? 32 : 16;  // k of one wgmma (32 bytes of k either way)
    static constexpr int KS = D / KK;   // k steps of Q K^T
    static constexpr int PS = BN / KK;  // k steps of P V
    static constexpr uint32_t kStageBytes = Kt::kKVStageBytes, kVStageBytes = Kt::kVStageBytes;
    static constexpr bool kEarlyRescale = Kt::kEarlyRescale;

    float o[D / 2];
    OnlineSoftmax<2> softmax;  // rows g and g + 8 of this warp
    uint32_t pa[PS][4];  // P of the previous block (A fragments)
#ifdef CF_FWD_TRACE
    bool trace = false;  // this tile is the one probed
#endif

    // kv: pipeline counter of the tile's first key block. wrow0: this warp's first query row.
    __device__ __forceinline__ void run(const CfFwdParams& p, const FwdTile& t, const LogitInfo& li, float cmul,
                                        const FwdPipelines<Kt>& pl,
                                        uint32_t aQwg, uint32_t aK, uint32_t aV, uint32_t kv, int wrow0, int lane,
                                        const PingPong<Kt>& turn) {
        const int q4 = lane & 3, g = lane >> 2;
#pragma unroll
        for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
        softmax = OnlineSoftmax<2>();

        auto issue_s = [&](float (&s)[BN / 2], uint32_t st) {
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                const uint64_t da = desc_k_major(aQwg, BM, ks), db = desc_k_major(aK + st * kStageBytes, BN, ks);
                if constexpr (Kt::kFp8) wgmma_ss_e4m3<BN>(s, da, db, ks > 0);
                else wgmma_ss<BN, T, 0, 0>(s, da, db, ks > 0);
            }
            wg_commit();
        };
        // P(n) V(n) complete: o and P's fragments are free again, and so is V's stage n.
        auto finish_pv = [&](uint32_t n) {
            wg_wait<0>();
            reg_fence(o);
#pragma unroll
            for (int ks = 0; ks < PS; ++ks) reg_fence(pa[ks]);
            pl.v().consumer_release(n, lane);
        };
        auto issue_pv = [&](uint32_t st) {
#pragma unroll
            for (int ks = 0; ks < PS; ++ks) {
                if constexpr (Kt::kFp8)  // V^T: D rows of kBlockN keys, K-major
                    wgmma_rs_e4m3<D>(o, pa[ks], desc_k_major(aV + st * kVStageBytes, D, ks), 1);
                else
                    wgmma_rs<D, T, 1>(o, pa[ks], desc_mn_major(aV + st * kVStageBytes, BN, ks), 1);
            }
            wg_commit();
        };
        // Logit transform and mask (skipped for blocks this warp sees whole), then the online
        // softmax; leaves P in s and the output correction in corr.
        // Through a block mask a partly visible block also takes the rule's mask (a void step,
        // a bad list entry, hides everything). There the step's key and kind are read at the start
        // of its iteration (ms), so that a list entry's load runs under the waits and S; without a
        // block mask step j's key is computed here (the kernel as it was before block masks).
        struct MaskStep {
            int n0 = 0;
            StepKind kind = StepKind::kFull;
        } ms;
        auto read_step = [&](int j) {
            if constexpr (Kt::kBlockMasks) t.template step<BN>(j, ms.n0, ms.kind);
        };
        auto softmax_block = [&](float (&s)[BN / 2], int j, float (&corr)[2]) {
            const int n0 = Kt::kBlockMasks ? ms.n0 : (t.nb_hi - 1 - j) * BN;
            const StepKind kind = Kt::kBlockMasks ? ms.kind : StepKind::kFull;
            auto row_of = [&](int, int r) { return wrow0 + g + 8 * r; };
            mask_scores<1, NT>(s, li, t.mk, row_of, n0, q4, kind == StepKind::kFull && t.mk.block_full(wrow0, 16, n0, BN));
            if constexpr (Kt::kBlockMasks) {  // (the BlockMasked instantiations: plan.cuh)
                if (kind != StepKind::kFull)
                    mask_rule_scores<1, NT>(s, p.block_mask, t.mk, t.si.b, row_of, n0, q4, kind == StepKind::kVoid);
            }
            softmax.template step<1, NT>(s, cmul, corr);
        };
        auto to_p = [&](const float (&s)[BN / 2]) {
            if constexpr (Kt::kFp8) {
                // n8 tiles 4ks .. 4ks + 3 of S: register 0 = row g, tiles 4ks and 4ks + 1; 1 = row
                // g + 8; 2, 3 = the same of tiles 4ks + 2, 4ks + 3 (key order: fp8_vt_key)
#pragma unroll
                for (int ks = 0; ks < PS; ++ks)
#pragma unroll
                    for (int hr = 0; hr < 4; ++hr) {
                        const float* a = s + 16 * ks + 8 * (hr >> 1) + 2 * (hr & 1);
                        pa[ks][hr] = pack_e4m3x4(a[0], a[1], a[4], a[5]);
                    }
            } else {
                acc_to_a_frags<T, PS>(s, pa);
            }
        };

        // The correction of the last softmax block: O is rescaled by it before P V of that block
        // is issued, either at the end of the step (after the previous P V completed) or, with
        // kEarlyRescale, in the next step between issuing S and P V (FlashAttention-3's place:
        // the rescale runs while S is on the tensor cores, not on the step's critical tail).
        float corr[2];
        // Block 0: S only (nothing to multiply with V yet).
        read_step(0);
        {
            pl.k().consumer_wait(kv);
            float s[BN / 2];
            turn.wait();
            wg_fence();
            issue_s(s, pl.k().stage(kv));
            turn.pass(t.nblocks == 1);
            wg_wait<0>();
            reg_fence(s);
            pl.k().consumer_release(kv, lane);
            softmax_block(s, 0, corr);  // corr = 0 or 1 on o = 0: nothing to rescale
            to_p(s);
        }
        for (int j = 1; j < t.nblocks; ++j) {
            float s[BN / 2];
            read_step(j);
            if constexpr (Kt::kSerialPV) {
                // P(j-1) V(j-1), completed, then S(j), completed, then the softmax: no product
                // is in flight while another's registers are live, so S 128 + O 64 is the peak
                // and 256 keys fit (cuDNN's FP8 forward waits the same way). The other
                // warpgroup's products fill the tensor cores during this one's softmax.
                // Probe points (experiments/fwd_trace.py --serial): 0 start, 1 K / V arrived, 2 turn,
                // 3 P V issued, 4 P V complete, 5 S issued, 6 S complete, 7 softmax done.
                CF_TRACE(trace, turn.wg, j, 0);
                pl.v().consumer_wait(kv + j - 1);
                pl.k().consumer_wait(kv + j);
                CF_TRACE(trace, turn.wg, j, 1);
                turn.wait();
                CF_TRACE(trace, turn.wg, j, 2);
                wg_fence();
                issue_pv(pl.v().stage(kv + j - 1));
                CF_TRACE(trace, turn.wg, j, 3);
                finish_pv(kv + j - 1);
                CF_TRACE(trace, turn.wg, j, 4);
                wg_fence();
                issue_s(s, pl.k().stage(kv + j));
                turn.pass(j == t.nblocks - 1);
                CF_TRACE(trace, turn.wg, j, 5);
                wg_wait<0>();
                reg_fence(s);
                CF_TRACE(trace, turn.wg, j, 6);
                pl.k().consumer_release(kv + j, lane);
                softmax_block(s, j, corr);
                CF_TRACE(trace, turn.wg, j, 7);
            } else {
                CF_TRACE(trace, turn.wg, j, 0);
                pl.k().consumer_wait(kv + j);
                pl.v().consumer_wait(kv + j - 1);  // loaded right after K(j): S and P V stay back to back
                CF_TRACE(trace, turn.wg, j, 1);
                turn.wait();
                CF_TRACE(trace, turn.wg, j, 2);
                wg_fence();
                issue_s(s, pl.k().stage(kv + j));
                CF_TRACE(trace, turn.wg, j, 3);
                if constexpr (kEarlyRescale) {
                    scale_rows<1, DT>(o, corr);
                    wg_fence();  // o written by this thread -> read by the P V wgmma
                }
                issue_pv(pl.v().stage(kv + j - 1));
                turn.pass(j == t.nblocks - 1);
                CF_TRACE(trace, turn.wg, j, 4);
                wg_wait<1>();  // S(j) done, P(j-1) V(j-1) may still run
                reg_fence(s);
                CF_TRACE(trace, turn.wg, j, 5);
                pl.k().consumer_release(kv + j, lane);
                softmax_block(s, j, corr);
                CF_TRACE(trace, turn.wg, j, 6);
                finish_pv(kv + j - 1);
                CF_TRACE(trace, turn.wg, j, 7);
            }
            if constexpr (!kEarlyRescale) scale_rows<1, DT>(o, corr);
            to_p(s);
        }
        const uint32_t kv_last = kv + t.nblocks - 1;
        pl.v().consumer_wait(kv_last);
        if constexpr (kEarlyRescale) scale_rows<1, DT>(o, corr);
        wg_fence();
        issue_pv(pl.v().stage(kv_last));
        finish_pv(kv_last);
    }
};

// ---------------------------------------------------------------- epilogue
template <typename Kt>
struct FwdEpilogue {
    using T = typename Kt::Out;
    static constexpr int D = Kt::kHeadDim, BM = Kt::kBlockM, C = D / 8, DT = D / 8;

    // Normalise, write lse, stage O (as T) in this warp's own 16 rows of sO (with sO = Q's rows:
    // only this warp's wgmma read those rows, and they have completed), store 16 bytes per lane.
    // out_scale: what O is multiplied by besides 1 / l (the v descale of e4m3 inputs, else 1).
    static __device__ __forceinline__ void store(const CfFwdParams& p, const FwdTile& t, FwdMainloop<Kt>& ml, float cmul,
                                                 float out_scale, T* sO, int rl0, int lane) {
        const int g = lane >> 2, q4 = lane & 3, dch = p.d >> 3;
        const SeqInfo& si = t.si;
        float* lseg = si.lse(p, t.h);
        const float sink = sink_logit(p, t.h);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float lse;
            const float inv = ml.softmax.finish_row(r, cmul, lse, sink) * out_scale;
#pragma unroll
            for (int j = 0; j < DT; ++j) {
                ml.o[4 * j + 2 * r] *= inv;
                ml.o[4 * j + 2 * r + 1] *= inv;
            }
            const int row = t.m0 + rl0 + g + 8 * r;
            if (q4 == 0 && row < si.sq) lseg[row] = lse;
        }
        unsigned char* sOb = reinterpret_cast<unsigned char*>(sO);
        stage_acc_rows<T, DT>(sOb, BM, rl0 + g, 0, ml.o, q4);
        __syncwarp();
        T* og = si.o<T>(p, t.h);
#pragma unroll
        for (int it = 0; it < (16 * C) / 32; ++it) {
            const int idx = lane + it * 32;
            const int rl = rl0 + idx / C, c = idx % C;
            const int row = t.m0 + rl;
            if (row < si.sq && c < dch)
                *reinterpret_cast<uint4*>(og + (int64_t)row * p.o_row_stride + c * 8) =
                    *reinterpret_cast<const uint4*>(sOb + panel_offset(BM, rl, 8 * c));
        }
        __syncwarp();  // every lane read its staged rows before they are rewritten (next tile)
    }

    // A tile none of whose rows sees a key: o = 0, lse = -inf or the sink (all consumer threads).
    static __device__ __forceinline__ void store_empty(const CfFwdParams& p, const FwdTile& t, int ctid) {
        write_empty_rows<T, BM, Kt::kNConsumerThreads>(t.si.o<T>(p, t.h), p.o_row_stride, t.si.lse(p, t.h), t.m0, t.m_last,
                                                       p.d, ctid, sink_logit(p, t.h));
    }
};

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// ---------------------------------------------------------------- the kernel
template <typename Kt>
__global__ void __launch_bounds__(Kt::kNThreads, Kt::kMinBlocks)
    fwd_sm90_kernel(const CfFwdParams p, const __grid_constant__ FwdTmaMaps maps, const int tail_groups) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using T = typename Kt::Elem;
    constexpr int NWG = Kt::kNWarpGroups, NCT = Kt::kNConsumerThreads;
    extern __shared__ __align__(1024) unsigned char smem_fwd_sm90[];
    if (smem_addr(smem_fwd_sm90) & 1023) __trap();  // the 128-byte swizzle needs a 1024-byte aligned base
    auto& ss = *reinterpret_cast<FwdSharedStorage<Kt>*>(smem_fwd_sm90);
    const FwdPipelines<Kt> pl(ss);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2;  // consumer warpgroup wg < NWG: query rows 64 wg ..; NWG: producer
    if (tid == 0) {
        pl.q().init(128, 4 * NWG);  // full: one cp.async-tracking arrival per producer thread
        pl.k().init(128, 4 * NWG);  // empty: one arrival per consumer warp
        pl.v().init(128, 4 * NWG);
        if constexpr (Kt::kVtInKernel) mbar_init(smem_addr(&ss.vraw_bar), 1);
    }
    __syncthreads();  // barrier initialisation visible to every thread (the only CTA-wide barrier)

    if (wg == NWG) {
        setmaxnreg_dec<Kt::kProducerRegs>();  // the producer only computes addresses
        FwdProducer<Kt>::run(p, maps, tail_groups, ss, pl, tid - NCT);
        return;
    }

    setmaxnreg_inc<Kt::kConsumerRegs>();
    const FwdTileScheduler<Kt::kBlockM, Kt::kBlockN, !Kt::kPersistent, Kt::kBlockMasks> sched(p, tail_groups);
    const PingPong<Kt> turn{wg};
    const uint32_t aQwg = smem_addr(ss.q) + wg * 64 * kPanelRowBytes;  // this warpgroup's 64 rows of Q
    const uint32_t aK = smem_addr(ss.k), aV = smem_addr(ss.v);
    const int rl0 = 64 * wg + 16 * (warp & 3);  // this warp's first row in the block
    FwdMainloop<Kt> ml;
    uint32_t kv = 0, tcount = 0;  // same counters as the producer's
    for (int it = 0; it < sched.niters; ++it) {
        const int tile = sched.tile_index(it);
        if (tile >= sched.ntiles) continue;
        const FwdTile t = sched.decode(p, tile);
        if (t.empty()) continue;
        if (t.nblocks == 0) {
            FwdEpilogue<Kt>::store_empty(p, t, tid);
            continue;
        }
        LogitInfo li(p, t.si.b, t.h);
        float out_scale = 1.f;
        if constexpr (Kt::kFp8) {
            const int hk = kv_head(p, t.h);
            li.rescale(descale_of(p.q_descale, t.si.b, t.h) * descale_of(p.k_descale, t.si.b, hk));
            out_scale = descale_of(p.v_descale, t.si.b, hk);
        }
        const float cmul = li.general ? kLog2e : li.c;  // general path: s holds natural logits
        turn.start_tile();
        pl.q().consumer_wait(tcount);
#ifdef CF_FWD_TRACE
        ml.trace = blockIdx.x == 0 && tcount == 0;
#endif
        ml.run(p, t, li, cmul, pl, aQwg, aK, aV, kv, t.m0 + rl0, lane, turn);
        if constexpr (Kt::kSeparateO) pl.q().consumer_release(tcount, lane);  // Q read for the last time
        FwdEpilogue<Kt>::store(p, t, ml, cmul, out_scale, ss.o_staging(), rl0, lane);
        if constexpr (!Kt::kSeparateO) pl.q().consumer_release(tcount, lane);  // staging done: Q's rows are free
        kv += t.nblocks;
        ++tcount;
    }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

template <typename Kt>
cudaError_t launch_fwd_sm90(const CfFwdParams& p, const FwdPlan& pl, void* workspace, cudaStream_t stream) {
    using Sched = FwdTileScheduler<Kt::kBlockM, Kt::kBlockN, !Kt::kPersistent>;
    auto kern = fwd_sm90_kernel<Kt>;
    constexpr int smem = (int)sizeof(FwdSharedStorage<Kt>);
    static_assert(smem <= 227 * 1024, "must fit sm_90's 227 KB per CTA");
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    const int64_t ntiles = Sched::num_tiles(p);
    if (ntiles == 0) return cudaSuccess;                            // nothing to compute (and no empty launch)
    if (ntiles > INT32_MAX) return cudaErrorInvalidConfiguration;  // tile indices are int
    FwdTmaMaps maps{};  // q_ok = kv_ok = 0: cp.async
    if constexpr (Kt::kVtInKernel) {
        maps = make_fwd_tma_maps(p, Kt::kBlockM, Kt::kBlockN);
        if (!maps.q_ok || !maps.kv_ok) return cudaErrorNotSupported;  // cf_fwd_check rules this out
    } else if constexpr (Kt::kFp8) {
        // V^T into the workspace first (same stream: the attention kernel sees it)
        const Fp8VtLayout vl = fp8_vt_layout(p);
        if (workspace == nullptr) return cudaErrorInvalidValue;
        maps = make_fwd_tma_maps(p, Kt::kBlockM, Kt::kBlockN, workspace, vl.cols, Kt::kHeadDim);
        if (!maps.q_ok || !maps.kv_ok) return cudaErrorNotSupported;  // cf_fwd_check rules this out
        const dim3 tgrid((unsigned)(fp8_vt_padded_keys(p.seqlen_k) / kVtKeys),
                         (unsigned)(p.hkv * ((p.d + kVtTile - 1) / kVtTile)), (unsigned)p.b);
        if (tgrid.x > 0) {
            fp8_transpose_v_kernel<<<tgrid, 256, 0, stream>>>(p, static_cast<uint8_t*>(workspace), vl.cols);
            if ((e = cudaGetLastError()) != cudaSuccess) return e;
        }
    } else if (pl.tma) {
        maps = make_fwd_tma_maps(p, Kt::kBlockM, Kt::kBlockN);
    }
    kern<<<(unsigned)pl.ctas, Kt::kNThreads, smem, stream>>>(p, maps, pl.cta_order);
    return cudaGetLastError();
}

// Every configuration of config.cuh's table (the e4m3 rows' parameter is the output type).
#define CF_INST_FWD_SM90(name, ...)                                                                          \
    template cudaError_t launch_fwd_sm90<FwdSm90Traits##name<__half>>(const CfFwdParams&, const FwdPlan&, void*,      \
                                                                      cudaStream_t);                                \
    template cudaError_t launch_fwd_sm90<FwdSm90Traits##name<__nv_bfloat16>>(const CfFwdParams&, const FwdPlan&, void*, \
                                                                             cudaStream_t);
CF_FWD_SM90_CONFIGS(CF_INST_FWD_SM90)
CF_FWD_SM90_FP8_CONFIGS(CF_INST_FWD_SM90)
#undef CF_INST_FWD_SM90
// The configurations that run block masks (plan.cuh fwd_sm90_config), as BlockMasked instances.
#define CF_INST_FWD_SM90_MASKED(name)                                                                         \
    static_assert(fwd_sm90_takes_block_masks<FwdSm90Traits##name<__half>>(), #name " runs block masks");     \
    template cudaError_t launch_fwd_sm90<BlockMasked<FwdSm90Traits##name<__half>>>(const CfFwdParams&,            \
                                                                                  const FwdPlan&, void*, cudaStream_t); \
    template cudaError_t launch_fwd_sm90<BlockMasked<FwdSm90Traits##name<__nv_bfloat16>>>(                         \
        const CfFwdParams&, const FwdPlan&, void*, cudaStream_t);
CF_INST_FWD_SM90_MASKED(D64Short)
CF_INST_FWD_SM90_MASKED(D96)
CF_INST_FWD_SM90_MASKED(D128)
CF_INST_FWD_SM90_MASKED(D192)
CF_INST_FWD_SM90_MASKED(D256)
#undef CF_INST_FWD_SM90_MASKED

}  // namespace cf

#ifdef CF_FWD_TRACE
// The probe's buffer (experiments/fwd_trace.py): copies it out (then clears it); 0 on success.
extern "C" int cf_fwd_trace_read(long long* dst) { return cf::read_and_clear_trace(cf::g_fwd_trace, dst); }
#endif
