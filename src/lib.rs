//! # candle-flash
//!
//! Exact, IO-aware FlashAttention for [Candle](https://github.com/huggingface/candle): forward
//! **and backward**, as a candle `CustomOp3`, on CUDA (feature `cuda`) and on the CPU (a tiled
//! implementation of the same algorithm), with the call signatures of `candle-flash-attn`.
//!
//! Layouts: q `(B, Sq, H, D)`, k and v `(B, Sk, Hkv, D)`, output `(B, Sq, H, D)`. Varlen: q
//! `(total_q, H, D)`, k/v `(total_k, Hkv, D)` and cumulative u32 seqlens of length B+1.
//! `H % Hkv == 0` (GQA/MQA without repeating K/V). Causal masks are aligned bottom-right when
//! Sq ≠ Sk: query i sees key j iff `j <= i + Sk - Sq`. A row that sees no key gives 0 (and an
//! LSE of -inf), never NaN. dtypes f32, f16, bf16 (f32 accumulation); head dims up to 576 (on
//! CUDA multiples of 8; past [`MAX_CUDA_TENSOR_CORE_HEAD_DIM`] on the SIMT kernels: see
//! [`MAX_HEAD_DIM`], [`MAX_CUDA_HEAD_DIM`]); v may have a head dim of its own (MLA: out and dv
//! then have v's). Learnable sinks: [`FlashAttnOptions::sinks`].
//!
//! Bad arguments are a `candle_core::Error`. The values of the varlen offsets and ALiBi slopes
//! are checked on the CPU always, on CUDA only with [`FlashAttnOptions::check_device_data()`] or
//! [`CHECK_DEVICE_DATA_ENV`]`=1` (reading them would synchronise the stream on every call); bad
//! unchecked offsets give unspecified values in the affected rows, never an out-of-bounds access.
//!
//! Paged K/V caches (serving): [`flash_attn_varlen_paged_windowed`] (candle-flash-attn's
//! signature) or [`FlashAttnOptions::paged`], and [`write_paged_kv`] to append rows to the
//! pages; forward only, CPU and CUDA (`mm_prefix_ranges` too). [`compat::v3`] has
//! candle-flash-attn-v3's signatures.
//!
//! FP8 (e4m3) inputs: [`fp8`] (quantization with per-tensor, per-head or per-block scales, a
//! Hadamard rotation of q and k, and attention on the quantized tensors; forward only).
//!
//! Block-sparse attention: [`FlashAttnOptions::block_mask`] with a [`BlockMask`] (PyTorch
//! FlexAttention's layout, built from [`MaskSpec`] rules or a model's top-k key blocks); forward
//! and backward on the CPU and on the Hopper (sm_90a) kernels, f16 / bf16 ([`block_mask`]).
//!
//! `Tensor::backward()` through any of these functions gives dq, dk, dv; see [`op`] for how
//! the backward reaches the forward's log-sum-exp without recomputing the forward.
//!
//! ```
//! use candle_core::{Device, Tensor, DType};
//! let dev = Device::Cpu;
//! let q = Tensor::randn(0f32, 1., (1, 16, 4, 64), &dev)?;
//! let k = Tensor::randn(0f32, 1., (1, 16, 2, 64), &dev)?;
//! let v = Tensor::randn(0f32, 1., (1, 16, 2, 64), &dev)?;
//! let out = candle_flash::flash_attn(&q, &k, &v, 0.125, true)?;
//! assert_eq!(out.dims(), &[1, 16, 4, 64]);
//! # Ok::<(), candle_core::Error>(())
//! ```

pub mod block_mask;
pub mod compat;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod fp8;
pub mod fused;
mod inputs;
pub mod op;
pub mod paged;
pub mod params;
pub mod reference;
pub mod serving_params;

pub use block_mask::{BlockMask, MaskEval, MaskSpec};
pub use paged::{rope_write_paged_kv, write_paged_kv};
pub use params::{
    FlashAttnOptions, PagedKv, VarLen, CHECK_DEVICE_DATA_ENV, MAX_CUDA_GRID_YZ, MAX_CUDA_HEAD_DIM, MAX_CUDA_SEQLEN_SUM,
    MAX_CUDA_TENSOR_CORE_HEAD_DIM, MAX_HEAD_DIM,
};

use candle_core::{Result, Tensor};
pub use op::{AttnGrads, KernelPlans};
use op::{FlashAttnOp, LseSlot, SinkGradOp};
use std::sync::Arc;

/// `Device::new_cuda(ordinal)` with the device's memory pool set to cache freed memory (see
/// [`cuda::enable_allocation_caching`]); without the `cuda` feature, candle's error.
pub fn new_cuda_device(ordinal: usize) -> Result<candle_core::Device> {
    let device = candle_core::Device::new_cuda(ordinal)?;
    #[cfg(feature = "cuda")]
    cuda::enable_allocation_caching(device.as_cuda_device()?)?;
    Ok(device)
}

/// Attention with every option in `opts`: the function all the `flash_attn*` variants call.
pub fn flash_attn_with_options(q: &Tensor, k: &Tensor, v: &Tensor, opts: &FlashAttnOptions) -> Result<Tensor> {
    Ok(flash_attn_with_lse(q, k, v, opts)?.0)
}

/// Attention and its log-sum-exp (natural log, f32, `(B, H, Sq)`; `(H, total_q)` for varlen).
/// The output is differentiable; the LSE is a plain tensor (no gradient).
pub fn flash_attn_with_lse(q: &Tensor, k: &Tensor, v: &Tensor, opts: &FlashAttnOptions) -> Result<(Tensor, Tensor)> {
    let shape = params::validate(q, k, v, opts)?;
    if pads_value_head_dim(q, &shape, opts) {
        let d = shape.head_dim.max(shape.head_dim_v);
        let (out, lse) = flash_attn_with_lse(&pad_head_dim(q, d)?, &pad_head_dim(k, d)?, &pad_head_dim(v, d)?, opts)?;
        return Ok((out.narrow(out.rank() - 1, 0, shape.head_dim_v)?, lse));
    }
    let (q, k, v) = (aligned(q)?, aligned(k)?, aligned(v)?);
    let lse = LseSlot::default();
    let op = FlashAttnOp { opts: opts.clone(), shape: shape.clone(), lse: lse.clone(), forward_only: None, fp8: None };
    let out = q.apply_op3_arc(&k, &v, Arc::new(Box::new(op)))?;
    let out = match &opts.sinks {
        // Sinks that track gradients: the output passes through the node that gives theirs.
        Some(sinks) if sinks.track_op() => {
            let node = SinkGradOp { shape, opts: opts.clone(), q, k, v, lse: lse.clone() };
            out.apply_op2_arc(sinks, Arc::new(Box::new(node)))?
        }
        _ => out,
    };
    Ok((out, lse.get()?))
}

/// The CUDA kernels a call runs, as the kernels' plan layer chose them ([`KernelPlans`]): for
/// tests that assert which kernel a case runs, and for benchmarks. The call's forward runs (the
/// backward's plan reads its output and LSE, and the output stands in for the output's
/// gradient); no backward runs. The inputs go through what [`flash_attn_with_options`] does to
/// them first (the zero-padded value head dim, aligned copies). An error off CUDA.
pub fn describe_kernel_plans(q: &Tensor, k: &Tensor, v: &Tensor, opts: &FlashAttnOptions) -> Result<KernelPlans> {
    let shape = params::validate(q, k, v, opts)?;
    if pads_value_head_dim(q, &shape, opts) {
        let d = shape.head_dim.max(shape.head_dim_v);
        return describe_kernel_plans(&pad_head_dim(q, d)?, &pad_head_dim(k, d)?, &pad_head_dim(v, d)?, opts);
    }
    let (q, k, v) = (aligned(q)?, aligned(k)?, aligned(v)?);
    let (out, lse) = flash_attn_with_lse(&q, &k, &v, opts)?;
    op::describe_plans(&shape, opts, op::BwdInputs { q: &q, k: &k, v: &v, out: &out, grad_out: &out, lse: &lse })
}

/// Whether a call with a value head dim of its own (Dv ≠ Dqk, MLA) runs the kernels of one head
/// dim, the wider of the two, on zero-padded copies ([`pad_head_dim`]): the CPU kernels, and on
/// CUDA the tensor-core kernels (both head dims up to [`MAX_CUDA_TENSOR_CORE_HEAD_DIM`],
/// contiguous K/V), for which the padded copies cost less than the SIMT kernels' CUDA-core
/// arithmetic. Wider heads and paged caches (whose padded copy would be the whole cache) run the
/// CUDA SIMT kernels, which read v with its own head dim.
/// `CANDLE_FLASH_PAD_VALUE_HEAD_DIM=0` turns the padding off on CUDA (every such call on the SIMT
/// kernels), to compare the two and to test the SIMT kernels' narrow shape.
fn pads_value_head_dim(q: &Tensor, shape: &params::AttnShape, opts: &FlashAttnOptions) -> bool {
    static PAD_ON_CUDA: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let pad_on_cuda =
        *PAD_ON_CUDA.get_or_init(|| std::env::var("CANDLE_FLASH_PAD_VALUE_HEAD_DIM").as_deref() != Ok("0"));
    let wide = shape.head_dim.max(shape.head_dim_v) > MAX_CUDA_TENSOR_CORE_HEAD_DIM;
    let simt = q.device().is_cuda() && (wide || opts.paged.is_some() || !pad_on_cuda);
    shape.head_dim != shape.head_dim_v && !simt
}

/// `t` with zero columns appended to head dim `d`: zero columns add nothing to q·k and give zero
/// output columns (and zero gradients), so narrowing the results back is exact. The cost is the
/// padded copies and the padded columns' products.
fn pad_head_dim(t: &Tensor, d: usize) -> Result<Tensor> {
    let last = t.rank() - 1;
    match d - t.dim(last)? {
        0 => Ok(t.clone()),
        extra => t.pad_with_zeros(last, 0, extra),
    }
}

/// The GPU kernels load 16 bytes at a time, so on CUDA every row/head/batch stride and the
/// start offset must be a multiple of 8 elements; rarer layouts are copied (with autograd
/// routing gradients back through the copy).
fn aligned(t: &Tensor) -> Result<Tensor> {
    let (storage, layout) = t.storage_and_layout();
    let misaligned = !matches!(&*storage, candle_core::Storage::Cpu(_))
        && (layout.start_offset() % 8 != 0 || layout.stride().iter().rev().skip(1).any(|s| s % 8 != 0));
    drop(storage);
    if misaligned {
        t.force_contiguous()
    } else {
        Ok(t.clone())
    }
}

/// Explicit backward for callers with their own autograd: `(dq, dk, dv)` from the forward's
/// inputs, output, output gradient and LSE (as returned by [`flash_attn_with_lse`]).
/// dk and dv are summed over the query heads that share each KV head. With sinks, see
/// [`flash_attn_grads`] for their gradient too.
pub fn flash_attn_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
    opts: &FlashAttnOptions,
) -> Result<(Tensor, Tensor, Tensor)> {
    let g = flash_attn_grads(q, k, v, out, grad_out, lse, opts)?;
    Ok((g.dq, g.dk, g.dv))
}

/// [`flash_attn_backward`] that also returns the sinks' gradient (`dsinks`, f32 `[H]`, when
/// `opts.sinks` is set): `dsinks_h = -Σ_i e^{s_h - lse_i} · rowsum(dO ∘ O)_i`.
pub fn flash_attn_grads(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
    opts: &FlashAttnOptions,
) -> Result<AttnGrads> {
    let shape = params::validate(q, k, v, opts)?;
    if pads_value_head_dim(q, &shape, opts) {
        // As the forward: zero-padded to the wider head dim, the gradients narrowed back.
        params::validate_backward(&shape, opts, &op::BwdInputs { q, k, v, out, grad_out, lse })?;
        let d = shape.head_dim.max(shape.head_dim_v);
        let [q, k, v, out, grad_out] = [q, k, v, out, grad_out].map(|t| pad_head_dim(t, d));
        let g = flash_attn_grads(&q?, &k?, &v?, &out?, &grad_out?, lse, opts)?;
        let narrow = |t: Tensor, n: usize| t.narrow(t.rank() - 1, 0, n);
        let (dqk, dv) = (shape.head_dim, shape.head_dim_v);
        return Ok(AttnGrads {
            dq: narrow(g.dq, dqk)?,
            dk: narrow(g.dk, dqk)?,
            dv: narrow(g.dv, dv)?,
            dsinks: g.dsinks,
        });
    }
    op::backward(&shape, opts, op::BwdInputs { q, k, v, out, grad_out, lse }, true)
}

/// Flash attention. q `(B, Sq, H, D)`, k/v `(B, Sk, Hkv, D)` → `(B, Sq, H, D)`.
pub fn flash_attn(q: &Tensor, k: &Tensor, v: &Tensor, softmax_scale: f32, causal: bool) -> Result<Tensor> {
    flash_attn_with_options(q, k, v, &FlashAttnOptions::new(softmax_scale).causal(causal))
}

/// A window of a candle-flash-attn-compatible function: as there, a window wider than the
/// (maximum) key length is unbounded. (`FlashAttnOptions::window` keeps every window as given;
/// the two differ only when Sq > Sk and the right window exceeds Sk.)
fn compat_window(w: Option<usize>, seqlen_k: usize) -> Option<usize> {
    w.filter(|&w| w <= seqlen_k)
}

/// Key length of a batched k `(B, Sk, Hkv, D)` for [`compat_window`] (a wrong rank is reported
/// by the validation).
fn batched_seqlen_k(k: &Tensor) -> usize {
    k.dims().get(1).copied().unwrap_or(usize::MAX)
}

/// Flash attention with a sliding window: key j is visible to query i iff
/// `i + Sk - Sq - left <= j <= i + Sk - Sq + right` (`None` = unbounded on that side; as in
/// candle-flash-attn, a window wider than Sk is unbounded too).
pub fn flash_attn_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let sk = batched_seqlen_k(k);
    let opts = FlashAttnOptions::new(softmax_scale)
        .window(compat_window(window_size_left, sk), compat_window(window_size_right, sk));
    flash_attn_with_options(q, k, v, &opts)
}

/// Flash attention with ALiBi (`alibi_slopes`: f32 `[H]` or `[B, H]`).
pub fn flash_attn_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let opts = FlashAttnOptions::new(softmax_scale).causal(causal).alibi(Some(alibi_slopes));
    flash_attn_with_options(q, k, v, &opts)
}

/// Flash attention with ALiBi and a sliding window.
pub fn flash_attn_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let sk = batched_seqlen_k(k);
    let opts = FlashAttnOptions::new(softmax_scale)
        .window(compat_window(window_size_left, sk), compat_window(window_size_right, sk))
        .alibi(Some(alibi_slopes));
    flash_attn_with_options(q, k, v, &opts)
}

/// Flash attention with optional ALiBi, a sliding window and a softcap `c > 0` (the logit s
/// becomes `c·tanh(s/c)`). Unlike candle-flash-attn, `softcap <= 0` is an error, not "off".
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
    let sk = batched_seqlen_k(k);
    let opts = FlashAttnOptions::new(softmax_scale)
        .window(compat_window(window_size_left, sk), compat_window(window_size_right, sk))
        .alibi(alibi_slopes)
        .softcap(Some(softcap));
    flash_attn_with_options(q, k, v, &opts)
}

fn varlen(seqlens_q: &Tensor, seqlens_k: &Tensor, max_seqlen_q: usize, max_seqlen_k: usize) -> Option<VarLen> {
    Some(VarLen { seqlens_q: seqlens_q.clone(), seqlens_k: seqlens_k.clone(), max_seqlen_q, max_seqlen_k })
}

/// Varlen flash attention: q `(total_q, H, D)`, k/v `(total_k, Hkv, D)`, seqlens cumulative
/// u32 `[B+1]` starting at 0 and ending at the totals (values checked on CUDA only on request:
/// see [`FlashAttnOptions::check_device_data()`]).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let opts = FlashAttnOptions::new(softmax_scale).causal(causal).varlen(varlen(
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
    ));
    flash_attn_with_options(q, k, v, &opts)
}

/// Varlen flash attention with a sliding window.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let opts = FlashAttnOptions::new(softmax_scale)
        .window(compat_window(window_size_left, max_seqlen_k), compat_window(window_size_right, max_seqlen_k))
        .varlen(varlen(seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k));
    flash_attn_with_options(q, k, v, &opts)
}

/// Varlen flash attention with ALiBi.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let opts = FlashAttnOptions::new(softmax_scale).causal(causal).alibi(Some(alibi_slopes)).varlen(varlen(
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
    ));
    flash_attn_with_options(q, k, v, &opts)
}

/// Varlen flash attention with ALiBi and a sliding window.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let opts = FlashAttnOptions::new(softmax_scale)
        .window(compat_window(window_size_left, max_seqlen_k), compat_window(window_size_right, max_seqlen_k))
        .alibi(Some(alibi_slopes))
        .varlen(varlen(seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k));
    flash_attn_with_options(q, k, v, &opts)
}

/// Varlen flash attention with optional ALiBi, a sliding window and a softcap `c > 0`.
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
    let opts = FlashAttnOptions::new(softmax_scale)
        .window(compat_window(window_size_left, max_seqlen_k), compat_window(window_size_right, max_seqlen_k))
        .alibi(alibi_slopes)
        .softcap(Some(softcap))
        .varlen(varlen(seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k));
    flash_attn_with_options(q, k, v, &opts)
}

/// Varlen flash attention over a paged K/V cache, candle-flash-attn 0.11.1's signature and
/// semantics. q `(total_q, H, D)`; k/v `(num_blocks, page_block_size, Hkv, D)` pages; key j of
/// sequence b is row `j % page_block_size` of page `block_table[b][j / page_block_size]`
/// (`block_table` `(B, max_blocks)` u32 or i32); `seqlens_q`/`seqlens_k` cumulative u32 `[B+1]`,
/// where `seqlens_k` only gives each sequence's cache length. `mm_prefix_ranges`: i32
/// `(B, max_ranges, 2)` key-position ranges that attend to themselves bidirectionally whatever
/// the causal/window mask ([`FlashAttnOptions::mm_prefix_ranges`]). As in candle-flash-attn, a
/// window wider than `max_seqlen_k` is unbounded. `softcap`: `Some(c)`, c > 0 (unlike
/// candle-flash-attn, `Some(0.0)` is an error, not "off": pass `None`).
///
/// Forward only (a backward through it is an error). Any page size >= 1 on the CPU and on CUDA;
/// on CUDA the table's values are not read on the host unless asked
/// ([`FlashAttnOptions::check_device_data()`]: an entry outside the cache then reads page 0),
/// and neither are `mm_prefix_ranges`' (the kernel cuts each range to the keys). The options form is [`FlashAttnOptions::paged`];
/// [`write_paged_kv`] appends rows to the pages.
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
    let opts = FlashAttnOptions::new(softmax_scale)
        .window(compat_window(window_size_left, max_seqlen_k), compat_window(window_size_right, max_seqlen_k))
        .softcap(softcap)
        .varlen(varlen(seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k))
        .paged(Some(PagedKv::new(block_table, page_block_size)))
        .mm_prefix_ranges(mm_prefix_ranges);
    flash_attn_with_options(q, k, v, &opts)
}
