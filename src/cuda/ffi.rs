//! `#[repr(C)]` mirrors of `kernels/flash_api.h` (the one interface to our CUDA code) and the
//! declarations of its entry points. Change both files together.

use std::ffi::{c_char, c_int, c_void};

pub const CF_F32: i32 = 0;
pub const CF_F16: i32 = 1;
pub const CF_BF16: i32 = 2;
pub const CF_E4M3: i32 = 3;
/// `CfStatus::CF_ERR_UNSUPPORTED_DTYPE`: what `cf_fwd_check` answers when the FP8 kernel cannot
/// run a call (the caller then dequantizes).
pub const CF_ERR_UNSUPPORTED_DTYPE: i32 = -1;

/// `CfDescale`: the descales of one e4m3 input, `ptr[b * batch_stride + head / head_div]`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CfDescale {
    pub ptr: *const f32,
    pub batch_stride: i64,
    pub head_div: i32,
}

impl CfDescale {
    pub const NONE: Self = Self { ptr: std::ptr::null(), batch_stride: 0, head_div: 1 };
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CfFwdParams {
    pub q: *const c_void,
    pub k: *const c_void,
    pub v: *const c_void,
    pub o: *mut c_void,
    pub lse: *mut f32,
    pub alibi_slopes: *const f32,
    pub cu_seqlens_q: *const u32,
    pub cu_seqlens_k: *const u32,

    pub q_batch_stride: i64,
    pub q_row_stride: i64,
    pub q_head_stride: i64,
    pub k_batch_stride: i64,
    pub k_row_stride: i64,
    pub k_head_stride: i64,
    pub v_batch_stride: i64,
    pub v_row_stride: i64,
    pub v_head_stride: i64,
    pub o_batch_stride: i64,
    pub o_row_stride: i64,
    pub o_head_stride: i64,
    pub lse_batch_stride: i64,
    pub lse_head_stride: i64,

    pub b: i32,
    pub h: i32,
    pub hkv: i32,
    pub d: i32,
    pub seqlen_q: i32,
    pub seqlen_k: i32,
    pub alibi_batch_stride: i32,
    pub window_left: i32,
    pub window_right: i32,
    pub softmax_scale: f32,
    pub softcap: f32,
    pub dtype: i32,
    pub total_q: i64,
    pub total_k: i64,
    pub block_table: *const i32,
    pub block_table_batch_stride: i64,
    pub page_block_size: i32,
    pub num_blocks: i32,
    pub max_blocks: i32,
    pub o_dtype: i32,
    pub q_descale: CfDescale,
    pub k_descale: CfDescale,
    pub v_descale: CfDescale,
    /// f32 `[h]` sink logits, or null.
    pub sinks: *const f32,
    /// i32 `[b][prefix_max_ranges][2]` `mm_prefix_ranges`, or null.
    pub prefix_ranges: *const i32,
    /// The head dim of v, o, dout and dv (0: `d`).
    pub dv: i32,
    pub prefix_max_ranges: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CfBwdParams {
    pub fwd: CfFwdParams,
    pub dout: *const c_void,
    pub do_batch_stride: i64,
    pub do_row_stride: i64,
    pub do_head_stride: i64,
    pub dq: *mut c_void,
    pub dk: *mut c_void,
    pub dv: *mut c_void,
    pub dq_batch_stride: i64,
    pub dq_row_stride: i64,
    pub dq_head_stride: i64,
    pub dk_batch_stride: i64,
    pub dk_row_stride: i64,
    pub dk_head_stride: i64,
    pub dv_batch_stride: i64,
    pub dv_row_stride: i64,
    pub dv_head_stride: i64,
    pub deterministic: i32,
    /// f32 `[h]`: receives the sinks' gradient (with `fwd.sinks`), or null.
    pub dsinks: *mut f32,
}

// The sizes that flash_api.h's field order gives on LP64 (8-byte pointers and int64_t): a
// field added or dropped on one side only shows up here at compile time.
const _: () = assert!(std::mem::size_of::<CfFwdParams>() == 368);
const _: () = assert!(std::mem::size_of::<CfBwdParams>() == 512);

/// `CfRopeKvParams`: the fused rotary embedding and paged cache write.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CfRopeKvParams {
    pub q_in: *const c_void,
    pub k_in: *const c_void,
    pub v_in: *const c_void,
    pub cos: *const c_void,
    pub sin: *const c_void,
    pub slots: *const u32,
    pub q_out: *mut c_void,
    pub k_cache: *mut c_void,
    pub v_cache: *mut c_void,
    pub q_row_stride: i64,
    pub k_row_stride: i64,
    pub v_row_stride: i64,
    pub num_slots: i64,
    pub t: i32,
    pub h: i32,
    pub hkv: i32,
    pub d: i32,
    pub dtype: i32,
}

/// `CfAddRmsNormParams`: residual add and RMSNorm in one pass.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CfAddRmsNormParams {
    pub x: *const c_void,
    pub residual: *const c_void,
    pub weight: *const c_void,
    pub sum_out: *mut c_void,
    pub out: *mut c_void,
    pub rows: i64,
    pub n: i32,
    pub eps: f32,
    pub dtype: i32,
}

/// `CfSiluMulParams`: silu(gate) * up.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CfSiluMulParams {
    pub gate: *const c_void,
    pub up: *const c_void,
    pub out: *mut c_void,
    pub gate_row_stride: i64,
    pub up_row_stride: i64,
    pub rows: i64,
    pub n: i32,
    pub dtype: i32,
}

/// `CfConvertParams`: e4m3 <-> f32 / f16 / bf16, elementwise.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CfConvertParams {
    pub src: *const c_void,
    pub dst: *mut c_void,
    pub n: i64,
    pub src_dtype: i32,
    pub dst_dtype: i32,
}

/// `CfQuantizeParams` (`mode`: CF_QUANT_*): e4m3 quantization in (batch, row block, head) groups.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CfQuantizeParams {
    pub x: *const c_void,
    pub q: *mut c_void,
    pub scale: *mut f32,
    pub b: i64,
    pub s: i64,
    pub h: i64,
    pub d: i64,
    pub block_rows: i64,
    pub dtype: i32,
    pub mode: i32,
}
pub const CF_QUANT_FULL: i32 = 0;
pub const CF_QUANT_AMAX: i32 = 1;
pub const CF_QUANT_APPLY: i32 = 2;

extern "C" {
    pub fn cf_quantize_e4m3(p: *const CfQuantizeParams, stream: *mut c_void) -> c_int;
    pub fn cf_convert_e4m3(p: *const CfConvertParams, stream: *mut c_void) -> c_int;
    pub fn cf_add_rms_norm(p: *const CfAddRmsNormParams, stream: *mut c_void) -> c_int;
    pub fn cf_silu_mul(p: *const CfSiluMulParams, stream: *mut c_void) -> c_int;
    pub fn cf_rope_kv_write(p: *const CfRopeKvParams, stream: *mut c_void) -> c_int;
    pub fn cf_fwd_check(p: *const CfFwdParams) -> c_int;
    pub fn cf_fwd_workspace_size(p: *const CfFwdParams) -> usize;
    pub fn cf_fwd(p: *const CfFwdParams, workspace: *mut c_void, stream: *mut c_void) -> c_int;
    pub fn cf_bwd_workspace_size(p: *const CfBwdParams) -> usize;
    pub fn cf_bwd(p: *const CfBwdParams, workspace: *mut c_void, stream: *mut c_void) -> c_int;
    pub fn cf_sink_grad_workspace_size(p: *const CfBwdParams) -> usize;
    pub fn cf_sink_grad(p: *const CfBwdParams, workspace: *mut c_void, stream: *mut c_void) -> c_int;
    pub fn cf_error_string(status: c_int) -> *const c_char;
}
