// Which keys a query sees and what its logits are: the attention rules of flash_api.h written
// once for every kernel. MaskInfo (causal / sliding window, bottom-right aligned, key length),
// LogitInfo (scale, softcap, ALiBi), then the two ways kernels apply them: mask_scores() on a
// forward score fragment and p_ds() on one backward score element. The CPU path
// (src/cpu/) and the reference (src/reference.rs) implement the same rules; docs/kernels.md
// has the table of where each rule lives.
#pragma once
#include <math.h>
#include "seq.cuh"

namespace cf {

// Visibility of key j to query i: i + off - wl <= j <= i + off + wr, off = sk - sq, a negative
// window bound meaning unbounded on that side.
struct MaskInfo {
    int sq, sk, off, wl, wr;

    // A window at least sq + sk wide hides nothing: it is stored as unbounded (-1), so every
    // quantity below stays within +-2 (sq + sk) and 32-bit arithmetic is exact (dispatch.cu
    // rejects seqlen_q + seqlen_k >= 2^29). 32-bit math keeps these helpers cheap in registers,
    // which matters in the warp-specialised producer (kProducerRegs).
    __device__ __forceinline__ MaskInfo(int sq_, int sk_, int wl_, int wr_) : sq(sq_), sk(sk_), off(sk_ - sq_) {
        const int span = sq_ + sk_;
        wl = (wl_ < 0 || wl_ >= span) ? -1 : wl_;
        wr = (wr_ < 0 || wr_ >= span) ? -1 : wr_;
    }

    __device__ __forceinline__ bool visible(int i, int j) const {
        if (j >= sk) return false;
        const int rel = j - i - off;
        return (wl < 0 || rel >= -wl) && (wr < 0 || rel <= wr);
    }
    // visible() for one query row as limits: key j is visible to query i iff lo <= j <= hi
    // (lo > hi: none). Lets a masking loop do two integer compares per element.
    __device__ __forceinline__ void row_limits(int i, int& lo, int& hi) const {
        const int l = wl < 0 ? 0 : i + off - wl;
        const int h = wr < 0 ? sk - 1 : i + off + wr;
        lo = l < 0 ? 0 : (l > sk ? sk : l);
        hi = h >= sk ? sk - 1 : (h < -1 ? -1 : h);
    }
    // Keys [lo, hi) seen by at least one query of rows [r0, r1] (inclusive, r0 <= r1).
    __device__ __forceinline__ void key_range(int r0, int r1, int& lo, int& hi) const {
        const int l = wl < 0 ? 0 : r0 + off - wl;
        const int h = wr < 0 ? sk : r1 + off + wr + 1;
        lo = l < 0 ? 0 : l;
        hi = h > sk ? sk : h;
    }
    // Queries [lo, hi) that see at least one key of [c0, c1] (inclusive, c0 <= c1 < sk).
    __device__ __forceinline__ void query_range(int c0, int c1, int& lo, int& hi) const {
        const int l = wr < 0 ? 0 : c0 - off - wr;
        const int h = wl < 0 ? sq : c1 - off + wl + 1;
        lo = l < 0 ? 0 : l;
        hi = h > sq ? sq : h;
    }
    // visible() for one key column as limits: query i (< sq) sees key j iff lo <= i < hi (the
    // transposed backward masks its columns of queries with two compares per element).
    __device__ __forceinline__ void col_limits(int j, int& lo, int& hi) const {
        query_range(j, j, lo, hi);
        if (j >= sk) hi = lo;
    }
    // True when every (i, j) of rows [r0, r0+nr) x keys [c0, c0+nc) passes the key-length and
    // window tests (the row-length test is the caller's business).
    __device__ __forceinline__ bool block_full(int r0, int nr, int c0, int nc) const {
        if (c0 + nc > sk) return false;
        const int rel_min = c0 - (r0 + nr - 1) - off;
        const int rel_max = (c0 + nc - 1) - r0 - off;
        return (wl < 0 || rel_min >= -wl) && (wr < 0 || rel_max <= wr);
    }
};

// The mm_prefix_ranges of one sequence (flash_api.h): a query at position pos = i + sk - sq also
// sees keys [lo, hi), the union of the ranges [start, end) that hold pos (ranges that all hold
// one position overlap, so the union is one interval), cut to [0, sk). The values are device data
// nothing checked: an empty or reversed range selects nothing, and the cut keeps every key read
// inside the sequence. The SIMT forward is the only kernel that reads them (plan.cu).
struct PrefixRanges {
    const int32_t* r;  // [n][2] of this sequence, or NULL
    int n;

    __device__ __forceinline__ PrefixRanges(const CfFwdParams& p, int b)
        : r(p.prefix_ranges ? p.prefix_ranges + (int64_t)b * p.prefix_max_ranges * 2 : nullptr),
          n(p.prefix_ranges ? p.prefix_max_ranges : 0) {}

    // Keys [lo, hi) of the query at position pos (lo >= hi: none).
    __device__ __forceinline__ void keys(int pos, int sk, int& lo, int& hi) const {
        lo = sk;
        hi = 0;
        for (int k = 0; k < n; ++k) {
            const int s = r[2 * k], e = r[2 * k + 1];
            if (s < e && s <= pos && pos < e) {
                lo = min(lo, s);
                hi = max(hi, e);
            }
        }
        lo = max(lo, 0);
        hi = min(hi, sk);
    }
};

// Whether any head's logits need the general path (softcap, ALiBi, a scale that is not
// positive): a property of the call, so a kernel may also be chosen by it on the host.
__host__ __device__ inline bool logits_general(const CfFwdParams& p) {
    return p.softcap > 0.f || p.alibi_slopes != nullptr || !(p.softmax_scale > 0.f);
}

// raw q.k -> logit. The tensor-core kernels work in log2 units (x2 = logit * log2 e); on the
// fast path (no softcap, no ALiBi, scale > 0) x2 = qk * c with c = scale * log2 e, which lets
// the softmax use one FFMA + EX2 per element.
struct LogitInfo {
    float scale, softcap, inv_softcap, slope, c;
    bool general;

    __device__ __forceinline__ LogitInfo(const CfFwdParams& p, int b, int h) {
        scale = p.softmax_scale;
        softcap = p.softcap > 0.f ? p.softcap : 0.f;
        inv_softcap = softcap > 0.f ? 1.f / softcap : 0.f;
        slope = p.alibi_slopes ? p.alibi_slopes[(int64_t)b * p.alibi_batch_stride + h] : 0.f;
        general = logits_general(p);
        c = scale * kLog2e;
    }
    // Logits of q.k * f instead of q.k (FP8 inputs: f = q descale * k descale).
    __device__ __forceinline__ void rescale(float f) {
        scale *= f;
        c = scale * kLog2e;
        general = general || !(scale > 0.f);
    }
    // Natural-log logit; *dfac = d logit / d (scale*qk) (the softcap's tanh derivative).
    __device__ __forceinline__ float logit(float qk, int i, int j, int off, float* dfac) const {
        float v = qk * scale;
        float df = 1.f;
        if (softcap > 0.f) {
            const float t = tanhf(v * inv_softcap);
            v = softcap * t;
            df = 1.f - t * t;
        }
        if (slope != 0.f) {
            const int dist = i + off - j;
            v -= slope * (float)(dist < 0 ? -dist : dist);
        }
        *dfac = df;
        return v;
    }
};

// The descale of (sequence b, head x) of an e4m3 input (flash_api.h); 1 when there is none.
__device__ __forceinline__ float descale_of(const CfDescale& d, int b, int x) {
    return d.ptr ? d.ptr[(int64_t)b * d.batch_stride + x / d.head_div] : 1.f;
}

// Which (query block, head, sequence) a CTA of a one-CTA-per-query-block grid works on. With
// causal-like masks (right window bounded, left unbounded) the last query blocks see the most
// keys, so they are started first: the grid (query block, head, sequence), launched x fastest,
// takes its query blocks reversed within each head. With `across_heads` (the host's choice:
// plan.cuh heavy_first_order / mma_sync_heavy_first, grids of a few waves) the grid is
// launched (head, sequence, query block) instead (`grid`), i.e. query block slowest, reversed:
// every head's last block starts before any head's second last, where in the first order the
// last heads' heaviest blocks would start in the last wave and set its length. (Swapping the
// grid's axes, rather than renumbering a flat index, keeps integer divisions out of the
// kernels' prologue.)
struct QueryBlockCta {
    int qb, h, b;
    __host__ static dim3 grid(int query_blocks, int h, int b, bool across_heads) {
        return across_heads ? dim3(h, b, query_blocks) : dim3(query_blocks, h, b);
    }
    __device__ __forceinline__ static QueryBlockCta of(const CfFwdParams& p, bool across_heads) {
        if (across_heads) return {(int)(gridDim.z - 1 - blockIdx.z), (int)blockIdx.x, (int)blockIdx.y};
        const bool reversed = p.window_right >= 0 && p.window_left < 0;
        return {(int)(reversed ? gridDim.x - 1 - blockIdx.x : blockIdx.x), (int)blockIdx.y, (int)blockIdx.z};
    }
};

// What a CTA of a one-CTA-per-query-block grid works on (QueryBlockCta): rows [m0, m_last] of
// head h (KV head hk), which see keys [n_lo, n_hi). The forward and the dQ kernels (sm80, SIMT)
// start from it.
// kPath: which K/V the kernel reads (SeqInfo).
template <KvPath kPath = KvPath::kContiguous>
struct QueryBlockWork {
    SeqInfo si;
    MaskInfo mk;
    int h, hk, m0, m_last, n_lo, n_hi;

    __device__ __forceinline__ QueryBlockWork(const CfFwdParams& p, int block_m, bool across_heads = false)
        : QueryBlockWork(p, block_m, QueryBlockCta::of(p, across_heads)) {}
    __device__ __forceinline__ QueryBlockWork(const CfFwdParams& p, int block_m, QueryBlockCta c)
        : si(p, c.b, KvKind<kPath>{}), mk(si.sq, si.sk, p.window_left, p.window_right) {
        h = c.h;
        hk = kv_head(p, h);
        m0 = c.qb * block_m;
        m_last = min(m0 + block_m, si.sq) - 1;
        mk.key_range(m0, m_last, n_lo, n_hi);
    }
    // No row of this block exists in its sequence (return before touching anything).
    __device__ __forceinline__ bool empty() const { return m0 >= si.sq; }
    // The block's rows see no key (o = 0, lse = -inf in the forward; dq = 0).
    __device__ __forceinline__ bool no_keys() const { return n_hi <= n_lo; }
};

// Logit and visibility of one score: -inf when key j is hidden from query i. The SIMT kernels
// call it per element; mask_scores() below is the same rule over a tensor-core fragment.
__device__ __forceinline__ float masked_logit(const LogitInfo& li, const MaskInfo& mk, float qk, int i, int j) {
    float df;
    const float x = li.logit(qk, i, j, mk.off, &df);
    return mk.visible(i, j) ? x : -INFINITY;
}

// Forward: applies the logit transform and the mask to a score fragment in the mma.sync / wgmma
// accumulator layout (s[(mt * NT + t) * 4 + e]: row row_of(mt, e >> 1), key j0 + 8 t + 2 q4 +
// (e & 1); q4 = lane & 3). On return s holds, per element, x with x * c the log2-scaled logit
// (c = LogitInfo::c on the plain path, where x is the raw q.k; kLog2e on the general path, where
// x is the natural logit), -inf where masked. `full`: the caller knows every element is visible
// (then the plain path does nothing at all).
// Plain logits (causal / window / key-length masks only): the visible keys of a row are one
// interval, so each element costs two compares against a compile-time column offset.
template <int MT, int NT, typename RowOf>
__device__ __forceinline__ void mask_scores(float* s, const LogitInfo& li, const MaskInfo& mk, RowOf row_of, int j0,
                                            int q4, bool full) {
    if (li.general) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = row_of(mt, e >> 1);
                    const int j = j0 + 8 * t + 2 * q4 + (e & 1);
                    float df;
                    const float x = li.logit(s[(mt * NT + t) * 4 + e], i, j, mk.off, &df);
                    s[(mt * NT + t) * 4 + e] = (full || mk.visible(i, j)) ? x : -INFINITY;
                }
    } else if (!full) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                int lo, hi;
                mk.row_limits(row_of(mt, r), lo, hi);
                lo -= j0 + 2 * q4;  // column of element (t, e) relative to this lane: 8t + e
                hi -= j0 + 2 * q4;
#pragma unroll
                for (int t = 0; t < NT; ++t)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int c = 8 * t + e;
                        if (c < lo || c > hi) s[(mt * NT + t) * 4 + 2 * r + e] = -INFINITY;
                    }
            }
    }
}

// Backward: P and dS of one score element, from the raw q.k, dP = dO.v, the row's lse and
// dsum = rowsum(dO * O); hidden (or past the sequence) -> 0. Units: the tensor-core kernels
// work in log2 units (Log2Units: lse2 = lse * log2 e, ex2.approx), the f32 SIMT kernels in
// natural units (NaturalUnits: lse as is, expf) for f32 accuracy. kPlainFull: the caller knows
// every element of its block is visible and the logits are plain (no index math at all).
struct Log2Units {
    static __device__ __forceinline__ float lse(float lse_nat) { return lse_nat == -INFINITY ? INFINITY : lse_nat * kLog2e; }
    static __device__ __forceinline__ float exp(float x) { return ex2(x); }
    static constexpr float kPerNat = kLog2e;  // units per natural-log unit
};
struct NaturalUnits {
    static __device__ __forceinline__ float lse(float lse_nat) { return lse_nat == -INFINITY ? INFINITY : lse_nat; }
    static __device__ __forceinline__ float exp(float x) { return expf(x); }
    static constexpr float kPerNat = 1.f;
};
struct PdS {
    float p, ds;
};
// The two halves of p_ds for plain logits (li.general false: no derivative factor), for kernels
// that compute P while dP is still in flight and dS once it has landed; p_ds uses them too.
template <typename Units = Log2Units, bool kPlainFull = false>
__device__ __forceinline__ float p_plain(const LogitInfo& li, const MaskInfo& mk, float qk, float lse_u, int i, int j,
                                         bool full) {
    const float c = Units::kPerNat == kLog2e ? li.c : li.scale * Units::kPerNat;  // plain logit -> units
    if constexpr (kPlainFull) {
        return Units::exp(fmaf(qk, c, -lse_u));
    } else {
        const bool vis = full || (i < mk.sq && mk.visible(i, j));
        return vis ? Units::exp(qk * c - lse_u) : 0.f;
    }
}
__device__ __forceinline__ float ds_of(float p, float dp, float dsum) { return p * (dp - dsum); }

template <typename Units = Log2Units, bool kPlainFull = false>
__device__ __forceinline__ PdS p_ds(const LogitInfo& li, const MaskInfo& mk, float qk, float dp, float lse_u,
                                    float dsum, int i, int j, bool full) {
    if (kPlainFull || !li.general) {
        const float pv = p_plain<Units, kPlainFull>(li, mk, qk, lse_u, i, j, full);
        return {pv, ds_of(pv, dp, dsum)};
    } else {
        float df;
        const float x = li.logit(qk, i, j, mk.off, &df) * Units::kPerNat;
        const bool vis = full || (i < mk.sq && mk.visible(i, j));
        const float pv = vis ? Units::exp(x - lse_u) : 0.f;
        return {pv, ds_of(pv, dp, dsum) * df};
    }
}

}  // namespace cf
