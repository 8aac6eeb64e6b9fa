// Online softmax: the running row max and row sum that let the forward see the keys one block at
// a time and still produce exact softmax(x) V and the log-sum-exp. Written once for every
// forward kernel (sm80, split-KV, sm90 wgmma, f32 SIMT).
//
// Units. A kernel's scores x are in whatever units are cheapest for it; c maps them to the
// exponent's units (Units, mask.cuh): log2 units on tensor cores (ex2.approx; c = scale * log2 e
// for raw q.k, or log2 e for natural logits), natural units in f32 (expf; c = 1).
// Per row, after each block:  m' = max(m, max_j x_j);  P_j = exp_u(x_j c - m' c);
//   l' = l exp_u(m c - m' c) + sum_j P_j;   O' = O exp_u(m c - m' c) + P V.
// A row that has seen only masked keys keeps m = -inf; its exponent base is then 0, so every P
// is exp(-inf) = 0 and nothing is NaN. At the end o = O / l and lse = m c / kPerNat + log l
// (-inf and o = 0 when l = 0: the row saw no key).
#pragma once
#include <math.h>
#include "mask.cuh"

namespace cf {

// kRows rows per thread; each row is spread over kLanes consecutive lanes (4 in the mma layouts,
// 8 in the SIMT kernels), so maxima and sums are reduced over those lanes.
template <int kRows, int kLanes = 4, typename Units = Log2Units>
struct OnlineSoftmax {
    float row_max[kRows];  // running max of x (unscaled)
    float row_sum[kRows];  // running sum of P over this thread's columns (reduced at the end)

    __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            row_max[r] = -INFINITY;
            row_sum[r] = 0.f;
        }
    }

    // Row r meets a block whose largest x in this thread is `local_max`: updates the running max
    // and returns the exponent base m' c (0 while the row has seen nothing but masked keys) and,
    // in corr, the factor exp_u(m c - m' c) that rescales what was accumulated before.
    __device__ __forceinline__ float new_block_row(int r, float local_max, float c, float& corr) {
        const float m_new = fmaxf(row_max[r], group_max<kLanes>(local_max));
        const float base = (m_new == -INFINITY) ? 0.f : m_new * c;
        corr = Units::exp(row_max[r] * c - base);
        row_max[r] = m_new;
        return base;
    }
    __device__ __forceinline__ void add_block_row(int r, float block_sum, float corr) {
        row_sum[r] = row_sum[r] * corr + block_sum;
    }

    // One key block held as an accumulator fragment (mma.sync / wgmma layout: s[(mt * NT + t) * 4
    // + e] is row 2 mt + (e >> 1) of this thread). x -> P (unnormalised), running statistics
    // updated; corr[r] is what row r of the output must be multiplied by (the caller applies it
    // when its output accumulator is free: the sm90 kernel only after the previous P V is done).
    // kChains independent max / sum chains per row: the reductions are latency bound otherwise
    // (4 in the wgmma kernel; 1 where registers are tighter than latency, e.g. the sm_80 d = 128
    // kernel, which spills with 4).
    template <int MT, int NT, int kChains = 4, int DT = 0>
    __device__ __forceinline__ void step(float* s, float c, float (&corr)[kRows], float* o = nullptr) {
        static_assert(kRows == 2 * MT, "two accumulator rows per m16 tile");
        static_assert(kChains == 1 || kChains == 2 || kChains == 4, "chains");
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 2 * mt + h;
                float* sr = s + mt * NT * 4 + 2 * h;  // element (t, e) of row r: sr[4 t + e], e < 2
                float mx[kChains], sum[kChains];
#pragma unroll
                for (int k = 0; k < kChains; ++k) {
                    mx[k] = -INFINITY;
                    sum[k] = 0.f;
                }
#pragma unroll
                for (int t = 0; t < NT; ++t) mx[t % kChains] = fmaxf(mx[t % kChains], fmaxf(sr[4 * t], sr[4 * t + 1]));
#pragma unroll
                for (int k = 1; k < kChains; ++k) mx[0] = fmaxf(mx[0], mx[k]);
                const float base = new_block_row(r, mx[0], c, corr[r]);
#pragma unroll
                for (int t = 0; t < NT; ++t) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float pv = Units::exp(fmaf(sr[4 * t + e], c, -base));
                        sr[4 * t + e] = pv;
                        sum[t % kChains] += pv;
                    }
                }
                float total = sum[0];
#pragma unroll
                for (int k = 1; k < kChains; ++k) total += sum[k];
                add_block_row(r, total, corr[r]);
                // DT > 0: rescale row r of the output fragment o (DT n8 tiles per m16 tile) right
                // away, while corr[r] is live anyway (fewer registers than a pass afterwards).
#pragma unroll
                for (int t = 0; t < DT; ++t) {
                    o[(mt * DT + t) * 4 + 2 * h] *= corr[r];
                    o[(mt * DT + t) * 4 + 2 * h + 1] *= corr[r];
                }
            }
        }
    }

    // step() that also rescales the output fragment o (the mma.sync kernels: o is free).
    template <int MT, int NT, int DT, int kChains = 1>
    __device__ __forceinline__ void step_rescale(float* s, float c, float* o) {
        float corr[kRows];
        step<MT, NT, kChains, DT>(s, c, corr, o);
    }

    // End of the key loop for row r: returns 1 / l (0 for a row that saw no key, whose output
    // is then 0) and the natural-log lse (-inf for such a row). `sink` (natural units, -inf for
    // none: sink_logit) is an attention sink: one more term of the denominator without a value,
    // so the factor becomes e^{m - top} / (l e^{m - top} + e^{sink - top}) with top the larger of
    // the two maxima (no overflow either way), and a row that saw no key gets lse = sink.
    __device__ __forceinline__ float finish_row(int r, float c, float& lse, float sink = -INFINITY) const {
        const float l = group_sum<kLanes>(row_sum[r]);
        if (sink == -INFINITY) {
            lse = l > 0.f ? row_max[r] * c * (1.f / Units::kPerNat) + logf(l) : -INFINITY;
            return l > 0.f ? 1.f / l : 0.f;
        }
        const float m = l > 0.f ? row_max[r] * c : -INFINITY;  // exponent units
        const float s = sink * Units::kPerNat;
        const float top = fmaxf(m, s);
        const float kept = Units::exp(m - top);
        const float total = l * kept + Units::exp(s - top);
        lse = top * (1.f / Units::kPerNat) + logf(total);
        return kept / total;
    }
};

// The attention sink's logit of query head h (natural units), -inf when the call has none.
__device__ __forceinline__ float sink_logit(const CfFwdParams& p, int h) {
    return p.sinks != nullptr ? p.sinks[h] : -INFINITY;
}

// Multiplies row r of an output fragment (same layout, DT n8 tiles per m16 tile) by f[r].
template <int MT, int DT, int kRows>
__device__ __forceinline__ void scale_rows(float* o, const float (&f)[kRows]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < DT; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[(mt * DT + t) * 4 + e] *= f[2 * mt + (e >> 1)];
}

// Rows [m0, m_last] of a query block that see no key: o = 0, lse = -inf, or the head's sink
// logit `sink` (og, lseg: row 0 of the (sequence, head), as SeqInfo gives them).
template <typename T, int ROWS, int NTHREADS>
__device__ __forceinline__ void write_empty_rows(T* og, int64_t o_row_stride, float* lseg, int m0,
                                                 int m_last, int d, int tid, float sink) {
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
        if (m0 + r <= m_last) lseg[m0 + r] = sink;
}

}  // namespace cf
