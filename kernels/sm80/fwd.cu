// Forward pass on tensor cores (mma.sync m16n8k16 for f16/bf16; m16n8k8 tf32 for f32, as 3xTF32
// at f32 accuracy: common/tile.cuh), f32 accumulators: the sm_80 kernel, also used on Hopper for
// head-dim tiles without a wgmma kernel and for f32 (the plan, plan.cu). Per CTA:
// kBlockM query rows of one head, looping over the key blocks that any of them sees, last
// first (the boundary block is masked while the rest runs unmasked). Masking, logits and the
// online softmax are common/mask.cuh and common/softmax.cuh.
#include "../config.cuh"
#include "../plan.cuh"
#include "../launch.cuh"
#include "../common/softmax.cuh"

namespace cf {

// Kt::kPaged: K/V through the block table (flash_api.h). Its own instantiation (chosen by the plan): this
// kernel is at its register limit, and the table code in the contiguous one made it spill
// (ptxas -v); the paged one runs 64-row tiles for d = 96 / 128 (config.cuh).
// across_heads: the CTA order of QueryBlockCta (common/mask.cuh), chosen by the launcher.
template <typename Kt>
__global__ void __launch_bounds__(Kt::kNThreads, 1) fwd_tc_kernel(const CfFwdParams p, const int across_heads) {
    using T = typename Kt::Elem;
    constexpr int D = Kt::kHeadDim, BM = Kt::kBlockM, BN = Kt::kBlockN;
    constexpr int NTH = Kt::kNThreads, MT = Kt::kMTiles;
    constexpr int E = kChunkElems<T>;
    constexpr int C = D / E;            // 16-byte chunks per row
    constexpr int NT = BN / 8;          // n8 tiles of S
    constexpr int DT = D / 8;           // n8 tiles of O
    constexpr int KS = D / kMmaK<T>;    // k-steps of Q K^T
    constexpr int PS = BN / kMmaK<T>;   // k-steps of P V
    using Loader = TileLoader<C, NTH>;
    constexpr bool kPaged = Kt::kPaged;
    constexpr KvPath kKv = kPaged ? KvPath::kAny : KvPath::kContiguous;  // (SeqInfo)

    extern __shared__ __align__(128) unsigned char smem[];
    T* sQ = reinterpret_cast<T*>(smem);
    T* sK = sQ + BM * D;
    T* sV = sK + BN * D;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, q4 = lane & 3;
    const QueryBlockWork<kKv> w(p, BM, across_heads != 0);
    if (w.empty()) return;
    const SeqInfo& si = w.si;
    const MaskInfo& mk = w.mk;
    const int h = w.h, m0 = w.m0, n_lo = w.n_lo, n_hi = w.n_hi;
    const int dch = p.d / E;

    const T* qg = si.q<T>(p, h);
    const T* kg = si.k<T>(p, w.hk);
    const T* vg = si.v<T>(p, w.hk);
    T* og = si.o<T>(p, h);
    float* lseg = si.lse(p, h);
    if (w.no_keys()) {
        write_empty_rows<T, BM, NTH>(og, p.o_row_stride, lseg, m0, w.m_last, p.d, tid, sink_logit(p, h));
        return;
    }
    const LogitInfo li(p, si.b, h);
    const float cmul = li.general ? kLog2e : li.c;  // general path: s holds natural logits
    const int nb_lo = n_lo / BN, nb_hi = (n_hi + BN - 1) / BN;

    load_tile<BM, C, NTH>(sQ, qg + (int64_t)m0 * p.q_row_stride, p.q_row_stride, si.sq - m0, dch, tid, p.q);
    if constexpr (kPaged)
        si.template load_k<Loader, BN>(p, sK, kg, (nb_hi - 1) * BN, dch, tid);
    else  // as before paging existed: this kernel's register allocation follows even the index arithmetic
        load_tile<BN, C, NTH>(sK, kg + (int64_t)(nb_hi - 1) * BN * p.k_row_stride, p.k_row_stride,
                              si.sk - (nb_hi - 1) * BN, dch, tid, p.k);
    cp_async_commit();

    float acc[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) acc[mt][dt][0] = acc[mt][dt][1] = acc[mt][dt][2] = acc[mt][dt][3] = 0.f;
    OnlineSoftmax<2 * MT> softmax;
    const int row_w = warp * MT * 16;  // this warp's first row in the block

    for (int nb = nb_hi - 1; nb >= nb_lo; --nb) {
        const int n0 = nb * BN;
        cp_async_wait<0>();
        __syncthreads();  // K[nb] landed; every warp is done with V[nb+1]
        if constexpr (kPaged)
            si.template load_v<Loader, BN>(p, sV, vg, n0, dch, tid);
        else
            load_tile<BN, C, NTH>(sV, vg + (int64_t)n0 * p.v_row_stride, p.v_row_stride, si.sk - n0, dch, tid, p.v);
        cp_async_commit();

        float s[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
        gemm_abt<MT, NT, KS, C, C, T>(s, sQ, row_w, sK, 0, lane);

        const int i0 = m0 + row_w + g;
        mask_scores<MT, NT>(&s[0][0][0], li, mk, [&](int mt, int r) { return i0 + 16 * mt + 8 * r; }, n0, q4,
                            mk.block_full(m0, BM, n0, BN));
        softmax.template step_rescale<MT, NT, DT>(&s[0][0][0], cmul, &acc[0][0][0]);
        uint32_t pa[MT][PS][4];
        c_to_a<MT, PS, T>(pa, s);

        cp_async_wait<0>();
        __syncthreads();  // V[nb] landed; every warp is done with K[nb]
        if (nb > nb_lo) {
            if constexpr (kPaged)
                si.template load_k<Loader, BN>(p, sK, kg, (nb - 1) * BN, dch, tid);
            else
                load_tile<BN, C, NTH>(sK, kg + (int64_t)(nb - 1) * BN * p.k_row_stride, p.k_row_stride,
                                      si.sk - (nb - 1) * BN, dch, tid, p.k);
            cp_async_commit();
        }
        gemm_rs_b<MT, DT, PS, C, 2, T>(acc, pa, sV, 0, 0, lane);
    }

    // Normalize, write lse, stage O (as T) in this warp's own rows of sQ, store 16 B per lane.
    const float sink = sink_logit(p, h);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float lse;
            const float inv = softmax.finish_row(2 * mt + r, cmul, lse, sink);
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                acc[mt][dt][2 * r] *= inv;
                acc[mt][dt][2 * r + 1] *= inv;
            }
            const int row = m0 + row_w + mt * 16 + g + 8 * r;
            if (q4 == 0 && row < si.sq) lseg[row] = lse;
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
                stage_pair<T, C>(sQ, rl, 8 * dt + 2 * q4, acc[mt][dt][2 * r], acc[mt][dt][2 * r + 1]);
            }
    __syncwarp();
#pragma unroll
    for (int it = 0; it < (MT * 16 * C) / 32; ++it) {
        const int idx = lane + it * 32;
        const int rl = row_w + idx / C, c = idx % C;
        const int row = m0 + rl;
        if (row < si.sq && c < dch)
            *reinterpret_cast<uint4*>(og + (int64_t)row * p.o_row_stride + c * E) = staged_chunk<T, C>(sQ, rl, c);
    }
}

// ------------------------------------------------------------------ launchers
// The grid in the CTA order the plan chose (plan.cu: across_heads, mma_sync_heavy_first).
template <typename T, int D, bool kPaged, bool kHopperTile>
cudaError_t run_fwd_tc(const CfFwdParams& p, bool across_heads, cudaStream_t stream) {
    using Kt = FwdTraits<T, D, kPaged, kHopperTile>;
    auto kern = fwd_tc_kernel<Kt>;
    const int smem = Kt::kSmemBytes;
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (e != cudaSuccess) return e;
    }
    const int query_blocks = (p.seqlen_q + Kt::kBlockM - 1) / Kt::kBlockM;
    kern<<<QueryBlockCta::grid(query_blocks, p.h, p.b, across_heads), Kt::kNThreads, smem, stream>>>(p, across_heads);
    return cudaGetLastError();
}

template <typename T, int D, bool kPaged, bool kHopperTile>
cudaError_t fwd_tc_wave_slots(int64_t& slots) {
    using Kt = FwdTraits<T, D, kPaged, kHopperTile>;
    return wave_slots<Kt>(fwd_tc_kernel<Kt>, Kt::kNThreads, Kt::kSmemBytes, slots);
}

#define CF_INST_FWD_TILE(T, D, kPaged, kHopperTile)                                              \
    template cudaError_t run_fwd_tc<T, D, kPaged, kHopperTile>(const CfFwdParams&, bool, cudaStream_t); \
    template cudaError_t fwd_tc_wave_slots<T, D, kPaged, kHopperTile>(int64_t&);
#define CF_INST_FWD(T, D) CF_INST_FWD_TILE(T, D, false, false) CF_INST_FWD_TILE(T, D, true, false)
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
CF_INST_FWD(float, 32)
CF_INST_FWD(float, 64)
CF_INST_FWD(float, 96)
CF_INST_FWD(float, 128)
CF_INST_FWD(float, 192)
CF_INST_FWD(float, 256)
CF_INST_FWD_TILE(float, 256, false, true)
CF_INST_FWD_TILE(float, 256, true, true)

}  // namespace cf
