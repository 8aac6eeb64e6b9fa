// Block-sparse attention (flash_api.h CfBlockMask) for the kernels: which key blocks a query
// block visits and in what order (BlockList, KeySteps), and the element rule of the partly
// visible blocks as bit masks over a thread's accumulator columns (rule_cols). The CPU path
// (src/cpu/) and the reference (src/reference.rs) evaluate the same rule from src/block_mask.rs.
#pragma once
#include "mask.cuh"

namespace cf {

__host__ __device__ inline bool has_block_mask_lists(const CfBlockMask& m) { return m.kv_num != nullptr; }
__host__ __device__ inline bool has_block_mask(const CfFwdParams& p) { return has_block_mask_lists(p.block_mask); }

// One row of a mask's lists: the fully and partly visible blocks of one query block (kv lists)
// or of one key block (q lists, `transposed`) of (sequence b, query head h). Entries are read as
// device data (flash_api.h): counts cut to [0, width], an index outside [0, width) is -1.
struct BlockList {
    const int32_t* full;
    const int32_t* part;
    int nfull, n, width;  // n: full and partial entries together

    __device__ __forceinline__ BlockList() : full(nullptr), part(nullptr), nfull(0), n(0), width(0) {}

    __device__ __forceinline__ BlockList(const CfBlockMask& m, bool transposed, int b, int h, int row) {
        const int e = (m.batch == 1 ? 0 : b) * m.heads + (m.heads == 1 ? 0 : h);
        const int rows = transposed ? m.k_blocks : m.q_blocks;
        width = transposed ? m.q_blocks : m.k_blocks;
        const int64_t r = (int64_t)e * rows + row;
        const int32_t* fnum = transposed ? m.full_q_num : m.full_kv_num;
        const int32_t* pnum = transposed ? m.q_num : m.kv_num;
        nfull = min(max(fnum[r], 0), width);
        n = nfull + min(max(pnum[r], 0), width);
        full = (transposed ? m.full_q_idx : m.full_kv_idx) + r * width;
        part = (transposed ? m.q_idx : m.kv_idx) + r * width;
    }
    // Block of entry x < n (full ones first), -1 when the entry is not a block.
    __device__ __forceinline__ int block(int x) const {
        const int c = x < nfull ? full[x] : part[x - nfull];
        return (unsigned)c < (unsigned)width ? c : -1;
    }
    __device__ __forceinline__ bool is_full(int x) const { return x < nfull; }
};

// How a kernel step's tile lies in the mask: wholly visible (no element test beyond the other
// options' masks), partly (the rule decides per element), or not at all (a bad list entry: the
// step runs with every element masked, on block 0's rows, which exist).
enum class StepKind : int { kFull = 0, kPartial = 1, kVoid = 2 };

// The steps of `sub` kernel tiles per listed block (sub = 128 / the tile): step s is entry s / sub,
// tile s % sub of its block; its first row or key `start` and its kind.
template <int kSub, int kTile>
__device__ __forceinline__ void list_step(const BlockList& l, int s, int& start, StepKind& kind) {
    static_assert(kSub * kTile == CF_MASK_BLOCK, "whole tiles per mask block");
    const int x = s / kSub, c = l.block(x);
    kind = c < 0 ? StepKind::kVoid : l.is_full(x) ? StepKind::kFull : StepKind::kPartial;
    start = (c < 0 ? 0 : c) * CF_MASK_BLOCK + (s % kSub) * kTile;
}

// ---- the element rule over a thread's columns
// A thread's accumulator columns in the mma.sync / wgmma layouts are c_k = 8 (k >> 1) + (k & 1)
// (k < 32) from its first one (n8 tile k >> 1, element k & 1); the rule's masks are bit k of
// column c_k. cols_le(y): the columns c_k <= y.
__device__ __forceinline__ uint32_t cols_le(int y) {
    if (y < 0) return 0u;
    if (y >= 8 * 15 + 1) return ~0u;  // c_31 = 121
    const int n = 2 * (y >> 3) + ((y & 7) >= 1 ? 2 : 1);
    return n >= 32 ? ~0u : (1u << n) - 1u;
}
// The columns in [lo, hi] (relative; any ints with |lo|, |hi| < 2^30).
__device__ __forceinline__ uint32_t cols_in(int lo, int hi) { return lo > hi ? 0u : cols_le(hi) & ~cols_le(lo - 1); }
constexpr int kRuleFar = 1 << 30;  // an unbounded side
__device__ __forceinline__ int floor_div(int a, int c) { return (a >= 0 ? a : a - c + 1) / c; }

// The rule's visible columns of one accumulator row. Forward (kTransposed false): the row is
// query i, the columns keys col0 + c_k. Backward (kTransposed true, S^T): the row is key j, the
// columns queries col0 + c_k. off = sk - sq (pos = i + off); sq, sk: the sequence's lengths, so
// that the document ids are never read past them (such columns are masked by MaskInfo anyway).
// kCols: the thread's columns (<= 32; bits k >= kCols are not set by the document rule).
template <bool kTransposed, int kCols>
__device__ __forceinline__ uint32_t rule_cols(const CfBlockMask& m, int b, int row, int col0, int off, int sq, int sk) {
    uint32_t any = 0u, term = ~0u;
    for (int x = 0; x < m.n_nodes; ++x) {
        const CfMaskNode& nd = m.nodes[x];
        uint32_t c = ~0u;
        switch (nd.op) {
            case CF_MASK_CAUSAL:  // j <= i + off
                c = kTransposed ? cols_in(row - off - col0, kRuleFar) : cols_le(row + off - col0);
                break;
            case CF_MASK_WINDOW: {  // i + off - a <= j <= i + off + b
                if (kTransposed) {
                    const int lo = nd.b < 0 ? -kRuleFar : row - nd.b - off - col0;
                    const int hi = nd.a < 0 ? kRuleFar : row + nd.a - off - col0;
                    c = cols_in(lo, hi);
                } else {
                    const int lo = nd.a < 0 ? -kRuleFar : row + off - nd.a - col0;
                    const int hi = nd.b < 0 ? kRuleFar : row + off + nd.b - col0;
                    c = cols_in(lo, hi);
                }
                break;
            }
            case CF_MASK_CHUNKED: {  // pos and j in one chunk
                const int a = max(nd.a, 1);
                if (kTransposed) {
                    const int c0 = floor_div(row, a) * a;
                    c = cols_in(c0 - off - col0, c0 + a - 1 - off - col0);
                } else {
                    const int c0 = floor_div(row + off, a) * a;
                    c = cols_in(c0 - col0, c0 + a - 1 - col0);
                }
                break;
            }
            case CF_MASK_GLOBAL_TOKENS:  // j < a
                c = kTransposed ? (row < nd.a ? ~0u : 0u) : cols_le(nd.a - 1 - col0);
                break;
            case CF_MASK_PREFIX_LM: {  // j <= pos || j < prefix
                const int pre = (int)min(nd.q_data[(int64_t)b * nd.q_batch_stride], (uint32_t)kRuleFar);
                c = kTransposed ? (row < pre ? ~0u : cols_in(row - off - col0, kRuleFar))
                                : cols_le(max(row + off, pre - 1) - col0);
                break;
            }
            case CF_MASK_SAME_DOCUMENT: {
                const uint32_t* qd = nd.q_data + (int64_t)b * nd.q_batch_stride;
                const uint32_t* kd = nd.k_data + (int64_t)b * nd.k_batch_stride;
                const int rlim = kTransposed ? sk : sq, clim = kTransposed ? sq : sk;
                if (row >= rlim) {
                    c = 0u;
                    break;
                }
                const uint32_t mine = kTransposed ? kd[row] : qd[row];
                const uint32_t* other = kTransposed ? qd : kd;
                c = 0u;
#pragma unroll 8
                for (int k = 0; k < kCols; ++k) {
                    const int col = col0 + 8 * (k >> 1) + (k & 1);
                    if (col < clim && other[col] == mine) c |= 1u << k;
                }
                break;
            }
            default:  // CF_MASK_ALL
                break;
        }
        term &= c;
        if (nd.last_in_term) {
            any |= term;
            term = ~0u;
        }
    }
    return any;
}

// Forward: hides (-inf) the elements of a score fragment that the rule hides (all of them on a
// void step). Fragment layout as mask_scores (common/mask.cuh): s[(mt * NT + t) * 4 + e], row
// row_of(mt, e >> 1), key j0 + 8 t + 2 q4 + (e & 1).
template <int MT, int NT, typename RowOf>
__device__ __forceinline__ void mask_rule_scores(float* s, const CfBlockMask& m, const MaskInfo& mk, int b,
                                                 RowOf row_of, int j0, int q4, bool void_step) {
    static_assert(2 * NT <= 32, "a row's columns in one 32-bit mask");
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint32_t c =
                void_step ? 0u : rule_cols<false, 2 * NT>(m, b, row_of(mt, r), j0 + 2 * q4, mk.off, mk.sq, mk.sk);
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (!((c >> (2 * t + e)) & 1u)) s[(mt * NT + t) * 4 + 2 * r + e] = -INFINITY;
        }
}

// Backward (S^T / dP^T, m64 x BM accumulators): zeroes P^T and dS^T where the rule hides the
// element (all of them on a void step). Element 4j + e: key key0 + 8 (e >> 1), query m0 + 8 j +
// 2 q4 + (e & 1).
template <int BM>
__device__ __forceinline__ void mask_rule_p_ds(float* pT, float* dsT, const CfBlockMask& m, const MaskInfo& mk, int b,
                                               int m0, int key0, int q4, bool void_step) {
    constexpr int NJ = BM / 8;
    static_assert(2 * NJ <= 32, "a key's query columns in one 32-bit mask");
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const uint32_t c = void_step ? 0u : rule_cols<true, 2 * NJ>(m, b, key0 + 8 * r, m0 + 2 * q4, mk.off, mk.sq, mk.sk);
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (!((c >> (2 * j + e)) & 1u)) {
                    pT[4 * j + 2 * r + e] = 0.f;
                    dsT[4 * j + 2 * r + e] = 0.f;
                }
    }
}

}  // namespace cf
