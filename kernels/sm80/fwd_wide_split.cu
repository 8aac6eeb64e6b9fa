// Forward of wide heads on tensor cores (mma.sync, sm_80 and later), f16 / bf16: the head dims
// the 64-256 tiles do not take, d up to 576 and dv up to 512. MLA's absorbed decode ((576, 512),
// one KV head, 16-128 query heads, v the first 512 columns of the latent cache that is also k)
// and 512-wide heads (Gemma 4's global layers), decode and prefill.
//
// A CTA's rows are `pack` query heads x their queries (row r = head h0 + r / sq, query r % sq):
// for decode shapes every query head of one KV head (pack = the group), so a key block is read
// once for all of them; for longer query blocks one head (pack = 1), a query block a CTA. When v
// is a view of k (v_is_view_of_k) P V reads the value columns out of the K tile, so the cache
// is read once. Decode cuts the key range into nsplit chunks (plan.cuh plan_wide_split);
// each CTA writes its rows' normalised partial O and lse, split_combine_kernel merges them (and
// the sink). With one chunk (`direct`) the CTA writes o and lse itself.
//
// CTA: 8 warps, kBlockM rows (16 or 64), key blocks of 32 in a ring of kStages (cp.async, one
// commit group per block). Per key block, three steps between three barriers:
//   1. S = Q K^T. A 16-row tile gives too few (row, key) tiles for 8 warps, so the 36 k-steps of
//      the 576 columns are cut into kKSplit slices: warp (row tile, key tile of 16, k slice)
//      writes its partial 16 x 16 sums into sS[slice] (f32).
//   2. Softmax: 256 / kBlockM consecutive threads per row sum the slices, apply the logit rules
//      (mask.cuh: window, key length, softcap, ALiBi per row's head) and the online softmax
//      (softmax.cuh; the running max and sum live in the row's threads), write P (T) into sP and
//      the factor that rescales the row's earlier output into sCorr.
//   3. O += P V: warp (row tile, column group) owns kOutCols output columns in registers.
// The barriers: (A) block it has landed and every warp is done with block it - 1's P V, so its
// stage may be refilled; (B) the S partials are complete; (C) P and sCorr are complete. The next
// (A) also orders step 3's reads of sP before the next step 2's writes, and (B) step 2's reads
// of sS before the next step 1's writes (they are two barriers apart).
#include "../config.cuh"
#include "../launch.cuh"
#include "../common/softmax.cuh"
#include "split_combine.cuh"

namespace cf {

template <typename Kt>
__global__ void __launch_bounds__(Kt::kNThreads, 1) wide_split_fwd_kernel(const CfFwdParams p, const SplitArgs sa) {
    using T = typename Kt::Elem;
    constexpr int BM = Kt::kBlockM, BN = Kt::kBlockN, S = Kt::kStages, NTH = Kt::kNThreads;
    constexpr int CK = Kt::kCk, CV = Kt::kCv, CP = BN / 8, E = kChunkElems<T>;
    constexpr int MW = Kt::kMTiles, NW = Kt::kNTiles, KSW = Kt::kKSteps, LDS = Kt::kLdS;
    constexpr int DV = Kt::kVDim, CPW = Kt::kOutCols, NTV = CPW / 8;
    constexpr int TPR = NTH / BM, CPT = BN / TPR;  // softmax: threads per row, columns per thread
    static_assert(CPT == 2 || CPT == 8, "the softmax step's P stores: one pair or one chunk per thread");

    extern __shared__ __align__(128) unsigned char smem[];
    T* sQ = reinterpret_cast<T*>(smem);
    T* sRing = reinterpret_cast<T*>(smem + Kt::kQBytes);
    float* sS = reinterpret_cast<float*>(smem + Kt::kQBytes + S * Kt::kStageBytes);
    T* sP = reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(sS) + Kt::kSBytes);
    float* sCorr = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(sP) + Kt::kPBytes);
    float* sInv = sCorr + BM;
    auto stage_k = [&](int st) { return sRing + st * (Kt::kStageBytes / 2); };
    auto stage_v = [&](int st) { return Kt::kVInK ? stage_k(st) : stage_k(st) + BN * Kt::kQkDim; };

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, q4 = lane & 3;
    // (direct, causal-like masks: the last query blocks see the most keys, so they start first)
    const bool reversed = sa.direct && p.window_right >= 0 && p.window_left < 0;
    const int mx = blockIdx.x % sa.mblocks, split = blockIdx.x / sa.mblocks, b = blockIdx.z;
    const int mb = reversed ? sa.mblocks - 1 - mx : mx;
    const int h0 = blockIdx.y * sa.pack, hk = kv_head(p, h0);
    const SeqInfo si(p, b, KvKind<KvPath::kAny>{});
    const int sq = si.sq, R = sa.pack * sq;
    const int m0 = mb * BM;
    if (m0 >= R) return;
    const int nrows = min(BM, R - m0);
    const int dch = p.d / E, dvch = head_dim_v(p) / E;
    int i_lo, i_hi;
    packed_query_range(m0, nrows, sq, i_lo, i_hi);
    const int64_t SQ = p.seqlen_q;
    const int64_t part_b = ((int64_t)split * p.b + b) * p.h;  // + head, then * SQ + query
    const MaskInfo mk(sq, si.sk, p.window_left, p.window_right);
    int n_lo, n_hi, nb_lo, nb_hi;
    split_key_blocks<BN>(mk, i_lo, i_hi, split, sa.bps, n_lo, n_hi, nb_lo, nb_hi);
    const int dv = head_dim_v(p);
    if (n_hi <= n_lo || nb_hi <= nb_lo) {  // no key: -inf partials, or o = 0 and lse = the sink
        for (int r = tid; r < nrows; r += NTH) {
            const int rr = m0 + r, head = h0 + rr / sq, query = rr % sq;
            if (!sa.direct) {
                sa.lpart[(part_b + head) * SQ + query] = -INFINITY;
                continue;
            }
            T* og = si.o<T>(p, head) + (int64_t)query * p.o_row_stride;
            for (int c = 0; c < dv; c += E) *reinterpret_cast<uint4*>(og + c) = make_uint4(0, 0, 0, 0);
            si.lse(p, head)[query] = sink_logit(p, head);
        }
        return;
    }

    // Q rows (zeros past d and past the last row), in the first commit group
    for (int idx = tid; idx < BM * CK; idx += NTH) {
        const int r = idx / CK, c = idx % CK;
        const int rr = m0 + r;
        const bool ok = r < nrows && c < dch;
        const T* src = ok ? si.q<T>(p, h0 + rr / sq) + (int64_t)(rr % sq) * p.q_row_stride + c * E : static_cast<const T*>(p.q);
        cp_async_16(smem_addr(sQ + swz<CK>(r, c) * E), src, ok);
    }
    const T* kg = si.k<T>(p, hk);
    const T* vg = si.v<T>(p, hk);
    auto load_block = [&](int st, int nb) {
        const int n0 = nb * BN;
        si.template load_keys<TileLoader<CK, NTH>, BN>(p, stage_k(st), kg, p.k_batch_stride, p.k_row_stride, n0, dch,
                                                       tid, p.k);
        if constexpr (!Kt::kVInK)
            si.template load_keys<TileLoader<CV, NTH>, BN>(p, stage_v(st), vg, p.v_batch_stride, p.v_row_stride, n0,
                                                           dvch, tid, p.v);
    };
    const int nblk = nb_hi - nb_lo;
#pragma unroll
    for (int st = 0; st < S - 1; ++st) {
        if (st < nblk) load_block(st, nb_lo + st);
        cp_async_commit();
    }

    // step 1's warp roles
    const int s_mt = warp % MW, s_nt = (warp / MW) % NW, s_ks0 = (warp / (MW * NW)) * KSW;
    // step 2's: row sr, columns [sc0, sc0 + CPT); the row's head and query, its logit rules
    const int sr = tid / TPR, sc0 = (tid % TPR) * CPT;
    const bool row_ok = sr < nrows;
    const int s_head = h0 + (m0 + sr) / sq, s_query = (m0 + sr) % sq;
    const LogitInfo li(p, b, row_ok ? s_head : h0);
    OnlineSoftmax<1, TPR> softmax;
    // step 3's: row tile o_mt, output columns [o_c0, o_c0 + CPW)
    const int o_mt = warp % MW, o_c0 = (warp / MW) * CPW;
    float acc[1][NTV][4];
#pragma unroll
    for (int t = 0; t < NTV; ++t) acc[0][t][0] = acc[0][t][1] = acc[0][t][2] = acc[0][t][3] = 0.f;

    const SwzPtr<CK> pq(sQ, s_mt * 16 + (lane & 15), lane >> 4);
    for (int it = 0; it < nblk; ++it) {
        cp_async_wait<S - 2>();
        __syncthreads();  // (A)
        {
            const int nx = it + S - 1;
            if (nx < nblk) load_block(nx % S, nb_lo + nx);
            cp_async_commit();
        }
        const int st = it % S, n0 = (nb_lo + it) * BN;
        {  // 1. S partials: two accumulation chains per key tile (even / odd k-steps)
            const SwzPtr<CK> pk(stage_k(st), s_nt * 16 + (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
            float s[2][2][4];
#pragma unroll
            for (int c = 0; c < 2; ++c)
#pragma unroll
                for (int t = 0; t < 2; ++t) s[c][t][0] = s[c][t][1] = s[c][t][2] = s[c][t][3] = 0.f;
            // (36 k-steps of the 64-row tile: unrolled by 4, fully the fragment loads of all of
            // them are hoisted next to the 128 output registers and spill)
#pragma unroll(KSW > 16 ? 4 : KSW)
            for (int ks = 0; ks < KSW; ++ks) {
                const int cc = 2 * (s_ks0 + ks);
                uint32_t a[4], kb[4];
                ldsm_x4(a, pq.at(0, cc));
                ldsm_x4(kb, pk.at(0, cc));
                mma16816<T>(s[ks & 1][0], a, kb[0], kb[1]);
                mma16816<T>(s[ks & 1][1], a, kb[2], kb[3]);
            }
            float* dst = sS + ((s_ks0 / KSW) * BM + s_mt * 16 + g) * LDS + s_nt * 16 + 2 * q4;
#pragma unroll
            for (int t = 0; t < 2; ++t)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh)
                    *reinterpret_cast<float2*>(dst + hh * 8 * LDS + 8 * t) =
                        make_float2(s[0][t][2 * hh] + s[1][t][2 * hh], s[0][t][2 * hh + 1] + s[1][t][2 * hh + 1]);
        }
        __syncthreads();  // (B)
        {  // 2. softmax of row sr, columns sc0..: x in log2 units, -inf where hidden
            const bool full = !li.general && mk.block_full(i_lo, i_hi - i_lo + 1, n0, BN);
            float x[CPT];
#pragma unroll
            for (int e = 0; e < CPT; ++e) x[e] = 0.f;
#pragma unroll
            for (int ksl = 0; ksl < Kt::kKSplit; ++ksl)
#pragma unroll
                for (int e = 0; e < CPT; ++e) x[e] += sS[(ksl * BM + sr) * LDS + sc0 + e];
            float local_max = -INFINITY;
#pragma unroll
            for (int e = 0; e < CPT; ++e) {
                const int j = n0 + sc0 + e;
                float v;
                if (li.general) {
                    float df;
                    v = li.logit(x[e], s_query, j, mk.off, &df) * kLog2e;
                } else {
                    v = x[e] * li.c;
                }
                if (!row_ok || (!full && !mk.visible(s_query, j))) v = -INFINITY;
                x[e] = v;
                local_max = fmaxf(local_max, v);
            }
            float corr;
            const float base = softmax.new_block_row(0, local_max, 1.f, corr);
            float sum = 0.f;
#pragma unroll
            for (int e = 0; e < CPT; ++e) {
                x[e] = ex2(x[e] - base);
                sum += x[e];
            }
            softmax.add_block_row(0, sum, corr);
            T* pdst = sP + swz<CP>(sr, sc0 / 8) * 8 + sc0 % 8;
            if constexpr (CPT == 2) {
                *reinterpret_cast<uint32_t*>(pdst) = pack2<T>(x[0], x[1]);
            } else {
                *reinterpret_cast<uint4*>(pdst) =
                    make_uint4(pack2<T>(x[0], x[1]), pack2<T>(x[2], x[3]), pack2<T>(x[4], x[5]), pack2<T>(x[6], x[7]));
            }
            if (tid % TPR == 0) sCorr[sr] = corr;
        }
        __syncthreads();  // (C)
        {  // 3. O = O * corr + P V
            const float c_lo = sCorr[o_mt * 16 + g], c_hi = sCorr[o_mt * 16 + g + 8];
#pragma unroll
            for (int t = 0; t < NTV; ++t) {
                acc[0][t][0] *= c_lo;
                acc[0][t][1] *= c_lo;
                acc[0][t][2] *= c_hi;
                acc[0][t][3] *= c_hi;
            }
            // in column groups of at most 64 (8 n8 tiles): one call over the 64-row tile's 256
            // columns hoists all 32 B fragment loads next to the 128 output registers and spills
            constexpr int G = NTV < 8 ? NTV : 8;
#pragma unroll
            for (int c = 0; c < NTV / G; ++c)
                gemm_ab_16<1, G, BN / 16, CP, CV, 2, T>(*reinterpret_cast<float(*)[1][G][4]>(&acc[0][c * G][0]), sP,
                                                        o_mt * 16, stage_v(st), o_c0 / 8 + c * G, 0, lane);
        }
    }
    cp_async_wait<0>();

    // Epilogue: 1 / l and lse per row (the sink is the combine's), then the normalised partials.
    // (direct: the sink joins the denominator here, as in the one-pass kernels)
    {
        float lse;
        const float sink = sa.direct && row_ok ? sink_logit(p, s_head) : -INFINITY;
        const float inv = softmax.finish_row(0, 1.f, lse, sink);
        if (tid % TPR == 0) {
            sInv[sr] = inv;
            if (row_ok) {
                if (sa.direct)
                    si.lse(p, s_head)[s_query] = lse;
                else
                    sa.lpart[(part_b + s_head) * SQ + s_query] = lse;
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int rl = o_mt * 16 + g + 8 * hh;
        if (rl < nrows) {
            const int rr = m0 + rl, head = h0 + rr / sq, query = rr % sq;
            const float inv = sInv[rl];
            if (sa.direct) {
                T* og = si.o<T>(p, head) + (int64_t)query * p.o_row_stride + o_c0 + 2 * q4;
#pragma unroll
                for (int t = 0; t < NTV; ++t)
                    if (o_c0 + 8 * t < dv)
                        *reinterpret_cast<uint32_t*>(og + 8 * t) =
                            pack2<T>(acc[0][t][2 * hh] * inv, acc[0][t][2 * hh + 1] * inv);
            } else {
                float* op = sa.opart + ((part_b + head) * SQ + query) * DV + o_c0 + 2 * q4;
#pragma unroll
                for (int t = 0; t < NTV; ++t)
                    *reinterpret_cast<float2*>(op + 8 * t) =
                        make_float2(acc[0][t][2 * hh] * inv, acc[0][t][2 * hh + 1] * inv);
            }
        }
    }
}

template <typename Kt>
cudaError_t launch_wide_split(const CfFwdParams& p, const SplitArgs& sa, cudaStream_t stream) {
    auto kern = wide_split_fwd_kernel<Kt>;
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, Kt::kSmemBytes);
    if (e != cudaSuccess) return e;
    const dim3 grid(sa.mblocks * sa.nsplit, p.h / sa.pack, p.b);
    kern<<<grid, Kt::kNThreads, Kt::kSmemBytes, stream>>>(p, sa);
    return cudaGetLastError();
}

template <typename T>
cudaError_t run_fwd_wide_split(const CfFwdParams& p, const SplitPlan& sp, void* workspace, cudaStream_t stream) {
    if (workspace == nullptr && sp.nsplit > 1) return cudaErrorInvalidValue;
    SplitArgs sa;
    sa.nsplit = sp.nsplit;
    sa.bps = sp.bps;
    sa.pack = sp.pack;
    sa.mblocks = sp.mblocks;
    sa.direct = sp.nsplit == 1;
    sa.opart = static_cast<float*>(workspace);
    sa.lpart = reinterpret_cast<float*>(static_cast<char*>(workspace) + sp.opart_bytes);
    if (sp.wide == WideSplit::kNone) return cudaErrorInvalidValue;
    const cudaError_t e =
        with_wide_split_traits<T>(sp.wide, [&](auto kt) { return launch_wide_split<decltype(kt)>(p, sa, stream); });
    if (e != cudaSuccess || sa.direct) return e;
    const int64_t nrow = (int64_t)p.b * p.h * p.seqlen_q;
    split_combine_kernel<T, kWideSplitVDim><<<(unsigned)((nrow + 3) / 4), 128, 0, stream>>>(p, sa);
    return cudaGetLastError();
}

template cudaError_t run_fwd_wide_split<__half>(const CfFwdParams&, const SplitPlan&, void*, cudaStream_t);
template cudaError_t run_fwd_wide_split<__nv_bfloat16>(const CfFwdParams&, const SplitPlan&, void*, cudaStream_t);

}  // namespace cf
