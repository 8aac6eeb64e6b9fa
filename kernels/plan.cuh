// The plan layer: every runtime choice of a call, made once, before anything launches.
//   plan_fwd / plan_bwd (plan.cu)  the complete plan of a forward / backward: kernel family and
//               configuration, head-dim tile, split-KV, GQA split, dQ mode, logits kind, CTA
//               orders, workspace layout; dispatch.cu launches what a plan names, and the
//               launchers (launch.cuh) take the plan's values and make no choice of their own;
//               cf_fwd_describe / cf_bwd_describe (flash_api.h) print a plan (tests assert it)
//   the rules below, pure functions of the parameters (and of the device's SM count / shared
//   memory / occupancy, which plan.cu reads), so that a workspace size and the launch that uses
//   it always agree:
//   plan_split  split-KV decode: how many key chunks, GQA heads packed per CTA, ring depth
//   plan_bwd_workspace  backward workspace layout, atomic vs deterministic dQ, GQA head split
//   sm90 forward configuration by head dim and sequence length (fwd_sm90_config)
//   fwd_fp8_tile, fwd_fp8_long, fp8_vt_layout  the FP8 forward's head-dim tile, key-block width
//               and V^T workspace
//   heavy_first_order, bwd_heavy_groups, fwd_heavy_groups, mma_sync_heavy_first  CTA orders
// Measurements behind the constants: bench/NOTES.md.
#pragma once
#include <algorithm>
#include "config.cuh"
#include "launch.cuh"
#include "common/block_sparse.cuh"

namespace cf {

// Whether a call has any window (causal is a window with right = 0): the tile choices below
// that keep masked calls off the tiles measured only without masks.
inline bool has_window(const CfFwdParams& p) { return p.window_left >= 0 || p.window_right >= 0; }

inline size_t round256(size_t x) { return (x + 255) & ~size_t(255); }

// Split-KV (flash-decoding) plan for few query rows and long keys: nsplit > 1 when the
// one-pass grid would leave most of the GPU idle. f32: only on the tensor-core path (plan.cu's
// split_plan says so; the SIMT kernels have no split). pack = query heads per CTA (GQA group; 1 with
// ALiBi, whose slope is per head). A pure function of the parameters and the device's SM count,
// so cf_fwd_workspace_size and cf_fwd agree.
inline SplitPlan plan_split(const CfFwdParams& p) {
    SplitPlan sp{};
    sp.nsplit = 1;
    const int rd = round_head_dim(p.d);
    if (p.dtype == CF_E4M3 || (rd != 64 && rd != 128) || p.seqlen_q > 16 || p.seqlen_k < 256) return sp;
    const int group = p.h / p.hkv;
    const int pack = p.alibi_slopes ? 1 : group;
    const int64_t mblocks = (int64_t)(pack * p.seqlen_q + kSplitBlockM - 1) / kSplitBlockM;
    if (mblocks * (p.h / pack) > 65535) return sp;
    const int64_t base = mblocks * (p.h / pack) * p.b;
    int sms = 0;
    if (current_sm_count(sms) != cudaSuccess) {
        (void)cudaGetLastError();
        sms = 132;
    }
    const int64_t slots = (int64_t)sms * 2;  // the split kernel runs 2 CTAs per SM (d = 128)
    if (base >= slots) return sp;
    // at most one CTA per SM when the grid is small (measured: more, smaller splits are slower;
    // then the kernel uses a deeper K/V ring), at least 2 splits otherwise
    const int nkb = (p.seqlen_k + kSplitBlockN - 1) / kSplitBlockN;
    const int64_t cap = std::max<int64_t>(2, sms / base);
    const int max_split = (int)std::min<int64_t>({(int64_t)128, (int64_t)(nkb + 1) / 2, cap});
    // share of the last wave's slots that n splits fill; the fewest splits within 5% of the best
    auto efficiency = [&](int n) {
        const int64_t ctas = base * n;
        return (double)ctas / (double)(((ctas + slots - 1) / slots) * slots);
    };
    double best = 0.0;
    for (int n = 1; n <= max_split; ++n) best = std::max(best, efficiency(n));
    int nsplit = 1;
    for (int n = 1; n <= max_split; ++n)
        if (efficiency(n) >= 0.95 * best) { nsplit = n; break; }
    if (nsplit <= 1) return sp;
    sp.deep = base * nsplit <= sms;
    sp.bps = (nkb + nsplit - 1) / nsplit;
    sp.nsplit = (nkb + sp.bps - 1) / sp.bps;  // no chunk left empty
    sp.pack = pack;
    sp.mblocks = (int)mblocks;
    const size_t rows = (size_t)sp.nsplit * p.b * p.h * p.seqlen_q;
    sp.opart_bytes = (rows * rd * sizeof(float) + 255) & ~size_t(255);
    sp.bytes = sp.opart_bytes + rows * sizeof(float);
    return sp;
}

// The wide-head kernel (sm80/fwd_wide_split.cu) for a call, or kNone (the SIMT kernels): f16 /
// bf16 past the 256-column tiles (d in (256, 576] or dv in (256, 512]), no prefix ranges. Rows
// per CTA: 16 when a KV group's rows (group heads x seqlen_q queries) fit, else 64; when a
// configuration takes more shared memory than the device gives a block (smem_optin), the next one
// that fits: 16 rows, a shorter ring.
inline WideSplit wide_split_config(const CfFwdParams& p, bool v_in_k, int smem_optin) {
    const int dv = head_dim_v(p);
    if ((p.dtype != CF_F16 && p.dtype != CF_BF16) || p.prefix_ranges != nullptr) return WideSplit::kNone;
    if ((p.d <= 256 && dv <= 256) || p.d > kWideSplitQkDim || dv > kWideSplitVDim) return WideSplit::kNone;
    const bool rows16 = (int64_t)(p.h / p.hkv) * p.seqlen_q <= 16;
    const WideSplit in_k[] = {WideSplit::kRows64VInK3, WideSplit::kRows16VInK4, WideSplit::kRows16VInK2};
    const WideSplit apart[] = {WideSplit::kRows64V2, WideSplit::kRows16V2};
    auto smem = [](WideSplit w) { return with_wide_split_traits<__half>(w, [](auto kt) { return decltype(kt)::kSmemBytes; }); };
    const WideSplit* list = v_in_k ? in_k : apart;
    const int n = v_in_k ? 3 : 2;
    for (int k = rows16 ? 1 : 0; k < n; ++k)
        if (smem(list[k]) <= smem_optin) return list[k];
    return WideSplit::kNone;
}
inline int wide_split_rows(WideSplit w) {
    return w == WideSplit::kRows64VInK3 || w == WideSplit::kRows64V2 ? 64 : 16;
}

// The decode shapes of wide heads: a KV group's rows (group heads x seqlen_q queries) at most 128
// (decode, MTP / speculative steps), which the wide-head kernel packs into one CTA.
inline bool wide_decode_shape(const CfFwdParams& p) { return (int64_t)(p.h / p.hkv) * p.seqlen_q <= 128; }

// Its plan. Decode shapes (a KV group's rows, group heads x seqlen_q queries, at most 128: decode,
// MTP / speculative steps): a CTA takes every row of one KV group (pack = group), and, one CTA per
// SM (the tiles take 100-225 KB), the key range is cut until the grid fills one wave of SMs (the
// fewest splits within 5% of the best last-wave share), each split at least 4 key blocks. Longer
// query blocks: one head's query block a CTA (pack = 1), one split. One split writes o directly
// (no workspace).
inline SplitPlan plan_wide_split(const CfFwdParams& p, WideSplit w, int sms) {
    SplitPlan sp{};
    sp.wide = w;
    const int group = p.h / p.hkv;
    const bool decode = wide_decode_shape(p);
    sp.pack = decode ? group : 1;
    const int rows = wide_split_rows(w);
    sp.mblocks = (int)(((int64_t)sp.pack * p.seqlen_q + rows - 1) / rows);
    const int64_t base = (int64_t)sp.mblocks * (p.h / sp.pack) * p.b;
    const int nkb = std::max(1, (p.seqlen_k + kWideSplitBlockN - 1) / kWideSplitBlockN);
    int nsplit = 1;
    if (decode && base < sms) {
        const int max_split = (int)std::min<int64_t>({(int64_t)128, (int64_t)std::max(1, nkb / 4),
                                                      (int64_t)(INT32_MAX / 2) / std::max<int64_t>(1, sp.mblocks)});
        auto efficiency = [&](int n) {
            const int64_t ctas = base * n;
            return (double)ctas / (double)(((ctas + sms - 1) / sms) * sms);
        };
        double best = 0.0;
        for (int n = 1; n <= max_split; ++n) best = std::max(best, efficiency(n));
        for (int n = 1; n <= max_split; ++n)
            if (efficiency(n) >= 0.95 * best) { nsplit = n; break; }
    }
    sp.bps = (nkb + nsplit - 1) / nsplit;
    sp.nsplit = (nkb + sp.bps - 1) / sp.bps;  // no chunk left empty
    if (sp.nsplit == 1) return sp;
    const size_t part_rows = (size_t)sp.nsplit * p.b * p.h * p.seqlen_q;
    sp.opart_bytes = round256(part_rows * kWideSplitVDim * sizeof(float));
    sp.bytes = sp.opart_bytes + part_rows * sizeof(float);
    return sp;
}

// Which kernels a backward runs (plan_bwd): the SIMT ones, or the tensor-core dK/dV kernel of
// the sm_90a wgmma family (d <= 128 tiles: sm90/bwd.cuh; 192 / 256: sm90/bwd_wide.cuh) or the
// mma.sync one (sm80/bwd.cuh), followed by the dQ pass or dQ conversion and the split reduction.
enum class BwdKernel { kSimt, kMmaSync, kWgmma, kWgmmaWide };
// The backward's plan: the workspace layout (plan_bwd_workspace, a pure function of the
// parameters: cf_bwd_workspace_size and cf_bwd must agree, so no device query there) and what
// plan_bwd (plan.cu) adds for the launch.
struct BwdPlan {
    size_t dsum_off, dq_off, sem_off, cnt_off, dkv_off, total;
    int nsplit, hps, sem_blocks;
    int64_t total_q, total_k;
    bool atomic_dq;   // the dK/dV kernels add dQ into dq_accum (else the separate dQ pass runs)
    bool ordered_dq;  // ... in key-block order (deterministic mode on the sm_90a kernels)
    // GQA split on the sm_90a d <= 128 kernel: the last CTA of each (sequence, KV head, key
    // block) sums the splits' dK / dV partials itself (BwdWs::dkv_count, counters after dq_sem)
    // instead of the separate reduction kernel.
    bool dkv_in_kernel;
    // ---- the launch (plan_bwd)
    BwdKernel kernel;
    int tile;             // head-dim tile of the tensor-core kernels (round_head_dim; the wgmma tile)
    SimtShape simt;       // kSimt
    bool general_logits;  // kWgmma: the general-logits instance (common/mask.cuh logits_general)
    bool reduce_dkv;      // the GQA split's partials summed by the reduction kernel (not in the kernel)
    // CTA orders (BwdWs::heavy_first of each launch): the dK/dV grid's trailing heavy-first groups
    // (bwd_heavy_groups; mma.sync: all groups or none), the dQ pass's across-heads flag
    // (QueryBlockCta); -1 until plan_bwd computes them for a launch.
    int dkdv_order, dq_order;
    bool tma;  // kWgmma / kWgmmaWide: Q / dO by TMA where the maps encode (else cp.async)
    bool block_mask;  // kWgmma / kWgmmaWide: the BlockMasked instantiation (config.cuh)
};

// tc: the tensor-core kernels run (16-bit, or f32 on 3xTF32; plan.cu decides), else SIMT.
// sm90: the sm_90a dK/dV kernels run. Deterministic mode there adds dQ in the dK/dV kernel too,
// each query block's reductions in key-block order (BwdWs::dq_sem, counters after dq_accum),
// instead of the mma.sync kernels' separate dQ pass, which recomputes S and dP.
// GQA backward (plan_bwd below): the grid size in CTAs under which the query heads of a KV head
// are split over several CTAs (~2 waves of 132 SMs), and the key length from which the sm_90a
// backward gives every query head its own CTAs (the measurements below).
constexpr int64_t kBwdGqaSplitTarget = 264;
constexpr int kBwdGqaSplitKeys = 4096;
inline BwdPlan plan_bwd_workspace(const CfBwdParams& p, bool tc, bool sm90) {
    const CfFwdParams& f = p.fwd;
    BwdPlan pl{};
    pl.total_q = f.total_q;
    pl.total_k = f.total_k;
    pl.sem_blocks = (f.seqlen_q + 63) / 64;
    // (the counters are int-indexed; beyond that, the dQ pass)
    pl.ordered_dq = tc && sm90 && p.deterministic != 0 && 2 * (int64_t)f.b * f.h * pl.sem_blocks <= INT32_MAX;
    pl.atomic_dq = tc && (p.deterministic == 0 || pl.ordered_dq);
    // GQA/MQA on tensor cores: split the query heads of a KV head over several CTAs (hps heads
    // each; f32 dK / dV partials summed in a fixed order, by the last CTA of each key block on
    // the sm_90a d <= 128 kernel (dkv_in_kernel below), else by a reduction kernel) when the grid
    // would otherwise be small: ~2 waves of 132 SMs counted in 64-key blocks.
    // Under a causal mask (triangular: no left window) a CTA's work falls with its key block, and
    // the grid balances better with more, smaller CTAs. The sm_90a bwd.cuh kernel (d <= 128) then
    // counts its own CTAs of 128 keys, and from 4096 keys gives every query head its own CTAs.
    // Measured (2026-11-27 (commit 4324c52), H100, 32 / 8 heads, d = 128, bwd TF/s, before -> after):
    // - causal: 1k 149 -> 165, 2k 307 -> 310 (2 heads a CTA either way; 1 head measured 314 ->
    //   286), 4k 403 -> 408, 8k 469 -> 500, 16k 469 -> 539, 32k 555 -> 566;
    // - without a mask, one head a CTA was slower at 8k (542 -> 515: equal CTAs balance anyway, and
    //   the partials' traffic, 2 * group * seqlen_k * d floats a KV head, remains), so there the
    //   rule stays as it was.
    pl.nsplit = 1;
    pl.hps = f.h / f.hkv;
    if (tc && f.h > f.hkv) {
        const int group = f.h / f.hkv;
        const bool causal_narrow = sm90 && f.d <= 128 && f.window_right >= 0 && f.window_left < 0;
        const int key_block = causal_narrow ? 128 : 64;
        const int64_t ctas = (int64_t)((f.seqlen_k + key_block - 1) / key_block) * f.hkv * f.b;
        const int64_t target = kBwdGqaSplitTarget;
        int want = ctas >= target ? 1 : (int)((target + ctas - 1) / ctas);
        if (causal_narrow && f.seqlen_k >= kBwdGqaSplitKeys) want = group;
        if (want > group) want = group;
        pl.hps = (group + want - 1) / want;
        pl.nsplit = (group + pl.hps - 1) / pl.hps;
        if ((int64_t)f.hkv * pl.nsplit > 65535) { pl.nsplit = 1; pl.hps = group; }
    }
    size_t off = 0;
    pl.dsum_off = off;
    off += round256(sizeof(float) * (size_t)f.h * pl.total_q);
    pl.dq_off = off;
    // the tiled layout (sm_90a) holds the rows layout's floats and more; one size for both
    if (pl.atomic_dq)
        off += round256(sizeof(float) * (size_t)(pl.total_q + BwdWs::kDqSpareRows) * f.h * 64 * BwdWs::dq_panels(f.d));
    pl.sem_off = off;  // zeroed with dq_accum (one memset up to dkv_off)
    if (pl.ordered_dq) off += round256(sizeof(int) * 2 * (size_t)f.b * f.h * pl.sem_blocks);
    // One counter per (sequence, KV head, key block of at least 64 keys), zeroed by the same
    // memset (from cnt_off when there is no dq_accum).
    pl.dkv_in_kernel = pl.nsplit > 1 && sm90 && f.d <= 128;
    pl.cnt_off = off;
    if (pl.dkv_in_kernel) off += round256(sizeof(int) * (size_t)f.b * f.hkv * ((f.seqlen_k + 63) / 64));
    pl.dkv_off = off;
    if (pl.nsplit > 1) off += round256(sizeof(float) * 2 * (size_t)pl.nsplit * pl.total_k * f.hkv * f.d);
    pl.total = off;
    return pl;
}

// Forward on Hopper: which FwdSm90Traits configuration (config.cuh) runs for head-dim tile D.
// D = 64 with short queries: 128 x 128 persistent tiles (hiding the prologue / epilogue of short
// tiles matters most); longer: 192 x 128 (3 consumer warpgroups; 192 x 96 was 2-10% faster than
// 128 x 128 there, and 192 x 128 is 2-14% faster than 192 x 96); without masks, short queries
// run the 192 x 128 tile persistent (config.cuh FwdSm90TraitsD64Persistent). D = 128: 128 x 128.
// Which head-dim tiles the Hopper forward takes (the rest run the mma.sync kernel): d = 96 has a
// 96-column tile (config.cuh FwdSm90TraitsD96: shared memory keeps whole 64-column panels, zeros
// past d); d <= 32 stays on the mma.sync kernel's own 32 tile.
inline bool fwd_sm90_takes(int rounded_d) { return rounded_d >= 64; }
// Which head-dim tile the Hopper backward runs for a rounded head dim (0: the mma.sync kernel);
// d <= 32 stays on mma.sync. d = 96 has its own tile: the 128 tile's step with 96 columns of
// S^T / dP^T / dV / dK products (config.cuh BwdSm90Traits::kHeadDimPad); it ran on the 128 tile
// with zero-filled columns before (faster than the mma.sync 96 tile: bench/NOTES.md "Backward
// v4–v5").
inline int bwd_sm90_tile(int rounded_d) { return rounded_d >= 64 ? rounded_d : 0; }
// Whether a grid starts every head's heaviest CTAs first, across heads: the dK/dV kernels take
// their CTAs key block slowest (common/bwd_work.cuh DkdvCta), the query-block grids (the mma.sync
// forward and dQ kernels) query block slowest, last first (common/mask.cuh QueryBlockCta). Under
// causal-like masks the first key blocks / last query blocks of a head carry the most work, and
// in launch order the last head's heaviest CTA starts in the last wave. Only on grids of at most
// 4 waves (`slots`: the CTAs the device runs at once): there one CTA is a large part of an SM's
// work (GQA 4:1 causal, N = 8k: 512 CTAs, the heaviest 512 steps against ~1000 per SM; sm_90a bwd
// +24% on an H200, +7% on an H100; N = 2k +31-34%), while on larger grids of many heads (N = 2k,
// B = 8: 2048 CTAs) the new order loses the heads' Q / dO (K / V) locality in L2 (-15%) and the
// tail is a few percent (bench/NOTES.md, 2026-11-26, commit f0052a2, 2026-11-26, commit 640d14c).
// `max_waves`: 4 for the sm_90a dK/dV kernels (measured there); see mma_sync_heavy_first for the
// mma.sync kernels.
inline bool heavy_first_order(const CfFwdParams& f, int64_t ctas, int64_t slots, int max_waves = 4) {
    // (ctas <= 65535 also lets QueryBlockCta put the query blocks and the sequences on grid axes
    // y and z, whose limit that is)
    return f.window_right >= 0 && ctas <= max_waves * slots && ctas <= 65535;
}
// The sm_90a dK/dV kernels' order (common/bwd_work.cuh DkdvCta), as the number of the grid's last
// (KV head * split, sequence) groups, of `groups` with `key_blocks` CTAs each, that run key block
// slowest: all of them on grids of at most 4 waves (heavy_first_order). Beyond that, under
// causal-like masks, a group's key block 0 carries about twice its mean work and in launch order
// the last groups' start in the last waves: a list-scheduling model (experiments/cta_order_model.py)
// puts the makespan 5-7% above ideal where a group has fewer key blocks than a wave has slots
// (d = 128 causal at 2k-8k, d = 256 at 4k), <1% from there on (16k). There the last
// kBwdTailWaves waves' worth of groups run key block slowest (model: 1-1.3% above ideal;
// measured -2 to +6.5%, +3% on average, bench/NOTES.md, 2026-11-27, commit 2031cb3), and the CTAs
// running together still come from a few heads: every group in that order cost 20-45% at 1k-4k
// (L2).
constexpr int kBwdTailWaves = 2;
// The rule both launchers share, for `groups` groups of `blocks` CTAs whose first CTA carries the
// most work: the trailing groups that hold kBwdTailWaves waves, or 0 where no group's heavy
// CTA can start late (a group as long as a wave, one wave in all) or the grid's flat CTA index would
// not fit 32 bits (DkdvCta computes it unsigned; the forward's launcher refuses grids of more than
// INT32_MAX tiles before it asks).
inline int trailing_heavy_groups(int64_t blocks, int64_t groups, int64_t slots) {
    if (blocks <= 0 || blocks >= slots) return 0;
    if (blocks * groups <= slots || blocks * groups > (int64_t)UINT32_MAX) return 0;
    return (int)std::min<int64_t>(groups, (kBwdTailWaves * slots + blocks - 1) / blocks);
}
inline int bwd_heavy_groups(const CfFwdParams& f, int64_t key_blocks, int64_t groups, int64_t slots) {
    if (heavy_first_order(f, key_blocks * groups, slots)) return (int)groups;
    return f.window_right >= 0 ? trailing_heavy_groups(key_blocks, groups, slots) : 0;
}
// The one-tile-per-CTA sm_90a forward (the d = 64 192 x 128 tile; sm90/tile_scheduler.cuh): under
// causal masks each head's query blocks go heaviest first, and the last groups' heaviest tiles
// would start in the last waves, as in the backward above. Same rule: the last kBwdTailWaves
// waves' worth of (head, sequence) groups run query block slowest, where a head has fewer query
// blocks than a wave has slots.
inline int fwd_heavy_groups(const CfFwdParams& f, int64_t query_blocks, int64_t groups, int64_t slots) {
    const bool causal_like = f.window_right >= 0 && f.window_left < 0;
    return causal_like ? trailing_heavy_groups(query_blocks, groups, slots) : 0;
}
// The same choice for the mma.sync kernels (sm80/; `query_grid`: the forward and dQ grids, else
// dK/dV). f32 runs 3xTF32, bound by the tensor cores even when no K / V tile is shared in L2:
// up to 16 waves (H100, f32 causal, B·N = 16384: d = 256 forward +9-10% at 512-4k, backward +5-7%
// from 2k; d = 64 / 128 forward +3-5%). The 16-bit forward up to 16 waves only while every head
// keeps two or more of a wave's slots (2·h·b <= slots), so that the CTAs running at once still
// share K / V in L2 (d = 128 at 4k / 16k +12%, d = 256 at 2k +7-17%; d = 64 at 1k, 512 heads,
// -12% without that rule). The 16-bit dK/dV kernels keep launch order (their timings moved by
// less than the run-to-run spread, and the order cost the d = 256 instance 4 bytes of spills on
// sm_90a). Measured with CANDLE_FLASH_DISABLE_SM90A on an H100 (bench/NOTES.md, 2026-11-26,
// commit 640d14c); on an A100 these kernels are the only ones.
inline bool mma_sync_heavy_first(const CfFwdParams& f, int64_t ctas, int64_t slots, bool query_grid) {
    if (f.dtype == CF_F32) return heavy_first_order(f, ctas, slots, 16);
    return query_grid && heavy_first_order(f, ctas, slots, 16) && 2 * (int64_t)f.h * f.b <= slots;
}

// e4m3 forward (sm_90a only): the 128 head-dim tile up to d = 128 (d = 64 with zero-filled
// columns: 8-bit rows of 64 bytes would need a second swizzle mode), else the 256 tile.
inline int fwd_fp8_tile(int d) { return d <= 128 ? 128 : 256; }
// The 128 tile's wide key blocks (config.cuh FwdSm90Fp8TraitsD128Long: 256 keys, serial P V) from
// 4096 queries and keys: faster from 8k, slower at 2k (H100, bench/NOTES.md "FP8: 256 keys,
// serial P V").
// The 256 tile has no wider block: its V^T stages (64 KB per 128 keys) fill shared memory.
inline bool fwd_fp8_long(const CfFwdParams& p) {
    return fwd_fp8_tile(p.d) == 128 && p.seqlen_q >= 4096 && p.seqlen_k >= 4096;
}
// The e4m3 configuration (config.cuh CF_FWD_SM90_FP8_CONFIGS) of a call.
inline FwdSm90Config fwd_fp8_config(const CfFwdParams& p) {
    if (fwd_fp8_tile(p.d) == 256) return FwdSm90Config::kFp8D256;
    return fwd_fp8_long(p) ? FwdSm90Config::kFp8D128Long : FwdSm90Config::kFp8D128;
}

// Where the e4m3 forward keeps V transposed (8-bit wgmma reads B K-major only, so P V needs V^T
// with keys along the rows): e4m3 [batches][hkv][d][cols] in the forward's workspace, written by
// a transpose pass before the attention kernel (sm90/fwd.cu). Key j of sequence b sits at column
// col0(b) + the position of j in its 32-key group's fragment order (fp8_vt_key):
//   batched: batches = b, col0 = 0, cols = fp8_vt_padded_keys(seqlen_k);
//   varlen:  batches = 1, col0 = (row 0 of b rounded up to 16) + kFp8VtSeqGap b, cols = total_k
//            rounded up to 16 + kFp8VtSeqGap b.
// Each sequence owns fp8_vt_padded_keys(its length) columns, zeros past its end: at least 255
// more than its length, so every key block the FP8 kernels use (any width up to 256 keys, not
// only divisors of 256: 192 and 224 are not) that starts inside the sequence ends on zeros (P is
// 0 past the end, and V must not be NaN there). The kernels load V^T in whole 128-key boxes, so a
// 192-key block also reads 64 columns it never multiplies: any values, or TMA's zeros past cols.
// A pure function of the parameters (cf_fwd_workspace_size and cf_fwd agree).
struct Fp8VtLayout {
    int64_t batches, cols;
    size_t bytes;
};
constexpr int kFp8KeyPad = 256;
__host__ __device__ inline int64_t fp8_vt_padded_keys(int64_t sk) {
    return (sk + 2 * kFp8KeyPad - 2) / kFp8KeyPad * kFp8KeyPad;  // sk + 255 rounded up to 256
}
// >= the most fp8_vt_padded_keys adds to a length (510) + 15 (the rounding of col0): sequences'
// padded columns never overlap.
constexpr int kFp8VtSeqGap = 3 * kFp8KeyPad;
// Column of varlen sequence b's key 0 (its first packed key row row0); also, with b = the number
// of sequences and row0 = total_k, the columns the layout needs.
__host__ __device__ inline int64_t fp8_vt_varlen_col0(int64_t row0, int b) {
    return (row0 + 15) / 16 * 16 + (int64_t)kFp8VtSeqGap * b;
}
// Whether the kernel fwd_fp8 runs for p transposes V itself (config.cuh kFp8VtInKernelShort /
// Long, the traits' kVtInKernel): then no workspace, and V is read through a row map like K's.
inline bool fwd_fp8_vt_in_kernel(const CfFwdParams& p) {
    return fwd_fp8_tile(p.d) == 128 && (fwd_fp8_long(p) ? kFp8VtInKernelLong : kFp8VtInKernelShort);
}
inline Fp8VtLayout fp8_vt_layout(const CfFwdParams& p) {
    Fp8VtLayout l{};
    if (fwd_fp8_vt_in_kernel(p)) return l;  // no V^T in memory
    const bool varlen = p.cu_seqlens_k != nullptr;
    l.batches = varlen ? 1 : p.b;
    l.cols = varlen ? fp8_vt_varlen_col0(p.total_k, p.b) : fp8_vt_padded_keys(p.seqlen_k);
    if (l.cols < kFp8KeyPad) l.cols = kFp8KeyPad;  // a legal map even with no key
    l.bytes = round256((size_t)l.batches * p.hkv * p.d * l.cols);
    return l;
}
constexpr int kFwdSm90D64ShortMaxSeq = 2048;
// Sequence lengths from which the wide key blocks (config.cuh "...Long") pay, per head-dim tile
// (H100, bench/NOTES.md "Forward: wider key blocks"): below, their two stages (three for the
// narrow d = 128 / 192 tiles) and wider diagonal blocks cost more than the fewer per-block fixed
// costs save (d = 128: -17% at 512 causal, -2-4% at 2k; level at 4k, +4-5% from 8k).
inline bool fwd_sm90_long(const CfFwdParams& p, int tile) {
    const bool masked = p.window_right >= 0;  // causal-like: diagonal blocks
    const int from = tile == 128 ? 4096 : tile == 192 ? 1024 : (masked ? 8192 : 4096);
    return p.seqlen_k >= from && p.seqlen_q >= from;
}
// Through a block mask: the 128-row tiles whose key blocks divide the mask's 128 (one query
// block a tile, whole tiles per key block: common/block_sparse.cuh).
inline FwdSm90Config fwd_sm90_config(const CfFwdParams& p) {
    if (has_block_mask(p)) {
        switch (round_head_dim(p.d)) {
            case 64: return FwdSm90Config::kD64Short;
            case 96: return FwdSm90Config::kD96;
            case 128: return FwdSm90Config::kD128;
            case 192: return FwdSm90Config::kD192;
            default: return FwdSm90Config::kD256;
        }
    }
    switch (round_head_dim(p.d)) {
        case 64: {
            const bool masked = has_window(p);
            if (p.seqlen_q > kFwdSm90D64ShortMaxSeq) return FwdSm90Config::kD64;
            return masked ? FwdSm90Config::kD64Short : FwdSm90Config::kD64Persistent;
        }
        case 96: return fwd_sm90_long(p, 128) ? FwdSm90Config::kD96Long : FwdSm90Config::kD96;
        case 128: return fwd_sm90_long(p, 128) ? FwdSm90Config::kD128Long : FwdSm90Config::kD128;
        case 192: return fwd_sm90_long(p, 192) ? FwdSm90Config::kD192Long : FwdSm90Config::kD192;
        default: return fwd_sm90_long(p, 256) ? FwdSm90Config::kD256Long : FwdSm90Config::kD256;
    }
}

// ------------------------------------------------------------------ the plans of a call
// Which kernel family a forward runs (plan_fwd): the SIMT kernels (what only they run: heads past
// the tensor-core tiles without the wide-head kernel, a value head dim of its own, prefix ranges;
// f32 whose tensors the tiles cannot load), the mma.sync kernel (sm80/fwd.cu), the split-KV
// decode (sm80/fwd_split.cu), the wide-head kernel (sm80/fwd_wide_split.cu), the sm_90a wgmma
// kernel (sm90/fwd.cu) in a 16-bit or an e4m3 configuration, the sm_90a wgmma kernel of 512-wide
// heads (sm90/fwd_wide.cu: d = dv = 512 past the decode shapes).
enum class FwdKernel { kSimt, kMmaSync, kSplit, kWideSplit, kWgmma, kWgmmaWide };
struct FwdPlan {
    FwdKernel kernel;
    int tile;            // head-dim tile of kMmaSync / kSplit / kWgmma (round_head_dim; e4m3: fwd_fp8_tile)
    bool paged;          // kMmaSync: the paged-K/V instantiation (sm80/fwd.cu says why it has its own)
    bool hopper_tile;    // kMmaSync, f32 at d = 256: the 128-row 8-warp tile (config.cuh FwdTraits)
    SimtShape simt;      // kSimt
    FwdSm90Config sm90;  // kWgmma (an e4m3 row for e4m3 inputs)
    SplitPlan split;     // kSplit / kWideSplit; nsplit = 1 otherwise
    // The CTA order (-1 until plan_fwd computes it for a launch): kMmaSync 1 = query block slowest
    // across heads (common/mask.cuh QueryBlockCta, mma_sync_heavy_first); kWgmma the trailing
    // (head, sequence) groups that run query block slowest (fwd_heavy_groups); 0 = launch order.
    int cta_order;
    int64_t ctas;        // kWgmma / kWgmmaWide: the grid (persistent configurations: at most one wave); -1 until planned
    bool tma;            // kWgmma / kWgmmaWide: Q / K / V by TMA where the maps encode (else cp.async throughout)
    size_t workspace;    // bytes cf_fwd needs (split partials, the e4m3 V^T)
    bool block_mask;     // kWgmma: the BlockMasked instantiation of configuration sm90 (config.cuh)
};
// What a plan is for: sizing the workspace (no occupancy query, nothing the size depends on) or
// a launch (the CTA orders too, which read the kernels' occupancy on the device).
enum class PlanFor { kWorkspace, kLaunch };
// The plans of a call whose parameters check_fwd / check_bwd accepted (plan.cu), into pl; an
// error of a device query the plan needs (an occupancy, the SM count) is returned.
cudaError_t plan_fwd(const CfFwdParams& p, PlanFor what, FwdPlan& pl);
cudaError_t plan_bwd(const CfBwdParams& p, PlanFor what, BwdPlan& pl);
// The plans as text ("wgmma D128Long order=0 workspace=0", cf_fwd_describe / cf_bwd_describe).
void describe_fwd_plan(const FwdPlan& pl, char* buf, size_t cap);
void describe_bwd_plan(const BwdPlan& pl, char* buf, size_t cap);

// The device facts the plans and the argument checks read (plan.cu; each read once per device).
bool smem_fits(int bytes);
// Whether the sm_90a kernels may load by TMA: the driver has the tensor-map encoder, and
// CANDLE_FLASH_DISABLE_TMA=1 does not switch it off (to run and test their cp.async paths).
bool tma_enabled();
// The calls only the SIMT kernels run, and their shape (config.cuh SimtShape).
bool simt_only(const CfFwdParams& p);
// The head-dim tile of the wgmma backward of a call, 0 when the mma.sync / SIMT kernels run.
int bwd_sm90_tile_for(const CfFwdParams& f);
SimtShape simt_shape(const CfFwdParams& p);
// The 16-byte rules of the tensor-core tile loads (elements of elem_bytes bytes; batch strides
// are not checked for varlen sides).
bool tensor_aligned(const void* ptr, int64_t batch_stride, int64_t row_stride, int64_t head_stride, bool varlen,
                    int elem_bytes = 2);

// Occupancy of the kernels a plan names, asked of the launchers' translation units (where the
// kernels are) by plan_bwd / plan_fwd for the CTA orders: the CTAs one wave of the kernel runs.
template <typename T, int D, bool kPaged, bool kHopperTile>
cudaError_t fwd_tc_wave_slots(int64_t& slots);
// The backward's dK/dV kernel of plan pl (and its key block), and the dQ pass (and its query block).
struct BwdWave {
    int64_t dkdv_slots, dq_slots;
    int dkdv_block_n, dq_block_m;
};
template <typename T, int D>
cudaError_t bwd_tc_wave(const BwdPlan& pl, BwdWave& w);

}  // namespace cf
