//! FP8 (e4m3) attention: quantize, rotate, attend.
//!
//! * [`quantize_e4m3`] turns an f32 / f16 / bf16 tensor into [`Fp8Tensor`]: `DType::F8E4M3`
//!   data and f32 descales, one per tensor, per (batch, head) or per block of rows of each
//!   (batch, head) ([`Fp8Scaling`]); value ≈ data · descale.
//! * [`hadamard_rotate`] multiplies the last dimension by an orthonormal (block) Hadamard
//!   matrix. Rotating q and k by the same matrix leaves q·kᵀ unchanged and spreads a few
//!   outlier channels over all of them, so they quantize with a smaller error (FlashAttention-3's
//!   "incoherent processing"); v is not rotated.
//! * [`flash_attn_fp8`] ([`Fp8Tensor`] inputs, any scaling) and [`flash_attn_fp8_descaled`]
//!   (FlashAttention-3's convention: e4m3 q, k, v and `(B, Hkv)` f32 descales) compute
//!   attention with an f32 / f16 / bf16 output.
//!
//! Every device computes the same function. On a Hopper GPU (sm_90a) the FP8 tensor-core kernel
//! runs (`kernels/sm90/fwd.cu`, e4m3 wgmma for both products, f32 accumulation, f16 / bf16
//! output) whenever the call fits it: descales of one value per (batch, head) or per tensor
//! (FlashAttention-3's `(B, Hkv)`, [`Fp8Scaling::PerTensor`] / [`Fp8Scaling::PerHead`]), an f16
//! or bf16 output, head dims that are multiples of 16, 16-byte aligned rows. Like
//! FlashAttention-3 it rounds the unnormalised softmax P to e4m3 before P V (about 2-3% error per
//! element, averaging out over the keys). Everywhere else, and for per-block descales or an f32
//! output, the inputs are dequantized (data · descale, rounded to the output dtype) and the
//! regular kernels of that dtype run. `CANDLE_FLASH_FP8_DEQUANTIZE=1` forces the dequantizing
//! path (for comparisons). FP8 attention is forward only: a backward through it is an error.
use crate::inputs::{Fp8Kernel, KernelDescale};
use crate::op::{FlashAttnOp, LseSlot};
use crate::params::{self, AttnShape, FlashAttnOptions};
use candle_core::{bail, DType, Device, Result, Tensor};
use std::sync::Arc;

/// Largest finite e4m3 value (OCP FP8 E4M3FN): quantization maps each group's largest
/// magnitude onto it.
pub const E4M3_MAX: f32 = 448.0;

/// How many values share one descale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Scaling {
    /// One descale for the whole tensor.
    PerTensor,
    /// One per (batch, head) (FlashAttention-3's `(B, H)` descales).
    PerHead,
    /// One per block of this many consecutive rows of each (batch, head): the block
    /// quantization of the FlashAttention-3 paper (rows of the last block may be fewer).
    PerBlock(usize),
}

/// An e4m3 tensor and its descales: element (b, s, h, d) ≈ `data[b, s, h, d] ·
/// descale[b, s / block_rows, h / (H / Hd)]` with `descale` f32 of shape `(B, NB, Hd)`,
/// `NB = ceil(S / block_rows)` and Hd dividing H (a descale may serve a group of heads).
/// `data` is `(B, S, H, D)` or, packed (varlen), `(total, H, D)`, which counts as B = 1.
#[derive(Clone, Debug)]
pub struct Fp8Tensor {
    pub data: Tensor,
    pub descale: Tensor,
    pub block_rows: usize,
}

/// `x.to_dtype(dtype)` for conversions to and from e4m3: on CUDA by our kernel
/// ([`CastE4m3`]: candle's CUDA e4m3 casts exist only when its kernels were built with them, and
/// ours are not), elsewhere candle's cast. Either way the result stays in the autograd graph (as
/// candle's casts do), so a backward that reaches FP8 attention meets its error.
pub(crate) fn cast_e4m3(x: &Tensor, dtype: DType) -> Result<Tensor> {
    let floats = |d: DType| matches!(d, DType::F32 | DType::F16 | DType::BF16);
    let one_side = (x.dtype() == DType::F8E4M3 && floats(dtype)) || (floats(x.dtype()) && dtype == DType::F8E4M3);
    if x.device().is_cuda() && one_side && cfg!(feature = "cuda") {
        return x.contiguous()?.apply_op1_arc(Arc::new(Box::new(CastE4m3(dtype))));
    }
    x.to_dtype(dtype)
}

/// The GPU cast between e4m3 and f32 / f16 / bf16 as a candle op (`cf_convert_e4m3`); its
/// gradient is the incoming one cast back, like `to_dtype`'s.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct CastE4m3(DType);

impl candle_core::CustomOp1 for CastE4m3 {
    fn name(&self) -> &'static str {
        "candle-flash-cast-e4m3"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        bail!("candle-flash fp8: the e4m3 cast kernel runs on CUDA (the CPU uses candle's cast)")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        Ok((crate::cuda::convert_e4m3((s, l), self.0)?, l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(cast_e4m3(grad, arg.dtype())?))
    }
}

/// (B, S, H, D) of a 4-d tensor, (1, total, H, D) of a packed 3-d one.
fn bshd(t: &Tensor) -> Result<(usize, usize, usize, usize)> {
    match t.dims() {
        &[b, s, h, d] => Ok((b, s, h, d)),
        &[s, h, d] => Ok((1, s, h, d)),
        dims => {
            bail!("candle-flash fp8: expected (batch, seq, heads, head_dim) or (total, heads, head_dim), got {dims:?}")
        }
    }
}

/// The descale of every row: `(B, NB, Hd)` → `(B, S, H, 1)` (f32).
fn row_descales(descale: &Tensor, block_rows: usize, (b, s, h): (usize, usize, usize)) -> Result<Tensor> {
    let (db, nb, hd) = descale.dims3()?;
    if db != b || hd == 0 || h % hd != 0 || block_rows == 0 || nb != s.div_ceil(block_rows).max(1) {
        bail!(
            "candle-flash fp8: descale of shape {:?} with {block_rows}-row blocks does not fit (B, S, H) = ({b}, {s}, {h})",
            descale.dims()
        )
    }
    if descale.dtype() != DType::F32 {
        bail!("candle-flash fp8: descales must be f32, got {:?}", descale.dtype())
    }
    let rows = if nb == 1 {
        descale.broadcast_as((b, s, hd))?
    } else {
        let idx: Vec<u32> = (0..s).map(|r| (r / block_rows) as u32).collect();
        descale.index_select(&Tensor::new(idx, descale.device())?, 1)?
    };
    let rows = if hd < h { rows.unsqueeze(3)?.broadcast_as((b, s, hd, h / hd))?.reshape((b, s, h))? } else { rows };
    rows.unsqueeze(3)
}

/// Quantizes `x` (f32 / f16 / bf16, `(B, S, H, D)` or `(total, H, D)`) to e4m3 with the given
/// scaling: each group's largest magnitude maps to ±448 (an all-zero group gets descale 1).
/// On CUDA two kernels do it (the groups' maxima, then the scaled cast), unless `x` tracks
/// gradients: then candle ops, which keep the autograd graph. Both give the same bits as the CPU.
pub fn quantize_e4m3(x: &Tensor, scaling: Fp8Scaling) -> Result<Fp8Tensor> {
    if !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        bail!("candle-flash fp8: quantize_e4m3 takes f32, f16 or bf16, got {:?}", x.dtype())
    }
    let (b, s, h, d) = bshd(x)?;
    let block_rows = match scaling {
        Fp8Scaling::PerTensor | Fp8Scaling::PerHead => s.max(1),
        Fp8Scaling::PerBlock(0) => bail!("candle-flash fp8: PerBlock needs at least one row per block"),
        Fp8Scaling::PerBlock(r) => r,
    };
    // The fused kernels are for inference: a tensor that tracks gradients takes the candle ops,
    // so that the graph stays and asking for a gradient through FP8 attention is an error.
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.elem_count() > 0 && !x.track_op() {
        return quantize_on_gpu(x, (b, s, h, d), block_rows, scaling);
    }
    let x4 = x.to_dtype(DType::F32)?.reshape((b, s, h, d))?;
    let nb = s.div_ceil(block_rows).max(1);
    let amax = match scaling {
        _ if x4.elem_count() == 0 => Tensor::zeros((b, nb, h), DType::F32, x.device())?,
        Fp8Scaling::PerTensor => x4.abs()?.max_all()?.broadcast_as((b, nb, h))?.contiguous()?,
        Fp8Scaling::PerHead => x4.abs()?.max(3)?.max(1)?.unsqueeze(1)?,
        Fp8Scaling::PerBlock(r) => {
            let padded = if nb * r > s { x4.pad_with_zeros(1, 0, nb * r - s)? } else { x4.clone() };
            padded.abs()?.reshape((b, nb, r, h, d))?.max(4)?.max(2)?
        }
    };
    let descale = descale_of_amax(&amax)?;
    let rows = row_descales(&descale, block_rows, (b, s, h))?;
    let q = cast_e4m3(&x4.broadcast_div(&rows)?.clamp(-E4M3_MAX, E4M3_MAX)?, DType::F8E4M3)?;
    Ok(Fp8Tensor { data: q.reshape(x.dims())?, descale, block_rows })
}

/// descale = amax / 448 (candle's `/ f64`: a multiplication by 1 / 448 in f32, which
/// `cf_quantize_e4m3` repeats), or 1 where the group is all zero (nothing to scale).
fn descale_of_amax(amax: &Tensor) -> Result<Tensor> {
    amax.eq(0f32)?.where_cond(&amax.ones_like()?, &(amax / E4M3_MAX as f64)?)
}

/// [`quantize_e4m3`] on CUDA: `cf_quantize_e4m3`'s two kernels (each group's maximum and
/// descale, then the scaled cast) instead of the dozen candle ops above, with the same bits.
/// Per-tensor scaling takes the groups' maxima from the GPU and reduces the small `(B, 1, H)`
/// tensor with candle before the cast.
#[cfg(feature = "cuda")]
fn quantize_on_gpu(
    x: &Tensor,
    dims: (usize, usize, usize, usize),
    block_rows: usize,
    scaling: Fp8Scaling,
) -> Result<Fp8Tensor> {
    use crate::cuda::QuantStep;
    let x = x.contiguous()?;
    let (data, descale) = if let Fp8Scaling::PerTensor = scaling {
        let (_, amax) = crate::cuda::quantize_e4m3(&x, dims, block_rows, QuantStep::Amax)?;
        let descale = descale_of_amax(&amax.max_all()?.broadcast_as(amax.shape())?.contiguous()?)?;
        crate::cuda::quantize_e4m3(&x, dims, block_rows, QuantStep::Apply(&descale))?
    } else {
        crate::cuda::quantize_e4m3(&x, dims, block_rows, QuantStep::Full)?
    };
    let data = data.ok_or_else(|| candle_core::Error::Msg("candle-flash fp8: quantization wrote no data".into()))?;
    Ok(Fp8Tensor { data, descale, block_rows })
}

/// `data · descale` in `dtype` (f32 / f16 / bf16), in `t.data`'s shape.
pub fn dequantize(t: &Fp8Tensor, dtype: DType) -> Result<Tensor> {
    if t.data.dtype() != DType::F8E4M3 {
        bail!("candle-flash fp8: data must be F8E4M3, got {:?}", t.data.dtype())
    }
    let (b, s, h, d) = bshd(&t.data)?;
    if !t.descale.device().same_device(t.data.device()) {
        bail!(
            "candle-flash fp8: descale is on {:?}, data on {:?}",
            t.descale.device().location(),
            t.data.device().location()
        )
    }
    let rows = row_descales(&t.descale, t.block_rows, (b, s, h))?;
    let x = cast_e4m3(&t.data, DType::F32)?.reshape((b, s, h, d))?.broadcast_mul(&rows)?;
    x.to_dtype(dtype)?.reshape(t.data.dims())
}

/// The orthonormal Hadamard matrix of size n (a power of two), Sylvester's construction.
fn hadamard(n: usize) -> Vec<f32> {
    let mut m = vec![1f32];
    let mut k = 1;
    while k < n {
        let mut next = vec![0f32; 4 * k * k];
        for i in 0..k {
            for j in 0..k {
                let v = m[i * k + j];
                next[i * 2 * k + j] = v;
                next[i * 2 * k + j + k] = v;
                next[(i + k) * 2 * k + j] = v;
                next[(i + k) * 2 * k + j + k] = -v;
            }
        }
        m = next;
        k *= 2;
    }
    let norm = 1.0 / (n as f32).sqrt();
    m.iter().map(|v| v * norm).collect()
}

/// `x · R` along the last dimension D, R orthonormal: block-diagonal with Hadamard blocks of
/// the largest power of two dividing D (the whole of D when it is one; 32 for D = 96, 64 for
/// D = 192). Computed in f32, returned in x's dtype. Apply it to q and k (never only one).
pub fn hadamard_rotate(x: &Tensor) -> Result<Tensor> {
    let d = x.dim(candle_core::D::Minus1)?;
    if d == 0 {
        return Ok(x.clone());
    }
    let blk = 1usize << d.trailing_zeros();
    let h = hadamard(blk);
    let mut r = vec![0f32; d * d];
    for b0 in (0..d).step_by(blk) {
        for i in 0..blk {
            r[(b0 + i) * d + b0..(b0 + i) * d + b0 + blk].copy_from_slice(&h[i * blk..(i + 1) * blk]);
        }
    }
    let r = Tensor::from_vec(r, (d, d), x.device())?;
    let rows = x.elem_count() / d;
    x.to_dtype(DType::F32)?.reshape((rows, d))?.matmul(&r)?.to_dtype(x.dtype())?.reshape(x.dims())
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn dequantize_forced() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("CANDLE_FLASH_FP8_DEQUANTIZE").is_ok_and(|v| !v.is_empty() && v != "0"))
}

/// Whether the FP8 kernel takes this call (module docs): CUDA, an f16 / bf16 output
/// (`shape.dtype`), not forced off, and `cf_fwd_check` says it runs.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
fn kernel_takes(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    kernel: &Fp8Kernel,
) -> Result<bool> {
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() && matches!(shape.dtype, DType::F16 | DType::BF16) && !dequantize_forced() {
        return crate::cuda::fp8_kernel_runs(shape, opts, kernel, [q, k, v]);
    }
    Ok(false)
}

/// Runs the call on the FP8 kernel when it can (module docs), else `Ok(None)`.
fn attend_on_fp8_kernel(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    kernel: Fp8Kernel,
) -> Result<Option<Tensor>> {
    if kernel_takes(q, k, v, shape, opts, &kernel)? {
        let lse = LseSlot::default();
        let op = FlashAttnOp {
            opts: opts.clone(),
            shape: shape.clone(),
            lse,
            forward_only: Some("FP8 attention"),
            fp8: Some(kernel),
        };
        return q.apply_op3_arc(k, v, Arc::new(Box::new(op))).map(Some);
    }
    Ok(None)
}

/// Whether [`flash_attn_fp8_descaled`] on these inputs (with `(B, Hkv)` descales or none) runs
/// the FP8 tensor-core kernel (true) or the dequantizing path (false); see the module docs.
pub fn uses_fp8_kernel(q: &Tensor, k: &Tensor, v: &Tensor, opts: &FlashAttnOptions, out_dtype: DType) -> Result<bool> {
    let shape = params::validate_fp8(q, k, v, opts, out_dtype)?;
    kernel_takes(q, k, v, &shape, opts, &Fp8Kernel { descales: [None, None, None] })
}

/// The kernel's view of an [`Fp8Tensor`]'s descales, when it has one per (batch, head group)
/// (`NB = 1`: per tensor or per head); `None` for per-block descales. `heads`: the tensor's heads.
fn kernel_descale(t: &Fp8Tensor, heads: usize) -> Result<Option<KernelDescale>> {
    let (b, nb, hd) = t.descale.dims3()?;
    if nb != 1 || hd == 0 || !heads.is_multiple_of(hd) {
        return Ok(None);
    }
    // packed (varlen) data is one batch: every sequence reads the same descales
    let batch_stride = if t.data.rank() == 3 || b == 1 { 0 } else { hd };
    Ok(Some(KernelDescale { tensor: t.descale.flatten_all()?.contiguous()?, batch_stride, head_div: heads / hd }))
}

/// Attention on e4m3 inputs with any scaling (see [`Fp8Tensor`]), output in `out_dtype`
/// (f32, f16 or bf16). Every option of [`FlashAttnOptions`] but paged K/V; forward only.
pub fn flash_attn_fp8(
    q: &Fp8Tensor,
    k: &Fp8Tensor,
    v: &Fp8Tensor,
    opts: &FlashAttnOptions,
    out_dtype: DType,
) -> Result<Tensor> {
    let shape = params::validate_fp8(&q.data, &k.data, &v.data, opts, out_dtype)?;
    let (h, hkv) = (shape.num_heads, shape.num_kv_heads);
    if let (Some(dq), Some(dk), Some(dv)) = (kernel_descale(q, h)?, kernel_descale(k, hkv)?, kernel_descale(v, hkv)?) {
        let kernel = Fp8Kernel { descales: [Some(dq), Some(dk), Some(dv)] };
        if let Some(out) = attend_on_fp8_kernel(&q.data, &k.data, &v.data, &shape, opts, kernel)? {
            return Ok(out);
        }
    }
    let (q, k, v) = (dequantize(q, out_dtype)?, dequantize(k, out_dtype)?, dequantize(v, out_dtype)?);
    attend_forward_only(&q, &k, &v, shape, opts)
}

/// FlashAttention-3's FP8 convention: q, k, v `DType::F8E4M3` in the layouts of
/// [`crate::flash_attn_with_options`], and optional f32 descales of shape `(B, Hkv)` (B = the
/// number of sequences for varlen; `None` = 1), the q descale of a query head being that of its
/// KV head. Output in `out_dtype` (f32, f16 or bf16); forward only.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_fp8_descaled(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    q_descale: Option<&Tensor>,
    k_descale: Option<&Tensor>,
    v_descale: Option<&Tensor>,
    opts: &FlashAttnOptions,
    out_dtype: DType,
) -> Result<Tensor> {
    let shape = params::validate_fp8(q, k, v, opts, out_dtype)?;
    let (nb, hkv) = (shape.batch, shape.num_kv_heads);
    for (name, t) in [("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)] {
        if let Some(t) = t {
            if t.dims() != [nb, hkv] || t.dtype() != DType::F32 {
                bail!(
                    "candle-flash fp8: {name} must be f32 of shape (batch, kv_heads) = ({nb}, {hkv}), got {:?} {:?}",
                    t.dtype(),
                    t.dims()
                )
            }
            if !t.device().same_device(q.device()) {
                bail!(
                    "candle-flash fp8: {name} is on {:?} but q is on {:?}",
                    t.device().location(),
                    q.device().location()
                )
            }
        }
    }
    let as_kernel = |t: Option<&Tensor>, head_div: usize| -> Result<Option<KernelDescale>> {
        t.map(|t| Ok(KernelDescale { tensor: t.contiguous()?, batch_stride: hkv, head_div })).transpose()
    };
    let kernel = Fp8Kernel {
        descales: [as_kernel(q_descale, shape.num_heads / hkv)?, as_kernel(k_descale, 1)?, as_kernel(v_descale, 1)?],
    };
    if let Some(out) = attend_on_fp8_kernel(q, k, v, &shape, opts, kernel)? {
        return Ok(out);
    }
    // As Fp8Tensor descales: batched (B, 1, Hkv); varlen: one per packed row (1, total, Hkv),
    // gathered by each row's sequence (found on the device from the cumulative seqlens).
    let wrap = |data: &Tensor, descale: Option<&Tensor>, cu: Option<&Tensor>| -> Result<Fp8Tensor> {
        let ones;
        let descale = match descale {
            Some(t) => t,
            None => {
                ones = Tensor::ones((nb, hkv), DType::F32, q.device())?;
                &ones
            }
        };
        match cu {
            None => {
                Ok(Fp8Tensor { data: data.clone(), descale: descale.unsqueeze(1)?, block_rows: data.dim(1)?.max(1) })
            }
            Some(cu) => {
                let rows = data.dim(0)?;
                let seq = row_sequence(cu, rows, nb, q.device())?;
                Ok(Fp8Tensor {
                    data: data.clone(),
                    descale: descale.index_select(&seq, 0)?.unsqueeze(0)?,
                    block_rows: 1,
                })
            }
        }
    };
    let (cq, ck) = match &opts.varlen {
        Some(vl) => (Some(&vl.seqlens_q), Some(&vl.seqlens_k)),
        None => (None, None),
    };
    let (q, k, v) = (wrap(q, q_descale, cq)?, wrap(k, k_descale, ck)?, wrap(v, v_descale, ck)?);
    let (q, k, v) = (dequantize(&q, out_dtype)?, dequantize(&k, out_dtype)?, dequantize(&v, out_dtype)?);
    attend_forward_only(&q, &k, &v, shape, opts)
}

/// The sequence of each of `rows` packed rows, from cumulative seqlens `cu` (B + 1 entries):
/// the number of sequence ends at or below the row, capped at B - 1. On the device, no host
/// read (O(rows · B) comparisons, fine for the dequantizing path).
fn row_sequence(cu: &Tensor, rows: usize, nb: usize, device: &Device) -> Result<Tensor> {
    if rows == 0 || nb == 0 {
        return Tensor::zeros(rows, DType::U32, device);
    }
    let ends = cu.to_dtype(DType::I64)?.narrow(0, 1, nb)?.unsqueeze(0)?; // (1, B)
    let r = Tensor::arange(0i64, rows as i64, device)?.unsqueeze(1)?; // (rows, 1)
    let seq = r.broadcast_ge(&ends)?.to_dtype(DType::U32)?.sum(1)?;
    seq.minimum((nb - 1) as f64)?.to_dtype(DType::U32)
}

/// The regular op on dequantized inputs (contiguous, so no realignment), with the shape
/// `validate_fp8` gave (validated once), marked forward only (its backward is an error).
fn attend_forward_only(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    shape: AttnShape,
    opts: &FlashAttnOptions,
) -> Result<Tensor> {
    let lse = LseSlot::default();
    let op = FlashAttnOp { opts: opts.clone(), shape, lse, forward_only: Some("FP8 attention"), fp8: None };
    q.apply_op3_arc(k, v, Arc::new(Box::new(op)))
}
