// What one dK/dV CTA works on, shared by the sm_80 (flash_bwd.cuh) and sm_90a
// (flash_bwd_sm90.cuh) kernels: kBlockN keys of one KV head of one sequence, and the steps
// (query head of its GQA split, query block of BM rows) whose queries see those keys.
#pragma once
#include "attn_common.cuh"

namespace cf {

template <typename T, int BN, int BM>
struct DkdvWork {
    SeqInfo si;
    MaskInfo mk;
    int b, hkv_i, split, n0, h_begin, mb_lo, nm, total_it, dch;
    const T* kg;  // K / V rows of this KV head, row 0 of the sequence
    const T* vg;
    int64_t q_boff, do_boff, lse_boff;

    // grid: (key block, KV head * nsplit + split, batch)
    __device__ __forceinline__ DkdvWork(const CfBwdParams& p, const BwdWs& ws)
        : si(p.fwd, blockIdx.z), mk(si.sq, si.sk, p.fwd.window_left, p.fwd.window_right) {
        const CfFwdParams& f = p.fwd;
        b = blockIdx.z;
        hkv_i = blockIdx.y / ws.nsplit;
        split = blockIdx.y % ws.nsplit;
        n0 = blockIdx.x * BN;
        dch = f.d >> 3;
        const int group = f.h / f.hkv;
        h_begin = hkv_i * group + split * ws.hps;
        const int h_end = min(h_begin + ws.hps, (hkv_i + 1) * group);
        int m_lo = 0, m_hi = 0;
        if (n0 < si.sk) mk.query_range(n0, min(n0 + BN, si.sk) - 1, m_lo, m_hi);
        mb_lo = m_lo / BM;
        nm = m_hi > m_lo ? (m_hi + BM - 1) / BM - mb_lo : 0;
        total_it = nm * max(h_end - h_begin, 0);
        kg = static_cast<const T*>(f.k) + si.k_off(b, f.k_batch_stride, f.k_row_stride) + (int64_t)hkv_i * f.k_head_stride;
        vg = static_cast<const T*>(f.v) + si.k_off(b, f.v_batch_stride, f.v_row_stride) + (int64_t)hkv_i * f.v_head_stride;
        q_boff = si.q_off(b, f.q_batch_stride, f.q_row_stride);
        do_boff = si.q_off(b, p.do_batch_stride, p.do_row_stride);
        lse_boff = (int64_t)b * f.lse_batch_stride + (si.q_varlen ? si.q_row0 : 0);
    }
    __device__ __forceinline__ bool empty() const { return n0 >= si.sk; }
    __device__ __forceinline__ int head(int it) const { return h_begin + it / nm; }
    __device__ __forceinline__ int row0(int it) const { return (mb_lo + it % nm) * BM; }

    // cp.async copies of the CTA's K and V rows. Loader: the kernel's shared layout (TileLoader /
    // PanelLoader: Loader::load<ROWS>(dst, src, row_stride, valid_rows, valid_chunks, tid, fallback)).
    template <typename Loader>
    __device__ __forceinline__ void load_kv(const CfFwdParams& f, T* sK, T* sV, int tid) const {
        Loader::template load<BN>(sK, kg + (int64_t)n0 * f.k_row_stride, f.k_row_stride, si.sk - n0, dch, tid, f.k);
        Loader::template load<BN>(sV, vg + (int64_t)n0 * f.v_row_stride, f.v_row_stride, si.sk - n0, dch, tid, f.v);
    }
    // cp.async copies of step it: Q and dO rows, lse and dsum (f32, zero past the sequence).
    template <typename Loader>
    __device__ __forceinline__ void issue_step(const CfBwdParams& p, const BwdWs& ws, int it, T* sQ, T* sdO,
                                               float* sL, float* sD, int tid) const {
        const CfFwdParams& f = p.fwd;
        const int hq = head(it), m0 = row0(it);
        Loader::template load<BM>(sQ, static_cast<const T*>(f.q) + q_boff + (int64_t)hq * f.q_head_stride + (int64_t)m0 * f.q_row_stride,
                                  f.q_row_stride, si.sq - m0, dch, tid, f.q);
        Loader::template load<BM>(sdO, static_cast<const T*>(p.dout) + do_boff + (int64_t)hq * p.do_head_stride + (int64_t)m0 * p.do_row_stride,
                                  p.do_row_stride, si.sq - m0, dch, tid, p.dout);
        if (tid < BM) {
            const bool ok = m0 + tid < si.sq;
            const float* lp = f.lse + lse_boff + (int64_t)hq * f.lse_head_stride + m0 + tid;
            const float* dp = ws.dsum + (int64_t)hq * ws.total_q + si.q_row0 + m0 + tid;
            cp_async_4(smem_addr(sL + tid), ok ? (const void*)lp : (const void*)f.lse, ok);
            cp_async_4(smem_addr(sD + tid), ok ? (const void*)dp : (const void*)ws.dsum, ok);
        }
    }
};

}  // namespace cf
