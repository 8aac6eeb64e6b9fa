//! The one source of truth for options and shapes: [`FlashAttnOptions`] holds every option of
//! every public variant, and [`validate`] is the only place that checks arguments. Both the CPU
//! and the CUDA paths (and the reference) consume the [`AttnShape`] it returns.

use candle_core::{bail, DType, Device, Tensor};

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
/// `(total_k, Hkv, D)` for both layouts.
#[derive(Clone, Debug)]
pub struct AttnShape {
    pub dtype: DType,
    pub batch: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Batched: Sq and Sk. Varlen: max_seqlen_q and max_seqlen_k.
    pub max_seqlen_q: usize,
    pub max_seqlen_k: usize,
    pub total_q: usize,
    pub total_k: usize,
    pub seqs: Vec<SeqSpan>,
    pub is_varlen: bool,
    /// ALiBi slopes copied to the host (`batch * num_heads` values, one per (b, h)).
    pub alibi_per_head: Option<Vec<f32>>,
}

impl AttnShape {
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// Shape of the log-sum-exp: `(B, H, Sq)` batched, `(H, total_q)` varlen.
    pub fn lse_dims(&self) -> Vec<usize> {
        if self.is_varlen {
            vec![self.num_heads, self.total_q]
        } else {
            vec![self.batch, self.num_heads, self.max_seqlen_q]
        }
    }

    /// Index of (sequence b, head h, row i) in the LSE buffer laid out as [`Self::lse_dims`].
    pub fn lse_index(&self, b: usize, h: usize, i: usize) -> usize {
        if self.is_varlen {
            h * self.total_q + self.seqs[b].q_start + i
        } else {
            (b * self.num_heads + h) * self.max_seqlen_q + i
        }
    }

    pub fn alibi_slope(&self, b: usize, h: usize) -> Option<f32> {
        self.alibi_per_head.as_ref().map(|s| s[b * self.num_heads + h])
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

/// Reads cumulative seqlens to the host and checks them against the packed total and max.
fn read_seqlens(name: &str, t: &Tensor, total: usize, max: usize) -> candle_core::Result<Vec<usize>> {
    if t.dtype() != DType::U32 {
        bail!("candle-flash: {name} has dtype {:?}, expected u32", t.dtype())
    }
    if t.rank() != 1 || t.dim(0)? < 2 {
        bail!("candle-flash: {name} must be 1-D with B+1 >= 2 cumulative offsets, got shape {:?}", t.dims())
    }
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

/// Checks q, k, v and the options, for every variant and every device, and returns the shape.
/// The only device-specific rule is CUDA's head dim (a multiple of 8, for 16-byte loads).
pub fn validate(q: &Tensor, k: &Tensor, v: &Tensor, opts: &FlashAttnOptions) -> candle_core::Result<AttnShape> {
    validate_inner(q, k, v, opts, false)
}

/// [`validate`] for the reference, which also computes in f64 (the tests' ground truth).
pub fn validate_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttnOptions,
) -> candle_core::Result<AttnShape> {
    validate_inner(q, k, v, opts, true)
}

fn validate_inner(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttnOptions,
    allow_f64: bool,
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

    let (batch, max_seqlen_q, max_seqlen_k, total_q, total_k, seqs) = match &opts.varlen {
        None => {
            let (b, sq) = (q.dims()[0], q.dims()[1]);
            let (bk, sk) = (k.dims()[0], k.dims()[1]);
            if bk != b {
                bail!("candle-flash: batch sizes differ: q has {b}, k and v have {bk}")
            }
            let seqs = (0..b).map(|i| SeqSpan { q_start: i * sq, q_len: sq, k_start: i * sk, k_len: sk }).collect();
            (b, sq, sk, b * sq, b * sk, seqs)
        }
        Some(vl) => {
            check_same_device("seqlens_q", &vl.seqlens_q, q.device())?;
            check_same_device("seqlens_k", &vl.seqlens_k, q.device())?;
            let (total_q, total_k) = (q.dims()[0], k.dims()[0]);
            let oq = read_seqlens("seqlens_q", &vl.seqlens_q, total_q, vl.max_seqlen_q)?;
            let ok = read_seqlens("seqlens_k", &vl.seqlens_k, total_k, vl.max_seqlen_k)?;
            if oq.len() != ok.len() {
                bail!("candle-flash: seqlens_q has {} entries but seqlens_k has {}", oq.len(), ok.len())
            }
            let seqs = (0..oq.len() - 1)
                .map(|b| SeqSpan { q_start: oq[b], q_len: oq[b + 1] - oq[b], k_start: ok[b], k_len: ok[b + 1] - ok[b] })
                .collect();
            (oq.len() - 1, vl.max_seqlen_q, vl.max_seqlen_k, total_q, total_k, seqs)
        }
    };

    let alibi_per_head = match &opts.alibi_slopes {
        None => None,
        Some(s) => {
            check_same_device("alibi_slopes", s, q.device())?;
            if s.dtype() != DType::F32 {
                bail!("candle-flash: alibi_slopes must be f32, got {:?}", s.dtype())
            }
            let values = match s.dims() {
                [h] if *h == num_heads => s.to_vec1::<f32>()?.repeat(batch),
                [b, h] if *b == batch && *h == num_heads => s.flatten_all()?.to_vec1::<f32>()?,
                dims => bail!(
                    "candle-flash: alibi_slopes must have shape [{num_heads}] or [{batch}, {num_heads}], got {dims:?}"
                ),
            };
            Some(values)
        }
    };

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
        seqs,
        is_varlen: opts.varlen.is_some(),
        alibi_per_head,
    })
}

/// Checks the extra tensors of an explicit backward call against the forward's shape.
pub fn validate_backward(
    shape: &AttnShape,
    q: &Tensor,
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
) -> candle_core::Result<()> {
    for (name, t) in [("out", out), ("grad_out", grad_out)] {
        check_same_device(name, t, q.device())?;
        if t.dims() != q.dims() {
            bail!("candle-flash: {name} has shape {:?}, expected q's {:?}", t.dims(), q.dims())
        }
        if t.dtype() != q.dtype() {
            bail!("candle-flash: {name} has dtype {:?}, expected q's {:?}", t.dtype(), q.dtype())
        }
    }
    check_same_device("lse", lse, q.device())?;
    if lse.dtype() != DType::F32 || lse.dims() != shape.lse_dims().as_slice() {
        bail!("candle-flash: lse must be f32 of shape {:?}, got {:?} {:?}", shape.lse_dims(), lse.dtype(), lse.dims())
    }
    Ok(())
}
