//! `#[repr(C)]` mirrors of `kernels/flash_api.h` (the one interface to our CUDA code) and the
//! declarations of its entry points. Change both files together: the test at the end checks
//! every struct's fields, offsets and size against the header as C lays it out (it runs in the
//! lib's tests with the `cuda` feature); `bench/kernel_check.py` builds its ctypes mirrors from
//! the header itself.

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
    /// Block-sparse attention; `kv_num` null: none.
    pub block_mask: CfBlockMask,
}

/// `CfMaskOp`: the element rules of a block mask's partial blocks.
pub const CF_MASK_ALL: i32 = 0;
pub const CF_MASK_CAUSAL: i32 = 1;
pub const CF_MASK_WINDOW: i32 = 2;
pub const CF_MASK_SAME_DOCUMENT: i32 = 3;
pub const CF_MASK_PREFIX_LM: i32 = 4;
pub const CF_MASK_CHUNKED: i32 = 5;
pub const CF_MASK_GLOBAL_TOKENS: i32 = 6;
/// `CF_MASK_MAX_NODES`.
pub const CF_MASK_MAX_NODES: usize = 16;

/// `CfMaskNode`: one rule of an AND term of the element rule (an OR of such terms).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CfMaskNode {
    pub op: i32,
    pub a: i32,
    pub b: i32,
    pub last_in_term: i32,
    pub q_data: *const u32,
    pub k_data: *const u32,
    pub q_batch_stride: i64,
    pub k_batch_stride: i64,
}

impl CfMaskNode {
    pub const NONE: Self = Self {
        op: CF_MASK_ALL,
        a: 0,
        b: 0,
        last_in_term: 0,
        q_data: std::ptr::null(),
        k_data: std::ptr::null(),
        q_batch_stride: 0,
        k_batch_stride: 0,
    };
}

/// `CfBlockMask`: the lists of a [`crate::BlockMask`] and its element rule.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CfBlockMask {
    pub kv_num: *const i32,
    pub kv_idx: *const i32,
    pub full_kv_num: *const i32,
    pub full_kv_idx: *const i32,
    pub q_num: *const i32,
    pub q_idx: *const i32,
    pub full_q_num: *const i32,
    pub full_q_idx: *const i32,
    pub batch: i32,
    pub heads: i32,
    pub q_blocks: i32,
    pub k_blocks: i32,
    pub n_nodes: i32,
    pub pad_: i32,
    pub nodes: [CfMaskNode; CF_MASK_MAX_NODES],
}

impl CfBlockMask {
    pub const NONE: Self = Self {
        kv_num: std::ptr::null(),
        kv_idx: std::ptr::null(),
        full_kv_num: std::ptr::null(),
        full_kv_idx: std::ptr::null(),
        q_num: std::ptr::null(),
        q_idx: std::ptr::null(),
        full_q_num: std::ptr::null(),
        full_q_idx: std::ptr::null(),
        batch: 0,
        heads: 0,
        q_blocks: 0,
        k_blocks: 0,
        n_nodes: 0,
        pad_: 0,
        nodes: [CfMaskNode::NONE; CF_MASK_MAX_NODES],
    };
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
const _: () = assert!(std::mem::size_of::<CfFwdParams>() == 1224);
const _: () = assert!(std::mem::size_of::<CfBwdParams>() == 1368);

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
    pub fn cf_fwd_describe(p: *const CfFwdParams, buf: *mut c_char, cap: usize) -> c_int;
    pub fn cf_bwd_describe(p: *const CfBwdParams, buf: *mut c_char, cap: usize) -> c_int;
    pub fn cf_sink_grad_workspace_size(p: *const CfBwdParams) -> usize;
    pub fn cf_sink_grad(p: *const CfBwdParams, workspace: *mut c_void, stream: *mut c_void) -> c_int;
    pub fn cf_error_string(status: c_int) -> *const c_char;
}

/// The mirrors against `flash_api.h` itself: every struct's field names in order, their offsets
/// and the struct's size, as C lays the header's declarations out (LP64, natural alignment).
#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const HEADER: &str = include_str!("../../kernels/flash_api.h");

    /// Field (name, offset) list, size and alignment of a C struct.
    struct CLayout {
        fields: Vec<(String, usize)>,
        size: usize,
        align: usize,
    }

    /// The header without `//` and `/* */` comments.
    fn strip_comments(text: &str) -> String {
        let mut out = String::new();
        let mut rest = text;
        while let Some(i) = rest.find('/') {
            out.push_str(&rest[..i]);
            let tail = &rest[i..];
            rest = if tail.starts_with("//") {
                tail.find('\n').map_or("", |e| &tail[e..])
            } else if tail.starts_with("/*") {
                tail.find("*/").map_or("", |e| &tail[e + 2..])
            } else {
                out.push('/');
                &tail[1..]
            };
        }
        out.push_str(rest);
        out
    }

    /// Every `typedef struct { ... } Name;` of the header, laid out in order of appearance (a
    /// struct may hold an earlier one).
    fn c_layouts() -> HashMap<String, CLayout> {
        let text = strip_comments(HEADER);
        let mut layouts: HashMap<String, CLayout> = HashMap::new();
        let mut rest = text.as_str();
        while let Some(start) = rest.find("typedef struct {") {
            let body_start = start + "typedef struct {".len();
            let end = body_start + rest[body_start..].find('}').expect("closing brace");
            let semi = end + rest[end..].find(';').expect("struct name");
            let name = rest[end + 1..semi].trim().to_string();
            let (mut offset, mut align, mut fields) = (0usize, 1usize, vec![]);
            for decl in rest[body_start..end].split(';').map(|d| d.split_whitespace().collect::<Vec<_>>().join(" ")) {
                if decl.is_empty() {
                    continue;
                }
                let mut parts = decl.split(',').map(str::trim);
                let first = parts.next().expect("a declaration");
                let cut = first.rfind([' ', '*']).expect("a type and a name");
                let ty = first[..=cut].trim();
                let (size, a) = if ty.contains('*') {
                    (8, 8)
                } else {
                    match ty.trim_start_matches("const ") {
                        "int64_t" | "uint64_t" | "size_t" => (8, 8),
                        "int32_t" | "uint32_t" | "int" | "float" => (4, 4),
                        other => {
                            let l = layouts.get(other).unwrap_or_else(|| panic!("{name}: unknown type {other:?}"));
                            (l.size, l.align)
                        }
                    }
                };
                for field in std::iter::once(first[cut + 1..].trim()).chain(parts) {
                    // a fixed-size array `name[n]`
                    let (field, count) = match field.split_once('[') {
                        Some((f, n)) => (f, n.trim_end_matches(']').parse::<usize>().expect("an array length")),
                        None => (field, 1),
                    };
                    offset = offset.div_ceil(a) * a;
                    fields.push((field.to_string(), offset));
                    offset += size * count;
                    align = align.max(a);
                }
            }
            let size = offset.div_ceil(align) * align;
            layouts.insert(name, CLayout { fields, size, align });
            rest = &rest[semi..];
        }
        layouts
    }

    macro_rules! assert_mirrors {
        ($layouts:expr, $ty:ident { $($field:ident),* $(,)? }) => {{
            let c = $layouts.get(stringify!($ty)).expect(concat!(stringify!($ty), " is not in flash_api.h"));
            let rust: Vec<(String, usize)> =
                vec![$((stringify!($field).to_string(), std::mem::offset_of!($ty, $field))),*];
            assert_eq!(rust, c.fields, concat!(stringify!($ty), ": fields or offsets differ from flash_api.h"));
            assert_eq!(std::mem::size_of::<$ty>(), c.size, concat!(stringify!($ty), ": size differs from flash_api.h"));
        }};
    }

    #[test]
    fn mirrors_match_the_header_field_by_field() {
        let layouts = c_layouts();
        assert_eq!(layouts.len(), 10, "a struct was added to flash_api.h: mirror it here and below");
        assert_mirrors!(layouts, CfDescale { ptr, batch_stride, head_div });
        assert_mirrors!(
            layouts,
            CfFwdParams {
                q,
                k,
                v,
                o,
                lse,
                alibi_slopes,
                cu_seqlens_q,
                cu_seqlens_k,
                q_batch_stride,
                q_row_stride,
                q_head_stride,
                k_batch_stride,
                k_row_stride,
                k_head_stride,
                v_batch_stride,
                v_row_stride,
                v_head_stride,
                o_batch_stride,
                o_row_stride,
                o_head_stride,
                lse_batch_stride,
                lse_head_stride,
                b,
                h,
                hkv,
                d,
                seqlen_q,
                seqlen_k,
                alibi_batch_stride,
                window_left,
                window_right,
                softmax_scale,
                softcap,
                dtype,
                total_q,
                total_k,
                block_table,
                block_table_batch_stride,
                page_block_size,
                num_blocks,
                max_blocks,
                o_dtype,
                q_descale,
                k_descale,
                v_descale,
                sinks,
                prefix_ranges,
                dv,
                prefix_max_ranges,
                block_mask
            }
        );
        assert_mirrors!(layouts, CfMaskNode { op, a, b, last_in_term, q_data, k_data, q_batch_stride, k_batch_stride });
        assert_mirrors!(
            layouts,
            CfBlockMask {
                kv_num,
                kv_idx,
                full_kv_num,
                full_kv_idx,
                q_num,
                q_idx,
                full_q_num,
                full_q_idx,
                batch,
                heads,
                q_blocks,
                k_blocks,
                n_nodes,
                pad_,
                nodes
            }
        );
        assert_mirrors!(
            layouts,
            CfBwdParams {
                fwd,
                dout,
                do_batch_stride,
                do_row_stride,
                do_head_stride,
                dq,
                dk,
                dv,
                dq_batch_stride,
                dq_row_stride,
                dq_head_stride,
                dk_batch_stride,
                dk_row_stride,
                dk_head_stride,
                dv_batch_stride,
                dv_row_stride,
                dv_head_stride,
                deterministic,
                dsinks
            }
        );
        assert_mirrors!(
            layouts,
            CfRopeKvParams {
                q_in,
                k_in,
                v_in,
                cos,
                sin,
                slots,
                q_out,
                k_cache,
                v_cache,
                q_row_stride,
                k_row_stride,
                v_row_stride,
                num_slots,
                t,
                h,
                hkv,
                d,
                dtype
            }
        );
        assert_mirrors!(layouts, CfAddRmsNormParams { x, residual, weight, sum_out, out, rows, n, eps, dtype });
        assert_mirrors!(layouts, CfSiluMulParams { gate, up, out, gate_row_stride, up_row_stride, rows, n, dtype });
        assert_mirrors!(layouts, CfConvertParams { src, dst, n, src_dtype, dst_dtype });
        assert_mirrors!(layouts, CfQuantizeParams { x, q, scale, b, s, h, d, block_rows, dtype, mode });
    }
}
