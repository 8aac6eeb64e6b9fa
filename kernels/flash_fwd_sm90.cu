// Forward pass for Hopper (sm_90a): warpgroup MMA (wgmma) version of fwd_tc_kernel, same
// semantics (flash_api.h): varlen, causal / sliding window with bottom-right alignment,
// softcap, ALiBi, GQA, arbitrary 16-byte aligned strides; o = 0 and lse = -inf for rows that see
// no key. Dispatched from run_fwd_tc for head-dim tiles 64 / 128 when sm90a_available().
//
// CTA = 1 or 2 warpgroups x 64 query rows (FwdSm90Traits). Per key block (from the last
// visible one down):
//   S = Q K^T        wgmma_ss, Q and K K-major panel tiles in shared memory
//   mask (boundary blocks only) + online softmax in registers (log2 units, scale folded in)
//   O += P V         wgmma_rs, P from registers (accumulator -> A fragment), V MN-major
// Intra-warpgroup overlap (as in FlashAttention-3): S(j) = Q K(j)^T and O += P(j-1) V(j-1) are
// issued back to back, then the softmax of block j runs while the tensor cores finish P V; O is
// rescaled by block j's correction only after P(j-1) V(j-1) has completed.
// K/V: three stages loaded with cp.async by all threads; one __syncthreads per key block.
// The kernel body exists only in sm_90a code (wgmma); the same file also builds for sm_80 / PTX.
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
    constexpr int D = Kt::kHeadDim, BM = Kt::kBlockM, BN = Kt::kBlockN, NTH = Kt::kNThreads;
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
    T* sK = sQ + BM * D;                 // [3][BN][D]
    T* sV = sK + Kt::kStages * BN * D;   // [3][BN][D]
    const uint32_t aQ = smem_addr(sQ), aK = smem_addr(sK), aV = smem_addr(sV);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2;            // warpgroup: query rows 64*wg .. 64*wg+63 of the block
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
    if (n_hi <= n_lo) {  // no query row of the block sees a key
        for (int idx = tid; idx < BM * C; idx += NTH) {
            const int r = idx / C, c = idx % C;
            if (m0 + r <= m_last && c < dch)
                *reinterpret_cast<uint4*>(og + (int64_t)(m0 + r) * p.o_row_stride + c * 8) = make_uint4(0, 0, 0, 0);
        }
        for (int r = tid; r < BM; r += NTH)
            if (m0 + r <= m_last) lseg[m0 + r] = -INFINITY;
        return;
    }
    const LogitInfo li(p, b, h);
    const float cmul = li.general ? kLog2e : li.c;  // general path: s holds natural logits
    const int nb_lo = n_lo / BN, nb_hi = (n_hi + BN - 1) / BN;
    const int nblocks = nb_hi - nb_lo;  // processed in order j = 0.. : key block nb_hi - 1 - j

    auto load_k = [&](int nb, int st) {
        load_panels<BN, C, NTH>(sK + st * BN * D, kg + (int64_t)nb * BN * p.k_row_stride, p.k_row_stride,
                                si.sk - nb * BN, dch, tid, p.k);
    };
    auto load_v = [&](int nb, int st) {
        load_panels<BN, C, NTH>(sV + st * BN * D, vg + (int64_t)nb * BN * p.v_row_stride, p.v_row_stride,
                                si.sk - nb * BN, dch, tid, p.v);
    };
    // cp.async groups: {Q, K(0)}, {K(1), V(0)}; then per block j one group {K(j+2), V(j+1)}
    // (possibly empty) issued right after block j's barrier; block j waits for all but the
    // newest group (K(j), V(j-1) were issued two barriers earlier). Stage of block j: j % 3.
    load_panels<BM, C, NTH>(sQ, qg + (int64_t)m0 * p.q_row_stride, p.q_row_stride, si.sq - m0, dch, tid, p.q);
    load_k(nb_hi - 1, 0);
    cp_async_commit();
    if (nblocks > 1) load_k(nb_hi - 2, 1);
    load_v(nb_hi - 1, 0);
    cp_async_commit();

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float rmax[2] = {-INFINITY, -INFINITY}, rsum[2] = {0.f, 0.f};
    uint32_t pa[PS][4];                                  // P of the previous block (A fragments)
    const int wrow0 = m0 + 64 * wg + 16 * (warp & 3);    // this warp's first query row
    const uint32_t aQwg = aQ + wg * 64 * kPanelRowBytes; // this warpgroup's 64 rows of Q

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
    // Barrier of block j: its K (and V of block j-1) landed and are visible to wgmma; every
    // warpgroup is done with the stages the next loads overwrite (K(j-1): S of block j-1 was
    // waited for; V(j-2): P V of block j-2 was waited for, both in block j-1). Then issue the
    // loads of K(j+2) and V(j+1).
    auto sync_and_prefetch = [&](int j, int st_next2, int st_next1) {
        cp_async_wait<1>();
        fence_async_smem();
        __syncthreads();
        if (j + 2 < nblocks) load_k(nb_hi - 3 - j, st_next2);
        if (j + 1 < nblocks) load_v(nb_hi - 2 - j, st_next1);
        cp_async_commit();
    };

    // Block 0: S only (nothing to multiply with V yet).
    {
        sync_and_prefetch(0, 2, 1);
        float s[BN / 2];
        wg_fence();
        issue_s(s, 0);
        wg_wait<0>();
        reg_fence(s);
        mask(s, (nb_hi - 1) * BN);
        float corr[2];
        sm90_softmax<NT>(s, rmax, rsum, corr, cmul);  // corr = 0 or 1 on o = 0: nothing to rescale
        to_p(s);
    }
    int st = 0;  // stage of block j - 1
    for (int j = 1; j < nblocks; ++j) {
        const int st_prev = st;
        st = st == 2 ? 0 : st + 1;                   // stage of block j
        const int st_next1 = st == 2 ? 0 : st + 1;   // stage of block j + 1
        sync_and_prefetch(j, st_prev, st_next1);     // block j + 2 reuses the stage of block j - 1
        const int nb = nb_hi - 1 - j;

        float s[BN / 2];
        wg_fence();
        issue_s(s, st);
        issue_pv(st_prev);
        wg_wait<1>();  // S(j) done, P(j-1) V(j-1) may still run
        reg_fence(s);
        mask(s, nb * BN);
        float corr[2];
        sm90_softmax<NT>(s, rmax, rsum, corr, cmul);
        wg_wait<0>();  // P(j-1) V(j-1) done: o and pa are free
        reg_fence(o);
#pragma unroll
        for (int ks = 0; ks < PS; ++ks) reg_fence(pa[ks]);
#pragma unroll
        for (int t = 0; t < DT; ++t) {
            o[4 * t + 0] *= corr[0];
            o[4 * t + 1] *= corr[0];
            o[4 * t + 2] *= corr[1];
            o[4 * t + 3] *= corr[1];
        }
        to_p(s);
    }
    cp_async_wait<0>();  // V(last)
    fence_async_smem();
    __syncthreads();
    wg_fence();
    issue_pv((nblocks - 1) % 3);
    wg_wait<0>();
    reg_fence(o);

    // Normalize, write lse, stage O (as T) in this warp's own 16 rows of sQ (only this warp's
    // wgmma read them, and those have completed), store 16 bytes per lane.
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
    const int rl0 = 64 * wg + 16 * (warp & 3);  // this warp's first row in the block
    unsigned char* sQb = reinterpret_cast<unsigned char*>(sQ);
#pragma unroll
    for (int t = 0; t < DT; ++t)
#pragma unroll
        for (int r = 0; r < 2; ++r)
            *reinterpret_cast<uint32_t*>(sQb + panel_offset(BM, rl0 + g + 8 * r, 8 * t + 2 * q4)) =
                pack2<T>(o[4 * t + 2 * r], o[4 * t + 2 * r + 1]);
    __syncwarp();
#pragma unroll
    for (int it = 0; it < (16 * C) / 32; ++it) {
        const int idx = lane + it * 32;
        const int rl = rl0 + idx / C, c = idx % C;
        const int row = m0 + rl;
        if (row < si.sq && c < dch)
            *reinterpret_cast<uint4*>(og + (int64_t)row * p.o_row_stride + c * 8) =
                *reinterpret_cast<const uint4*>(sQb + panel_offset(BM, rl, 8 * c));
    }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

template <typename Kt>
cudaError_t launch_fwd_sm90(const CfFwdParams& p, cudaStream_t stream) {
    auto kern = fwd_sm90_kernel<Kt>;
    const int smem = Kt::kSmemBytes;
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    const dim3 grid((p.seqlen_q + Kt::kBlockM - 1) / Kt::kBlockM, p.h, p.b);
    if (grid.x == 0 || grid.z == 0) return cudaSuccess;  // nothing to compute (and no empty launch)
    kern<<<grid, Kt::kNThreads, smem, stream>>>(p);
    return cudaGetLastError();
}

template <typename T, int D>
cudaError_t run_fwd_sm90(const CfFwdParams& p, cudaStream_t stream) {
    if constexpr (D == 64) {
        return launch_fwd_sm90<FwdSm90TraitsD64<T>>(p, stream);
    } else {
        static_assert(D == 128, "wgmma forward: head-dim tiles 64 and 128");
        if (p.window_right >= 0 && p.seqlen_q <= kFwdSm90ShortCausalMaxSeq)
            return launch_fwd_sm90<FwdSm90TraitsD128Short<T>>(p, stream);
        return launch_fwd_sm90<FwdSm90TraitsD128<T>>(p, stream);
    }
}

template cudaError_t run_fwd_sm90<__half, 64>(const CfFwdParams&, cudaStream_t);
template cudaError_t run_fwd_sm90<__half, 128>(const CfFwdParams&, cudaStream_t);
template cudaError_t run_fwd_sm90<__nv_bfloat16, 64>(const CfFwdParams&, cudaStream_t);
template cudaError_t run_fwd_sm90<__nv_bfloat16, 128>(const CfFwdParams&, cudaStream_t);

}  // namespace cf
