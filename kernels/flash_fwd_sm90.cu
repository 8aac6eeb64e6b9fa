// Forward pass for Hopper (sm_90a): warpgroup MMA (wgmma) version of fwd_tc_kernel, same
// semantics (flash_api.h): varlen, causal / sliding window with bottom-right alignment,
// softcap, ALiBi, GQA, arbitrary 16-byte aligned strides; o = 0 and lse = -inf for rows that see
// no key. Dispatched from run_fwd_tc for head-dim tiles 64 / 128 when sm90a_available().
//
// Warp-specialised CTA (FwdSm90Traits): kNWarpGroups consumer warpgroups x 64 query rows, plus
// one producer warpgroup that only issues cp.async loads (Q, then K / V key blocks into a ring
// of kStages stages). Stages are handed over with mbarriers: full (producer -> consumers, one
// cp.async-tracking arrival per producer thread) and empty (consumers -> producer, one arrival
// per consumer warp), K and V separately so a K stage is refilled as soon as S has read it.
// No CTA-wide barrier inside the key loop: the producer runs ahead by up to kStages blocks.
// Persistent configurations (kPersistent) launch one wave of CTAs that loop over tiles; the
// producer then runs ahead into the next tile (Q has its own full / empty pair).
// Per key block (from the last visible one down), each consumer warpgroup:
//   S = Q K^T        wgmma_ss, Q and K K-major panel tiles in shared memory
//   mask (boundary blocks only) + online softmax in registers (log2 units, scale folded in)
//   O += P V         wgmma_rs, P from registers (accumulator -> A fragment), V MN-major
// Intra-warpgroup overlap (as in FlashAttention-3): S(j) = Q K(j)^T and O += P(j-1) V(j-1) are
// issued back to back, then the softmax of block j runs while the tensor cores finish P V; O is
// rescaled by block j's correction only after P(j-1) V(j-1) has completed.
// Ping-pong (kPingPong): the consumer warpgroups issue their GEMMs in turn (named barrier per
// warpgroup), so while one runs its softmax the tensor cores work for another.
// The kernel body exists only in sm_90a code (wgmma); the same file also builds for sm_80 / PTX.
#include <algorithm>
#include <cstdint>
#include "kernel_traits.cuh"
#include "launch.cuh"
#include "wgmma.cuh"

namespace cf {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Online softmax step on one m64nBN accumulator (this thread: rows g and g+8 of its warp, NT n8
// tiles, register 4t+e = element e of tile t). s holds x (logits in the units c maps to log2
// units), masked = -inf. On return s holds P = 2^(x*c - m*c) (unnormalized), rmax / rsum are
// updated and corr[r] is the factor the output rows must be scaled by (applied by the caller
// once the previous P V has completed).
template <int NT>
__device__ __forceinline__ void sm90_softmax(float (&s)[NT * 4], float (&rmax)[2], float (&rsum)[2],
                                             float (&corr)[2], float c) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        // 4 independent max / sum chains (the reductions are latency bound otherwise)
        float mx4[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
        for (int t = 0; t < NT; ++t)
            mx4[t & 3] = fmaxf(mx4[t & 3], fmaxf(s[4 * t + 2 * r], s[4 * t + 2 * r + 1]));
        const float mx = quad_max(fmaxf(fmaxf(mx4[0], mx4[1]), fmaxf(mx4[2], mx4[3])));
        const float m_new = fmaxf(rmax[r], mx);
        const float ms = (m_new == -INFINITY) ? 0.f : m_new * c;  // all masked so far: 2^-inf = 0
        corr[r] = ex2(rmax[r] * c - ms);
        rmax[r] = m_new;
        float sum4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int t = 0; t < NT; ++t) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float pv = ex2(fmaf(s[4 * t + 2 * r + e], c, -ms));
                s[4 * t + 2 * r + e] = pv;
                sum4[t & 3] += pv;
            }
        }
        const float sum = (sum4[0] + sum4[1]) + (sum4[2] + sum4[3]);
        rsum[r] = rsum[r] * corr[r] + sum;
    }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <typename Kt>
__global__ void __launch_bounds__(Kt::kNThreads, Kt::kMinBlocks) fwd_sm90_kernel(const CfFwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using T = typename Kt::Elem;
    constexpr int D = Kt::kHeadDim, BM = Kt::kBlockM, BN = Kt::kBlockN;
    constexpr int NWG = Kt::kNWarpGroups, NCT = Kt::kNConsumerThreads, NPT = 128;  // NPT: producer threads
    constexpr int S = Kt::kStages;
    constexpr int C = D / 8;      // 16-byte chunks per row
    constexpr int NT = BN / 8;    // n8 tiles of S
    constexpr int DT = D / 8;     // n8 tiles of O
    constexpr int KS = D / 16;    // k16 steps of Q K^T
    constexpr int PS = BN / 16;   // k16 steps of P V
    constexpr uint32_t kStage = Kt::kKVStageBytes;

    // wgmma's 128-byte swizzle is anchored at 1024-byte boundaries: align the tiles by hand
    // (the dynamic shared memory base alignment is not guaranteed; 1 KB of slack is allocated).
    extern __shared__ unsigned char smem_raw[];
    const uint32_t raw = smem_addr(smem_raw);
    unsigned char* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
    T* sQ = reinterpret_cast<T*>(smem);
    T* sO = Kt::kSeparateO ? sQ + BM * D : sQ;  // output staging
    T* sK = sQ + (Kt::kSeparateO ? 2 : 1) * BM * D;  // [S][BN][D]
    T* sV = sK + S * BN * D;                         // [S][BN][D]
    const uint32_t aQ = smem_addr(sQ), aK = smem_addr(sK), aV = smem_addr(sV);
    // mbarriers (8 bytes each): Q full, Q empty, K full[S], V full[S], K empty[S], V empty[S]
    const uint32_t bar_q_full = smem_addr(sV + S * BN * D), bar_q_empty = bar_q_full + 8;
    const uint32_t bar_k_full = bar_q_full + 16, bar_v_full = bar_k_full + 8 * S;
    const uint32_t bar_k_empty = bar_v_full + 8 * S, bar_v_empty = bar_k_empty + 8 * S;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2;  // consumer warpgroup wg < NWG: query rows 64*wg ..; NWG: producer
    const int g = lane >> 2, q4 = lane & 3;
    const int dch = p.d >> 3;
    // Tiles (query block, head, batch), query block fastest (the CTAs running at the same time
    // share K / V in L2). Non-persistent launch (gridDim.x == ntiles): one tile per CTA.
    // Persistent launch (gridDim.x < ntiles; the producer loads the next tile's Q / K / V while
    // the consumers finish the current one): the CTAs take units of two tiles round-robin, a
    // unit pairing the i-th heaviest and the i-th lightest query block of a head, so that every
    // unit costs about the same under causal masks and the static schedule stays balanced.
    const int num_m = (p.seqlen_q + BM - 1) / BM;
    const int ntiles = num_m * p.h * p.b;
    const int pair = gridDim.x < ntiles ? 1 : 0;  // log2(tiles per unit)
    const int nunits = (ntiles + pair) >> pair;
    const int niters = ((nunits + gridDim.x - 1) / gridDim.x) << pair;
    auto tile_of = [&](int it) { return ((((it >> pair) * gridDim.x + blockIdx.x)) << pair) + (it & pair); };
    // Causal-like masks: the last query blocks do the most work, so start them first.
    const bool heavy_last = p.window_right >= 0 && p.window_left < 0;

    if (tid == 0) {
        mbar_init(bar_q_full, NPT);   // one cp.async-tracking arrival per producer thread
        mbar_init(bar_q_empty, 4 * NWG);  // one arrival per consumer warp
        for (int i = 0; i < S; ++i) {
            mbar_init(bar_k_full + 8 * i, NPT);
            mbar_init(bar_v_full + 8 * i, NPT);
            mbar_init(bar_k_empty + 8 * i, 4 * NWG);
            mbar_init(bar_v_empty + 8 * i, 4 * NWG);
        }
    }
    __syncthreads();  // barrier initialisation visible to every thread (the only CTA-wide barrier)

    // Both roles walk the same tiles and skip the same ones (no row, or no visible key), so the
    // barrier phases stay in step: ring slot of the CTA's kv-th key block = kv % S, phase
    // (kv / S) & 1; Q phase = (number of tiles computed so far) & 1.
    struct Tile {
        SeqInfo si;
        MaskInfo mk;
        int b, h, m0, m_last, nb_hi, nblocks;  // key blocks nb_hi - 1 - j for j = 0 .. nblocks - 1
        __device__ __forceinline__ Tile(const CfFwdParams& p, int b_)
            : si(p, b_), mk(si.sq, si.sk, p.window_left, p.window_right), b(b_) {}
    };
    // Tile number -> sequence, head, query block and key blocks (one decoding for both roles).
    auto tile_at = [&](int tile) {
        const int r = tile % num_m, hb = tile / num_m;
        const int mi = !pair ? r : (r & 1) ? num_m - 1 - (r >> 1) : (r >> 1);  // 0: heaviest
        Tile t(p, hb / p.h);
        t.h = hb % p.h;
        t.m0 = (heavy_last ? num_m - 1 - mi : mi) * BM;
        t.m_last = min(t.m0 + BM, t.si.sq) - 1;
        int n_lo, n_hi;
        t.mk.key_range(t.m0, t.m_last, n_lo, n_hi);
        t.nb_hi = (n_hi + BN - 1) / BN;
        t.nblocks = n_hi > n_lo ? t.nb_hi - n_lo / BN : 0;
        return t;
    };

    if (wg == NWG) {
        // ---------------- producer warpgroup: loads only, few registers
        setmaxnreg_dec<Kt::kProducerRegs>();
        const int ptid = tid - NCT;
        uint32_t kv = 0, tcount = 0;
        for (int it = 0; it < niters; ++it) {
            const int tile = tile_of(it);
            if (tile >= ntiles) continue;
            const Tile t = tile_at(tile);
            const SeqInfo& si = t.si;
            const int b = t.b;
            if (t.m0 >= si.sq || t.nblocks == 0) continue;
            const int hk = t.h / (p.h / p.hkv);
            const T* qg = static_cast<const T*>(p.q) + si.q_off(b, p.q_batch_stride, p.q_row_stride) + (int64_t)t.h * p.q_head_stride;
            const T* kg = static_cast<const T*>(p.k) + si.k_off(b, p.k_batch_stride, p.k_row_stride) + (int64_t)hk * p.k_head_stride;
            const T* vg = static_cast<const T*>(p.v) + si.k_off(b, p.v_batch_stride, p.v_row_stride) + (int64_t)hk * p.v_head_stride;
            auto load_k = [&](int j) {
                const uint32_t i = kv + j, st = i % S, nb = t.nb_hi - 1 - j;
                mbar_wait(bar_k_empty + 8 * st, ((i / S) & 1) ^ 1);
                load_panels<BN, C, NPT>(sK + st * BN * D, kg + (int64_t)nb * BN * p.k_row_stride, p.k_row_stride,
                                        si.sk - nb * BN, dch, ptid, p.k);
                mbar_arrive_cp_async(bar_k_full + 8 * st);
            };
            auto load_v = [&](int j) {
                const uint32_t i = kv + j, st = i % S, nb = t.nb_hi - 1 - j;
                mbar_wait(bar_v_empty + 8 * st, ((i / S) & 1) ^ 1);
                load_panels<BN, C, NPT>(sV + st * BN * D, vg + (int64_t)nb * BN * p.v_row_stride, p.v_row_stride,
                                        si.sk - nb * BN, dch, ptid, p.v);
                mbar_arrive_cp_async(bar_v_full + 8 * st);
            };
            // K(0) first: its stage may be free before the consumers release Q.
            load_k(0);
            mbar_wait(bar_q_empty, (tcount & 1) ^ 1);
            load_panels<BM, C, NPT>(sQ, qg + (int64_t)t.m0 * p.q_row_stride, p.q_row_stride, si.sq - t.m0, dch, ptid, p.q);
            mbar_arrive_cp_async(bar_q_full);
            // Then K(j), V(j-1): the order the consumers need them in (S(j) is issued before P V(j-1)).
            for (int j = 1; j < t.nblocks; ++j) {
                load_k(j);
                load_v(j - 1);
            }
            load_v(t.nblocks - 1);
            kv += t.nblocks;
            ++tcount;
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives its issuing thread
        return;
    }

    // ---------------- consumer warpgroups
    setmaxnreg_inc<Kt::kConsumerRegs>();
    const uint32_t aQwg = aQ + wg * 64 * kPanelRowBytes;  // this warpgroup's 64 rows of Q
    const int rl0 = 64 * wg + 16 * (warp & 3);            // this warp's first row in the block

    // Ping-pong turn: warpgroup wg waits on named barrier 1 + wg, which the previous warpgroup
    // (cyclically) arrives at once it has issued its GEMMs; the last warpgroup starts the
    // rotation of each tile. Every wait is matched by exactly one arrival (the last warpgroup
    // skips its final one of the tile), so no barrier is left half-complete.
    auto turn_wait = [&]() {
        if constexpr (Kt::kPingPong) named_bar_sync(1 + wg, 256);
    };
    auto turn_pass = [&](bool last_block) {
        if constexpr (Kt::kPingPong)
            if (!(last_block && wg == NWG - 1)) named_bar_arrive(1 + (wg + 1) % NWG, 256);
    };
    // Consumer side of the ring: wait for a stage (its cp.async writes then made visible to the
    // async proxy, which wgmma reads through) and hand it back (one arrival per warp, after the
    // wgmma reading it completed; wgmma.wait_group is warp-synchronous).
    auto wait_full = [&](uint32_t bar, uint32_t i) {
        mbar_wait(bar + 8 * (i % S), (i / S) & 1);
        fence_async_smem();
    };
    auto release = [&](uint32_t bar, uint32_t i) {
        if (lane == 0) mbar_arrive(bar + 8 * (i % S));
    };

    uint32_t kv = 0, tcount = 0;
    for (int it = 0; it < niters; ++it) {
        const int tile = tile_of(it);
        if (tile >= ntiles) continue;
        const Tile t = tile_at(tile);
        const SeqInfo& si = t.si;
        const MaskInfo& mk = t.mk;
        if (t.m0 >= si.sq) continue;
        const int b = t.b, h = t.h, m0 = t.m0, nb_hi = t.nb_hi, nblocks = t.nblocks;
        T* og = static_cast<T*>(p.o) + si.q_off(b, p.o_batch_stride, p.o_row_stride) + (int64_t)h * p.o_head_stride;
        float* lseg = p.lse + (int64_t)b * p.lse_batch_stride + (int64_t)h * p.lse_head_stride + (si.q_varlen ? si.q_row0 : 0);
        if (nblocks == 0) {  // no query row of the block sees a key
            for (int idx = tid; idx < BM * C; idx += NCT) {
                const int r = idx / C, c = idx % C;
                if (m0 + r <= t.m_last && c < dch)
                    *reinterpret_cast<uint4*>(og + (int64_t)(m0 + r) * p.o_row_stride + c * 8) = make_uint4(0, 0, 0, 0);
            }
            for (int r = tid; r < BM; r += NCT)
                if (m0 + r <= t.m_last) lseg[m0 + r] = -INFINITY;
            continue;
        }
        const LogitInfo li(p, b, h);
        const float cmul = li.general ? kLog2e : li.c;  // general path: s holds natural logits

        float o[D / 2];
#pragma unroll
        for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
        float rmax[2] = {-INFINITY, -INFINITY}, rsum[2] = {0.f, 0.f};
        uint32_t pa[PS][4];                                // P of the previous block (A fragments)
        const int wrow0 = m0 + rl0;                        // this warp's first query row

        auto issue_s = [&](float (&s)[BN / 2], int st) {
#pragma unroll
            for (int ks = 0; ks < KS; ++ks)
                wgmma_ss<BN, T, 0, 0>(s, desc_k_major(aQwg, BM, ks), desc_k_major(aK + st * kStage, BN, ks), ks > 0);
            wg_commit();
        };
        auto issue_pv = [&](int st) {
#pragma unroll
            for (int ks = 0; ks < PS; ++ks) wgmma_rs<D, T, 1>(o, pa[ks], desc_mn_major(aV + st * kStage, BN, ks), 1);
            wg_commit();
        };
        // Logit transform (softcap / ALiBi) and masking; skipped for blocks this warp sees whole.
        // Plain logits (causal / window / key-length masks): per row the visible keys are one
        // interval, so each element costs two compares against a compile-time column offset.
        auto mask = [&](float (&s)[BN / 2], int n0) {
            const bool full = mk.block_full(wrow0, 16, n0, BN);
            if (li.general) {
#pragma unroll
                for (int t = 0; t < NT; ++t)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int i = wrow0 + g + 8 * (e >> 1);
                        const int j = n0 + t * 8 + 2 * q4 + (e & 1);
                        float df;
                        const float x = li.logit(s[4 * t + e], i, j, mk.off, &df);
                        s[4 * t + e] = (full || mk.visible(i, j)) ? x : -INFINITY;
                    }
            } else if (!full) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    int lo, hi;
                    mk.row_limits(wrow0 + g + 8 * r, lo, hi);
                    lo -= n0 + 2 * q4;  // column of element (t, e) relative to this lane: 8t + e
                    hi -= n0 + 2 * q4;
#pragma unroll
                    for (int t = 0; t < NT; ++t)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int c = 8 * t + e;
                            if (c < lo || c > hi) s[4 * t + 2 * r + e] = -INFINITY;
                        }
                }
            }
        };
        auto to_p = [&](const float (&s)[BN / 2]) {
#pragma unroll
            for (int ks = 0; ks < PS; ++ks) {
                pa[ks][0] = pack2<T>(s[8 * ks + 0], s[8 * ks + 1]);
                pa[ks][1] = pack2<T>(s[8 * ks + 2], s[8 * ks + 3]);
                pa[ks][2] = pack2<T>(s[8 * ks + 4], s[8 * ks + 5]);
                pa[ks][3] = pack2<T>(s[8 * ks + 6], s[8 * ks + 7]);
            }
        };

        if constexpr (Kt::kPingPong)
            if (wg == NWG - 1) named_bar_arrive(1, 256);
        mbar_wait(bar_q_full, tcount & 1);
        // Block 0: S only (nothing to multiply with V yet).
        {
            wait_full(bar_k_full, kv);
            float s[BN / 2];
            turn_wait();
            wg_fence();
            issue_s(s, kv % S);
            turn_pass(nblocks == 1);
            wg_wait<0>();
            reg_fence(s);
            release(bar_k_empty, kv);
            mask(s, (nb_hi - 1) * BN);
            float corr[2];
            sm90_softmax<NT>(s, rmax, rsum, corr, cmul);  // corr = 0 or 1 on o = 0: nothing to rescale
            to_p(s);
        }
        for (int j = 1; j < nblocks; ++j) {
            const int nb = nb_hi - 1 - j;
            float s[BN / 2];
            wait_full(bar_k_full, kv + j);
            wait_full(bar_v_full, kv + j - 1);  // loaded right after K(j): S and P V stay back to back
            turn_wait();
            wg_fence();
            issue_s(s, (kv + j) % S);
            issue_pv((kv + j - 1) % S);
            turn_pass(j == nblocks - 1);
            wg_wait<1>();  // S(j) done, P(j-1) V(j-1) may still run
            reg_fence(s);
            release(bar_k_empty, kv + j);
            mask(s, nb * BN);
            float corr[2];
            sm90_softmax<NT>(s, rmax, rsum, corr, cmul);
            wg_wait<0>();  // P(j-1) V(j-1) done: o and pa are free
            reg_fence(o);
#pragma unroll
            for (int ks = 0; ks < PS; ++ks) reg_fence(pa[ks]);
            release(bar_v_empty, kv + j - 1);
#pragma unroll
            for (int t = 0; t < DT; ++t) {
                o[4 * t + 0] *= corr[0];
                o[4 * t + 1] *= corr[0];
                o[4 * t + 2] *= corr[1];
                o[4 * t + 3] *= corr[1];
            }
            to_p(s);
        }
        const uint32_t kv_last = kv + nblocks - 1;
        wait_full(bar_v_full, kv_last);
        wg_fence();
        issue_pv(kv_last % S);
        wg_wait<0>();
        reg_fence(o);
        release(bar_v_empty, kv_last);
        if constexpr (Kt::kSeparateO) release(bar_q_empty, 0);  // Q read for the last time
        kv += nblocks;
        ++tcount;

        // Normalize, write lse, stage O (as T) in this warp's own 16 rows of sO (with sO = sQ:
        // only this warp's wgmma read those rows, and they have completed), store 16 bytes per
        // lane.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float l = quad_sum(rsum[r]);
            const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
            for (int t = 0; t < DT; ++t) {
                o[4 * t + 2 * r] *= inv;
                o[4 * t + 2 * r + 1] *= inv;
            }
            const int row = wrow0 + g + 8 * r;
            if (q4 == 0 && row < si.sq) lseg[row] = l > 0.f ? rmax[r] * cmul * kLn2 + logf(l) : -INFINITY;
        }
        unsigned char* sOb = reinterpret_cast<unsigned char*>(sO);
#pragma unroll
        for (int t = 0; t < DT; ++t)
#pragma unroll
            for (int r = 0; r < 2; ++r)
                *reinterpret_cast<uint32_t*>(sOb + panel_offset(BM, rl0 + g + 8 * r, 8 * t + 2 * q4)) =
                    pack2<T>(o[4 * t + 2 * r], o[4 * t + 2 * r + 1]);
        __syncwarp();
#pragma unroll
        for (int it = 0; it < (16 * C) / 32; ++it) {
            const int idx = lane + it * 32;
            const int rl = rl0 + idx / C, c = idx % C;
            const int row = m0 + rl;
            if (row < si.sq && c < dch)
                *reinterpret_cast<uint4*>(og + (int64_t)row * p.o_row_stride + c * 8) =
                    *reinterpret_cast<const uint4*>(sOb + panel_offset(BM, rl, 8 * c));
        }
        __syncwarp();  // every lane read its staged rows before they are rewritten (next tile)
        if constexpr (!Kt::kSeparateO) release(bar_q_empty, 0);  // staging done: Q's rows are free
    }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

template <typename Kt>
cudaError_t launch_fwd_sm90(const CfFwdParams& p, cudaStream_t stream) {
    auto kern = fwd_sm90_kernel<Kt>;
    const int smem = Kt::kSmemBytes;
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    const int64_t ntiles = (int64_t)((p.seqlen_q + Kt::kBlockM - 1) / Kt::kBlockM) * p.h * p.b;
    if (ntiles == 0) return cudaSuccess;  // nothing to compute (and no empty launch)
    if (ntiles > INT32_MAX) return cudaErrorInvalidConfiguration;  // tile indices are int
    int64_t grid = ntiles;
    if (Kt::kPersistent) {  // one wave of CTAs, each looping over tiles
        int sms = 0;
        if ((e = current_sm_count(sms)) != cudaSuccess) return e;
        grid = std::min<int64_t>(ntiles, (int64_t)sms * Kt::kMinBlocks);
    }
    kern<<<(unsigned)grid, Kt::kNThreads, smem, stream>>>(p);
    return cudaGetLastError();
}

template <typename T, int D>
cudaError_t run_fwd_sm90(const CfFwdParams& p, cudaStream_t stream) {
    if constexpr (D == 64) {
        if (p.seqlen_q <= kFwdSm90D64ShortMaxSeq) return launch_fwd_sm90<FwdSm90TraitsD64Short<T>>(p, stream);
        return launch_fwd_sm90<FwdSm90TraitsD64<T>>(p, stream);
    } else {
        static_assert(D == 128, "wgmma forward: head-dim tiles 64 and 128");
        return launch_fwd_sm90<FwdSm90TraitsD128<T>>(p, stream);
    }
}

template cudaError_t run_fwd_sm90<__half, 64>(const CfFwdParams&, cudaStream_t);
template cudaError_t run_fwd_sm90<__half, 128>(const CfFwdParams&, cudaStream_t);
template cudaError_t run_fwd_sm90<__nv_bfloat16, 64>(const CfFwdParams&, cudaStream_t);
template cudaError_t run_fwd_sm90<__nv_bfloat16, 128>(const CfFwdParams&, cudaStream_t);

}  // namespace cf
