// Forward in f32 on CUDA cores (SIMT): every GPU, f32 accuracy (expf, natural-log units), same
// semantics as the tensor-core kernels through the same common/ rules.
#include "../config.cuh"
#include "../launch.cuh"
#include "../common/softmax.cuh"

namespace cf {

// 8 threads per query row: each computes 4 of the 32 scores of a key block (keys sub + 8k)
// and owns output columns sub + 8m.
__global__ void __launch_bounds__(F32FwdTraits::kNThreads) fwd_f32_kernel(const CfFwdParams p) {
    constexpr int BM = F32FwdTraits::kBlockM, BN = F32FwdTraits::kBlockN, NTH = F32FwdTraits::kNThreads;
    extern __shared__ float smf[];
    const int d = p.d, ld = d + 1, d8 = d >> 3;
    float* sQ = smf;
    float* sK = sQ + BM * ld;
    float* sV = sK + BN * ld;
    float* sP = sV + BN * ld;  // [BM][BN+1]

    const int tid = threadIdx.x, r = tid >> 3, sub = tid & 7;
    const QueryBlockWork<KvPath::kAny> w(p, BM);
    if (w.empty()) return;
    const SeqInfo& si = w.si;
    const MaskInfo& mk = w.mk;
    const int h = w.h, m0 = w.m0, n_lo = w.n_lo, n_hi = w.n_hi;
    const float* qg = si.q<float>(p, h);
    const float* kg = si.k<float>(p, w.hk);
    const float* vg = si.v<float>(p, w.hk);
    float* og = si.o<float>(p, h);
    float* lseg = si.lse(p, h);
    if (w.no_keys()) {
        write_empty_rows<float, BM, NTH>(og, p.o_row_stride, lseg, m0, w.m_last, d, tid, sink_logit(p, h));
        return;
    }
    const LogitInfo li(p, si.b, h);
    load_rows_f32<BM, NTH>(sQ, qg + (int64_t)m0 * p.q_row_stride, p.q_row_stride, nullptr, nullptr, 0, si.sq - m0, d, ld, tid);
    float o[32];
#pragma unroll
    for (int m = 0; m < 32; ++m) o[m] = 0.f;
    OnlineSoftmax<1, 8, NaturalUnits> softmax;  // this thread's row, spread over 8 lanes
    const int i = m0 + r;

    for (int n0 = (n_lo / BN) * BN; n0 < n_hi; n0 += BN) {
        __syncthreads();
        load_rows_f32<BN, NTH>(
            sK, [&](int r) { return kg + si.key_offset(p, n0 + r, p.k_batch_stride, p.k_row_stride); }, sV,
            [&](int r) { return vg + si.key_offset(p, n0 + r, p.v_batch_stride, p.v_row_stride); }, si.sk - n0, d, ld, tid);
        __syncthreads();
        float sv[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int jl = sub + 8 * k;
            const float* qr = sQ + r * ld;
            const float* kr = sK + jl * ld;
            float a = 0.f;
            for (int c = 0; c < d; ++c) a = fmaf(qr[c], kr[c], a);
            sv[k] = masked_logit(li, mk, a, i, n0 + jl);
        }
        float corr;
        const float base = softmax.new_block_row(0, fmaxf(fmaxf(sv[0], sv[1]), fmaxf(sv[2], sv[3])), 1.f, corr);
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float pk = NaturalUnits::exp(sv[k] - base);
            sP[r * (BN + 1) + sub + 8 * k] = pk;
            sum += pk;
        }
        softmax.add_block_row(0, sum, corr);
        __syncwarp();
#pragma unroll
        for (int m = 0; m < 32; ++m) {
            if (m < d8) {
                const int c = sub + 8 * m;
                float a = o[m] * corr;
                for (int jl = 0; jl < BN; ++jl) a = fmaf(sP[r * (BN + 1) + jl], sV[jl * ld + c], a);
                o[m] = a;
            }
        }
    }
    float lse;
    const float inv = softmax.finish_row(0, 1.f, lse, sink_logit(p, h));
    if (i < si.sq) {
#pragma unroll
        for (int m = 0; m < 32; ++m)
            if (m < d8) og[(int64_t)i * p.o_row_stride + sub + 8 * m] = o[m] * inv;
        if (sub == 0) lseg[i] = lse;
    }
}


cudaError_t run_fwd_f32(const CfFwdParams& p, cudaStream_t stream) {
    const size_t smem = F32FwdTraits::smem_bytes(p.d);
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute(fwd_f32_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
    }
    const dim3 grid((p.seqlen_q + F32FwdTraits::kBlockM - 1) / F32FwdTraits::kBlockM, p.h, p.b);
    fwd_f32_kernel<<<grid, F32FwdTraits::kNThreads, smem, stream>>>(p);
    return cudaGetLastError();
}

}  // namespace cf
