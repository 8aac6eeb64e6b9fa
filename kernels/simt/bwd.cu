// Backward pieces that are not tensor-core kernels: dsum = rowsum(dO*O) and the sinks' gradient
// for every dtype, and the SIMT backward (f32 arithmetic, any element type; the counterpart of
// simt/fwd.cu): a dK/dV kernel that loops over the query heads of its KV head, and a dQ kernel.
// No atomics: always deterministic.
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
    for (int c = lane, dv = head_dim_v(f); c < dv; c += 32) acc = fmaf(to_float<T>(o[c]), to_float<T>(dO[c]), acc);
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

// The operand tiles of a SIMT backward kernel in its dynamic shared memory: Q [rows_q][ldq], dO
// [rows_q][ldv], K [rows_k][ldq], V [rows_k][ldv] (ld = simt_ld(head dim)), the key-side pair first
// (dK / dV, which keeps it for the whole CTA) or second (dQ); `rest` follows them.
struct SimtBwdTiles {
    float *q, *dout, *k, *v, *rest;
    __device__ __forceinline__ SimtBwdTiles(float* base, bool keys_first, int rows_q, int rows_k, int ldq, int ldv) {
        float* first = base;
        float* second = base + (keys_first ? rows_k : rows_q) * (ldq + ldv);
        float* qs = keys_first ? second : first;
        float* ks = keys_first ? first : second;
        q = qs;
        dout = qs + rows_q * ldq;
        k = ks;
        v = ks + rows_k * ldq;
        rest = base + (rows_q + rows_k) * (ldq + ldv);
    }
    // q.k over d columns and dO.v over dv columns, of query row il and key row jl.
    __device__ __forceinline__ void dots(int il, int jl, int d, int dv, int ldq, int ldv, float& qk, float& dpv) const {
        qk = simt_dot(q + il * ldq, k + jl * ldq, d);
        dpv = simt_dot(dout + il * ldv, v + jl * ldv, dv);
    }
};

// ------------------------------------------------------------------ dK / dV
// CTA: kBlockN keys of one KV head (SimtKeyTraits); loops over all query heads of that KV head
// and the query blocks (kBlockM rows) that see these keys. Scores: thread -> key tid % kBlockN,
// rows tid / kBlockN + kRowStep k. Accumulation: thread -> key tid / kThreads, columns
// tid % kThreads + kThreads m of dK (d of them) and dV (dv).
template <typename T, SimtShape kShape>
__global__ void __launch_bounds__(SimtKeyTraits<kShape>::kNThreads) bwd_dkdv_simt_kernel(const CfBwdParams p, const BwdWs ws) {
    using Tr = SimtKeyTraits<kShape>;
    constexpr int BN = Tr::kBlockN, BM = Tr::kBlockM, NTH = Tr::kNThreads, NT = Tr::kThreads, RS = Tr::kRowStep;
    constexpr int NC = Tr::kCols;
    const CfFwdParams& f = p.fwd;
    extern __shared__ float smf[];
    const int d = f.d, dvd = head_dim_v(f), ldq = simt_ld(d), ldv = simt_ld(dvd);
    const SimtBwdTiles t(smf, /*keys_first=*/true, BM, BN, ldq, ldv);
    float *sK = t.k, *sV = t.v, *sQ = t.q, *sdO = t.dout;
    float* sP = t.rest;  // [BM][BN+1]
    float* sdS = sP + BM * (BN + 1);
    float* sL = sdS + BM * (BN + 1);
    float* sD = sL + BM;

    const int tid = threadIdx.x;
    const int jl = tid % BN, ib = tid / BN;   // score phase
    const int jr = tid / NT, sub = tid % NT;  // accumulation phase
    const int hk = blockIdx.y, b = blockIdx.z;
    const SeqInfo si(f, b);
    const int n0 = blockIdx.x * BN;
    if (n0 >= si.sk) return;
    const int group = f.h / f.hkv;

    const MaskInfo mk(si.sq, si.sk, f.window_left, f.window_right);
    int m_lo, m_hi;
    mk.query_range(n0, min(n0 + BN, si.sk) - 1, m_lo, m_hi);

    const T* kg = si.k<T>(f, hk) + (int64_t)n0 * f.k_row_stride;
    const T* vg = si.v<T>(f, hk) + (int64_t)n0 * f.v_row_stride;
    load_rows_as_f32<BN, NTH, T>(sK, [&](int r) { return kg + r * f.k_row_stride; }, si.sk - n0, d, ldq, tid);
    load_rows_as_f32<BN, NTH, T>(sV, [&](int r) { return vg + r * f.v_row_stride; }, si.sk - n0, dvd, ldv, tid);
    float dk[NC], dv[NC];
    float ck[NC], cv[NC];  // compensation of the running totals (Kahan: see the block sums below)
#pragma unroll
    for (int m = 0; m < NC; ++m) dk[m] = dv[m] = ck[m] = cv[m] = 0.f;

    for (int hq = hk * group; hq < (hk + 1) * group; ++hq) {
        const LogitInfo li(f, b, hq);
        const T* qg = si.q<T>(f, hq);
        const T* dog = si.dout<T>(p, hq);
        const float* lp = si.lse(f, hq);
        const float* dp = ws.dsum_rows(si, hq);
        for (int m0 = (m_lo / BM) * BM; m0 < m_hi; m0 += BM) {
            __syncthreads();
            load_rows_as_f32<BM, NTH, T>(sQ, [&](int r) { return qg + (int64_t)(m0 + r) * f.q_row_stride; }, si.sq - m0, d, ldq, tid);
            load_rows_as_f32<BM, NTH, T>(sdO, [&](int r) { return dog + (int64_t)(m0 + r) * p.do_row_stride; }, si.sq - m0, dvd, ldv, tid);
            if (tid < BM) {
                const bool ok = m0 + tid < si.sq;
                sL[tid] = ok ? NaturalUnits::lse(lp[m0 + tid]) : INFINITY;
                sD[tid] = ok ? dp[m0 + tid] : 0.f;
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < BM / RS; ++k) {
                const int il = ib + RS * k;
                const int i = m0 + il, j = n0 + jl;
                float qk, dpv;
                t.dots(il, jl, d, dvd, ldq, ldv, qk, dpv);
                const PdS x = p_ds<NaturalUnits>(li, mk, qk, dpv, sL[il], sD[il], i, j, false);
                sP[il * (BN + 1) + jl] = x.p;
                sdS[il * (BN + 1) + jl] = x.ds;
            }
            __syncthreads();
#pragma unroll
            for (int m = 0; m < NC; ++m) {
                // Each query block's sum on its own, then one compensated add into the running
                // total: a key's dV / dK sum over every query row of the group's heads (thousands
                // of terms), and one sequential chain of them drifted to 6x the error of the
                // naive f32 computation (fuzz: d = 256, GQA 4:1, 200 rows, one key).
                const int c = sub + NT * m;
                if (c < dvd) {
                    float a = 0.f;
                    for (int il = 0; il < BM; ++il) a = fmaf(sP[il * (BN + 1) + jr], sdO[il * ldv + c], a);
                    kahan_add(dv[m], cv[m], a);
                }
                if (c < d) {
                    float a = 0.f;
                    for (int il = 0; il < BM; ++il) a = fmaf(sdS[il * (BN + 1) + jr], sQ[il * ldq + c], a);
                    kahan_add(dk[m], ck[m], a);
                }
            }
        }
    }
    const int j = n0 + jr;
    if (j < si.sk) {
        T* dkg = si.dk<T>(p, hk) + (int64_t)j * p.dk_row_stride;
        T* dvg = si.dv<T>(p, hk) + (int64_t)j * p.dv_row_stride;
        const float scale = f.softmax_scale;
#pragma unroll
        for (int m = 0; m < NC; ++m) {
            const int c = sub + NT * m;
            if (c < d) dkg[c] = from_float<T>(dk[m] * scale);
            if (c < dvd) dvg[c] = from_float<T>(dv[m]);
        }
    }
}

// ------------------------------------------------------------------ dQ
// CTA: kBlockM query rows of one head (SimtRowTraits), looping over the key blocks (kBlockN keys)
// it sees. Thread -> row tid / kThreads; scores for keys tid % kThreads + kThreads k, dQ columns
// tid % kThreads + kThreads m.
template <typename T, SimtShape kShape>
__global__ void __launch_bounds__(SimtRowTraits<kShape>::kNThreads) bwd_dq_simt_kernel(const CfBwdParams p, const BwdWs ws) {
    using Tr = SimtRowTraits<kShape>;
    constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, NTH = Tr::kNThreads, NT = Tr::kThreads;
    constexpr int NS = Tr::kScores, NC = Tr::kCols;
    const CfFwdParams& f = p.fwd;
    extern __shared__ float smf[];
    const int d = f.d, dvd = head_dim_v(f), ldq = simt_ld(d), ldv = simt_ld(dvd);
    const SimtBwdTiles t(smf, /*keys_first=*/false, BM, BN, ldq, ldv);
    float *sQ = t.q, *sdO = t.dout, *sK = t.k, *sV = t.v;
    float* sdS = t.rest;  // [BM][BN+1]

    const int tid = threadIdx.x, r = tid / NT, sub = tid % NT;
    const QueryBlockWork<> w(f, BM);
    if (w.empty()) return;
    const SeqInfo& si = w.si;
    const MaskInfo& mk = w.mk;
    const int h = w.h, m0 = w.m0, n_lo = w.n_lo, n_hi = w.n_hi;
    const T* qg = si.q<T>(f, h) + (int64_t)m0 * f.q_row_stride;
    const T* dog = si.dout<T>(p, h) + (int64_t)m0 * p.do_row_stride;
    const T* kg = si.k<T>(f, w.hk);
    const T* vg = si.v<T>(f, w.hk);
    T* dqg = si.dq<T>(p, h);
    const LogitInfo li(f, si.b, h);

    load_rows_as_f32<BM, NTH, T>(sQ, [&](int rr) { return qg + rr * f.q_row_stride; }, si.sq - m0, d, ldq, tid);
    load_rows_as_f32<BM, NTH, T>(sdO, [&](int rr) { return dog + rr * p.do_row_stride; }, si.sq - m0, dvd, ldv, tid);
    const int i = m0 + r;
    float L = INFINITY, Dv = 0.f;
    if (i < si.sq) {
        L = NaturalUnits::lse(si.lse(f, h)[i]);
        Dv = ws.dsum_rows(si, h)[i];
    }
    float dq[NC], cq[NC];  // cq: compensation (kahan_add)
#pragma unroll
    for (int m = 0; m < NC; ++m) dq[m] = cq[m] = 0.f;

    for (int n0 = (n_lo / BN) * BN; n0 < n_hi; n0 += BN) {
        __syncthreads();
        load_rows_as_f32<BN, NTH, T>(sK, [&](int rr) { return kg + (int64_t)(n0 + rr) * f.k_row_stride; }, si.sk - n0, d, ldq, tid);
        load_rows_as_f32<BN, NTH, T>(sV, [&](int rr) { return vg + (int64_t)(n0 + rr) * f.v_row_stride; }, si.sk - n0, dvd, ldv, tid);
        __syncthreads();
#pragma unroll
        for (int k = 0; k < NS; ++k) {
            const int jl = sub + NT * k, j = n0 + jl;
            float qk, dpv;
            t.dots(r, jl, d, dvd, ldq, ldv, qk, dpv);
            sdS[r * (BN + 1) + jl] = p_ds<NaturalUnits>(li, mk, qk, dpv, L, Dv, i, j, false).ds;
        }
        __syncwarp();  // a row's threads share a warp
#pragma unroll
        for (int m = 0; m < NC; ++m) {
            const int c = sub + NT * m;
            if (c < d) {
                float a = 0.f;  // the key block's sum, then one compensated add (as dV / dK)
                for (int jl = 0; jl < BN; ++jl) a = fmaf(sdS[r * (BN + 1) + jl], sK[jl * ldq + c], a);
                kahan_add(dq[m], cq[m], a);
            }
        }
    }
    if (i < si.sq) {
        const float scale = f.softmax_scale;
#pragma unroll
        for (int m = 0; m < NC; ++m) {
            const int c = sub + NT * m;
            if (c < d) dqg[(int64_t)i * p.dq_row_stride + c] = from_float<T>(dq[m] * scale);
        }
    }
}

// One launch of a SIMT backward kernel with `smem` bytes of dynamic shared memory (opted in past
// the default 48 KB); an empty grid launches nothing.
template <typename Kern>
cudaError_t launch_simt_bwd(Kern kern, dim3 grid, int threads, size_t smem, const CfBwdParams& p, const BwdWs& ws,
                            cudaStream_t stream) {
    if (grid.x == 0) return cudaSuccess;
    if (smem > 48 * 1024) {
        const cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
    }
    kern<<<grid, threads, smem, stream>>>(p, ws);
    return cudaGetLastError();
}

template <typename T, SimtShape kShape>
cudaError_t run_bwd_simt(const CfBwdParams& p, const BwdWs& ws, cudaStream_t stream) {
    using Kt = SimtKeyTraits<kShape>;
    using Rt = SimtRowTraits<kShape>;
    const CfFwdParams& f = p.fwd;
    const int dv = head_dim_v(f);
    const dim3 dkdv_grid((f.seqlen_k + Kt::kBlockN - 1) / Kt::kBlockN, f.hkv, f.b);
    cudaError_t e = launch_simt_bwd(bwd_dkdv_simt_kernel<T, kShape>, dkdv_grid, Kt::kNThreads, Kt::smem_bytes(f.d, dv), p,
                                    ws, stream);
    if (e != cudaSuccess) return e;
    const dim3 dq_grid((f.seqlen_q + Rt::kBlockM - 1) / Rt::kBlockM, f.h, f.b);
    return launch_simt_bwd(bwd_dq_simt_kernel<T, kShape>, dq_grid, Rt::kNThreads, Rt::dq_smem_bytes(f.d, dv), p, ws, stream);
}

#define CF_SIMT_BWD(T)                                                                                          \
    template cudaError_t run_bwd_simt<T, SimtShape::kNarrow>(const CfBwdParams&, const BwdWs&, cudaStream_t); \
    template cudaError_t run_bwd_simt<T, SimtShape::kWide>(const CfBwdParams&, const BwdWs&, cudaStream_t);
CF_SIMT_BWD(float)
CF_SIMT_BWD(__half)
CF_SIMT_BWD(__nv_bfloat16)
#undef CF_SIMT_BWD

}  // namespace cf
