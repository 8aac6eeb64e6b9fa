// Host-side launchers, one per (kernel family, dtype, tile configuration); defined and
// explicitly instantiated next to their kernels (sm80/, sm90/, simt/). Which one runs, and with
// which CTA order, split and workspace, is the plan's (plan.cuh, plan.cu); dispatch.cu calls the
// launcher the plan names with the plan's values: a launcher launches what it is asked to and
// makes no choice of its own.
#pragma once
#include <cuda_runtime.h>
#include <atomic>
#include <cstdint>
#include "common/bwd_work.cuh"
#include "config.cuh"

namespace cf {

// Calls f(T{}) with the element type of dtype (f32, f16, bf16): the one switch from a
// dtype code to the instantiations of its element type.
template <typename F>
decltype(auto) with_element_type(int dtype, F&& f) {
    switch (dtype) {
        case CF_F32: return f(float{});
        case CF_F16: return f(__half{});
        default: return f(__nv_bfloat16{});
    }
}

// True when the current device is an sm_90 GPU and this library carries sm_90a code (the wgmma
// kernels). Probed once per device with a one-thread kernel; CANDLE_FLASH_DISABLE_SM90A=1 turns
// the sm_90a kernels off (to run and compare the sm_80 path on a Hopper GPU).
bool sm90a_available();
// Streaming multiprocessors of the current device.
cudaError_t current_sm_count(int& sms);
// The current device's opt-in limit of dynamic shared memory per block, in bytes.
cudaError_t current_smem_optin(int& bytes);

// A positive value read once per device and kept in `cache` (0 = not read yet): device
// attributes (plan.cu), occupancies (wave_slots), asked on hot paths. `read(dev, value)` asks
// the runtime.
template <typename Read>
cudaError_t cached_per_device(std::atomic<int> (&cache)[64], int& value, Read read) {
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    const bool cached = dev >= 0 && dev < 64;
    if (cached && (value = cache[dev].load()) > 0) return cudaSuccess;
    e = read(dev, value);
    if (e == cudaSuccess && cached) cache[dev].store(value);
    return e;
}

// The CTAs of one wave of `kern` (launched with `threads` threads and `smem` bytes of dynamic
// shared memory): how many one SM runs at once (cudaOccupancyMaxActiveBlocksPerMultiprocessor,
// after the kernel's shared-memory attribute is set) times the SMs. Asked of the device once per
// device for each `Tag` (the kernel's traits): the plans ask it per call.
template <typename Tag, typename Kern>
cudaError_t wave_slots(Kern kern, int threads, int smem, int64_t& slots) {
    static std::atomic<int> per_sm[64];
    int sms = 0, n = 0;
    cudaError_t e = current_sm_count(sms);
    if (e == cudaSuccess)
        e = cached_per_device(per_sm, n, [&](int, int& v) {
            cudaError_t err = smem > 48 * 1024
                                  ? cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)
                                  : cudaSuccess;
            return err != cudaSuccess ? err : cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, kern, threads, smem);
        });
    slots = (int64_t)n * sms;
    return e;
}

// The timeline probes (CF_FWD_TRACE / CF_BWD_TRACE builds, bench/*_trace.py): copies a probe's
// device buffer `sym` out to dst, then clears it; 0 on success.
template <typename Sym>
inline int read_and_clear_trace(const Sym& sym, long long* dst) {
    static const Sym zeros = {};
    if (cudaDeviceSynchronize() != cudaSuccess || cudaMemcpyFromSymbol(dst, sym, sizeof(Sym)) != cudaSuccess) return 1;
    return cudaMemcpyToSymbol(sym, &zeros, sizeof(Sym)) == cudaSuccess ? 0 : 1;
}

// mma.sync forward (sm80/fwd.cu), every head-dim tile of config.cuh; kPaged: K/V through the
// block table (p.block_table set), else contiguous; kHopperTile: FwdTraits' 128-row 8-warp tile
// (f32, d = 256, 192 KB of shared memory). across_heads: the plan's CTA order (FwdPlan::cta_order).
template <typename T, int D, bool kPaged, bool kHopperTile>
cudaError_t run_fwd_tc(const CfFwdParams& p, bool across_heads, cudaStream_t stream);
// sm_90a wgmma forward (sm90/fwd.cu) with configuration Kt (a row of config.cuh's
// CF_FWD_SM90_CONFIGS table, the one plan pl names); call only when sm90a_available(). The plan
// gives the grid (FwdPlan::ctas), the CTA order (cta_order) and whether TMA loads (tma). The
// workspace (cf_fwd's) holds V^T for e4m3 inputs whose kernel does not transpose V itself
// (Fp8VtLayout, plan.cuh), unused otherwise (may be NULL then).
struct FwdPlan;
template <typename Kt>
cudaError_t launch_fwd_sm90(const CfFwdParams& p, const FwdPlan& pl, void* workspace, cudaStream_t stream);
// sm_90a wgmma forward of 512-wide heads (sm90/fwd_wide.cu), Kt = FwdSm90WideTraits<T>; one CTA
// a 64-row tile, the plan's CTA order (cta_order) and TMA choice (tma). Call only when
// sm90a_available() and plan.cu's fwd_sm90_wide_takes chose it.
template <typename Kt>
cudaError_t launch_fwd_sm90_wide(const CfFwdParams& p, const FwdPlan& pl, cudaStream_t stream);
// SIMT forward (simt/fwd.cu), element type T, shape kShape (config.cuh SimtShape), and the
// dynamic shared memory it asks for a call (the plan checks it fits before choosing it).
template <typename T, SimtShape kShape>
cudaError_t run_fwd_simt(const CfFwdParams& p, cudaStream_t stream);
size_t simt_fwd_smem_bytes(const CfFwdParams& p, SimtShape shape);
// Split-KV plan (flash-decoding): the key range cut into nsplit chunks of bps key blocks, `pack`
// query heads of one KV group per CTA, mblocks query blocks per group, deep = at most one CTA
// per SM (deeper K/V ring). Partials live in the caller's workspace: opart (f32, [nsplit][b][h]
// [seqlen_q][head-dim tile]) then lpart (f32, [nsplit][b][h][seqlen_q]); bytes = 0 when nsplit == 1.
// wide != kNone: the wide-head kernel (sm80/fwd_wide_split.cu) in that configuration (config.cuh
// WideSplitTraits: rows per CTA, v read from k's tile, ring depth; with_wide_split_traits maps one
// to the other); pack is the whole KV group for decode shapes, 1 for longer query blocks.
enum class WideSplit { kNone, kRows16VInK4, kRows16VInK2, kRows64VInK3, kRows16V2, kRows64V2 };
// Calls f(Traits{}) with the WideSplitTraits of element type T that configuration w names (the one
// table from configuration to traits: the plan asks their shared memory, the launcher launches
// them); w != kNone.
template <typename T, typename F>
decltype(auto) with_wide_split_traits(WideSplit w, F&& f) {
    switch (w) {
        case WideSplit::kRows16VInK4: return f(WideSplitTraits<T, 16, true, 4>{});
        case WideSplit::kRows16VInK2: return f(WideSplitTraits<T, 16, true, 2>{});
        case WideSplit::kRows64VInK3: return f(WideSplitTraits<T, 64, true, 3>{});
        case WideSplit::kRows16V2: return f(WideSplitTraits<T, 16, false, 2>{});
        default: return f(WideSplitTraits<T, 64, false, 2>{});
    }
}
// Its name (cf_fwd_describe).
inline const char* wide_split_name(WideSplit w) {
    static const char* const names[] = {"none", "Rows16VInK4", "Rows16VInK2", "Rows64VInK3", "Rows16V2", "Rows64V2"};
    return names[(int)w];
}
struct SplitPlan {
    int nsplit, bps, pack, mblocks;
    bool deep;
    WideSplit wide;
    size_t opart_bytes, bytes;
};
// Decode shapes (sm80/fwd_split.cu, D in {64, 128}).
template <typename T, int D>
cudaError_t run_fwd_split(const CfFwdParams& p, const SplitPlan& sp, void* workspace, cudaStream_t stream);
// Decode shapes of wide heads (sm80/fwd_wide_split.cu: d <= 576, dv <= 512, f16 / bf16).
template <typename T>
cudaError_t run_fwd_wide_split(const CfFwdParams& p, const SplitPlan& sp, void* workspace, cudaStream_t stream);

// Writes dsum (D = rowsum(dO*O)) into ws.dsum (simt/bwd.cu, every dtype).
cudaError_t run_bwd_dot_do_o(const CfBwdParams& p, const BwdWs& ws, cudaStream_t stream);
// After dsum: the attention sinks' gradient into p.dsinks (simt/bwd.cu; p.fwd.sinks set).
cudaError_t run_bwd_sink_grad(const CfBwdParams& p, const BwdWs& ws, cudaStream_t stream);
// Tensor-core backward after dsum (sm80/bwd.cuh, instantiated in sm80/bwd_{f16,bf16,tf32}.cu) as
// plan pl says (plan.cuh BwdPlan): dK/dV (+ dQ accumulation when ws.dq_accum) with the sm_90a
// wgmma kernels (sm90/bwd.cuh for D = 64 / 96 / 128, sm90/bwd_wide.cuh for 192 / 256; bulk
// reductions into the tiled dq_accum) or the mma.sync one (f32 atomics into the row layout);
// then the dQ pass (deterministic) or the dQ conversion, then the split reduction
// (pl.reduce_dkv); each grid in the plan's CTA order.
struct BwdPlan;
template <typename T, int D>
cudaError_t run_bwd_tc(const CfBwdParams& p, const BwdWs& ws, const BwdPlan& pl, cudaStream_t stream);
// SIMT backward after dsum (simt/bwd.cu): dK/dV, then dQ, no workspace beyond dsum.
template <typename T, SimtShape kShape>
cudaError_t run_bwd_simt(const CfBwdParams& p, const BwdWs& ws, cudaStream_t stream);

}  // namespace cf
