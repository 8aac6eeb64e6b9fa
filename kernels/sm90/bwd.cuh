// Backward dK/dV (+ atomic dQ) on Hopper warpgroup MMA (sm_90a). Same algorithm, semantics and
// workspace as bwd_dkdv_tc_kernel (sm80/bwd.cuh); what changes is who does the products:
//   per query block, warpgroup w (keys 64w..64w+63 of the CTA's kBlockN):
//     S^T  = K Q^T,  dP^T = V dO^T         wgmma, A and B from shared (both K-major)
//     P^T  = 2^(S^T c - lse2),  dS^T = P^T (dP^T - dsum)     registers (columns = queries)
//     dV  += P^T dO, dK += dS^T Q          wgmma, A = P^T / dS^T from registers, B MN-major
//     atomic mode: dS^T -> shared; dQ = dS K (wgmma, both MN-major) -> a 64 x 64 f32 tile in
//                  shared memory -> one bulk reduction (cp.reduce.async.bulk) into the tiled
//                  dq_accum per warpgroup and step (a timing build without any dQ reduction
//                  ran 1.5x faster than per-element f32 atomics; the bulk reductions gained
//                  5-8%, the load ring below the rest: bench/NOTES.md "Backward v4–v5").
//                  At d = 96 / 128 (not deterministic) the warpgroups take turns instead: step s's
//                  owner computes all of dQ(s) as one m64 x n128 product (kDqTurns, below).
// Computing the transposed scores keeps P^T and dS^T in the accumulator layout that the dV / dK
// products take as register A operands: no shared-memory round trip for P at all, and dS goes
// through shared memory only for dQ.
// Loads (v5, v7): Q / dO go by TMA (tma.cuh; cp.async where TMA cannot: a varlen query block
// crossing the sequence end, or no tensor map) into a ring of Kt::kStages stages guarded by mbarriers
// (pipeline.cuh), lse / dsum by cp.async. At d = 96 / 128 (Kt::kProducerWG) a third, producer
// warpgroup that setmaxnreg lowers to 24 registers (the consumers get 240) issues Q / dO from its
// first warp, and warp 0 of the consumers copies lse / dsum one step ahead; at d = 64 warp 0
// issues all of step it + 1 between its products.
//
// Parts, in the order a CTA runs them:
//   BwdSharedStorage   shared memory as a struct; the launch asks for exactly its sizeof
//   DkdvWork           (common/bwd_work.cuh) the CTA's key block and its steps (query blocks)
//   bwd_start          the ring's barriers, K / V, step 0's loads
//   BwdProducer        the loads of a step: Q / dO (and without the producer warpgroup lse / dsum:
//                      load_step, bwd_load_step), lse / dsum alone (load_rows, bwd_load_rows); the
//                      producer warpgroup's loop is the kernel's
//   BwdMainloop        a consumer warpgroup's step: the S^T / dP^T step (issue_s_dp, p_ds), the
//                      dV / dK step (issue_dv, issue_dk, drain_step), the dQ flush (store_ds,
//                      dq_step, flush_dq; by turns dq_turn_product, flush_turn_tile), in the
//                      kernel's two step loops (dQ by turns, or lockstep)
//   BwdEpilogue        dK / dV out: staged 16-byte rows (store_staged), or the GQA split's f32
//                      partials (store_partials), which the last CTA of the key block
//                      (last_split) sums, in the kernel's body
//
// Barrier protocol (the ring's mbarriers in BwdSharedStorage::bars; Pipeline in pipeline.cuh).
// Step it uses stage it % kStages:
//   full[s]:  the loading warp's 32 cp.async-tracking arrivals (+ warp 0's 32 for the rows with
//             the producer: 64) + the TMA bytes (expect_tx by the loading warp's lane 0). The
//             consumers wait on it before the step's first product (consumer_wait).
//   empty[s]: one arrival per consumer warp (8) once its dV / dK products have read the stage
//             (consumer_release). The loading warp waits on it before it issues the step
//             kStages later into the stage (producer_acquire).
// Named barriers (bar.sync; id 0 is __syncthreads):
//   0           the whole CTA: barrier initialisation published and K / V landed (bwd_start);
//               without the producer warpgroup also the epilogue's (as kBarEpi below)
//   1 + wg      warpgroup wg's 128 threads, its dQ staging tile: free for the stores
//               (wait_dq_tile_free, after thread 0 waited for the bulk reduction that read it),
//               then stored before thread 0 issues the next reduction (flush_dq_tile). By turns
//               each warpgroup passes its own barrier equally often (racecheck).
//   3 kBarDs    the 256 consumer threads: both halves of dS^T(it) in shared memory, once a step
//               (double-buffered, so a warpgroup that runs ahead writes the other one); without
//               dQ in the kernel it orders the reads of lse / dsum before warp 0's next copies
//   4 kBarEpi   the 256 consumer threads, with the producer warpgroup (which has returned by
//               then): the epilogue's staging of dK / dV and the split's last-CTA vote
//               (named_bar_any, bar.red.or)
// There is no CTA-wide barrier per step: the warpgroups meet only at kBarDs.
#pragma once
#include <cstddef>
#include "../config.cuh"
#include "../common/bwd_work.cuh"
#include "pipeline.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace cf {

#ifdef CF_BWD_TRACE
// Timeline probe (a build-time option for experiments/bwd_trace.py, never in the crate's build):
// clock64() at twelve points of a step (named in experiments/bwd_trace.py), taken by thread 0 of each
// consumer warpgroup of the CTA at blockIdx (1, 0, 0) over its first kBwdTraceSteps steps. The
// buffer is per translation unit (static); sm80/bwd_bf16.cu reads it (cf_bwd_trace_read).
constexpr int kBwdTraceSteps = 64, kBwdTraceEvents = 12;
static __device__ long long g_bwd_trace[2][kBwdTraceSteps][kBwdTraceEvents];
#define CF_BTRACE(on, wg, s, e)                                                                      \
    do {                                                                                             \
        if ((on) && (threadIdx.x & 127) == 0 && (s) < kBwdTraceSteps) g_bwd_trace[wg][s][e] = clock64(); \
    } while (0)
#else
#define CF_BTRACE(on, wg, s, e) \
    do {                        \
    } while (0)
#endif

// ---------------------------------------------------------------- shared memory
// The kernel's shared memory (config.cuh BwdSm90Traits::kSmemBytes is its sizeof). The tiles are
// in the panel layout (wgmma.cuh) with the 128-byte swizzle, which is anchored at 1024-byte
// boundaries: every tile starts at a multiple of 1024 bytes from the base (itself 1024-byte
// aligned, which the kernel checks). In this order they land there without padding (the f32
// rows and staging tiles follow the last swizzled tile); the alignment is asserted (aligned())
// rather than declared, because alignas(1024) would round the struct's size, and with it the
// launch's request, up to a multiple of 1024.
template <typename Kt>
struct BwdSharedStorage {
    using T = typename Kt::Elem;
    static constexpr int kKeyElems = Kt::kBlockN * Kt::kHeadDimPad, kStageElems = Kt::kBlockM * Kt::kHeadDimPad;
    T k[kKeyElems];  // K and V of the CTA's keys, loaded once
    T v[kKeyElems];
    T q[Kt::kStages][kStageElems];     // the Q / dO ring; dK / dV are staged in it at the end
    T dout[Kt::kStages][kStageElems];
    T ds[2][Kt::kBlockN * Kt::kBlockM];  // dS^T [keys][queries], double-buffered
    float lse[Kt::kStages][Kt::kBlockM];   // the ring's lse / dsum rows
    float dsum[Kt::kStages][Kt::kBlockM];
    float dq[2][Kt::kDqSlots][Kt::kDqRows * 64];  // per warpgroup: dQ staging tiles (f32) of the bulk reductions
    uint64_t bars[2][Kt::kStages];  // the ring's mbarriers (Pipeline): full[kStages], then empty[kStages]

    static constexpr bool aligned() {
        return offsetof(BwdSharedStorage, k) % 1024 == 0 && offsetof(BwdSharedStorage, v) % 1024 == 0 &&
               offsetof(BwdSharedStorage, q) % 1024 == 0 && sizeof(q[0]) % 1024 == 0 &&
               offsetof(BwdSharedStorage, dout) % 1024 == 0 && sizeof(dout[0]) % 1024 == 0 &&
               offsetof(BwdSharedStorage, ds) % 1024 == 0 && sizeof(ds[0]) % 1024 == 0 &&
               offsetof(BwdSharedStorage, dq) % 16 == 0 && sizeof(dq[0][0]) % 16 == 0;  // bulk copies: 16 bytes
    }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The kernel's dynamic shared memory as its storage struct.
template <typename Storage>
__device__ __forceinline__ Storage& bwd_shared_storage() {
    static_assert(sizeof(Storage) <= 227 * 1024, "sm_90 shared memory");
    extern __shared__ __align__(1024) unsigned char smem_sm90[];
    if (smem_addr(smem_sm90) & 1023) __trap();  // the 128-byte swizzle needs a 1024-byte aligned base
    return *reinterpret_cast<Storage*>(smem_sm90);
}

// Step it's lse / dsum rows (cp.async, zero past the sequence) into stage pipe.stage(it) of the ring, by
// one warp; the caller commits them on the stage's full barrier.
template <int BM, typename Work, typename Pipe>
__device__ __forceinline__ void bwd_load_rows(const CfBwdParams& p, const BwdWs& ws, const Work& w,
                                              const Pipe& pipe, int it, float* sL, float* sD, int lane) {
    const CfFwdParams& f = p.fwd;
    const SeqInfo& si = w.si;
    const int st = pipe.stage(it), hq = w.head(it), m0 = w.row0(it);
    const float* lp = si.lse(f, hq) + m0;
    const float* dp = ws.dsum_rows(si, hq) + m0;
#pragma unroll
    for (int r = lane; r < BM; r += 32) {
        const bool ok = m0 + r < si.sq;
        cp_async_4(smem_addr(sL + st * BM + r), ok ? (const void*)(lp + r) : (const void*)f.lse, ok);
        cp_async_4(smem_addr(sD + st * BM + r), ok ? (const void*)(dp + r) : (const void*)ws.dsum, ok);
    }
}

// Step it's Q / dO (TMA, or cp.async for a varlen block crossing the sequence end / without maps)
// into stage pipe.stage(it) of the ring, by one warp; every lane then commits one cp.async-tracking
// arrival on the stage's full barrier. Waits until the stage's previous step released it
// (pipe.producer_acquire). kProducer: the warp is the producer warpgroup's (24 registers), so its
// cp.async passes run rolled and it leaves the lse / dsum rows to warp 0 of the consumers (below);
// otherwise it copies them too.
template <int BM, int D, bool kProducer, typename T, typename Work, typename Pipe>
__device__ __forceinline__ void bwd_load_step(const CfBwdParams& p, const BwdWs& ws, const BwdTmaMaps& maps,
                                              const Work& w, const Pipe& pipe, int it, T* sQ, T* sdO, float* sL,
                                              float* sD, int lane) {
    constexpr int C = D / 8;
    const CfFwdParams& f = p.fwd;
    const SeqInfo& si = w.si;
    const int st = pipe.stage(it), hq = w.head(it), m0 = w.row0(it);
    T* q_dst = sQ + st * BM * D;
    T* do_dst = sdO + st * BM * D;
    pipe.producer_acquire(it);
    if (maps.ok && (!si.q_varlen || m0 + BM <= si.sq)) {
        if (lane == 0) {
            const int64_t row0 = (si.q_varlen ? si.q_row0 : 0) + m0;
            const int batch = si.q_varlen ? 0 : si.b;
            const uint32_t bar = pipe.full_bar(it);
            mbar_expect_tx(bar, 2 * BM * D * 2);
#pragma unroll
            for (int pnl = 0; pnl < D / 64; ++pnl) {
                tma_load_4d(smem_addr(q_dst) + pnl * BM * kPanelRowBytes, &maps.q, bar, 64 * pnl, (int)row0, hq, batch);
                tma_load_4d(smem_addr(do_dst) + pnl * BM * kPanelRowBytes, &maps.dout, bar, 64 * pnl, (int)row0, hq, batch);
            }
        }
    } else {
        load_panels_warp<BM, C, kProducer>(q_dst, si.q<T>(f, hq) + (int64_t)m0 * f.q_row_stride, f.q_row_stride,
                                           si.sq - m0, w.dch, lane, f.q);
        load_panels_warp<BM, C, kProducer>(do_dst, si.dout<T>(p, hq) + (int64_t)m0 * p.do_row_stride, p.do_row_stride,
                                           si.sq - m0, w.dch, lane, p.dout);
    }
    if constexpr (!kProducer) bwd_load_rows<BM>(p, ws, w, pipe, it, sL, sD, lane);
    pipe.producer_commit_cp_async(it);
}

// P^T of plain logits (li.general false) over the m64 x BM accumulators of S^T (s): element
// 4j + e is key key0 + 8 (e >> 1), query m0 + 8j + 2 q4 + (e & 1); cL is the step's lse. Calls
// f(i, j, e, p) for every element i = 4j + e with its P^T value p. A full block (no row without
// keys, so lse is finite) needs no index math; otherwise the mask is two compares per element
// against the visible queries of the thread's two key rows (MaskInfo::col_limits).
template <int BM, bool kFull, typename F>
__device__ __forceinline__ void for_each_p(const LogitInfo& li, const MaskInfo& mk, const float (&s)[BM / 2],
                                           const float* cL, int m0, int key0, int q4, F&& f) {
    int lo[2] = {0, 0}, hi[2] = {8 * BM, 8 * BM};  // limits relative to the thread's query columns 8j + (e & 1)
    if constexpr (!kFull) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mk.col_limits(key0 + 8 * r, lo[r], hi[r]);
            lo[r] -= m0 + 2 * q4;
            hi[r] -= m0 + 2 * q4;
        }
    }
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
        const float2 l2 = *reinterpret_cast<const float2*>(cL + 8 * j + 2 * q4);
        const float lse2[2] = {Log2Units::lse(l2.x), Log2Units::lse(l2.y)};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float pv = p_plain<Log2Units, true>(li, mk, s[4 * j + e], lse2[e & 1], 0, 0, true);
            if constexpr (!kFull) {
                const int c = 8 * j + (e & 1), r = e >> 1;
                pv = (c >= lo[r] && c < hi[r]) ? pv : 0.f;
            }
            f(4 * j + e, j, e, pv);
        }
    }
}
template <int BM, typename F>
__device__ __forceinline__ void for_each_p(const LogitInfo& li, const MaskInfo& mk, const float (&s)[BM / 2],
                                           const float* cL, bool full, int m0, int key0, int q4, F&& f) {
    if (full) for_each_p<BM, true>(li, mk, s, cL, m0, key0, q4, f);
    else for_each_p<BM, false>(li, mk, s, cL, m0, key0, q4, f);
}

// The two passes of plain logits, so that a kernel can compute P^T while dP^T is still in
// flight (and dS^T while dV's product runs): bwd_p in place over s, then bwd_ds over dp from s
// (which still holds P^T in f32); cD is the step's dsum.
template <int BM>
__device__ __forceinline__ void bwd_p(const LogitInfo& li, const MaskInfo& mk, float (&s)[BM / 2], const float* cL,
                                      bool full, int m0, int key0, int q4) {
    for_each_p<BM>(li, mk, s, cL, full, m0, key0, q4, [&](int i, int, int, float p) { s[i] = p; });
}
template <int BM>
__device__ __forceinline__ void bwd_ds(const float (&p)[BM / 2], float (&dp)[BM / 2], const float* cD, int q4) {
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
        const float2 d2 = *reinterpret_cast<const float2*>(cD + 8 * j + 2 * q4);
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[4 * j + e] = ds_of(p[4 * j + e], dp[4 * j + e], (e & 1) ? d2.y : d2.x);
    }
}

// P^T and dS^T in one pass, in place over S^T (s) and dP^T (dp), same layout. kLogits: what the
// caller knows of logits_general() (the sm_90a kernel instances are chosen by it on the host):
// plain logits take for_each_p; general ones (softcap's derivative needs the raw score) a pass
// with per-element index math.
enum class Logits { kPlain, kGeneral, kEither };
template <int BM, Logits kLogits = Logits::kEither>
__device__ __forceinline__ void bwd_p_ds(const LogitInfo& li, const MaskInfo& mk, float (&s)[BM / 2], float (&dp)[BM / 2],
                                         const float* cL, const float* cD, bool full, int m0, int key0, int q4) {
    auto plain = [&] {
        for_each_p<BM>(li, mk, s, cL, full, m0, key0, q4, [&](int i, int j, int e, float p) {
            s[i] = p;
            dp[i] = ds_of(p, dp[i], cD[8 * j + 2 * q4 + (e & 1)]);
        });
    };
    auto general = [&] {
#pragma unroll
        for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int ql = 8 * j + 2 * q4 + (e & 1);
                const PdS x = p_ds(li, mk, s[4 * j + e], dp[4 * j + e], Log2Units::lse(cL[ql]), cD[ql], m0 + ql,
                                   key0 + 8 * (e >> 1), false);
                s[4 * j + e] = x.p;
                dp[4 * j + e] = x.ds;
            }
        }
    };
    if constexpr (kLogits == Logits::kPlain) plain();
    else if constexpr (kLogits == Logits::kGeneral) general();
    else if (li.general) general();
    else plain();
}

// The loads of both sm_90a backward kernels, bound to the kernel's ring: a step's Q / dO (and,
// without the producer warpgroup, its lse / dsum rows: load_step, bwd_load_step), or its lse /
// dsum rows alone (load_rows) by warp 0 of the consumers when the producer warpgroup issues the
// Q / dO. BM: the step's query rows, D: the tiles' columns. Its members are references to the
// kernel's locals, as in BwdMainloop.
template <int BM, int D, bool kProducerWG, typename T, typename Work, typename Pipe>
struct BwdProducer {
    const CfBwdParams& p;
    const BwdWs& ws;
    const BwdTmaMaps& maps;
    const Work& w;
    const Pipe& pipe;
    T *const &sQ, *const &sdO;     // the ring's tiles
    float *const &sL, *const &sD;  // and rows
    const int& lane;

    __device__ __forceinline__ void load_step(int it) const {
        bwd_load_step<BM, D, kProducerWG>(p, ws, maps, w, pipe, it, sQ, sdO, sL, sD, lane);
    }
    // With the producer warpgroup, warp 0 of the consumers copies step it's lse / dsum rows at the
    // start of step it - 1: every consumer warp read the stage's previous rows (step it - 2) before
    // the dS^T barrier of that step, which warp 0 has passed, so the copy needs no wait, and
    // racecheck sees that order (it does not follow the ring's mbarriers, which order the
    // producer's Q / dO).
    __device__ __forceinline__ void load_rows(int it) const {
        bwd_load_rows<BM>(p, ws, w, pipe, it, sL, sD, lane);
        pipe.producer_commit_cp_async(it);
    }
};

// The start of both sm_90a backward kernels: the ring's barriers, K / V once by the NCT consumer
// threads (cp.async, zero-filled past the sequence), step 0 by the loading warp (threads
// kLoader..kLoader + 31: warp 0, or the producer warpgroup's first warp, whose step 0 leaves out
// the lse / dsum rows: the kernel's warp 0 copies them), then one CTA barrier
// after which K / V are visible to wgmma.
template <int NCT, int D, bool kProducerWG = false, typename T, typename Work, typename Pipe, typename Producer>
__device__ __forceinline__ void bwd_start(const CfFwdParams& f, const Work& w, const Pipe& pipe, T* sK, T* sV,
                                          Producer producer, int tid) {
    constexpr int kLoader = kProducerWG ? NCT : 0;
    if (tid == 0) pipe.init(kProducerWG ? 64 : 32, 8);  // full: the loading warp (+ warp 0's rows)
    __syncthreads();  // barrier initialisation published
    if (!kProducerWG || tid < NCT) w.template load_kv<PanelLoader<D / 8, NCT>>(f, sK, sV, tid);
    cp_async_commit();
    if (tid >= kLoader && tid < kLoader + 32 && w.total_it > 0) producer.load_step(0);
    cp_async_wait<0>();
    fence_async_smem();  // K / V (cp.async, generic proxy) -> wgmma (async proxy)
    __syncthreads();     // every thread's K / V rows landed
}
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// ---------------------------------------------------------------- the consumers' step
// The parts of a consumer warpgroup's step (warpgroup wg: keys 64 wg.. of the CTA's block), over
// the kernel's registers and shared memory: the S^T / dP^T step (issue_s_dp, p_ds), the dV / dK
// step (issue_dv, issue_dk, drain_step) and the dQ flush (store_ds, then dq_step and flush_dq;
// by turns dq_turn_product and flush_turn_tile). The kernel's two step loops call them in order;
// dk / dv are the kernel's accumulators.
// The members are references to the kernel's locals, not copies: with copies of the integers
// and addresses, ptxas laid out the d = 96 / 128 kernels' registers differently (same
// instructions, another order; cubins compared with those of commit 9358020, 2026-12-03).
template <typename Kt, bool kOrdered, typename Work>
struct BwdMainloop {
    using T = typename Kt::Elem;
    static constexpr int D = Kt::kHeadDim, BM = Kt::kBlockM, BN = Kt::kBlockN;
    static constexpr int KS = D / 16;   // k16 steps of S^T and dP^T
    static constexpr int MS = BM / 16;  // k16 steps of dV / dK (query rows)
    static constexpr int NS = BN / 16;  // k16 steps of dQ (keys)
    static constexpr int NA = BM / 2;   // accumulators of an m64 x BM product
    static constexpr int ND = D / 2;    // accumulators of an m64 x D product
    static constexpr int NQ = 32;       // accumulators of the m64 x n64 dQ slice
    static constexpr bool kDA = Kt::kDescAdvance;  // how the k16 steps' wgmma descriptors are built
    static constexpr int kSlots = Kt::kDqSlots;

    const CfBwdParams& p;
    const BwdWs& ws;
    const Work& w;
    const CfFwdParams& f;
    const SeqInfo& si;
    const MaskInfo& mk;
    T* const& sdS;
    float *const &sL, *const &sD;  // the ring's lse / dsum rows
    float* const& sDq;
    const int &b, &n0;
    const int &wg, &wq, &g, &q4;  // warpgroup, warp within it, the lane's row / column in its quad
    const uint32_t &tK, &tdS;
    const uint32_t &tKw, &tVw;  // this warpgroup's 64 keys (K-major A)
    const int& key_l0;  // local key of accumulator rows (e < 2); +8 for e >= 2
    const int& wt;      // thread within the warpgroup
    float (&dk)[ND];
    float (&dv)[ND];
    DqOrder& order;
    const bool& trace;  // CF_BWD_TRACE: this warpgroup's steps are recorded

    // ---- the S^T / dP^T step
    // S^T = K Q^T and dP^T = V dO^T (this warpgroup's 64 keys x BM queries), two commit groups
    __device__ __forceinline__ void issue_s_dp(float (&sT)[NA], float (&dpT)[NA], uint32_t tQ, uint32_t tdO) const {
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < KS; ++ks)
            wgmma_ss<BM, T, 0, 0>(sT, desc_k_major<kDA>(tKw, BN, ks), desc_k_major<kDA>(tQ, BM, ks), ks > 0);
        wg_commit();
#pragma unroll
        for (int ks = 0; ks < KS; ++ks)
            wgmma_ss<BM, T, 0, 0>(dpT, desc_k_major<kDA>(tVw, BN, ks), desc_k_major<kDA>(tdO, BM, ks), ks > 0);
        wg_commit();
    }
    // P^T, dS^T in registers (element 4j+e: key key_l0 + 8 (e >> 1), query 8j + 2 q4 + (e & 1)) in
    // place over sT / dpT, P^T overlapped with dP^T's product as Kt::kOverlapP says; step it's
    // rows in ring stage st.
    // kind: the step's in a block mask (DkdvWork::step_kind, read at the step's start).
    __device__ __forceinline__ void p_ds(float (&sT)[NA], float (&dpT)[NA], const LogitInfo& li, int it, int m0,
                                         int st, StepKind kind) const {
        const bool full = kind == StepKind::kFull && mk.block_full(m0, BM, n0, BN) && m0 + BM <= si.sq;
        const float* cL = sL + st * BM;
        const float* cD = sD + st * BM;
        if constexpr (Kt::kOverlapP) {
            // P^T while dP^T runs
            wg_wait<1>();
            reg_fence(sT);
            CF_BTRACE(trace, wg, it, 3);
            bwd_p<BM>(li, mk, sT, cL, full, m0, n0 + key_l0, q4);
            CF_BTRACE(trace, wg, it, 4);
            wg_wait<0>();
            reg_fence(dpT);
            CF_BTRACE(trace, wg, it, 5);
            bwd_ds<BM>(sT, dpT, cD, q4);
        } else {
            wg_wait<0>();
            reg_fence(sT);
            reg_fence(dpT);
            bwd_p_ds<BM, Kt::kGeneralLogits ? Logits::kGeneral : Logits::kPlain>(li, mk, sT, dpT, cL, cD, full, m0,
                                                                               n0 + key_l0, q4);
        }
        if constexpr (Kt::kBlockMasks) {
            if (kind != StepKind::kFull)
                mask_rule_p_ds<BM>(sT, dpT, w.bmask, mk, b, m0, n0 + key_l0, q4, kind == StepKind::kVoid);
        }
    }

    // ---- the dV / dK step: dV += P^T dO, dK += dS^T Q (A from registers; B = dO / Q [queries][d], MN-major)
    // P^T / dS^T accumulators -> register A fragments of dV / dK's products, and those products.
    static __device__ __forceinline__ void pack_a(uint32_t (&a)[MS][4], const float (&x)[NA]) {
#pragma unroll
        for (int kq = 0; kq < MS; ++kq) {
            const int j0 = 8 * kq, j1 = 8 * kq + 4;  // accumulator index of n8 tiles 2kq, 2kq+1
            a[kq][0] = pack2<T>(x[j0], x[j0 + 1]);
            a[kq][1] = pack2<T>(x[j0 + 2], x[j0 + 3]);
            a[kq][2] = pack2<T>(x[j1], x[j1 + 1]);
            a[kq][3] = pack2<T>(x[j1 + 2], x[j1 + 3]);
        }
    }
    static __device__ __forceinline__ void issue_rs(float (&acc)[ND], uint32_t (&a)[MS][4], uint32_t tB) {
        wg_fence();
#pragma unroll
        for (int kq = 0; kq < MS; ++kq) wgmma_rs<D, T, 1>(acc, a[kq], desc_mn_major<kDA>(tB, BM, kq), 1);
        wg_commit();
    }
    __device__ __forceinline__ void issue_dv(uint32_t (&pa)[MS][4], const float (&sT)[NA], uint32_t tdO) const {
        pack_a(pa, sT);
        issue_rs(dv, pa, tdO);
    }
    __device__ __forceinline__ void issue_dk(uint32_t (&dsa)[MS][4], const float (&dpT)[NA], uint32_t tQ) const {
        pack_a(dsa, dpT);
        issue_rs(dk, dsa, tQ);
    }
    // Every product this warpgroup issued in the step has completed (dV, dK and what came before):
    // the accumulators and the P^T / dS^T fragments are free again.
    __device__ __forceinline__ void drain_step(uint32_t (&pa)[MS][4], uint32_t (&dsa)[MS][4]) const {
        wg_wait<0>();
        reg_fence(dv);
        reg_fence(dk);
        reg_fence(pa);
        reg_fence(dsa);
    }

    // ---- the dQ flush
    // step s's rows of dq_accum for this warpgroup's tile (d = 64: query rows 64 wg.. of panel 0;
    // d = 128, either product: all the step's rows of panel wg)
    __device__ __forceinline__ float* dq_dst(int s) const {
        return ws.dq_tile_rows(f, si, w.head(s), D == 64 ? 0 : wg, w.row0(s) + (D == 64 ? 64 * wg : 0));
    }
    // this warpgroup's rows of dS^T (element 4j+e of the A fragments: key key_l0 + 8 (e >> 1),
    // query 8j + 2 q4 + (e & 1)) into buffer buf (not the transposed-dQ layout)
    __device__ __forceinline__ void store_ds(const uint32_t (&a)[MS][4], int buf) const {
#pragma unroll
        for (int kq = 0; kq < MS; ++kq)
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2)      // n8 tile 2kq + h2
#pragma unroll
                for (int r = 0; r < 2; ++r) {   // key row +8r
                    const int kl = key_l0 + 8 * r, ql = 16 * kq + 8 * h2 + 2 * q4;
                    *reinterpret_cast<uint32_t*>(reinterpret_cast<unsigned char*>(sdS + buf * BN * BM) +
                                                 panel_offset(BN, kl, ql)) = a[kq][2 * h2 + r];
                }
    }
    // dQ(s) = dS(s) K (not transposed), one commit group
    __device__ __forceinline__ void issue_dq(float (&dq)[32], int s) const {
        const uint32_t tdSi = tdS + (s & 1) * BN * BM * 2;
        const uint32_t tA = D == 64 ? tdSi + wg * BN * kPanelRowBytes : tdSi;
        const uint32_t tB = D == 64 ? tK : tK + wg * BN * kPanelRowBytes;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < NS; ++kk)
            wgmma_ss<64, T, 1, 1>(dq, desc_mn_major<kDA>(tA, BN, kk), desc_mn_major<kDA>(tB, BN, kk), kk > 0);
        wg_commit();
    }

    // The dQ tile's flush a step late (flush_dq below), not at the end of its own step: +3-8% at
    // d = 64, level at d = 128 (bench/NOTES.md, 2026-11-26, commit f0052a2).
    // kOrdered: step s's reductions wait for their turn (sm90/tma.cuh DqOrder; thread 0 of the
    // warpgroup, which issues them), and the turn passes on once they have completed: dq_signal,
    // after the next P^T / dS^T (~1000 cycles after the late flush's issue). At the dS^T barrier
    // instead (~1700 cycles), d = 64 ran 5-11% slower, d = 128 the same: the turn's wait chains
    // the CTAs of a head (bench/NOTES.md, 2026-11-26, commit 6b00961).
    __device__ __forceinline__ void dq_turn(int s) const {
        if constexpr (kOrdered)
            if (wt == 0) {
                const int m0 = w.row0(s);
                order.turn(ws.dq_sem, ws.dq_counter(b, f, w.head(s), m0, wg), w.dq_turn(m0));
            }
    }
    __device__ __forceinline__ void dq_signal() const {
        if constexpr (kOrdered)
            if (wt == 0) order.signal(ws.dq_sem);
    }
    // This warpgroup's dQ staging tile of step s, and the wait that frees it for the warpgroup's
    // stores: thread 0 waits until the reduction from the same tile kDqSlots steps ago has read
    // it (with two tiles, step s - 1's reduction, the newest group, may still be reading the
    // other one), then the warpgroup's barrier.
    __device__ __forceinline__ float* dq_tile(int s) const { return sDq + (wg * kSlots + s % kSlots) * Kt::kDqRows * 64; }
    __device__ __forceinline__ void wait_dq_tile_free() const {
        if (wt == 0) bulk_wait_read<kSlots - 1>();
        named_bar_sync(1 + wg, 128);
    }
    // dQ of step s (both warpgroups' halves of dS^T(s) in shared memory): dQ = dS K, then the tile
    // -> shared -> one bulk reduction into the tiled dq_accum (d = 64: warpgroup w takes query rows
    // 64w.. (panel w of dS^T) and all 64 columns, i.e. panel 0 of dq_accum; d = 128: all 64 query
    // rows and columns 64w.. (panel w of K and of dq_accum)). Waits for every product this
    // warpgroup has issued.
    __device__ __forceinline__ void dq_step(int s) const {
        float dq[NQ];
        issue_dq(dq, s);
        wg_wait<0>();
        reg_fence(dq);
        CF_BTRACE(trace, wg, s, 9);
        wait_dq_tile_free();
        stage_dq_tile<NQ / 4>(dq, 0, dq_tile(s), 16 * wq + g, q4);  // flushed by flush_dq(s)
        CF_BTRACE(trace, wg, s, 10);
    }
    // The late flush: step s's staged dQ tile goes out (fence, barrier, bulk reduction) in step s + 1,
    // right after that step's S^T / dP^T are issued, instead of at the end of step s, where both
    // warpgroups did it with the tensor cores idle (bwd_trace.py: ~600 of a ~4600-cycle step).
    __device__ __forceinline__ void flush_dq(int s) const {
        dq_turn(s);
        flush_dq_tile(dq_tile(s), dq_dst(s), 1 + wg, wt);
    }

    // The owner's turn (dQ by turns): all of dQ(it) = dS(it) K from buffer buf of dS^T as one
    // m64 x n128 product into dq, staged into sT0 (flush_turn_tile sends it in its next step).
    // Called with every other product of the warpgroup completed (drain_step).
    __device__ __forceinline__ void dq_turn_product(float (&dq)[2 * NQ], const int& it, const int& buf,
                                                    float* const& sT0) const {
        const uint32_t tdSi = tdS + buf * BN * BM * 2;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < NS; ++kk)  // A = dS (MN-major), B = K (MN-major, 128 columns)
            wgmma_ss<2 * 64, T, 1, 1>(dq, desc_mn_major<kDA>(tdSi, BN, kk), desc_mn_major<kDA>(tK, BN, kk), kk > 0);
        wg_commit();
        wg_wait<0>();
        reg_fence(dq);
        reg_fence(dv);
        reg_fence(dk);
        CF_BTRACE(trace, wg, it, 9);
        if (wt == 0) bulk_wait_read<0>();  // the tile's previous reduction (step it - 2) has read it
        named_bar_sync(1 + wg, 128);
        stage_dq_tile<NQ / 2>(dq, 0, sT0, 16 * wq + g, q4);
        stage_dq_tile<NQ / 2>(dq, 8, sT0 + 64 * 64, 16 * wq + g, q4);
    }
    // dQ by turns: step s's staged dQ tile (sT0: the warpgroup's [2 panels][64][64] tile) -> its
    // two panels of dq_accum
    __device__ __forceinline__ void flush_turn_tile(int s, float* sT0) const {
        fence_async_smem();  // st.shared (generic proxy) -> bulk copy (async proxy)
        named_bar_sync(1 + wg, 128);
        if (wt == 0) {
#pragma unroll
            for (int pnl = 0; pnl < 2; ++pnl)
                bulk_reduce_add_f32(ws.dq_tile_rows(f, si, w.head(s), pnl, w.row0(s)), smem_addr(sT0 + pnl * 64 * 64),
                                    64 * 64 * 4);
            bulk_commit();
        }
    }
};

// ---------------------------------------------------------------- the epilogue
// dK (scaled by the caller) and dV of the CTA's keys out of the consumers' registers (element
// 4j+e: key key_l0 + 8 (e >> 1), column 8j + 2 q4 + (e & 1)): without a GQA split staged in the
// Q / dO ring and written in 16-byte rows (store_staged); with one as f32 partials of the split
// (store_partials), which the last of the key block's nsplit CTAs (last_split, with
// ws.dkv_count) then sums, in the kernel's body. The members are references to the kernel's
// locals, as in BwdMainloop.
template <typename Kt, typename Work>
struct BwdEpilogue {
    using T = typename Kt::Elem;
    static constexpr int D = Kt::kHeadDim, BN = Kt::kBlockN, NCT = Kt::kNConsumerThreads, ND = D / 2;
    static constexpr int C = D / 8;  // chunks per dK / dV row
    // Named barrier of the consumers' dK / dV staging (the producer warpgroup has left by then;
    // without one, the whole CTA's barrier)
    static constexpr int kBarEpi = 4;
    const CfBwdParams& p;
    const BwdWs& ws;
    const Work& w;
    const int &tid, &key_l0, &q4;

    static __device__ __forceinline__ void consumers_sync() {
        if constexpr (Kt::kProducerWG) named_bar_sync(kBarEpi, NCT);
        else __syncthreads();
    }
    __device__ __forceinline__ void store_staged(BwdSharedStorage<Kt>& ss, const float (&dk)[ND], const float (&dv)[ND]) const {
        const SeqInfo& si = w.si;
        const int n0 = w.n0, dch = w.dch;
        consumers_sync();  // all shared reads done: stage dK / dV in the Q / dO buffers
        unsigned char* sOk = reinterpret_cast<unsigned char*>(&ss.q[0][0]);
        unsigned char* sOv = reinterpret_cast<unsigned char*>(&ss.dout[0][0]);
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const uint32_t off = panel_offset(BN, key_l0 + 8 * r, 8 * j + 2 * q4);
                *reinterpret_cast<uint32_t*>(sOk + off) = pack2<T>(dk[4 * j + 2 * r], dk[4 * j + 2 * r + 1]);
                *reinterpret_cast<uint32_t*>(sOv + off) = pack2<T>(dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]);
            }
        consumers_sync();
        T* dkg = si.dk<T>(p, w.hkv_i);
        T* dvg = si.dv<T>(p, w.hkv_i);
        for (int idx = tid; idx < BN * C; idx += NCT) {
            const int r = idx / C, c = idx % C;
            if (n0 + r < si.sk && c < dch) {
                const uint32_t off = panel_offset(BN, r, 8 * c);
                *reinterpret_cast<uint4*>(dkg + (int64_t)(n0 + r) * p.dk_row_stride + c * 8) = *reinterpret_cast<const uint4*>(sOk + off);
                *reinterpret_cast<uint4*>(dvg + (int64_t)(n0 + r) * p.dv_row_stride + c * 8) = *reinterpret_cast<const uint4*>(sOv + off);
            }
        }
    }
    // The last of the nsplit CTAs of this (sequence, KV head, key block) to get here sums
    // every split's partials (the kernel, after last_split), in split order (the same sums, in the same order, as
    // bwd_reduce_dkv_kernel, which then does not run), while they are still in L2.
    // The threadFenceReduction pattern: each thread's partials are visible on the device
    // before the CTA's count, and the last CTA reads the others' after seeing it, past L1.
    __device__ __forceinline__ bool last_split() const {
        const CfFwdParams& f = p.fwd;
        __threadfence();
        consumers_sync();
        bool last = false;
        if (tid == 0) {
            const int64_t c = ((int64_t)w.b * f.hkv + w.hkv_i) * gridDim.x + w.n0 / BN;
            last = atomicAdd(ws.dkv_count + c, 1) == ws.nsplit - 1;
        }
        if constexpr (Kt::kProducerWG) last = named_bar_any(kBarEpi, NCT, last);
        else last = __syncthreads_or(last);
        return last;
    }
    // rs: the partials' row stride
    __device__ __forceinline__ void store_partials(const float (&dk)[ND], const float (&dv)[ND], int64_t rs) const {
        const CfFwdParams& f = p.fwd;
        const SeqInfo& si = w.si;
        const int n0 = w.n0;
        float* wk = ws.dk_part_rows(f, si, w.split, w.hkv_i) + n0 * rs;
        float* wv = wk + ws.dkv_v_offset(f);
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int rl = key_l0 + 8 * r, col = 8 * j + 2 * q4;
                if (n0 + rl < si.sk && col < f.d) {
                    *reinterpret_cast<float2*>(wk + rl * rs + col) = make_float2(dk[4 * j + 2 * r], dk[4 * j + 2 * r + 1]);
                    *reinterpret_cast<float2*>(wv + rl * rs + col) = make_float2(dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]);
                }
            }
    }
};
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// kOrdered: deterministic mode (ws.dq_sem set): the dQ reductions in key-block order (DqOrder),
// the query blocks last first (DkdvWork kReverse). A template parameter, so that the default
// kernel carries none of it (a run-time switch cost d = 64 ~2%).
template <typename Kt, bool kOrdered = false>
__global__ void __launch_bounds__(Kt::kNThreads, 1)
    bwd_dkdv_sm90_kernel(const __grid_constant__ CfBwdParams p, const BwdWs ws, const __grid_constant__ BwdTmaMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using T = typename Kt::Elem;
    constexpr int D = Kt::kHeadDim, BM = Kt::kBlockM, BN = Kt::kBlockN, NCT = Kt::kNConsumerThreads;
    // DP: the tiles' columns in shared memory (whole panels; d = 96 keeps 128, zeros past d); the
    // products read D of them (dQ = dS K reads all DP: its second 64-column half at d = 96 adds
    // zeros into dq_accum's second panel, which has room for them)
    constexpr int DP = Kt::kHeadDimPad;
    constexpr int MS = BM / 16;  // k16 steps of dV / dK (query rows)
    constexpr int NA = BM / 2;   // accumulators of an m64 x BM product
    constexpr int ND = D / 2;    // accumulators of an m64 x D product
    constexpr int NQ = 32;       // accumulators of the m64 x n64 dQ slice

    using Storage = BwdSharedStorage<Kt>;
    static_assert(Storage::aligned(), "swizzled tiles at 1024-byte offsets");
    Storage& ss = bwd_shared_storage<Storage>();
    T* sK = ss.k;
    T* sV = ss.v;
    constexpr int NST = Kt::kStages;
    T* sQ = &ss.q[0][0];
    T* sdO = &ss.dout[0][0];
    T* sdS = &ss.ds[0][0];
    float* sL = &ss.lse[0][0];
    float* sD = &ss.dsum[0][0];
    float* sDq = &ss.dq[0][0][0];
    uint64_t* bars = &ss.bars[0][0];

    const CfFwdParams& f = p.fwd;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wq = warp & 3;  // warpgroup, warp within it
    const int g = lane >> 2, q4 = lane & 3;
    // CTAs key block slowest under causal-like masks (plan.cuh heavy_first_order: measured there)
    using Work = DkdvWork<T, BN, BM, true, false, kOrdered, true, Kt::kBlockMasks>;  // StepDivider
    const Work w(p, ws);
    if (w.empty()) return;
    const SeqInfo& si = w.si;
    const MaskInfo& mk = w.mk;
    const int b = w.b, hkv_i = w.hkv_i, split = w.split, n0 = w.n0, dch = w.dch, total_it = w.total_it;
    // Named barriers (file comment): 1 + wg one warpgroup's dQ staging; kBarDs dS^T published;
    // BwdEpilogue::kBarEpi the consumers' dK / dV staging.
    constexpr int kBarDs = 3;
    const Pipeline<NST> pipe(smem_addr(bars));
    // dQ by turns (config.cuh BwdSm90Traits::kDqTurns); the ordered kernel keeps the column split
    constexpr bool kDqTurns = Kt::kDqTurns && !kOrdered;
    const BwdProducer<BM, DP, Kt::kProducerWG, T, Work, Pipeline<NST>> producer{p, ws, maps, w, pipe,
                                                                              sQ, sdO, sL, sD, lane};
    bwd_start<NCT, DP, Kt::kProducerWG>(f, w, pipe, sK, sV, producer, tid);
    if constexpr (Kt::kProducerWG) {
        if (tid >= NCT) {
            // The producer warpgroup: its first warp loads steps 1.. as their stages free up.
            setmaxnreg_dec<Kt::kProducerRegs>();
            if (tid < NCT + 32)
                for (int it = 1; it < total_it; ++it) producer.load_step(it);
            cp_async_wait<0>();
            return;
        }
        setmaxnreg_inc<Kt::kConsumerRegs>();
        if (warp == 0 && total_it > 0) producer.load_rows(0);
    }
    float dk[ND], dv[ND];
#pragma unroll
    for (int i = 0; i < ND; ++i) dk[i] = dv[i] = 0.f;

    const uint32_t tK = smem_addr(sK), tV = smem_addr(sV), tdS = smem_addr(sdS);
    const uint32_t tKw = tK + 64 * wg * kPanelRowBytes;  // this warpgroup's 64 keys (K-major A)
    const uint32_t tVw = tV + 64 * wg * kPanelRowBytes;
    const int key_l0 = 64 * wg + 16 * wq + g;  // local key of accumulator rows (e < 2); +8 for e >= 2
    const int wt = tid & 127;  // thread within the warpgroup
#ifdef CF_BWD_TRACE
    const bool trace = blockIdx.x == 1 && blockIdx.y == 0 && blockIdx.z == 0;
#else
    constexpr bool trace = false;
#endif
    [[maybe_unused]] DqOrder order;
    const BwdMainloop<Kt, kOrdered, Work> ml{p,  ws,  w,  f,   si,  mk,     sdS, sL, sD, sDq,   b,    n0, wg,
                                             wq, g,   q4, tK, tdS, tKw, tVw, key_l0, wt, dk, dv, order, trace};

    if constexpr (kDqTurns) {
        // ---- dQ by turns (config.cuh BwdSm90Traits::kDqTurns). The warpgroups take turns at dQ: step s's
        // owner, warpgroup s & 1, computes all of dQ(s) = dS(s) K as m64 x n128 x k128 (8 wgmma
        // instead of 2 x 8 of n64: each k16 step reads dS's 2 KB once for all 128 columns, so a
        // step's operand reads from shared memory fall from 256 to 240 KB; ncu counts the d = 128
        // step bound by shared-memory wavefronts, bench/NOTES.md, 2026-11-27, commit df99929), stages
        // it into its own 64 x 128 tile and flushes that in its next step (the late flush); the
        // other warpgroup goes on to its next step. Both still meet at the dS^T barrier of each
        // step, as in the lockstep schedule below (only the owner waiting, on a bar.arrive of the
        // other, measured the same). Each warpgroup passes its own barrier 1 + wg equally often
        // (below): with unequal counts racecheck reported hazards in the epilogue, across the two
        // barriers of all 256 consumer threads there.
        const bool atomic = ws.dq_accum != nullptr;
        float* sT0 = sDq + wg * 2 * 64 * 64;  // this warpgroup's [2 panels][64][64] dQ tile
        for (int it = 0; it < total_it; ++it) {
            const int hq = w.head(it), m0 = w.row0(it);
            const StepKind kind = w.step_kind(it);  // through a block mask: the rule too
            const int st = pipe.stage(it);
            const bool owner = (it & 1) == wg;
            CF_BTRACE(trace, wg, it, 0);
            if (warp == 0 && it + 1 < total_it) producer.load_rows(it + 1);
            pipe.consumer_wait(it);
            CF_BTRACE(trace, wg, it, 1);
            const uint32_t tQ = smem_addr(sQ + st * BM * DP), tdO = smem_addr(sdO + st * BM * DP);
            const LogitInfo li(f, b, hq);
            float sT[NA], dpT[NA];
            ml.issue_s_dp(sT, dpT, tQ, tdO);
            if (atomic && !owner) {
                if (it > 0) ml.flush_turn_tile(it - 1, sT0);  // the tile this warpgroup staged in its turn
                else named_bar_sync(1 + wg, 128);  // (see the end of the loop)
            }
            CF_BTRACE(trace, wg, it, 2);
            uint32_t pa[MS][4], dsa[MS][4];
            ml.p_ds(sT, dpT, li, it, m0, st, kind);
            ml.issue_dv(pa, sT, tdO);
            ml.issue_dk(dsa, dpT, tQ);
            CF_BTRACE(trace, wg, it, 6);
            if (atomic) {
                const int buf = it & 1;
                ml.store_ds(dsa, buf);  // (overlaps the dV / dK products)
                fence_async_smem();  // st.shared (generic proxy) -> wgmma (async proxy)
                CF_BTRACE(trace, wg, it, 7);
                named_bar_sync(kBarDs, 256);  // both halves of dS^T(it) in place
                if (!owner) {
                    ml.drain_step(pa, dsa);
                    CF_BTRACE(trace, wg, it, 8);
                    CF_BTRACE(trace, wg, it, 9);
                } else {
                    // dV / dK done first: with P^T / dS^T's fragments still pinned beside dQ's 64
                    // accumulators, ptxas serialised every wgmma of the kernel (C7512)
                    ml.drain_step(pa, dsa);
                    CF_BTRACE(trace, wg, it, 8);
                    // The owner's turn (dQ's accumulators are the kernel's: declared in the part,
                    // the same instructions came out in another order)
                    float dq[2 * NQ];
                    ml.dq_turn_product(dq, it, buf, sT0);
                }
            } else {
                ml.drain_step(pa, dsa);
                named_bar_sync(kBarDs, 256);  // (as in the lockstep schedule: racecheck-visible order)
            }
            CF_BTRACE(trace, wg, it, 10);
            pipe.consumer_release(it, lane);  // this warp is done with the stage's Q / dO
            CF_BTRACE(trace, wg, it, 11);
        }
        // the last turn's tile (the other warpgroup's last one went out in the last step); the
        // other warpgroup passes its barrier once more here, as warpgroup 1 did in step 0
        if (atomic && total_it > 0) {
            if (((total_it - 1) & 1) == wg) ml.flush_turn_tile(total_it - 1, sT0);
            else named_bar_sync(1 + wg, 128);
        }
    } else {
    for (int it = 0; it < total_it; ++it) {
        const int hq = w.head(it), m0 = w.row0(it);
        const StepKind kind = w.step_kind(it);  // through a block mask: the rule too
        const int st = pipe.stage(it);
        CF_BTRACE(trace, wg, it, 0);
        if (warp == 0 && it + 1 < total_it) {
            if constexpr (Kt::kProducerWG) producer.load_rows(it + 1);
            else producer.load_step(it + 1);  // waits until step it - 1 released its stage
        }
        pipe.consumer_wait(it);  // this step's tiles landed (and the fence for the cp.async part)
        CF_BTRACE(trace, wg, it, 1);
        const uint32_t tQ = smem_addr(sQ + st * BM * DP), tdO = smem_addr(sdO + st * BM * DP);
        const LogitInfo li(f, b, hq);

        // ---- S^T = K Q^T, dP^T = V dO^T
        float sT[NA], dpT[NA];
        ml.issue_s_dp(sT, dpT, tQ, tdO);
        if (ws.dq_accum != nullptr && it > 0) ml.flush_dq(it - 1);
        CF_BTRACE(trace, wg, it, 2);

        // ---- P^T, dS^T, then dV += P^T dO, dK += dS^T Q (A from registers; B = dO / Q [queries][d], MN-major)
        uint32_t pa[MS][4], dsa[MS][4];
        ml.p_ds(sT, dpT, li, it, m0, st, kind);
        ml.issue_dv(pa, sT, tdO);
        ml.dq_signal();  // the reduction issued early in this step (late flush), ~1000 cycles ago
        ml.issue_dk(dsa, dpT, tQ);
        CF_BTRACE(trace, wg, it, 6);

        if (ws.dq_accum != nullptr) {
            // ---- dS^T -> shared (overlaps the dV / dK products), then dQ = dS K
            const int buf = it & 1;
            ml.store_ds(dsa, buf);
            fence_async_smem();
            CF_BTRACE(trace, wg, it, 7);
            ml.dq_signal();  // (without the late flush: the reduction of the last step)
            named_bar_sync(kBarDs, 256);  // both warpgroups' dS (dS^T) rows are in place
            CF_BTRACE(trace, wg, it, 8);
            ml.dq_step(it);
            reg_fence(dv);
            reg_fence(dk);
            reg_fence(pa);
            reg_fence(dsa);
            pipe.consumer_release(it, lane);  // this warp is done with the stage's Q / dO
            CF_BTRACE(trace, wg, it, 11);
        } else {
            ml.drain_step(pa, dsa);
            // The ring's empty barrier alone orders these reads of lse / dsum before warp 0's next
            // cp.async into the stage, but racecheck does not follow mbarriers; the atomic mode
            // has the dS^T barrier here, and this keeps the deterministic mode provably clean.
            named_bar_sync(kBarDs, 256);
            pipe.consumer_release(it, lane);
        }
    }

    if (ws.dq_accum != nullptr && total_it > 0) ml.flush_dq(total_it - 1);
    }  // lockstep schedule
    ml.dq_signal();
    if (ws.dq_accum != nullptr && wt == 0) bulk_wait<0>();  // the last reduction is done with shared memory

    // ---- write dK (scaled) and dV. Element 4j+e: key key_l0 + 8 (e >> 1), column 8j + 2 q4 + (e & 1).
    const float scale = f.softmax_scale;
#pragma unroll
    for (int i = 0; i < ND; ++i) dk[i] *= scale;

    cp_async_wait<0>();
    using Epilogue = BwdEpilogue<Kt, Work>;
    const Epilogue epi{p, ws, w, tid, key_l0, q4};
    if (ws.nsplit == 1) {
        epi.store_staged(ss, dk, dv);
    } else {
        const int64_t rs = (int64_t)f.hkv * f.d;
        epi.store_partials(dk, dv, rs);
        if (ws.dkv_count != nullptr) {
            // The sums stay in the kernel's body: in a part of BwdEpilogue, their registers came
            // out in another order.
            if (epi.last_split()) {
                __threadfence();
                const int rows = min(BN, si.sk - n0), c4 = f.d / 4;
                const int64_t split_stride = ws.total_k * rs, voff = ws.dkv_v_offset(f);
                const float* pk = ws.dk_part_rows(f, si, 0, hkv_i) + n0 * rs;
                T* dkg = si.dk<T>(p, hkv_i) + (int64_t)n0 * p.dk_row_stride;
                T* dvg = si.dv<T>(p, hkv_i) + (int64_t)n0 * p.dv_row_stride;
                for (int idx = tid; idx < rows * c4; idx += NCT) {
                    const int r = idx / c4, c = 4 * (idx % c4);
                    const float* src = pk + r * rs + c;
                    float4 sk4 = make_float4(0.f, 0.f, 0.f, 0.f), sv4 = sk4;
                    for (int s = 0; s < ws.nsplit; ++s) {
                        const float4 ak = __ldcg(reinterpret_cast<const float4*>(src + s * split_stride));
                        const float4 av = __ldcg(reinterpret_cast<const float4*>(src + s * split_stride + voff));
                        sk4.x += ak.x, sk4.y += ak.y, sk4.z += ak.z, sk4.w += ak.w;
                        sv4.x += av.x, sv4.y += av.y, sv4.z += av.z, sv4.w += av.w;
                    }
                    *reinterpret_cast<uint2*>(dkg + (int64_t)r * p.dk_row_stride + c) =
                        make_uint2(pack2<T>(sk4.x, sk4.y), pack2<T>(sk4.z, sk4.w));
                    *reinterpret_cast<uint2*>(dvg + (int64_t)r * p.dv_row_stride + c) =
                        make_uint2(pack2<T>(sv4.x, sv4.y), pack2<T>(sv4.z, sv4.w));
                }
            }
        }
    }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace cf
