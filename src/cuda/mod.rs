//! Launch code for our CUDA kernels (`kernels/`, compiled by build.rs into a static library).
//!
//! Everything runs on candle's stream for the device; every entry point's status is checked
//! and turned into a `candle_core::Error` that names the kernel. A tensor on CUDA never falls
//! back to the CPU path.

mod ffi;

use crate::params::{AttnShape, FlashAttnOptions};
use candle_core::cuda_backend::cudarc::driver::{
    result::memset_d8_async, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use candle_core::cuda_backend::CudaDType;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Error, Layout, Result, Storage, Tensor};
use half::{bf16, f16};
use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};

static POISON_OUTPUTS: AtomicBool = AtomicBool::new(false);

/// Fill every output with NaN before each kernel runs, so that an element a kernel fails to
/// write shows up in tests (costs one memset per output; off by default).
pub fn set_poison_outputs(on: bool) {
    POISON_OUTPUTS.store(on, Ordering::Relaxed);
}

fn cuda_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Msg(format!("candle-flash: {what}: {e}"))
}

/// Turns a status of `flash_api.h` into a Result naming the entry point.
fn check(status: i32, entry: &str) -> Result<()> {
    if status == 0 {
        return Ok(());
    }
    // SAFETY: cf_error_string returns a static NUL-terminated string for any status.
    let msg = unsafe { CStr::from_ptr(ffi::cf_error_string(status)) }.to_string_lossy().into_owned();
    bail!("candle-flash: CUDA kernel {entry} failed (status {status}): {msg}")
}

/// Allocates `len` elements, NaN-filled when poisoning is on.
fn alloc_output<T: DeviceRepr>(dev: &CudaDevice, stream: &CudaStream, len: usize) -> Result<CudaSlice<T>> {
    // SAFETY: the kernels write every element before anything reads it (and the tests check
    // exactly that with poisoning on).
    let mut slice = unsafe { dev.alloc::<T>(len.max(1)) }?;
    if POISON_OUTPUTS.load(Ordering::Relaxed) {
        let bytes = len.max(1) * std::mem::size_of::<T>();
        let (ptr, _guard) = slice.device_ptr_mut(stream);
        // SAFETY: ptr addresses `bytes` bytes we just allocated on this stream; all 0xFF bytes
        // are NaN in f32, f16 and bf16.
        unsafe { memset_d8_async(ptr, 0xFF, bytes, stream.cu_stream()) }.map_err(|e| cuda_err("poison", e))?;
    }
    Ok(slice)
}

/// (batch, row, head) strides in elements of a q/k/v-shaped layout.
fn strides(layout: &Layout, is_varlen: bool) -> (i64, i64, i64) {
    let s = layout.stride();
    if is_varlen {
        (0, s[0] as i64, s[1] as i64)
    } else {
        (s[0] as i64, s[1] as i64, s[2] as i64)
    }
}

fn dtype_code(dtype: DType) -> Result<i32> {
    Ok(match dtype {
        DType::F32 => ffi::CF_F32,
        DType::F16 => ffi::CF_F16,
        DType::BF16 => ffi::CF_BF16,
        dt => bail!("candle-flash: unsupported dtype {dt:?} on cuda"),
    })
}

/// Device pointer (at the layout's start offset) of a storage's slice of type T.
fn ptr<T: CudaDType + DeviceRepr>(s: &CudaStorage, l: &Layout, stream: &CudaStream) -> Result<u64> {
    let slice = s.as_cuda_slice::<T>()?;
    let (base, _guard) = slice.device_ptr(stream);
    Ok(base + (l.start_offset() * std::mem::size_of::<T>()) as u64)
}

/// Tensors of the options that live on the device: ALiBi slopes and varlen offsets.
struct OptionPtrs {
    alibi: u64,
    alibi_batch_stride: i32,
    cu_seqlens_q: u64,
    cu_seqlens_k: u64,
    // Keep the (contiguous) tensors alive while the kernel may read them.
    _keep: Vec<Tensor>,
}

fn option_ptrs(opts: &FlashAttnOptions, shape: &AttnShape, stream: &CudaStream) -> Result<OptionPtrs> {
    let mut out = OptionPtrs { alibi: 0, alibi_batch_stride: 0, cu_seqlens_q: 0, cu_seqlens_k: 0, _keep: vec![] };
    let device_ptr = |t: &Tensor, keep: &mut Vec<Tensor>| -> Result<u64> {
        let t = t.contiguous()?;
        let p = {
            let (s, l) = t.storage_and_layout();
            match &*s {
                Storage::Cuda(s) => match t.dtype() {
                    DType::F32 => ptr::<f32>(s, l, stream)?,
                    DType::U32 => ptr::<u32>(s, l, stream)?,
                    dt => bail!("candle-flash: unexpected option dtype {dt:?}"),
                },
                _ => bail!("candle-flash: option tensor is not on the GPU"),
            }
        };
        keep.push(t);
        Ok(p)
    };
    if let Some(slopes) = &opts.alibi_slopes {
        out.alibi = device_ptr(slopes, &mut out._keep)?;
        out.alibi_batch_stride = if slopes.rank() == 2 { shape.num_heads as i32 } else { 0 };
    }
    if let Some(vl) = &opts.varlen {
        out.cu_seqlens_q = device_ptr(&vl.seqlens_q, &mut out._keep)?;
        out.cu_seqlens_k = device_ptr(&vl.seqlens_k, &mut out._keep)?;
    }
    Ok(out)
}

fn window(w: Option<usize>) -> i32 {
    w.map(|x| x.min(i32::MAX as usize) as i32).unwrap_or(-1)
}

/// Forward parameters with every field but the tensor pointers and strides filled.
fn base_params(shape: &AttnShape, opts: &FlashAttnOptions, o: &OptionPtrs) -> Result<ffi::CfFwdParams> {
    let lse_dims = shape.lse_dims();
    let (lse_batch_stride, lse_head_stride) = if shape.is_varlen {
        (0, lse_dims[1] as i64)
    } else {
        ((lse_dims[1] * lse_dims[2]) as i64, lse_dims[2] as i64)
    };
    Ok(ffi::CfFwdParams {
        q: std::ptr::null(),
        k: std::ptr::null(),
        v: std::ptr::null(),
        o: std::ptr::null_mut(),
        lse: std::ptr::null_mut(),
        alibi_slopes: o.alibi as *const f32,
        cu_seqlens_q: o.cu_seqlens_q as *const u32,
        cu_seqlens_k: o.cu_seqlens_k as *const u32,
        q_batch_stride: 0,
        q_row_stride: 0,
        q_head_stride: 0,
        k_batch_stride: 0,
        k_row_stride: 0,
        k_head_stride: 0,
        v_batch_stride: 0,
        v_row_stride: 0,
        v_head_stride: 0,
        o_batch_stride: 0,
        o_row_stride: 0,
        o_head_stride: 0,
        lse_batch_stride,
        lse_head_stride,
        b: shape.batch as i32,
        h: shape.num_heads as i32,
        hkv: shape.num_kv_heads as i32,
        d: shape.head_dim as i32,
        seqlen_q: shape.max_seqlen_q as i32,
        seqlen_k: shape.max_seqlen_k as i32,
        alibi_batch_stride: o.alibi_batch_stride,
        window_left: window(opts.window_size_left),
        window_right: window(opts.window_size_right),
        softmax_scale: opts.softmax_scale,
        softcap: opts.softcap.unwrap_or(0.0),
        dtype: dtype_code(shape.dtype)?,
    })
}

/// Forward on CUDA: the output (q's dtype and dims, contiguous) and the LSE (f32).
pub(crate) fn forward(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, CudaStorage)> {
    match shape.dtype {
        DType::F32 => forward_t::<f32>(shape, opts, q, k, v),
        DType::F16 => forward_t::<f16>(shape, opts, q, k, v),
        DType::BF16 => forward_t::<bf16>(shape, opts, q, k, v),
        dt => bail!("candle-flash: unsupported dtype {dt:?} on cuda"),
    }
}

fn forward_t<T: CudaDType + DeviceRepr>(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    (q, q_l): (&CudaStorage, &Layout),
    (k, k_l): (&CudaStorage, &Layout),
    (v, v_l): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, CudaStorage)> {
    let dev = q.device.clone();
    let stream = dev.cuda_stream();
    let out_len = q_l.shape().elem_count();
    let lse_len: usize = shape.lse_dims().iter().product();
    let mut out = alloc_output::<T>(&dev, &stream, out_len)?;
    let mut lse = alloc_output::<f32>(&dev, &stream, lse_len)?;
    if out_len > 0 {
        let option_ptrs = option_ptrs(opts, shape, &stream)?;
        let mut p = base_params(shape, opts, &option_ptrs)?;
        (p.q_batch_stride, p.q_row_stride, p.q_head_stride) = strides(q_l, shape.is_varlen);
        (p.k_batch_stride, p.k_row_stride, p.k_head_stride) = strides(k_l, shape.is_varlen);
        (p.v_batch_stride, p.v_row_stride, p.v_head_stride) = strides(v_l, shape.is_varlen);
        let out_l = Layout::contiguous(q_l.shape());
        (p.o_batch_stride, p.o_row_stride, p.o_head_stride) = strides(&out_l, shape.is_varlen);
        let (qp, kp, vp) = (ptr::<T>(q, q_l, &stream)?, ptr::<T>(k, k_l, &stream)?, ptr::<T>(v, v_l, &stream)?);
        let (op, _og) = out.device_ptr_mut(&stream);
        let (lp, _lg) = lse.device_ptr_mut(&stream);
        p.q = qp as *const c_void;
        p.k = kp as *const c_void;
        p.v = vp as *const c_void;
        p.o = op as *mut c_void;
        p.lse = lp as *mut f32;
        // SAFETY: every pointer addresses a live device buffer of the extents described by
        // `p` (validated shapes, the tensors' own layouts); the call only enqueues work on
        // candle's stream, which also orders the buffers' later uses and frees.
        let status = unsafe { ffi::cf_fwd(&p, stream.cu_stream() as *mut c_void) };
        check(status, "cf_fwd")?;
    }
    Ok((T::wrap_cuda_slice(out, dev.clone()), f32::wrap_cuda_slice(lse, dev)))
}

/// Backward on CUDA: dq (q's dims), dk, dv (k's dims), contiguous, in the inputs' dtype.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    // Contiguous inputs keep the backward's addressing simple (the gradient candle hands us
    // may be a broadcast view); copies are O(N) and only happen for strided inputs.
    let t = [q, k, v, out, grad_out, lse].map(|t| t.contiguous());
    let [q, k, v, out, grad_out, lse] = t;
    let (q, k, v, out, grad_out, lse) = (q?, k?, v?, out?, grad_out?, lse?);
    match shape.dtype {
        DType::F32 => backward_t::<f32>(shape, opts, [&q, &k, &v, &out, &grad_out], &lse),
        DType::F16 => backward_t::<f16>(shape, opts, [&q, &k, &v, &out, &grad_out], &lse),
        DType::BF16 => backward_t::<bf16>(shape, opts, [&q, &k, &v, &out, &grad_out], &lse),
        dt => bail!("candle-flash: unsupported dtype {dt:?} on cuda"),
    }
}

fn backward_t<T: CudaDType + DeviceRepr + ValidAsZeroBits>(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    tensors: [&Tensor; 5],
    lse: &Tensor,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    let guards = tensors.map(|t| t.storage_and_layout());
    let cuda = |i: usize| -> Result<(&CudaStorage, &Layout)> {
        match &*guards[i].0 {
            Storage::Cuda(s) => Ok((s, guards[i].1)),
            _ => bail!("candle-flash: backward input {i} is not on the GPU"),
        }
    };
    let [(q, q_l), (k, k_l), (v, v_l), (o, o_l), (dout, do_l)] = [cuda(0)?, cuda(1)?, cuda(2)?, cuda(3)?, cuda(4)?];
    let (lse_s, lse_l) = lse.storage_and_layout();
    let lse_s = match &*lse_s {
        Storage::Cuda(s) => s,
        _ => bail!("candle-flash: lse is not on the GPU"),
    };
    let dev = q.device.clone();
    let stream = dev.cuda_stream();
    let (q_len, k_len) = (q_l.shape().elem_count(), k_l.shape().elem_count());
    if q_len == 0 || k_len == 0 {
        // Nothing to differentiate: zero gradients without a launch.
        let zeros =
            |n: usize| -> Result<CudaStorage> { Ok(T::wrap_cuda_slice(dev.alloc_zeros::<T>(n.max(1))?, dev.clone())) };
        return Ok((zeros(q_len)?, zeros(k_len)?, zeros(k_len)?));
    }
    let mut dq = alloc_output::<T>(&dev, &stream, q_len)?;
    let mut dk = alloc_output::<T>(&dev, &stream, k_len)?;
    let mut dv = alloc_output::<T>(&dev, &stream, k_len)?;
    {
        let option_ptrs = option_ptrs(opts, shape, &stream)?;
        let mut f = base_params(shape, opts, &option_ptrs)?;
        (f.q_batch_stride, f.q_row_stride, f.q_head_stride) = strides(q_l, shape.is_varlen);
        (f.k_batch_stride, f.k_row_stride, f.k_head_stride) = strides(k_l, shape.is_varlen);
        (f.v_batch_stride, f.v_row_stride, f.v_head_stride) = strides(v_l, shape.is_varlen);
        (f.o_batch_stride, f.o_row_stride, f.o_head_stride) = strides(o_l, shape.is_varlen);
        f.q = ptr::<T>(q, q_l, &stream)? as *const c_void;
        f.k = ptr::<T>(k, k_l, &stream)? as *const c_void;
        f.v = ptr::<T>(v, v_l, &stream)? as *const c_void;
        f.o = ptr::<T>(o, o_l, &stream)? as *mut c_void;
        f.lse = ptr::<f32>(lse_s, lse_l, &stream)? as *mut f32;
        let (dqp, _g1) = dq.device_ptr_mut(&stream);
        let (dkp, _g2) = dk.device_ptr_mut(&stream);
        let (dvp, _g3) = dv.device_ptr_mut(&stream);
        let q_strides = strides(q_l, shape.is_varlen);
        let k_strides = strides(k_l, shape.is_varlen);
        let do_strides = strides(do_l, shape.is_varlen);
        let p = ffi::CfBwdParams {
            fwd: f,
            dout: ptr::<T>(dout, do_l, &stream)? as *const c_void,
            do_batch_stride: do_strides.0,
            do_row_stride: do_strides.1,
            do_head_stride: do_strides.2,
            dq: dqp as *mut c_void,
            dk: dkp as *mut c_void,
            dv: dvp as *mut c_void,
            dq_batch_stride: q_strides.0,
            dq_row_stride: q_strides.1,
            dq_head_stride: q_strides.2,
            dk_batch_stride: k_strides.0,
            dk_row_stride: k_strides.1,
            dk_head_stride: k_strides.2,
            dv_batch_stride: k_strides.0,
            dv_row_stride: k_strides.1,
            dv_head_stride: k_strides.2,
            deterministic: opts.deterministic as i32,
            total_q: shape.total_q as i32,
            total_k: shape.total_k as i32,
        };
        // SAFETY: reads only the params struct.
        let ws_bytes = unsafe { ffi::cf_bwd_workspace_size(&p) };
        // SAFETY: the workspace's contents are undefined on entry by contract (cf_bwd clears
        // what it needs on the stream).
        let mut workspace = unsafe { dev.alloc::<u8>(ws_bytes.max(1)) }?;
        let (wp, _wg) = workspace.device_ptr_mut(&stream);
        // SAFETY: as in the forward: live buffers of the described extents, enqueued on
        // candle's stream.
        let status = unsafe { ffi::cf_bwd(&p, wp as *mut c_void, stream.cu_stream() as *mut c_void) };
        check(status, "cf_bwd")?;
    }
    Ok((T::wrap_cuda_slice(dq, dev.clone()), T::wrap_cuda_slice(dk, dev.clone()), T::wrap_cuda_slice(dv, dev)))
}

/// Lets the device's default memory pool keep freed memory instead of returning it to the
/// driver at every synchronisation. candle allocates every output with `cuMemAllocAsync` from
/// that pool, whose release threshold is 0 by default, so each call otherwise pays for mapping
/// fresh memory (PyTorch's caching allocator avoids the same cost). Process-wide for the device;
/// the examples call it, library users may.
pub fn enable_allocation_caching(device: &CudaDevice) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let cu_device = device.cuda_stream().context().cu_device();
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: plain driver calls on a valid device handle with out-pointers to locals.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, cu_device).result().map_err(|e| cuda_err("default mem pool", e))?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut c_void,
        )
        .result()
        .map_err(|e| cuda_err("mem pool release threshold", e))?;
    }
    Ok(())
}
