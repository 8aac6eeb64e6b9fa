// Every tile configuration of every kernel family, in one place: kernels read their shapes from
// these traits, the static_asserts say what the kernel code assumes. Which configuration runs
// for a call is decided by the plan layer (plan.cuh, plan.cu), nowhere else.
#pragma once
#include <type_traits>
#include "common/tile.cuh"

namespace cf {

// Head dims that get their own instantiation; d is rounded up to the next one (extra columns
// are zero-filled on load and never stored).
constexpr int kHeadDims[] = {32, 64, 96, 128, 192, 256};
inline int round_head_dim(int d) {
    return d <= 32 ? 32 : d <= 64 ? 64 : d <= 96 ? 96 : d <= 128 ? 128 : d <= 192 ? 192 : 256;
}
// Calls f(std::integral_constant<int, D>{}) for head-dim tile `tile` (one of kHeadDims; 256 for
// any other value): the one switch from a plan's tile to the instantiation of that tile.
template <typename F>
decltype(auto) with_head_dim_tile(int tile, F&& f) {
    switch (tile) {
        case 32: return f(std::integral_constant<int, 32>{});
        case 64: return f(std::integral_constant<int, 64>{});
        case 96: return f(std::integral_constant<int, 96>{});
        case 128: return f(std::integral_constant<int, 128>{});
        case 192: return f(std::integral_constant<int, 192>{});
        default: return f(std::integral_constant<int, 256>{});
    }
}

// Columns of a head-dim tile in the sm_90a kernels' shared memory: whole 128-byte panels (the
// wgmma swizzle's width), zeros past d; the products read only the tile's own columns.
constexpr int panel_padded_cols(int cols, int elem_bytes) { return (cols * elem_bytes + 127) / 128 * 128 / elem_bytes; }

// ------------------------------------------------------------------ forward (tensor cores)
// CTA = kNWarps warps over kBlockM query rows (each warp owns kMTiles m16 tiles), looping over
// kBlockN keys per step. Shared memory: Q [kBlockM][D] + K [kBlockN][D] + V [kBlockN][D].
// kPaged: K/V read through the paged block table (its own instantiation, chosen by the plan):
// 64 query rows for d = 96 / 128, since with 128 (two m16 tiles per warp) the page lookups on top
// of the accumulators made the kernel spill (ptxas -v: 32 / 168 bytes; also with the K load
// moved after P V). Measured consequence: with a left-bounded window the 128-row contiguous tile
// also walks key blocks that are fully masked for some of its rows, after their visible ones,
// and the online softmax rescales those rows by exp2(m c - fl(m c)) (not exactly 1), so paged
// and contiguous can differ in the last bits there (d = 96 / 128 on this kernel only).
// f32 (3xTF32, common/tile.cuh): every product costs 3 mmas and every operand twice the
// registers (big + small parts) and twice the shared memory, so 64 query rows above d = 64 (S 32
// + O 64 registers at d = 128) and 32 keys above d = 128 (the tiles fit sm_80's shared memory).
// kHopperTile (f32 at d = 256 where the device has 192 KB of shared memory for a block: Hopper):
// 128 query rows on 8 warps (each still 16 rows: O 128 registers) over the same 32-key blocks,
// 192 KB; every K / V block then serves twice the rows. H100 against PyTorch's efficient SDPA in
// f32: 0.84-1.00x on the 16-key block of two 4-warp CTAs per SM (as of 2026-11-26, commit 6b00961)
// -> 0.90-1.16x (bench/NOTES.md, 2026-11-26, commit d223264). Paged K/V takes it too, so that a paged
// call keeps the contiguous call's bits.
template <typename T_, int kHeadDim_, bool kPaged_ = false, bool kHopperTile_ = false>
struct FwdTraits {
    using Elem = T_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr bool kPaged = kPaged_;
    static constexpr bool kF32 = sizeof(T_) == 4;
    static constexpr int kBlockM = kHopperTile_ || kHeadDim <= (kF32 || kPaged ? 64 : 128) ? 128 : 64;
    static constexpr int kBlockN = kF32 && kHeadDim > 128 ? 32 : 64;
    static constexpr int kNWarps = kHopperTile_ ? 8 : 4;
    static constexpr int kNThreads = kNWarps * 32;
    static constexpr int kMTiles = kBlockM / (16 * kNWarps);
    static constexpr int kSmemBytes = (kBlockM + 2 * kBlockN) * kHeadDim * (int)sizeof(T_);

    static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "head dim tile: multiple of 32, <= 256");
    static_assert(kBlockM == 16 * kNWarps * kMTiles, "warps own whole m16 tiles");
    static_assert(kBlockN % 16 == 0, "P*V k-steps of 16 keys");
    static_assert(kSmemBytes <= 160 * 1024 || (kHopperTile_ && kSmemBytes <= 227 * 1024),
                  "must fit sm_80's 163 KB (the Hopper tile: Hopper's 227 KB, plan.cu checks)");
    static_assert(!kHopperTile_ || (kF32 && kHeadDim == 256), "the Hopper tile is f32 d = 256's");
};

// ------------------------------------------------------------------ forward, split-KV decode (sm80/fwd_split.cu)
// CTA = 4 warps over kSplitBlockM packed query rows (GQA heads x queries), one chunk of the key
// range in kSplitBlockN blocks.
constexpr int kSplitBlockM = 64, kSplitBlockN = 64;
template <typename T_, int kHeadDim_, int kStages_>
struct SplitTraits {
    using Elem = T_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kSplitBlockM, kBlockN = kSplitBlockN, kNWarps = 4, kNThreads = 128;
    // (K, V) block pairs in the ring: kStages - 1 in flight while one is used (2 when the grid
    // fills every SM with 2 CTAs; 4 when there is at most one CTA per SM, to keep more bytes in
    // flight; f32 at d = 128: 2, the most that fits sm_80's shared memory)
    static constexpr int kStages = sizeof(T_) == 4 && kHeadDim == 128 ? 2 : kStages_;
    static constexpr int kSmemBytes = (kBlockM + 2 * kStages * kBlockN) * kHeadDim * (int)sizeof(T_);
    static_assert(kSmemBytes <= 160 * 1024, "must fit sm_80's 163 KB");
    static_assert(kBlockM == 16 * kNWarps, "one m16 tile per warp");
    static_assert(kBlockN % 16 == 0 && kStages >= 2, "P*V k-steps of 16 keys; a ring");
    static_assert(kHeadDim == 64 || kHeadDim == 128, "split path: head-dim tiles 64 / 128");
};

// ------------------------------------------------------------------ forward, split-KV decode of wide heads (sm80/fwd_wide_split.cu)
// Head dims the 64 / 128 split kernel does not take: d up to 576 and dv up to 512 (MLA's absorbed
// decode, (576, 512) with one KV head; 512-wide heads). CTA = 8 warps over kBlockM packed rows
// (every query head of one KV head x its queries), key blocks of kBlockN in a ring of kStages.
// kVInK: v is the first dv columns of k's rows (MLA's latent cache, v_is_view_of_k): the ring
// holds K only and P V reads the K tile, so the cache is read once. Shared memory: Q [kBlockM][576],
// the ring, the S partials [kKSplit][kBlockM][kBlockN + 8] f32 (S = Q K^T is cut over the k axis
// where the rows are too few to give every warp keys of its own), P [kBlockM][kBlockN] and three
// f32 per row (rescale factor, 1 / l, lse).
constexpr int kWideSplitQkDim = 576, kWideSplitVDim = 512, kWideSplitBlockN = 32;
template <typename T_, int kBlockM_, bool kVInK_, int kStages_>
struct WideSplitTraits {
    using Elem = T_;
    static constexpr int kBlockM = kBlockM_, kBlockN = kWideSplitBlockN, kStages = kStages_;
    static constexpr bool kVInK = kVInK_;
    static constexpr int kQkDim = kWideSplitQkDim, kVDim = kWideSplitVDim;
    static constexpr int kNWarps = 8, kNThreads = 256;
    static constexpr int kCk = kQkDim / 8, kCv = kVInK ? kCk : kVDim / 8;  // 16-byte chunks per row
    // S = Q K^T: warp (row tile, key tile of 16, k slice); kKSplit k slices of the 36 k-steps
    static constexpr int kMTiles = kBlockM / 16, kNTiles = kBlockN / 16;
    static constexpr int kKSplit = kNWarps / (kMTiles * kNTiles);
    static constexpr int kKSteps = kQkDim / 16 / kKSplit;
    // O += P V: warp (row tile, kVDim * kMTiles / 8 output columns)
    static constexpr int kOutCols = kVDim * kMTiles / kNWarps;
    static constexpr int kLdS = kBlockN + 8;  // f32 row of the S partials (conflict-free float2 stores)
    static constexpr int kQBytes = kBlockM * kQkDim * 2;
    static constexpr int kStageBytes = kBlockN * (kQkDim + (kVInK ? 0 : kVDim)) * 2;
    static constexpr int kSBytes = kKSplit * kBlockM * kLdS * 4;
    static constexpr int kPBytes = kBlockM * kBlockN * 2;
    static constexpr int kSmemBytes = kQBytes + kStages * kStageBytes + kSBytes + kPBytes + 3 * kBlockM * 4;

    static_assert(sizeof(T_) == 2, "f16 / bf16");
    static_assert(kBlockM == 16 || kBlockM == 64, "row tiles of 16 or 64");
    static_assert(kKSplit >= 1 && kMTiles * kNTiles * kKSplit == kNWarps, "every warp has a share of S");
    static_assert(kQkDim / 16 % kKSplit == 0, "whole k-steps per slice");
    static_assert(kOutCols % 64 == 0, "output columns of a warp start at a multiple of 8 chunks (swizzle)");
    static_assert(kStages >= 2 && kSmemBytes <= 227 * 1024, "a ring; Hopper's 227 KB (the plan checks the device)");
};

// ------------------------------------------------------------------ forward (sm_90a wgmma)
// Where the e4m3 d <= 128 forward transposes V (8-bit wgmma reads V^T): inside the attention
// kernel (sm90/fwd.cu FwdVTranspose: the producer warpgroup, from a raw TMA-loaded V tile) or in
// the pre-pass (fp8_transpose_v_kernel, into the workspace): in the kernel on the 128-key tile
// (below 4096 keys), the pre-pass for the 256-key tile. H100 / H200 (bench/NOTES.md "FP8: V
// transposed inside the kernel"): in the kernel +2-15% at 1k-2k, but 5-13% slower on the 256-key
// tile (4k-16k), where the transpose's shared-memory stores slow the consumers' softmax more than
// the pre-pass costs (~1-2%).
constexpr bool kFp8VtInKernelShort = true, kFp8VtInKernelLong = false;
// Warp-specialised CTA: kNWarpGroups consumer warpgroups, each owning 64 query rows (one m64
// wgmma tile) and looping over kBlockN keys per step, plus one producer warpgroup that issues
// the cp.async loads of Q and of the K / V ring (kStages stages, mbarrier-guarded).
// Registers: the launch gives every thread kLaunchRegs; the producer then lowers itself to
// kProducerRegs (setmaxnreg) and the consumers take what it freed (kConsumerRegs).
// kPingPong: the consumer warpgroups take turns issuing their GEMMs (named barriers), so one's
// softmax overlaps the others' tensor-core work.
// kPersistent: one wave of CTAs looping over (query block, head, batch) tiles, so the next
// tile's loads overlap the current tile's last GEMMs and epilogue (otherwise one CTA per tile).
// kSeparateO: the output is staged in its own buffer (the next tile's Q can be loaded
// meanwhile) instead of in the consumers' rows of Q.
// Shared memory: FwdSharedStorage (sm90/fwd.cu; panel layout of sm90/wgmma.cuh, 1024-byte
// aligned tiles): Q [kBlockM][D] (+ O [kBlockM][D]) + K, V [kStages][kBlockN][D] + the pipeline
// mbarriers; the launch asks for its sizeof and asserts it fits. Head-dim tiles 64, 96, 128, 192,
// 256; shared memory holds whole 64-column panels (96: 128 columns, see kHeadDimPad).
// Out_: the output's element type (T_ but for e4m3 inputs, whose output is f16 or bf16).
// kFp8 (e4m3 inputs): both products run on 8-bit wgmma (k32), which reads both operands K-major,
// so V arrives transposed (sm90/fwd.cu: Fp8VtLayout): a V^T stage is [D][kVtKeys], whole 128-key
// panels (kBlockN rounded up to 128: a 192-key block loads and keeps 256 columns and multiplies
// the first 192), key blocks of 32-key multiples, head-dim tiles 128 and 256 (one or two panels
// of Q / K rows).
template <typename T_, int kHeadDim_, int kBlockN_, int kNWarpGroups_, int kStages_, bool kPingPong_,
          bool kPersistent_, bool kSeparateO_, typename Out_ = T_, bool kVtInKernel_ = false>
struct FwdSm90Traits {
    static constexpr bool kBlockMasks = false;  // BlockMasked<> sets it
    using Elem = T_;
    using Out = Out_;
    static constexpr int kElemBytes = (int)sizeof(T_);
    static constexpr bool kFp8 = kElemBytes == 1;
    static constexpr int kHeadDim = kHeadDim_;
    // Columns of the Q / K / V / O tiles in shared memory: whole 128-byte panels (the swizzle's
    // width). A 96-column head-dim tile keeps 128 columns, loaded with zeros past d (TMA's
    // out-of-bounds fill, or cp.async's), and its products read only the first 96: Q K^T in 6 k16
    // steps, P V as an n96 wgmma over one and a half panels of V.
    static constexpr int kHeadDimPad = panel_padded_cols(kHeadDim, kElemBytes);
    static constexpr int kNWarpGroups = kNWarpGroups_;  // consumers
    static constexpr int kNConsumerThreads = 128 * kNWarpGroups;
    static constexpr int kNThreads = kNConsumerThreads + 128;  // + the producer warpgroup
    static constexpr int kBlockM = 64 * kNWarpGroups;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kStages = kStages_;
    static constexpr int kMinBlocks = 1;  // one CTA per SM (registers: all of the SM's)
    static constexpr bool kPingPong = kPingPong_ && kNWarpGroups > 1;
    static constexpr bool kPersistent = kPersistent_;
    static constexpr bool kSeparateO = kSeparateO_;
    static constexpr int kLaunchRegs = (65536 / kNThreads) & ~7;
    // The producer only computes addresses (40 registers, spill-free: keep its code lean, e.g.
    // MaskInfo's 32-bit math); consumers get the rest. d = 64, 2 consumer warpgroups: 56, since
    // its paged K/V loads (page lookups, SeqInfo::load_keys) spilled at 40 (ptxas -v: 52 / 136
    // bytes); the consumers get 224 instead of 232. d = 64, 3 consumer warpgroups (192 x 128):
    // 32 with its cp.async row passes rolled (FwdProducer::kRolled; unrolled they spilled 76
    // bytes), so that the consumers get the 160 that S 64 + P 32 + O 32 need (at 152 they spilled).
    // e4m3: TMA only, no cp.async paths: the producer runs at the minimum (24), and the
    // consumers take 240 (d = 256: O 128 + S 64 + P 16 registers).
    // e4m3 with V transposed in the kernel (kVtInKernel, 128 head-dim tile): the producer also
    // transposes V, at 32 (the consumers keep 240).
    static constexpr bool kVtInKernel = kVtInKernel_;
    static constexpr int kProducerRegs =
        kFp8 ? (kVtInKernel ? 32 : 24) : kHeadDim == 64 ? (kNWarpGroups == 3 ? 32 : 56) : 40;
    static constexpr int kConsumerRegs0 = ((kLaunchRegs * kNThreads - 128 * kProducerRegs) / kNConsumerThreads) & ~7;
    static constexpr int kConsumerRegs = kConsumerRegs0 > 240 ? 240 : kConsumerRegs0;
    // e4m3 with more than 224 keys per block (kSerialPV; sm90/fwd.cu FwdMainloop): a step runs
    // P(j-1) V(j-1) to completion, then S(j), then the softmax, instead of the softmax while P V
    // finishes. No product is then in flight while another's registers are live: S 128 + O 64 is
    // the peak at 256 keys and d = 128, where the overlapped step (S 128 + O 64 + P 32) spilled
    // and serialised its wgmmas. cuDNN's FP8 forward (ncu, 9.19: 64 x 256 per warpgroup, P from
    // registers) waits the same way. Up to 224 keys the overlapped step fits (S 112 + P 28 + O 64)
    // and is faster (192 keys serial: -7%; bench/NOTES.md "FP8: 256 keys, serial P V").
    static constexpr bool kSerialPV = kFp8 && kBlockN > 224;
    // Where O is rescaled by a block's softmax correction (sm90/fwd.cu FwdMainloop): at the end of
    // the step (after the previous P V completed) or, early, in the next step between issuing S
    // and P V (FlashAttention-3's place, off the step's critical tail). Early pays where O is
    // large: 16-bit d = 256 (H100: +6-8% at 8k-16k on the 64-key tile, +1-3% on the 80-key one);
    // at d = 64 / 128 / 192 it measured level (within +-3%), on e4m3 1-4% slower.
    // (Never with kSerialPV: its step rescales O between its two products, P V being complete.)
    static constexpr bool kEarlyRescale = !kSerialPV && !kFp8 && kHeadDim == 256;
    static constexpr int kQBytes = kBlockM * kHeadDimPad * kElemBytes;
    static constexpr int kKVStageBytes = kBlockN * kHeadDimPad * kElemBytes;
    static constexpr int kVtKeys = kFp8 ? (kBlockN + 127) / 128 * 128 : kBlockN;  // keys of a V stage
    static constexpr int kVStageBytes = kVtKeys * kHeadDimPad * kElemBytes;
    // The raw V tile that the producer transposes into a V^T stage (kVtInKernel): [kBlockN][128].
    static constexpr int kVRawBytes = kVtInKernel ? kBlockN * kHeadDimPad : 0;

    static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256 && (!kFp8 || kHeadDim == kHeadDimPad),
                  "wgmma forward: k16 steps in whole 32-byte chunks; e4m3 head-dim tiles of whole panels");
    static_assert(!kFp8 || (kBlockN % 32 == 0 && kBlockN <= 256 && kSeparateO),
                  "e4m3: P V^T in k-steps of 32 keys; O (16-bit) has its own buffer");
    static_assert(kFp8 || std::is_same<Out_, T_>::value, "16-bit inputs: output of the same type");
    static_assert(!kVtInKernel || (kFp8 && kHeadDimPad == 128), "V^T in the kernel: one 128-byte panel of d");
    static_assert(kStages >= 2, "K/V ring");
    static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "wgmma N of S = Q K^T; P V in k-steps of 16 keys");
    static_assert(kBlockM % 16 == 0 && kBlockN % 16 == 0, "load_panels row passes (128 producer threads)");
    static_assert(kQBytes % 1024 == 0 && kKVStageBytes % 1024 == 0 && kVStageBytes % 1024 == 0,
                  "tiles stay 1024-byte aligned");
    static_assert(kConsumerRegs > kLaunchRegs, "setmaxnreg: consumers gain what the producer gives up");
    static_assert(kNWarpGroups <= 4, "named barriers 1..kNWarpGroups; ping-pong barriers count 256 threads");
};
// The configurations the plan chooses from (plan.cuh fwd_sm90_config; H100 measurements, bf16, B*N = 16384):
//   D = 64, seqlen_q <= 2048: 128 x 128 tiles, persistent (tiles are short: hiding their
//            prologue / epilogue matters most); 4 stages, output in its own buffer.
//   D = 64, longer:  192 x 128 tiles (3 consumer warpgroups at 160 registers, the producer at 32;
//            +2-14% over 192 x 96 from 4k: bench/NOTES.md "Forward d = 64: 192 x 128"; 128 x 128
//            and persistent launches measured 2-10% slower than 192 x 96 there).
//   D = 96 / 128: 128 x 128 tiles, persistent; 2 stages and O in its own buffer.
//   D = 192: 128 x 64 tiles, 3 stages, persistent (Q 48 KB + K/V 144 KB).
//   D = 256: 128 x 64 tiles, 2 stages, persistent (Q 64 KB + K/V 128 KB). O 128 + S 32 + P 16.
// and for long sequences (plan.cuh fwd_sm90_config) wider key blocks in 2 stages, which
// spread the per-block fixed costs (row max / sum, the O rescale, barriers) over more keys:
//   D = 128: 128 x 176 (FlashAttention-3's tile; Q 32 KB + K/V 176 KB; S 88 + P 44 + O 64).
//   D = 192: 128 x 96 (Q 48 KB + K/V 144 KB; S 48 + P 24 + O 96).
//   D = 256: 128 x 80 (FlashAttention-3's; Q 64 KB + K/V 160 KB; S 40 + P 20 + O 128; 40 bytes
//            of loop-invariant words spilled, loaded once per block).
//   H100, same runs (bench/NOTES.md "Forward: wider key blocks"): +10-15% from 8k at d = 192 /
//   256, +4-5% at d = 128; up to 17% slower at 512-2k causal (fewer stages, wider diagonal blocks).
// D = 96 (64 < d <= 96): the d = 128 shapes with 96 columns of products (25% fewer than on the
// 128 tile, which d = 96 ran before; shared memory keeps 128 columns: kHeadDimPad). O takes 48
// registers instead of 64, so the long block is 192 keys (S 96 + P 48 + O 48). H100, bf16 /
// f16 (bench/NOTES.md "Forward: a 96-column tile"): +6-11% over the 128 tile at every N, the
// 192-key block +2-7% over 176 from 8k.
// The 128 x 128 tiles of d = 96 / 128 (below the wide blocks' lengths): 2 stages and O in a buffer
// of its own, not 3 stages with O staged in Q's rows (there the producer cannot load the next
// tile's Q until the epilogue has stored O). H100: +1-12% at N <= 2048, level at 4096 against the
// wide block (bench/NOTES.md "Forward: O in its own buffer for short tiles").
// The same at d = 192's 128 x 64 tile (2 stages + O) measured -2% / +4% at 512: not taken.
// D = 64 without masks up to 2048 queries: the same 192 x 128 tile, persistent with its own O
// buffer (Q 24 KB + K/V 128 KB + O 24 KB), so that the next tile's loads overlap the epilogue.
// H100: +1-2% over the 128 x 128 tile at 512-1k, +10% at 2k; level or 1% slower than the
// one-CTA-per-tile launch at 4k, 2-4% slower from 8k; under causal masks 15-20% slower than
// 128 x 128 at 512-2k (bench/NOTES.md, 2026-11-26, commit 7202f51).
// The table of these configurations, one row each: the enum FwdSm90Config, the traits aliases
// (FwdSm90Traits<name><T>; the e4m3 rows' parameter is the output type), the visitor below
// (plan.cu and dispatch.cu) and sm90/fwd.cu's instantiations are generated from it, so a
// configuration is added in one place. Columns: name, head-dim tile, key block, consumer
// warpgroups, K/V stages, ping-pong (the consumer warpgroups take turns at the softmax),
// persistent (tiles from a scheduler, not one CTA each), O in a buffer of its own (else staged in
// Q's rows).
//        name            D    keys WGs stages ping-pong persistent O-buffer
#define CF_FWD_SM90_CONFIGS(X)                                        \
    X(D64Short,      64,  128, 2,  4,     true,     true,      true)  \
    X(D64,           64,  128, 3,  4,     true,     false,     false) \
    X(D64Persistent, 64,  128, 3,  4,     true,     true,      true)  \
    X(D96,           96,  128, 2,  2,     true,     true,      true)  \
    X(D128,          128, 128, 2,  2,     true,     true,      true)  \
    X(D192,          192, 64,  2,  3,     true,     true,      false) \
    X(D256,          256, 64,  2,  2,     true,     true,      false) \
    X(D96Long,       96,  192, 2,  2,     true,     true,      false) \
    X(D128Long,      128, 176, 2,  2,     true,     true,      false) \
    X(D192Long,      192, 96,  2,  2,     true,     true,      false) \
    X(D256Long,      256, 80,  2,  2,     true,     true,      false)
// e4m3 inputs (Out = f16 / bf16 output), 128 x 128 tiles, persistent, ping-pong:
//   D = 128 (d <= 128): Q 16 KB + K, V^T 4 x 2 x 16 KB + O 32 KB + raw V 16 KB (V transposed in
//   the kernel, kFp8VtInKernelShort) = 192 KB. O 64 + S 64 + P 16 registers.
//   D = 256: Q 32 KB + K, V^T 2 x 2 x 32 KB + O 64 KB = 224 KB. O 128 + S 64 + P 16.
//   (3 consumer warpgroups at d = 128, 192 x 128: 160 registers each, spilled 144 bytes.)
//   D = 128 long (plan.cuh fwd_fp8_long): 128 x 256, 2 stages, P V serial (kSerialPV): Q 16
//   KB + (K 32 KB + V^T 32 KB) x 2 + O 32 KB = 176 KB; S 128 + O 64 registers, no spills. H100,
//   against the former 128 x 192 (3 stages, overlapped P V): +4-6% non-causal and +1-4% causal at
//   8k-16k (bench/NOTES.md "FP8: 256 keys, serial P V"). The 128 x 192 tile had been +0-7% over
//   128 x 128 at 8k-16k, level at 4k, 4-14% slower up to 2k ("FP8 forward: wider key blocks").
// The e4m3 rows: the same columns, then V transposed in the kernel (kVtInKernel) or by a pre-pass.
//        name            D    keys WGs stages ping-pong persistent O-buffer V^T in the kernel
#define CF_FWD_SM90_FP8_CONFIGS(X)                                                          \
    X(Fp8D128,       128, 128, 2,  4,     true,     true,      true,    kFp8VtInKernelShort) \
    X(Fp8D128Long,   128, 256, 2,  2,     true,     true,      true,    kFp8VtInKernelLong)  \
    X(Fp8D256,       256, 128, 2,  2,     true,     true,      true,    false)

#define CF_FWD_SM90_ALIAS(name, d, bn, wg, st, pp, pers, sep) \
    template <typename T> using FwdSm90Traits##name = FwdSm90Traits<T, d, bn, wg, st, pp, pers, sep>;
#define CF_FWD_SM90_FP8_ALIAS(name, d, bn, wg, st, pp, pers, sep, vt) \
    template <typename O> using FwdSm90Traits##name = FwdSm90Traits<__nv_fp8_e4m3, d, bn, wg, st, pp, pers, sep, O, vt>;
CF_FWD_SM90_CONFIGS(CF_FWD_SM90_ALIAS)
CF_FWD_SM90_FP8_CONFIGS(CF_FWD_SM90_FP8_ALIAS)
#undef CF_FWD_SM90_ALIAS
#undef CF_FWD_SM90_FP8_ALIAS

#define CF_FWD_SM90_ENUM(name, ...) k##name,
enum class FwdSm90Config { CF_FWD_SM90_CONFIGS(CF_FWD_SM90_ENUM) CF_FWD_SM90_FP8_CONFIGS(CF_FWD_SM90_ENUM) };
#undef CF_FWD_SM90_ENUM
// Whether configuration c is one of the e4m3 rows.
constexpr bool fwd_sm90_is_fp8(FwdSm90Config c) { return c >= FwdSm90Config::kFp8D128; }
// Its name (the table's first column), for cf_fwd_describe.
inline const char* fwd_sm90_config_name(FwdSm90Config c) {
#define CF_FWD_SM90_NAME(name, ...) #name,
    static const char* const names[] = {CF_FWD_SM90_CONFIGS(CF_FWD_SM90_NAME) CF_FWD_SM90_FP8_CONFIGS(CF_FWD_SM90_NAME)};
#undef CF_FWD_SM90_NAME
    return names[(int)c];
}
// Calls f(Traits{}) with the traits of configuration c: a 16-bit row with element type T, an
// e4m3 row with output type T (the one map from configuration to traits, for the plan and the
// launch alike).
template <typename T, typename F>
decltype(auto) with_fwd_sm90_traits(FwdSm90Config c, F&& f) {
#define CF_FWD_SM90_CASE(name, ...) \
    case FwdSm90Config::k##name: return f(FwdSm90Traits##name<T>{});
    switch (c) {
        CF_FWD_SM90_CONFIGS(CF_FWD_SM90_CASE)
        CF_FWD_SM90_FP8_CONFIGS(CF_FWD_SM90_CASE)
    }
#undef CF_FWD_SM90_CASE
    return f(FwdSm90TraitsD128<T>{});  // not reached: every enumerator has its case
}

// ------------------------------------------------------------------ sm90 forward, 512-wide heads
// sm90/fwd_wide.cu: d = dv = 512 (Gemma 4's global layers) on wgmma, f16 / bf16. A 64 x 512 f32
// output is 256 registers a thread in one warpgroup, so the output is split by columns across two
// consumer warpgroups (as FlashAttention-3 splits a 512-wide V): the softmax warpgroup computes S =
// Q K^T, the mask and the online softmax and O[:, 0:256] += P V with P from registers; the second
// output warpgroup O[:, 256:512] += P V with P from shared memory. CTA = 64 query rows (one m64
// slice: O fills both warpgroups' registers), key blocks of 64 (S on m64n64k16: at n32 the Q
// operand's shared-memory reads, 2 KB per k16 step, would bind the product), one tile a CTA.
// K and V go through a ring of four 64 x 256 chunks (K low, K high, V low, V high of a key block;
// 32 KB each): Q 64 KB + ring 128 KB + P 2 x 8 KB + the rows' factors = 209 KB. Registers:
// consumers 232 (O 128 + S 32 + P 16), the producer 32.
template <typename T_>
struct FwdSm90WideTraits {
    using Elem = T_;
    static constexpr int kHeadDim = 512, kBlockM = 64, kBlockN = 64;
    static constexpr int kChunkCols = 256;  // columns of a ring chunk = of each warpgroup's O
    static constexpr int kChunks = 4;       // ring slots: K low, K high, V low, V high
    static constexpr int kNThreads = 384;   // two consumer warpgroups + the producer
    // setmaxnreg moves registers within what the CTA was given at launch (384 x 168, not the
    // SM's 65536): the consumers can gain only what the producer gives up, else their
    // setmaxnreg.inc waits forever.
    static constexpr int kLaunchRegs = (65536 / kNThreads) & ~7;
    static constexpr int kProducerRegs = 32;  // 24 spilled its cp.async paths (32 bytes)
    static constexpr int kConsumerRegs = ((kLaunchRegs * kNThreads - 128 * kProducerRegs) / 256) & ~7;
    static_assert(256 * kConsumerRegs + 128 * kProducerRegs <= kLaunchRegs * kNThreads, "setmaxnreg: the CTA's registers");
    static_assert(2 * kChunkCols == kHeadDim, "two chunks a row");
};

// ------------------------------------------------------------------ backward (tensor cores)
// dK/dV kernel: CTA = 8 warps over kBlockN keys of one KV head, looping over kBlockM query rows
// per step (and over the query heads of its split). Three warp layouts:
//   A (S = Q K^T, dP = dO V^T, kBlockM x kBlockN): kAWarpsM x kAWarpsN warps, 16*kAMT x kAKeys
//     each (computed as kAHalves passes of kAKeys/kAHalves keys to bound live registers)
//   B (dV += P^T dO, dK += dS^T Q, kBlockN x D): 4 x 2 warps, 16*kBMT keys x D/2 columns each
//     (the 2 warps interleave 16-column pairs)
//   C (atomic dQ += dS K, kBlockM x D): kCWarpsM x kCWarpsD warps, 16*kCMT rows x D/kCWarpsD
//     columns each (interleaved 16-column pairs), at most 32 columns at a time
// Shared: K, V [kBlockN][D]; Q, dO [kStages][kBlockM][D]; P, dS [kBlockM][kBlockN];
// lse, D [kStages][kBlockM] (f32). dK/dV are staged through the K and V buffers at the end.
// f32 (3xTF32): 64 x 64 tiles (the operands take twice the registers and shared memory), Q/dO
// double-buffered up to d = 64 (d = 128 single: 163 KB otherwise). f32 at d = 192 / 256
// (kF32Wide): 32 query rows per step (64 would need 288 KB at d = 256), layout A's warps 16 x 16
// (the 32 rows leave 8 per warp otherwise) and layout C 4 warps wide; 160 KB at d = 192 (every
// sm_80 part), 208 KB at d = 256 (Hopper's 227 KB: plan.cu asks the device).
template <typename T_, int kHeadDim_>
struct BwdTraits {
    using Elem = T_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr bool kF32 = sizeof(T_) == 4;
    static constexpr bool kF32Wide = kF32 && kHeadDim > 128;
    // d = 64: 128 x 128 tiles (fewer steps)
    static constexpr int kBlockM = kF32Wide ? 32 : kHeadDim == 64 && !kF32 ? 128 : 64;
    static constexpr int kBlockN = kHeadDim <= 128 && !kF32 ? 128 : 64;
    static constexpr int kNWarps = 8;
    static constexpr int kNThreads = kNWarps * 32;
    static constexpr int kStages = kHeadDim <= (kF32 ? 64 : 128) ? 2 : 1;  // Q/dO double buffering
    static constexpr int kAKeys = kF32Wide ? 16 : 32;  // keys per warp in layout A
    static constexpr int kAWarpsN = kBlockN / kAKeys, kAWarpsM = kNWarps / kAWarpsN;
    static constexpr int kAMT = kBlockM / (16 * kAWarpsM);
    static constexpr int kAHalves = ((kAMT == 2 && kHeadDim == 96) || kAMT == 4) ? 2 : 1;  // phase A in 2 key halves
    static constexpr int kBWarpsN = 4, kBWarpsD = 2;
    static constexpr int kBMT = kBlockN / (16 * kBWarpsN);
    static constexpr int kBNT = kHeadDim / 8 / kBWarpsD;
    static constexpr int kBUnroll = (kHeadDim >= 192 || (kBMT == 2 && kHeadDim == 96)) ? 1
                                   : (kBMT == 2 && kHeadDim == 128) ? 2 : (kBlockM == 128 ? 4 : kBlockM / 16);  // no spills
    // sm_90 unroll of phase A's k loop (full, except d = 128 with one pass over 32 keys)
    static constexpr int kAUnroll90 = (kHeadDim == 128 && kAHalves == 1) ? 4 : kHeadDim / 16;
    static constexpr int kCWarpsD = ((kBlockN == 128 || kF32Wide) && kHeadDim % 64 == 0) ? 4 : 2;
    static constexpr int kCWarpsM = kNWarps / kCWarpsD;
    static constexpr int kCMT = kBlockM / (16 * kCWarpsM);
    static constexpr int kCPairs = kHeadDim / 16 / kCWarpsD;            // 16-column pairs per warp
    static constexpr int kCGroup = kCPairs % 2 == 0 ? 2 : 1;            // pairs per dQ sub-step
    static constexpr int kSmemBytes = (2 * kBlockN * kHeadDim + 2 * kStages * kBlockM * kHeadDim +
                                       2 * kBlockM * kBlockN) * (int)sizeof(T_) + 2 * kStages * kBlockM * 4;

    static_assert(kAWarpsM * kAWarpsN == kNWarps && 16 * kAMT * kAWarpsM == kBlockM, "layout A");
    static_assert(16 * kBMT * kBWarpsN == kBlockN && kBWarpsN * kBWarpsD == kNWarps, "layout B");
    static_assert((kHeadDim / 16) % kBWarpsD == 0 && kBNT % 2 == 0, "layout B columns");
    static_assert(16 * kCMT * kCWarpsM == kBlockM && (kHeadDim / 16) % kCWarpsD == 0, "layout C");
    static_assert(kCWarpsD * 2 <= 4 || kHeadDim % 64 == 0, "pair stride 8 needs 8-chunk swizzle");
    static_assert((kBlockN / 8) % 8 == 0, "P/dS rows: 8-chunk swizzle (transposed reads)");
    static_assert(kAKeys % 16 == 0 && kAKeys / 8 / kAHalves >= 1, "layout A: whole n8 tiles per half");
    static_assert(kSmemBytes <= 163 * 1024 || (kF32Wide && kSmemBytes <= 227 * 1024),
                  "must fit sm_80's 163 KB (f32 at d = 256: Hopper's 227 KB, plan.cu checks)");
};

// Deterministic dQ kernel: like the forward, 4 warps each owning 16 query rows, looping over
// kBlockN keys per step with K/V double-buffered. Shared: Q, dO [kBlockM][D]; K, V [2][kBlockN][D].
template <typename T_, int kHeadDim_>
struct BwdDqTraits {
    using Elem = T_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = 64;
    static constexpr bool kF32Wide = sizeof(T_) == 4 && kHeadDim > 128;
    // f32 at d = 192 / 256: 16-key blocks (144 / 192 KB; the latter Hopper's, plan.cu checks)
    static constexpr int kBlockN = kF32Wide ? 16 : kHeadDim <= (sizeof(T_) == 4 ? 64 : 128) ? 64 : 32;
    static constexpr int kNWarps = 4;
    static constexpr int kNThreads = kNWarps * 32;
    static constexpr int kSmemBytes = (2 * kBlockM * kHeadDim + 4 * kBlockN * kHeadDim) * (int)sizeof(T_);

    static_assert(kBlockM == 16 * kNWarps, "one m16 tile per warp");
    static_assert(kBlockN % 16 == 0, "dS*K k-steps of 16 keys");
    static_assert(kSmemBytes <= 160 * 1024 || (kF32Wide && kSmemBytes <= 227 * 1024), "must fit sm_80's 163 KB");
};

// A kernel configuration that reads block masks (common/block_sparse.cuh): the same traits with
// kBlockMasks set, its own instantiation, so that the kernels of calls without a block mask carry
// none of its code (their cubins are those of the build before block masks existed).
template <typename Kt>
struct BlockMasked : Kt {
    static constexpr bool kBlockMasks = true;
};

// The sm_90a forward configurations that run block masks: one mask block a tile (128 rows of
// 16-bit inputs), whole tiles per mask block (key blocks dividing 128).
template <typename Kt>
constexpr bool fwd_sm90_takes_block_masks() {
    return !Kt::kFp8 && Kt::kBlockM == 128 && 128 % Kt::kBlockN == 0;
}

// The shared memory of the sm_90a backward kernels, as structs (sm90/bwd.cuh, sm90/bwd_wide.cuh);
// the traits' kSmemBytes is their sizeof.
template <typename Kt>
struct BwdSharedStorage;
template <typename Kt>
struct BwdWideSharedStorage;

// sm_90a dK/dV kernel (wgmma, sm90/bwd.cuh): CTA = 2 warpgroups over kBlockN keys of one KV
// head (64 keys each), looping over kBlockM query rows per step. Per step each warpgroup computes
// S^T = K Q^T and dP^T = V dO^T for its keys (m64 x n kBlockM), then dV += P^T dO and dK += dS^T Q
// with P^T / dS^T straight from registers; atomic mode: dS^T -> shared, dQ = dS K (m64 x n64 per
// warpgroup). Shared (sm90/bwd.cuh BwdSharedStorage; panel layout, wgmma.cuh): K, V
// [kBlockN][D]; Q, dO [kStages][kBlockM][D] (the TMA ring); dS^T [2][kBlockN][kBlockM]; lse, dsum
// [kStages][kBlockM] (f32); dQ staging [2 warpgroups][kDqSlots][kDqRows][64] (f32, for the bulk
// reductions); the ring's mbarriers. dK/dV staged through Q/dO at the end.
// The plain-logit step at d = 96 / 128 computes P^T while dP^T's product runs (bench/NOTES.md
// "Backward v6"; also dS^T while dV's product runs measured no better); the d = 64 step keeps
// backward v5's lockstep (P^T and dS^T after both products): its 64-query S^T and dP^T leave no
// room (the overlaps spilled 76 / 20 bytes).
// A producer warpgroup at d = 96 / 128 (bench/NOTES.md "Backward v7"): a third warpgroup issues
// the Q / dO loads (its first warp; setmaxnreg lowers it to kProducerRegs), the two consumer
// warpgroups take the registers it frees, and warp 0 copies the lse / dsum rows: +2-14% at
// d = 96 / 128 from N = 2k. At d = 64 warp 0 of the consumers issues all loads between its
// products (within noise, -5% at 512 with the producer).
// The Q / dO ring has 2 stages (a third at d = 128 measured 1-2% slower); dQ is staged in one tile
// per warpgroup, or two with dQ by turns (2 tiles measured level, 0.97-1.03x); the warpgroups do
// not run in ping-pong (2-7% slower on an H100): bench/NOTES.md, 2026-11-26, commit 2059c30.
// dQ by turns in the 64-query d = 96 / 128 step (sm90/bwd.cuh; not the deterministic kernel): the
// warpgroups take turns computing a step's whole dQ (m64 x n128: 240 instead of 256 KB of operand
// reads from shared memory a step; -3.6% time under ncu, +1-2% under sustained load against each
// computing half of dQ's columns every step: bench/NOTES.md, 2026-11-27, commit df99929).
// (Tried and dropped on 2026-11-27 (commit df99929): dQ split by keys, each warpgroup a partial over
// its own 64 keys, summed through shared memory: 4-9% slower, commit b799cc6.)
// The d = 64 backward's wgmma descriptors are derived from each k16 step's address; the other
// sm90 kernels advance them from one base per tile (sm90/wgmma.cuh desc_advance), which cut the
// d = 128 backward's instructions 15% and its time 2.6% under ncu, but made the d = 64 backward
// 2% slower (bench/NOTES.md, 2026-11-27, commit 17d890a).

// kBlockM_: query rows per step, 128 at d = 64, else 64. (FA3's 80-query d = 128 step measured
// level with 64 from 4k and 2-6% slower below: bench/NOTES.md, 2026-11-26, commit f0052a2.)
template <typename T_, int kHeadDim_, bool kGeneralLogits_, int kBlockM_ = (kHeadDim_ == 64 ? 128 : 64)>
struct BwdSm90Traits {
    static constexpr bool kBlockMasks = false;  // BlockMasked<> sets it
    using Elem = T_;
    static constexpr int kHeadDim = kHeadDim_;
    // Columns of the K / V / Q / dO tiles in shared memory (whole 64-column panels): d = 96 keeps
    // 128 (zeros past d), its S^T / dP^T run 6 k16 steps and dV / dK are m64 x n96 products.
    static constexpr int kHeadDimPad = panel_padded_cols(kHeadDim, (int)sizeof(T_));
    // logits_general() of the call: the plain instance splits P^T from dS^T (kOverlapP), the
    // general one keeps them fused (softcap's derivative needs the raw score, which P replaces)
    static constexpr bool kGeneralLogits = kGeneralLogits_;
    static constexpr int kBlockN = 128;
    static constexpr int kBlockM = kBlockM_;
    // rows of one warpgroup's dQ staging tile (f32 x 64 columns)
    static constexpr int kDqRows = kHeadDim == 64 ? 64 : kBlockM;
    // the producer warpgroup (above: d = 96 / 128)
    static constexpr bool kProducerWG = kHeadDim != 64;
    // dQ by turns (the ordered kernel keeps the column split): each warpgroup's staging region
    // holds a 64 x 128 tile (two slots' worth)
    static constexpr bool kDqTurns = kHeadDim >= 96 && kBlockM == 64 && kProducerWG;
    static constexpr int kDqSlots = kDqTurns ? 2 : 1;
    // wgmma descriptors of the k16 steps advanced from one base per tile (sm90/wgmma.cuh
    // desc_advance: -15% instructions at d = 128) or, at d = 64, derived from each step's address
    static constexpr bool kDescAdvance = kHeadDim != 64;
    static constexpr int kNConsumerThreads = 256;
    static constexpr int kNThreads = kNConsumerThreads + (kProducerWG ? 128 : 0);
    // With the producer warpgroup: launch registers 168, the producer keeps kProducerRegs (TMA and
    // the cp.async fallback of a varlen block's rows), the consumers get the rest, at most 240.
    // 24, although the producer then keeps four loop-invariant address words in local memory: at
    // 32 nothing spills, but the consumers' 232 registers cost the backward 8-16%.
    static constexpr int kLaunchRegs = (65536 / kNThreads) & ~7;
    static constexpr int kProducerRegs = 24;
    static constexpr int kConsumerRegs0 = ((kLaunchRegs * kNThreads - 128 * kProducerRegs) / kNConsumerThreads) & ~7;
    static constexpr int kConsumerRegs = kConsumerRegs0 > 240 ? 240 : kConsumerRegs0;
    // P^T computed while dP^T is in flight (plain logits at d = 96 / 128, above; bwd.cuh)
    static constexpr bool kOverlapP = !kGeneralLogits && kHeadDim != 64;
    // Stages of the Q / dO / lse / dsum ring
    static constexpr int kStages = 2;
    // What the launch asks for: the kernel's shared memory is one BwdSharedStorage (sm90/bwd.cuh,
    // which also checks that it fits)
    static constexpr int kSmemBytes = (int)sizeof(BwdSharedStorage<BwdSm90Traits>);

    static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128, "wgmma backward: head-dim tiles 64, 96, 128");
    static_assert(kBlockN == 2 * 64, "one m64 slice of keys per warpgroup");
    // dQ = dS K is m64 x n64 per warpgroup: split over query rows (d = 64) or columns (d = 128);
    // dQ^T is m64 x n80 per warpgroup, split over columns
    static_assert((kHeadDim == 64 && kBlockM == 128) || (kHeadDim == 96 && kBlockM == 64) ||
                      (kHeadDim == 128 && kBlockM == 64),
                  "dQ split");
    static_assert(2 * kBlockM >= kBlockN, "dK/dV staging fits in Q / dO");
    static_assert(!kProducerWG || kConsumerRegs > kLaunchRegs, "setmaxnreg: consumers gain what the producer gives up");
};

// sm_90a dK/dV kernel for the wide head-dim tiles 192 and 256 (sm90/bwd_wide.cuh): CTA = 2
// warpgroups over 64 keys, both covering all of them; warpgroup 0 holds dV (and computes P^T,
// dS^T), warpgroup 1 holds dK (and computes dP^T); dQ columns [0, kDq0) / [kDq0, D) per
// warpgroup. Shared (sm90/bwd_wide.cuh BwdWideSharedStorage; panel layout): K, V [64][D]; Q, dO
// [2][64][D] (the TMA ring); dS^T, P^T [64][64]; the dP^T exchange (f32, 64 x 64); lse, dsum
// [2][64]; the ring's 4 mbarriers; at d = 192 one more dQ staging slot. dQ tiles staged in the
// step's Q / dO stage (and that slot).
template <typename T_, int kHeadDim_>
struct BwdSm90WideTraits {
    static constexpr bool kBlockMasks = false;  // BlockMasked<> sets it
    using Elem = T_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockN = 64;
    static constexpr int kBlockM = 64;
    static constexpr int kNThreads = 256;
    // dQ's column split: whole 64-column panels per warpgroup (an MN-major B operand starts at a
    // panel), so d = 192 splits 128 + 64
    static constexpr int kDq0 = kHeadDim == 192 ? 128 : kHeadDim / 2;
    // d = 192: warpgroup 0's second dQ staging slot (a 64 x 64 f32 tile) has its own region; at
    // d = 256 shared memory is full and the second slots are the step's Q / dO stage (bwd_wide.cuh)
    static constexpr int kSlotBytes = kHeadDim == 192 ? 64 * 64 * 4 : 0;
    // What the launch asks for: one BwdWideSharedStorage (sm90/bwd_wide.cuh, which also checks
    // that it fits)
    static constexpr int kSmemBytes = (int)sizeof(BwdWideSharedStorage<BwdSm90WideTraits>);

    static_assert(kHeadDim == 192 || kHeadDim == 256, "wide wgmma backward: head-dim tiles 192 and 256");
    static_assert(kBlockN == 64 && kBlockM == 64, "one m64 key slice, one panel of queries");
    static_assert(kDq0 % 64 == 0 && (kHeadDim - kDq0) % 64 == 0, "dQ split on panel boundaries");
    static_assert(2 * kBlockM * kHeadDim >= kBlockN * kHeadDim, "dK/dV staging fits in Q / dO");
};

// ------------------------------------------------------------------ SIMT (simt/)
// f32 arithmetic on CUDA cores, any element type in memory (converted as tiles are loaded), any
// stride. Two shapes of every kernel: kNarrow for head dims up to 256 (f32 calls whose layout
// the tensor-core tiles do not take), kWide for what only these kernels run (flash_api.h: a head
// dim up to 576, a value head dim of its own, prefix ranges). A row's (or key's) columns are
// spread over kThreads threads; the wide shape gives it twice the threads (576 columns: 36 per
// thread, all in registers) and holds half the rows and keys, so that its f32 tiles at (576,
// 512) fit an A100's 163 KB and at d = 512 an sm_86's 99 KB.
enum class SimtShape { kNarrow, kWide };
constexpr int simt_max_head_dim(SimtShape s) { return s == SimtShape::kWide ? 576 : 256; }
// Row stride (floats) of a SIMT operand tile of `cols` columns (a multiple of 8): padded by 4
// floats, so rows stay 16-byte aligned for the float4 reads of simt_dot and 8 row-parallel
// threads reading one float4 each hit 8 different 16-byte bank groups (4 (cols + 4) mod 128 is
// an odd multiple of 16).
__host__ __device__ constexpr int simt_ld(int cols) { return cols + 4; }

// Forward and dQ: CTA = kBlockM query rows x kBlockN keys per step, kThreads threads per row.
template <SimtShape kShape>
struct SimtRowTraits {
    static constexpr bool kWide = kShape == SimtShape::kWide;
    static constexpr int kBlockM = kWide ? 8 : 16, kBlockN = kWide ? 16 : 32, kThreads = kWide ? 16 : 8;
    static constexpr int kNThreads = 128;
    static constexpr int kScores = kBlockN / kThreads;                     // scores per thread per step
    static constexpr int kCols = simt_max_head_dim(kShape) / kThreads;     // output columns per thread
    // Forward: Q [kBlockM][d], K [kBlockN][d], V [kBlockN][dv] (none when v is read from K's
    // tile: simt/fwd.cu v_is_view_of_k), P [kBlockM][kBlockN].
    static size_t fwd_smem_bytes(int d, int dv, bool v_in_k) {
        return size_t(4) * (kBlockM * simt_ld(d) + kBlockN * simt_ld(d) + (v_in_k ? 0 : kBlockN * simt_ld(dv)) +
                            kBlockM * (kBlockN + 1));
    }
    // dQ: Q, dO [kBlockM][d / dv], K, V [kBlockN][d / dv], dS [kBlockM][kBlockN].
    static size_t dq_smem_bytes(int d, int dv) {
        return size_t(4) * ((kBlockM + kBlockN) * (simt_ld(d) + simt_ld(dv)) + kBlockM * (kBlockN + 1));
    }
    static_assert(kNThreads == kBlockM * kThreads && kBlockN % kThreads == 0, "whole rows, whole score sets");
};
// dK / dV: CTA = kBlockN keys, kBlockM query rows per step; scores: thread -> key tid % kBlockN,
// rows tid / kBlockN + kRowStep k; accumulation: kThreads threads per key.
template <SimtShape kShape>
struct SimtKeyTraits {
    static constexpr bool kWide = kShape == SimtShape::kWide;
    static constexpr int kBlockN = kWide ? 8 : 16, kBlockM = kWide ? 16 : 32, kNThreads = 128;
    static constexpr int kThreads = kNThreads / kBlockN, kRowStep = kNThreads / kBlockN;
    static constexpr int kCols = simt_max_head_dim(kShape) / kThreads;
    // K [kBlockN][d], V [kBlockN][dv], Q [kBlockM][d], dO [kBlockM][dv], P and dS
    // [kBlockM][kBlockN], lse and D [kBlockM].
    static size_t smem_bytes(int d, int dv) {
        return size_t(4) * ((kBlockN + kBlockM) * (simt_ld(d) + simt_ld(dv)) + 2 * kBlockM * (kBlockN + 1) + 2 * kBlockM);
    }
    static_assert(kBlockM % kRowStep == 0, "whole row passes");
};

}  // namespace cf
