//! The one source of truth for options and shapes: [`FlashAttnOptions`] holds every option of
//! every public variant, and [`validate`] is the only place that checks arguments. Both the CPU
//! and the CUDA paths (and the reference) consume the [`AttnShape`] it returns.
//!
//! What the shapes alone show is checked on every call and every device. The *values* of the
//! option tensors (varlen offsets, ALiBi slopes) live on the tensors' device: on the CPU they
//! are read and checked on every call (free there), on CUDA only on request
//! ([`FlashAttnOptions::check_device_data()`] or `CANDLE_FLASH_CHECK_DEVICE_DATA=1`), because
//! reading them is a host copy that stalls the stream and breaks CUDA-graph capture. Unchecked
//! bad offsets on CUDA are clamped by the kernels (never an access outside the tensors).

use crate::op::BwdInputs;
use candle_core::{bail, DType, Device, Error, Tensor};
use std::sync::OnceLock;

/// On CUDA, max_seqlen_q + max_seqlen_k must stay below this (2^29): the kernels' mask
/// arithmetic is 32-bit (`kernels/common/mask.cuh`, checked again in `kernels/dispatch.cu`).
pub const MAX_CUDA_SEQLEN_SUM: usize = 1 << 29;

/// On CUDA, batch and query heads are at most this (the launch grids' y and z dimensions).
pub const MAX_CUDA_GRID_YZ: usize = 65535;

/// Largest head dimension any path supports.
pub const MAX_HEAD_DIM: usize = 256;

/// Variable-length batching: sequences packed along the first axis, `seqlens_*` are the
/// cumulative offsets (u32, length B+1, starting at 0 and ending at the packed total).
#[derive(Clone, Debug)]
pub struct VarLen {
    pub seqlens_q: Tensor,
    pub seqlens_k: Tensor,
    pub max_seqlen_q: usize,
    pub max_seqlen_k: usize,
}

/// Every option of every public `flash_attn*` function. The defaults are plain full attention.
#[derive(Clone, Debug)]
pub struct FlashAttnOptions {
    /// Multiplies q·k before the softmax (usually `1/sqrt(D)`).
    pub softmax_scale: f32,
    /// Keys more than this many positions left of the (bottom-right aligned) diagonal are
    /// masked; `None` is unbounded.
    pub window_size_left: Option<usize>,
    /// Keys more than this many positions right of the diagonal are masked; `None` is
    /// unbounded. Causal attention is `(None, Some(0))`.
    pub window_size_right: Option<usize>,
    /// `Some(c)`, c > 0: the logit s becomes `c·tanh(s/c)` before ALiBi and masking.
    pub softcap: Option<f32>,
    /// f32 slopes of shape `[H]` or `[B, H]`: adds `-slope·|i + Sk - Sq - j|` to the logits.
    pub alibi_slopes: Option<Tensor>,
    /// Packed variable-length sequences (q is `(total_q, H, D)`).
    pub varlen: Option<VarLen>,
    /// Backward only: give bit-identical gradients run to run (no order-dependent atomics).
    pub deterministic: bool,
    /// CUDA: copy the varlen offsets and ALiBi slopes to the host and check their values on
    /// every call (a stream synchronisation; not capturable in a CUDA graph). Off by default,
    /// where bad offsets give unspecified values in the affected rows but never an access
    /// outside the tensors. Also turned on for every call by the environment variable
    /// [`CHECK_DEVICE_DATA_ENV`]`=1`. The CPU always checks (reading there is free).
    pub check_device_data: bool,
}

/// Environment variable that turns [`FlashAttnOptions::check_device_data()`] on for every call
/// (any value but empty or `0`; read once per process).
pub const CHECK_DEVICE_DATA_ENV: &str = "CANDLE_FLASH_CHECK_DEVICE_DATA";

fn check_device_data_env() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var(CHECK_DEVICE_DATA_ENV).is_ok_and(|v| !v.is_empty() && v != "0"))
}

impl FlashAttnOptions {
    pub fn new(softmax_scale: f32) -> Self {
        Self {
            softmax_scale,
            window_size_left: None,
            window_size_right: None,
            softcap: None,
            alibi_slopes: None,
            varlen: None,
            deterministic: false,
            check_device_data: false,
        }
    }

    /// Bottom-right aligned causal mask when `causal`, nothing otherwise.
    pub fn causal(mut self, causal: bool) -> Self {
        if causal {
            self.window_size_right = Some(0);
        }
        self
    }

    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.window_size_left = left;
        self.window_size_right = right;
        self
    }

    pub fn alibi(mut self, slopes: Option<&Tensor>) -> Self {
        self.alibi_slopes = slopes.cloned();
        self
    }

    pub fn softcap(mut self, softcap: Option<f32>) -> Self {
        self.softcap = softcap;
        self
    }

    pub fn varlen(mut self, varlen: Option<VarLen>) -> Self {
        self.varlen = varlen;
        self
    }

    pub fn deterministic(mut self, deterministic: bool) -> Self {
        self.deterministic = deterministic;
        self
    }

    /// Sets the field `check_device_data`: on CUDA, read and check the values of the varlen
    /// offsets and ALiBi slopes on every call (a host synchronisation).
    pub fn check_device_data(mut self, check: bool) -> Self {
        self.check_device_data = check;
        self
    }

    pub fn is_causal(&self) -> bool {
        self.window_size_left.is_none() && self.window_size_right == Some(0)
    }
}

/// One sequence of the batch: where its rows start in the packed row axis, and how many.
/// For the batched layout, sequence b starts at `b * Sq` (resp. `b * Sk`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSpan {
    pub q_start: usize,
    pub q_len: usize,
    pub k_start: usize,
    pub k_len: usize,
}

impl SeqSpan {
    /// The offset that aligns the causal/window diagonal bottom-right: query i sits at key
    /// position `i + diag_offset()`.
    pub fn diag_offset(&self) -> isize {
        self.k_len as isize - self.q_len as isize
    }
}

/// Validated shapes of one call. Rows are packed: q is viewed as `(total_q, H, D)` and k/v as
/// `(total_k, Hkv, D)` for both layouts. Every field but [`Self::host`] comes from the shapes
/// alone, so the CUDA path needs no device data on the host.
#[derive(Clone, Debug)]
pub struct AttnShape {
    pub dtype: DType,
    /// B (varlen: the length of the seqlens minus one).
    pub batch: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Batched: Sq and Sk. Varlen: max_seqlen_q and max_seqlen_k, capped at the totals (no
    /// sequence can be longer than its packed tensor).
    pub max_seqlen_q: usize,
    pub max_seqlen_k: usize,
    pub total_q: usize,
    pub total_k: usize,
    pub is_varlen: bool,
    /// ALiBi slopes of shape `[B, H]` (false for `[H]` or no ALiBi).
    pub alibi_per_batch: bool,
    /// The checked values of the device-held options: always on the CPU (and for the
    /// reference), on CUDA only when [`FlashAttnOptions::check_device_data()`] asked for them.
    pub host: Option<HostData>,
}

/// The values of the option tensors, read to the host and checked by [`validate`]: where each
/// sequence lies (from the varlen offsets, or the batched shape) and the ALiBi slopes.
#[derive(Clone, Debug)]
pub struct HostData {
    pub seqs: Vec<SeqSpan>,
    /// `batch * num_heads` slopes, one per (b, h).
    alibi: Option<Vec<f32>>,
    num_heads: usize,
}

impl HostData {
    pub fn alibi_slope(&self, b: usize, h: usize) -> Option<f32> {
        self.alibi.as_ref().map(|s| s[b * self.num_heads + h])
    }

    pub fn has_alibi(&self) -> bool {
        self.alibi.is_some()
    }
}

impl AttnShape {
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// The host values; always there for CPU tensors (validate reads them on the CPU).
    pub fn host(&self) -> candle_core::Result<&HostData> {
        self.host.as_ref().ok_or_else(|| Error::Msg("candle-flash: the seqlens/ALiBi values were not read".into()))
    }

    /// Shape of the log-sum-exp: `(B, H, Sq)` batched, `(H, total_q)` varlen.
    pub fn lse_dims(&self) -> Vec<usize> {
        if self.is_varlen {
            vec![self.num_heads, self.total_q]
        } else {
            vec![self.batch, self.num_heads, self.max_seqlen_q]
        }
    }

    /// Index of (row i of `seq`, head h) in the LSE buffer laid out as [`Self::lse_dims`].
    pub fn lse_index(&self, seq: &SeqSpan, h: usize, i: usize) -> usize {
        if self.is_varlen {
            h * self.total_q + seq.q_start + i
        } else {
            // Sequence b starts at row b * Sq: (b * H + h) * Sq + i.
            seq.q_start * self.num_heads + h * self.max_seqlen_q + i
        }
    }

    /// The key range `[lo, hi)` that query row `i` of `seq` may see (possibly empty).
    pub fn key_range(&self, opts: &FlashAttnOptions, seq: &SeqSpan, i: usize) -> (usize, usize) {
        let pos = i as isize + seq.diag_offset();
        let lo = match opts.window_size_left {
            Some(w) => (pos - w as isize).max(0),
            None => 0,
        };
        let hi = match opts.window_size_right {
            Some(w) => (pos + w as isize + 1).min(seq.k_len as isize),
            None => seq.k_len as isize,
        };
        if hi <= lo {
            (0, 0)
        } else {
            (lo as usize, hi as usize)
        }
    }

    /// The query range `[lo, hi)` that can see key row `j` of `seq` (possibly empty).
    pub fn query_range(&self, opts: &FlashAttnOptions, seq: &SeqSpan, j: usize) -> (usize, usize) {
        // Query i sees j iff pos(i) - wl <= j <= pos(i) + wr with pos(i) = i + offset.
        let base = j as isize - seq.diag_offset();
        let lo = match opts.window_size_right {
            Some(w) => (base - w as isize).max(0),
            None => 0,
        };
        let hi = match opts.window_size_left {
            Some(w) => (base + w as isize + 1).min(seq.q_len as isize),
            None => seq.q_len as isize,
        };
        if hi <= lo {
            (0, 0)
        } else {
            (lo as usize, hi as usize)
        }
    }
}

fn check_float_dtype(name: &str, t: &Tensor, allow_f64: bool) -> candle_core::Result<()> {
    match t.dtype() {
        DType::F32 | DType::F16 | DType::BF16 => Ok(()),
        DType::F64 if allow_f64 => Ok(()),
        dt => bail!("candle-flash: {name} has dtype {dt:?}, expected f32, f16 or bf16"),
    }
}

fn check_same_device(name: &str, t: &Tensor, device: &Device) -> candle_core::Result<()> {
    if !t.device().same_device(device) {
        bail!("candle-flash: {name} is on {:?} but q is on {:?}", t.device().location(), device.location())
    }
    Ok(())
}

fn check_last_dim_contiguous(name: &str, t: &Tensor) -> candle_core::Result<()> {
    if t.rank() > 0 && t.dims()[t.rank() - 1] > 1 && t.stride()[t.rank() - 1] != 1 {
        bail!("candle-flash: the last dimension of {name} must be contiguous, strides are {:?}", t.stride())
    }
    Ok(())
}

/// Reads cumulative seqlens to the host and checks them against the packed total and max
/// (the shape-only checks of the tensor are done before).
fn read_seqlens(name: &str, t: &Tensor, total: usize, max: usize) -> candle_core::Result<Vec<usize>> {
    let offsets: Vec<usize> = t.to_vec1::<u32>()?.into_iter().map(|x| x as usize).collect();
    if offsets[0] != 0 {
        bail!("candle-flash: {name} must start at 0, got {offsets:?}")
    }
    for (b, w) in offsets.windows(2).enumerate() {
        if w[1] < w[0] {
            bail!("candle-flash: {name} is not monotonic at sequence {b}: {offsets:?}")
        }
        if w[1] - w[0] > max {
            bail!("candle-flash: sequence {b} of {name} has length {} > max_seqlen {max}", w[1] - w[0])
        }
    }
    if *offsets.last().unwrap() != total {
        bail!("candle-flash: {name} ends at {} but the packed tensor has {total} rows", offsets.last().unwrap())
    }
    Ok(offsets)
}

/// Shape-only checks of a seqlens tensor; returns its number of sequences B.
fn seqlens_batch(name: &str, t: &Tensor, device: &Device) -> candle_core::Result<usize> {
    check_same_device(name, t, device)?;
    if t.dtype() != DType::U32 {
        bail!("candle-flash: {name} has dtype {:?}, expected u32", t.dtype())
    }
    if t.rank() != 1 || t.dim(0)? < 2 {
        bail!("candle-flash: {name} must be 1-D with B+1 >= 2 cumulative offsets, got shape {:?}", t.dims())
    }
    Ok(t.dim(0)? - 1)
}

/// Checks q, k, v and the options, for every variant and every device, and returns the shape.
/// Device-specific rules: CUDA's head dim (a multiple of 8, for 16-byte loads) and 32-bit
/// sizes; the option tensors' values are read and checked on the CPU always, on CUDA only when
/// asked (see the module documentation).
pub fn validate(q: &Tensor, k: &Tensor, v: &Tensor, opts: &FlashAttnOptions) -> candle_core::Result<AttnShape> {
    let read = !q.device().is_cuda() || opts.check_device_data || check_device_data_env();
    validate_inner(q, k, v, opts, false, read)
}

/// [`validate`] for the reference, which also computes in f64 (the tests' ground truth) and
/// always needs the values on the host.
pub fn validate_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttnOptions,
) -> candle_core::Result<AttnShape> {
    validate_inner(q, k, v, opts, true, true)
}

fn validate_inner(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttnOptions,
    allow_f64: bool,
    read_device_data: bool,
) -> candle_core::Result<AttnShape> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        check_float_dtype(name, t, allow_f64)?;
        check_same_device(name, t, q.device())?;
        check_last_dim_contiguous(name, t)?;
    }
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        bail!("candle-flash: dtype mismatch: q {:?}, k {:?}, v {:?}", q.dtype(), k.dtype(), v.dtype())
    }
    let want_rank = if opts.varlen.is_some() { 3 } else { 4 };
    let layout = if opts.varlen.is_some() { "(total, heads, head_dim)" } else { "(batch, seq, heads, head_dim)" };
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.rank() != want_rank {
            bail!("candle-flash: {name} must have rank {want_rank} {layout}, got shape {:?}", t.dims())
        }
    }
    if k.dims() != v.dims() {
        bail!("candle-flash: k and v must have the same shape, got k {:?} and v {:?}", k.dims(), v.dims())
    }
    let r = want_rank;
    let (num_heads, head_dim) = (q.dims()[r - 2], q.dims()[r - 1]);
    let (num_kv_heads, kv_head_dim) = (k.dims()[r - 2], k.dims()[r - 1]);
    if kv_head_dim != head_dim {
        bail!("candle-flash: head dims differ: q has {head_dim}, k and v have {kv_head_dim}")
    }
    if head_dim == 0 || head_dim > MAX_HEAD_DIM {
        bail!("candle-flash: head dim {head_dim} is not supported (1..={MAX_HEAD_DIM})")
    }
    if q.device().is_cuda() && head_dim % 8 != 0 {
        bail!("candle-flash: head dim {head_dim} is not supported on CUDA (multiple of 8 up to {MAX_HEAD_DIM})")
    }
    if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
        bail!("candle-flash: q has {num_heads} heads, which is not a multiple of k/v's {num_kv_heads} heads")
    }
    if !opts.softmax_scale.is_finite() {
        bail!("candle-flash: softmax_scale must be finite, got {}", opts.softmax_scale)
    }
    if let Some(c) = opts.softcap {
        if !(c > 0.0 && c.is_finite()) {
            bail!("candle-flash: softcap must be finite and > 0, got {c}")
        }
    }

    let (batch, max_seqlen_q, max_seqlen_k, total_q, total_k) = match &opts.varlen {
        None => {
            let (b, sq) = (q.dims()[0], q.dims()[1]);
            let (bk, sk) = (k.dims()[0], k.dims()[1]);
            if bk != b {
                bail!("candle-flash: batch sizes differ: q has {b}, k and v have {bk}")
            }
            (b, sq, sk, b * sq, b * sk)
        }
        Some(vl) => {
            let (total_q, total_k) = (q.dims()[0], k.dims()[0]);
            let bq = seqlens_batch("seqlens_q", &vl.seqlens_q, q.device())?;
            let bk = seqlens_batch("seqlens_k", &vl.seqlens_k, q.device())?;
            if bq != bk {
                bail!("candle-flash: seqlens_q has {} entries but seqlens_k has {}", bq + 1, bk + 1)
            }
            for (name, total, max) in [("q", total_q, vl.max_seqlen_q), ("k", total_k, vl.max_seqlen_k)] {
                if total > u32::MAX as usize {
                    bail!("candle-flash: {name} has {total} rows, more than u32 seqlens can address")
                }
                if max == 0 && total > 0 {
                    bail!("candle-flash: max_seqlen_{name} is 0 but {name} has {total} rows")
                }
            }
            (bq, vl.max_seqlen_q.min(total_q), vl.max_seqlen_k.min(total_k), total_q, total_k)
        }
    };
    if q.device().is_cuda() && [batch, max_seqlen_q, max_seqlen_k].iter().any(|&x| x > i32::MAX as usize) {
        bail!(
            "candle-flash: batch {batch}, max_seqlen_q {max_seqlen_q} and max_seqlen_k {max_seqlen_k} must fit \
             the CUDA kernels' 32-bit sizes"
        )
    }
    // Grid dimensions y / z of the CUDA launches (kernels/dispatch.cu checks them again).
    if q.device().is_cuda() && (batch > MAX_CUDA_GRID_YZ || num_heads > MAX_CUDA_GRID_YZ) {
        bail!("candle-flash: batch {batch} and heads {num_heads} must be at most {MAX_CUDA_GRID_YZ} on CUDA")
    }
    // The kernels' mask arithmetic is 32-bit (kernels/common/mask.cuh): |positions| < 2^30.
    if q.device().is_cuda() && max_seqlen_q + max_seqlen_k >= MAX_CUDA_SEQLEN_SUM {
        bail!(
            "candle-flash: max_seqlen_q {max_seqlen_q} + max_seqlen_k {max_seqlen_k} must be below \
             {MAX_CUDA_SEQLEN_SUM} on CUDA"
        )
    }

    if let Some(s) = &opts.alibi_slopes {
        check_same_device("alibi_slopes", s, q.device())?;
        if s.dtype() != DType::F32 {
            bail!("candle-flash: alibi_slopes must be f32, got {:?}", s.dtype())
        }
        match s.dims() {
            [h] if *h == num_heads => {}
            [b, h] if *b == batch && *h == num_heads => {}
            dims => {
                bail!(
                    "candle-flash: alibi_slopes must have shape [{num_heads}] or [{batch}, {num_heads}], got {dims:?}"
                )
            }
        }
    }

    let host = if read_device_data { Some(read_host_data(q, k, opts, batch, num_heads)?) } else { None };

    Ok(AttnShape {
        dtype: q.dtype(),
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        max_seqlen_q,
        max_seqlen_k,
        total_q,
        total_k,
        is_varlen: opts.varlen.is_some(),
        alibi_per_batch: opts.alibi_slopes.as_ref().is_some_and(|s| s.rank() == 2),
        host,
    })
}

/// The values part of [`validate_inner`] (after every shape check): copies the varlen offsets
/// and ALiBi slopes to the host and checks them.
fn read_host_data(
    q: &Tensor,
    k: &Tensor,
    opts: &FlashAttnOptions,
    batch: usize,
    num_heads: usize,
) -> candle_core::Result<HostData> {
    let seqs = match &opts.varlen {
        None => {
            let (sq, sk) = (q.dims()[1], k.dims()[1]);
            (0..batch).map(|i| SeqSpan { q_start: i * sq, q_len: sq, k_start: i * sk, k_len: sk }).collect()
        }
        Some(vl) => {
            let oq = read_seqlens("seqlens_q", &vl.seqlens_q, q.dims()[0], vl.max_seqlen_q)?;
            let ok = read_seqlens("seqlens_k", &vl.seqlens_k, k.dims()[0], vl.max_seqlen_k)?;
            (0..batch)
                .map(|b| SeqSpan { q_start: oq[b], q_len: oq[b + 1] - oq[b], k_start: ok[b], k_len: ok[b + 1] - ok[b] })
                .collect()
        }
    };
    let alibi = match &opts.alibi_slopes {
        None => None,
        Some(s) => {
            let values = s.flatten_all()?.to_vec1::<f32>()?;
            if let Some(i) = values.iter().position(|x| !x.is_finite()) {
                bail!("candle-flash: alibi_slopes must be finite, got {} at index {i}", values[i])
            }
            // One slope per (b, h): repeat the [H] form over the batch.
            Some(if s.rank() == 1 { values.repeat(batch) } else { values })
        }
    };
    Ok(HostData { seqs, alibi, num_heads })
}

/// Checks the extra tensors of a backward call (out, grad_out, lse) against the forward's shape.
pub fn validate_backward(shape: &AttnShape, x: &BwdInputs<&Tensor>) -> candle_core::Result<()> {
    let q = x.q;
    for (name, t) in [("out", x.out), ("grad_out", x.grad_out)] {
        check_same_device(name, t, q.device())?;
        if t.dims() != q.dims() {
            bail!("candle-flash: {name} has shape {:?}, expected q's {:?}", t.dims(), q.dims())
        }
        if t.dtype() != q.dtype() {
            bail!("candle-flash: {name} has dtype {:?}, expected q's {:?}", t.dtype(), q.dtype())
        }
    }
    check_same_device("lse", x.lse, q.device())?;
    if x.lse.dtype() != DType::F32 || x.lse.dims() != shape.lse_dims().as_slice() {
        bail!(
            "candle-flash: lse must be f32 of shape {:?}, got {:?} {:?}",
            shape.lse_dims(),
            x.lse.dtype(),
            x.lse.dims()
        )
    }
    Ok(())
}
