//! Launches of the serving steps' kernels (`kernels/serving/`): the rotary + paged cache write,
//! residual add + RMSNorm, SiLU × up, and the e4m3 conversions and quantization (`crate::fp8`).
//! The attention's launches are the parent module's; the helpers (argument structs, outputs,
//! status checks) are shared from there.

use super::*;

/// `cf_rope_kv_write`: see [`crate::rope_write_paged_kv`], which validated the shapes, the
/// strides and the dtypes (f32 / f16 / bf16, u32 slots) into `shape`. The caches are written in
/// place through their storage (as candle's own in-place scatter does); the rotated q is a new
/// tensor.
pub(crate) fn rope_kv_write(
    [q, k, v]: [&Tensor; 3],
    (cos, sin): (&Tensor, &Tensor),
    (k_cache, v_cache): (&Tensor, &Tensor),
    slots: &Tensor,
    shape: &crate::serving_params::RopeCacheWriteShape,
) -> Result<Tensor> {
    let dev = q.device().as_cuda_device()?.clone();
    let stream = dev.cuda_stream();
    let dtype = q.dtype();
    let n = shape.t * shape.h * shape.d;
    let row_stride = |t: &Tensor| t.stride()[0] as i64;
    let named = [
        ("q", q),
        ("k", k),
        ("v", v),
        ("cos", cos),
        ("sin", sin),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("slot_mapping", slots),
    ];
    let (out, ()) = with_args(&named, |args| {
        new_output(&dev, dtype, n, |out| {
            let p = ffi::CfRopeKvParams {
                q_in: const_ptr(&args[0]),
                k_in: const_ptr(&args[1]),
                v_in: const_ptr(&args[2]),
                cos: const_ptr(&args[3]),
                sin: const_ptr(&args[4]),
                slots: const_ptr(&args[7]) as *const u32,
                q_out: out as *mut c_void,
                k_cache: mut_ptr(&args[5]),
                v_cache: mut_ptr(&args[6]),
                q_row_stride: row_stride(q),
                k_row_stride: row_stride(k),
                v_row_stride: row_stride(v),
                num_slots: shape.cache.slots as i64,
                t: i32::try_from(shape.t).map_err(|_| Error::Msg(format!("candle-flash: {} rows", shape.t)))?,
                h: shape.h as i32,
                hkv: shape.hkv as i32,
                d: shape.d as i32,
                dtype: dtype_code(dtype)?,
            };
            // SAFETY: the pointers address live buffers of the validated extents (q/k/v rows at
            // their strides, cos/sin and the caches contiguous, `out` t*h*d elements just
            // allocated); slots at or past num_slots write nothing; the call only enqueues work
            // on candle's stream.
            let status = unsafe { ffi::cf_rope_kv_write(&p, stream.cu_stream() as *mut c_void) };
            check(status, "cf_rope_kv_write")
        })
    })?;
    Ok(tensor_of(out, (shape.t, shape.h, shape.d)))
}

/// A new contiguous output of `n` elements of `dtype` (f32 / f16 / bf16), filled by `run` given
/// its device pointer (work enqueued on candle's stream); with what `run` returned.
fn new_output<R>(
    dev: &CudaDevice,
    dtype: DType,
    n: usize,
    run: impl FnOnce(u64) -> Result<R>,
) -> Result<(CudaStorage, R)> {
    fn typed<T: CudaDType + DeviceRepr, R>(
        dev: &CudaDevice,
        n: usize,
        run: impl FnOnce(u64) -> Result<R>,
    ) -> Result<(CudaStorage, R)> {
        let stream = dev.cuda_stream();
        let mut out = alloc_output::<T>(dev, &stream, n)?;
        let r = {
            let (ptr, _sync) = out.device_ptr_mut(&stream);
            run(ptr)?
        };
        Ok((T::wrap_cuda_slice(out, dev.clone()), r))
    }
    match dtype {
        DType::F32 => typed::<f32, R>(dev, n, run),
        DType::F16 => typed::<f16, R>(dev, n, run),
        DType::BF16 => typed::<bf16, R>(dev, n, run),
        DType::F8E4M3 => typed::<float8::F8E4M3, R>(dev, n, run),
        dt => bail!("candle-flash: unsupported dtype {dt:?} on cuda"),
    }
}

/// `x.to_dtype(dtype)` where exactly one of the two is F8E4M3 (the other f32 / f16 / bf16), on
/// the GPU (`cf_convert_e4m3`; to e4m3: round to nearest even, saturated to ±448); x contiguous.
pub(crate) fn convert_e4m3((x, l): (&CudaStorage, &Layout), dtype: DType) -> Result<CudaStorage> {
    if !l.is_contiguous() {
        bail!("candle-flash: cf_convert_e4m3 takes a contiguous tensor")
    }
    let dev = x.device.clone();
    let stream = dev.cuda_stream();
    let n = l.shape().elem_count();
    let src = TensorArg::read((x, l), &stream)?;
    let (out, ()) = new_output(&dev, dtype, n, |out| {
        let p = ffi::CfConvertParams {
            src: const_ptr(&src),
            dst: out as *mut c_void,
            n: n as i64,
            src_dtype: dtype_code(x.dtype())?,
            dst_dtype: dtype_code(dtype)?,
        };
        // SAFETY: x is contiguous with n elements from the layout's start, out holds n of
        // `dtype`; the call only enqueues work on candle's stream.
        check(unsafe { ffi::cf_convert_e4m3(&p, stream.cu_stream() as *mut c_void) }, "cf_convert_e4m3")
    })?;
    Ok(out)
}

/// What [`quantize_e4m3`] runs of `cf_quantize_e4m3` (flash_api.h).
pub(crate) enum QuantStep<'a> {
    /// Each group's descale from its amax, then the e4m3 data: returns (data, descale).
    Full,
    /// Only each group's amax (per-tensor scaling reduces them): returns (None, amax).
    Amax,
    /// Only the e4m3 data, with these descales `(b, nb, h)` (f32, contiguous): returns (data, them).
    Apply(&'a Tensor),
}

/// `cf_quantize_e4m3` on `x`, contiguous f32 / f16 / bf16 viewed as `(b, s, h, d)`, in groups
/// of (batch, `block_rows` rows, head); [`crate::fp8::quantize_e4m3`] validated all of it.
/// Two kernels at most (the group maxima, the scaled cast) instead of a dozen candle ops.
pub(crate) fn quantize_e4m3(
    x: &Tensor,
    (b, s, h, d): (usize, usize, usize, usize),
    block_rows: usize,
    step: QuantStep,
) -> Result<(Option<Tensor>, Tensor)> {
    let dev = x.device().as_cuda_device()?.clone();
    let stream = dev.cuda_stream();
    let nb = s.div_ceil(block_rows).max(1);
    let mut named = vec![("x", x)];
    if let QuantStep::Apply(scale) = &step {
        named.push(("descale", *scale));
    }
    with_args(&named, |a| {
        let launch = |q: u64, scale: u64, mode: i32| -> Result<()> {
            let p = ffi::CfQuantizeParams {
                x: const_ptr(&a[0]),
                q: q as *mut c_void,
                scale: scale as *mut f32,
                b: b as i64,
                s: s as i64,
                h: h as i64,
                d: d as i64,
                block_rows: block_rows as i64,
                dtype: dtype_code(x.dtype())?,
                mode,
            };
            // SAFETY: x holds b * s * h * d contiguous elements from its start (validated), q as
            // many e4m3 bytes and scale b * nb * h f32 (allocated here, or the validated
            // descales, which APPLY only reads); the call only enqueues work on candle's stream.
            check(unsafe { ffi::cf_quantize_e4m3(&p, stream.cu_stream() as *mut c_void) }, "cf_quantize_e4m3")
        };
        let scales = |st: CudaStorage| tensor_of(st, (b, nb, h));
        let data = |st: CudaStorage| tensor_of(st, x.shape().clone());
        match step {
            QuantStep::Full => {
                let (scale, (q, ())) = new_output(&dev, DType::F32, b * nb * h, |scale| {
                    new_output(&dev, DType::F8E4M3, b * s * h * d, |q| launch(q, scale, ffi::CF_QUANT_FULL))
                })?;
                Ok((Some(data(q)), scales(scale)))
            }
            QuantStep::Amax => {
                let (amax, ()) = new_output(&dev, DType::F32, b * nb * h, |amax| launch(0, amax, ffi::CF_QUANT_AMAX))?;
                Ok((None, scales(amax)))
            }
            QuantStep::Apply(scale) => {
                let (q, ()) =
                    new_output(&dev, DType::F8E4M3, b * s * h * d, |q| launch(q, a[1].ptr, ffi::CF_QUANT_APPLY))?;
                Ok((Some(data(q)), scale.clone()))
            }
        }
    })
}

/// A tensor over a new output's storage (no autograd: these ops are inference paths).
fn tensor_of(storage: CudaStorage, shape: impl Into<candle_core::Shape>) -> Tensor {
    Tensor::from_storage(candle_core::Storage::Cuda(storage), shape, candle_core::op::BackpropOp::none(), false)
}

/// Device pointers of the named tensors (at their start offsets) and their ordering guards, kept
/// alive while `f` enqueues the launch; a tensor not on CUDA is an error naming it.
fn with_args<R>(tensors: &[(&str, &Tensor)], f: impl FnOnce(&[TensorArg]) -> Result<R>) -> Result<R> {
    let stream = tensors[0].1.device().as_cuda_device()?.cuda_stream();
    let guards: Vec<_> = tensors.iter().map(|(_, t)| t.storage_and_layout()).collect();
    let mut args = Vec::with_capacity(guards.len());
    for (g, (name, _)) in guards.iter().zip(tensors) {
        args.push(TensorArg::read(device_storage::<CudaStorage>(name, g)?, &stream)?);
    }
    f(&args)
}

/// `cf_add_rms_norm`: see [`crate::fused::add_rms_norm`], which validated `x`, `residual` and
/// `weight` (contiguous, `rows` x `n`). Returns (sum, normed); the sum is `x` itself without a
/// residual.
pub(crate) fn add_rms_norm(
    x: &Tensor,
    residual: Option<&Tensor>,
    weight: &Tensor,
    eps: f32,
    (rows, n): (usize, usize),
) -> Result<(Tensor, Tensor)> {
    let dev = x.device().as_cuda_device()?.clone();
    let stream = dev.cuda_stream();
    let dtype = x.dtype();
    let mut named = vec![("x", x), ("weight", weight)];
    named.extend(residual.map(|r| ("residual", r)));
    with_args(&named, |a| {
        // Writes `out`, and the sum to `sum_ptr` (0 without a residual).
        let launch = |sum_ptr: u64, out: u64| -> Result<()> {
            let p = ffi::CfAddRmsNormParams {
                x: const_ptr(&a[0]),
                residual: a.get(2).map_or(std::ptr::null(), const_ptr),
                weight: const_ptr(&a[1]),
                sum_out: sum_ptr as *mut c_void,
                out: out as *mut c_void,
                rows: rows as i64,
                n: i32::try_from(n).map_err(|_| Error::Msg(format!("candle-flash: rms norm over {n} values")))?,
                eps,
                dtype: dtype_code(dtype)?,
            };
            // SAFETY: x / residual / out / sum are rows * n contiguous elements, weight n
            // (validated or just allocated); the call only enqueues work on candle's stream.
            check(unsafe { ffi::cf_add_rms_norm(&p, stream.cu_stream() as *mut c_void) }, "cf_add_rms_norm")
        };
        let tensor = |s: CudaStorage| tensor_of(s, x.shape().clone());
        if residual.is_some() {
            let (sum, (out, ())) =
                new_output(&dev, dtype, rows * n, |sum| new_output(&dev, dtype, rows * n, |out| launch(sum, out)))?;
            Ok((tensor(sum), tensor(out)))
        } else {
            let (out, ()) = new_output(&dev, dtype, rows * n, |out| launch(0, out))?;
            Ok((x.clone(), tensor(out)))
        }
    })
}

/// `cf_silu_mul`: see [`crate::fused::silu_mul`], which validated `gate` and `up` (`rows` x `n`,
/// rows strided, values contiguous). Returns `(rows, n)` contiguous.
pub(crate) fn silu_mul(gate: &Tensor, up: &Tensor, (rows, n): (usize, usize)) -> Result<Tensor> {
    let dev = gate.device().as_cuda_device()?.clone();
    let stream = dev.cuda_stream();
    let dtype = gate.dtype();
    let row_stride = |t: &Tensor| if t.rank() >= 2 { t.stride()[t.rank() - 2] as i64 } else { 0 };
    let (out, ()) = with_args(&[("gate", gate), ("up", up)], |a| {
        new_output(&dev, dtype, rows * n, |out| {
            let p = ffi::CfSiluMulParams {
                gate: const_ptr(&a[0]),
                up: const_ptr(&a[1]),
                out: out as *mut c_void,
                gate_row_stride: row_stride(gate),
                up_row_stride: row_stride(up),
                rows: rows as i64,
                n: n as i32,
                dtype: dtype_code(dtype)?,
            };
            // SAFETY: gate / up rows at their strides hold n values each (validated), out rows * n
            // contiguous; the call only enqueues work on candle's stream.
            check(unsafe { ffi::cf_silu_mul(&p, stream.cu_stream() as *mut c_void) }, "cf_silu_mul")
        })
    })?;
    let mut dims = gate.dims().to_vec();
    if let Some(l) = dims.last_mut() {
        *l = n;
    }
    Ok(tensor_of(out, dims))
}
