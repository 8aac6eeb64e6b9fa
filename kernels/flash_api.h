// The one C interface between the Rust crate (src/cuda/) and our CUDA kernels.
//
// Rust mirrors these structs with #[repr(C)] in src/cuda/ffi.rs: change both together.
// All pointers are device pointers. Strides are in elements; the last (head-dim) axis is always
// contiguous. Every entry point launches on the stream it is given (candle's stream) and returns
// 0 on success, a cudaError_t (> 0) when a launch failed, or a CfStatus (< 0) when the
// combination of options is not supported; cf_error_string() turns any of them into text.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

// CF_E4M3: FP8 (OCP e4m3) q, k, v, forward only (cf_fwd; o is f16 or bf16, see o_dtype).
enum CfDType { CF_F32 = 0, CF_F16 = 1, CF_BF16 = 2, CF_E4M3 = 3 };

enum CfStatus {
    CF_OK = 0,
    CF_ERR_UNSUPPORTED_DTYPE = -1,
    CF_ERR_UNSUPPORTED_HEAD_DIM = -2,
    CF_ERR_MISALIGNED = -3,
    CF_ERR_BAD_ARGUMENT = -4,
    // a block mask with what its kernels do not run (cf_error_string says what they take)
    CF_ERR_UNSUPPORTED_BLOCK_MASK = -5,
};

// Addressing of one (batch b, row i, head h) vector, for x in {q, k, v, o, dout, dq, dk, dv}:
//   batched (cu_seqlens_* == NULL): x + b*x_batch_stride + i*x_row_stride + h*x_head_stride
//   varlen:                         x + (cu_seqlens[b] + i)*x_row_stride + h*x_head_stride
//   paged k / v (block_table set):  see block_table below
// q/o/dout/dq use cu_seqlens_q and seqlen_q; k/v/dk/dv use cu_seqlens_k and seqlen_k.
// Query head h reads KV head h / (h / hkv) with integer division of the head counts, i.e.
// kv_head = h_index / (p->h / p->hkv) (GQA/MQA: h % hkv == 0, checked by the Rust side).
//
// lse (f32, natural log) of (b, h, i): lse[b*lse_batch_stride + h*lse_head_stride + row]
//   with row = i (batched) or cu_seqlens_q[b] + i (varlen, lse_batch_stride == 0).
// A row that sees no key gets o = 0 and lse = -inf.
typedef struct {
    const float* ptr;
    int64_t batch_stride;
    int32_t head_div;
} CfDescale;

// Block-sparse attention (src/block_mask.rs, FlexAttention's BlockMask): the score matrix of each
// (sequence, query head) cut into CF_MASK_BLOCK x CF_MASK_BLOCK blocks. For query block r the
// mask lists its fully visible key blocks (full_kv_idx, full_kv_num of them) and its partly
// visible ones (kv_idx, kv_num): inside those the element rule (nodes) decides; every other key
// block is hidden and never read. The q lists are the same transposed (each key block's query
// blocks), for the backward. Entry e of (sequence b, query head h) is
//   e = (batch == 1 ? 0 : b) * heads + (heads == 1 ? 0 : h)
// counts [e][rows] and indices [e][rows][width], rows / width = q_blocks / k_blocks for the kv
// lists and k_blocks / q_blocks for the q lists, int32, contiguous. The lists are device data the
// host does not read: a count is cut to [0, width], and an index outside [0, width) selects no
// key (the step is computed fully masked), so any values give defined rows and no access outside
// the tensors; an index listed twice is counted twice. Batched layout only (no varlen, no paged
// K/V), no prefix ranges; the forward intersects it with every other option's mask.
// The element rule is an OR of terms, each term an AND of nodes (a node with `last_in_term` set
// closes its term); no term: no element of a partial block is visible. Positions follow the
// causal convention: query i of a sequence sits at key position pos = i + seqlen_k - seqlen_q.
#define CF_MASK_BLOCK 128
#define CF_MASK_MAX_NODES 16
enum CfMaskOp {
    CF_MASK_ALL = 0,            // every key
    CF_MASK_CAUSAL = 1,         // j <= pos
    CF_MASK_WINDOW = 2,         // pos - a <= j <= pos + b (a or b < 0: unbounded on that side)
    CF_MASK_SAME_DOCUMENT = 3,  // q_data[b][i] == k_data[b][j] (document ids)
    CF_MASK_PREFIX_LM = 4,      // j <= pos || j < q_data[b] (prefix length)
    CF_MASK_CHUNKED = 5,        // floor(pos / a) == floor(j / a), a >= 1
    CF_MASK_GLOBAL_TOKENS = 6,  // j < a
};
typedef struct {
    int32_t op;  // CfMaskOp
    int32_t a, b;
    int32_t last_in_term;  // nonzero: the node ends its AND term
    // u32 data: SAME_DOCUMENT q_data [B or 1][seqlen_q], k_data [B or 1][seqlen_k]; PREFIX_LM
    // q_data [B or 1]. Row b at b * batch_stride (0: one row for every sequence).
    const uint32_t* q_data;
    const uint32_t* k_data;
    int64_t q_batch_stride, k_batch_stride;
} CfMaskNode;
typedef struct {
    // kv_num NULL: no block mask (the rest is not read)
    const int32_t* kv_num;
    const int32_t* kv_idx;
    const int32_t* full_kv_num;
    const int32_t* full_kv_idx;
    const int32_t* q_num;
    const int32_t* q_idx;
    const int32_t* full_q_num;
    const int32_t* full_q_idx;
    int32_t batch, heads;        // the mask's (each 1: broadcast, or the call's b / h)
    int32_t q_blocks, k_blocks;  // ceil(seqlen_q / 128), ceil(seqlen_k / 128)
    int32_t n_nodes;             // <= CF_MASK_MAX_NODES
    int32_t pad_;
    CfMaskNode nodes[16];  // CF_MASK_MAX_NODES
} CfBlockMask;

typedef struct {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;
    // NULL when there is no ALiBi; otherwise the slope of (b, h) is
    // alibi_slopes[b*alibi_batch_stride + h] (alibi_batch_stride == 0 for slopes of shape [H]).
    const float* alibi_slopes;
    // NULL unless varlen; otherwise b+1 cumulative offsets (device memory).
    const uint32_t* cu_seqlens_q;
    const uint32_t* cu_seqlens_k;

    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    int64_t lse_batch_stride, lse_head_stride;

    int32_t b, h, hkv, d;
    // Batched: the sequence lengths. Varlen: max_seqlen_q / max_seqlen_k (grid sizing); the real
    // length of sequence b is cu_seqlens[b+1] - cu_seqlens[b] (<= the max, checked by Rust).
    int32_t seqlen_q, seqlen_k;
    int32_t alibi_batch_stride;
    // Key j is visible to query i (both 0-based within their sequence, sq/sk that sequence's
    // lengths) iff  i + sk - sq - window_left <= j <= i + sk - sq + window_right,
    // where a negative window means unbounded on that side. causal == (-1, 0).
    int32_t window_left, window_right;
    // logit = s = softmax_scale * q.k ; if softcap > 0: s = softcap * tanh(s / softcap);
    //         s -= slope * |i + sk - sq - j| (ALiBi); masked keys are excluded.
    float softmax_scale;
    float softcap;  // 0 = off
    int32_t dtype;  // CfDType of q, k, v, o (and dout, dq, dk, dv)
    // Rows of the q-side / k-side tensors (b*seqlen batched; the packed totals varlen). Known
    // from the shapes alone, so workspaces are sized without reading device memory, and the
    // kernels clamp what they read from cu_seqlens to them: offsets are clamped to [0, total],
    // a decreasing pair is an empty sequence, and a length above seqlen_q / seqlen_k (the
    // maxima) is cut to it. Bad offsets thus give unspecified values in the affected rows, never
    // an access outside the tensors (the Rust side checks them on request: a host copy).
    int64_t total_q, total_k;
    // Paged K/V (forward only; cf_bwd rejects it): NULL for contiguous k / v. Otherwise k and v
    // are caches of num_blocks pages of page_block_size rows, cu_seqlens_k is set and only its
    // differences are used (the length of sequence b's cache, <= seqlen_k; the offsets address
    // nothing), and key j of sequence b, KV head hk, is
    //   x + page*x_batch_stride + (j % page_block_size)*x_row_stride + hk*x_head_stride
    //   with page = block_table[b*block_table_batch_stride + j / page_block_size]
    // (x_batch_stride: the stride between pages). The table holds b rows of max_blocks entries,
    // int32 (a u32 table is passed as is: its values are read as uint32); entries past a
    // sequence's last page are never read. Its values are device data the host does not check
    // by default: an entry outside [0, num_blocks) (negative, or past the cache) reads page 0,
    // so a bad table gives unspecified values in the affected rows and never an access outside
    // the cache. Needs seqlen_k <= max_blocks * page_block_size (checked), so no lookup runs
    // past a table row; total_k = num_blocks * page_block_size.
    const int32_t* block_table;
    int64_t block_table_batch_stride;
    int32_t page_block_size, num_blocks, max_blocks;
    // CfDType of o: equal to dtype, except for e4m3 inputs (then CF_F16 or CF_BF16).
    int32_t o_dtype;
    // e4m3 inputs only (ignored otherwise): the descales of q, k and v (value = e4m3 * descale).
    // The descale of (sequence b, head x) is ptr[b*batch_stride + x / head_div], x the query head
    // for q and the KV head for k and v (FlashAttention-3's (B, Hkv) descales: batch_stride =
    // hkv, head_div = h / hkv for q and 1 for k, v); ptr NULL: 1.
    CfDescale q_descale, k_descale, v_descale;
    // Learnable attention sinks: NULL, or one f32 logit per query head (sinks[h], natural-log
    // units) that joins every row's softmax denominator and carries no value:
    //   o_i = sum_j e^{x_ij} v_j / (e^{sinks[h]} + sum_j e^{x_ij}),  lse_i = log(e^{sinks[h]} + sum_j e^{x_ij}).
    // A row that sees no key then gets o = 0 and lse = sinks[h]. The backward needs nothing else
    // (its P = e^{x - lse} and D = rowsum(dO * o) already account for the sink); see dsinks.
    const float* sinks;
    // mm_prefix_ranges (multimodal prefixes): NULL, or int32 [b][prefix_max_ranges][2] key
    // positions [start, end). Query i of sequence b at position pos = i + sk - sq also sees every
    // key of each range that holds pos (below sk), whatever the window. Device data the host does
    // not check: a range with start >= end selects nothing and what a range selects is cut to
    // [0, sk), so any values give defined rows and no access outside the tensors. Forward only.
    const int32_t* prefix_ranges;
    // Head dim of v, o (and dout, dv): 0 means d (MLA's value head dim of its own otherwise).
    // d <= 256 with dv == d and no prefix_ranges run on the tensor-core kernels; the f16 / bf16
    // forward of a wider head (d <= 576, dv <= 512) on the wide-head tensor-core kernel; the
    // rest (the backward of wider heads, dv != d up to 256, f32 past 256, prefix ranges) on the
    // SIMT kernels.
    int32_t dv;
    int32_t prefix_max_ranges;
    // Block-sparse attention (CfBlockMask above); block_mask.kv_num NULL: none.
    CfBlockMask block_mask;
} CfFwdParams;

typedef struct {
    CfFwdParams fwd;  // q, k, v, o and lse of the forward (read only here) and every option
    const void* dout;
    int64_t do_batch_stride, do_row_stride, do_head_stride;
    void* dq;
    void* dk;  // [.., hkv, d]: gradients summed over the query heads of each KV head
    void* dv;
    int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
    int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
    int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
    // Nonzero: the same inputs give the same bits every run (no order-dependent atomics).
    int32_t deterministic;
    // With fwd.sinks: NULL, or f32 [h] that receives the sinks' gradient
    //   dsinks[h] = -sum_{b, i} e^{sinks[h] - lse(b, h, i)} * rowsum(dout * o)(b, h, i)
    // (summed in a fixed order: deterministic). cf_sink_grad computes only this.
    float* dsinks;
} CfBwdParams;

// Scratch memory: the caller allocates it (from candle's allocator, on the same stream) and
// passes it in; no entry point allocates, frees or synchronises. Sizes are pure functions of
// the parameters and the current device (its SM count), so the size call and the launch agree.

// Forward: bytes of scratch memory cf_fwd needs for these parameters (0 for most shapes; the
// split-KV decode path keeps its partial outputs there, and the e4m3 forward V^T where its
// kernel does not transpose V itself: d > 128, or 4096 queries and keys and more).
size_t cf_fwd_workspace_size(const CfFwdParams* p);
// Forward: CF_OK when cf_fwd runs these parameters on the current device, else the status it
// would return without launching anything (e4m3 inputs need the sm_90a kernel: a Hopper GPU,
// head dims 16 .. 256 in multiples of 16, 16-byte aligned rows, no paged K/V; a caller that
// gets CF_ERR_UNSUPPORTED_DTYPE computes another way, e.g. on dequantized inputs).
int cf_fwd_check(const CfFwdParams* p);
// Forward: writes o and lse. `workspace` holds cf_fwd_workspace_size(p) bytes (NULL when 0),
// contents undefined on entry.
int cf_fwd(const CfFwdParams* p, void* workspace, cudaStream_t stream);

// Backward: bytes of scratch memory cf_bwd needs for these parameters (may be 0).
size_t cf_bwd_workspace_size(const CfBwdParams* p);
// Backward: writes dq, dk, dv (and dsinks when set). `workspace` holds cf_bwd_workspace_size(p)
// bytes, contents undefined on entry (cf_bwd clears what it needs on `stream`).
int cf_bwd(const CfBwdParams* p, void* workspace, cudaStream_t stream);

// The sinks' gradient alone (p->fwd.sinks and p->dsinks set; reads fwd.o, fwd.lse and dout; dq,
// dk, dv are not used and may be NULL): for autograd, where dsinks and dq/dk/dv are asked for by
// two graph nodes. Workspace: cf_sink_grad_workspace_size(p) bytes (rowsum(dout * o), f32).
size_t cf_sink_grad_workspace_size(const CfBwdParams* p);
int cf_sink_grad(const CfBwdParams* p, void* workspace, cudaStream_t stream);

// The Llama block's step between its projections and the attention, in one pass over T rows:
// the rotary embedding of q and k, and the write of the rotated k and of v into a paged cache
// (src/paged.rs: rope_write_paged_kv). Row t of q_in / k_in / v_in holds h / hkv / hkv heads of
// d values (head stride d, the row strides given; the three may be views of one fused
// projection). Row t is rotated with cos / sin row t (d/2 values each, in `dtype`): the pairs
// (x[i], x[i + d/2]) become (x[i] cos - x[i + d/2] sin, x[i] sin + x[i + d/2] cos), computed in
// f32 and rounded once. q_out (T, h, d) gets the rotated q; the caches (num_slots, hkv, d) get
// row t's rotated k and its v at slot slots[t], unless slots[t] >= num_slots (u32::MAX marks
// padding): then nothing is written for that row, so no slot value writes outside the caches.
typedef struct {
    const void* q_in;
    const void* k_in;
    const void* v_in;
    const void* cos;
    const void* sin;
    const uint32_t* slots;
    void* q_out;
    void* k_cache;
    void* v_cache;
    int64_t q_row_stride, k_row_stride, v_row_stride;
    int64_t num_slots;
    int32_t t, h, hkv, d;
    int32_t dtype;  // CfDType of everything but slots
} CfRopeKvParams;

int cf_rope_kv_write(const CfRopeKvParams* p, cudaStream_t stream);

// Residual add and RMSNorm in one pass (the Llama block's norms; src/fused.rs add_rms_norm):
// for each of `rows` rows of n values, sum = x + residual (rounded to dtype; residual NULL:
// sum = x), out = sum * rsqrt(mean(sum^2) + eps) * weight, the mean and the scaling in f32,
// rounded once. sum_out receives the sum (NULL when residual is NULL). All contiguous.
typedef struct {
    const void* x;
    const void* residual;
    const void* weight;
    void* sum_out;
    void* out;
    int64_t rows;
    int32_t n;
    float eps;
    int32_t dtype;
} CfAddRmsNormParams;

int cf_add_rms_norm(const CfAddRmsNormParams* p, cudaStream_t stream);

// SwiGLU's product (src/fused.rs silu_mul): out = silu(gate) * up over `rows` rows of n values,
// in f32, rounded once; gate and up rows at their strides (views of one fused [gate | up]
// product), out contiguous.
typedef struct {
    const void* gate;
    const void* up;
    void* out;
    int64_t gate_row_stride, up_row_stride;
    int64_t rows;
    int32_t n;
    int32_t dtype;
} CfSiluMulParams;

int cf_silu_mul(const CfSiluMulParams* p, cudaStream_t stream);

// Elementwise conversion of n contiguous values between e4m3 and f32 / f16 / bf16 (exactly one
// of src_dtype, dst_dtype is CF_E4M3; to e4m3: round to nearest even, saturated to +-448).
typedef struct {
    const void* src;
    void* dst;
    int64_t n;
    int32_t src_dtype, dst_dtype;
} CfConvertParams;

int cf_convert_e4m3(const CfConvertParams* p, cudaStream_t stream);

// Quantization of x [b][s][h][d] (contiguous f32 / f16 / bf16) to e4m3 in groups of (batch,
// block of block_rows rows, head): scale [b][nb][h], nb = max(1, ceil(s / block_rows)).
// mode CF_QUANT_FULL: each group's amax -> scale = amax * (1 / 448) (1 for an all-zero group),
//   then q = e4m3(x / scale) (round to nearest even, saturated to +-448);
// CF_QUANT_AMAX: only scale = each group's amax (q untouched; per-tensor scaling reduces them);
// CF_QUANT_APPLY: only q = e4m3(x / scale), with the scales given.
// Non-finite inputs: NaN is ignored by the amax and stays NaN in q.
enum CfQuantMode { CF_QUANT_FULL = 0, CF_QUANT_AMAX = 1, CF_QUANT_APPLY = 2 };
typedef struct {
    const void* x;
    void* q;
    float* scale;
    int64_t b, s, h, d, block_rows;
    int32_t dtype, mode;
} CfQuantizeParams;

int cf_quantize_e4m3(const CfQuantizeParams* p, cudaStream_t stream);

// The plan cf_fwd / cf_bwd would run for p (kernel family and configuration, head-dim tile,
// split, dQ mode, CTA orders, workspace bytes; "none" when there is nothing to compute), as one
// line of text into buf (cap bytes, NUL-terminated, cut to fit): which kernel a call runs, for
// tests and benchmarks. The same checks as cf_fwd / cf_bwd; nothing is launched (but the
// device's one-time probes and occupancy queries the plan reads).
int cf_fwd_describe(const CfFwdParams* p, char* buf, size_t cap);
int cf_bwd_describe(const CfBwdParams* p, char* buf, size_t cap);

// Text for any status returned above (static storage, never NULL).
const char* cf_error_string(int status);

#ifdef __cplusplus
}
#endif
