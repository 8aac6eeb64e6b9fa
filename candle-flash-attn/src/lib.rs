//! # candle-flash-attn (candle-flash)
//!
//! candle-flash's FlashAttention (the root crate of this repository) under the name and the API
//! of candle-flash-attn 0.11.1: the same eleven public functions with the same signatures,
//! computed by candle-flash (its CUDA kernels with the `cuda` feature, on by default, and its
//! tiled CPU path on `Device::Cpu`). A crate that calls `candle_flash_attn::flash_attn` (all of
//! candle-transformers' models with the `flash-attn` feature) uses candle-flash once the
//! application's Cargo.toml says:
//!
//! ```toml
//! [patch.crates-io]
//! candle-flash-attn = { path = "path/to/candle-flash/candle-flash-attn" }
//! ```
//!
//! Differences from candle-flash-attn 0.11.1:
//!
//! - head dims up to 576 (candle-flash-attn: up to 512; on CUDA multiples of 8 as there, past
//!   256 on candle-flash's SIMT kernels, exact but slower than its tensor-core ones); a larger
//!   one is a `candle_core::Error` naming it.
//! - CPU tensors work too (candle-flash-attn needs CUDA tensors).
//! - the structs `FlashAttn` and `FlashAttnVarLen` (the `CustomOp3` values behind the functions)
//!   are not provided; call the functions. candle-transformers uses only [`flash_attn`].
//! - the `cudnn` feature is accepted and does nothing.
//!
//! The softcap argument keeps candle-flash-attn's meaning: `softcap <= 0.0` (or `Some(0.0)`)
//! turns it off. Windows wider than the (maximum) key length are unbounded, as there. Every
//! other argument and layout is candle-flash-attn's; see candle-flash's documentation of each
//! function for the details (GQA/MQA, bottom-right aligned causal masks, varlen offsets).

use candle_core::{Result, Tensor};

pub use candle_flash::{
    flash_attn, flash_attn_alibi, flash_attn_alibi_windowed, flash_attn_varlen, flash_attn_varlen_alibi,
    flash_attn_varlen_alibi_windowed, flash_attn_varlen_windowed, flash_attn_windowed,
};

/// candle-flash-attn's softcap: on only for `c > 0`.
fn softcap_on(softcap: f32) -> Option<f32> {
    (softcap > 0.0).then_some(softcap)
}

/// Flash attention with optional ALiBi, a sliding window and a softcap: the logit s becomes
/// `softcap·tanh(s/softcap)` before the softmax when `softcap > 0`; `softcap <= 0` is no
/// softcap (candle-flash-attn's meaning). q `(B, Sq, H, D)`, k/v `(B, Sk, Hkv, D)`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    match (softcap_on(softcap), alibi_slopes) {
        (Some(c), _) => candle_flash::flash_attn_alibi_windowed_softcap(
            q,
            k,
            v,
            alibi_slopes,
            softmax_scale,
            window_size_left,
            window_size_right,
            c,
        ),
        (None, Some(slopes)) => {
            candle_flash::flash_attn_alibi_windowed(q, k, v, slopes, softmax_scale, window_size_left, window_size_right)
        }
        (None, None) => candle_flash::flash_attn_windowed(q, k, v, softmax_scale, window_size_left, window_size_right),
    }
}

/// Varlen flash attention with optional ALiBi, a sliding window and a softcap (`softcap <= 0`
/// is no softcap). q `(total_q, H, D)`, k/v `(total_k, Hkv, D)`, seqlens cumulative u32 `[B+1]`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    match (softcap_on(softcap), alibi_slopes) {
        (Some(c), _) => candle_flash::flash_attn_varlen_alibi_windowed_softcap(
            q,
            k,
            v,
            alibi_slopes,
            seqlens_q,
            seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            window_size_left,
            window_size_right,
            c,
        ),
        (None, Some(slopes)) => candle_flash::flash_attn_varlen_alibi_windowed(
            q,
            k,
            v,
            slopes,
            seqlens_q,
            seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            window_size_left,
            window_size_right,
        ),
        (None, None) => candle_flash::flash_attn_varlen_windowed(
            q,
            k,
            v,
            seqlens_q,
            seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale,
            window_size_left,
            window_size_right,
        ),
    }
}

/// Varlen flash attention over a paged K/V cache: q `(total_q, H, D)`, k/v
/// `(num_blocks, page_block_size, Hkv, D)`, `block_table` `(B, max_blocks)`, `seqlens_k` the
/// cumulative cache lengths, optional i32 `mm_prefix_ranges` `(B, max_ranges, 2)` (CPU only in
/// candle-flash). `softcap`: `None`, or `Some(c)` with `c <= 0`, is no softcap. Forward only.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_paged_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    block_table: &Tensor,
    mm_prefix_ranges: Option<&Tensor>,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    page_block_size: usize,
    softcap: Option<f32>,
) -> Result<Tensor> {
    candle_flash::flash_attn_varlen_paged_windowed(
        q,
        k,
        v,
        seqlens_q,
        seqlens_k,
        block_table,
        mm_prefix_ranges,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        window_size_left,
        window_size_right,
        page_block_size,
        softcap.and_then(softcap_on),
    )
}
