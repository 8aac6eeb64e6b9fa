//! Launch code for our CUDA kernels (`kernels/`, compiled by build.rs into a static library).
//!
//! Everything runs on candle's stream for the device; every entry point's status is checked
//! and turned into a `candle_core::Error` that names the kernel. A tensor on CUDA never falls
//! back to the CPU path. Nothing here synchronises with the host (so a call can be captured in
//! a CUDA graph): scratch memory of either direction comes from candle's stream-ordered
//! allocator ([`workspace`]), and the values of the option tensors are never read here (see
//! `crate::params`). The kernel parameters are built in one place ([`fwd_params`], embedded by
//! the backward's) from one [`TensorArg`] per tensor.

mod ffi;
mod serving;

use crate::block_mask::{BlockMask, MaskSpec};
use crate::inputs::{device_storage, BwdInputs, Fp8Kernel, StorageGuard};
use crate::params::{AttnShape, FlashAttnOptions};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    result::memset_d8_async, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop, ValidAsZeroBits,
};
use candle_core::cuda_backend::CudaDType;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Error, Layout, Result, Tensor};
use half::{bf16, f16};
use std::ffi::{c_char, c_void, CStr};
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

fn dtype_code(dtype: DType) -> Result<i32> {
    Ok(match dtype {
        DType::F32 => ffi::CF_F32,
        DType::F16 => ffi::CF_F16,
        DType::BF16 => ffi::CF_BF16,
        DType::F8E4M3 => ffi::CF_E4M3,
        dt => bail!("candle-flash: unsupported dtype {dt:?} on cuda"),
    })
}

/// One tensor a kernel reads or writes: its device pointer (at the layout's start offset) and
/// its strides in elements. Holds the buffer's stream-ordering record until it is dropped,
/// after the launch is enqueued.
struct TensorArg<'a> {
    ptr: u64,
    stride: Vec<usize>,
    _sync: SyncOnDrop<'a>,
}

impl<'a> TensorArg<'a> {
    /// A tensor the kernel reads (inputs, ALiBi slopes, varlen offsets), of any dtype.
    fn read((s, l): (&'a CudaStorage, &Layout), stream: &'a CudaStream) -> Result<Self> {
        fn base<'a, T: CudaDType + 'a>(s: &'a CudaStorage, stream: &'a CudaStream) -> Result<(u64, SyncOnDrop<'a>)> {
            Ok(s.as_cuda_slice::<T>()?.device_ptr(stream))
        }
        let (ptr, sync) = match s.dtype() {
            DType::F32 => base::<f32>(s, stream)?,
            DType::F16 => base::<f16>(s, stream)?,
            DType::BF16 => base::<bf16>(s, stream)?,
            DType::U32 => base::<u32>(s, stream)?,
            DType::I32 => base::<i32>(s, stream)?,
            DType::F8E4M3 => base::<float8::F8E4M3>(s, stream)?,
            dt => bail!("candle-flash: unexpected dtype {dt:?} on cuda"),
        };
        let offset = l.start_offset() * s.dtype().size_in_bytes();
        Ok(Self { ptr: ptr + offset as u64, stride: l.stride().to_vec(), _sync: sync })
    }

    /// A buffer the kernel writes, contiguous with dimensions `dims`.
    fn write<T>(slice: &'a mut CudaSlice<T>, dims: &[usize], stream: &'a CudaStream) -> Self {
        let stride = Layout::contiguous(dims).stride().to_vec();
        let (ptr, sync) = slice.device_ptr_mut(stream);
        Self { ptr, stride, _sync: sync }
    }

    /// (batch, row, head) strides of a q/k/v-shaped tensor (`flash_api.h`'s addressing).
    fn strides(&self, is_varlen: bool) -> (i64, i64, i64) {
        let s = &self.stride;
        if is_varlen {
            (0, s[0] as i64, s[1] as i64)
        } else {
            (s[0] as i64, s[1] as i64, s[2] as i64)
        }
    }
}

fn const_ptr(a: &TensorArg) -> *const c_void {
    a.ptr as *const c_void
}

fn mut_ptr(a: &TensorArg) -> *mut c_void {
    a.ptr as *mut c_void
}

/// The tensors of a forward launch (for the backward: the forward's, all read).
struct FwdArgs<'a> {
    q: TensorArg<'a>,
    k: TensorArg<'a>,
    v: TensorArg<'a>,
    o: TensorArg<'a>,
    lse: TensorArg<'a>,
    /// [`OPTION_TENSORS`], where the options have them, then a block mask's tensors
    /// ([`BlockMaskTensors`]).
    options: Vec<Option<TensorArg<'a>>>,
}

/// The option tensors the kernels read, in the order of [`option_tensors`].
const OPTION_TENSORS: [&str; 6] =
    ["alibi_slopes", "seqlens_q", "seqlens_k", "block_table", "sinks", "mm_prefix_ranges"];

/// The option tensors the kernels read ([`OPTION_TENSORS`]: ALiBi slopes, cu_seqlens_q,
/// cu_seqlens_k, the paged block table, the sinks, the prefix ranges; then, with a block mask,
/// its eight lists and its rule's data: [`BlockMaskTensors`]), contiguous (usually the tensors
/// themselves), to be kept alive until the launch is enqueued.
fn option_tensors(opts: &FlashAttnOptions) -> Result<Vec<Option<Tensor>>> {
    let vl = opts.varlen.as_ref();
    let contiguous = |t: Option<&Tensor>| t.map(Tensor::contiguous).transpose();
    let mut tensors = vec![
        contiguous(opts.alibi_slopes.as_ref())?,
        contiguous(vl.map(|v| &v.seqlens_q))?,
        contiguous(vl.map(|v| &v.seqlens_k))?,
        contiguous(opts.paged.as_ref().map(|p| &p.block_table))?,
        contiguous(opts.sinks.as_ref())?,
        contiguous(opts.mm_prefix_ranges.as_ref())?,
    ];
    if let Some(mask) = &opts.block_mask {
        for t in BlockMaskTensors::of(mask)?.tensors {
            tensors.push(contiguous(t.as_ref())?);
        }
    }
    Ok(tensors)
}

/// The storage guards of [`option_tensors`]: read them as [`option_args`].
fn option_guards(tensors: &[Option<Tensor>]) -> Vec<Option<StorageGuard<'_>>> {
    tensors.iter().map(|t| t.as_ref().map(Tensor::storage_and_layout)).collect()
}

fn option_args<'a>(
    guards: &'a [Option<StorageGuard<'_>>],
    stream: &'a CudaStream,
) -> Result<Vec<Option<TensorArg<'a>>>> {
    guards
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let name = OPTION_TENSORS.get(i).copied().unwrap_or("block_mask");
            g.as_ref().map(|g| TensorArg::read(device_storage::<CudaStorage>(name, g)?, stream)).transpose()
        })
        .collect()
}

/// A block mask as the kernels read it (flash_api.h `CfBlockMask`): its eight lists, then each
/// rule node's query-side and key-side data (document ids, prefix lengths), in node order. The
/// rule goes to the kernels as an OR of AND terms (its disjunctive form, at most
/// `CF_MASK_MAX_NODES` rules in all).
struct BlockMaskTensors {
    tensors: Vec<Option<Tensor>>,
    /// The nodes, their data pointers still null (filled from the tensors' arguments).
    nodes: Vec<ffi::CfMaskNode>,
}

impl BlockMaskTensors {
    fn of(mask: &BlockMask) -> Result<Self> {
        let lists = [
            mask.kv_num_blocks(),
            mask.kv_indices(),
            mask.full_kv_num_blocks(),
            mask.full_kv_indices(),
            mask.q_num_blocks(),
            mask.q_indices(),
            mask.full_q_num_blocks(),
            mask.full_q_indices(),
        ];
        let mut tensors: Vec<Option<Tensor>> = lists.into_iter().map(|t| Some(t.clone())).collect();
        let mut nodes = vec![];
        let terms = mask.spec().map_or(vec![], dnf);
        if terms.iter().map(|t| t.len().max(1)).sum::<usize>() > ffi::CF_MASK_MAX_NODES {
            bail!(
                "candle-flash: the block mask's rule has more than {} rules in its OR-of-ANDs form, more than the \
                 CUDA kernels take: simplify it, or run the call on the CPU",
                ffi::CF_MASK_MAX_NODES
            )
        }
        let far = |x: usize| x.min(1 << 29) as i32;
        for term in terms {
            if term.is_empty() {
                // an empty AND: every key (a node without data)
                nodes.push(ffi::CfMaskNode { op: ffi::CF_MASK_ALL, ..ffi::CfMaskNode::NONE });
                tensors.extend([None, None]);
            }
            for leaf in term {
                let (op, a, b, q, k) = match leaf {
                    MaskSpec::Causal => (ffi::CF_MASK_CAUSAL, 0, 0, None, None),
                    MaskSpec::Window { left, right } => {
                        (ffi::CF_MASK_WINDOW, left.map_or(-1, far), right.map_or(-1, far), None, None)
                    }
                    MaskSpec::SameDocument { q_doc, k_doc } => {
                        (ffi::CF_MASK_SAME_DOCUMENT, 0, 0, Some(q_doc.clone()), Some(k_doc.clone()))
                    }
                    MaskSpec::PrefixLm { prefix } => (ffi::CF_MASK_PREFIX_LM, 0, 0, Some(prefix.clone()), None),
                    MaskSpec::Chunked { chunk } => (ffi::CF_MASK_CHUNKED, far(*chunk).max(1), 0, None, None),
                    MaskSpec::GlobalTokens { n } => (ffi::CF_MASK_GLOBAL_TOKENS, far(*n), 0, None, None),
                    MaskSpec::And(_) | MaskSpec::Or(_) => unreachable!("dnf returns leaves"),
                };
                // rows of the per-sequence data: [B or 1, S] ids, [B or 1] prefix lengths
                let stride = |t: &Option<Tensor>| -> Result<i64> {
                    Ok(match t {
                        Some(t) if t.dim(0)? > 1 => t.elem_count() as i64 / t.dim(0)? as i64,
                        _ => 0,
                    })
                };
                let (q_batch_stride, k_batch_stride) = (stride(&q)?, stride(&k)?);
                nodes.push(ffi::CfMaskNode { op, a, b, q_batch_stride, k_batch_stride, ..ffi::CfMaskNode::NONE });
                tensors.push(q);
                tensors.push(k);
            }
            nodes.last_mut().expect("a term has a node").last_in_term = 1;
        }
        Ok(Self { tensors, nodes })
    }

    /// The kernels' `CfBlockMask`, its pointers from `args` (the arguments of [`Self::of`]'s
    /// tensors, in order).
    fn params(mask: &BlockMask, nodes: &[ffi::CfMaskNode], args: &[Option<TensorArg>]) -> Result<ffi::CfBlockMask> {
        let ptr = |i: usize| args[i].as_ref().map_or(std::ptr::null(), |a| a.ptr as *const i32);
        let (batch, heads) = mask.batch_heads();
        let (q_blocks, k_blocks) = mask.num_blocks();
        let mut m = ffi::CfBlockMask {
            kv_num: ptr(0),
            kv_idx: ptr(1),
            full_kv_num: ptr(2),
            full_kv_idx: ptr(3),
            q_num: ptr(4),
            q_idx: ptr(5),
            full_q_num: ptr(6),
            full_q_idx: ptr(7),
            batch: batch as i32,
            heads: heads as i32,
            q_blocks: q_blocks as i32,
            k_blocks: k_blocks as i32,
            n_nodes: nodes.len() as i32,
            ..ffi::CfBlockMask::NONE
        };
        for (x, node) in nodes.iter().enumerate() {
            let data = |i: usize| args[8 + 2 * x + i].as_ref().map_or(std::ptr::null(), |a| a.ptr as *const u32);
            m.nodes[x] = ffi::CfMaskNode { q_data: data(0), k_data: data(1), ..*node };
        }
        Ok(m)
    }
}

/// A rule as an OR of AND terms of its leaves (its disjunctive form: `and` distributes over `or`).
fn dnf(spec: &MaskSpec) -> Vec<Vec<&MaskSpec>> {
    match spec {
        MaskSpec::And(rules) => rules.iter().fold(vec![vec![]], |acc, r| {
            let right = dnf(r);
            acc.iter().flat_map(|t| right.iter().map(move |u| t.iter().chain(u).copied().collect())).collect()
        }),
        MaskSpec::Or(rules) => rules.iter().flat_map(dnf).collect(),
        leaf => vec![vec![leaf]],
    }
}

fn window(w: Option<usize>) -> i32 {
    w.map(|x| x.min(i32::MAX as usize) as i32).unwrap_or(-1)
}

/// The one place the forward parameters are built (the backward embeds them). Sizes were
/// checked to fit by `params::validate`.
fn fwd_params(shape: &AttnShape, opts: &FlashAttnOptions, a: &FwdArgs) -> Result<ffi::CfFwdParams> {
    let varlen = shape.is_varlen;
    let [q, o] = [&a.q, &a.o].map(|t| t.strides(varlen));
    // Paged k / v are (num_blocks, page_block_size, Hkv, D): (page, row, head) strides.
    let [k, v] = [&a.k, &a.v].map(|t| t.strides(varlen && shape.page_block_size.is_none()));
    let lse_dims = shape.lse_dims();
    let (lse_batch_stride, lse_head_stride) =
        if varlen { (0, lse_dims[1] as i64) } else { ((lse_dims[1] * lse_dims[2]) as i64, lse_dims[2] as i64) };
    let opt = |i: usize| a.options[i].as_ref().map_or(std::ptr::null(), const_ptr);
    let [alibi, cu_q, cu_k, table, sinks, prefix] = [0, 1, 2, 3, 4, 5].map(opt);
    let block_mask = match &opts.block_mask {
        Some(mask) => BlockMaskTensors::params(mask, &BlockMaskTensors::of(mask)?.nodes, &a.options[6..])?,
        None => ffi::CfBlockMask::NONE,
    };
    // The table as int32 (a u32 table is passed as is, flash_api.h); sizes fit i32 (validate).
    let (table_stride, page_block_size, num_blocks, max_blocks) = match (&a.options[3], &opts.paged) {
        (Some(t), Some(paged)) => {
            let page = paged.page_block_size;
            (t.stride[0] as i64, page as i32, (shape.total_k / page) as i32, paged.block_table.dim(1)? as i32)
        }
        _ => (0, 0, 0, 0),
    };
    Ok(ffi::CfFwdParams {
        q: const_ptr(&a.q),
        k: const_ptr(&a.k),
        v: const_ptr(&a.v),
        o: mut_ptr(&a.o),
        lse: mut_ptr(&a.lse) as *mut f32,
        alibi_slopes: alibi as *const f32,
        cu_seqlens_q: cu_q as *const u32,
        cu_seqlens_k: cu_k as *const u32,
        q_batch_stride: q.0,
        q_row_stride: q.1,
        q_head_stride: q.2,
        k_batch_stride: k.0,
        k_row_stride: k.1,
        k_head_stride: k.2,
        v_batch_stride: v.0,
        v_row_stride: v.1,
        v_head_stride: v.2,
        o_batch_stride: o.0,
        o_row_stride: o.1,
        o_head_stride: o.2,
        lse_batch_stride,
        lse_head_stride,
        b: shape.batch as i32,
        h: shape.num_heads as i32,
        hkv: shape.num_kv_heads as i32,
        d: shape.head_dim as i32,
        seqlen_q: shape.max_seqlen_q as i32,
        seqlen_k: shape.max_seqlen_k as i32,
        alibi_batch_stride: if shape.alibi_per_batch { shape.num_heads as i32 } else { 0 },
        window_left: window(opts.window_size_left),
        window_right: window(opts.window_size_right),
        softmax_scale: opts.softmax_scale,
        softcap: opts.softcap.unwrap_or(0.0),
        dtype: dtype_code(shape.dtype)?,
        total_q: shape.total_q as i64,
        total_k: shape.total_k as i64,
        block_table: table as *const i32,
        block_table_batch_stride: table_stride,
        page_block_size,
        num_blocks,
        max_blocks,
        o_dtype: dtype_code(shape.dtype)?,
        q_descale: ffi::CfDescale::NONE,
        k_descale: ffi::CfDescale::NONE,
        v_descale: ffi::CfDescale::NONE,
        sinks: sinks as *const f32,
        prefix_ranges: prefix as *const i32,
        dv: shape.head_dim_v as i32,
        prefix_max_ranges: opts.mm_prefix_ranges.as_ref().map_or(Ok(0), |r| r.dim(1))? as i32,
        block_mask,
    })
}

/// [`fwd_params`] for the FP8 kernel: e4m3 q, k, v, the output in `shape.dtype` (what
/// `params::validate_fp8` records), the descales of `fp8` at their device pointers.
fn fp8_params(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    fp8: &Fp8Kernel,
    a: &FwdArgs,
    descales: &[Option<TensorArg>; 3],
) -> Result<ffi::CfFwdParams> {
    let mut p = fwd_params(shape, opts, a)?;
    p.dtype = ffi::CF_E4M3;
    let arg = |i: usize| -> ffi::CfDescale {
        match (&fp8.descales[i], &descales[i]) {
            (Some(d), Some(t)) => ffi::CfDescale {
                ptr: t.ptr as *const f32,
                batch_stride: d.batch_stride as i64,
                head_div: d.head_div as i32,
            },
            _ => ffi::CfDescale::NONE,
        }
    };
    (p.q_descale, p.k_descale, p.v_descale) = (arg(0), arg(1), arg(2));
    Ok(p)
}

/// The descale tensors of an FP8 call, read (contiguous f32 on q's device).
fn descale_guards(fp8: &Fp8Kernel) -> [Option<StorageGuard<'_>>; 3] {
    fp8.descales.each_ref().map(|d| d.as_ref().map(|d| d.tensor.storage_and_layout()))
}

fn descale_args<'a>(
    guards: &'a [Option<StorageGuard<'_>>; 3],
    stream: &'a CudaStream,
) -> Result<[Option<TensorArg<'a>>; 3]> {
    let arg = |g: &'a Option<StorageGuard<'_>>| -> Result<Option<TensorArg<'a>>> {
        g.as_ref().map(|g| TensorArg::read(device_storage::<CudaStorage>("descale", g)?, stream)).transpose()
    };
    Ok([arg(&guards[0])?, arg(&guards[1])?, arg(&guards[2])?])
}

/// Whether the FP8 (e4m3) kernel runs this call on this device (`cf_fwd_check`): sm_90a, the
/// alignment and head-dim rules of flash_api.h. False: the caller computes on dequantized inputs.
pub(crate) fn fp8_kernel_runs(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    fp8: &Fp8Kernel,
    [q, k, v]: [&Tensor; 3],
) -> Result<bool> {
    let dev = match q.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => return Ok(false),
    };
    let stream = dev.cuda_stream();
    let guards = [q, k, v].map(Tensor::storage_and_layout);
    let [gq, gk, gv] = &guards;
    let options = option_tensors(opts)?;
    let option_g = option_guards(&options);
    let dg = descale_guards(fp8);
    let qa = TensorArg::read(device_storage::<CudaStorage>("q", gq)?, &stream)?;
    // The output does not exist yet: it will be a fresh contiguous allocation (aligned), so q's
    // pointer with contiguous strides stands in for it (and for the lse) in the check.
    let stand_in = |dims: &[usize]| TensorArg {
        ptr: qa.ptr,
        stride: Layout::contiguous(dims).stride().to_vec(),
        _sync: SyncOnDrop::Record(None),
    };
    let args = FwdArgs {
        k: TensorArg::read(device_storage::<CudaStorage>("k", gk)?, &stream)?,
        v: TensorArg::read(device_storage::<CudaStorage>("v", gv)?, &stream)?,
        o: stand_in(&{
            let mut dims = gq.1.dims().to_vec();
            *dims.last_mut().expect("rank 3 or 4") = shape.head_dim_v;
            dims
        }),
        lse: stand_in(&shape.lse_dims()),
        options: option_args(&option_g, &stream)?,
        q: qa,
    };
    let p = fp8_params(shape, opts, fp8, &args, &descale_args(&dg, &stream)?)?;
    // SAFETY: reads only the params struct (and queries the device once).
    match unsafe { ffi::cf_fwd_check(&p) } {
        0 => Ok(true),
        ffi::CF_ERR_UNSUPPORTED_DTYPE => Ok(false),
        status => check(status, "cf_fwd_check").map(|_| false),
    }
}

/// The FP8 forward on CUDA (after [`fp8_kernel_runs`]): the output in `shape.dtype` (f16 /
/// bf16), q's dims, contiguous, and the LSE (f32).
pub(crate) fn forward_fp8(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    fp8: &Fp8Kernel,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, CudaStorage)> {
    match shape.dtype {
        DType::F16 => forward_t::<f16>(shape, opts, Some(fp8), [q, k, v], None),
        DType::BF16 => forward_t::<bf16>(shape, opts, Some(fp8), [q, k, v], None),
        dt => bail!("candle-flash fp8: the FP8 kernel writes f16 or bf16, not {dt:?}"),
    }
}

/// Scratch memory of `bytes` bytes from candle's allocator (stream-ordered on candle's stream),
/// for either direction; None when the kernels need none (they then get NULL).
fn workspace(dev: &CudaDevice, bytes: usize) -> Result<Option<CudaSlice<u8>>> {
    if bytes == 0 {
        return Ok(None);
    }
    // SAFETY: the workspace's contents are undefined on entry by contract (flash_api.h).
    Ok(Some(unsafe { dev.alloc::<u8>(bytes) }?))
}

/// Device pointer of a [`workspace`] (NULL for none) and its ordering record.
fn workspace_arg<'a>(ws: &'a mut Option<CudaSlice<u8>>, stream: &'a CudaStream) -> Option<TensorArg<'a>> {
    ws.as_mut().map(|w| {
        let len = w.len();
        TensorArg::write(w, &[len], stream)
    })
}

fn workspace_ptr(ws: &Option<TensorArg>) -> *mut c_void {
    ws.as_ref().map_or(std::ptr::null_mut(), mut_ptr)
}

/// Forward on CUDA: the output (q's dtype and dims with v's head dim, contiguous) and the LSE (f32).
pub(crate) fn forward(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, CudaStorage)> {
    forward_or_describe(shape, opts, [q, k, v], None)
}

/// The plan `cf_fwd` would run for this forward (`cf_fwd_describe`, kernels/flash_api.h), as text.
pub(crate) fn describe_forward(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
) -> Result<String> {
    let mut plan = String::new();
    forward_or_describe(shape, opts, [q, k, v], Some(&mut plan))?;
    Ok(plan)
}

/// The forward, or with `describe` its plan (into the string) and nothing launched.
fn forward_or_describe(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    qkv: [(&CudaStorage, &Layout); 3],
    describe: Option<&mut String>,
) -> Result<(CudaStorage, CudaStorage)> {
    match shape.dtype {
        DType::F32 => forward_t::<f32>(shape, opts, None, qkv, describe),
        DType::F16 => forward_t::<f16>(shape, opts, None, qkv, describe),
        DType::BF16 => forward_t::<bf16>(shape, opts, None, qkv, describe),
        dt => bail!("candle-flash: unsupported dtype {dt:?} on cuda"),
    }
}

/// One call of the kernels: its workspace (`size` bytes) allocated and the call launched on
/// candle's stream (`launch(workspace, stream)`), or, with `describe`, its plan's text written
/// there instead (`plan(buffer, capacity)`: `cf_fwd_describe` / `cf_bwd_describe`) and nothing
/// launched. Each closure returns its entry point's name and status.
fn launch_or_describe(
    dev: &CudaDevice,
    stream: &CudaStream,
    describe: Option<&mut String>,
    plan: impl FnOnce(*mut c_char, usize) -> (&'static str, i32),
    size: impl FnOnce() -> usize,
    launch: impl FnOnce(*mut c_void, *mut c_void) -> (&'static str, i32),
) -> Result<()> {
    if let Some(text) = describe {
        let mut buf = vec![0u8; 256];
        let (entry, status) = plan(buf.as_mut_ptr() as *mut c_char, buf.len());
        check(status, entry)?;
        let end = buf.iter().position(|&c| c == 0).unwrap_or(buf.len());
        *text = String::from_utf8_lossy(&buf[..end]).into_owned();
        return Ok(());
    }
    let mut ws = workspace(dev, size())?;
    let ws = workspace_arg(&mut ws, stream);
    let (entry, status) = launch(workspace_ptr(&ws), stream.cu_stream() as *mut c_void);
    check(status, entry)
}

/// The forward of output type T; `fp8`: q, k, v are e4m3 and the FP8 kernel runs. `describe`:
/// the plan into the string instead of the launch.
fn forward_t<T: CudaDType + DeviceRepr>(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    fp8: Option<&Fp8Kernel>,
    [q, k, v]: [(&CudaStorage, &Layout); 3],
    describe: Option<&mut String>,
) -> Result<(CudaStorage, CudaStorage)> {
    let dev = q.0.device.clone();
    let stream = dev.cuda_stream();
    let (mut out_dims, lse_dims) = (q.1.dims().to_vec(), shape.lse_dims());
    *out_dims.last_mut().expect("rank 3 or 4") = shape.head_dim_v;
    let mut out = alloc_output::<T>(&dev, &stream, out_dims.iter().product())?;
    let mut lse = alloc_output::<f32>(&dev, &stream, lse_dims.iter().product())?;
    if q.1.shape().elem_count() > 0 {
        let options = option_tensors(opts)?;
        let guards = option_guards(&options);
        let descale_g = fp8.map(descale_guards);
        let args = FwdArgs {
            q: TensorArg::read(q, &stream)?,
            k: TensorArg::read(k, &stream)?,
            v: TensorArg::read(v, &stream)?,
            o: TensorArg::write(&mut out, &out_dims, &stream),
            lse: TensorArg::write(&mut lse, &lse_dims, &stream),
            options: option_args(&guards, &stream)?,
        };
        let p = match (fp8, &descale_g) {
            (Some(fp8), Some(g)) => fp8_params(shape, opts, fp8, &args, &descale_args(g, &stream)?)?,
            _ => fwd_params(shape, opts, &args)?,
        };
        launch_or_describe(
            &dev,
            &stream,
            describe,
            // SAFETY: reads the params struct; the buffer is the caller's own, of that length.
            |buf, cap| ("cf_fwd_describe", unsafe { ffi::cf_fwd_describe(&p, buf, cap) }),
            // SAFETY: reads only the params struct.
            || unsafe { ffi::cf_fwd_workspace_size(&p) },
            // SAFETY: every pointer addresses a live device buffer of the extents described by
            // `p` (validated shapes, the tensors' own layouts; the kernels clamp what they read
            // from cu_seqlens to the totals; FP8 descales: live f32 buffers covering every
            // (sequence, head) index, `fp8::kernel_descale`); the workspace is live for the
            // call; the call only enqueues work on candle's stream, which also orders the
            // buffers' later uses and frees.
            |ws, s| ("cf_fwd", unsafe { ffi::cf_fwd(&p, ws, s) }),
        )?;
    } else if let Some(plan) = describe {
        *plan = "none".to_string();
    }
    Ok((T::wrap_cuda_slice(out, dev.clone()), f32::wrap_cuda_slice(lse, dev)))
}

/// Backward on CUDA (contiguous inputs): dq (q's dims), dk, dv (k's dims), contiguous, in the
/// inputs' dtype; and, with sinks and `want_dsinks`, the sinks' gradient (f32 `[H]`).
pub(crate) fn backward(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    x: BwdInputs<(&CudaStorage, &Layout)>,
    want_dsinks: bool,
) -> Result<BwdOutputs> {
    backward_or_describe(shape, opts, x, want_dsinks, None)
}

/// The plan `cf_bwd` would run for this backward (`cf_bwd_describe`), as text.
pub(crate) fn describe_backward(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    x: BwdInputs<(&CudaStorage, &Layout)>,
) -> Result<String> {
    let mut plan = String::new();
    backward_or_describe(shape, opts, x, false, Some(&mut plan))?;
    Ok(plan)
}

fn backward_or_describe(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    x: BwdInputs<(&CudaStorage, &Layout)>,
    want_dsinks: bool,
    describe: Option<&mut String>,
) -> Result<BwdOutputs> {
    match shape.dtype {
        DType::F32 => backward_t::<f32>(shape, opts, x, want_dsinks, describe),
        DType::F16 => backward_t::<f16>(shape, opts, x, want_dsinks, describe),
        DType::BF16 => backward_t::<bf16>(shape, opts, x, want_dsinks, describe),
        dt => bail!("candle-flash: unsupported dtype {dt:?} on cuda"),
    }
}

/// dq, dk, dv and the sinks' gradient (when asked for) of a CUDA backward.
pub(crate) type BwdOutputs = (CudaStorage, CudaStorage, CudaStorage, Option<CudaStorage>);

/// The backward's parameters: the forward's (`fwd`), dout, and the gradients it writes (dq, dk,
/// dv: null for [`sink_grads`], which writes only dsinks).
fn bwd_params(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    fwd: &FwdArgs,
    dout: &TensorArg,
    grads: Option<[&TensorArg; 3]>,
    dsinks: Option<&TensorArg>,
) -> Result<ffi::CfBwdParams> {
    let varlen = shape.is_varlen;
    let dout_s = dout.strides(varlen);
    let none = (0, 0, 0);
    let [dq_s, dk_s, dv_s] = grads.map_or([none; 3], |g| g.map(|t| t.strides(varlen)));
    let [dq, dk, dv] = grads.map_or([std::ptr::null_mut(); 3], |g| g.map(mut_ptr));
    Ok(ffi::CfBwdParams {
        fwd: fwd_params(shape, opts, fwd)?,
        dout: const_ptr(dout),
        do_batch_stride: dout_s.0,
        do_row_stride: dout_s.1,
        do_head_stride: dout_s.2,
        dq,
        dk,
        dv,
        dq_batch_stride: dq_s.0,
        dq_row_stride: dq_s.1,
        dq_head_stride: dq_s.2,
        dk_batch_stride: dk_s.0,
        dk_row_stride: dk_s.1,
        dk_head_stride: dk_s.2,
        dv_batch_stride: dv_s.0,
        dv_row_stride: dv_s.1,
        dv_head_stride: dv_s.2,
        deterministic: opts.deterministic as i32,
        dsinks: dsinks.map_or(std::ptr::null_mut(), |t| mut_ptr(t) as *mut f32),
    })
}

/// The backward of element type T; `describe`: the plan into the string instead of the launch.
fn backward_t<T: CudaDType + DeviceRepr + ValidAsZeroBits>(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    x: BwdInputs<(&CudaStorage, &Layout)>,
    want_dsinks: bool,
    mut describe: Option<&mut String>,
) -> Result<BwdOutputs> {
    let dev = x.q.0.device.clone();
    let stream = dev.cuda_stream();
    let (q_dims, k_dims, v_dims) = (x.q.1.dims().to_vec(), x.k.1.dims().to_vec(), x.v.1.dims().to_vec());
    let (q_len, k_len, v_len): (usize, usize, usize) =
        (q_dims.iter().product(), k_dims.iter().product(), v_dims.iter().product());
    let with_dsinks = want_dsinks && opts.sinks.is_some();
    let h = shape.num_heads;
    if q_len == 0 || k_len == 0 {
        if let Some(plan) = describe.as_mut() {
            **plan = "none".to_string();
        }
        // Nothing to differentiate: zero gradients without a launch (a row without keys puts
        // all its mass on the sink, whose gradient -P_sink * rowsum(dO * 0) is 0 too).
        let zeros = |n: usize| -> Result<CudaSlice<T>> { dev.alloc_zeros::<T>(n.max(1)) };
        let wrap = |s: CudaSlice<T>| T::wrap_cuda_slice(s, dev.clone());
        let dsinks =
            if with_dsinks { Some(f32::wrap_cuda_slice(dev.alloc_zeros::<f32>(h)?, dev.clone())) } else { None };
        return Ok((wrap(zeros(q_len)?), wrap(zeros(k_len)?), wrap(zeros(v_len)?), dsinks));
    }
    let mut dq = alloc_output::<T>(&dev, &stream, q_len)?;
    let mut dk = alloc_output::<T>(&dev, &stream, k_len)?;
    let mut dv = alloc_output::<T>(&dev, &stream, v_len)?;
    let mut dsinks = if with_dsinks { Some(alloc_output::<f32>(&dev, &stream, h)?) } else { None };
    {
        let options = option_tensors(opts)?;
        let guards = option_guards(&options);
        let a = x.try_map(|_, t| TensorArg::read(t, &stream))?;
        let fwd = FwdArgs { q: a.q, k: a.k, v: a.v, o: a.out, lse: a.lse, options: option_args(&guards, &stream)? };
        let (dq, dk, dv) = (
            TensorArg::write(&mut dq, &q_dims, &stream),
            TensorArg::write(&mut dk, &k_dims, &stream),
            TensorArg::write(&mut dv, &v_dims, &stream),
        );
        let dsinks = dsinks.as_mut().map(|s| TensorArg::write(s, &[h], &stream));
        let p = bwd_params(shape, opts, &fwd, &a.grad_out, Some([&dq, &dk, &dv]), dsinks.as_ref())?;
        launch_or_describe(
            &dev,
            &stream,
            describe,
            // SAFETY: reads the params struct; the buffer is the caller's own, of that length.
            |buf, cap| ("cf_bwd_describe", unsafe { ffi::cf_bwd_describe(&p, buf, cap) }),
            // SAFETY: reads only the params struct.
            || unsafe { ffi::cf_bwd_workspace_size(&p) },
            // SAFETY: as in the forward: live buffers of the described extents (the workspace
            // too), enqueued on candle's stream.
            |ws, s| ("cf_bwd", unsafe { ffi::cf_bwd(&p, ws, s) }),
        )?;
    }
    let dsinks = dsinks.map(|s| f32::wrap_cuda_slice(s, dev.clone()));
    Ok((T::wrap_cuda_slice(dq, dev.clone()), T::wrap_cuda_slice(dk, dev.clone()), T::wrap_cuda_slice(dv, dev), dsinks))
}

/// The sinks' gradient alone (f32 `[H]`), from the forward's inputs, output and LSE and the
/// output's gradient (contiguous): `cf_sink_grad`, for autograd's sink node.
pub(crate) fn sink_grads(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    x: BwdInputs<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    let dev = x.q.0.device.clone();
    let stream = dev.cuda_stream();
    let h = shape.num_heads;
    let mut dsinks = alloc_output::<f32>(&dev, &stream, h)?;
    {
        let options = option_tensors(opts)?;
        let guards = option_guards(&options);
        let a = x.try_map(|_, t| TensorArg::read(t, &stream))?;
        let fwd = FwdArgs { q: a.q, k: a.k, v: a.v, o: a.out, lse: a.lse, options: option_args(&guards, &stream)? };
        let out = TensorArg::write(&mut dsinks, &[h], &stream);
        let p = bwd_params(shape, opts, &fwd, &a.grad_out, None, Some(&out))?;
        // SAFETY: reads only the params struct.
        let mut ws = workspace(&dev, unsafe { ffi::cf_sink_grad_workspace_size(&p) })?;
        let ws = workspace_arg(&mut ws, &stream);
        // SAFETY: live buffers of the described extents (o, dout, lse, sinks, dsinks), enqueued
        // on candle's stream.
        let status = unsafe { ffi::cf_sink_grad(&p, workspace_ptr(&ws), stream.cu_stream() as *mut c_void) };
        check(status, "cf_sink_grad")?;
    }
    Ok(f32::wrap_cuda_slice(dsinks, dev))
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

pub(crate) use serving::{add_rms_norm, convert_e4m3, quantize_e4m3, rope_kv_write, silu_mul, QuantStep};
