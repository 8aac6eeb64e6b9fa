// The plan layer's host side (plan.cuh): the device facts the plans read (each once per device),
// which kernels a call can run, and plan_fwd / plan_bwd, the complete plan of a call. Nothing here
// launches work (but the one-thread probe of sm90a_available); dispatch.cu runs the plans.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include "plan.cuh"
#include "sm90/tile_scheduler.cuh"
#include "sm90/tma.cuh"

namespace cf {

namespace {
// Whether the environment variable `name` is set to anything but empty or "0": the
// CANDLE_FLASH_* switches that send calls to other kernels (to compare them, and to test them on
// shapes another kernel would take). Read once by each switch.
bool env_switch(const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr && v[0] != '\0' && v[0] != '0';
}
}  // namespace

__global__ void sm90a_probe_kernel(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    *out = 1;
#else
    *out = 0;
#endif
}

bool sm90a_available() {
    static std::atomic<int> cache[64];  // per device: 0 = not probed, 1 = no, 2 = yes
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        (void)cudaGetLastError();
        return false;
    }
    const int known = cache[dev].load();
    if (known != 0) return known == 2;
    bool ok = false;
    int major = 0, minor = 0;
    if (!env_switch("CANDLE_FLASH_DISABLE_SM90A") &&
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
        major == 9 && minor == 0) {
        // sm_90a SASS runs only on sm_90; what the device actually runs (SASS or JIT-compiled
        // compute_90 PTX, which has no wgmma) is known only by asking a kernel.
        int* flag = nullptr;
        int host = 0;
        if (cudaMalloc(&flag, sizeof(int)) == cudaSuccess) {
            sm90a_probe_kernel<<<1, 1>>>(flag);
            ok = cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess && host == 1;
            (void)cudaFree(flag);
        }
    }
    (void)cudaGetLastError();
    cache[dev].store(ok ? 2 : 1);
    return ok;
}

// A device attribute read once per device: they are asked on every forward of a decode shape
// (the SM count, by cf_fwd_workspace_size and again by cf_fwd), by every persistent launch and by
// the f32 tile choices (the shared-memory limit), like sm90a_available().
template <cudaDeviceAttr kAttr>
cudaError_t cached_device_attribute(int& value) {
    static std::atomic<int> cache[64];
    return cached_per_device(cache, value, [](int dev, int& v) { return cudaDeviceGetAttribute(&v, kAttr, dev); });
}
cudaError_t current_sm_count(int& sms) { return cached_device_attribute<cudaDevAttrMultiProcessorCount>(sms); }
// The most dynamic shared memory one block may opt in to (Hopper 227 KB, A100 163 KB, the other
// sm_8x parts 99 KB): the f32 tiles at d = 192 / 256 need more than the smallest.
cudaError_t current_smem_optin(int& bytes) {
    return cached_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(bytes);
}

// Whether the device gives a block `bytes` of shared memory (false if it cannot be asked).
bool smem_fits(int bytes) {
    int have = 0;
    if (current_smem_optin(have) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return have >= bytes;
}

bool tma_enabled() {
    static const bool on = !env_switch("CANDLE_FLASH_DISABLE_TMA") && tensor_map_encoder() != nullptr;
    return on;
}

namespace {
bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }
}  // namespace

// Alignment needed by the 16-byte vector loads/stores (and TMA rows) of the tensor-core kernels:
// strides in elements of elem_bytes bytes (2: f16 / bf16, 1: e4m3, 4: f32) that are whole 16
// bytes. Batch strides are unused (and not checked) for varlen sides.
bool tensor_aligned(const void* ptr, int64_t batch_stride, int64_t row_stride, int64_t head_stride, bool varlen,
                    int elem_bytes) {
    auto stride_ok = [&](int64_t s) { return (s * elem_bytes) % 16 == 0; };
    return aligned16(ptr) && stride_ok(row_stride) && stride_ok(head_stride) && (varlen || stride_ok(batch_stride));
}

// What only the SIMT kernels run (flash_api.h): a head dim past the tensor-core tiles' 256, a
// value head dim of its own, mm_prefix_ranges (a second key interval per row, which the
// tensor-core kernels' one-interval masks do not carry), unless the wide-head kernel takes the
// call (split_plan). Their shape: kNarrow up to 256 columns, kWide past it (config.cuh SimtShape).
bool simt_only(const CfFwdParams& p) { return p.d > 256 || head_dim_v(p) != p.d || p.prefix_ranges != nullptr; }
SimtShape simt_shape(const CfFwdParams& p) {
    return std::max(p.d, head_dim_v(p)) > simt_max_head_dim(SimtShape::kNarrow) ? SimtShape::kWide : SimtShape::kNarrow;
}

namespace {
// f32 runs on tensor cores (3xTF32: sm80/fwd.cu, sm80/bwd.cuh) when its tensors meet the 16-byte
// rules of the tile loads (tensor_aligned with 4-byte elements: rows and strides of multiples of
// 4 floats), else on the SIMT kernels, which take any stride. Some tiles at d = 192 / 256 take
// more shared memory than sm_80's 99 KB parts have (the backward's at d = 256: more than the
// A100's too): where the device has less than they need, the SIMT kernels.
// CANDLE_FLASH_F32_SIMT=1 keeps f32 on the SIMT kernels (to compare).
bool f32_simt_forced() {
    static const bool forced = env_switch("CANDLE_FLASH_F32_SIMT");
    return forced;
}
bool f32_fwd_tensor_cores(const CfFwdParams& p) {
    if (p.dtype != CF_F32 || f32_simt_forced() || simt_only(p)) return false;
    // the 64 x 32 tiles take 96 / 128 KB at d = 192 / 256: the latter more than sm_86 / sm_89 give
    const int rd = round_head_dim(p.d);
    if (rd > 128 && !smem_fits(rd == 192 ? FwdTraits<float, 192>::kSmemBytes : FwdTraits<float, 256>::kSmemBytes))
        return false;
    const bool vq = p.cu_seqlens_q != nullptr, vk = p.cu_seqlens_k != nullptr && p.block_table == nullptr;
    return tensor_aligned(p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride, vq, 4) &&
           tensor_aligned(p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride, vk, 4) &&
           tensor_aligned(p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride, vk, 4) &&
           tensor_aligned(p.o, p.o_batch_stride, p.o_row_stride, p.o_head_stride, vq, 4);
}
bool f32_bwd_tensor_cores(const CfBwdParams& p) {
    const CfFwdParams& f = p.fwd;
    if (!f32_fwd_tensor_cores(f)) return false;
    const int rd = round_head_dim(f.d);
    if (rd > 128) {
        const int need = rd == 192 ? std::max(BwdTraits<float, 192>::kSmemBytes, BwdDqTraits<float, 192>::kSmemBytes)
                                   : std::max(BwdTraits<float, 256>::kSmemBytes, BwdDqTraits<float, 256>::kSmemBytes);
        if (!smem_fits(need)) return false;
    }
    const bool vq = f.cu_seqlens_q != nullptr, vk = f.cu_seqlens_k != nullptr;
    return tensor_aligned(p.dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride, vq, 4) &&
           tensor_aligned(p.dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, vq, 4) &&
           tensor_aligned(p.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride, vk, 4) &&
           tensor_aligned(p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, vk, 4);
}
// Whether the backward runs the tensor-core kernels (their workspace plan differs).
bool bwd_tensor_cores(const CfBwdParams& p) {
    return simt_only(p.fwd) ? false : p.fwd.dtype != CF_F32 || f32_bwd_tensor_cores(p);
}

// CANDLE_FLASH_DISABLE_WIDE_SPLIT=1 keeps the decode shapes of wide heads on the SIMT kernels
// (to compare, and to test those kernels on the shapes the wide split kernel takes).
bool wide_split_disabled() {
    static const bool off = env_switch("CANDLE_FLASH_DISABLE_WIDE_SPLIT");
    return off;
}

// The split-KV plan of a call: the wide-head kernel's for heads past 256 columns, none on the
// SIMT kernels; the one decision that both sizes the workspace and picks the kernel.
SplitPlan split_plan(const CfFwdParams& p) {
    if (!wide_split_disabled()) {
        int optin = 0, sms = 0;
        if (current_smem_optin(optin) != cudaSuccess || current_sm_count(sms) != cudaSuccess) {
            (void)cudaGetLastError();
            optin = 0;
        }
        const WideSplit w = wide_split_config(p, v_is_view_of_k(p), optin);
        if (w != WideSplit::kNone) return plan_wide_split(p, w, sms);
    }
    if (simt_only(p) || (p.dtype == CF_F32 && !f32_fwd_tensor_cores(p))) {
        SplitPlan none{};
        none.nsplit = 1;
        return none;
    }
    return plan_split(p);
}

// The head-dim tile of the wgmma backward for this call, 0 when the mma.sync / SIMT kernels run
// (f32, no sm_90a, or a tile bwd_sm90_tile leaves to mma.sync). cf_bwd's dq_accum layout follows it.
}  // namespace
int bwd_sm90_tile_for(const CfFwdParams& f) {
    return f.dtype != CF_F32 && !simt_only(f) && sm90a_available() ? bwd_sm90_tile(round_head_dim(f.d)) : 0;
}
namespace {

// The wgmma forward's grid and CTA order: one CTA a tile, or at most one wave of persistent CTAs
// (whose scheduler orders the tiles: order 0); one CTA a tile takes the trailing heavy-first
// groups (fwd_heavy_groups).
cudaError_t fwd_sm90_grid(const CfFwdParams& p, FwdPlan& pl) {
    return with_fwd_sm90_traits<__half>(pl.sm90, [&](auto kt) -> cudaError_t {
        using Kt = decltype(kt);
        using Sched = FwdTileScheduler<Kt::kBlockM, Kt::kBlockN, !Kt::kPersistent>;
        int sms = 0;
        const cudaError_t e = current_sm_count(sms);
        if (e != cudaSuccess) return e;
        const int64_t wave = (int64_t)sms * Kt::kMinBlocks;
        pl.ctas = Sched::grid_size(p, Kt::kPersistent, (int)wave);
        const int query_blocks = (p.seqlen_q + Kt::kBlockM - 1) / Kt::kBlockM;
        pl.cta_order = Kt::kPersistent ? 0 : fwd_heavy_groups(p, query_blocks, (int64_t)p.h * p.b, wave);
        return cudaSuccess;
    });
}

// The wgmma forward of 512-wide heads (sm90/fwd_wide.cu) takes d = dv = 512 in f16 / bf16 on
// sm_90a, past the decode shapes: those (a KV group's rows, group x seqlen_q, at most 128) stay
// on the wide-head split-KV kernel, which packs a group's heads into one CTA so the cache is read
// once for all of them (plan_wide_split's own rule).
bool fwd_sm90_wide_takes(const CfFwdParams& p) {
    return (p.dtype == CF_F16 || p.dtype == CF_BF16) && p.d == FwdSm90WideTraits<__half>::kHeadDim &&
           head_dim_v(p) == p.d && p.prefix_ranges == nullptr && !wide_decode_shape(p) &&
           sm90a_available();
}
// Its grid (one CTA a 64-row tile, one CTA an SM) and CTA order (fwd_heavy_groups).
cudaError_t fwd_sm90_wide_grid(const CfFwdParams& p, FwdPlan& pl) {
    using Kt = FwdSm90WideTraits<__half>;
    int sms = 0;
    const cudaError_t e = current_sm_count(sms);
    if (e != cudaSuccess) return e;
    pl.ctas = FwdTileScheduler<Kt::kBlockM, Kt::kBlockN, true>::num_tiles(p);
    const int query_blocks = (p.seqlen_q + Kt::kBlockM - 1) / Kt::kBlockM;
    pl.cta_order = fwd_heavy_groups(p, query_blocks, (int64_t)p.h * p.b, sms);
    return cudaSuccess;
}

// The mma.sync forward's CTA order: across heads on grids of a few waves (mma_sync_heavy_first).
cudaError_t fwd_mma_sync_order(const CfFwdParams& p, const FwdPlan& pl, int& order) {
    return with_element_type(p.dtype, [&](auto t) {
        using T = decltype(t);
        return with_head_dim_tile(pl.tile, [&](auto dc) -> cudaError_t {
            constexpr int D = decltype(dc)::value;
            auto ask = [&](auto traits, cudaError_t (*slots_of)(int64_t&)) {
                using Kt = decltype(traits);
                int64_t slots = 0;
                const cudaError_t e = slots_of(slots);
                const int query_blocks = (p.seqlen_q + Kt::kBlockM - 1) / Kt::kBlockM;
                order = mma_sync_heavy_first(p, (int64_t)query_blocks * p.h * p.b, slots, true);
                return e;
            };
            if constexpr (D == 256 && sizeof(T) == 4) {
                if (pl.hopper_tile)
                    return pl.paged ? ask(FwdTraits<T, D, true, true>{}, fwd_tc_wave_slots<T, D, true, true>)
                                    : ask(FwdTraits<T, D, false, true>{}, fwd_tc_wave_slots<T, D, false, true>);
            }
            return pl.paged ? ask(FwdTraits<T, D, true, false>{}, fwd_tc_wave_slots<T, D, true, false>)
                            : ask(FwdTraits<T, D, false, false>{}, fwd_tc_wave_slots<T, D, false, false>);
        });
    });
}
}  // namespace

cudaError_t plan_fwd(const CfFwdParams& p, PlanFor what, FwdPlan& pl) {
    pl = FwdPlan{};
    pl.cta_order = -1;
    pl.ctas = -1;
    pl.split.nsplit = 1;
    pl.tile = round_head_dim(p.d);
    const bool launch = what == PlanFor::kLaunch;
    if (p.dtype == CF_E4M3) {  // check_fwd_e4m3 passed: the e4m3 wgmma kernel
        pl.kernel = FwdKernel::kWgmma;
        pl.sm90 = fwd_fp8_config(p);
        pl.tile = fwd_fp8_tile(p.d);
        pl.workspace = fp8_vt_layout(p).bytes;
        pl.tma = true;  // the e4m3 kernel loads by TMA only (check_fwd_e4m3 asked tma_enabled)
        return launch ? fwd_sm90_grid(p, pl) : cudaSuccess;
    }
    if (has_block_mask(p)) {  // check_fwd allowed it: f16 / bf16, d == dv <= 256, sm_90a (no split-KV)
        pl.kernel = FwdKernel::kWgmma;
        pl.sm90 = fwd_sm90_config(p);
        pl.tma = tma_enabled();
        pl.block_mask = true;
        return launch ? fwd_sm90_grid(p, pl) : cudaSuccess;
    }
    if (fwd_sm90_wide_takes(p)) {  // 512-wide heads past the decode shapes, on wgmma
        pl.kernel = FwdKernel::kWgmmaWide;
        pl.tile = FwdSm90WideTraits<__half>::kHeadDim;
        pl.tma = tma_enabled();
        return launch ? fwd_sm90_wide_grid(p, pl) : cudaSuccess;
    }
    pl.split = split_plan(p);
    pl.workspace = pl.split.bytes;
    if (pl.split.wide != WideSplit::kNone) {  // heads past 256 columns in f16 / bf16
        pl.kernel = FwdKernel::kWideSplit;
        pl.cta_order = 0;
        return cudaSuccess;
    }
    if (simt_only(p) || (p.dtype == CF_F32 && !f32_fwd_tensor_cores(p))) {
        pl.kernel = FwdKernel::kSimt;
        pl.simt = simt_shape(p);
        pl.cta_order = 0;
        return cudaSuccess;
    }
    if (pl.split.nsplit > 1) {  // decode shapes
        pl.kernel = FwdKernel::kSplit;
        pl.cta_order = 0;
        return cudaSuccess;
    }
    if (p.dtype != CF_F32 && fwd_sm90_takes(pl.tile) && sm90a_available()) {
        pl.kernel = FwdKernel::kWgmma;
        pl.sm90 = fwd_sm90_config(p);
        pl.tma = tma_enabled();
        return launch ? fwd_sm90_grid(p, pl) : cudaSuccess;
    }
    // mma.sync: paged K/V has its own instantiation (sm80/fwd.cu says why); f32 at d = 256 on
    // Hopper the 128-row 8-warp tile (config.cuh FwdTraits kHopperTile), paged K/V too (a paged
    // call must give the contiguous call's bits)
    pl.kernel = FwdKernel::kMmaSync;
    pl.paged = p.block_table != nullptr;
    pl.hopper_tile = p.dtype == CF_F32 && pl.tile == 256 && smem_fits(FwdTraits<float, 256, false, true>::kSmemBytes);
    return launch ? fwd_mma_sync_order(p, pl, pl.cta_order) : cudaSuccess;
}

cudaError_t plan_bwd(const CfBwdParams& p, PlanFor what, BwdPlan& pl) {
    const CfFwdParams& f = p.fwd;
    const bool tc = bwd_tensor_cores(p);
    const int tile90 = bwd_sm90_tile_for(f);
    pl = plan_bwd_workspace(p, tc, tile90 != 0);
    pl.dkdv_order = pl.dq_order = -1;
    pl.tile = tile90 != 0 ? tile90 : round_head_dim(f.d);
    if (!tc) {
        pl.kernel = BwdKernel::kSimt;
        pl.simt = simt_shape(f);
        pl.dkdv_order = pl.dq_order = 0;
        return cudaSuccess;
    }
    pl.kernel = tile90 == 0 ? BwdKernel::kMmaSync : tile90 <= 128 ? BwdKernel::kWgmma : BwdKernel::kWgmmaWide;
    pl.general_logits = pl.kernel == BwdKernel::kWgmma && logits_general(f);
    pl.tma = pl.kernel != BwdKernel::kMmaSync && tma_enabled();
    pl.block_mask = has_block_mask(f);  // (check_bwd: only on the wgmma kernels)
    // the sm_90a d <= 128 kernel sums the GQA split's partials itself (dkv_in_kernel)
    pl.reduce_dkv = pl.nsplit > 1 && !pl.dkv_in_kernel;
    if (what != PlanFor::kLaunch) return cudaSuccess;
    BwdWave w{};
    const cudaError_t e = with_element_type(f.dtype, [&](auto t) {
        using T = decltype(t);
        return with_head_dim_tile(pl.tile, [&](auto dc) { return bwd_tc_wave<T, decltype(dc)::value>(pl, w); });
    });
    if (e != cudaSuccess) return e;
    const int64_t key_blocks = (f.seqlen_k + w.dkdv_block_n - 1) / w.dkdv_block_n;
    const int64_t groups = (int64_t)f.hkv * pl.nsplit * f.b;
    // the wgmma kernels: trailing heavy-first groups; mma.sync: every group key block slowest, or none
    if (pl.kernel == BwdKernel::kMmaSync)
        pl.dkdv_order = mma_sync_heavy_first(f, key_blocks * groups, w.dkdv_slots, false) ? (int)groups : 0;
    else
        pl.dkdv_order = bwd_heavy_groups(f, key_blocks, groups, w.dkdv_slots);
    const int64_t query_blocks = (f.seqlen_q + w.dq_block_m - 1) / w.dq_block_m;
    pl.dq_order = pl.atomic_dq ? 0 : mma_sync_heavy_first(f, query_blocks * f.h * f.b, w.dq_slots, true);
    return cudaSuccess;
}

void describe_fwd_plan(const FwdPlan& pl, char* buf, size_t cap) {
    const SplitPlan& sp = pl.split;
    switch (pl.kernel) {
        case FwdKernel::kSimt:
            std::snprintf(buf, cap, "simt %s workspace=%zu", pl.simt == SimtShape::kWide ? "wide" : "narrow", pl.workspace);
            break;
        case FwdKernel::kMmaSync:
            std::snprintf(buf, cap, "mma_sync tile=%d%s%s order=%d workspace=%zu", pl.tile, pl.paged ? " paged" : "",
                          pl.hopper_tile ? " hopper_tile" : "", pl.cta_order, pl.workspace);
            break;
        case FwdKernel::kSplit:
            std::snprintf(buf, cap, "split tile=%d nsplit=%d pack=%d%s workspace=%zu", pl.tile, sp.nsplit, sp.pack,
                          sp.deep ? " deep" : "", pl.workspace);
            break;
        case FwdKernel::kWideSplit:
            std::snprintf(buf, cap, "wide_split %s nsplit=%d pack=%d workspace=%zu", wide_split_name(sp.wide), sp.nsplit,
                          sp.pack, pl.workspace);
            break;
        case FwdKernel::kWgmmaWide:
            std::snprintf(buf, cap, "wgmma_wide tile=%d ctas=%lld order=%d%s workspace=%zu", pl.tile, (long long)pl.ctas,
                          pl.cta_order, pl.tma ? "" : " no_tma", pl.workspace);
            break;
        default:
            std::snprintf(buf, cap, "wgmma %s ctas=%lld order=%d%s%s workspace=%zu", fwd_sm90_config_name(pl.sm90),
                          (long long)pl.ctas, pl.cta_order, pl.tma ? "" : " no_tma", pl.block_mask ? " block_mask" : "",
                          pl.workspace);
            break;
    }
}

void describe_bwd_plan(const BwdPlan& pl, char* buf, size_t cap) {
    static const char* const kernels[] = {"simt", "mma_sync", "wgmma", "wgmma_wide"};
    const char* dq = pl.ordered_dq ? "ordered" : pl.atomic_dq ? "atomic" : "pass";
    if (pl.kernel == BwdKernel::kSimt) {
        std::snprintf(buf, cap, "simt %s workspace=%zu", pl.simt == SimtShape::kWide ? "wide" : "narrow", pl.total);
        return;
    }
    const bool no_tma = pl.kernel != BwdKernel::kMmaSync && !pl.tma;
    std::snprintf(buf, cap, "%s tile=%d%s dq=%s nsplit=%d%s order=%d/%d%s%s workspace=%zu", kernels[(int)pl.kernel],
                  pl.tile, pl.general_logits ? " general_logits" : "", dq, pl.nsplit,
                  pl.nsplit > 1 ? (pl.reduce_dkv ? " reduce" : " dkv_in_kernel") : "", pl.dkdv_order, pl.dq_order,
                  no_tma ? " no_tma" : "", pl.block_mask ? " block_mask" : "", pl.total);
}

}  // namespace cf
