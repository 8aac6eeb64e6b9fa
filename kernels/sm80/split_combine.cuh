// The split-KV forwards' partial results and their merge (sm80/fwd_split.cu, sm80/fwd_wide_split.cu):
// each split writes its rows' normalised O (f32) and natural-log lse into the caller's workspace
// (SplitPlan), split_combine_kernel merges them into o and lse.
#pragma once
#include "../config.cuh"
#include "../common/softmax.cuh"

namespace cf {

struct SplitArgs {
    float* opart;  // [nsplit][b][h][seqlen_q][dpad]
    float* lpart;  // [nsplit][b][h][seqlen_q]
    int nsplit, bps, pack, mblocks;
    // The wide-head kernel with one split: it writes o and lse itself (no partials, no combine).
    bool direct;
};

// The query indices [i_lo, i_hi] that the rows [m0, m0 + nrows) of a packed tile (row r = head
// r / sq, query r % sq: a KV group's heads x queries) cover: the rows' own range when they lie in
// one head, the whole sequence when they span two.
__device__ __forceinline__ void packed_query_range(int m0, int nrows, int sq, int& i_lo, int& i_hi) {
    if (m0 / sq == (m0 + nrows - 1) / sq) {
        i_lo = m0 % sq;
        i_hi = (m0 + nrows - 1) % sq;
    } else {
        i_lo = 0;
        i_hi = sq - 1;
    }
}

// The keys [n_lo, n_hi) that the query rows [i_lo, i_hi] see (MaskInfo::key_range) and, of the
// blocks of BN keys they touch, those of split `split` (bps blocks a split): [nb_lo, nb_hi).
template <int BN>
__device__ __forceinline__ void split_key_blocks(const MaskInfo& mk, int i_lo, int i_hi, int split, int bps, int& n_lo,
                                                 int& n_hi, int& nb_lo, int& nb_hi) {
    mk.key_range(i_lo, i_hi, n_lo, n_hi);
    nb_lo = max(n_lo / BN, split * bps);
    nb_hi = min((n_hi + BN - 1) / BN, (split + 1) * bps);
}

// One warp per (b, h, i) row: lse = log sum_s exp(lse_s); o = sum_s exp(lse_s - lse) o_s. An
// attention sink is one more partial, with lse_s = its logit and o_s = 0 (the splits know none).
// D: the row length of the partials (the kernel's value head-dim tile); head_dim_v(p) columns are
// written.
template <typename T, int D>
__global__ void __launch_bounds__(128) split_combine_kernel(const CfFwdParams p, const SplitArgs sa) {
    const int lane = threadIdx.x & 31;
    const int64_t SQ = p.seqlen_q;
    const int64_t row = (int64_t)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (row >= (int64_t)p.b * p.h * SQ) return;
    const int i = (int)(row % SQ);
    const int h = (int)((row / SQ) % p.h);
    const int b = (int)(row / (SQ * p.h));
    const SeqInfo si(p, b);
    if (i >= si.sq) return;
    const int64_t sstride = (int64_t)p.b * p.h * SQ;  // between splits
    const int64_t base = ((int64_t)b * p.h + h) * SQ + i;
    const float sink = sink_logit(p, h);
    float m = sink;
    for (int s = lane; s < sa.nsplit; s += 32) m = fmaxf(m, sa.lpart[base + s * sstride]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float lse = -INFINITY;
    if (m != -INFINITY) {
        float sum = 0.f;
        for (int s = lane; s < sa.nsplit; s += 32) {
            const float ls = sa.lpart[base + s * sstride];
            sum += ls == -INFINITY ? 0.f : expf(ls - m);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        lse = m + logf(sum + expf(sink - m));
    }
    T* og = si.o<T>(p, h) + (int64_t)i * p.o_row_stride;
    for (int c0 = lane * 4; c0 < head_dim_v(p); c0 += 128) {
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
        if (lse != -INFINITY) {
            for (int s = 0; s < sa.nsplit; ++s) {
                const float ls = sa.lpart[base + s * sstride];
                if (ls == -INFINITY) continue;
                const float w = expf(ls - lse);
                const float4 v = *reinterpret_cast<const float4*>(sa.opart + (base + s * sstride) * D + c0);
                a0 = fmaf(w, v.x, a0);
                a1 = fmaf(w, v.y, a1);
                a2 = fmaf(w, v.z, a2);
                a3 = fmaf(w, v.w, a3);
            }
        }
        if constexpr (std::is_same<T, float>::value)
            *reinterpret_cast<float4*>(og + c0) = make_float4(a0, a1, a2, a3);
        else
            *reinterpret_cast<uint2*>(og + c0) = make_uint2(pack2<T>(a0, a1), pack2<T>(a2, a3));
    }
    if (lane == 0)
        si.lse(p, h)[i] = lse;
}

}  // namespace cf
