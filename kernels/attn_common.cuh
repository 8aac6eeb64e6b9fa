// Attention semantics shared by every kernel: where a sequence lives (batched or varlen), which
// keys a query sees (window / causal), how a raw q.k becomes a logit (scale, softcap, ALiBi), and
// the backward workspace description. See flash_api.h for the contract.
#pragma once
#include <math.h>
#include "flash_api.h"
#include "tile.cuh"

namespace cf {

// One sequence of the batch.
struct SeqInfo {
    int sq, sk;               // this sequence's lengths
    int64_t q_row0, k_row0;   // index of its row 0 among all rows (b*seqlen, or cu_seqlens[b])
    bool q_varlen, k_varlen;

    __device__ __forceinline__ SeqInfo(const CfFwdParams& p, int b) {
        q_varlen = p.cu_seqlens_q != nullptr;
        k_varlen = p.cu_seqlens_k != nullptr;
        if (q_varlen) {
            const uint32_t s = p.cu_seqlens_q[b], e = p.cu_seqlens_q[b + 1];
            q_row0 = s;
            sq = int(e - s);
        } else {
            q_row0 = int64_t(b) * p.seqlen_q;
            sq = p.seqlen_q;
        }
        if (k_varlen) {
            const uint32_t s = p.cu_seqlens_k[b], e = p.cu_seqlens_k[b + 1];
            k_row0 = s;
            sk = int(e - s);
        } else {
            k_row0 = int64_t(b) * p.seqlen_k;
            sk = p.seqlen_k;
        }
    }
    // Element offset of (this sequence's row 0, head 0) in a q-side / k-side tensor.
    __device__ __forceinline__ int64_t q_off(int b, int64_t batch_stride, int64_t row_stride) const {
        return q_varlen ? q_row0 * row_stride : int64_t(b) * batch_stride;
    }
    __device__ __forceinline__ int64_t k_off(int b, int64_t batch_stride, int64_t row_stride) const {
        return k_varlen ? k_row0 * row_stride : int64_t(b) * batch_stride;
    }
};

// Visibility of key j to query i: i + off - wl <= j <= i + off + wr, off = sk - sq, a negative
// window bound meaning unbounded on that side.
struct MaskInfo {
    int sq, sk, off, wl, wr;

    __device__ __forceinline__ MaskInfo(int sq_, int sk_, int wl_, int wr_)
        : sq(sq_), sk(sk_), off(sk_ - sq_), wl(wl_), wr(wr_) {}

    __device__ __forceinline__ bool visible(int i, int j) const {
        if (j >= sk) return false;
        const int rel = j - i - off;
        return (wl < 0 || rel >= -wl) && (wr < 0 || rel <= wr);
    }
    // visible() for one query row as limits: key j is visible to query i iff lo <= j <= hi
    // (lo > hi: none). Lets a masking loop do two integer compares per element.
    __device__ __forceinline__ void row_limits(int i, int& lo, int& hi) const {
        const long long l = wl < 0 ? 0LL : (long long)i + off - wl;
        const long long h = wr < 0 ? (long long)sk - 1 : (long long)i + off + wr;
        lo = (int)(l < 0 ? 0 : (l > sk ? (long long)sk : l));
        hi = (int)(h >= sk ? (long long)sk - 1 : (h < -1 ? -1LL : h));
    }
    // Keys [lo, hi) seen by at least one query of rows [r0, r1] (inclusive, r0 <= r1).
    __device__ __forceinline__ void key_range(int r0, int r1, int& lo, int& hi) const {
        const long long l = wl < 0 ? 0LL : (long long)r0 + off - wl;
        const long long h = wr < 0 ? (long long)sk : (long long)r1 + off + wr + 1;
        lo = (int)(l < 0 ? 0 : l);
        hi = (int)(h > sk ? (long long)sk : h);
    }
    // Queries [lo, hi) that see at least one key of [c0, c1] (inclusive, c0 <= c1 < sk).
    __device__ __forceinline__ void query_range(int c0, int c1, int& lo, int& hi) const {
        const long long l = wr < 0 ? 0LL : (long long)c0 - off - wr;
        const long long h = wl < 0 ? (long long)sq : (long long)c1 - off + wl + 1;
        lo = (int)(l < 0 ? 0 : l);
        hi = (int)(h > sq ? (long long)sq : h);
    }
    // True when every (i, j) of rows [r0, r0+nr) x keys [c0, c0+nc) passes the key-length and
    // window tests (the row-length test is the caller's business).
    __device__ __forceinline__ bool block_full(int r0, int nr, int c0, int nc) const {
        if (c0 + nc > sk) return false;
        const long long rel_min = (long long)c0 - (r0 + nr - 1) - off;
        const long long rel_max = (long long)(c0 + nc - 1) - r0 - off;
        return (wl < 0 || rel_min >= -(long long)wl) && (wr < 0 || rel_max <= (long long)wr);
    }
};

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
        general = softcap > 0.f || p.alibi_slopes != nullptr || !(scale > 0.f);
        c = scale * kLog2e;
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

// Backward: P and dS of one score element; masked -> 0. lse2 = lse * log2 e (+inf for rows seeing nothing).
struct PdS {
    float p, ds;
};
__device__ __forceinline__ PdS p_ds(const LogitInfo& li, float qk, float dp, float lse2, float dsum,
                                    int i, int j, int off, bool visible) {
    float x2, df = 1.f;
    if (li.general) {
        x2 = li.logit(qk, i, j, off, &df) * kLog2e;
    } else {
        x2 = qk * li.c;
    }
    const float pv = visible ? ex2(x2 - lse2) : 0.f;
    return {pv, pv * (dp - dsum) * df};
}
__device__ __forceinline__ float lse_to_log2(float lse) {
    return lse == -INFINITY ? INFINITY : lse * kLog2e;
}

// Backward scratch memory (all f32). Offsets are rounded up to 256 bytes.
//   dsum     [h][total_q]                 D_i = rowsum(dO * O)
//   dq_accum [total_q][h][d]              only for the tensor-core path with atomics
//   dkv      [2][nsplit][total_k][hkv][d] only when the query heads of a KV head are split
//                                          over nsplit CTAs (GQA/MQA): dK part, then dV part
struct BwdWs {
    float* dsum;
    float* dq_accum;
    float* dkv;
    int nsplit;    // CTAs sharing the query heads of one KV head (1 = write dk/dv directly)
    int hps;       // query heads per split
    int64_t total_q, total_k;
};

}  // namespace cf
