// Backward pieces that are not tensor-core kernels: dsum = rowsum(dO*O) for every dtype, and the
// f32 SIMT backward (a dK/dV kernel that loops over the query heads of its KV head, and a dQ
// kernel). The f32 path has no atomics: it is always deterministic.
#include "../config.cuh"
#include "../launch.cuh"
#include "../common/bwd_work.cuh"

namespace cf {

// One warp per (query row, head); grid (ceil(max_sq / 8), h, b), 256 threads.
template <typename T>
__global__ void __launch_bounds__(256) bwd_dot_do_o_kernel(const CfBwdParams p, const BwdWs ws) {
    const CfFwdParams& f = p.fwd;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = blockIdx.y, b = blockIdx.z, i = blockIdx.x * 8 + warp;
    const SeqInfo si(f, b);
    if (i >= si.sq) return;
    const T* o = si.o<T>(f, h) + (int64_t)i * f.o_row_stride;
    const T* dO = si.dout<T>(p, h) + (int64_t)i * p.do_row_stride;
    float acc = 0.f;
    for (int c = lane; c < f.d; c += 32) acc = fmaf(to_float<T>(o[c]), to_float<T>(dO[c]), acc);
    acc = warp_sum(acc);
    if (lane == 0) ws.dsum_rows(si, h)[i] = acc;
}

cudaError_t run_bwd_dot_do_o(const CfBwdParams& p, const BwdWs& ws, cudaStream_t stream) {
    const CfFwdParams& f = p.fwd;
    const dim3 grid((f.seqlen_q + 7) / 8, f.h, f.b);
    if (grid.x == 0) return cudaSuccess;
    switch (f.dtype) {
        case CF_F32: bwd_dot_do_o_kernel<float><<<grid, 256, 0, stream>>>(p, ws); break;
        case CF_F16: bwd_dot_do_o_kernel<__half><<<grid, 256, 0, stream>>>(p, ws); break;
        default: bwd_dot_do_o_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(p, ws); break;
    }
    return cudaGetLastError();
}

// One CTA per query head h: dsinks[h] = -sum over the head's rows of e^{sink - lse} * dsum (the
// sink's probability times D: a sink carries no value, so its score gradient is -P_sink D). Each
// thread walks rows at a stride of the CTA, then a fixed-order reduction: the same bits every run.
__global__ void __launch_bounds__(256) bwd_sink_grad_kernel(const CfBwdParams p, const BwdWs ws) {
    const CfFwdParams& f = p.fwd;
    const int h = blockIdx.x;
    const float sink = f.sinks[h];
    float acc = 0.f;
    for (int b = 0; b < f.b; ++b) {
        const SeqInfo si(f, b);
        const float* lse = si.lse(f, h);
        const float* dsum = ws.dsum_rows(si, h);
        for (int i = threadIdx.x; i < si.sq; i += 256) acc = fmaf(expf(sink - lse[i]), dsum[i], acc);
    }
    __shared__ float warp_totals[8];
    acc = warp_sum(acc);
    if ((threadIdx.x & 31) == 0) warp_totals[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < 8; ++w) total += warp_totals[w];
        p.dsinks[h] = -total;
    }
}

cudaError_t run_bwd_sink_grad(const CfBwdParams& p, const BwdWs& ws, cudaStream_t stream) {
    if (p.fwd.h == 0) return cudaSuccess;
    bwd_sink_grad_kernel<<<p.fwd.h, 256, 0, stream>>>(p, ws);
    return cudaGetLastError();
}

// total += x with compensation c (Kahan): the rounding of each add is carried into the next, so a
// long chain of block sums (a key's dV over every query row of a KV group: 512 blocks at 16k rows)
// errs like one add. nvcc does not reassociate these without fast-math.
__device__ __forceinline__ void kahan_add(float& total, float& c, float x) {
    const float y = x - c;
    const float t = total + y;
    c = (t - total) - y;
    total = t;
}

// ------------------------------------------------------------------ f32 dK / dV
// CTA: 16 keys of one KV head; loops over all query heads of that KV head and the query blocks
// (32 rows) that see these keys. Scores: thread -> key tid&15, rows (tid>>4) + 8k. Accumulation:
// thread -> key tid>>3, columns (tid&7) + 8m.
__global__ void __launch_bounds__(F32BwdTraits::kNThreads) bwd_dkdv_f32_kernel(const CfBwdParams p, const BwdWs ws) {
    constexpr int BN = F32BwdTraits::kBlockN, BM = F32BwdTraits::kBlockM, NTH = F32BwdTraits::kNThreads;
    const CfFwdParams& f = p.fwd;
    extern __shared__ float smf[];
    const int d = f.d, ld = d + 1, d8 = d >> 3;
    float* sK = smf;
    float* sV = sK + BN * ld;
    float* sQ = sV + BN * ld;
    float* sdO = sQ + BM * ld;
    float* sP = sdO + BM * ld;     // [BM][BN+1]
    float* sdS = sP + BM * (BN + 1);
    float* sL = sdS + BM * (BN + 1);
    float* sD = sL + BM;

    const int tid = threadIdx.x;
    const int jl = tid & 15, ib = tid >> 4;   // score phase
    const int jr = tid >> 3, sub = tid & 7;   // accumulation phase
    const int hk = blockIdx.y, b = blockIdx.z;
    const SeqInfo si(f, b);
    const int n0 = blockIdx.x * BN;
    if (n0 >= si.sk) return;
    const int group = f.h / f.hkv;

    const MaskInfo mk(si.sq, si.sk, f.window_left, f.window_right);
    int m_lo, m_hi;
    mk.query_range(n0, min(n0 + BN, si.sk) - 1, m_lo, m_hi);

    const float* kg = si.k<float>(f, hk);
    const float* vg = si.v<float>(f, hk);
    load_rows_f32<BN, NTH>(sK, kg + (int64_t)n0 * f.k_row_stride, f.k_row_stride, sV, vg + (int64_t)n0 * f.v_row_stride,
                            f.v_row_stride, si.sk - n0, d, ld, tid);
    float dk[32], dv[32];
    float ck[32], cv[32];  // compensation of the running totals (Kahan: see the block sums below)
#pragma unroll
    for (int m = 0; m < 32; ++m) dk[m] = dv[m] = ck[m] = cv[m] = 0.f;

    for (int hq = hk * group; hq < (hk + 1) * group; ++hq) {
        const LogitInfo li(f, b, hq);
        const float* qg = si.q<float>(f, hq);
        const float* dog = si.dout<float>(p, hq);
        const float* lp = si.lse(f, hq);
        const float* dp = ws.dsum_rows(si, hq);
        for (int m0 = (m_lo / BM) * BM; m0 < m_hi; m0 += BM) {
            __syncthreads();
            // inline rather than load_rows_f32: at 128 registers this loop nest spills 4 bytes with it
            for (int idx = tid; idx < BM * d; idx += NTH) {
                const int ii = idx / d, c = idx % d;
                const bool ok = m0 + ii < si.sq;
                sQ[ii * ld + c] = ok ? qg[(int64_t)(m0 + ii) * f.q_row_stride + c] : 0.f;
                sdO[ii * ld + c] = ok ? dog[(int64_t)(m0 + ii) * p.do_row_stride + c] : 0.f;
            }
            if (tid < BM) {
                const bool ok = m0 + tid < si.sq;
                sL[tid] = ok ? NaturalUnits::lse(lp[m0 + tid]) : INFINITY;
                sD[tid] = ok ? dp[m0 + tid] : 0.f;
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int il = ib + 8 * k;
                const int i = m0 + il, j = n0 + jl;
                const float* qr = sQ + il * ld;
                const float* dr = sdO + il * ld;
                const float* kr = sK + jl * ld;
                const float* vr = sV + jl * ld;
                float qk = 0.f, dpv = 0.f;
                for (int c = 0; c < d; ++c) {
                    qk = fmaf(qr[c], kr[c], qk);
                    dpv = fmaf(dr[c], vr[c], dpv);
                }
                const PdS x = p_ds<NaturalUnits>(li, mk, qk, dpv, sL[il], sD[il], i, j, false);
                sP[il * (BN + 1) + jl] = x.p;
                sdS[il * (BN + 1) + jl] = x.ds;
            }
            __syncthreads();
#pragma unroll
            for (int m = 0; m < 32; ++m) {
                if (m < d8) {
                    // Each query block's sum on its own, then one compensated add into the
                    // running total: a key's dV / dK sum over every query row of the group's heads
                    // (thousands of terms), and one sequential chain of them drifted to 6x the
                    // error of the naive f32 computation (fuzz: d = 256, GQA 4:1, 200 rows, one key).
                    const int c = sub + 8 * m;
                    float av = 0.f, ak = 0.f;
                    for (int il = 0; il < BM; ++il) {
                        av = fmaf(sP[il * (BN + 1) + jr], sdO[il * ld + c], av);
                        ak = fmaf(sdS[il * (BN + 1) + jr], sQ[il * ld + c], ak);
                    }
                    kahan_add(dv[m], cv[m], av);
                    kahan_add(dk[m], ck[m], ak);
                }
            }
        }
    }
    const int j = n0 + jr;
    if (j < si.sk) {
        float* dkg = si.dk<float>(p, hk) + (int64_t)j * p.dk_row_stride;
        float* dvg = si.dv<float>(p, hk) + (int64_t)j * p.dv_row_stride;
        const float scale = f.softmax_scale;
#pragma unroll
        for (int m = 0; m < 32; ++m) {
            if (m < d8) {
                dkg[sub + 8 * m] = dk[m] * scale;
                dvg[sub + 8 * m] = dv[m];
            }
        }
    }
}

// ------------------------------------------------------------------ f32 dQ
// CTA: 16 query rows of one head, looping over the key blocks (32 keys) it sees. Thread -> row
// tid>>3; scores for keys (tid&7) + 8k, dQ columns (tid&7) + 8m.
__global__ void __launch_bounds__(F32DqTraits::kNThreads) bwd_dq_f32_kernel(const CfBwdParams p, const BwdWs ws) {
    constexpr int BM = F32DqTraits::kBlockM, BN = F32DqTraits::kBlockN, NTH = F32DqTraits::kNThreads;
    const CfFwdParams& f = p.fwd;
    extern __shared__ float smf[];
    const int d = f.d, ld = d + 1, d8 = d >> 3;
    float* sQ = smf;
    float* sdO = sQ + BM * ld;
    float* sK = sdO + BM * ld;
    float* sV = sK + BN * ld;
    float* sdS = sV + BN * ld;  // [BM][BN+1]

    const int tid = threadIdx.x, r = tid >> 3, sub = tid & 7;
    const QueryBlockWork<> w(f, BM);
    if (w.empty()) return;
    const SeqInfo& si = w.si;
    const MaskInfo& mk = w.mk;
    const int h = w.h, m0 = w.m0, n_lo = w.n_lo, n_hi = w.n_hi;
    const float* qg = si.q<float>(f, h);
    const float* dog = si.dout<float>(p, h);
    const float* kg = si.k<float>(f, w.hk);
    const float* vg = si.v<float>(f, w.hk);
    float* dqg = si.dq<float>(p, h);
    const LogitInfo li(f, si.b, h);

    load_rows_f32<BM, NTH>(sQ, qg + (int64_t)m0 * f.q_row_stride, f.q_row_stride, sdO, dog + (int64_t)m0 * p.do_row_stride,
                            p.do_row_stride, si.sq - m0, d, ld, tid);
    const int i = m0 + r;
    float L = INFINITY, Dv = 0.f;
    if (i < si.sq) {
        L = NaturalUnits::lse(si.lse(f, h)[i]);
        Dv = ws.dsum_rows(si, h)[i];
    }
    float dq[32], cq[32];  // cq: compensation (kahan_add)
#pragma unroll
    for (int m = 0; m < 32; ++m) dq[m] = cq[m] = 0.f;

    if (n_hi > n_lo) {
        for (int n0 = (n_lo / BN) * BN; n0 < n_hi; n0 += BN) {
            __syncthreads();
            load_rows_f32<BN, NTH>(sK, kg + (int64_t)n0 * f.k_row_stride, f.k_row_stride, sV, vg + (int64_t)n0 * f.v_row_stride,
                                    f.v_row_stride, si.sk - n0, d, ld, tid);
            __syncthreads();
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int jl = sub + 8 * k, j = n0 + jl;
                const float* qr = sQ + r * ld;
                const float* dr = sdO + r * ld;
                const float* kr = sK + jl * ld;
                const float* vr = sV + jl * ld;
                float qk = 0.f, dpv = 0.f;
                for (int c = 0; c < d; ++c) {
                    qk = fmaf(qr[c], kr[c], qk);
                    dpv = fmaf(dr[c], vr[c], dpv);
                }
                sdS[r * (BN + 1) + jl] = p_ds<NaturalUnits>(li, mk, qk, dpv, L, Dv, i, j, false).ds;
            }
            __syncwarp();  // a row's 8 threads share a warp
#pragma unroll
            for (int m = 0; m < 32; ++m) {
                if (m < d8) {
                    const int c = sub + 8 * m;
                    float a = 0.f;  // the key block's sum, then one compensated add (as dV / dK)
                    for (int jl = 0; jl < BN; ++jl) a = fmaf(sdS[r * (BN + 1) + jl], sK[jl * ld + c], a);
                    kahan_add(dq[m], cq[m], a);
                }
            }
        }
    }
    if (i < si.sq) {
        const float scale = f.softmax_scale;
#pragma unroll
        for (int m = 0; m < 32; ++m)
            if (m < d8) dqg[(int64_t)i * p.dq_row_stride + sub + 8 * m] = dq[m] * scale;
    }
}

cudaError_t run_bwd_f32(const CfBwdParams& p, const BwdWs& ws, cudaStream_t stream) {
    const CfFwdParams& f = p.fwd;
    cudaError_t e;
    {
        const size_t smem = F32BwdTraits::smem_bytes(f.d);
        if (smem > 48 * 1024 &&
            (e = cudaFuncSetAttribute(bwd_dkdv_f32_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem)) != cudaSuccess)
            return e;
        const dim3 grid((f.seqlen_k + F32BwdTraits::kBlockN - 1) / F32BwdTraits::kBlockN, f.hkv, f.b);
        if (grid.x > 0) {
            bwd_dkdv_f32_kernel<<<grid, F32BwdTraits::kNThreads, smem, stream>>>(p, ws);
            if ((e = cudaGetLastError()) != cudaSuccess) return e;
        }
    }
    {
        const size_t smem = F32DqTraits::smem_bytes(f.d);
        if (smem > 48 * 1024 &&
            (e = cudaFuncSetAttribute(bwd_dq_f32_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem)) != cudaSuccess)
            return e;
        const dim3 grid((f.seqlen_q + F32DqTraits::kBlockM - 1) / F32DqTraits::kBlockM, f.h, f.b);
        if (grid.x > 0) {
            bwd_dq_f32_kernel<<<grid, F32DqTraits::kNThreads, smem, stream>>>(p, ws);
            if ((e = cudaGetLastError()) != cudaSuccess) return e;
        }
    }
    return cudaSuccess;
}

}  // namespace cf
