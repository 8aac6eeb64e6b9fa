// Backward pass, tensor-core kernels (f16/bf16 on m16n8k16; f32 as 3xTF32 on m16n8k8, 32-row steps at
// d = 192 / 256: config.cuh BwdTraits; common/tile.cuh), FA2 algorithm:
//   dsum  = rowsum(dO * O)                                (bwd_dot_do_o_kernel, simt/bwd_f32.cu)
//   dK/dV: one CTA per 64 keys of a KV head, looping over the query blocks (and the query heads
//          of its split): recompute P = exp(logit - lse), dV += P^T dO, dP = dO V^T,
//          dS = P (dP - D) [* (1 - tanh^2) with softcap], dK += dS^T Q (scaled at the end);
//          non-deterministic mode also does dQ_accum += dS K with f32 atomics.
//   dQ:    deterministic mode: a forward-like pass per query block over the key blocks.
//          Atomic mode: dq = scale * dq_accum converted to T.
//   GQA:   split > 1 CTAs per KV head write f32 partial dK/dV, summed in a fixed order.
#pragma once
#include "../config.cuh"
#include "../common/bwd_work.cuh"
#include "../plan.cuh"
#include "../launch.cuh"
#include "../sm90/bwd.cuh"
#include "../sm90/bwd_wide.cuh"
#include <type_traits>

namespace cf {

// ------------------------------------------------------------------ dK / dV (+ atomic dQ)
template <typename Kt>
__global__ void __launch_bounds__(Kt::kNThreads, 1) bwd_dkdv_tc_kernel(const CfBwdParams p, const BwdWs ws) {
    using T = typename Kt::Elem;
    constexpr int D = Kt::kHeadDim, BM = Kt::kBlockM, BN = Kt::kBlockN, NTH = Kt::kNThreads, ST = Kt::kStages;
    constexpr int E = kChunkElems<T>, MK = kMmaK<T>;
    constexpr int C = D / E;     // chunks per Q/K/V/dO row
    constexpr int CP = BN / E;   // chunks per P/dS row
    constexpr int KS = D / MK;   // k-steps of S and dP
    constexpr int MS = BM / MK;  // k-steps of phase B
    constexpr int NS = BN / MK;  // k-steps of phase C
    constexpr int AMT = Kt::kAMT, AWM = Kt::kAWarpsM, AH = Kt::kAHalves;
    constexpr int BMT = Kt::kBMT, BNT = Kt::kBNT;
    constexpr int CMT = Kt::kCMT, CWM = Kt::kCWarpsM, CD = Kt::kCWarpsD, CG = Kt::kCGroup;

    extern __shared__ __align__(128) unsigned char smem[];
    T* sK = reinterpret_cast<T*>(smem);
    T* sV = sK + BN * D;
    T* sQ = sV + BN * D;          // [ST][BM*D]
    T* sdO = sQ + ST * BM * D;    // [ST][BM*D]
    T* sP = sdO + ST * BM * D;    // [BM*BN]
    T* sdS = sP + BM * BN;        // [BM*BN]
    float* sL = reinterpret_cast<float*>(sdS + BM * BN);  // [ST][BM]
    float* sD = sL + ST * BM;                             // [ST][BM]

    const CfFwdParams& f = p.fwd;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, q4 = lane & 3;
    // The CTA order across heads for f32 only (plan.cuh mma_sync_heavy_first).
    const DkdvWork<T, BN, BM, std::is_same<T, float>::value> w(p, ws);
    if (w.empty()) return;
    const SeqInfo& si = w.si;
    const MaskInfo& mk = w.mk;
    const int b = w.b, hkv_i = w.hkv_i, split = w.split, n0 = w.n0, dch = w.dch, total_it = w.total_it;
    using Loader = TileLoader<C, NTH>;
    w.template prologue<Loader, D>(p, ws, sK, sV, sQ, sdO, sL, sD, tid);
    auto issue_q = [&](int it, int stage) { w.template issue_stage<Loader, D>(p, ws, it, stage, sQ, sdO, sL, sD, tid); };

    float dk[BMT][BNT][4], dv[BMT][BNT][4];
#pragma unroll
    for (int mt = 0; mt < BMT; ++mt)
#pragma unroll
        for (int t = 0; t < BNT; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk[mt][t][e] = dv[mt][t][e] = 0.f;

    const int wa_m = warp % AWM, wa_n = warp / AWM;  // A: rows 16*AMT*wa_m, keys kAKeys*wa_n
    const int wb_n = warp % 4, wb_d = warp / 4;      // B: keys 16*BMT*wb_n, column pairs 2t + wb_d
    const int wc_m = warp % CWM, wc_d = warp / CWM;  // C: rows 16*CMT*wc_m, column pairs CD*t + wc_d
    const int ra0 = 16 * AMT * wa_m, rb0 = 16 * BMT * wb_n, rc0 = 16 * CMT * wc_m;

    for (int it = 0; it < total_it; ++it) {
        const int hq = w.head(it), m0 = w.row0(it);
        const int st = (ST == 2) ? (it & 1) : 0;
        cp_async_wait<0>();
        __syncthreads();  // this step's tiles landed; the previous step is done everywhere
        if (ST == 2 && it + 1 < total_it) {
            issue_q(it + 1, st ^ 1);
            cp_async_commit();
        }
        const T* cQ = sQ + st * BM * D;
        const T* cdO = sdO + st * BM * D;
        const LogitInfo li(f, b, hq);

        // ---- phase A: S = Q K^T, dP = dO V^T; P and dS -> shared (as T). With AH = 2 the
        //      warp's 32 keys are done as two halves of 16 (fewer live registers).
        const bool full = mk.block_full(m0, BM, n0, BN) && m0 + BM <= si.sq;
#pragma unroll
        for (int hf = 0; hf < AH; ++hf) {
            constexpr int AK = Kt::kAKeys, NTA = AK / 8 / AH;
            const int key0 = AK * wa_n + (AK / AH) * hf;  // first key (local) of this half
            float s[AMT][NTA][4], dpa[AMT][NTA][4];
#pragma unroll
            for (int mt = 0; mt < AMT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NTA; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mt][nt][e] = dpa[mt][nt][e] = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
            constexpr int AU = D >= 192 ? 2 : (D >= 128 ? 1 : KS);  // sm_80's allocator: bound the hoisted loads
#else
            constexpr int AU = Kt::kAUnroll90;
#endif
            gemm_abt<AMT, NTA, KS, C, C, T, AU>(s, cQ, ra0, sK, key0, lane);
            gemm_abt<AMT, NTA, KS, C, C, T, AU>(dpa, cdO, ra0, sV, key0, lane);
            // The element loop is instantiated twice: kFast (every element visible, plain scale:
            // one FFMA + EX2 + FADD + FMUL per element, no index math) and the general one.
            auto elementwise = [&](auto fast_tag) {
                constexpr bool kFast = decltype(fast_tag)::value;
#pragma unroll
                for (int mt = 0; mt < AMT; ++mt) {
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int rl = ra0 + 16 * mt + g + 8 * r;
                        const int i = m0 + rl;
                        const float lse2 = Log2Units::lse(sL[st * BM + rl]);
                        const float dsv = sD[st * BM + rl];
#pragma unroll
                        for (int nt = 0; nt < NTA; ++nt) {
                            float pv[2], dsr[2];
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                const int j = n0 + key0 + 8 * nt + 2 * q4 + e;
                                const PdS x = p_ds<Log2Units, kFast>(li, mk, s[mt][nt][2 * r + e], dpa[mt][nt][2 * r + e], lse2, dsv, i, j, full);
                                pv[e] = x.p;
                                dsr[e] = x.ds;
                            }
                            stage_pair<T, CP>(sP, rl, key0 + 8 * nt + 2 * q4, pv[0], pv[1]);
                            stage_pair<T, CP>(sdS, rl, key0 + 8 * nt + 2 * q4, dsr[0], dsr[1]);
                        }
                    }
                }
            };
            if (full && !li.general) {
                elementwise(std::true_type{});
            } else {
                elementwise(std::false_type{});
            }
        }
        __syncthreads();  // P, dS visible

        // ---- phase B: dV += P^T dO, dK += dS^T Q
        gemm_at_b<BMT, BNT, MS, CP, C, 4, T, Kt::kBUnroll>(dv, sP, 2 * BMT * wb_n, cdO, 2 * wb_d, lane);
        gemm_at_b<BMT, BNT, MS, CP, C, 4, T, Kt::kBUnroll>(dk, sdS, 2 * BMT * wb_n, cQ, 2 * wb_d, lane);

        if (ST == 1 && it + 1 < total_it) {
            __syncthreads();  // everyone is done with Q/dO
            issue_q(it + 1, 0);
            cp_async_commit();
        }

        // ---- phase C (atomic mode): dQ_accum += dS K, 2*CG n8 tiles at a time
        if (ws.dq_accum != nullptr) {
            const int64_t rstride = (int64_t)f.h * f.d;
            float* dqg = ws.dq_accum_rows(f, si, hq) + m0 * rstride;
            [[maybe_unused]] const bool dq_vec2 = (reinterpret_cast<uintptr_t>(ws.dq_accum) & 7) == 0;  // sm_90 only
#pragma unroll
            for (int gi = 0; gi < Kt::kCPairs / CG; ++gi) {
                float acc[CMT][2 * CG][4];
#pragma unroll
                for (int mt = 0; mt < CMT; ++mt)
#pragma unroll
                    for (int t = 0; t < 2 * CG; ++t)
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[mt][t][e] = 0.f;
                gemm_ab<CMT, 2 * CG, NS, CP, C, 2 * CD, T>(acc, sdS, rc0, sK, 2 * wc_d, gi * CG * 2 * CD, lane);
#pragma unroll
                for (int mt = 0; mt < CMT; ++mt)
#pragma unroll
                    for (int t = 0; t < 2 * CG; ++t)
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            const int rl = rc0 + 16 * mt + g + 8 * r;
                            const int pair = CD * (gi * CG + (t >> 1)) + wc_d;
                            const int col = 16 * pair + 8 * (t & 1) + 2 * q4;  // even; d % 8 == 0
                            if (m0 + rl < si.sq && col < f.d) {
                                float* dst = dqg + rl * rstride + col;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
                                // one 8-byte vector reduction per column pair (half the L2 ops);
                                // every offset is even, so only the workspace base decides
                                if (dq_vec2) {
                                    atomicAdd(reinterpret_cast<float2*>(dst), make_float2(acc[mt][t][2 * r], acc[mt][t][2 * r + 1]));
                                } else
#endif
                                {
                                    atomicAdd(dst, acc[mt][t][2 * r]);
                                    atomicAdd(dst + 1, acc[mt][t][2 * r + 1]);
                                }
                            }
                        }
            }
        }
    }

    // ---- write dK (scaled) and dV. Element (mt, t, e): key rb0 + 16 mt + g + 8 (e>>1),
    //      column 32 (t>>1) + 16 wb_d + 8 (t&1) + 2 q4 + (e&1).
    const float scale = f.softmax_scale;
#pragma unroll
    for (int mt = 0; mt < BMT; ++mt)
#pragma unroll
        for (int t = 0; t < BNT; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk[mt][t][e] *= scale;

    cp_async_wait<0>();
    if (ws.nsplit == 1) {
        __syncthreads();  // all shared reads done: reuse the K / V buffers (BN x D) as dK / dV staging
        T* sOk = sK;
        T* sOv = sV;
#pragma unroll
        for (int mt = 0; mt < BMT; ++mt)
#pragma unroll
            for (int t = 0; t < BNT; ++t)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int rl = rb0 + 16 * mt + g + 8 * r;
                    const int col = 8 * (4 * (t >> 1) + 2 * wb_d + (t & 1)) + 2 * q4;
                    stage_pair<T, C>(sOk, rl, col, dk[mt][t][2 * r], dk[mt][t][2 * r + 1]);
                    stage_pair<T, C>(sOv, rl, col, dv[mt][t][2 * r], dv[mt][t][2 * r + 1]);
                }
        __syncthreads();
        T* dkg = si.dk<T>(p, hkv_i);
        T* dvg = si.dv<T>(p, hkv_i);
        for (int idx = tid; idx < BN * C; idx += NTH) {
            const int r = idx / C, c = idx % C;
            if (n0 + r < si.sk && c < dch) {
                *reinterpret_cast<uint4*>(dkg + (int64_t)(n0 + r) * p.dk_row_stride + c * E) = staged_chunk<T, C>(sOk, r, c);
                *reinterpret_cast<uint4*>(dvg + (int64_t)(n0 + r) * p.dv_row_stride + c * E) = staged_chunk<T, C>(sOv, r, c);
            }
        }
    } else {
        const int64_t rs = (int64_t)f.hkv * f.d;
        float* wk = ws.dk_part_rows(f, si, split, hkv_i) + n0 * rs;
        float* wv = wk + ws.dkv_v_offset(f);
#pragma unroll
        for (int mt = 0; mt < BMT; ++mt)
#pragma unroll
            for (int t = 0; t < BNT; ++t)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int rl = rb0 + 16 * mt + g + 8 * r;
                    const int col = 32 * (t >> 1) + 16 * wb_d + 8 * (t & 1) + 2 * q4;
                    if (n0 + rl < si.sk && col < f.d) {
                        *reinterpret_cast<float2*>(wk + rl * rs + col) = make_float2(dk[mt][t][2 * r], dk[mt][t][2 * r + 1]);
                        *reinterpret_cast<float2*>(wv + rl * rs + col) = make_float2(dv[mt][t][2 * r], dv[mt][t][2 * r + 1]);
                    }
                }
    }
}

// ------------------------------------------------------------------ deterministic dQ
template <typename Kt>
__global__ void __launch_bounds__(Kt::kNThreads, 1) bwd_dq_tc_kernel(const CfBwdParams p, const BwdWs ws) {
    using T = typename Kt::Elem;
    constexpr int D = Kt::kHeadDim, BM = Kt::kBlockM, BN = Kt::kBlockN, NTH = Kt::kNThreads;
    constexpr int E = kChunkElems<T>;
    constexpr int C = D / E, NT = BN / 8, DT = D / 8, KS = D / kMmaK<T>, PS = BN / kMmaK<T>;

    extern __shared__ __align__(128) unsigned char smem[];
    T* sQ = reinterpret_cast<T*>(smem);
    T* sdO = sQ + BM * D;
    T* sK = sdO + BM * D;     // [2][BN*D]
    T* sV = sK + 2 * BN * D;  // [2][BN*D]

    const CfFwdParams& f = p.fwd;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, q4 = lane & 3;
    const QueryBlockWork<> w(f, BM, ws.heavy_first != 0);
    if (w.empty()) return;
    const SeqInfo& si = w.si;
    const MaskInfo& mk = w.mk;
    const int h = w.h, b = si.b, m0 = w.m0, n_lo = w.n_lo, n_hi = w.n_hi;
    const int dch = f.d / E;

    const T* qg = si.q<T>(f, h);
    const T* dog = si.dout<T>(p, h);
    const T* kg = si.k<T>(f, w.hk);
    const T* vg = si.v<T>(f, w.hk);
    T* dqg = si.dq<T>(p, h);
    const int nb_lo = n_lo / BN, nb_hi = n_hi > n_lo ? (n_hi + BN - 1) / BN : nb_lo;

    load_tile<BM, C, NTH>(sQ, qg + (int64_t)m0 * f.q_row_stride, f.q_row_stride, si.sq - m0, dch, tid, f.q);
    load_tile<BM, C, NTH>(sdO, dog + (int64_t)m0 * p.do_row_stride, p.do_row_stride, si.sq - m0, dch, tid, p.dout);
    if (nb_hi > nb_lo) {
        const int n0 = nb_lo * BN;
        load_tile<BN, C, NTH>(sK, kg + (int64_t)n0 * f.k_row_stride, f.k_row_stride, si.sk - n0, dch, tid, f.k);
        load_tile<BN, C, NTH>(sV, vg + (int64_t)n0 * f.v_row_stride, f.v_row_stride, si.sk - n0, dch, tid, f.v);
    }
    cp_async_commit();

    const int row_w = 16 * warp;
    float lse2[2], dsv[2];
    {
        const float* lp = si.lse(f, h);
        const float* dp = ws.dsum_rows(si, h);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = m0 + row_w + g + 8 * r;
            lse2[r] = i < si.sq ? Log2Units::lse(lp[i]) : INFINITY;
            dsv[r] = i < si.sq ? dp[i] : 0.f;
        }
    }
    const LogitInfo li(f, b, h);

    float acc[1][DT][4];
#pragma unroll
    for (int t = 0; t < DT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][t][e] = 0.f;

    for (int nb = nb_lo, it = 0; nb < nb_hi; ++nb, ++it) {
        const int n0 = nb * BN;
        const int st = it & 1;
        cp_async_wait<0>();
        __syncthreads();  // K/V[nb] landed; everyone is done with the other stage
        if (nb + 1 < nb_hi) {
            const int n1 = n0 + BN;
            load_tile<BN, C, NTH>(sK + (st ^ 1) * BN * D, kg + (int64_t)n1 * f.k_row_stride, f.k_row_stride, si.sk - n1, dch, tid, f.k);
            load_tile<BN, C, NTH>(sV + (st ^ 1) * BN * D, vg + (int64_t)n1 * f.v_row_stride, f.v_row_stride, si.sk - n1, dch, tid, f.v);
            cp_async_commit();
        }
        const T* cK = sK + st * BN * D;
        const T* cV = sV + st * BN * D;
        float s[1][NT][4], dpa[1][NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[0][nt][e] = dpa[0][nt][e] = 0.f;
        gemm_abt<1, NT, KS, C, C, T>(s, sQ, row_w, cK, 0, lane);
        gemm_abt<1, NT, KS, C, C, T>(dpa, sdO, row_w, cV, 0, lane);
        const bool full = mk.block_full(m0, BM, n0, BN) && m0 + BM <= si.sq;
        // dS in place of S; instantiated twice like the dK/dV kernel's element loop
        auto elementwise = [&](auto fast_tag) {
            constexpr bool kFast = decltype(fast_tag)::value;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = e >> 1;
                    const int i = m0 + row_w + g + 8 * r;
                    const int j = n0 + 8 * nt + 2 * q4 + (e & 1);
                    s[0][nt][e] = p_ds<Log2Units, kFast>(li, mk, s[0][nt][e], dpa[0][nt][e], lse2[r], dsv[r], i, j, full).ds;
                }
        };
        if (full && !li.general) {
            elementwise(std::true_type{});
        } else {
            elementwise(std::false_type{});
        }
        uint32_t a[1][PS][4];
        c_to_a<1, PS, T>(a, s);
        gemm_rs_b<1, DT, PS, C, 2, T>(acc, a, cK, 0, 0, lane);
    }

    // scale, stage in this warp's own rows of sQ, store
    const float scale = f.softmax_scale;
    cp_async_wait<0>();  // no copy into sQ may still be in flight (empty key range)
    __syncwarp();
#pragma unroll
    for (int t = 0; t < DT; ++t)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int rl = row_w + g + 8 * r;
            stage_pair<T, C>(sQ, rl, 8 * t + 2 * q4, acc[0][t][2 * r] * scale, acc[0][t][2 * r + 1] * scale);
        }
    __syncwarp();
#pragma unroll
    for (int it = 0; it < (16 * C) / 32; ++it) {
        const int idx = lane + it * 32;
        const int rl = row_w + idx / C, c = idx % C;
        if (m0 + rl < si.sq && c < dch)
            *reinterpret_cast<uint4*>(dqg + (int64_t)(m0 + rl) * p.dq_row_stride + c * E) = staged_chunk<T, C>(sQ, rl, c);
    }
}

// ------------------------------------------------------------------ small per-row kernels
// One warp per (row, head); grid (ceil(max_rows / 8), heads, b), 256 threads.
template <typename T>
__global__ void __launch_bounds__(256) bwd_convert_dq_kernel(const CfBwdParams p, const BwdWs ws) {
    const CfFwdParams& f = p.fwd;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = blockIdx.y, b = blockIdx.z, i = blockIdx.x * 8 + warp;
    const SeqInfo si(f, b);
    if (i >= si.sq) return;
    T* dst = si.dq<T>(p, h) + (int64_t)i * p.dq_row_stride;
    const float scale = f.softmax_scale;
    if (ws.dq_tiled) {
        for (int c = lane; c < f.d; c += 32) {
            const float* row = ws.dq_tile_rows(f, si, h, c >> 6, i);
            dst[c] = from_float<T>(row[((((c & 63) >> 3) ^ (i & 7)) << 3) + (c & 7)] * scale);
        }
    } else {
        const float* src = ws.dq_accum_rows(f, si, h) + (int64_t)i * f.h * f.d;
        for (int c = lane; c < f.d; c += 32) dst[c] = from_float<T>(src[c] * scale);
    }
}

template <typename T>
__global__ void __launch_bounds__(256) bwd_reduce_dkv_kernel(const CfBwdParams p, const BwdWs ws) {
    const CfFwdParams& f = p.fwd;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hk = blockIdx.y, b = blockIdx.z, j = blockIdx.x * 8 + warp;
    const SeqInfo si(f, b);
    if (j >= si.sk) return;
    const int64_t rs = (int64_t)f.hkv * f.d;
    const int64_t split_stride = ws.total_k * rs;
    const float* wk = ws.dk_part_rows(f, si, 0, hk) + j * rs;
    const float* wv = wk + ws.dkv_v_offset(f);
    T* dk = si.dk<T>(p, hk) + (int64_t)j * p.dk_row_stride;
    T* dv = si.dv<T>(p, hk) + (int64_t)j * p.dv_row_stride;
    for (int c = lane; c < f.d; c += 32) {
        float sk = 0.f, sv = 0.f;
        for (int s = 0; s < ws.nsplit; ++s) {  // fixed order: deterministic
            sk += wk[s * split_stride + c];
            sv += wv[s * split_stride + c];
        }
        dk[c] = from_float<T>(sk);
        dv[c] = from_float<T>(sv);
    }
}

// ------------------------------------------------------------------ launcher
template <typename K>
static cudaError_t set_smem(K kern, int smem) {
    if (smem > 48 * 1024)
        return cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    return cudaSuccess;
}

// Calls f(kernel, Traits{}, wgmma) with the dK/dV kernel that plan pl names for element type T
// and head-dim tile D (wgmma: std::true_type for a sm_90a kernel, which also takes the TMA maps
// of Q and dO): the one map from plan to kernel, for the launch and the plan's occupancy
// question alike.
template <typename T, int D, typename F>
cudaError_t with_dkdv_kernel(const BwdPlan& pl, F&& f) {
    const bool ordered = pl.ordered_dq;
    if constexpr (sizeof(T) == 2 && (D == 64 || D == 96 || D == 128)) {
        if (pl.kernel == BwdKernel::kWgmma) {
            using Plain = BwdSm90Traits<T, D, false>;
            using General = BwdSm90Traits<T, D, true>;
            if (pl.block_mask) {  // (never ordered: check_bwd)
                using MPlain = BlockMasked<Plain>;
                using MGeneral = BlockMasked<General>;
                return pl.general_logits ? f(bwd_dkdv_sm90_kernel<MGeneral>, MGeneral{}, std::true_type{})
                                         : f(bwd_dkdv_sm90_kernel<MPlain>, MPlain{}, std::true_type{});
            }
            if (ordered)
                return pl.general_logits ? f(bwd_dkdv_sm90_kernel<General, true>, General{}, std::true_type{})
                                         : f(bwd_dkdv_sm90_kernel<Plain, true>, Plain{}, std::true_type{});
            return pl.general_logits ? f(bwd_dkdv_sm90_kernel<General>, General{}, std::true_type{})
                                     : f(bwd_dkdv_sm90_kernel<Plain>, Plain{}, std::true_type{});
        }
    } else if constexpr (sizeof(T) == 2 && (D == 192 || D == 256)) {
        if (pl.kernel == BwdKernel::kWgmmaWide) {
            using Kt = BwdSm90WideTraits<T, D>;
            if (pl.block_mask) return f(bwd_dkdv_sm90_wide_kernel<BlockMasked<Kt>>, BlockMasked<Kt>{}, std::true_type{});
            return ordered ? f(bwd_dkdv_sm90_wide_kernel<Kt, true>, Kt{}, std::true_type{})
                           : f(bwd_dkdv_sm90_wide_kernel<Kt>, Kt{}, std::true_type{});
        }
    }
    return f(bwd_dkdv_tc_kernel<BwdTraits<T, D>>, BwdTraits<T, D>{}, std::false_type{});
}

template <typename T, int D>
cudaError_t bwd_tc_wave(const BwdPlan& pl, BwdWave& w) {
    cudaError_t e = with_dkdv_kernel<T, D>(pl, [&](auto kern, auto traits, auto) {
        using Kt = decltype(traits);
        w.dkdv_block_n = Kt::kBlockN;
        return wave_slots<Kt>(kern, Kt::kNThreads, Kt::kSmemBytes, w.dkdv_slots);
    });
    if (e != cudaSuccess) return e;
    using Dq = BwdDqTraits<T, D>;
    w.dq_block_m = Dq::kBlockM;
    w.dq_slots = 0;
    if (pl.atomic_dq) return cudaSuccess;  // no dQ pass
    return wave_slots<Dq>(bwd_dq_tc_kernel<Dq>, Dq::kNThreads, Dq::kSmemBytes, w.dq_slots);
}

template <typename T, int D>
cudaError_t run_bwd_tc(const CfBwdParams& p, const BwdWs& ws, const BwdPlan& pl, cudaStream_t stream) {
    const CfFwdParams& f = p.fwd;
    cudaError_t e;
    // dK/dV (+ atomic dQ): one CTA per kBlockN keys of a KV head (and GQA split), in the plan's
    // order (ws.heavy_first of the kernel's copy of ws)
    e = with_dkdv_kernel<T, D>(pl, [&](auto kern, auto traits, auto wgmma) -> cudaError_t {
        using Kt = decltype(traits);
        cudaError_t err = set_smem(kern, Kt::kSmemBytes);
        const dim3 grid((f.seqlen_k + Kt::kBlockN - 1) / Kt::kBlockN, f.hkv * ws.nsplit, f.b);
        if (err != cudaSuccess || grid.x == 0) return err;
        BwdWs kws = ws;
        kws.heavy_first = pl.dkdv_order;
        if constexpr (decltype(wgmma)::value)
            kern<<<grid, Kt::kNThreads, Kt::kSmemBytes, stream>>>(p, kws, pl.tma ? make_bwd_tma_maps(p, Kt::kBlockM)
                                                                                  : BwdTmaMaps{});
        else
            kern<<<grid, Kt::kNThreads, Kt::kSmemBytes, stream>>>(p, kws);
        return cudaGetLastError();
    });
    if (e != cudaSuccess) return e;
    if (ws.dq_accum == nullptr) {
        // the dQ pass: a query-block grid, launched in QueryBlockCta's layout of the plan's order
        using Kt = BwdDqTraits<T, D>;
        if ((e = set_smem(bwd_dq_tc_kernel<Kt>, Kt::kSmemBytes)) != cudaSuccess) return e;
        const int query_blocks = (f.seqlen_q + Kt::kBlockM - 1) / Kt::kBlockM;
        if (query_blocks > 0) {
            BwdWs kws = ws;
            kws.heavy_first = pl.dq_order;
            const dim3 grid = QueryBlockCta::grid(query_blocks, f.h, f.b, kws.heavy_first);
            bwd_dq_tc_kernel<Kt><<<grid, Kt::kNThreads, Kt::kSmemBytes, stream>>>(p, kws);
            if ((e = cudaGetLastError()) != cudaSuccess) return e;
        }
    } else {
        const dim3 grid((f.seqlen_q + 7) / 8, f.h, f.b);
        if (grid.x > 0) {
            bwd_convert_dq_kernel<T><<<grid, 256, 0, stream>>>(p, ws);
            if ((e = cudaGetLastError()) != cudaSuccess) return e;
        }
    }
    if (pl.reduce_dkv) {
        const dim3 grid((f.seqlen_k + 7) / 8, f.hkv, f.b);
        if (grid.x > 0) {
            bwd_reduce_dkv_kernel<T><<<grid, 256, 0, stream>>>(p, ws);
            if ((e = cudaGetLastError()) != cudaSuccess) return e;
        }
    }
    return cudaSuccess;
}

// The instantiations of one (element type, head-dim tile): sm80/bwd_{f16,bf16,tf32}.cu.
#define CF_INST_BWD(T, D)                                                                                  \
    template cudaError_t run_bwd_tc<T, D>(const CfBwdParams&, const BwdWs&, const BwdPlan&, cudaStream_t); \
    template cudaError_t bwd_tc_wave<T, D>(const BwdPlan&, BwdWave&);

}  // namespace cf
