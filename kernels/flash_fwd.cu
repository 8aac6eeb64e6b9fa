// Forward pass: tensor-core kernel for f16/bf16 (mma.sync m16n8k16, f32 accumulators, online
// softmax in log2 units) and a SIMT kernel for f32.
#include "kernel_traits.cuh"
#include "launch.cuh"

namespace cf {

// Rows [m0, m_last] of a query block that sees no key: o = 0, lse = -inf.
template <typename T, int ROWS, int NTHREADS>
__device__ __forceinline__ void write_empty_rows(T* og, int64_t o_row_stride, float* lseg, int m0,
                                                 int m_last, int d, int tid) {
    const int d8 = d >> 3;
    for (int idx = tid; idx < ROWS * d8; idx += NTHREADS) {
        const int r = idx / d8, c = idx % d8;
        if (m0 + r <= m_last) {
            if constexpr (sizeof(T) == 2) {
                *reinterpret_cast<uint4*>(og + (int64_t)(m0 + r) * o_row_stride + c * 8) = make_uint4(0, 0, 0, 0);
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) og[(int64_t)(m0 + r) * o_row_stride + c * 8 + e] = T(0);
            }
        }
    }
    for (int r = tid; r < ROWS; r += NTHREADS)
        if (m0 + r <= m_last) lseg[m0 + r] = -INFINITY;
}

// Online softmax step for one key block. s holds x (logits in units that c maps to log2 units:
// x2 = x * c), masked entries = -inf. On return s holds P = 2^(x2 - m2) (unnormalized) and the
// running max / sum / output accumulators are rescaled.
template <int MT, int NT, int DT>
__device__ __forceinline__ void softmax_step(float (&s)[MT][NT][4], float (&rmax)[MT][2],
                                             float (&rsum)[MT][2], float (&acc)[MT][DT][4], float c) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
            mx = quad_max(mx);
            const float m_new = fmaxf(rmax[mt][r], mx);
            const float ms = (m_new == -INFINITY) ? 0.f : m_new * c;  // all masked so far: 2^-inf = 0
            const float corr = ex2(rmax[mt][r] * c - ms);
            rmax[mt][r] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float pv = ex2(fmaf(s[mt][nt][2 * r + e], c, -ms));
                    s[mt][nt][2 * r + e] = pv;
                    sum += pv;
                }
            }
            rsum[mt][r] = rsum[mt][r] * corr + sum;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                acc[mt][dt][2 * r] *= corr;
                acc[mt][dt][2 * r + 1] *= corr;
            }
        }
    }
}

template <typename Kt>
__global__ void __launch_bounds__(Kt::kNThreads, 1) fwd_tc_kernel(const CfFwdParams p) {
    using T = typename Kt::Elem;
    constexpr int D = Kt::kHeadDim, BM = Kt::kBlockM, BN = Kt::kBlockN;
    constexpr int NTH = Kt::kNThreads, MT = Kt::kMTiles;
    constexpr int C = D / 8;     // 16-byte chunks per row
    constexpr int NT = BN / 8;   // n8 tiles of S
    constexpr int DT = D / 8;    // n8 tiles of O
    constexpr int KS = D / 16;   // k-steps of Q K^T
    constexpr int PS = BN / 16;  // k-steps of P V

    extern __shared__ __align__(128) unsigned char smem[];
    T* sQ = reinterpret_cast<T*>(smem);
    T* sK = sQ + BM * D;
    T* sV = sK + BN * D;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, q4 = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z;
    const SeqInfo si(p, b);
    // Causal-like masks: the last query blocks do the most work, so start them first.
    const int m_block = (p.window_right >= 0 && p.window_left < 0) ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int m0 = m_block * BM;
    if (m0 >= si.sq) return;
    const int hk = h / (p.h / p.hkv);
    const int dch = p.d >> 3;

    const T* qg = static_cast<const T*>(p.q) + si.q_off(b, p.q_batch_stride, p.q_row_stride) + (int64_t)h * p.q_head_stride;
    const T* kg = static_cast<const T*>(p.k) + si.k_off(b, p.k_batch_stride, p.k_row_stride) + (int64_t)hk * p.k_head_stride;
    const T* vg = static_cast<const T*>(p.v) + si.k_off(b, p.v_batch_stride, p.v_row_stride) + (int64_t)hk * p.v_head_stride;
    T* og = static_cast<T*>(p.o) + si.q_off(b, p.o_batch_stride, p.o_row_stride) + (int64_t)h * p.o_head_stride;
    float* lseg = p.lse + (int64_t)b * p.lse_batch_stride + (int64_t)h * p.lse_head_stride + (si.q_varlen ? si.q_row0 : 0);

    const MaskInfo mk(si.sq, si.sk, p.window_left, p.window_right);
    const int m_last = min(m0 + BM, si.sq) - 1;
    int n_lo, n_hi;
    mk.key_range(m0, m_last, n_lo, n_hi);
    if (n_hi <= n_lo) {
        write_empty_rows<T, BM, NTH>(og, p.o_row_stride, lseg, m0, m_last, p.d, tid);
        return;
    }
    const LogitInfo li(p, b, h);
    const float cmul = li.general ? kLog2e : li.c;  // general path: s holds natural logits
    const int nb_lo = n_lo / BN, nb_hi = (n_hi + BN - 1) / BN;

    load_tile<BM, C, NTH>(sQ, qg + (int64_t)m0 * p.q_row_stride, p.q_row_stride, si.sq - m0, dch, tid, p.q);
    load_tile<BN, C, NTH>(sK, kg + (int64_t)(nb_hi - 1) * BN * p.k_row_stride, p.k_row_stride,
                          si.sk - (nb_hi - 1) * BN, dch, tid, p.k);
    cp_async_commit();

    float acc[MT][DT][4];
    float rmax[MT][2], rsum[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) acc[mt][dt][0] = acc[mt][dt][1] = acc[mt][dt][2] = acc[mt][dt][3] = 0.f;
        rmax[mt][0] = rmax[mt][1] = -INFINITY;
        rsum[mt][0] = rsum[mt][1] = 0.f;
    }
    const int row_w = warp * MT * 16;  // this warp's first row in the block

    for (int nb = nb_hi - 1; nb >= nb_lo; --nb) {
        const int n0 = nb * BN;
        cp_async_wait<0>();
        __syncthreads();  // K[nb] landed; every warp is done with V[nb+1]
        load_tile<BN, C, NTH>(sV, vg + (int64_t)n0 * p.v_row_stride, p.v_row_stride, si.sk - n0, dch, tid, p.v);
        cp_async_commit();

        float s[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
        gemm_abt<MT, NT, KS, C, C, T>(s, sQ, row_w, sK, 0, lane);

        const bool full = mk.block_full(m0, BM, n0, BN);
        if (li.general || !full) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int i = m0 + row_w + mt * 16 + g + 8 * (e >> 1);
                        const int j = n0 + nt * 8 + 2 * q4 + (e & 1);
                        float x = s[mt][nt][e];
                        if (li.general) {
                            float df;
                            x = li.logit(x, i, j, mk.off, &df);
                        }
                        if (!full && !mk.visible(i, j)) x = -INFINITY;
                        s[mt][nt][e] = x;
                    }
        }
        softmax_step<MT, NT, DT>(s, rmax, rsum, acc, cmul);
        uint32_t pa[MT][PS][4];
        c_to_a<MT, PS, T>(pa, s);

        cp_async_wait<0>();
        __syncthreads();  // V[nb] landed; every warp is done with K[nb]
        if (nb > nb_lo) {
            load_tile<BN, C, NTH>(sK, kg + (int64_t)(nb - 1) * BN * p.k_row_stride, p.k_row_stride,
                                  si.sk - (nb - 1) * BN, dch, tid, p.k);
            cp_async_commit();
        }
        gemm_rs_b<MT, DT, PS, C, 2, T>(acc, pa, sV, 0, 0, lane);
    }

    // Normalize, write lse, stage O (as T) in this warp's own rows of sQ, store 16 B per lane.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float l = quad_sum(rsum[mt][r]);
            const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                acc[mt][dt][2 * r] *= inv;
                acc[mt][dt][2 * r + 1] *= inv;
            }
            const int row = m0 + row_w + mt * 16 + g + 8 * r;
            if (q4 == 0 && row < si.sq)
                lseg[row] = l > 0.f ? rmax[mt][r] * cmul * kLn2 + logf(l) : -INFINITY;
        }
    }
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int rl = row_w + mt * 16 + g + 8 * r;
                *reinterpret_cast<uint32_t*>(sQ + swz<C>(rl, dt) * 8 + 2 * q4) =
                    pack2<T>(acc[mt][dt][2 * r], acc[mt][dt][2 * r + 1]);
            }
    __syncwarp();
#pragma unroll
    for (int it = 0; it < (MT * 16 * C) / 32; ++it) {
        const int idx = lane + it * 32;
        const int rl = row_w + idx / C, c = idx % C;
        const int row = m0 + rl;
        if (row < si.sq && c < dch)
            *reinterpret_cast<uint4*>(og + (int64_t)row * p.o_row_stride + c * 8) =
                *reinterpret_cast<const uint4*>(sQ + swz<C>(rl, c) * 8);
    }
}

// ------------------------------------------------------------------ f32 SIMT forward
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
    const int h = blockIdx.y, b = blockIdx.z;
    const SeqInfo si(p, b);
    const int m_block = (p.window_right >= 0 && p.window_left < 0) ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int m0 = m_block * BM;
    if (m0 >= si.sq) return;
    const int hk = h / (p.h / p.hkv);
    const float* qg = static_cast<const float*>(p.q) + si.q_off(b, p.q_batch_stride, p.q_row_stride) + (int64_t)h * p.q_head_stride;
    const float* kg = static_cast<const float*>(p.k) + si.k_off(b, p.k_batch_stride, p.k_row_stride) + (int64_t)hk * p.k_head_stride;
    const float* vg = static_cast<const float*>(p.v) + si.k_off(b, p.v_batch_stride, p.v_row_stride) + (int64_t)hk * p.v_head_stride;
    float* og = static_cast<float*>(p.o) + si.q_off(b, p.o_batch_stride, p.o_row_stride) + (int64_t)h * p.o_head_stride;
    float* lseg = p.lse + (int64_t)b * p.lse_batch_stride + (int64_t)h * p.lse_head_stride + (si.q_varlen ? si.q_row0 : 0);

    const MaskInfo mk(si.sq, si.sk, p.window_left, p.window_right);
    const int m_last = min(m0 + BM, si.sq) - 1;
    int n_lo, n_hi;
    mk.key_range(m0, m_last, n_lo, n_hi);
    if (n_hi <= n_lo) {
        write_empty_rows<float, BM, NTH>(og, p.o_row_stride, lseg, m0, m_last, d, tid);
        return;
    }
    const LogitInfo li(p, b, h);
    for (int idx = tid; idx < BM * d; idx += NTH) {
        const int rr = idx / d, c = idx % d;
        sQ[rr * ld + c] = (m0 + rr < si.sq) ? qg[(int64_t)(m0 + rr) * p.q_row_stride + c] : 0.f;
    }
    float o[32];
#pragma unroll
    for (int m = 0; m < 32; ++m) o[m] = 0.f;
    float mrow = -INFINITY, lrow = 0.f;
    const int i = m0 + r;

    for (int n0 = (n_lo / BN) * BN; n0 < n_hi; n0 += BN) {
        __syncthreads();
        for (int idx = tid; idx < BN * d; idx += NTH) {
            const int jj = idx / d, c = idx % d;
            const bool ok = n0 + jj < si.sk;
            sK[jj * ld + c] = ok ? kg[(int64_t)(n0 + jj) * p.k_row_stride + c] : 0.f;
            sV[jj * ld + c] = ok ? vg[(int64_t)(n0 + jj) * p.v_row_stride + c] : 0.f;
        }
        __syncthreads();
        float sv[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int jl = sub + 8 * k;
            const float* qr = sQ + r * ld;
            const float* kr = sK + jl * ld;
            float a = 0.f;
            for (int c = 0; c < d; ++c) a = fmaf(qr[c], kr[c], a);
            float df;
            float x = li.logit(a, i, n0 + jl, mk.off, &df);
            if (!mk.visible(i, n0 + jl)) x = -INFINITY;
            sv[k] = x;
        }
        float mx = oct_max(fmaxf(fmaxf(sv[0], sv[1]), fmaxf(sv[2], sv[3])));
        const float m_new = fmaxf(mrow, mx);
        const float ms = m_new == -INFINITY ? 0.f : m_new;
        const float corr = expf(mrow - ms);
        mrow = m_new;
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float pk = expf(sv[k] - ms);
            sP[r * (BN + 1) + sub + 8 * k] = pk;
            sum += pk;
        }
        lrow = lrow * corr + sum;
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
    const float l = oct_sum(lrow);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    if (i < si.sq) {
#pragma unroll
        for (int m = 0; m < 32; ++m)
            if (m < d8) og[(int64_t)i * p.o_row_stride + sub + 8 * m] = o[m] * inv;
        if (sub == 0) lseg[i] = l > 0.f ? mrow + logf(l) : -INFINITY;
    }
}

// ------------------------------------------------------------------ launchers
template <typename T, int D>
cudaError_t run_fwd_tc(const CfFwdParams& p, cudaStream_t stream) {
    if constexpr (D == 64 || D == 128) {
        if (sm90a_available()) return run_fwd_sm90<T, D>(p, stream);  // wgmma kernel on Hopper
    }
    using Kt = FwdTraits<T, D>;
    auto kern = fwd_tc_kernel<Kt>;
    const int smem = Kt::kSmemBytes;
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (e != cudaSuccess) return e;
    }
    const dim3 grid((p.seqlen_q + Kt::kBlockM - 1) / Kt::kBlockM, p.h, p.b);
    kern<<<grid, Kt::kNThreads, smem, stream>>>(p);
    return cudaGetLastError();
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

#define CF_INST_FWD(T, D) template cudaError_t run_fwd_tc<T, D>(const CfFwdParams&, cudaStream_t);
CF_INST_FWD(__half, 32)
CF_INST_FWD(__half, 64)
CF_INST_FWD(__half, 96)
CF_INST_FWD(__half, 128)
CF_INST_FWD(__half, 192)
CF_INST_FWD(__half, 256)
CF_INST_FWD(__nv_bfloat16, 32)
CF_INST_FWD(__nv_bfloat16, 64)
CF_INST_FWD(__nv_bfloat16, 96)
CF_INST_FWD(__nv_bfloat16, 128)
CF_INST_FWD(__nv_bfloat16, 192)
CF_INST_FWD(__nv_bfloat16, 256)

}  // namespace cf
