// Forward pass of 512-wide heads on Hopper (sm_90a): d = dv = 512, f16 / bf16, wgmma, warp-
// specialised; the same semantics as every other forward (flash_api.h; masks, logits and the
// online softmax from common/). The plan (plan.cu fwd_sm90_wide_takes) sends it the calls past
// the decode shapes (those stay on sm80/fwd_wide_split.cu, which packs a KV group's heads).
// Configuration and the reasons for its sizes: config.cuh FwdSm90WideTraits.
//
// Parts, in the order a CTA runs them:
//   FwdWideSharedStorage  shared memory as a struct; the launch asks for exactly its sizeof
//   FwdWideProducer       warpgroup 2: Q, then per key block the ring's four chunks (TMA where
//                         tma.cuh allows, else cp.async: paged K/V, varlen blocks crossing a
//                         sequence's end, CANDLE_FLASH_DISABLE_TMA)
//   FwdWideSoftmaxWg      warpgroup 0: S = Q K^T, mask, online softmax, P to shared memory,
//                         O[:, 0:256] += P V (P from registers)
//   FwdWideOutputWg       warpgroup 1: O[:, 256:512] += P V (P from shared memory), rescaled by the
//                         factors warpgroup 0 publishes with P
//   FwdWideEpilogue       both: normalise, stage the 64 x 256 half in Q's shared memory, 16-byte stores
//
// Barrier protocol (mbarriers in FwdWideSharedStorage; Pipeline in pipeline.cuh):
//   Q     1-stage pipeline. full: the producer's 128 arrivals (+ TMA bytes); empty: the 8 consumer
//         warps, after the epilogue's stores (O is staged in Q's rows).
//   ring  4 stages; buffer 4 n + c of the CTA's n-th key block uses stage c: 0 K columns 0-255,
//         1 K 256-511, 2 V 0-255, 3 V 256-511. full: 128 producer arrivals (+ bytes); empty: 4 warp
//         arrivals: warpgroup 0 releases stages 0-2, warpgroup 1 stage 3.
//   Named barriers, 256 threads (the two consumer warpgroups):
//     kBarPFull + s (s = j & 1): warpgroup 0 arrives once P(j) and block j's row factors are in
//         slot s (stores fenced to the async proxy); warpgroup 1 waits before its P V.
//     kBarPEmpty + s: warpgroup 1 arrives once its P(j) V(j) has completed (slot s read), for j + 2
//         < nblocks only; warpgroup 0 waits before writing P(j + 2) into the slot. Every wait has
//         exactly one arrival, so no barrier is left half-complete.
//     kBarEpi: warpgroup 0 arrives once the rows' 1 / l are in shared memory; warpgroup 1 waits.
//   One tile a CTA (the grid is the tile count): the slots and the factors are not reused
//   across tiles.
// Per key block j (last one first, as sm90/fwd.cu), warpgroup 0: issue S(j), rescale its O by
// block j-1's correction, issue P(j-1) V(j-1), wait S(j), softmax(j) and P(j) out to warpgroup 1
// while P(j-1) V(j-1) runs, then wait for it. Warpgroup 1: wait P(j), rescale, P(j) V(j).
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

template <typename Kt>
struct FwdWideSharedStorage {
    using T = typename Kt::Elem;
    static constexpr int BM = Kt::kBlockM, BN = Kt::kBlockN, D = Kt::kHeadDim, CC = Kt::kChunkCols;
    alignas(1024) T q[BM * D];                     // Q; O staged here by the epilogue
    alignas(1024) T chunk[Kt::kChunks][BN * CC];   // the ring: [BN keys][256 columns] panel tiles
    alignas(1024) T p[2][BM * BN];                 // P(j) in slot j & 1 (K-major A operand)
    float corr[2][BM];                             // block j's row correction, beside P(j)
    float inv[BM];                                 // the rows' 1 / l (epilogue)
    uint64_t q_bars[2][1];
    uint64_t ring_bars[2][Kt::kChunks];
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

constexpr int kWideBarPFull = 1, kWideBarPEmpty = 3, kWideBarEpi = 5;

template <typename Kt>
struct FwdWidePipelines {
    using Storage = FwdWideSharedStorage<Kt>;
    uint32_t base;
    __device__ __forceinline__ explicit FwdWidePipelines(Storage& ss) : base(smem_addr(&ss)) {}
    __device__ __forceinline__ Pipeline<1> q() const { return Pipeline<1>(base + offsetof(Storage, q_bars)); }
    __device__ __forceinline__ Pipeline<Kt::kChunks> ring() const {
        return Pipeline<Kt::kChunks>(base + offsetof(Storage, ring_bars));
    }
};

// Buffer number of chunk c of the CTA's key block kb (kb counts across tiles).
__device__ __forceinline__ uint32_t wide_chunk(uint32_t kb, int c) { return 4u * kb + (uint32_t)c; }

template <typename Kt>
using FwdWideScheduler = FwdTileScheduler<Kt::kBlockM, Kt::kBlockN, true>;

// ---------------------------------------------------------------- producer
template <typename Kt>
struct FwdWideProducer {
    using T = typename Kt::Elem;
    static constexpr int BM = Kt::kBlockM, BN = Kt::kBlockN, D = Kt::kHeadDim, CC = Kt::kChunkCols, NPT = 128;

    static __device__ __forceinline__ void run(const CfFwdParams& p, const FwdTmaMaps& maps, int tail_groups,
                                               FwdWideSharedStorage<Kt>& ss, const FwdWidePipelines<Kt>& pl,
                                               int ptid) {
        const FwdWideScheduler<Kt> sched(p, tail_groups);
        const int dch = p.d >> 3;
        uint32_t kv = 0, tcount = 0;
        sched.for_each_loaded_tile(p, [&](const FwdTile& t) {
            const SeqInfo& si = t.si;
            const int hk = kv_head(p, t.h);
            const FwdTmaRows rows(si);
            const int64_t krow0 = rows.k_row0, qrow0 = rows.q_row0;
            const int kbatch = rows.k_batch, qbatch = rows.q_batch;

            pl.q().producer_acquire(tcount);
            if (maps.q_ok) {
                if (ptid == 0)
                    tma_load_tile<BM, D>(smem_addr(ss.q), &maps.q, pl.q().full_bar(tcount), qrow0 + t.m0, t.h, qbatch);
            } else {
                load_panels<BM, D / 8, NPT, true>(ss.q, si.q<T>(p, t.h) + (int64_t)t.m0 * p.q_row_stride, p.q_row_stride,
                                                  si.sq - t.m0, dch, ptid, p.q);
            }
            pl.q().producer_commit_cp_async(tcount);

            for (int j = 0; j < t.nblocks; ++j) {
                const int n0 = (t.nb_hi - 1 - j) * BN;
                const bool tma = maps.kv_ok && (!si.k_varlen || n0 + BN <= si.sk);
#pragma unroll 1
                for (int c = 0; c < Kt::kChunks; ++c) {
                    const bool is_k = c < 2;
                    const int col0 = CC * (c & 1);
                    const uint32_t n = wide_chunk(kv + j, c);
                    T* dst = ss.chunk[c];
                    pl.ring().producer_acquire(n);
                    if (tma) {
                        if (ptid == 0) {
                            const uint32_t bar = pl.ring().full_bar(n);
                            mbar_expect_tx(bar, BN * CC * (int)sizeof(T));
#pragma unroll
                            for (int pnl = 0; pnl < CC / 64; ++pnl)
                                tma_load_4d(smem_addr(dst) + pnl * BN * kPanelRowBytes, is_k ? &maps.k : &maps.v, bar,
                                            col0 + 64 * pnl, (int)(krow0 + n0), hk, kbatch);
                        }
                    } else if (is_k) {
                        si.template load_keys<PanelLoader<CC / 8, NPT, true>, BN>(
                            p, dst, si.k<T>(p, hk) + col0, p.k_batch_stride, p.k_row_stride, n0, dch - col0 / 8, ptid, p.k);
                    } else {
                        si.template load_keys<PanelLoader<CC / 8, NPT, true>, BN>(
                            p, dst, si.v<T>(p, hk) + col0, p.v_batch_stride, p.v_row_stride, n0, dch - col0 / 8, ptid, p.v);
                    }
                    pl.ring().producer_commit_cp_async(n);
                }
            }
            kv += t.nblocks;
            ++tcount;
        });
        asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives its issuing thread
    }
};

// ---------------------------------------------------------------- consumers
// The state both consumer warpgroups keep: their 64 x 256 half of O (m64n256 accumulator layout:
// warp w rows 16 w + g (+ 8)).
template <typename Kt>
struct FwdWideAcc {
    static constexpr int OT = Kt::kChunkCols / 8;  // n8 tiles of an O half
    float o[Kt::kChunkCols / 2];
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < Kt::kChunkCols / 2; ++i) o[i] = 0.f;
    }
};

// Warpgroup 0.
template <typename Kt>
struct FwdWideSoftmaxWg {
    using T = typename Kt::Elem;
    static constexpr int BM = Kt::kBlockM, BN = Kt::kBlockN, D = Kt::kHeadDim, CC = Kt::kChunkCols;
    static constexpr int NT = BN / 8;  // n8 tiles of S
    static constexpr int KS = D / 16;  // k16 steps of Q K^T (KS / 2 per K chunk)
    static constexpr int PS = BN / 16; // k16 steps of P V
    FwdWideAcc<Kt> acc;
    OnlineSoftmax<2> softmax;
    uint32_t pa[PS][4];

    // kv: the tile's first key block (CTA count). warp: 0..3 within the warpgroup.
    __device__ __forceinline__ void run(const FwdTile& t, const LogitInfo& li, float cmul, const FwdWidePipelines<Kt>& pl,
                                        FwdWideSharedStorage<Kt>& ss, uint32_t kv, int warp, int lane) {
        const int q4 = lane & 3, g = lane >> 2, wrow0 = t.m0 + 16 * warp;
        const uint32_t aQ = smem_addr(ss.q), aKlo = smem_addr(ss.chunk[0]), aKhi = smem_addr(ss.chunk[1]),
                       aV = smem_addr(ss.chunk[2]);
        const Pipeline<Kt::kChunks> ring = pl.ring();
        acc.zero();
        softmax = OnlineSoftmax<2>();

        // S in two commit groups, one per K chunk, each issued once its chunk has landed (the
        // high chunk gets the low half's time to arrive); the low chunk is released as soon as
        // its half has completed, so that the next block's low chunk loads while the high half
        // and P V still run (with one ring stage per chunk, the loads of K(j+1) otherwise
        // started only after all of S(j)). The tiles' addresses are loop-invariant: laundered
        // once a block, so that the compiler rebuilds the 64 descriptors of S from three bases
        // instead of keeping them all live (hoisted, they spilled the warpgroup).
        auto issue_s_half = [&](float (&s)[BN / 2], int j, int half) {
            ring.consumer_wait(wide_chunk(kv + j, half));
            uint32_t q0 = aQ, k0 = half ? aKhi : aKlo;
            asm volatile("" : "+r"(q0), "+r"(k0));
            // wgmma.fence before the first half only: ptxas adds the arrive before the second
            // (info C7519); the explicit fence there scheduled the loop differently, untimed.
            if (half == 0) wg_fence();
#pragma unroll
            for (int ks = 0; ks < KS / 2; ++ks) {
                const int kq = KS / 2 * half + ks;
                wgmma_ss<BN, T, 0, 0>(s, desc_k_major(q0, BM, kq), desc_k_major(k0, BN, ks), half > 0 || ks > 0);
            }
            wg_commit();
        };
        auto issue_pv = [&]() {
#pragma unroll
            for (int ks = 0; ks < PS; ++ks) wgmma_rs<CC, T, 1>(acc.o, pa[ks], desc_mn_major(aV, BN, ks), 1);
            wg_commit();
        };
        // P(j-1) V(j-1) complete: O and P's fragments are free again, and so is V's low chunk.
        auto finish_pv = [&](int j) {
            wg_wait<0>();
            reg_fence(acc.o);
#pragma unroll
            for (int ks = 0; ks < PS; ++ks) reg_fence(pa[ks]);
            ring.consumer_release(wide_chunk(kv + j, 2), lane);
        };
        auto softmax_block = [&](float (&s)[BN / 2], int j, float (&corr)[2]) {
            const int n0 = (t.nb_hi - 1 - j) * BN;
            mask_scores<1, NT>(s, li, t.mk, [&](int, int r) { return wrow0 + g + 8 * r; }, n0, q4,
                               t.mk.block_full(wrow0, 16, n0, BN));
            softmax.template step<1, NT>(s, cmul, corr);
        };
        // P(j) (its A fragments, pa) and its row factors into slot j & 1 for warpgroup 1, once
        // P(j-1) V(j-1) has completed (publishing from S while that product still read pa and O
        // made ptxas serialise every wgmma of the kernel, C7513). stmatrix: matrix i of k16 step
        // ks is fragment register i (rows 8 (i & 1), keys 16 ks + 8 (i >> 1) of the warp's 16
        // rows); lane 8 i + r addresses row r of matrix i.
        auto publish_p = [&](const float (&corr)[2], int j) {
            const int slot = j & 1;
            if (j >= 2) named_bar_sync(kWideBarPEmpty + slot, 256);
            const uint32_t base = smem_addr(ss.p[slot]);
            const int mi = lane >> 3, mr = lane & 7;
            const int row = 16 * warp + mr + 8 * (mi & 1);
#pragma unroll
            for (int ks = 0; ks < PS; ++ks) stmatrix_x4(base + panel_offset(BM, row, 16 * ks + 8 * (mi >> 1)), pa[ks]);
            if (q4 == 0) {
                ss.corr[slot][16 * warp + g] = corr[0];
                ss.corr[slot][16 * warp + g + 8] = corr[1];
            }
            fence_async_smem();  // stmatrix / st.shared (generic proxy) -> warpgroup 1's wgmma
            named_bar_arrive(kWideBarPFull + slot, 256);
        };

        float corr[2];
        {  // block 0: S only
            float s[BN / 2];
            issue_s_half(s, 0, 0);
            issue_s_half(s, 0, 1);
            wg_wait<1>();
            ring.consumer_release(wide_chunk(kv, 0), lane);
            wg_wait<0>();
            reg_fence(s);
            ring.consumer_release(wide_chunk(kv, 1), lane);
            softmax_block(s, 0, corr);  // corr = 0 or 1 on O = 0: nothing to rescale
            acc_to_a_frags<T, PS>(s, pa);
            publish_p(corr, 0);
        }
        for (int j = 1; j < t.nblocks; ++j) {
            float s[BN / 2];
            issue_s_half(s, j, 0);
            issue_s_half(s, j, 1);
            ring.consumer_wait(wide_chunk(kv + j - 1, 2));
            scale_rows<1, FwdWideAcc<Kt>::OT>(acc.o, corr);  // block j-1's correction, while S runs
            wg_fence();  // O written by this thread -> read by the P V wgmma
            issue_pv();
            wg_wait<2>();  // S's low half done: its K chunk is free
            ring.consumer_release(wide_chunk(kv + j, 0), lane);
            wg_wait<1>();  // S(j) done, P(j-1) V(j-1) may still run
            reg_fence(s);
            ring.consumer_release(wide_chunk(kv + j, 1), lane);
            softmax_block(s, j, corr);
            finish_pv(j - 1);
            acc_to_a_frags<T, PS>(s, pa);
            publish_p(corr, j);
        }
        const int last = t.nblocks - 1;
        ring.consumer_wait(wide_chunk(kv + last, 2));
        scale_rows<1, FwdWideAcc<Kt>::OT>(acc.o, corr);
        wg_fence();
        issue_pv();
        finish_pv(last);
    }
};

// Warpgroup 1.
template <typename Kt>
struct FwdWideOutputWg {
    using T = typename Kt::Elem;
    static constexpr int BM = Kt::kBlockM, BN = Kt::kBlockN, CC = Kt::kChunkCols, PS = BN / 16;
    FwdWideAcc<Kt> acc;

    __device__ __forceinline__ void run(const FwdTile& t, const FwdWidePipelines<Kt>& pl, FwdWideSharedStorage<Kt>& ss,
                                        uint32_t kv, int warp, int lane) {
        const int r0 = 16 * warp + (lane >> 2);
        const uint32_t aV = smem_addr(ss.chunk[3]);
        const Pipeline<Kt::kChunks> ring = pl.ring();
        acc.zero();
        for (int j = 0; j < t.nblocks; ++j) {
            const int slot = j & 1;
            named_bar_sync(kWideBarPFull + slot, 256);
            const float corr[2] = {ss.corr[slot][r0], ss.corr[slot][r0 + 8]};
            scale_rows<1, FwdWideAcc<Kt>::OT>(acc.o, corr);
            const uint32_t n = wide_chunk(kv + j, 3);
            ring.consumer_wait(n);
            wg_fence();
            const uint32_t aP = smem_addr(ss.p[slot]);
#pragma unroll
            for (int ks = 0; ks < PS; ++ks)
                wgmma_ss<CC, T, 0, 1>(acc.o, desc_k_major(aP, BM, ks), desc_mn_major(aV, BN, ks), 1);
            wg_commit();
            wg_wait<0>();
            reg_fence(acc.o);
            ring.consumer_release(n, lane);
            if (j + 2 < t.nblocks) named_bar_arrive(kWideBarPEmpty + slot, 256);
        }
    }
};

// ---------------------------------------------------------------- epilogue
template <typename Kt>
struct FwdWideEpilogue {
    using T = typename Kt::Elem;
    static constexpr int BM = Kt::kBlockM, CC = Kt::kChunkCols, OT = CC / 8;

    // Rows' 1 / l in `inv` (rows g, g + 8 of the warp), then this warpgroup's half (columns col0 ..
    // col0 + 255) staged in Q's rows of this warp (every S has completed: warpgroup 1 gets here
    // after the last P, which warpgroup 0 publishes after the last S) and stored 16 bytes a lane.
    static __device__ __forceinline__ void store(const CfFwdParams& p, const FwdTile& t, FwdWideAcc<Kt>& acc,
                                                 const float (&inv)[2], int col0, FwdWideSharedStorage<Kt>& ss,
                                                 int warp, int lane) {
        const int g = lane >> 2, q4 = lane & 3, dch = p.d >> 3, rl0 = 16 * warp;
#pragma unroll
        for (int j = 0; j < OT; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                acc.o[4 * j + 2 * r] *= inv[r];
                acc.o[4 * j + 2 * r + 1] *= inv[r];
            }
        unsigned char* sOb = reinterpret_cast<unsigned char*>(ss.q);
        stage_acc_rows<T, OT>(sOb, BM, rl0 + g, col0, acc.o, q4);
        __syncwarp();
        T* og = t.si.o<T>(p, t.h);
        constexpr int CPR = CC / 8;  // 16-byte chunks of a half row
#pragma unroll 4
        for (int it = 0; it < (16 * CPR) / 32; ++it) {
            const int idx = lane + it * 32;
            const int rl = rl0 + idx / CPR, c = col0 / 8 + idx % CPR;
            const int row = t.m0 + rl;
            if (row < t.si.sq && c < dch)
                *reinterpret_cast<uint4*>(og + (int64_t)row * p.o_row_stride + c * 8) =
                    *reinterpret_cast<const uint4*>(sOb + panel_offset(BM, rl, 8 * c));
        }
        __syncwarp();
    }
};

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// ---------------------------------------------------------------- the kernel
template <typename Kt>
__global__ void __launch_bounds__(Kt::kNThreads, 1)
    fwd_sm90_wide_kernel(const CfFwdParams p, const __grid_constant__ FwdTmaMaps maps, const int tail_groups) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using T = typename Kt::Elem;
    extern __shared__ __align__(1024) unsigned char smem_fwd_wide[];
    if (smem_addr(smem_fwd_wide) & 1023) __trap();  // the 128-byte swizzle needs a 1024-byte aligned base
    auto& ss = *reinterpret_cast<FwdWideSharedStorage<Kt>*>(smem_fwd_wide);
    const FwdWidePipelines<Kt> pl(ss);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    if (tid == 0) {
        pl.q().init(128, 8);    // full: one arrival per producer thread; empty: every consumer warp
        pl.ring().init(128, 4); // empty: the four warps of the warpgroup that reads the chunk
    }
    __syncthreads();  // barrier initialisation visible to every thread (the only CTA-wide barrier)

    if (wg == 2) {
        setmaxnreg_dec<Kt::kProducerRegs>();
        FwdWideProducer<Kt>::run(p, maps, tail_groups, ss, pl, tid - 256);
        return;
    }
    setmaxnreg_inc<Kt::kConsumerRegs>();
    const FwdWideScheduler<Kt> sched(p, tail_groups);
    const int wwarp = warp & 3;
    uint32_t kv = 0, tcount = 0;
    for (int it = 0; it < sched.niters; ++it) {
        const int tile = sched.tile_index(it);
        if (tile >= sched.ntiles) continue;
        const FwdTile t = sched.decode(p, tile);
        if (t.empty()) continue;
        if (t.nblocks == 0) {
            write_empty_rows<T, Kt::kBlockM, 256>(t.si.o<T>(p, t.h), p.o_row_stride, t.si.lse(p, t.h), t.m0, t.m_last,
                                                  p.d, tid, sink_logit(p, t.h));
            continue;
        }
        float inv[2];
        if (wg == 0) {
            const LogitInfo li(p, t.si.b, t.h);
            const float cmul = li.general ? kLog2e : li.c;  // general path: s holds natural logits
            pl.q().consumer_wait(tcount);
            FwdWideSoftmaxWg<Kt> ml;
            ml.run(t, li, cmul, pl, ss, kv, wwarp, lane);
            float* lseg = t.si.lse(p, t.h);
            const float sink = sink_logit(p, t.h);
            const int g = lane >> 2;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float lse;
                inv[r] = ml.softmax.finish_row(r, cmul, lse, sink);
                const int rl = 16 * wwarp + g + 8 * r, row = t.m0 + rl;
                if ((lane & 3) == 0) {
                    ss.inv[rl] = inv[r];
                    if (row < t.si.sq) lseg[row] = lse;
                }
            }
            named_bar_arrive(kWideBarEpi, 256);
            FwdWideEpilogue<Kt>::store(p, t, ml.acc, inv, 0, ss, wwarp, lane);
        } else {
            FwdWideOutputWg<Kt> ow;
            ow.run(t, pl, ss, kv, wwarp, lane);
            named_bar_sync(kWideBarEpi, 256);
            const int r0 = 16 * wwarp + (lane >> 2);
            inv[0] = ss.inv[r0];
            inv[1] = ss.inv[r0 + 8];
            FwdWideEpilogue<Kt>::store(p, t, ow.acc, inv, Kt::kChunkCols, ss, wwarp, lane);
        }
        pl.q().consumer_release(tcount, lane);  // staging read out: Q's rows are free
        kv += t.nblocks;
        ++tcount;
    }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

template <typename Kt>
cudaError_t launch_fwd_sm90_wide(const CfFwdParams& p, const FwdPlan& pl, cudaStream_t stream) {
    auto kern = fwd_sm90_wide_kernel<Kt>;
    constexpr int smem = (int)sizeof(FwdWideSharedStorage<Kt>);
    static_assert(smem <= 227 * 1024, "must fit sm_90's 227 KB per CTA");
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    // one tile a CTA (FwdWideSharedStorage's slots are not reused across tiles): the plan's grid
    if (pl.ctas == 0) return cudaSuccess;
    if (pl.ctas < 0) return cudaErrorInvalidValue;                  // not a launch plan
    if (pl.ctas > INT32_MAX) return cudaErrorInvalidConfiguration;  // tile indices are int
    FwdTmaMaps maps{};  // q_ok = kv_ok = 0: cp.async
    if (pl.tma) maps = make_fwd_tma_maps(p, Kt::kBlockM, Kt::kBlockN);
    kern<<<(unsigned)pl.ctas, Kt::kNThreads, smem, stream>>>(p, maps, pl.cta_order);
    return cudaGetLastError();
}

template cudaError_t launch_fwd_sm90_wide<FwdSm90WideTraits<__half>>(const CfFwdParams&, const FwdPlan&, cudaStream_t);
template cudaError_t launch_fwd_sm90_wide<FwdSm90WideTraits<__nv_bfloat16>>(const CfFwdParams&, const FwdPlan&,
                                                                            cudaStream_t);

}  // namespace cf
