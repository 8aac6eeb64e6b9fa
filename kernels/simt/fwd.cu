// Forward on CUDA cores (SIMT), f32 arithmetic for every element type: the f32 calls the
// tensor-core tiles do not take, and what only these kernels run (flash_api.h: head dims up to
// 576, a value head dim of its own, mm_prefix_ranges). Same semantics as the tensor-core kernels
// through the same common/ rules, in natural-log units (expf) for f32 accuracy.
#include "../config.cuh"
#include "../launch.cuh"
#include "../common/softmax.cuh"

namespace cf {

// CTA: kBlockM query rows of one head, kThreads threads per row (SimtRowTraits). Thread (r, sub)
// computes the scores of keys sub + kThreads k of each block and owns output columns
// sub + kThreads m. (Launch bounds with one block per SM: without the minimum, ptxas held the
// kernel to 128 registers and the wide shape spilled; the tiles allow two CTAs an SM anyway.)
template <typename T, SimtShape kShape>
__global__ void __launch_bounds__(SimtRowTraits<kShape>::kNThreads, 1) fwd_simt_kernel(const CfFwdParams p) {
    using Tr = SimtRowTraits<kShape>;
    constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, NT = Tr::kThreads, NTH = Tr::kNThreads;
    constexpr int NS = Tr::kScores, NC = Tr::kCols;
    extern __shared__ float smf[];
    const int d = p.d, dv = head_dim_v(p), ldq = simt_ld(d);
    const bool v_in_k = v_is_view_of_k(p);
    const int ldv = v_in_k ? ldq : simt_ld(dv);
    float* sQ = smf;
    float* sK = sQ + BM * ldq;
    float* sV = v_in_k ? sK : sK + BN * ldq;
    float* sP = sV + (v_in_k ? BN * ldq : BN * ldv);  // [BM][BN+1] (after K when V is K)
    __shared__ int s_prefix_lo, s_prefix_hi;

    const int tid = threadIdx.x, r = tid / NT, sub = tid % NT;
    const QueryBlockWork<KvPath::kAny> w(p, BM);
    if (w.empty()) return;
    const SeqInfo& si = w.si;
    const MaskInfo& mk = w.mk;
    const int h = w.h, m0 = w.m0, i = m0 + r;

    // Keys seen through mm_prefix_ranges: this row's [plo, phi), and the hull over the block's
    // rows (with the window's range) bounds the key loop; blocks in a gap between the two are
    // masked whole.
    int plo = 0, phi = 0, n_lo = w.n_lo, n_hi = w.n_hi;
    if (p.prefix_ranges != nullptr) {
        const PrefixRanges pr(p, si.b);
        if (i <= w.m_last) pr.keys(i + mk.off, si.sk, plo, phi);
        if (tid == 0) {
            s_prefix_lo = si.sk;
            s_prefix_hi = 0;
        }
        __syncthreads();
        if (plo < phi && sub == 0) {
            atomicMin(&s_prefix_lo, plo);
            atomicMax(&s_prefix_hi, phi);
        }
        __syncthreads();
        const int blo = s_prefix_lo, bhi = s_prefix_hi;
        if (blo < bhi) {
            if (n_hi <= n_lo) {
                n_lo = blo;
                n_hi = bhi;
            } else {
                n_lo = min(n_lo, blo);
                n_hi = max(n_hi, bhi);
            }
        }
    }

    const T* qg = si.q<T>(p, h);
    const T* kg = si.k<T>(p, w.hk);
    const T* vg = si.v<T>(p, w.hk);
    T* og = si.o<T>(p, h);
    float* lseg = si.lse(p, h);
    if (n_hi <= n_lo) {
        write_empty_rows<T, BM, NTH>(og, p.o_row_stride, lseg, m0, w.m_last, dv, tid, sink_logit(p, h));
        return;
    }
    const LogitInfo li(p, si.b, h);
    load_rows_as_f32<BM, NTH, T>(sQ, [&](int rr) { return qg + (int64_t)(m0 + rr) * p.q_row_stride; }, si.sq - m0, d, ldq, tid);
    float o[NC];
#pragma unroll
    for (int m = 0; m < NC; ++m) o[m] = 0.f;
    OnlineSoftmax<1, NT, NaturalUnits> softmax;  // this thread's row, spread over NT lanes

    for (int n0 = (n_lo / BN) * BN; n0 < n_hi; n0 += BN) {
        __syncthreads();
        auto k_row = [&](int rr) { return kg + si.key_offset(p, n0 + rr, p.k_batch_stride, p.k_row_stride); };
        load_rows_as_f32<BN, NTH, T>(sK, k_row, si.sk - n0, d, ldq, tid);
        if (!v_in_k) {
            auto v_row = [&](int rr) { return vg + si.key_offset(p, n0 + rr, p.v_batch_stride, p.v_row_stride); };
            load_rows_as_f32<BN, NTH, T>(sV, v_row, si.sk - n0, dv, ldv, tid);
        }
        __syncthreads();
        float sv[NS];
        float local_max = -INFINITY;
#pragma unroll
        for (int k = 0; k < NS; ++k) {
            const int jl = sub + NT * k, j = n0 + jl;
            const float a = simt_dot(sQ + r * ldq, sK + jl * ldq, d);
            float df;
            const float x = li.logit(a, i, j, mk.off, &df);
            sv[k] = (mk.visible(i, j) || (plo <= j && j < phi)) ? x : -INFINITY;
            local_max = fmaxf(local_max, sv[k]);
        }
        float corr;
        const float base = softmax.new_block_row(0, local_max, 1.f, corr);
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < NS; ++k) {
            const float pk = NaturalUnits::exp(sv[k] - base);
            sP[r * (BN + 1) + sub + NT * k] = pk;
            sum += pk;
        }
        softmax.add_block_row(0, sum, corr);
        __syncwarp();  // a row's threads share a warp
#pragma unroll
        for (int m = 0; m < NC; ++m) {
            const int c = sub + NT * m;
            if (c < dv) {
                float a = o[m] * corr;
                for (int jl = 0; jl < BN; ++jl) a = fmaf(sP[r * (BN + 1) + jl], sV[jl * ldv + c], a);
                o[m] = a;
            }
        }
    }
    float lse;
    const float inv = softmax.finish_row(0, 1.f, lse, sink_logit(p, h));
    if (i < si.sq) {
#pragma unroll
        for (int m = 0; m < NC; ++m) {
            const int c = sub + NT * m;
            if (c < dv) og[(int64_t)i * p.o_row_stride + c] = from_float<T>(o[m] * inv);
        }
        if (sub == 0) lseg[i] = lse;
    }
}

size_t simt_fwd_smem_bytes(const CfFwdParams& p, SimtShape shape) {
    const int dv = head_dim_v(p);
    const bool v_in_k = v_is_view_of_k(p);
    return shape == SimtShape::kWide ? SimtRowTraits<SimtShape::kWide>::fwd_smem_bytes(p.d, dv, v_in_k)
                                     : SimtRowTraits<SimtShape::kNarrow>::fwd_smem_bytes(p.d, dv, v_in_k);
}

template <typename T, SimtShape kShape>
cudaError_t run_fwd_simt(const CfFwdParams& p, cudaStream_t stream) {
    using Tr = SimtRowTraits<kShape>;
    const size_t smem = simt_fwd_smem_bytes(p, kShape);
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute(fwd_simt_kernel<T, kShape>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
    }
    const dim3 grid((p.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM, p.h, p.b);
    fwd_simt_kernel<T, kShape><<<grid, Tr::kNThreads, smem, stream>>>(p);
    return cudaGetLastError();
}

#define CF_SIMT_FWD(T)                                                                           \
    template cudaError_t run_fwd_simt<T, SimtShape::kNarrow>(const CfFwdParams&, cudaStream_t); \
    template cudaError_t run_fwd_simt<T, SimtShape::kWide>(const CfFwdParams&, cudaStream_t);
CF_SIMT_FWD(float)
CF_SIMT_FWD(__half)
CF_SIMT_FWD(__nv_bfloat16)
#undef CF_SIMT_FWD

}  // namespace cf
