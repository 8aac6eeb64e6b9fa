// Which (query block, head, sequence) tiles a CTA of the Hopper forward computes, and in what
// order. Producer and consumers walk the same sequence of tiles through the same scheduler, so
// their barrier phases stay in step.
//
// Tiles are numbered query block fastest (the CTAs running at the same time share K / V in L2).
// Non-persistent launch (gridDim.x == ntiles): one tile per CTA. Persistent launch (gridDim.x <
// ntiles; one wave of CTAs, the producer loads the next tile while the consumers finish the
// current one): CTAs take units of two tiles round-robin, a unit pairing the i-th heaviest and
// the i-th lightest query block of a head, so that every unit costs about the same under causal
// masks and the static schedule stays balanced. A non-persistent launch under causal masks takes
// each head's query blocks heaviest first; its last `tail` (head, sequence) groups (the host's
// choice: plan.cuh fwd_heavy_groups) are numbered query block slowest, so that the last
// groups' heaviest tiles do not start in the grid's last wave.
#pragma once
#include <algorithm>
#include "../common/block_sparse.cuh"

namespace cf {

// One tile: query rows [m0, m_last] of head h of one sequence, against key blocks
// nb_hi - 1 - j for j = 0 .. nblocks - 1 (last first: the boundary block is masked first), or,
// through a block mask (`sparse`), the steps of its query block's lists (common/block_sparse.cuh:
// the fully visible blocks, then the partly visible ones, 128 / kBlockN steps each).
struct FwdTile {
    SeqInfo si;
    MaskInfo mk;
    int h, m0, m_last, nb_hi, nblocks;
    bool sparse;
    BlockList bl;  // sparse only

    __device__ __forceinline__ FwdTile(const CfFwdParams& p, int b)
        : si(p, b, KvKind<KvPath::kAny>{}), mk(si.sq, si.sk, p.window_left, p.window_right), sparse(false) {}
    // No query row of this tile exists in its sequence: nothing to load, compute or store.
    __device__ __forceinline__ bool empty() const { return m0 >= si.sq; }
    // Step j's first key and its kind (always kFull without a block mask: the options' masks
    // are MaskInfo's business).
    template <int BN, bool kBlockMasks = true>
    __device__ __forceinline__ void step(int j, int& n0, StepKind& kind) const {
        if constexpr (kBlockMasks && CF_MASK_BLOCK % BN == 0) {
            if (sparse) {
                list_step<CF_MASK_BLOCK / BN, BN>(bl, j, n0, kind);
                return;
            }
        }
        n0 = (nb_hi - 1 - j) * BN;
        kind = StepKind::kFull;
    }
    // Step j's first key; kBlockMasks: the kernel reads block masks (else the dense walk's).
    template <int BN, bool kBlockMasks>
    __device__ __forceinline__ int key_start(int j) const {
        int n0;
        StepKind kind;
        step<BN, kBlockMasks>(j, n0, kind);
        return n0;
    }
};

// Where this sequence's rows sit in the forward's TMA maps (tma.cuh): a varlen tensor's map is one
// batch of all its rows, a batched tensor's has the sequence as its batch coordinate.
struct FwdTmaRows {
    int64_t k_row0, q_row0;
    int k_batch, q_batch;
    __device__ __forceinline__ explicit FwdTmaRows(const SeqInfo& si)
        : k_row0(si.k_varlen ? si.k_row0 : 0),
          q_row0(si.q_varlen ? si.q_row0 : 0),
          k_batch(si.k_varlen ? 0 : si.b),
          q_batch(si.q_varlen ? 0 : si.b) {}
};

// kOneTilePerCta: the non-persistent kernels (only they take `tail_groups`; the persistent ones
// carry none of its code). kBlockMasks: the kernel reads block masks (the 16-bit forward; the
// others carry none of its code).
template <int kBlockM, int kBlockN, bool kOneTilePerCta, bool kBlockMasks = false>
struct FwdTileScheduler {
    int num_m, ntiles, pair, niters, tail;
    bool heavy_last;

    // Tiles of a launch; the launch asks for min(ntiles, SMs * CTAs per SM) CTAs when persistent.
    static int64_t num_tiles(const CfFwdParams& p) { return (int64_t)((p.seqlen_q + kBlockM - 1) / kBlockM) * p.h * p.b; }
    static int64_t grid_size(const CfFwdParams& p, bool persistent, int ctas_per_wave) {
        return persistent ? std::min<int64_t>(num_tiles(p), ctas_per_wave) : num_tiles(p);
    }

    __device__ __forceinline__ FwdTileScheduler(const CfFwdParams& p, int tail_groups) {
        num_m = (p.seqlen_q + kBlockM - 1) / kBlockM;
        ntiles = num_m * p.h * p.b;
        pair = (int)gridDim.x < ntiles ? 1 : 0;  // log2(tiles per unit)
        const int nunits = (ntiles + pair) >> pair;
        niters = ((nunits + (int)gridDim.x - 1) / (int)gridDim.x) << pair;
        // Causal-like masks: the last query blocks do the most work, so start them first.
        heavy_last = p.window_right >= 0 && p.window_left < 0;
        tail = kOneTilePerCta && !pair ? tail_groups : 0;
    }

    // Tile of this CTA's it-th iteration (it < niters); >= ntiles: none (skip it).
    __device__ __forceinline__ int tile_index(int it) const {
        return (((it >> pair) * (int)gridDim.x + (int)blockIdx.x) << pair) + (it & pair);
    }

    // The producers' walk: f(t) for each of this CTA's tiles that has key blocks to load, in
    // order (the consumers walk the same tiles, and also store the empty ones).
    template <class F>
    __device__ __forceinline__ void for_each_loaded_tile(const CfFwdParams& p, F&& f) const {
        for (int it = 0; it < niters; ++it) {
            const int tile = tile_index(it);
            if (tile >= ntiles) continue;
            const FwdTile t = decode(p, tile);
            if (t.empty() || t.nblocks == 0) continue;  // the consumers skip it too
            f(t);
        }
    }

    __device__ __forceinline__ FwdTile decode(const CfFwdParams& p, int tile) const {
        int r = tile % num_m, hb = tile / num_m;
        const int groups = p.h * p.b;
        if (kOneTilePerCta && tail > 0 && hb >= groups - tail) {  // the last groups: query block slowest
            const int t = tile - (groups - tail) * num_m;
            r = t / tail;
            hb = groups - tail + t % tail;
        }
        const int mi = !pair ? r : (r & 1) ? num_m - 1 - (r >> 1) : (r >> 1);  // 0: heaviest
        FwdTile t(p, hb / p.h);
        t.h = hb % p.h;
        t.m0 = (heavy_last ? num_m - 1 - mi : mi) * kBlockM;
        t.m_last = min(t.m0 + kBlockM, t.si.sq) - 1;
        int n_lo, n_hi;
        t.mk.key_range(t.m0, t.m_last, n_lo, n_hi);
        t.nb_hi = (n_hi + kBlockN - 1) / kBlockN;
        t.nblocks = n_hi > n_lo ? t.nb_hi - n_lo / kBlockN : 0;
        // a block mask: the plan runs it on tiles inside one mask block (kBlockM = 128, kBlockN | 128)
        if constexpr (kBlockMasks && kBlockM == CF_MASK_BLOCK && CF_MASK_BLOCK % kBlockN == 0) {
            if (has_block_mask(p) && t.nblocks > 0) {
                t.sparse = true;
                t.bl = BlockList(p.block_mask, false, t.si.b, t.h, t.m0 / CF_MASK_BLOCK);
                t.nblocks = t.bl.n * (CF_MASK_BLOCK / kBlockN);
            }
        }
        return t;
    }
};

}  // namespace cf
