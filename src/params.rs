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
//!
//! Paged K/V ([`PagedKv`]) is forward only, on every device; its block table is one of those
//! device-held values (read and checked on CUDA only on request; unchecked bad entries are
//! clamped by the kernels). `mm_prefix_ranges` is forward only too: [`validate_backward`]
//! rejects any backward through either.

use crate::block_mask::{BlockMask, HostBlocks};
use crate::inputs::BwdInputs;
use candle_core::{bail, DType, Device, Error, Tensor};
use std::sync::{Arc, OnceLock};

/// On CUDA, max_seqlen_q + max_seqlen_k must stay below this (2^29): the kernels' mask
/// arithmetic is 32-bit (`kernels/common/mask.cuh`, checked again in `kernels/dispatch.cu`).
pub const MAX_CUDA_SEQLEN_SUM: usize = 1 << 29;

/// On CUDA, batch and query heads are at most this (the launch grids' y and z dimensions).
pub const MAX_CUDA_GRID_YZ: usize = 65535;

/// Largest head dimension (of q/k and of v) the CPU path and the reference support.
pub const MAX_HEAD_DIM: usize = 576;

/// Largest head dimension the CUDA kernels support (of q/k and of v alike; multiples of 8).
pub const MAX_CUDA_HEAD_DIM: usize = 576;

/// Largest head dimension of the CUDA tensor-core kernels: wider heads, a value head dim of its
/// own (unless padded to one, see `flash_attn_with_lse`) and `mm_prefix_ranges` run on the SIMT
/// kernels (f32 arithmetic on CUDA cores, `kernels/simt/`), exact but slower.
pub const MAX_CUDA_TENSOR_CORE_HEAD_DIM: usize = 256;

/// Variable-length batching: sequences packed along the first axis, `seqlens_*` are the
/// cumulative offsets (u32, length B+1, starting at 0 and ending at the packed total).
#[derive(Clone, Debug)]
pub struct VarLen {
    pub seqlens_q: Tensor,
    pub seqlens_k: Tensor,
    pub max_seqlen_q: usize,
    pub max_seqlen_k: usize,
}

/// A paged K/V cache (vLLM / FlashAttention-2 layout): k and v are `(num_blocks,
/// page_block_size, Hkv, D)` pages, and sequence b's key j lives in page
/// `block_table[b][j / page_block_size]` at row `j % page_block_size`. Needs the varlen layout:
/// `seqlens_k` then gives each sequence's cache length (only the differences of consecutive
/// entries are used; the offsets address nothing, the table does).
#[derive(Clone, Debug)]
pub struct PagedKv {
    /// `(B, max_blocks)` u32 or i32 page indices; entries past a sequence's last page are not
    /// read (servers pad them with anything, -1 included). On CUDA its values are checked only
    /// under [`FlashAttnOptions::check_device_data()`]; otherwise an entry outside the cache
    /// (negative, or `>= num_blocks`) reads page 0: unspecified values in the rows that use it,
    /// never an access outside the cache.
    pub block_table: Tensor,
    /// Rows per page; must equal dimension 1 of k and v.
    pub page_block_size: usize,
}

impl PagedKv {
    pub fn new(block_table: &Tensor, page_block_size: usize) -> Self {
        Self { block_table: block_table.clone(), page_block_size }
    }
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
    /// Read k and v as a paged cache through a block table (forward only; CPU and CUDA).
    pub paged: Option<PagedKv>,
    /// i32 `(B, max_ranges, 2)` half-open key-position ranges `[start, end)` (candle-flash-attn's
    /// multimodal prefixes, e.g. an image's tokens): a query whose position `i + Sk - Sq` lies in
    /// a range also sees every key of that range (below Sk), whatever the causal/window mask
    /// says, so the range attends to itself bidirectionally. Ranges with `start >= end` are
    /// ignored. Forward only. On CUDA the values are device data nothing reads on the host
    /// (the kernel cuts every range to the keys); the call runs on the SIMT kernels.
    pub mm_prefix_ranges: Option<Tensor>,
    /// Learnable attention sinks (gpt-oss): f32 `[H]`, one logit `s_h` per query head that joins
    /// every row's softmax denominator and carries no value: row i of head h gets
    /// `out_i = Σ_j e^{x_ij} v_j / (e^{s_h} + Σ_j e^{x_ij})`. The returned LSE includes the sink,
    /// and a row that sees no key gives 0 (all its mass on the sink, LSE `s_h`). Differentiable:
    /// through `Tensor::backward()` when the tensor is a `Var`, and from [`crate::flash_attn_grads`].
    /// Values must be finite (checked where the device-data policy reads values: always on the CPU).
    pub sinks: Option<Tensor>,
    /// Block-sparse attention ([`BlockMask`], FlexAttention's layout): a query sees a key only
    /// where the mask's block lists and rule allow it *and* every other option does (the
    /// intersection of the masks). The CPU kernels visit only the listed key blocks of each
    /// query block. Batched layout only (no varlen, paged K/V or `mm_prefix_ranges` with it
    /// yet); built for the call's Sq and Sk, its batch and head axes 1 or the call's. CPU only
    /// so far: on CUDA it is an error until the kernels read the lists.
    pub block_mask: Option<BlockMask>,
    /// Backward only: give bit-identical gradients run to run (no order-dependent atomics). On
    /// Hopper dQ's additions then go in key-block order inside the dK/dV kernel (about 0.7-0.8x
    /// the default backward's speed); elsewhere a separate dQ pass runs.
    pub deterministic: bool,
    /// CUDA: copy the varlen offsets, ALiBi slopes and the paged block table to the host and
    /// check their values on every call (a stream synchronisation; not capturable in a CUDA
    /// graph). Off by default, where bad offsets or table entries give unspecified values in the
    /// affected rows but never an access outside the tensors (a table entry outside the cache
    /// reads page 0). Also turned on for every call by the environment variable
    /// [`CHECK_DEVICE_DATA_ENV`]`=1`. The CPU always checks (reading there is free).
    pub check_device_data: bool,
}

/// Environment variable that turns [`FlashAttnOptions::check_device_data()`] on for every call
/// (any value but empty or `0`; read once per process).
pub const CHECK_DEVICE_DATA_ENV: &str = "CANDLE_FLASH_CHECK_DEVICE_DATA";

pub(crate) fn check_device_data_env() -> bool {
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
            paged: None,
            mm_prefix_ranges: None,
            sinks: None,
            block_mask: None,
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

    pub fn paged(mut self, paged: Option<PagedKv>) -> Self {
        self.paged = paged;
        self
    }

    pub fn mm_prefix_ranges(mut self, ranges: Option<&Tensor>) -> Self {
        self.mm_prefix_ranges = ranges.cloned();
        self
    }

    /// Learnable attention sinks, f32 `[H]` (see the field [`FlashAttnOptions::sinks`]).
    pub fn sinks(mut self, sinks: Option<&Tensor>) -> Self {
        self.sinks = sinks.cloned();
        self
    }

    /// Attention through a block mask (see the field [`FlashAttnOptions::block_mask`]).
    pub fn block_mask(mut self, mask: Option<&BlockMask>) -> Self {
        self.block_mask = mask.cloned();
        self
    }

    pub fn deterministic(mut self, deterministic: bool) -> Self {
        self.deterministic = deterministic;
        self
    }

    /// Sets the field `check_device_data`: on CUDA, read and check the values of the varlen
    /// offsets, ALiBi slopes and paged block table on every call (a host synchronisation).
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
    /// Head dim of q and k.
    pub head_dim: usize,
    /// Head dim of v and the output (MLA's value dim; usually `head_dim`).
    pub head_dim_v: usize,
    /// Batched: Sq and Sk. Varlen: max_seqlen_q and max_seqlen_k, capped at the totals (no
    /// sequence can be longer than its packed tensor).
    pub max_seqlen_q: usize,
    pub max_seqlen_k: usize,
    pub total_q: usize,
    /// Rows of k and v (paged: num_blocks * page_block_size, the whole cache).
    pub total_k: usize,
    pub is_varlen: bool,
    /// Rows per page when k and v are a paged cache (see [`PagedKv`]).
    pub page_block_size: Option<usize>,
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
    /// Paged K/V: `k_start` is 0 for every sequence (its rows are found through `pages`).
    pub seqs: Vec<SeqSpan>,
    /// `batch * num_heads` slopes, one per (b, h).
    alibi: Option<Vec<f32>>,
    num_heads: usize,
    /// Paged K/V: the pages of each sequence, in logical order (only those its keys use).
    pub pages: Option<Vec<Vec<usize>>>,
    /// `mm_prefix_ranges` of each sequence as `[start, end)` pairs (empty ranges dropped).
    prefix_ranges: Option<Vec<Vec<(i64, i64)>>>,
    /// The sink logit of each query head (checked finite).
    sinks: Option<Vec<f32>>,
    /// The block mask's classes and rule on the host.
    pub(crate) block_mask: Option<Arc<HostBlocks>>,
}

impl HostData {
    /// The keys that query row `i` of sequence `b` sees because of `mm_prefix_ranges`: the
    /// union of the ranges that hold the query's position, cut to `[0, k_len)`. Ranges that all
    /// hold one position overlap, so the union is one interval. None when there is none.
    pub fn prefix_keys(&self, b: usize, seq: &SeqSpan, i: usize) -> Option<(usize, usize)> {
        let pos = i as i64 + seq.diag_offset() as i64;
        let holding = self.prefix_ranges.as_ref()?[b].iter().filter(|&&(s, e)| s <= pos && pos < e);
        let (lo, hi) = holding.fold((i64::MAX, i64::MIN), |(lo, hi), &(s, e)| (lo.min(s), hi.max(e)));
        let (lo, hi) = (lo.max(0), hi.min(seq.k_len as i64));
        (lo < hi).then_some((lo as usize, hi as usize))
    }

    pub fn alibi_slope(&self, b: usize, h: usize) -> Option<f32> {
        self.alibi.as_ref().map(|s| s[b * self.num_heads + h])
    }

    pub fn has_alibi(&self) -> bool {
        self.alibi.is_some()
    }

    /// The sink logit of query head `h`, when the call has sinks.
    pub fn sink(&self, h: usize) -> Option<f32> {
        self.sinks.as_ref().map(|s| s[h])
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

    /// Every key query row `i` of sequence `b` sees: the window's [`Self::key_range`] and, with
    /// `mm_prefix_ranges`, the prefix interval that holds the query ([`HostData::prefix_keys`]).
    pub fn row_keys(&self, opts: &FlashAttnOptions, host: &HostData, b: usize, i: usize) -> RowKeys {
        let seq = &host.seqs[b];
        RowKeys::union(self.key_range(opts, seq, i), host.prefix_keys(b, seq, i))
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

/// The keys one query row sees: everything in `hull` except `gap` (the window and a prefix
/// range that do not touch leave a gap between them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowKeys {
    pub hull: (usize, usize),
    pub gap: Option<(usize, usize)>,
}

impl RowKeys {
    fn union(window: (usize, usize), prefix: Option<(usize, usize)>) -> Self {
        let empty = |r: (usize, usize)| r.1 <= r.0;
        match prefix {
            None => Self { hull: window, gap: None },
            Some(p) if empty(window) => Self { hull: p, gap: None },
            Some(p) => {
                let (first, second) = if p.0 < window.0 { (p, window) } else { (window, p) };
                let hull = (first.0, first.1.max(second.1));
                let gap = (first.1 < second.0).then_some((first.1, second.0));
                Self { hull, gap }
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.hull.1 <= self.hull.0
    }

    pub fn contains(&self, j: usize) -> bool {
        self.hull.0 <= j && j < self.hull.1 && !self.gap.is_some_and(|(lo, hi)| lo <= j && j < hi)
    }
}

pub(crate) fn check_float_dtype(name: &str, t: &Tensor, allow_f64: bool) -> candle_core::Result<()> {
    match t.dtype() {
        DType::F32 | DType::F16 | DType::BF16 => Ok(()),
        DType::F64 if allow_f64 => Ok(()),
        DType::F8E4M3 => {
            bail!("candle-flash: {name} is F8E4M3: use candle_flash::fp8 (flash_attn_fp8 / flash_attn_fp8_descaled)")
        }
        dt => bail!("candle-flash: {name} has dtype {dt:?}, expected f32, f16 or bf16"),
    }
}

pub(crate) fn check_same_device(name: &str, t: &Tensor, device: &Device) -> candle_core::Result<()> {
    if !t.device().same_device(device) {
        bail!("candle-flash: {name} is on {:?} but q is on {:?}", t.device().location(), device.location())
    }
    Ok(())
}

pub(crate) fn check_last_dim_contiguous(name: &str, t: &Tensor) -> candle_core::Result<()> {
    if t.rank() > 0 && t.dims()[t.rank() - 1] > 1 && t.stride()[t.rank() - 1] != 1 {
        bail!("candle-flash: the last dimension of {name} must be contiguous, strides are {:?}", t.stride())
    }
    Ok(())
}

/// Reads cumulative seqlens to the host and checks them against max and, when there is one,
/// the packed total (paged k has none). The shape-only checks of the tensor are done before.
fn read_seqlens(name: &str, t: &Tensor, total: Option<usize>, max: usize) -> candle_core::Result<Vec<usize>> {
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
    match (offsets.last(), total) {
        (Some(&end), Some(total)) if end != total => {
            bail!("candle-flash: {name} ends at {end} but the packed tensor has {total} rows")
        }
        _ => {}
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
    validate_inner(q, k, v, opts, Inputs::Kernels, read_device_data(q, opts))
}

/// Whether validation reads the varlen offsets, ALiBi slopes and block table on the host: always
/// off CUDA, on CUDA only when asked ([`FlashAttnOptions::check_device_data`]).
fn read_device_data(q: &Tensor, opts: &FlashAttnOptions) -> bool {
    !q.device().is_cuda() || opts.check_device_data || check_device_data_env()
}

/// [`validate`] for FP8 attention ([`crate::fp8`]): q, k and v `DType::F8E4M3`, an f32 / f16 /
/// bf16 output, no paged K/V (its cache would be dequantized whole on every call); the shapes
/// and every other option as for the other dtypes. The descales are checked where they are
/// interpreted (`fp8.rs`). The shape returned is that of the attention that runs: dtype
/// `out_dtype`, on the dequantized inputs.
pub fn validate_fp8(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttnOptions,
    out_dtype: DType,
) -> candle_core::Result<AttnShape> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.dtype() != DType::F8E4M3 {
            bail!("candle-flash fp8: {name} has dtype {:?}, expected F8E4M3", t.dtype())
        }
    }
    if !matches!(out_dtype, DType::F32 | DType::F16 | DType::BF16) {
        bail!("candle-flash fp8: output dtype {out_dtype:?}, expected f32, f16 or bf16")
    }
    if opts.paged.is_some() {
        bail!("candle-flash fp8: paged K/V is not supported with FP8 inputs")
    }
    let mut shape = validate_inner(q, k, v, opts, Inputs::Fp8, read_device_data(q, opts))?;
    if shape.head_dim_v != shape.head_dim {
        bail!("candle-flash fp8: v's head dim {} must equal q's {}", shape.head_dim_v, shape.head_dim)
    }
    shape.dtype = out_dtype; // what runs: the regular kernels on the dequantized inputs
    Ok(shape)
}

/// [`validate`] for the reference, which also computes in f64 (the tests' ground truth),
/// always needs the values on the host, and is plain candle ops on any device: none of the
/// CUDA kernels' size limits apply to it.
pub fn validate_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttnOptions,
) -> candle_core::Result<AttnShape> {
    validate_inner(q, k, v, opts, Inputs::Reference, true)
}

/// Whose inputs [`validate_inner`] checks: the kernels' (f32 / f16 / bf16, the CUDA kernels'
/// limits on CUDA), the reference's (f64 too, no kernel limits) or FP8 ones (F8E4M3; they are
/// dequantized for the kernels, whose limits then apply).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Inputs {
    Kernels,
    Reference,
    Fp8,
}

fn validate_inner(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttnOptions,
    inputs: Inputs,
    read_device_data: bool,
) -> candle_core::Result<AttnShape> {
    // Our CUDA kernels will run this call (and their size limits apply).
    let kernels_on_cuda = q.device().is_cuda() && inputs != Inputs::Reference;
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if inputs != Inputs::Fp8 {
            check_float_dtype(name, t, inputs == Inputs::Reference)?;
        }
        check_same_device(name, t, q.device())?;
        check_last_dim_contiguous(name, t)?;
    }
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        bail!("candle-flash: dtype mismatch: q {:?}, k {:?}, v {:?}", q.dtype(), k.dtype(), v.dtype())
    }
    if opts.paged.is_some() && opts.varlen.is_none() {
        bail!("candle-flash: paged K/V needs the varlen layout (q (total_q, heads, head_dim), seqlens_q, seqlens_k)")
    }
    let q_rank = if opts.varlen.is_some() { 3 } else { 4 };
    let kv_rank = if opts.paged.is_some() { 4 } else { q_rank };
    let q_layout = if opts.varlen.is_some() { "(total, heads, head_dim)" } else { "(batch, seq, heads, head_dim)" };
    let kv_layout = if opts.paged.is_some() { "(num_blocks, page_block_size, heads, head_dim)" } else { q_layout };
    for (name, t, rank, layout) in
        [("q", q, q_rank, q_layout), ("k", k, kv_rank, kv_layout), ("v", v, kv_rank, kv_layout)]
    {
        if t.rank() != rank {
            bail!("candle-flash: {name} must have rank {rank} {layout}, got shape {:?}", t.dims())
        }
    }
    // v may have a head dim of its own (MLA); every other axis is k's.
    if k.dims()[..kv_rank - 1] != v.dims()[..kv_rank - 1] {
        bail!(
            "candle-flash: k and v must have the same shape but for the head dim, got k {:?} and v {:?}",
            k.dims(),
            v.dims()
        )
    }
    let (num_heads, head_dim) = (q.dims()[q_rank - 2], q.dims()[q_rank - 1]);
    let (num_kv_heads, kv_head_dim) = (k.dims()[kv_rank - 2], k.dims()[kv_rank - 1]);
    let head_dim_v = v.dims()[kv_rank - 1];
    // The CUDA kernels read a paged cache's v with a head dim of its own (MLA decode: v a view of
    // the latent k cache); the CPU kernels do not.
    if head_dim_v != head_dim && opts.paged.is_some() && !kernels_on_cuda && inputs != Inputs::Reference {
        bail!(
            "candle-flash: a value head dim of its own ({head_dim_v}, q/k {head_dim}) is not supported with paged K/V \
             on the CPU (it is on CUDA)"
        )
    }
    if kv_head_dim != head_dim {
        bail!("candle-flash: head dims differ: q has {head_dim}, k has {kv_head_dim}")
    }
    for (what, d) in [("head dim", head_dim), ("value head dim", head_dim_v)] {
        if d == 0 || d > MAX_HEAD_DIM {
            bail!("candle-flash: {what} {d} is not supported (1..={MAX_HEAD_DIM})")
        }
        if kernels_on_cuda && (d % 8 != 0 || d > MAX_CUDA_HEAD_DIM) {
            bail!(
                "candle-flash: {what} {d} is not supported on CUDA (multiples of 8 up to {MAX_CUDA_HEAD_DIM}; \
                 the CPU takes any up to {MAX_HEAD_DIM})"
            )
        }
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
            let total_q = q.dims()[0];
            let bq = seqlens_batch("seqlens_q", &vl.seqlens_q, q.device())?;
            let bk = seqlens_batch("seqlens_k", &vl.seqlens_k, q.device())?;
            if bq != bk {
                bail!("candle-flash: seqlens_q has {} entries but seqlens_k has {}", bq + 1, bk + 1)
            }
            // Packed k: its rows are the keys. Paged k: the whole cache, of which each
            // sequence reads at most the pages of its block_table row.
            let (total_k, k_capacity) = match &opts.paged {
                None => (k.dims()[0], k.dims()[0]),
                Some(paged) => {
                    let max_blocks = check_paged(paged, k, bq, q.device())?;
                    let sizes = [k.dims()[0], paged.page_block_size, max_blocks];
                    if kernels_on_cuda && sizes.iter().any(|&x| x > i32::MAX as usize) {
                        bail!(
                            "candle-flash: num_blocks {}, page_block_size {} and the block_table width {max_blocks} \
                             must fit the CUDA kernels' 32-bit sizes",
                            sizes[0],
                            sizes[1]
                        )
                    }
                    (k.dims()[0] * k.dims()[1], max_blocks * paged.page_block_size)
                }
            };
            let mut packed = vec![("q", total_q, vl.max_seqlen_q)];
            if opts.paged.is_none() {
                packed.push(("k", total_k, vl.max_seqlen_k));
            }
            for (name, total, max) in packed {
                if total > u32::MAX as usize {
                    bail!("candle-flash: {name} has {total} rows, more than u32 seqlens can address")
                }
                if max == 0 && total > 0 {
                    bail!("candle-flash: max_seqlen_{name} is 0 but {name} has {total} rows")
                }
            }
            (bq, vl.max_seqlen_q.min(total_q), vl.max_seqlen_k.min(k_capacity), total_q, total_k)
        }
    };
    if kernels_on_cuda && [batch, max_seqlen_q, max_seqlen_k].iter().any(|&x| x > i32::MAX as usize) {
        bail!(
            "candle-flash: batch {batch}, max_seqlen_q {max_seqlen_q} and max_seqlen_k {max_seqlen_k} must fit \
             the CUDA kernels' 32-bit sizes"
        )
    }
    // Grid dimensions y / z of the CUDA launches (kernels/dispatch.cu checks them again).
    if kernels_on_cuda && (batch > MAX_CUDA_GRID_YZ || num_heads > MAX_CUDA_GRID_YZ) {
        bail!("candle-flash: batch {batch} and heads {num_heads} must be at most {MAX_CUDA_GRID_YZ} on CUDA")
    }
    // The kernels' mask arithmetic is 32-bit (kernels/common/mask.cuh): |positions| < 2^30.
    if kernels_on_cuda && max_seqlen_q + max_seqlen_k >= MAX_CUDA_SEQLEN_SUM {
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

    if let Some(ranges) = &opts.mm_prefix_ranges {
        check_same_device("mm_prefix_ranges", ranges, q.device())?;
        if ranges.dtype() != DType::I32 {
            bail!("candle-flash: mm_prefix_ranges must be i32, got {:?}", ranges.dtype())
        }
        if !matches!(ranges.dims(), [b, _, 2] if *b == batch) {
            bail!("candle-flash: mm_prefix_ranges must have shape [{batch}, max_ranges, 2], got {:?}", ranges.dims())
        }
    }

    if let Some(s) = &opts.sinks {
        check_same_device("sinks", s, q.device())?;
        if s.dtype() != DType::F32 || s.dims() != [num_heads] {
            bail!(
                "candle-flash: sinks must be f32 of shape [{num_heads}] (one per query head), got {:?} {:?}",
                s.dtype(),
                s.dims()
            )
        }
    }

    if let Some(mask) = &opts.block_mask {
        check_block_mask(mask, opts, q.device(), kernels_on_cuda, (batch, num_heads), (max_seqlen_q, max_seqlen_k))?;
    }

    let host = if read_device_data { Some(read_host_data(q, k, opts, batch, num_heads)?) } else { None };

    Ok(AttnShape {
        dtype: q.dtype(),
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        head_dim_v,
        max_seqlen_q,
        max_seqlen_k,
        total_q,
        total_k,
        is_varlen: opts.varlen.is_some(),
        page_block_size: opts.paged.as_ref().map(|p| p.page_block_size),
        alibi_per_batch: opts.alibi_slopes.as_ref().is_some_and(|s| s.rank() == 2),
        host,
    })
}

/// The checks of a block mask against the call: where it runs, the layout, its device, the
/// lengths it was built for and its batch and head axes (1 or the call's).
fn check_block_mask(
    mask: &BlockMask,
    opts: &FlashAttnOptions,
    device: &Device,
    kernels_on_cuda: bool,
    (batch, num_heads): (usize, usize),
    (seqlen_q, seqlen_k): (usize, usize),
) -> candle_core::Result<()> {
    if kernels_on_cuda {
        // the rule's data is read where it lives: on the call's device (u32, as the builders checked)
        if let Some(spec) = mask.spec() {
            for t in spec.data_tensors() {
                check_same_device("the block mask rule's data", t, device)?;
            }
        }
    }
    if opts.varlen.is_some() {
        bail!(
            "candle-flash: a block mask needs the batched layout (q (batch, seq, heads, head_dim)): \
             varlen and paged K/V with a block mask are not supported yet"
        )
    }
    if opts.mm_prefix_ranges.is_some() {
        bail!("candle-flash: mm_prefix_ranges with a block mask is not supported yet")
    }
    check_same_device("block_mask", mask.kv_num_blocks(), device)?;
    if mask.seqlens() != (seqlen_q, seqlen_k) {
        bail!(
            "candle-flash: the block mask was built for seqlen_q {} and seqlen_k {}, but the call has {seqlen_q} and {seqlen_k}",
            mask.seqlens().0,
            mask.seqlens().1
        )
    }
    let (mask_batch, mask_heads) = mask.batch_heads();
    if ![1, batch].contains(&mask_batch) || ![1, num_heads].contains(&mask_heads) {
        bail!(
            "candle-flash: the block mask has batch {mask_batch} and heads {mask_heads}, which do not broadcast \
             to the call's batch {batch} and {num_heads} query heads (each must be 1 or the call's)"
        )
    }
    Ok(())
}

/// Shape-only checks of a paged cache (k is `(num_blocks, page_block_size, Hkv, D)`, rank
/// checked before) and its block table; returns the table's width (pages per sequence).
fn check_paged(paged: &PagedKv, k: &Tensor, batch: usize, device: &Device) -> candle_core::Result<usize> {
    let page_rows = k.dims()[1];
    if paged.page_block_size == 0 {
        bail!("candle-flash: page_block_size must be at least 1, got 0")
    }
    if paged.page_block_size != page_rows {
        bail!(
            "candle-flash: page_block_size {} does not match the pages of k and v, {page_rows} rows each (k shape {:?})",
            paged.page_block_size,
            k.dims()
        )
    }
    let table = &paged.block_table;
    check_same_device("block_table", table, device)?;
    if !matches!(table.dtype(), DType::U32 | DType::I32) {
        bail!("candle-flash: block_table must be u32 or i32, got {:?}", table.dtype())
    }
    match table.dims() {
        [b, max_blocks] if *b == batch => Ok(*max_blocks),
        dims => bail!("candle-flash: block_table must have shape [{batch}, max_blocks], got {dims:?}"),
    }
}

/// Reads the block table and checks, for each sequence, that its keys fit the table's row and
/// that every page they use exists. Entries past a sequence's last page are not read.
fn read_pages(paged: &PagedKv, num_blocks: usize, seqs: &[SeqSpan]) -> candle_core::Result<Vec<Vec<usize>>> {
    let rows: Vec<Vec<i64>> = match paged.block_table.dtype() {
        DType::U32 => {
            paged.block_table.to_vec2::<u32>()?.into_iter().map(|r| r.into_iter().map(i64::from).collect()).collect()
        }
        _ => paged.block_table.to_vec2::<i32>()?.into_iter().map(|r| r.into_iter().map(i64::from).collect()).collect(),
    };
    let page = paged.page_block_size;
    seqs.iter()
        .zip(rows)
        .enumerate()
        .map(|(b, (seq, row))| {
            let used = seq.k_len.div_ceil(page);
            if used > row.len() {
                bail!(
                    "candle-flash: sequence {b} has {} keys but its block_table row holds {} pages of {page} rows ({} keys)",
                    seq.k_len,
                    row.len(),
                    row.len() * page
                )
            }
            row[..used]
                .iter()
                .enumerate()
                .map(|(slot, &block)| match usize::try_from(block) {
                    Ok(block) if block < num_blocks => Ok(block),
                    _ => bail!(
                        "candle-flash: block_table[{b}][{slot}] = {block} is not a page of the cache (0..{num_blocks})"
                    ),
                })
                .collect()
        })
        .collect()
}

/// Reads `mm_prefix_ranges` (shape checked before) as `[start, end)` pairs per sequence,
/// dropping the empty ones (they select nothing).
fn read_prefix_ranges(ranges: &Tensor) -> candle_core::Result<Vec<Vec<(i64, i64)>>> {
    Ok(ranges
        .to_vec3::<i32>()?
        .into_iter()
        .map(|seq| seq.into_iter().map(|r| (r[0] as i64, r[1] as i64)).filter(|(s, e)| s < e).collect())
        .collect())
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
    let seqs: Vec<SeqSpan> = match &opts.varlen {
        None => {
            let (sq, sk) = (q.dims()[1], k.dims()[1]);
            (0..batch).map(|i| SeqSpan { q_start: i * sq, q_len: sq, k_start: i * sk, k_len: sk }).collect()
        }
        Some(vl) => {
            let oq = read_seqlens("seqlens_q", &vl.seqlens_q, Some(q.dims()[0]), vl.max_seqlen_q)?;
            // Paged: seqlens_k only gives lengths (the pages may hold any number of rows).
            let packed_k = opts.paged.is_none().then(|| k.dims()[0]);
            let ok = read_seqlens("seqlens_k", &vl.seqlens_k, packed_k, vl.max_seqlen_k)?;
            let k_start = |b: usize| if packed_k.is_some() { ok[b] } else { 0 };
            (0..batch)
                .map(|b| SeqSpan {
                    q_start: oq[b],
                    q_len: oq[b + 1] - oq[b],
                    k_start: k_start(b),
                    k_len: ok[b + 1] - ok[b],
                })
                .collect()
        }
    };
    let pages = match &opts.paged {
        Some(paged) => Some(read_pages(paged, k.dims()[0], &seqs)?),
        None => None,
    };
    let prefix_ranges = opts.mm_prefix_ranges.as_ref().map(read_prefix_ranges).transpose()?;
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
    let sinks = match &opts.sinks {
        None => None,
        Some(s) => {
            let values = s.to_vec1::<f32>()?;
            if let Some(i) = values.iter().position(|x| !x.is_finite()) {
                bail!("candle-flash: sinks must be finite, got {} at head {i}", values[i])
            }
            Some(values)
        }
    };
    let block_mask = opts.block_mask.as_ref().map(BlockMask::host).transpose()?;
    Ok(HostData { seqs, alibi, num_heads, pages, prefix_ranges, sinks, block_mask })
}

/// Checks the extra tensors of a backward call (out, grad_out, lse) against the forward's shape.
pub fn validate_backward(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    x: &BwdInputs<&Tensor>,
) -> candle_core::Result<()> {
    // Serving reads pages and prefix ranges forward only; a backward would need dK/dV
    // scattered back into pages, which nothing asks for yet.
    if opts.paged.is_some() {
        bail!("candle-flash: paged K/V is forward only: no backward (autograd or flash_attn_backward) through it")
    }
    if opts.mm_prefix_ranges.is_some() {
        bail!("candle-flash: mm_prefix_ranges is forward only: no backward (autograd or flash_attn_backward) with it")
    }
    let q = x.q;
    let mut out_dims = q.dims().to_vec();
    *out_dims.last_mut().expect("q has rank 3 or 4") = shape.head_dim_v;
    for (name, t) in [("out", x.out), ("grad_out", x.grad_out)] {
        check_same_device(name, t, q.device())?;
        if t.dims() != out_dims.as_slice() {
            bail!("candle-flash: {name} has shape {:?}, expected {out_dims:?} (q's, with v's head dim)", t.dims())
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
