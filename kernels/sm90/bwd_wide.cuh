// Backward dK/dV (+ atomic dQ) on wgmma for the wide head-dim tiles 192 and 256 (sm_90a).
// Same algorithm, semantics and workspace as bwd_dkdv_sm90_kernel (bwd.cuh). What changes is how
// the two warpgroups share a CTA's work: at these widths one warpgroup cannot hold both dK and dV
// of 64 keys (64 x 256 x 2 f32 = 256 registers per thread), so each warpgroup owns one of them,
// for all 64 keys of the CTA:
//   warpgroup 1 ("dK"):  dP^T = V dO^T (m64 x BM)  -> shared, f32              [barrier dP]
//   warpgroup 0 ("dV"):  S^T = K Q^T (m64 x BM); with dP^T from shared: P^T, dS^T in registers
//                        (the one p_ds of common/mask.cuh, so softcap's derivative stays with S);
//                        P^T, dS^T -> shared (bf16 panels)                       [barrier dS]
//   warpgroup 0:         dV += P^T dO;   warpgroup 1: dK += dS^T Q   (A from shared, K-major;
//                        one instruction stream with role-dependent descriptors: a version with
//                        P^T as a register operand on warpgroup 0 spilled 512 bytes at d = 256)
//   both, atomic mode:   dQ = dS K, columns [0, kDq0) on warpgroup 0 and [kDq0, D) on 1
//                        (A = dS^T read MN-major, B = K MN-major), then 64 x 64 tiles through
//                        shared memory into bulk reductions (the tiled dq_accum).
// S^T and dP^T run on the tensor cores at the same time; the work after the exchange is one
// D-wide product per warpgroup plus half of dQ, so both warpgroups issue the same MMA volume.
// Step protocol: the TMA / mbarrier ring of bwd.cuh for Q / dO / lse / dsum, no CTA-wide barrier
// per step; named barriers (both warpgroups): dP^T exchanged, P^T / dS^T stored, (atomic mode)
// every product of the step done reading shared memory. Each warpgroup stages its dQ tiles in the
// step's Q (warpgroup 0) / dO (warpgroup 1) stage (at d = 192 warpgroup 0's first tile in a region
// of its own), so step it's stage is released only in step it + 1, once the bulk reductions have
// read the tiles (bulk_wait_read + a warpgroup barrier): warpgroup 1 after its dP^T stores,
// warpgroup 0 after its P^T / dS^T stores, then warp 0 issues step it + 1 into it. A warpgroup
// overwrites the dP^T exchange / dS^T / P^T only after the other one passed the barrier that
// follows its last read of them (program order).
//
// Barrier protocol (the ring's mbarriers in BwdWideSharedStorage::bars; Pipeline in pipeline.cuh).
// Step it uses stage it % 2; warp 0 loads (bwd_start: step 0; then step it + 1 in step it):
//   full[s]:  warp 0's 32 cp.async-tracking arrivals + the TMA bytes (expect_tx by its lane 0);
//             every consumer warp waits on it before the step's first product.
//   empty[s]: one arrival per warp (8), in step it + 1 for step it (release_prev: after the
//             bulk reductions read the dQ tiles staged in the stage); warp 0 waits on it before
//             it issues step it + 2 into the stage.
// Named barriers (id 0 is __syncthreads: bwd_start only):
//   1 kBarDp    256: warpgroup 1 arrives (bar.arrive) once its dP^T is in the exchange;
//               warpgroup 0 waits before reading it
//   2 kBarDs    256, both wait: P^T and dS^T (warpgroup 0's stores) in shared memory
//   3 kBarRead  256, both wait (atomic mode): every product of the step has read its operands,
//               so the dQ tiles may go into the step's Q / dO stage
//   4 + wg      warpgroup wg's 128 threads (kWideBarWg): its dQ staging, after thread 0 waited for
//               the reads of the previous step's reductions (release_prev), and before each
//               tile's bulk reduction (reduce_dq_tile)
//   6 kBarRel   256: warpgroup 1 arrives once it released step it - 1's stage; warpgroup 0
//               waits before warp 0 loads step it + 1 into it
#pragma once
#include "../config.cuh"
#include "../common/bwd_work.cuh"
#include "bwd.cuh"
#include "pipeline.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace cf {

// ---------------------------------------------------------------- shared memory
// The kernel's shared memory (config.cuh BwdSm90WideTraits::kSmemBytes is its sizeof). The bf16
// tiles are in the panel layout (wgmma.cuh) with the 128-byte swizzle, anchored at 1024-byte
// boundaries: each starts at a multiple of 1024 bytes from the (1024-byte aligned) base. Asserted
// (aligned()) rather than declared, as in BwdSharedStorage (bwd.cuh): alignas(1024) would round
// the size the launch asks for up to a multiple of 1024.
template <typename Kt>
struct BwdWideSharedStorage {
    using T = typename Kt::Elem;
    static constexpr int kKeyElems = Kt::kBlockN * Kt::kHeadDim, kStageElems = Kt::kBlockM * Kt::kHeadDim;
    T k[kKeyElems];  // K and V of the CTA's 64 keys, loaded once
    T v[kKeyElems];
    T q[2][kStageElems];  // the Q / dO ring; a step's dQ tiles are staged in its stage
    T dout[2][kStageElems];
    T ds[Kt::kBlockN * Kt::kBlockM];  // dS^T [keys][queries]
    T p[Kt::kBlockN * Kt::kBlockM];   // P^T [keys][queries]
    float4 dp_exchange[Kt::kBlockM / 8][128];  // dP^T, warpgroup 1 -> 0: thread wt's accumulators 4c.. at [c][wt]
    float lse[2][Kt::kBlockM];   // the ring's lse / dsum rows
    float dsum[2][Kt::kBlockM];
    uint64_t bars[2][2];  // the ring's mbarriers (Pipeline<2>): full[2], then empty[2]
    // d = 192: warpgroup 0's second dQ staging slot (a 64 x 64 f32 tile); at d = 256 none, a
    // zero-length array (GNU C++, as nvcc's front end and its host compilers take it): a base
    // class holding the slot instead cost the d = 192 kernel 16 instructions (a null check and
    // generic addressing of the derived-to-base conversion)
    float dq_slot[Kt::kSlotBytes / 4];
};

template <typename Kt>
constexpr bool bwd_wide_storage_aligned() {
    using S = BwdWideSharedStorage<Kt>;
    return offsetof(S, k) % 1024 == 0 && offsetof(S, v) % 1024 == 0 && offsetof(S, q) % 1024 == 0 &&
           sizeof(S::q[0]) % 1024 == 0 && offsetof(S, dout) % 1024 == 0 && sizeof(S::dout[0]) % 1024 == 0 &&
           offsetof(S, ds) % 1024 == 0 && offsetof(S, p) % 1024 == 0 &&
           offsetof(S, dq_slot) % 16 == 0;  // bulk copies: 16 bytes
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// dQ (N columns starting at column tile tKc of K) = dS K over the CTA's BN keys.
template <int N, int BN, typename T>
__device__ __forceinline__ void wide_dq_product(float (&dq)[N / 2], uint32_t tdS, uint32_t tKc) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
        wgmma_ss<N, T, 1, 1>(dq, desc_mn_major(tdS, BN, kk), desc_mn_major(tKc, BN, kk), kk > 0);
}

// Named barrier kWideBarWg + wg: one warpgroup's dQ staging (file comment).
constexpr uint32_t kWideBarWg = 4;

// The parts of a warpgroup's step: S^T or dP^T (s_or_dp), the dP^T exchange (send_dp /
// receive_dp), P^T and dS^T to shared memory (store_p_ds), dV or dK (issue_dv_or_dk), the
// release of the previous step's stage (release_prev) and the dQ reductions' turn and d = 192
// panels and d = 256 halves (take_turn, dq_panels, panel_store, half_store);
// the kernel's step loop calls them by role. Its members are references to the kernel's locals
// (as BwdMainloop's in bwd.cuh, and for the same reason); the step's own values (it, hq, m0) come
// by reference too, as the lambdas these parts replace captured them.
template <typename Kt, bool kOrdered, typename Work>
struct BwdWideMainloop {
    using T = typename Kt::Elem;
    static constexpr int BN = Kt::kBlockN, BM = Kt::kBlockM, ND = Kt::kHeadDim / 2;
    static constexpr int KS = Kt::kHeadDim / 16;  // k16 steps of S^T and dP^T
    static constexpr uint32_t kBarWg = kWideBarWg;
    const BwdWs& ws;
    const Work& w;
    const CfFwdParams& f;
    const SeqInfo& si;
    const Pipeline<2>& pipe;
    const int &wg, &wq, &wt, &g, &q4, &lane;
    const uint32_t &tK, &tV, &tdS, &tP;
    float4* const& sX;
    T *const &sP, *const &sdS;
    float (&acc)[ND];
    DqOrder& order;
    const int& key_l0;
    const bool& trace;

    // ---- S^T = K Q^T (warpgroup 0) / dP^T = V dO^T (warpgroup 1): 64 keys x BM queries
    __device__ __forceinline__ void s_or_dp(float (&sc)[BM / 2], const uint32_t& tQ, const uint32_t& tdO, const int& it) const {
        const uint32_t tA = wg == 0 ? tK : tV, tB = wg == 0 ? tQ : tdO;
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < KS; ++ks)
            wgmma_ss<BM, T, 0, 0>(sc, desc_k_major(tA, BN, ks), desc_k_major(tB, BM, ks), ks > 0);
        wg_commit();
        wg_wait<0>();
        reg_fence(sc);
        CF_BTRACE(trace, wg, it, 2);
    }
    // ---- dP^T from warpgroup 1 to 0 (thread wt of both warpgroups holds the same elements)
    __device__ __forceinline__ void send_dp(const float (&sc)[BM / 2]) const {
#pragma unroll
        for (int c = 0; c < BM / 8; ++c) sX[c * 128 + wt] = make_float4(sc[4 * c], sc[4 * c + 1], sc[4 * c + 2], sc[4 * c + 3]);
    }
    __device__ __forceinline__ void receive_dp(float (&dp)[BM / 2]) const {
#pragma unroll
        for (int c = 0; c < BM / 8; ++c) {
            const float4 x = sX[c * 128 + wt];
            dp[4 * c] = x.x;
            dp[4 * c + 1] = x.y;
            dp[4 * c + 2] = x.z;
            dp[4 * c + 3] = x.w;
        }
    }
    // ---- dV += P^T dO (warpgroup 0) / dK += dS^T Q (warpgroup 1): A = [keys][queries]
    //      K-major, B = [queries][d] MN-major. One instruction stream for both roles (only
    //      the descriptors differ), so the accumulators keep one register assignment.
    __device__ __forceinline__ void issue_dv_or_dk(const uint32_t& tQ, const uint32_t& tdO) const {
        const uint32_t tA2 = wg == 0 ? tP : tdS, tB2 = wg == 0 ? tdO : tQ;
        wg_fence();
#pragma unroll
        for (int kq = 0; kq < BM / 16; ++kq)
            wgmma_ss<Kt::kHeadDim, T, 0, 1>(acc, desc_k_major(tA2, BN, kq), desc_mn_major(tB2, BM, kq), 1);
        wg_commit();
    }
    // ---- P^T and dS^T -> shared (bf16 panels [keys][queries]): n8 tile j of the
    //      accumulators holds queries 8j + 2 q4 (+1) of keys key_l0 (+8)
    __device__ __forceinline__ void store_p_ds(const float (&sc)[BM / 2], const float (&dp)[BM / 2]) const {
        unsigned char* pP = reinterpret_cast<unsigned char*>(sP);
        unsigned char* pdS = reinterpret_cast<unsigned char*>(sdS);
#pragma unroll
        for (int j = 0; j < BM / 8; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const uint32_t off = panel_offset(BN, key_l0 + 8 * r, 8 * j + 2 * q4);
                *reinterpret_cast<uint32_t*>(pP + off) = pack2<T>(sc[4 * j + 2 * r], sc[4 * j + 2 * r + 1]);
                *reinterpret_cast<uint32_t*>(pdS + off) = pack2<T>(dp[4 * j + 2 * r], dp[4 * j + 2 * r + 1]);
            }
    }

    // ---- Step it - 1 is over once the bulk reductions it issued have read their staging
    //      tiles (in its Q / dO stage, and dq_slot at d = 192): then that stage goes back to the
    //      loader. Each warpgroup waits as late as it can: warpgroup 1 after its dP^T stores,
    //      warpgroup 0 just before warp 0 loads step it + 1 into that stage (kBarRel: warpgroup
    //      1 has released it too). A reduction of 32 KB per warpgroup takes ~2500 cycles to read
    //      (bwd_trace.py, d = 256); waited for right after this step's first products, it
    //      held both warpgroups ~1000 cycles a step.
    __device__ __forceinline__ void release_prev(const int& it) const {
        if (it > 0) {
            if (ws.dq_accum != nullptr) {
                if (wt == 0) {
                    if constexpr (kOrdered) order.signal(ws.dq_sem);  // waits for the writes too
                    else bulk_wait_read<0>();
                }
                named_bar_sync(kBarWg + wg, 128);
            }
            pipe.consumer_release(it - 1, lane);
        }
    }
    // before this warpgroup's first reduction of the step (query rows m0.. of head hq)
    __device__ __forceinline__ void take_turn(const int& hq, const int& m0) const {
        if (kOrdered && wt == 0) order.turn(ws.dq_sem, ws.dq_counter(w.b, f, hq, m0, wg), w.dq_turn(m0));
    }
    // dQ's N columns from panel pnl on into dq (d = 192: one 64-column panel; d = 256: this
    // warpgroup's half, two panels), with every product of the warpgroup completed
    template <int N>
    __device__ __forceinline__ void dq_panels(float (&dq)[N / 2], int pnl) const {
        wg_fence();  // dq's registers were last written by ordinary instructions
        wide_dq_product<N, BN, T>(dq, tdS, tK + pnl * BN * kPanelRowBytes);
        wg_commit();
        wg_wait<0>();
        reg_fence(dq);
        reg_fence(acc);
    }
    // and out through the two slots into its panels of dq_accum
    __device__ __forceinline__ void half_store(float (&dq)[64], const int& hq, const int& m0, float* const (&slot)[2],
                                               const int& pnl0) const {
#pragma unroll
        for (int pp = 0; pp < 2; ++pp)
            reduce_dq_tile<16>(dq, 8 * pp, slot[pp], ws.dq_tile_rows(f, si, hq, pnl0 + pp, m0), kBarWg + wg, wt,
                               16 * wq + g, q4);
    }
    // d = 192: and out through tile into panel pnl of dq_accum
    __device__ __forceinline__ void panel_store(float (&dqp)[32], const int& hq, const int& m0, float* tile, int pnl) const {
        reduce_dq_tile<8>(dqp, 0, tile, ws.dq_tile_rows(f, si, hq, pnl, m0), kBarWg + wg, wt, 16 * wq + g, q4);
    }
};

// The epilogue: this warpgroup's accumulators (dV on warpgroup 0, dK on 1; element 4j+e: key
// key_l0 + 8 (e >> 1), column 8j + 2 q4 + (e & 1)) into the rows of dst (row stride rs), each
// pair of columns by put(address, a, b). Its members are references to the kernel's locals (as
// BwdMainloop's in bwd.cuh).
template <typename Kt>
struct BwdWideEpilogue {
    static constexpr int D = Kt::kHeadDim, ND = D / 2;
    const CfFwdParams& f;
    const SeqInfo& si;
    const int &n0, &key_l0, &q4;
    float (&acc)[ND];

    template <typename Dst, typename Put>
    __device__ __forceinline__ void store(Dst* dst, int64_t rs, Put put) const {
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int rl = key_l0 + 8 * r, col = 8 * j + 2 * q4;
                if (n0 + rl < si.sk && col < f.d) put(dst + (int64_t)(n0 + rl) * rs + col, acc[4 * j + 2 * r], acc[4 * j + 2 * r + 1]);
            }
    }
};
#endif

// kOrdered: deterministic mode, as in bwd_dkdv_sm90_kernel.
template <typename Kt, bool kOrdered = false>
__global__ void __launch_bounds__(Kt::kNThreads, 1)
    bwd_dkdv_sm90_wide_kernel(const __grid_constant__ CfBwdParams p, const BwdWs ws, const __grid_constant__ BwdTmaMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using T = typename Kt::Elem;
    constexpr int D = Kt::kHeadDim, BM = Kt::kBlockM, BN = Kt::kBlockN, NTH = Kt::kNThreads;
    constexpr int NA = BM / 2;    // accumulators of an m64 x BM product
    constexpr int ND = D / 2;     // accumulators of an m64 x D product
    constexpr int DQ0 = Kt::kDq0, DQ1 = D - DQ0;
    // named barriers (0 is __syncthreads): dP^T exchanged, dS^T / P^T stored, the step's products
    // done reading shared memory (all 256 threads); kBarRel: warpgroup 1 has released step it - 1's
    // stage (warpgroup 0 loads step it + 1 into it); kWideBarWg + wg: one warpgroup's dQ staging
    // (BwdWideMainloop)
    constexpr uint32_t kBarDp = 1, kBarDs = 2, kBarRead = 3, kBarRel = 6;

    using Storage = BwdWideSharedStorage<Kt>;
    static_assert(bwd_wide_storage_aligned<Kt>(), "swizzled tiles at 1024-byte offsets");
    static_assert(sizeof(Storage) <= 227 * 1024, "sm_90 shared memory");
    // (bwd.cuh's bwd_shared_storage here addressed the dP^T exchange one add per store worse)
    extern __shared__ __align__(1024) unsigned char smem_sm90[];
    if (smem_addr(smem_sm90) & 1023) __trap();  // the 128-byte swizzle needs a 1024-byte aligned base
    Storage& ss = *reinterpret_cast<Storage*>(smem_sm90);
    T* sK = ss.k;
    T* sV = ss.v;
    T* sQ = &ss.q[0][0];
    T* sdO = &ss.dout[0][0];
    T* sdS = ss.ds;
    T* sP = ss.p;
    float4* sX = &ss.dp_exchange[0][0];
    float* sL = &ss.lse[0][0];
    float* sD = &ss.dsum[0][0];
    uint64_t* bars = &ss.bars[0][0];

    const CfFwdParams& f = p.fwd;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wq = warp & 3, wt = tid & 127;  // warpgroup, warp / thread within it
    const int g = lane >> 2, q4 = lane & 3;
    // CTAs key block slowest under causal-like masks (plan.cuh heavy_first_order), and the
    // rotated query-block order without masks (common/bwd_work.cuh DkdvWork kRotate)
    using Work = DkdvWork<T, BN, BM, true, true, kOrdered, false, Kt::kBlockMasks>;
    const Work w(p, ws);
    const bool trace = blockIdx.x == 1 && blockIdx.y == 0 && blockIdx.z == 0;
    (void)trace;
    if (w.empty()) return;
    const SeqInfo& si = w.si;
    const MaskInfo& mk = w.mk;
    const int hkv_i = w.hkv_i, split = w.split, n0 = w.n0, total_it = w.total_it;
    const Pipeline<2> pipe(smem_addr(bars));
    const BwdProducer<BM, D, false, T, Work, Pipeline<2>> producer{p, ws, maps, w, pipe, sQ, sdO, sL, sD, lane};
    bwd_start<NTH, D>(f, w, pipe, sK, sV, producer, tid);

    // kOrdered: a step's reductions take their turn (sm90/tma.cuh DqOrder; thread 0 of the
    // warpgroup, before the first of them) and pass it on once they have completed (in the next
    // step's release_prev, where the wait for their reads was).
    [[maybe_unused]] DqOrder order;

    float acc[ND];  // dV on warpgroup 0, dK on warpgroup 1
#pragma unroll
    for (int i = 0; i < ND; ++i) acc[i] = 0.f;

    const uint32_t tK = smem_addr(sK), tV = smem_addr(sV), tdS = smem_addr(sdS), tP = smem_addr(sP);
    const int key_l0 = 16 * wq + g;  // local key of accumulator rows (e < 2); +8 for e >= 2
    const BwdWideMainloop<Kt, kOrdered, Work> ml{ws,  w,  f,  si, pipe, wg, wq, wt,  g,   q4,     lane, tK,
                                                 tV,  tdS, tP, sX, sP, sdS, acc, order, key_l0, trace};

    for (int it = 0; it < total_it; ++it) {
        CF_BTRACE(trace, wg, it, 0);
        const int hq = w.head(it), m0 = w.row0(it);
        const StepKind kind = w.step_kind(it);  // through a block mask: the rule too
        const int st = pipe.stage(it);
        pipe.consumer_wait(it);  // this step's tiles landed (and the fence for the cp.async part)
        CF_BTRACE(trace, wg, it, 1);
        const uint32_t tQ = smem_addr(sQ + st * BM * D), tdO = smem_addr(sdO + st * BM * D);

        // ---- S^T = K Q^T (warpgroup 0) / dP^T = V dO^T (warpgroup 1): 64 keys x BM queries
        float sc[NA];
        ml.s_or_dp(sc, tQ, tdO, it);

        CF_BTRACE(trace, wg, it, 3);

        if (wg == 1) {
            // ---- dP^T to warpgroup 0 (thread wt of both warpgroups holds the same elements)
            ml.send_dp(sc);
            named_bar_arrive(kBarDp, 256);
            ml.release_prev(it);
            named_bar_arrive(kBarRel, 256);
            CF_BTRACE(trace, wg, it, 4);
            CF_BTRACE(trace, wg, it, 5);
            CF_BTRACE(trace, wg, it, 6);
        } else {
            named_bar_sync(kBarDp, 256);
            CF_BTRACE(trace, wg, it, 4);
            float dp[NA];
            ml.receive_dp(dp);
            // ---- P^T, dS^T (element 4j+e: key key_l0 + 8 (e >> 1), query 8j + 2 q4 + (e & 1))
            const LogitInfo li(f, w.b, hq);
            const bool full = kind == StepKind::kFull && mk.block_full(m0, BM, n0, BN) && m0 + BM <= si.sq;
            bwd_p_ds<BM>(li, mk, sc, dp, sL + st * BM, sD + st * BM, full, m0, n0 + key_l0, q4);
            if constexpr (Kt::kBlockMasks) {
                if (kind != StepKind::kFull)
                    mask_rule_p_ds<BM>(sc, dp, w.bmask, mk, w.b, m0, n0 + key_l0, q4, kind == StepKind::kVoid);
            }
            CF_BTRACE(trace, wg, it, 5);
            ml.store_p_ds(sc, dp);
            fence_async_smem();  // st.shared (generic proxy) -> wgmma (async proxy)
            // step it + 1 into the stage both warpgroups released (release_prev; kBarRel also
            // orders warpgroup 1's staging stores before a cp.async fallback's writes, which
            // racecheck sees, unlike the ring's mbarriers). Here, with S^T and dP^T dead: issued
            // right after kBarDp, warp 0's load code beside the live accumulators made ptxas
            // serialise the d = 192 kernel's wgmma (C7511).
            ml.release_prev(it);
            named_bar_sync(kBarRel, 256);  // and warpgroup 1 has released it
            if (warp == 0 && it + 1 < total_it) producer.load_step(it + 1);
            CF_BTRACE(trace, wg, it, 6);
        }
        named_bar_sync(kBarDs, 256);  // P^T and dS^T are in shared
        CF_BTRACE(trace, wg, it, 7);

        ml.issue_dv_or_dk(tQ, tdO);
        if (ws.dq_accum != nullptr) {
            // ---- dQ = dS K, this warpgroup's columns (A = dS^T read MN-major, B = K MN-major),
            //      then its 64 x 64 tiles through shared memory into bulk reductions (tiled
            //      dq_accum). The tiles are staged in this step's Q (warpgroup 0) / dO (warpgroup 1)
            //      stage, free once both warpgroups' products of the step have completed (kBarRead)
            //      and held until the next step has seen the reads done (release_prev): two tiles
            //      at d = 256, so that the second need not wait for the first one's read; at d = 192
            //      one (warpgroup 0's first tile goes through a region of its own, dq_slot, see
            //      below). Nothing the next step writes early (the dP^T exchange, dS^T, P^T) is a
            //      staging tile, so its wait for the reads can come late.
            float* const stage_f = reinterpret_cast<float*>(wg == 0 ? sQ + st * BM * D : sdO + st * BM * D);
            float* const slot[2] = {stage_f, stage_f + 64 * 64};
            static_assert(BM * D * (int)sizeof(T) >= (D == 256 ? 2 : 1) * 64 * 64 * 4, "dQ tiles fit in a Q / dO stage");
            const int pnl0 = wg * (DQ0 / 64);  // this warpgroup's first dQ panel
            // Both warpgroups reach the kBarRead barrier through one instruction: bar.sync is
            // .aligned, which PTX requires every participating thread to execute at the same
            // instruction (compute-sanitizer synccheck flagged two copies at d = 192 once).
            if constexpr (D == 192) {
                // One 64-column panel at a time (32 accumulators, not 64): warpgroup 0's panel 0
                // goes out through its own region (dq_slot) before its panel 1's product, which
                // still reads dS^T, and panel 1 goes to the Q stage (slot 0) after kBarRead;
                // warpgroup 1 has panel 2 only. With both of warpgroup 0's panels in registers
                // this kernel sat at the edge where ptxas serialises its wgmma (C7511), and
                // unrelated changes (a field added to BwdWs) tipped it over.
                float dqp[32];
                ml.template dq_panels<64>(dqp, pnl0);  // warpgroup 0: panel 0; warpgroup 1: panel 2
                if (wg == 0) {
                    ml.take_turn(hq, m0);
                    ml.panel_store(dqp, hq, m0, ss.dq_slot, 0);
                    ml.template dq_panels<64>(dqp, 1);
                }
                named_bar_sync(kBarRead, 256);  // every product of this step has read its operands
                CF_BTRACE(trace, wg, it, 9);
                if (wg == 1) ml.take_turn(hq, m0);
                ml.panel_store(dqp, hq, m0, slot[0], wg == 0 ? 1 : pnl0);
            } else {
                // d = 256: two panels per warpgroup, in one product, into slots 0 and 1
                static_assert(DQ0 == DQ1 && DQ0 == 128, "d = 256 splits dQ 128 + 128");
                float dq[DQ0 / 2];
                ml.template dq_panels<128>(dq, pnl0);
                CF_BTRACE(trace, wg, it, 8);
                named_bar_sync(kBarRead, 256);  // every product of this step has read its operands
                CF_BTRACE(trace, wg, it, 9);
                ml.take_turn(hq, m0);
                ml.half_store(dq, hq, m0, slot, pnl0);
                CF_BTRACE(trace, wg, it, 10);
            }
        } else {
            wg_wait<0>();
            reg_fence(acc);
        }
        CF_BTRACE(trace, wg, it, 11);
    }

    if (ws.dq_accum != nullptr && wt == 0) {
        if constexpr (kOrdered) order.signal(ws.dq_sem);
        bulk_wait<0>();  // the last reduction is done with shared memory
    }

    // ---- write dK (scaled; warpgroup 1) and dV (warpgroup 0).
    //      Element 4j+e: key key_l0 + 8 (e >> 1), column 8j + 2 q4 + (e & 1).
    if (wg == 1) {
        const float scale = f.softmax_scale;
#pragma unroll
        for (int i = 0; i < ND; ++i) acc[i] *= scale;
    }
    // Straight from registers (4-byte pairs, 32 contiguous bytes per row and warp): each warpgroup
    // writes one whole tensor, so there is nothing to gather through shared memory (a staged
    // version, as in bwd.cuh, also drew racecheck reports between its two barriers).
    const BwdWideEpilogue<Kt> epi{f, si, n0, key_l0, q4, acc};
    if (ws.nsplit == 1) {
        epi.store(wg == 0 ? si.dv<T>(p, hkv_i) : si.dk<T>(p, hkv_i), wg == 0 ? p.dv_row_stride : p.dk_row_stride,
              [](T* d, float a, float b) { *reinterpret_cast<uint32_t*>(d) = pack2<T>(a, b); });
    } else {  // f32 partials of this split, summed by bwd_reduce_dkv_kernel
        float* wk = ws.dk_part_rows(f, si, split, hkv_i);
        epi.store(wg == 0 ? wk + ws.dkv_v_offset(f) : wk, (int64_t)f.hkv * f.d,
              [](float* d, float a, float b) { *reinterpret_cast<float2*>(d) = make_float2(a, b); });
    }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace cf
