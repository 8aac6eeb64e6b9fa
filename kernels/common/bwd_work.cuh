// The backward's workspace (BwdWs) and what one dK/dV CTA works on (DkdvWork), shared by the
// sm_80 (sm80/bwd.cuh) and sm_90a (sm90/bwd.cuh) kernels: kBlockN keys of one KV head of one sequence, and the steps
// (query head of its GQA split, query block of BM rows) whose queries see those keys.
#pragma once
#include "block_sparse.cuh"

namespace cf {

// Backward scratch memory (all f32). Offsets are rounded up to 256 bytes.
//   dsum     [h][total_q]                 D_i = rowsum(dO * O)
//   dq_accum                              only for the tensor-core path in atomic mode:
//            rows   [total_q][h][d]         (sm_80 kernels: f32 atomics per element pair)
//            tiled  [h][d/64][total_q + 128][64], chunk c (8 floats) of row i at c ^ (i & 7)
//                                          (sm_90a kernels: bulk reductions of whole 64 x 64
//                                          tiles; i counts from the sequence start, and the
//                                          128 spare rows take the zero rows of a query block
//                                          that runs past the last sequence)
//   dkv_count [b][hkv][key blocks] ints    nsplit > 1 on the sm_90a d <= 128 kernel (see below)
//   dkv      [2][nsplit][total_k][hkv][d] only when the query heads of a KV head are split
//                                          over nsplit CTAs (GQA/MQA): dK part, then dV part
struct BwdWs {
    float* dsum;
    float* dq_accum;
    float* dkv;
    int nsplit;    // CTAs sharing the query heads of one KV head (1 = write dk/dv directly)
    int dq_tiled;  // dq_accum in the tiled layout (the sm_90a kernels run)
    int hps;       // query heads per split
    // The CTA order across heads. dK/dV grids (DkdvCta): how many of the grid's last (KV head *
    // split, sequence) groups run key block slowest (0: launch order; all: every head's heaviest
    // CTAs first; plan.cuh bwd_heavy_groups). Query-block grids (QueryBlockCta): 0 / 1.
    int heavy_first;
    int64_t total_q, total_k;
    // Deterministic mode on the sm_90a kernels: the counters that order the dQ reductions
    // (sm90/tma.cuh DqOrder), [b][h][dq_sem_blocks][2 warpgroups]; nullptr otherwise.
    int* dq_sem;
    int dq_sem_blocks;  // 64-row query blocks per (sequence, head): seqlen_q / 64 rounded up
    // nsplit > 1 on the sm_90a d <= 128 kernel (plan.cuh plan_bwd_workspace dkv_in_kernel): how many
    // splits of each (sequence, KV head, key block) have written their partials,
    // [b][hkv][key blocks of the grid], zeroed per call; the last one sums them. nullptr: the
    // reduction kernel (sm80/bwd.cuh bwd_reduce_dkv_kernel) sums them after the dK/dV kernel.
    int* dkv_count;

    // Row 0 of (sequence si, head h) in each buffer.
    __device__ __forceinline__ float* dsum_rows(const SeqInfo& si, int h) const { return dsum + (int64_t)h * total_q + si.q_row0; }
    // dq_accum rows are h * d floats apart.
    __device__ __forceinline__ float* dq_accum_rows(const CfFwdParams& f, const SeqInfo& si, int h) const {
        return dq_accum + si.q_row0 * ((int64_t)f.h * f.d) + (int64_t)h * f.d;
    }
    // Tiled layout: row `row` (from row 0 of sequence si) of the [rows][64] column panel pnl of head h.
    __device__ __forceinline__ float* dq_tile_rows(const CfFwdParams& f, const SeqInfo& si, int h, int pnl,
                                                   int64_t row) const {
        return dq_accum + (((int64_t)h * dq_panels(f.d) + pnl) * (total_q + kDqSpareRows) + si.q_row0 + row) * 64;
    }
    static constexpr int kDqSpareRows = 128;
    static __host__ __device__ __forceinline__ int dq_panels(int d) { return (d + 63) / 64; }
    // dK partial of split `split`, KV head hk (rows hkv * d floats apart); the dV partials
    // follow all dK partials (dkv_v_offset floats further).
    __device__ __forceinline__ float* dk_part_rows(const CfFwdParams& f, const SeqInfo& si, int split, int hk) const {
        return dkv + ((int64_t)split * total_k + si.k_row0) * ((int64_t)f.hkv * f.d) + (int64_t)hk * f.d;
    }
    __device__ __forceinline__ int64_t dkv_v_offset(const CfFwdParams& f) const { return (int64_t)nsplit * total_k * f.hkv * f.d; }
    // Index in dq_sem of the counter of (sequence b, head h, the query block starting at row m0,
    // warpgroup wg); plan_bwd keeps the count within int.
    __device__ __forceinline__ int dq_counter(int b, const CfFwdParams& f, int h, int m0, int wg) const {
        return (((b * f.h + h) * dq_sem_blocks + (m0 >> 6)) << 1) + wg;
    }
};


// The CTA's (key block, KV head * nsplit + split, batch). The grid is (key blocks, KV heads *
// nsplit, batch), launched x fastest: neighbouring key blocks of one head run together and share
// its Q / dO in L2. Under causal-like masks the first key blocks see the most queries, and in that
// order the last group's heaviest CTA starts near the end and sets the grid's tail. With
// ws.heavy_first = g > 0 (plan.cuh bwd_heavy_groups) the kernels that take kHeavyFirst
// renumber the CTAs of the last g groups key block slowest: those groups' heaviest blocks start
// first among them, while every earlier group keeps the launch order and its L2 sharing. g = all
// groups on grids of a few waves (every head's heaviest blocks in the first wave). Lower key
// blocks of a head still start before higher ones (deterministic mode's dQ turns rely on it).
struct DkdvCta {
    int kb, y, b;
    template <bool kHeavyFirst>
    __device__ __forceinline__ static DkdvCta of(const BwdWs& ws) {
        if (!kHeavyFirst || !ws.heavy_first) return {(int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z};
        const unsigned flat = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        const unsigned yz = gridDim.y * gridDim.z, g = (unsigned)ws.heavy_first, first = (yz - g) * gridDim.x;
        if (flat < first) return {(int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z};
        const unsigned r = flat - first, group = yz - g + r % g;
        return {(int)(r / g), (int)(group % gridDim.y), (int)(group / gridDim.y)};
    }
};

// n / d and n % d for 0 <= n < 2^32 by one 64-bit multiply-high and one correction: m =
// floor((2^64 - 1) / d) makes floor(n m / 2^64) q or q - 1 (the error is below n / 2^64 < 2^-32,
// and a nonzero fraction of n / d is at least 1 / d >= 2^-32). The step loops divide the step
// index by the CTA's query-block count every step (head, row); the compiler's 32-bit division
// there was ~20 instructions and a MUFU.RCP on each step's critical path (bench/NOTES.md,
// 2026-11-27 (commit 17d890a)). One 64-bit division per CTA builds m. DkdvWork's kMulDiv chooses it per
// kernel: the d = 64 / 96 / 128 sm_90a backward measured 1-4% faster with it, the wide (d = 192 /
// 256) one 6% slower (same values; another schedule), the sm_80 family was not measured.
struct StepDivider {
    uint32_t d;
    uint64_t m;
    __device__ __forceinline__ explicit StepDivider(int d_ = 1) : d(d_ > 1 ? (uint32_t)d_ : 1u), m(~0ull / d) {}
    __device__ __forceinline__ void divmod(int n, int& q, int& r) const {
        uint32_t qq = (uint32_t)__umul64hi((uint64_t)(uint32_t)n, m);
        uint32_t rr = (uint32_t)n - qq * d;
        if (rr >= d) {
            ++qq;
            rr -= d;
        }
        q = (int)qq;
        r = (int)rr;
    }
};

// kRotate: without masks, the CTA walks its query blocks starting at its key block's index
// (mod their count) instead of at 0, so that the CTAs of a head, which run together, reduce their
// dQ tiles into different rows rather than all into the same 64 (the wide kernels, whose 64 KB of
// dQ reductions a step bind them; bench/NOTES.md, 2026-11-26, commit b125200). Not with kReverse
// (deterministic mode): there a query block's reductions go in key-block order, and a rotated CTA
// would reach the block it waits on last.
// kReverse: deterministic mode's query-block order (row0), and no rotation.
// kMulDiv: head / row0 divide the step index by StepDivider instead of the compiler's division.
// kBlockMasks: the steps follow a block mask (the kernels' BlockMasked instantiations); without
// it the type carries none of that code.
template <typename T, int BN, int BM, bool kHeavyFirst = false, bool kRotate = false, bool kReverse = false,
          bool kMulDiv = false, bool kBlockMasks = false>
struct DkdvWork {
    static constexpr bool kMasks = kBlockMasks && CF_MASK_BLOCK % BM == 0 && CF_MASK_BLOCK % BN == 0;
    SeqInfo si;
    MaskInfo mk;
    int b, hkv_i, split, n0, h_begin, mb_lo, nm, total_it, dch, rot;
    StepDivider by_nm;  // kMulDiv: step it -> (head it / nm, query block it % nm)
    // A block mask (the sm_90a kernels only: check_bwd): every head's steps are its key block's
    // q lists (full blocks first, 128 / BM steps each), nm the most of any of the CTA's heads;
    // a head with fewer has void steps at its end (computed fully masked). The kernel parameter's
    // (a reference, not a copy: it stays in the parameter space, __grid_constant__).
    const CfBlockMask& bmask;
    const T* kg;  // K / V rows of this KV head, row 0 of the sequence
    const T* vg;

    // grid: (key block, KV head * nsplit + split, batch), see DkdvCta
    __device__ __forceinline__ DkdvWork(const CfBwdParams& p, const BwdWs& ws) : DkdvWork(p, ws, DkdvCta::of<kHeavyFirst>(ws)) {}
    __device__ __forceinline__ DkdvWork(const CfBwdParams& p, const BwdWs& ws, DkdvCta c)
        : si(p.fwd, c.b), mk(si.sq, si.sk, p.fwd.window_left, p.fwd.window_right), bmask(p.fwd.block_mask) {
        const CfFwdParams& f = p.fwd;
        b = c.b;
        hkv_i = c.y / ws.nsplit;
        split = c.y % ws.nsplit;
        n0 = c.kb * BN;
        dch = f.d / kChunkElems<T>;
        const int group = f.h / f.hkv;
        h_begin = hkv_i * group + split * ws.hps;
        const int h_end = min(h_begin + ws.hps, (hkv_i + 1) * group);
        int m_lo = 0, m_hi = 0;
        if (n0 < si.sk) mk.query_range(n0, min(n0 + BN, si.sk) - 1, m_lo, m_hi);
        mb_lo = m_lo / BM;
        nm = m_hi > m_lo ? (m_hi + BM - 1) / BM - mb_lo : 0;
        if constexpr (kMasks) {
            if (sparse()) {
                mb_lo = 0;
                int most = 0;
                if (nm > 0)
                    for (int hh = h_begin; hh < h_end; ++hh) {
                        most = max(most, BlockList(bmask, true, b, hh, n0 / CF_MASK_BLOCK).n);
                        if (bmask.heads == 1) break;  // one list for every head
                    }
                nm = most * (CF_MASK_BLOCK / BM);
            }
        }
        if constexpr (kMulDiv) by_nm = StepDivider(nm);
        total_it = nm * max(h_end - h_begin, 0);
        // MaskInfo's windows, not the raw ones: a window as wide as the sequence is no mask
        rot = kRotate && !kReverse && mk.wl < 0 && mk.wr < 0 && nm > 0 && !sparse() ? c.kb % nm : 0;
        kg = si.k<T>(f, hkv_i);
        vg = si.v<T>(f, hkv_i);
    }
    __device__ __forceinline__ bool empty() const { return n0 >= si.sk; }
    __device__ __forceinline__ bool sparse() const { return kMasks && has_block_mask_lists(bmask); }
    // Deterministic dQ: how many key blocks add into step it's query block (BM rows from m0)
    // before this CTA's does, i.e. this key block minus the first key block the rows see.
    __device__ __forceinline__ int dq_turn(int m0) const {
        int lo, hi;
        mk.key_range(m0, min(m0 + BM, si.sq) - 1, lo, hi);
        return n0 / BN - lo / BN;
    }
    __device__ __forceinline__ void step_divmod(int it, int& q, int& r) const {
        if constexpr (kMulDiv) {
            by_nm.divmod(it, q, r);
        } else {
            q = it / nm;
            r = it % nm;
        }
    }
    __device__ __forceinline__ int head(int it) const {
        int q, r;
        step_divmod(it, q, r);
        return h_begin + q;
    }
    // Deterministic mode walks the query blocks last first: a query block's reductions go in
    // key-block order, and under causal or sliding-window masks key block kb's last query block
    // is at or after key block kb - 1's, so every CTA of a head starts on the last block (causal)
    // or reaches a block after the CTA before it; first first, kb would wait ~2 steps per key
    // block for kb - 1 (causal d = 128, 16k: 288 -> 234 TF/s instead of a gain).
    __device__ __forceinline__ int row0(int it) const {
        int q, r;
        step_divmod(it, q, r);
        if constexpr (kMasks) {
            if (sparse()) {
                int m0;
                StepKind kind;
                sparse_step(h_begin + q, r, m0, kind);
                return m0;
            }
        }
        if constexpr (kRotate) r = r + rot < nm ? r + rot : r + rot - nm;
        if constexpr (kReverse) r = nm - 1 - r;
        return (mb_lo + r) * BM;
    }

    // Through a block mask: step r of head h (its first query row and its kind).
    __device__ __forceinline__ void sparse_step(int h, int r, int& m0, StepKind& kind) const {
        if constexpr (kMasks) {
            const BlockList l(bmask, true, b, h, n0 / CF_MASK_BLOCK);
            if (r < l.n * (CF_MASK_BLOCK / BM)) {
                list_step<CF_MASK_BLOCK / BM, BM>(l, r, m0, kind);
                return;
            }
        }
        m0 = 0;
        kind = StepKind::kVoid;
    }
    // Step it's kind: kFull without a block mask (the options' masks are MaskInfo's business).
    __device__ __forceinline__ StepKind step_kind(int it) const {
        if constexpr (!kMasks) {
            return StepKind::kFull;
        } else {
            if (!sparse()) return StepKind::kFull;
            int q, r, m0;
            step_divmod(it, q, r);
            StepKind kind;
            sparse_step(h_begin + q, r, m0, kind);
            return kind;
        }
    }

    // cp.async copies of the CTA's K and V rows. Loader: the kernel's shared layout (TileLoader /
    // PanelLoader: Loader::load<ROWS>(dst, src, row_stride, valid_rows, valid_chunks, tid, fallback)).
    template <typename Loader>
    __device__ __forceinline__ void load_kv(const CfFwdParams& f, T* sK, T* sV, int tid) const {
        Loader::template load<BN>(sK, kg + (int64_t)n0 * f.k_row_stride, f.k_row_stride, si.sk - n0, dch, tid, f.k);
        Loader::template load<BN>(sV, vg + (int64_t)n0 * f.v_row_stride, f.v_row_stride, si.sk - n0, dch, tid, f.v);
    }
    // Step it into stage `stage` of the double-buffered Q / dO (D columns) and lse / dsum buffers.
    template <typename Loader, int D>
    __device__ __forceinline__ void issue_stage(const CfBwdParams& p, const BwdWs& ws, int it, int stage, T* sQ, T* sdO,
                                                float* sL, float* sD, int tid) const {
        issue_step<Loader>(p, ws, it, sQ + stage * BM * D, sdO + stage * BM * D, sL + stage * BM, sD + stage * BM, tid);
    }
    // The CTA's first cp.async group: its K and V rows and step 0 (stage 0).
    template <typename Loader, int D>
    __device__ __forceinline__ void prologue(const CfBwdParams& p, const BwdWs& ws, T* sK, T* sV, T* sQ, T* sdO, float* sL,
                                             float* sD, int tid) const {
        load_kv<Loader>(p.fwd, sK, sV, tid);
        if (total_it > 0) issue_stage<Loader, D>(p, ws, 0, 0, sQ, sdO, sL, sD, tid);
        cp_async_commit();
    }

    // cp.async copies of step it: Q and dO rows, lse and dsum (f32, zero past the sequence).
    template <typename Loader>
    __device__ __forceinline__ void issue_step(const CfBwdParams& p, const BwdWs& ws, int it, T* sQ, T* sdO,
                                               float* sL, float* sD, int tid) const {
        const CfFwdParams& f = p.fwd;
        const int hq = head(it), m0 = row0(it);
        Loader::template load<BM>(sQ, si.q<T>(f, hq) + (int64_t)m0 * f.q_row_stride,
                                  f.q_row_stride, si.sq - m0, dch, tid, f.q);
        Loader::template load<BM>(sdO, si.dout<T>(p, hq) + (int64_t)m0 * p.do_row_stride,
                                  p.do_row_stride, si.sq - m0, dch, tid, p.dout);
        if (tid < BM) {
            const bool ok = m0 + tid < si.sq;
            const float* lp = si.lse(f, hq) + m0 + tid;
            const float* dp = ws.dsum_rows(si, hq) + m0 + tid;
            cp_async_4(smem_addr(sL + tid), ok ? (const void*)lp : (const void*)f.lse, ok);
            cp_async_4(smem_addr(sD + tid), ok ? (const void*)dp : (const void*)ws.dsum, ok);
        }
    }
};

}  // namespace cf
