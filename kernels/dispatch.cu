// The entry points of flash_api.h: argument checks, then the call's plan (plan.cuh, plan.cu:
// every runtime choice, made there) and its launch: the launcher the plan names, with the plan's
// values (launch.cuh). Nothing here chooses a kernel.
#include "flash_api.h"
#include "plan.cuh"
#include "sm90/tma.cuh"
#include <cstdio>

// The sizes src/cuda/ffi.rs asserts for its mirrors (LP64): a field added on one side only fails
// to compile on both.
static_assert(sizeof(CfFwdParams) == 1224 && sizeof(CfBwdParams) == 1368, "change src/cuda/ffi.rs with flash_api.h");
static_assert(sizeof(CfBlockMask::nodes) == CF_MASK_MAX_NODES * sizeof(CfMaskNode), "the header's node count");

namespace cf {

namespace {
// e4m3 inputs: what the sm_90a FP8 kernel needs (the caller dequantizes when this fails with
// CF_ERR_UNSUPPORTED_DTYPE): f16 / bf16 output, d a multiple of 16 (TMA rows of 16-byte
// multiples), rows 16-byte aligned, contiguous K/V, valid descale divisors, TMA (tma_enabled),
// and, with probe_maps (cf_fwd_check), tensor maps the driver accepts (V^T's
// with q standing in for the workspace: only its alignment matters, and both are 16-byte
// aligned). cf_fwd does not probe again: its launch builds the maps and fails if they fail.
int check_fwd_e4m3(const CfFwdParams* p, bool probe_maps) {
    if (p->o_dtype != CF_F16 && p->o_dtype != CF_BF16) return CF_ERR_UNSUPPORTED_DTYPE;
    for (const CfDescale* ds : {&p->q_descale, &p->k_descale, &p->v_descale})
        if (ds->ptr != nullptr && (ds->head_div < 1 || ds->batch_stride < 0)) return CF_ERR_BAD_ARGUMENT;
    if (p->d % 16 != 0 || p->block_table != nullptr || !sm90a_available() || !tma_enabled())
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

// A block mask (flash_api.h CfBlockMask): its layout against the call (CF_ERR_BAD_ARGUMENT), then
// what its kernels take (CF_ERR_UNSUPPORTED_BLOCK_MASK): the sm_90a forward's 128-row tiles,
// f16 / bf16, d == dv <= 256 (from 33), batched, no paged K/V, no prefix ranges.
int check_block_mask(const CfFwdParams& p) {
    const CfBlockMask& m = p.block_mask;
    if (!m.kv_idx || !m.full_kv_num || !m.full_kv_idx || !m.q_num || !m.q_idx || !m.full_q_num || !m.full_q_idx)
        return CF_ERR_BAD_ARGUMENT;
    if ((m.batch != 1 && m.batch != p.b) || (m.heads != 1 && m.heads != p.h)) return CF_ERR_BAD_ARGUMENT;
    if (m.q_blocks != (p.seqlen_q + CF_MASK_BLOCK - 1) / CF_MASK_BLOCK ||
        m.k_blocks != (p.seqlen_k + CF_MASK_BLOCK - 1) / CF_MASK_BLOCK)
        return CF_ERR_BAD_ARGUMENT;
    if (m.n_nodes < 0 || m.n_nodes > CF_MASK_MAX_NODES) return CF_ERR_BAD_ARGUMENT;
    for (int x = 0; x < m.n_nodes; ++x) {
        const CfMaskNode& nd = m.nodes[x];
        if (nd.op < CF_MASK_ALL || nd.op > CF_MASK_GLOBAL_TOKENS) return CF_ERR_BAD_ARGUMENT;
        if (nd.op == CF_MASK_CHUNKED && nd.a < 1) return CF_ERR_BAD_ARGUMENT;
        if ((nd.op == CF_MASK_SAME_DOCUMENT || nd.op == CF_MASK_PREFIX_LM) &&
            (nd.q_data == nullptr || nd.q_batch_stride < 0))
            return CF_ERR_BAD_ARGUMENT;
        if (nd.op == CF_MASK_SAME_DOCUMENT && (nd.k_data == nullptr || nd.k_batch_stride < 0)) return CF_ERR_BAD_ARGUMENT;
    }
    const bool dtype_ok = p.dtype == CF_F16 || p.dtype == CF_BF16;
    const int rd = round_head_dim(p.d);
    if (!dtype_ok || p.cu_seqlens_q != nullptr || p.block_table != nullptr || p.prefix_ranges != nullptr ||
        head_dim_v(p) != p.d || !fwd_sm90_takes(rd) || rd > 256 || !sm90a_available())
        return CF_ERR_UNSUPPORTED_BLOCK_MASK;
    return CF_OK;
}

// The largest head dim (and value head dim) any kernel runs: the SIMT kernels' wide shape.
constexpr int kMaxHeadDim = 576;

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
    if (has_block_mask(*p)) {
        const int st = check_block_mask(*p);
        if (st != CF_OK) return st;
    }
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


// ---- running a plan: the launcher it names, with its values

template <typename T>
cudaError_t run_fwd_plan(const CfFwdParams& p, const FwdPlan& pl, void* ws, cudaStream_t s) {
    switch (pl.kernel) {
        case FwdKernel::kSimt:
            return pl.simt == SimtShape::kWide ? run_fwd_simt<T, SimtShape::kWide>(p, s)
                                               : run_fwd_simt<T, SimtShape::kNarrow>(p, s);
        case FwdKernel::kSplit:
            return pl.tile == 64 ? run_fwd_split<T, 64>(p, pl.split, ws, s) : run_fwd_split<T, 128>(p, pl.split, ws, s);
        case FwdKernel::kWideSplit:
            if constexpr (sizeof(T) == 2) return run_fwd_wide_split<T>(p, pl.split, ws, s);
            return cudaErrorInvalidValue;  // not planned: f16 / bf16 only
        case FwdKernel::kWgmma:
            if constexpr (sizeof(T) == 2)
                return with_fwd_sm90_traits<T>(pl.sm90, [&](auto kt) -> cudaError_t {
                    using Kt = decltype(kt);
                    if (pl.block_mask) {
                        if constexpr (fwd_sm90_takes_block_masks<Kt>()) return launch_fwd_sm90<BlockMasked<Kt>>(p, pl, ws, s);
                        return cudaErrorInvalidValue;  // not planned: plan.cuh fwd_sm90_config
                    }
                    return launch_fwd_sm90<Kt>(p, pl, ws, s);
                });
            return cudaErrorInvalidValue;  // not planned: 16-bit and e4m3 (output type T) only
        case FwdKernel::kWgmmaWide:
            if constexpr (sizeof(T) == 2) return launch_fwd_sm90_wide<FwdSm90WideTraits<T>>(p, pl, s);
            return cudaErrorInvalidValue;  // not planned: f16 / bf16 only
        default:
            return with_head_dim_tile(pl.tile, [&](auto dc) -> cudaError_t {
                constexpr int D = decltype(dc)::value;
                const bool across = pl.cta_order > 0;
                if constexpr (D == 256 && sizeof(T) == 4) {
                    if (pl.hopper_tile)
                        return pl.paged ? run_fwd_tc<T, D, true, true>(p, across, s) : run_fwd_tc<T, D, false, true>(p, across, s);
                }
                return pl.paged ? run_fwd_tc<T, D, true, false>(p, across, s) : run_fwd_tc<T, D, false, false>(p, across, s);
            });
    }
}

template <typename T>
cudaError_t run_bwd_plan(const CfBwdParams& p, const BwdWs& ws, const BwdPlan& pl, cudaStream_t s) {
    if (pl.kernel == BwdKernel::kSimt)
        return pl.simt == SimtShape::kWide ? run_bwd_simt<T, SimtShape::kWide>(p, ws, s)
                                           : run_bwd_simt<T, SimtShape::kNarrow>(p, ws, s);
    return with_head_dim_tile(pl.tile, [&](auto dc) { return run_bwd_tc<T, decltype(dc)::value>(p, ws, pl, s); });
}

int check_bwd(const CfBwdParams* p) {
    if (p == nullptr) return CF_ERR_BAD_ARGUMENT;
    if (p->fwd.dtype == CF_E4M3) return CF_ERR_UNSUPPORTED_DTYPE;  // FP8 attention is forward only
    int st = check_fwd(&p->fwd);
    if (st != CF_OK) return st;
    const CfFwdParams& f = p->fwd;
    if (f.block_table != nullptr || f.prefix_ranges != nullptr) return CF_ERR_BAD_ARGUMENT;  // forward only
    // a block mask's backward: the sm_90a dK/dV kernels with dQ by atomic reductions (deterministic
    // mode orders them by key blocks of the dense walk)
    if (has_block_mask(f) && (bwd_sm90_tile_for(f) == 0 || p->deterministic != 0)) return CF_ERR_UNSUPPORTED_BLOCK_MASK;
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

// cf_fwd_describe / cf_bwd_describe: the plan of a call that passed its checks (st), as text
// into buf; "none" when there is nothing to compute (empty).
template <typename Plan, typename Params, typename MakePlan, typename Text>
int describe_call(const Params* p, int st, bool empty, MakePlan make_plan, Text text, char* buf, size_t cap) {
    if (buf == nullptr || cap == 0) return CF_ERR_BAD_ARGUMENT;
    buf[0] = '\0';
    if (st != CF_OK) return st;
    if (empty) {
        std::snprintf(buf, cap, "none");
        return CF_OK;
    }
    Plan pl;
    const cudaError_t e = make_plan(*p, PlanFor::kLaunch, pl);
    if (e != cudaSuccess) return (int)e;
    text(pl, buf, cap);
    return CF_OK;
}

}  // namespace
}  // namespace cf

extern "C" {

size_t cf_fwd_workspace_size(const CfFwdParams* p) {
    using namespace cf;
    if (check_fwd(p) != CF_OK || p->b == 0 || p->seqlen_q == 0) return 0;
    FwdPlan pl;
    return plan_fwd(*p, PlanFor::kWorkspace, pl) == cudaSuccess ? pl.workspace : 0;
}

int cf_fwd_check(const CfFwdParams* p) { return cf::check_fwd(p, /*probe_maps=*/true); }

int cf_fwd(const CfFwdParams* p, void* workspace, cudaStream_t stream) {
    using namespace cf;
    const int st = check_fwd(p);
    if (st != CF_OK) return st;
    if (p->b == 0 || p->seqlen_q == 0) return CF_OK;
    FwdPlan pl;
    cudaError_t e = plan_fwd(*p, PlanFor::kLaunch, pl);
    if (e != cudaSuccess) return (int)e;
    if (p->dtype == CF_E4M3) {
        if (workspace == nullptr && pl.workspace != 0) return CF_ERR_BAD_ARGUMENT;  // V^T pre-pass
        // the output type is the e4m3 configuration's parameter
        e = p->o_dtype == CF_F16 ? run_fwd_plan<__half>(*p, pl, workspace, stream)
                                 : run_fwd_plan<__nv_bfloat16>(*p, pl, workspace, stream);
        return (int)e;
    }
    return (int)with_element_type(p->dtype, [&](auto t) { return run_fwd_plan<decltype(t)>(*p, pl, workspace, stream); });
}

int cf_fwd_describe(const CfFwdParams* p, char* buf, size_t cap) {
    using namespace cf;
    const int st = check_fwd(p);
    return describe_call<FwdPlan>(p, st, st == CF_OK && (p->b == 0 || p->seqlen_q == 0), plan_fwd, describe_fwd_plan, buf, cap);
}

size_t cf_bwd_workspace_size(const CfBwdParams* p) {
    using namespace cf;
    if (check_bwd(p) != CF_OK) return 0;
    BwdPlan pl;
    return plan_bwd(*p, PlanFor::kWorkspace, pl) == cudaSuccess ? pl.total : 0;
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
    BwdPlan pl;
    cudaError_t e = plan_bwd(*p, PlanFor::kLaunch, pl);
    if (e != cudaSuccess) return (int)e;
    if (pl.total > 0 && workspace == nullptr) return CF_ERR_BAD_ARGUMENT;
    char* base = static_cast<char*>(workspace);
    BwdWs ws;
    ws.dsum = reinterpret_cast<float*>(base + pl.dsum_off);
    ws.dq_accum = pl.atomic_dq ? reinterpret_cast<float*>(base + pl.dq_off) : nullptr;
    ws.dkv = pl.nsplit > 1 ? reinterpret_cast<float*>(base + pl.dkv_off) : nullptr;
    ws.nsplit = pl.nsplit;
    ws.dq_tiled = pl.atomic_dq && (pl.kernel == BwdKernel::kWgmma || pl.kernel == BwdKernel::kWgmmaWide);
    ws.hps = pl.hps;
    ws.heavy_first = 0;  // each launch's copy takes the plan's CTA order (run_bwd_tc)
    ws.total_q = pl.total_q;
    ws.total_k = pl.total_k;
    ws.dq_sem = pl.ordered_dq ? reinterpret_cast<int*>(base + pl.sem_off) : nullptr;
    ws.dq_sem_blocks = pl.sem_blocks;
    ws.dkv_count = pl.dkv_in_kernel ? reinterpret_cast<int*>(base + pl.cnt_off) : nullptr;

    if (pl.atomic_dq || pl.dkv_in_kernel) {
        // dq_accum, the dQ order's counters and the dK / dV counters: one memset
        const size_t lo = pl.atomic_dq ? pl.dq_off : pl.cnt_off;
        e = cudaMemsetAsync(base + lo, 0, pl.dkv_off - lo, stream);
        if (e != cudaSuccess) return (int)e;
    }
    if ((e = run_bwd_dot_do_o(*p, ws, stream)) != cudaSuccess) return (int)e;
    if (f.sinks != nullptr && p->dsinks != nullptr && (e = run_bwd_sink_grad(*p, ws, stream)) != cudaSuccess)
        return (int)e;
    return (int)with_element_type(f.dtype, [&](auto t) { return run_bwd_plan<decltype(t)>(*p, ws, pl, stream); });
}

int cf_bwd_describe(const CfBwdParams* p, char* buf, size_t cap) {
    using namespace cf;
    const int st = check_bwd(p);
    const bool empty = st == CF_OK && (p->fwd.b == 0 || (p->fwd.seqlen_q == 0 && p->fwd.seqlen_k == 0));
    return describe_call<BwdPlan>(p, st, empty, plan_bwd, describe_bwd_plan, buf, cap);
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
        case CF_ERR_UNSUPPORTED_BLOCK_MASK:
            return "candle-flash: block masks run on CUDA on the sm_90a (Hopper) kernels: f16 / bf16, head dims 33 to "
                   "256 with dv == d, the batched layout (no varlen, no paged K/V, no mm_prefix_ranges), and a "
                   "backward that is not deterministic; run other calls on the CPU";
        default:
            if (status > 0) return cudaGetErrorString(static_cast<cudaError_t>(status));
            return "candle-flash: unknown error";
    }
}

}  // extern "C"
