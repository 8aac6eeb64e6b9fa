// Forward for decode shapes (few query rows, long KV), f16/bf16 and f32 (3xTF32: common/tile.cuh),
// head-dim tiles 64 and 128
// (flash-decoding). The key range is cut into `nsplit` chunks of whole key blocks; each CTA
// computes one chunk for the query rows of `pack` query heads sharing one KV head (GQA rows
// packed: row r of a group = head h0 + r / sq, query r % sq), so each K/V tile is read once per
// group and chunk. Partials (normalised O in f32 and the natural-log lse per row) go to scratch
// in the caller's workspace (SplitPlan); split_combine_kernel merges them with
// lse-weighted sums and writes o (input dtype) and lse. Only warps that own valid rows do math.
#include "../config.cuh"
#include "../launch.cuh"
#include "../common/softmax.cuh"
#include "split_combine.cuh"

namespace cf {


template <typename Kt>
__global__ void __launch_bounds__(Kt::kNThreads, 2) split_fwd_kernel(const CfFwdParams p, const SplitArgs sa) {
    using T = typename Kt::Elem;
    constexpr int D = Kt::kHeadDim, BM = Kt::kBlockM, BN = Kt::kBlockN, NTH = Kt::kNThreads;
    constexpr int E = kChunkElems<T>;
    constexpr int C = D / E, NT = BN / 8, DT = D / 8, KS = D / kMmaK<T>, PS = BN / kMmaK<T>;
    using Loader = TileLoader<C, NTH>;

    extern __shared__ __align__(128) unsigned char smem[];
    T* sQ = reinterpret_cast<T*>(smem);
    T* sK = sQ + BM * D;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, q4 = lane & 3;
    const int split = blockIdx.x, gi = blockIdx.y / sa.mblocks, mb = blockIdx.y % sa.mblocks, b = blockIdx.z;
    const SeqInfo si(p, b, KvKind<KvPath::kAny>{});
    const int sq = si.sq, R = sa.pack * sq;
    const int m0 = mb * BM;
    if (m0 >= R) return;
    const int nrows = min(BM, R - m0);
    const int h0 = gi * sa.pack;
    const int hk = kv_head(p, h0);
    const int dch = p.d / E;
    int i_lo, i_hi;
    packed_query_range(m0, nrows, sq, i_lo, i_hi);

    const T* kg = si.k<T>(p, hk);
    const T* vg = si.v<T>(p, hk);
    const int64_t SQ = p.seqlen_q;
    const int64_t part_b = ((int64_t)split * p.b + b) * p.h;  // + head, then * SQ + i

    const MaskInfo mk(sq, si.sk, p.window_left, p.window_right);
    int n_lo, n_hi, nb_lo, nb_hi;
    split_key_blocks<BN>(mk, i_lo, i_hi, split, sa.bps, n_lo, n_hi, nb_lo, nb_hi);
    if (n_hi <= n_lo || nb_hi <= nb_lo) {
        for (int r = tid; r < nrows; r += NTH) {
            const int rr = m0 + r;
            sa.lpart[(part_b + h0 + rr / sq) * SQ + rr % sq] = -INFINITY;
        }
        return;
    }
    const LogitInfo li(p, b, h0);  // ALiBi only with pack == 1
    const float cmul = li.general ? kLog2e : li.c;

    {  // packed Q rows
        for (int idx = tid; idx < BM * C; idx += NTH) {
            const int r = idx / C, c = idx % C;
            const bool ok = r < nrows && c < dch;
            const int rr = m0 + r;
            const T* src = si.q<T>(p, h0 + rr / sq) + (int64_t)(rr % sq) * p.q_row_stride + c * E;
            cp_async_16(smem_addr(sQ + swz<C, sizeof(T)>(r, c) * E), ok ? static_cast<const void*>(src) : p.q, ok);
        }
    }
    // K/V ring of kStages (K, V) block pairs; block it (from the last one down) sits in stage
    // it % kStages. Every stage commits one cp.async group (possibly empty) so the counting is uniform.
    constexpr int S = Kt::kStages;
    const int nblk = nb_hi - nb_lo;
#pragma unroll
    for (int st = 0; st < S - 1; ++st) {
        if (st < nblk) {
            const int n0 = (nb_hi - 1 - st) * BN;
            si.template load_kv<Loader, BN>(p, sK + st * 2 * BN * D, sK + (st * 2 + 1) * BN * D, kg, vg, n0, dch, tid);
        }
        cp_async_commit();
    }

    float acc[1][DT][4];
    OnlineSoftmax<2> softmax;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) acc[0][dt][0] = acc[0][dt][1] = acc[0][dt][2] = acc[0][dt][3] = 0.f;
    const int row_w = warp * 16;
    const bool active = row_w < nrows;  // warp-uniform
    int irow[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) irow[r] = (m0 + row_w + g + 8 * r) % sq;

    for (int it = 0; it < nblk; ++it) {
        cp_async_wait<S - 2>();
        __syncthreads();  // block it landed; every warp is done with block it - 1 (stage (it + S - 1) % S)
        {
            const int nx = it + S - 1;
            if (nx < nblk) {
                const int st = nx % S, n0 = (nb_hi - 1 - nx) * BN;
                si.template load_kv<Loader, BN>(p, sK + st * 2 * BN * D, sK + (st * 2 + 1) * BN * D, kg, vg, n0, dch,
                                                tid);
            }
            cp_async_commit();
        }
        if (active) {
            const int n0 = (nb_hi - 1 - it) * BN;
            const T* sKc = sK + (it % S) * 2 * BN * D;
            const T* sVc = sKc + BN * D;
            float s[1][NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) s[0][nt][0] = s[0][nt][1] = s[0][nt][2] = s[0][nt][3] = 0.f;
            gemm_abt<1, NT, KS, C, C, T, (D >= 128 ? KS / 2 : KS)>(s, sQ, row_w, sKc, 0, lane);
            mask_scores<1, NT>(&s[0][0][0], li, mk, [&](int, int r) { return irow[r]; }, n0, q4,
                               mk.block_full(i_lo, i_hi - i_lo + 1, n0, BN));
            float corr[2];
            softmax.template step<1, NT>(&s[0][0][0], cmul, corr);
            scale_rows<1, DT>(&acc[0][0][0], corr);
            uint32_t pa[1][PS][4];
            c_to_a<1, PS, T>(pa, s);
            gemm_rs_b<1, DT, PS, C, 2, T>(acc, pa, sVc, 0, 0, lane);
        }
    }
    cp_async_wait<0>();
    if (!active) return;

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float lse;
        const float inv = softmax.finish_row(r, cmul, lse);
        const int rl = row_w + g + 8 * r;
        if (rl < nrows) {
            const int rr = m0 + rl;
            const int64_t idx = (part_b + h0 + rr / sq) * SQ + rr % sq;
            if (q4 == 0) sa.lpart[idx] = lse;
            float* op = sa.opart + idx * D + 2 * q4;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
                *reinterpret_cast<float2*>(op + dt * 8) = make_float2(acc[0][dt][2 * r] * inv, acc[0][dt][2 * r + 1] * inv);
        }
    }
}

template <typename Kt>
cudaError_t launch_split(const CfFwdParams& p, const SplitArgs& sa, cudaStream_t stream) {
    auto kern = split_fwd_kernel<Kt>;
    const int smem = Kt::kSmemBytes;
    cudaError_t e = cudaSuccess;
    if (smem > 48 * 1024) e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    const dim3 grid(sa.nsplit, sa.mblocks * (p.h / sa.pack), p.b);
    kern<<<grid, Kt::kNThreads, smem, stream>>>(p, sa);
    return cudaGetLastError();
}

template <typename T, int D>
cudaError_t run_fwd_split(const CfFwdParams& p, const SplitPlan& sp, void* workspace, cudaStream_t stream) {
    if (workspace == nullptr) return cudaErrorInvalidValue;
    SplitArgs sa;
    sa.nsplit = sp.nsplit;
    sa.bps = sp.bps;
    sa.pack = sp.pack;
    sa.mblocks = sp.mblocks;
    sa.direct = false;
    sa.opart = static_cast<float*>(workspace);
    sa.lpart = reinterpret_cast<float*>(static_cast<char*>(workspace) + sp.opart_bytes);
    cudaError_t e = sp.deep ? launch_split<SplitTraits<T, D, 4>>(p, sa, stream) : launch_split<SplitTraits<T, D, 2>>(p, sa, stream);
    if (e != cudaSuccess) return e;
    const int64_t nrow = (int64_t)p.b * p.h * p.seqlen_q;
    split_combine_kernel<T, D><<<(unsigned)((nrow + 3) / 4), 128, 0, stream>>>(p, sa);
    return cudaGetLastError();
}

#define CF_INST_SPLIT(T, D) template cudaError_t run_fwd_split<T, D>(const CfFwdParams&, const SplitPlan&, void*, cudaStream_t);
CF_INST_SPLIT(__half, 64)
CF_INST_SPLIT(__half, 128)
CF_INST_SPLIT(__nv_bfloat16, 64)
CF_INST_SPLIT(__nv_bfloat16, 128)
CF_INST_SPLIT(float, 64)
CF_INST_SPLIT(float, 128)

}  // namespace cf
