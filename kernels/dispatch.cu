// The entry points of flash_api.h and the one place where every runtime choice is made: argument
// checks, the architecture (sm_90a wgmma kernels or sm_80 mma.sync ones), the kernel family
// (f32 SIMT, tensor cores, split-KV decode), the tile configuration (head-dim tile; the sm_90a
// configuration) and the workspace plans (heuristics.cuh). Launchers (launch.cuh) only launch.
#include "flash_api.h"
#include "heuristics.cuh"
#include "sm90/tma.cuh"
#include <atomic>
#include <cstdlib>

// The sizes src/cuda/ffi.rs asserts for its mirrors (LP64): a field added on one side only fails
// to compile on both.
static_assert(sizeof(CfFwdParams) == 368 && sizeof(CfBwdParams) == 512, "change src/cuda/ffi.rs with flash_api.h");

namespace cf {

// Whether the environment variable `name` is set to anything but empty or "0": the
// CANDLE_FLASH_* switches that send calls to other kernels (to compare them, and to test them on
// shapes another kernel would take). Read once by each switch.
static bool env_switch(const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr && v[0] != '\0' && v[0] != '0';
}

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

namespace {
// Whether the device gives a block `bytes` of shared memory (false if it cannot be asked).
bool smem_fits(int bytes) {
    int have = 0;
    if (current_smem_optin(have) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return have >= bytes;
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }
// Alignment needed by the 16-byte vector loads/stores (and TMA rows) of the tensor-core kernels:
// strides in elements of elem_bytes bytes (2: f16 / bf16, 1: e4m3) that are whole 16 bytes.
// Batch strides are unused (and not checked) for varlen sides.
bool tensor_aligned(const void* ptr, int64_t batch_stride, int64_t row_stride, int64_t head_stride,
                    bool varlen, int elem_bytes = 2) {
    auto stride_ok = [&](int64_t s) { return (s * elem_bytes) % 16 == 0; };
    return aligned16(ptr) && stride_ok(row_stride) && stride_ok(head_stride) &&
           (varlen || stride_ok(batch_stride));
}

// e4m3 inputs: what the sm_90a FP8 kernel needs (the caller dequantizes when this fails with
// CF_ERR_UNSUPPORTED_DTYPE): f16 / bf16 output, d a multiple of 16 (TMA rows of 16-byte
// multiples), rows 16-byte aligned, contiguous K/V, valid descale divisors, a tensor-map encoder
// (TMA not disabled), and, with probe_maps (cf_fwd_check), tensor maps the driver accepts (V^T's
// with q standing in for the workspace: only its alignment matters, and both are 16-byte
// aligned). cf_fwd does not probe again: its launch builds the maps and fails if they fail.
int check_fwd_e4m3(const CfFwdParams* p, bool probe_maps) {
    if (p->o_dtype != CF_F16 && p->o_dtype != CF_BF16) return CF_ERR_UNSUPPORTED_DTYPE;
    for (const CfDescale* ds : {&p->q_descale, &p->k_descale, &p->v_descale})
        if (ds->ptr != nullptr && (ds->head_div < 1 || ds->batch_stride < 0)) return CF_ERR_BAD_ARGUMENT;
    if (p->d % 16 != 0 || p->block_table != nullptr || !sm90a_available() || tensor_map_encoder() == nullptr)
        return CF_ERR_UNSUPPORTED_DTYPE;
    const bool vq = p->cu_seqlens_q != nullptr, vk = p->cu_seqlens_k != nullptr;
    if (!tensor_aligned(p->q, p->q_batch_stride, p->q_row_stride, p->q_head_stride, vq, 1) ||
        !tensor_aligned(p->k, p->k_batch_stride, p->k_row_stride, p->k_head_stride, vk, 1) ||
        !tensor_aligned(p->v, p->v_batch_stride, p->v_row_stride, p->v_head_stride, vk, 1) ||
        !tensor_aligned(p->o, p->o_batch_stride, p->o_row_stride, p->o_head_stride, vq))
        return CF_ERR_UNSUPPORTED_DTYPE;
    if (probe_maps && p->b > 0 && p->seqlen_q > 0) {
        const FwdTmaMaps m = fwd_fp8_vt_in_kernel(*p)
                                 ? make_fwd_tma_maps(*p, 128, 128)
                                 : make_fwd_tma_maps(*p, 128, 128, p->q, fp8_vt_layout(*p).cols, fwd_fp8_tile(p->d));
        if (!m.q_ok || !m.kv_ok) return CF_ERR_UNSUPPORTED_DTYPE;
    }
    return CF_OK;
}

// What only the SIMT kernels run (flash_api.h): a head dim past the tensor-core tiles' 256, a
// value head dim of its own, mm_prefix_ranges (a second key interval per row, which the
// tensor-core kernels' one-interval masks do not carry). Their shape: kNarrow up to 256
// columns, kWide past it (config.cuh SimtShape).
constexpr int kMaxHeadDim = 576;
bool simt_only(const CfFwdParams& p) { return p.d > 256 || head_dim_v(p) != p.d || p.prefix_ranges != nullptr; }
SimtShape simt_shape(const CfFwdParams& p) {
    return std::max(p.d, head_dim_v(p)) > simt_max_head_dim(SimtShape::kNarrow) ? SimtShape::kWide : SimtShape::kNarrow;
}

// probe_maps: see check_fwd_e4m3 (e4m3 only).
int check_fwd(const CfFwdParams* p, bool probe_maps = false) {
    if (p == nullptr) return CF_ERR_BAD_ARGUMENT;
    if (p->dtype != CF_F32 && p->dtype != CF_F16 && p->dtype != CF_BF16 && p->dtype != CF_E4M3)
        return CF_ERR_UNSUPPORTED_DTYPE;
    if (p->dtype != CF_E4M3 && p->o_dtype != p->dtype) return CF_ERR_BAD_ARGUMENT;
    const int dv = head_dim_v(*p);
    if (p->d < 8 || p->d > kMaxHeadDim || p->d % 8 != 0 || p->dv < 0 || dv < 8 || dv > kMaxHeadDim || dv % 8 != 0)
        return CF_ERR_UNSUPPORTED_HEAD_DIM;
    if (p->b < 0 || p->h <= 0 || p->hkv <= 0 || p->h % p->hkv != 0 || p->seqlen_q < 0 || p->seqlen_k < 0)
        return CF_ERR_BAD_ARGUMENT;
    if (p->h > 65535 || p->b > 65535) return CF_ERR_BAD_ARGUMENT;  // grid y / z limits
    if ((p->cu_seqlens_q == nullptr) != (p->cu_seqlens_k == nullptr)) return CF_ERR_BAD_ARGUMENT;
    if (p->total_q < 0 || p->total_k < 0) return CF_ERR_BAD_ARGUMENT;
    // MaskInfo's 32-bit arithmetic (common/mask.cuh) and int row indices.
    if ((int64_t)p->seqlen_q + p->seqlen_k >= (int64_t(1) << 29)) return CF_ERR_BAD_ARGUMENT;
    if (p->cu_seqlens_q == nullptr &&
        (p->total_q != (int64_t)p->b * p->seqlen_q || p->total_k != (int64_t)p->b * p->seqlen_k))
        return CF_ERR_BAD_ARGUMENT;
    // An empty k / v (every key sequence empty) may come with no buffer at all (candle gives
    // zero-size CUDA tensors a null pointer): no kernel reads a key then.
    if (p->b > 0 && (p->q == nullptr || p->o == nullptr || p->lse == nullptr ||
                     (p->total_k > 0 && (p->k == nullptr || p->v == nullptr))))
        return CF_ERR_BAD_ARGUMENT;
    const bool paged = p->block_table != nullptr;
    if (paged) {
        // Lengths come from cu_seqlens_k; every key a sequence may have (<= seqlen_k) must have
        // a table entry, so no lookup (SeqInfo::key_offset) reads past a table row.
        if (p->cu_seqlens_k == nullptr || p->page_block_size < 1 || p->num_blocks < 0 || p->max_blocks < 0 ||
            p->block_table_batch_stride < p->max_blocks ||
            (int64_t)p->seqlen_k > (int64_t)p->max_blocks * p->page_block_size ||
            p->total_k != (int64_t)p->num_blocks * p->page_block_size)
            return CF_ERR_BAD_ARGUMENT;
    }
    if (p->prefix_ranges != nullptr && p->prefix_max_ranges < 0) return CF_ERR_BAD_ARGUMENT;
    if (simt_only(*p)) {
        // the e4m3 kernel has none of these; the SIMT shape's tiles must fit the device
        if (p->dtype == CF_E4M3) return CF_ERR_UNSUPPORTED_DTYPE;
        if (!smem_fits((int)simt_fwd_smem_bytes(*p, simt_shape(*p)))) return CF_ERR_UNSUPPORTED_HEAD_DIM;
    }
    if (p->dtype == CF_E4M3) return check_fwd_e4m3(p, probe_maps);
    if (p->dtype != CF_F32) {
        // paged k / v: the batch stride is the page stride, used for every page
        const bool vq = p->cu_seqlens_q != nullptr, vk = p->cu_seqlens_k != nullptr && !paged;
        if (!tensor_aligned(p->q, p->q_batch_stride, p->q_row_stride, p->q_head_stride, vq) ||
            !tensor_aligned(p->k, p->k_batch_stride, p->k_row_stride, p->k_head_stride, vk) ||
            !tensor_aligned(p->v, p->v_batch_stride, p->v_row_stride, p->v_head_stride, vk) ||
            !tensor_aligned(p->o, p->o_batch_stride, p->o_row_stride, p->o_head_stride, vq))
            return CF_ERR_MISALIGNED;
    }
    return CF_OK;
}


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
// Whether the backward runs the tensor-core kernels (their workspace plan differs: plan_bwd).
bool bwd_tensor_cores(const CfBwdParams& p) {
    return simt_only(p.fwd) ? false : p.fwd.dtype != CF_F32 || f32_bwd_tensor_cores(p);
}

// CANDLE_FLASH_DISABLE_WIDE_SPLIT=1 keeps the decode shapes of wide heads on the SIMT kernels
// (to compare, and to test those kernels on the shapes the wide split kernel takes).
bool wide_split_disabled() {
    static const bool off = env_switch("CANDLE_FLASH_DISABLE_WIDE_SPLIT");
    return off;
}

// The split-KV plan of a call (heuristics.cuh): the wide-head kernel's for the decode shapes of
// heads past 256 columns, none on the SIMT kernels; the one decision that both sizes the
// workspace (cf_fwd_workspace_size) and picks the kernel.
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

template <typename T>
cudaError_t fwd_split(const CfFwdParams& p, const SplitPlan& sp, void* ws, cudaStream_t s) {
    return round_head_dim(p.d) == 64 ? run_fwd_split<T, 64>(p, sp, ws, s) : run_fwd_split<T, 128>(p, sp, ws, s);
}

template <typename T>
cudaError_t fwd_sm90(const CfFwdParams& p, cudaStream_t s) {
    switch (fwd_sm90_config(p)) {
        case FwdSm90Config::kD64Short: return launch_fwd_sm90<FwdSm90TraitsD64Short<T>>(p, nullptr, s);
        case FwdSm90Config::kD64: return launch_fwd_sm90<FwdSm90TraitsD64<T>>(p, nullptr, s);
        case FwdSm90Config::kD64Persistent: return launch_fwd_sm90<FwdSm90TraitsD64Persistent<T>>(p, nullptr, s);
        case FwdSm90Config::kD96: return launch_fwd_sm90<FwdSm90TraitsD96<T>>(p, nullptr, s);
        case FwdSm90Config::kD128: return launch_fwd_sm90<FwdSm90TraitsD128<T>>(p, nullptr, s);
        case FwdSm90Config::kD192: return launch_fwd_sm90<FwdSm90TraitsD192<T>>(p, nullptr, s);
        case FwdSm90Config::kD96Long: return launch_fwd_sm90<FwdSm90TraitsD96Long<T>>(p, nullptr, s);
        case FwdSm90Config::kD256: return launch_fwd_sm90<FwdSm90TraitsD256<T>>(p, nullptr, s);
        case FwdSm90Config::kD128Long: return launch_fwd_sm90<FwdSm90TraitsD128Long<T>>(p, nullptr, s);
        case FwdSm90Config::kD192Long: return launch_fwd_sm90<FwdSm90TraitsD192Long<T>>(p, nullptr, s);
        default: return launch_fwd_sm90<FwdSm90TraitsD256Long<T>>(p, nullptr, s);
    }
}

// e4m3 inputs (check_fwd_e4m3 passed): the FP8 wgmma kernel, output type O.
template <typename O>
cudaError_t fwd_fp8(const CfFwdParams& p, void* ws, cudaStream_t s) {
    if (fwd_fp8_tile(p.d) == 256) return launch_fwd_sm90<FwdSm90Fp8TraitsD256<O>>(p, ws, s);
    return fwd_fp8_long(p) ? launch_fwd_sm90<FwdSm90Fp8TraitsD128Long<O>>(p, ws, s)
                           : launch_fwd_sm90<FwdSm90Fp8TraitsD128<O>>(p, ws, s);
}

// mma.sync forward: paged K/V has its own instantiation (sm80/fwd.cu says why).
template <typename T, int D, bool kHopperTile = false>
cudaError_t fwd_sm80(const CfFwdParams& p, cudaStream_t s) {
    return p.block_table != nullptr ? run_fwd_tc<T, D, true, kHopperTile>(p, s)
                                    : run_fwd_tc<T, D, false, kHopperTile>(p, s);
}

template <typename T>
cudaError_t fwd_simt(const CfFwdParams& p, cudaStream_t s) {
    return simt_shape(p) == SimtShape::kWide ? run_fwd_simt<T, SimtShape::kWide>(p, s)
                                             : run_fwd_simt<T, SimtShape::kNarrow>(p, s);
}

// f32 forward: the 3xTF32 mma.sync kernel of the rounded head dim, or the SIMT kernel.
cudaError_t fwd_f32(const CfFwdParams& p, void* ws, cudaStream_t s) {
    if (!f32_fwd_tensor_cores(p)) return fwd_simt<float>(p, s);
    const SplitPlan sp = split_plan(p);
    if (sp.nsplit > 1) return fwd_split<float>(p, sp, ws, s);
    switch (round_head_dim(p.d)) {
        case 32: return fwd_sm80<float, 32>(p, s);
        case 64: return fwd_sm80<float, 64>(p, s);
        case 96: return fwd_sm80<float, 96>(p, s);
        case 128: return fwd_sm80<float, 128>(p, s);
        case 192: return fwd_sm80<float, 192>(p, s);
        default:  // Hopper: the 128-row 8-warp tile (config.cuh FwdTraits kHopperTile), paged K/V
                  // too (a paged call must give the contiguous call's bits)
            return smem_fits(FwdTraits<float, 256, false, true>::kSmemBytes) ? fwd_sm80<float, 256, true>(p, s)
                                                                             : fwd_sm80<float, 256>(p, s);
    }
}

// f16 / bf16 forward: split-KV for decode shapes (wide heads too), else the wgmma kernel on
// Hopper for the head-dim tiles it takes (heuristics.cuh), else the mma.sync kernel; the SIMT
// kernel for what only it runs.
template <typename T>
cudaError_t fwd_tc(const CfFwdParams& p, void* ws, cudaStream_t s) {
    const SplitPlan sp = split_plan(p);
    if (sp.wide != WideSplit::kNone) return run_fwd_wide_split<T>(p, sp, ws, s);
    if (simt_only(p)) return fwd_simt<T>(p, s);
    if (sp.nsplit > 1) return fwd_split<T>(p, sp, ws, s);
    const int rd = round_head_dim(p.d);
    if (fwd_sm90_takes(rd) && sm90a_available()) return fwd_sm90<T>(p, s);
    switch (round_head_dim(p.d)) {
        case 32: return fwd_sm80<T, 32>(p, s);
        case 64: return fwd_sm80<T, 64>(p, s);
        case 96: return fwd_sm80<T, 96>(p, s);
        case 128: return fwd_sm80<T, 128>(p, s);
        case 192: return fwd_sm80<T, 192>(p, s);
        default: return fwd_sm80<T, 256>(p, s);
    }
}

// The head-dim tile of the wgmma backward for this call, 0 when the mma.sync / SIMT kernels run
// (f32, no sm_90a, or a tile bwd_sm90_tile leaves to mma.sync). cf_bwd's dq_accum layout follows it.
int bwd_sm90_tile_for(const CfFwdParams& f) {
    return f.dtype != CF_F32 && !simt_only(f) && sm90a_available() ? bwd_sm90_tile(round_head_dim(f.d)) : 0;
}

// Tensor-core backward: the wgmma dK/dV kernels on Hopper (bwd_sm90_tile_for says which tile),
// else the mma.sync kernels of the rounded head dim.
template <typename T>
cudaError_t bwd_tc(const CfBwdParams& p, const BwdWs& ws, cudaStream_t s) {
    const int rd = round_head_dim(p.fwd.d);
    const int tile90 = bwd_sm90_tile_for(p.fwd);
    const bool wgmma = tile90 != 0;
    switch (wgmma ? tile90 : rd) {
        case 32: return run_bwd_tc<T, 32>(p, ws, wgmma, s);
        case 64: return run_bwd_tc<T, 64>(p, ws, wgmma, s);
        case 96: return run_bwd_tc<T, 96>(p, ws, wgmma, s);
        case 128: return run_bwd_tc<T, 128>(p, ws, wgmma, s);
        case 192: return run_bwd_tc<T, 192>(p, ws, wgmma, s);
        default: return run_bwd_tc<T, 256>(p, ws, wgmma, s);
    }
}


template <typename T>
cudaError_t bwd_simt(const CfBwdParams& p, const BwdWs& ws, cudaStream_t s) {
    return simt_shape(p.fwd) == SimtShape::kWide ? run_bwd_simt<T, SimtShape::kWide>(p, ws, s)
                                                 : run_bwd_simt<T, SimtShape::kNarrow>(p, ws, s);
}

// f32 backward (after dsum) on the 3xTF32 mma.sync kernels.
cudaError_t bwd_f32(const CfBwdParams& p, const BwdWs& ws, cudaStream_t s) {
    switch (round_head_dim(p.fwd.d)) {
        case 32: return run_bwd_tc<float, 32>(p, ws, false, s);
        case 64: return run_bwd_tc<float, 64>(p, ws, false, s);
        case 96: return run_bwd_tc<float, 96>(p, ws, false, s);
        case 128: return run_bwd_tc<float, 128>(p, ws, false, s);
        case 192: return run_bwd_tc<float, 192>(p, ws, false, s);
        default: return run_bwd_tc<float, 256>(p, ws, false, s);
    }
}

int check_bwd(const CfBwdParams* p) {
    if (p == nullptr) return CF_ERR_BAD_ARGUMENT;
    if (p->fwd.dtype == CF_E4M3) return CF_ERR_UNSUPPORTED_DTYPE;  // FP8 attention is forward only
    int st = check_fwd(&p->fwd);
    if (st != CF_OK) return st;
    const CfFwdParams& f = p->fwd;
    if (f.block_table != nullptr || f.prefix_ranges != nullptr) return CF_ERR_BAD_ARGUMENT;  // forward only
    // the backward's SIMT tiles must fit the device
    if (simt_only(f)) {
        const int dv = head_dim_v(f);
        const size_t need = simt_shape(f) == SimtShape::kWide
                                ? std::max(SimtKeyTraits<SimtShape::kWide>::smem_bytes(f.d, dv),
                                           SimtRowTraits<SimtShape::kWide>::dq_smem_bytes(f.d, dv))
                                : std::max(SimtKeyTraits<SimtShape::kNarrow>::smem_bytes(f.d, dv),
                                           SimtRowTraits<SimtShape::kNarrow>::dq_smem_bytes(f.d, dv));
        if (!smem_fits((int)need)) return CF_ERR_UNSUPPORTED_HEAD_DIM;
    }
    if (f.b > 0 && (p->dout == nullptr || p->dq == nullptr || p->dk == nullptr || p->dv == nullptr))
        return CF_ERR_BAD_ARGUMENT;
    if (f.dtype != CF_F32) {
        const bool vq = f.cu_seqlens_q != nullptr, vk = f.cu_seqlens_k != nullptr;
        if (!tensor_aligned(p->dout, p->do_batch_stride, p->do_row_stride, p->do_head_stride, vq) ||
            !tensor_aligned(p->dq, p->dq_batch_stride, p->dq_row_stride, p->dq_head_stride, vq) ||
            !tensor_aligned(p->dk, p->dk_batch_stride, p->dk_row_stride, p->dk_head_stride, vk) ||
            !tensor_aligned(p->dv, p->dv_batch_stride, p->dv_row_stride, p->dv_head_stride, vk))
            return CF_ERR_MISALIGNED;
    }
    return CF_OK;
}

}  // namespace
}  // namespace cf

extern "C" {

size_t cf_fwd_workspace_size(const CfFwdParams* p) {
    using namespace cf;
    if (check_fwd(p) != CF_OK || p->b == 0 || p->seqlen_q == 0) return 0;
    if (p->dtype == CF_E4M3) return fp8_vt_layout(*p).bytes;
    return split_plan(*p).bytes;
}

int cf_fwd_check(const CfFwdParams* p) { return cf::check_fwd(p, /*probe_maps=*/true); }

int cf_fwd(const CfFwdParams* p, void* workspace, cudaStream_t stream) {
    using namespace cf;
    const int st = check_fwd(p);
    if (st != CF_OK) return st;
    if (p->b == 0 || p->seqlen_q == 0) return CF_OK;
    cudaError_t e;
    switch (p->dtype) {
        case CF_F32: e = fwd_f32(*p, workspace, stream); break;
        case CF_F16: e = fwd_tc<__half>(*p, workspace, stream); break;
        case CF_BF16: e = fwd_tc<__nv_bfloat16>(*p, workspace, stream); break;
        default:
            if (workspace == nullptr && fp8_vt_layout(*p).bytes != 0) return CF_ERR_BAD_ARGUMENT;  // V^T pre-pass
            e = p->o_dtype == CF_F16 ? fwd_fp8<__half>(*p, workspace, stream) : fwd_fp8<__nv_bfloat16>(*p, workspace, stream);
            break;
    }
    return (int)e;
}

size_t cf_bwd_workspace_size(const CfBwdParams* p) {
    using namespace cf;
    if (check_bwd(p) != CF_OK) return 0;
    return plan_bwd(*p, bwd_tensor_cores(*p), bwd_sm90_tile_for(p->fwd) != 0).total;
}

int cf_bwd(const CfBwdParams* p, void* workspace, cudaStream_t stream) {
    using namespace cf;
    const int st = check_bwd(p);
    if (st != CF_OK) return st;
    const CfFwdParams& f = p->fwd;
    if (f.b == 0 || (f.seqlen_q == 0 && f.seqlen_k == 0)) {
        // no rows: dsinks (when asked for) is zero
        if (f.sinks == nullptr || p->dsinks == nullptr || f.h == 0) return CF_OK;
        return (int)cudaMemsetAsync(p->dsinks, 0, sizeof(float) * f.h, stream);
    }
    const BwdPlan pl = plan_bwd(*p, bwd_tensor_cores(*p), bwd_sm90_tile_for(f) != 0);
    if (pl.total > 0 && workspace == nullptr) return CF_ERR_BAD_ARGUMENT;
    char* base = static_cast<char*>(workspace);
    BwdWs ws;
    ws.dsum = reinterpret_cast<float*>(base + pl.dsum_off);
    ws.dq_accum = pl.atomic_dq ? reinterpret_cast<float*>(base + pl.dq_off) : nullptr;
    ws.dkv = pl.nsplit > 1 ? reinterpret_cast<float*>(base + pl.dkv_off) : nullptr;
    ws.nsplit = pl.nsplit;
    ws.dq_tiled = pl.atomic_dq && bwd_sm90_tile_for(f) != 0;
    ws.hps = pl.hps;
    ws.heavy_first = 0;  // set per launch by the sm_90a dK/dV kernels' launcher (sm80/bwd.cuh)
    ws.total_q = pl.total_q;
    ws.total_k = pl.total_k;
    ws.dq_sem = pl.ordered_dq ? reinterpret_cast<int*>(base + pl.sem_off) : nullptr;
    ws.dq_sem_blocks = pl.sem_blocks;
    ws.dkv_count = pl.dkv_in_kernel ? reinterpret_cast<int*>(base + pl.cnt_off) : nullptr;

    cudaError_t e;
    if (pl.atomic_dq || pl.dkv_in_kernel) {
        // dq_accum, the dQ order's counters and the dK / dV counters: one memset
        const size_t lo = pl.atomic_dq ? pl.dq_off : pl.cnt_off;
        e = cudaMemsetAsync(base + lo, 0, pl.dkv_off - lo, stream);
        if (e != cudaSuccess) return (int)e;
    }
    if ((e = run_bwd_dot_do_o(*p, ws, stream)) != cudaSuccess) return (int)e;
    if (f.sinks != nullptr && p->dsinks != nullptr && (e = run_bwd_sink_grad(*p, ws, stream)) != cudaSuccess)
        return (int)e;
    if (!bwd_tensor_cores(*p)) {
        switch (f.dtype) {
            case CF_F32: e = bwd_simt<float>(*p, ws, stream); break;
            case CF_F16: e = bwd_simt<__half>(*p, ws, stream); break;
            default: e = bwd_simt<__nv_bfloat16>(*p, ws, stream); break;
        }
        return (int)e;
    }
    switch (f.dtype) {
        case CF_F32: e = bwd_f32(*p, ws, stream); break;
        case CF_F16: e = bwd_tc<__half>(*p, ws, stream); break;
        default: e = bwd_tc<__nv_bfloat16>(*p, ws, stream); break;
    }
    return (int)e;
}

// The sinks' gradient needs dsum alone: the workspace is dsum's rows, [h][total_q] f32.
size_t cf_sink_grad_workspace_size(const CfBwdParams* p) {
    if (p == nullptr || cf::check_fwd(&p->fwd) != CF_OK) return 0;
    return sizeof(float) * (size_t)p->fwd.h * (size_t)p->fwd.total_q;
}

int cf_sink_grad(const CfBwdParams* p, void* workspace, cudaStream_t stream) {
    using namespace cf;
    if (p == nullptr || p->fwd.sinks == nullptr || p->dsinks == nullptr || p->fwd.dtype == CF_E4M3 ||
        p->fwd.block_table != nullptr || p->dout == nullptr)
        return CF_ERR_BAD_ARGUMENT;
    const int st = check_fwd(&p->fwd);
    if (st != CF_OK) return st;
    const CfFwdParams& f = p->fwd;
    if (f.h == 0) return CF_OK;
    if (f.b == 0 || f.total_q == 0) {  // no rows: a zero gradient
        return (int)cudaMemsetAsync(p->dsinks, 0, sizeof(float) * f.h, stream);
    }
    if (workspace == nullptr) return CF_ERR_BAD_ARGUMENT;
    BwdWs ws{};
    ws.dsum = static_cast<float*>(workspace);
    ws.total_q = f.total_q;
    ws.total_k = f.total_k;
    cudaError_t e = run_bwd_dot_do_o(*p, ws, stream);
    if (e == cudaSuccess) e = run_bwd_sink_grad(*p, ws, stream);
    return (int)e;
}

const char* cf_error_string(int status) {
    switch (status) {
        case CF_OK: return "success";
        case CF_ERR_UNSUPPORTED_DTYPE:
            return "candle-flash: unsupported dtype (f32, f16, bf16; e4m3 only on sm_90a with d % 16 == 0, 16-byte "
                   "aligned rows, no paged K/V, f16 / bf16 output)";
        case CF_ERR_UNSUPPORTED_HEAD_DIM:
            return "candle-flash: unsupported head dim (need d and dv % 8 == 0, 8 <= d, dv <= 576, and, past 256 or "
                   "with dv != d, tiles that fit the device's shared memory)";
        case CF_ERR_MISALIGNED:
            return "candle-flash: f16/bf16 tensors need 16-byte aligned pointers and strides that are multiples of 8 elements";
        case CF_ERR_BAD_ARGUMENT: return "candle-flash: bad argument";
        default:
            if (status > 0) return cudaGetErrorString(static_cast<cudaError_t>(status));
            return "candle-flash: unknown error";
    }
}

}  // extern "C"
