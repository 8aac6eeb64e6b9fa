//! The plain attention: softmax(scale·QKᵀ + bias)·V with the whole score matrix materialised,
//! built from candle tensor ops so that candle's autograd differentiates it. Same options,
//! layouts and edge cases as the fast paths; used by the tests, the benchmark (`--impl naive`)
//! and the Llama block (`AttnImpl::Naive`). It computes in the dtype of its inputs: convert
//! them to f64 for a ground truth.

use crate::block_mask::HostBlocks;
use crate::params::{validate_reference, AttnShape, FlashAttnOptions, HostData, SeqSpan};
use candle_core::{DType, Result, Tensor, D};

/// Naive attention with the layouts of [`crate::flash_attn`] (or the varlen layout when
/// `opts.varlen` is set).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, opts: &FlashAttnOptions) -> Result<Tensor> {
    Ok(attention_impl(q, k, v, opts, false, false)?.0)
}

/// [`attention`] with FlashAttention-3's FP8 recipe for P V: the unnormalised P = exp(s - max)
/// rounded to e4m3 before it multiplies V (the row sum from the unrounded values). The naive
/// counterpart of the FP8 kernel (`crate::fp8`), whose error it bounds in the tests.
pub fn attention_fp8_p(q: &Tensor, k: &Tensor, v: &Tensor, opts: &FlashAttnOptions) -> Result<Tensor> {
    Ok(attention_impl(q, k, v, opts, false, true)?.0)
}

/// Naive attention and its log-sum-exp (f32, `(B, H, Sq)`, or `(H, total_q)` for varlen).
pub fn attention_with_lse(q: &Tensor, k: &Tensor, v: &Tensor, opts: &FlashAttnOptions) -> Result<(Tensor, Tensor)> {
    let (out, lse) = attention_impl(q, k, v, opts, true, false)?;
    let lse = lse.ok_or_else(|| candle_core::Error::Msg("candle-flash: reference lse missing".into()))?;
    Ok((out, lse))
}

/// A paged cache's keys and values gathered into the packed varlen layout, with the options
/// that read them there: `(k (total_k, Hkv, D), v, opts)`, where `total_k` is the sum of the
/// sequences' key lengths and `opts.varlen.seqlens_k` their offsets. This is what "paged"
/// means: the same attention as on these contiguous rows.
pub fn unpage(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttnOptions,
) -> Result<(Tensor, Tensor, FlashAttnOptions)> {
    let shape = validate_reference(q, k, v, opts)?;
    let (host, page) = (shape.host()?, k.dim(1)?);
    let (Some(pages), Some(varlen)) = (&host.pages, &opts.varlen) else {
        candle_core::bail!("candle-flash: unpage needs paged K/V options")
    };
    let rows = packed_key_rows(page, host.seqs.iter().zip(pages).map(|(seq, pages)| (seq.k_len, |i: usize| pages[i])));
    let rows = Tensor::new(rows.as_slice(), k.device())?;
    let gather = |t: &Tensor| t.flatten_to(1)?.index_select(&rows, 0);
    let mut offsets = vec![0u32];
    for seq in &host.seqs {
        offsets.push(offsets[offsets.len() - 1] + seq.k_len as u32);
    }
    let mut varlen = varlen.clone();
    varlen.seqlens_k = Tensor::new(offsets.as_slice(), k.device())?;
    let opts = opts.clone().paged(None).varlen(Some(varlen));
    Ok((gather(k)?, gather(v)?, opts))
}

/// For every key `j` of every sequence `(k_len, page_of)`, in order, its row
/// `page_of(j / page) · page + j % page` of a paged cache viewed as `(num_blocks · page, Hkv, D)`
/// (`page_of(i)`: the sequence's i-th page): the gather that turns the cache into the packed
/// varlen layout ([`unpage`]). Public for candle-flash-llama's paged cache (the rows its steps
/// gather for the attention paths that read the keys packed).
pub fn packed_key_rows<F: Fn(usize) -> usize>(page: usize, seqs: impl Iterator<Item = (usize, F)>) -> Vec<u32> {
    seqs.flat_map(|(k_len, page_of)| (0..k_len).map(move |j| (page_of(j / page) * page + j % page) as u32)).collect()
}

fn attention_impl(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttnOptions,
    want_lse: bool,
    p_e4m3: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    if opts.paged.is_some() {
        let (k, v, opts) = unpage(q, k, v, opts)?;
        return attention_impl(q, &k, &v, &opts, want_lse, p_e4m3);
    }
    let shape = validate_reference(q, k, v, opts)?;
    let host = shape.host()?;
    let prefix_ranges = match &opts.mm_prefix_ranges {
        Some(r) => Some(r.to_vec3::<i32>()?),
        None => None,
    };
    let (h, hkv, d, dv) = (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.head_dim_v);
    // Packed row views: (total, heads, D) for both layouts.
    let qp = q.reshape((shape.total_q, h, d))?;
    let kp = k.reshape((shape.total_k, hkv, d))?;
    let vp = v.reshape((shape.total_k, hkv, dv))?;
    let mut outs = Vec::with_capacity(shape.batch);
    let mut lses = Vec::with_capacity(shape.batch);
    for (b, seq) in host.seqs.iter().enumerate() {
        let qs = qp.narrow(0, seq.q_start, seq.q_len)?;
        let ks = kp.narrow(0, seq.k_start, seq.k_len)?;
        let vs = vp.narrow(0, seq.k_start, seq.k_len)?;
        let visible = Visible {
            opts,
            shape: &shape,
            seq,
            prefix_ranges: prefix_ranges.as_ref().map(|r| &r[b][..]),
            block_mask: host.block_mask.as_deref().map(|m| (m, b)),
        };
        let (o, lse) = sequence_attention(&qs, &ks, &vs, opts, (&shape, host), &visible, b, (want_lse, p_e4m3))?;
        outs.push(o);
        lses.extend(lse);
    }
    let mut out_dims = q.dims().to_vec();
    *out_dims.last_mut().expect("rank 3 or 4") = dv;
    let out = Tensor::cat(&outs, 0)?.reshape(out_dims)?;
    if !want_lse {
        return Ok((out, None));
    }
    let lse = if shape.is_varlen { Tensor::cat(&lses, 1)? } else { Tensor::stack(&lses, 0)? };
    Ok((out, Some(lse)))
}

/// Which keys each query row of one sequence sees.
struct Visible<'a> {
    opts: &'a FlashAttnOptions,
    shape: &'a AttnShape,
    seq: &'a SeqSpan,
    /// This sequence's `mm_prefix_ranges` rows, `[start, end]` pairs as given.
    prefix_ranges: Option<&'a [Vec<i32>]>,
    /// The block mask and this sequence's index: its dense element mask (the block lists and,
    /// in partial blocks, the rule), intersected with the rest.
    block_mask: Option<(&'a HostBlocks, usize)>,
}

impl Visible<'_> {
    /// The causal/window mask, or (candle-flash-attn's multimodal prefixes) query position and
    /// key both inside one `[start, end)` range, the key below Sk; and the block mask's element
    /// mask for query head `h`.
    fn get(&self, h: usize, i: usize, j: usize) -> bool {
        self.block_mask.is_none_or(|(mask, b)| mask.visible(b, h, i, j)) && self.options_mask(i, j)
    }

    /// Whether the block mask differs per head (then so does the bias).
    fn per_head(&self) -> bool {
        self.block_mask.is_some_and(|(mask, _)| mask.per_head())
    }

    /// Every mask but the block mask (the same for every head).
    fn options_mask(&self, i: usize, j: usize) -> bool {
        let (lo, hi) = self.shape.key_range(self.opts, self.seq, i);
        let pos = i as i64 + self.seq.diag_offset() as i64;
        let in_prefix = self.prefix_ranges.is_some_and(|ranges| {
            ranges.iter().any(|r| {
                let (start, end) = (r[0] as i64, r[1] as i64);
                (start..end).contains(&pos) && (start..end).contains(&(j as i64))
            })
        });
        (lo <= j && j < hi) || (in_prefix && j < self.seq.k_len)
    }
}

/// The additive bias of one sequence, `(H or 1, Sq, Sk)` f32: ALiBi where set (per head),
/// -inf where masked. None when every query sees every key without a bias.
fn bias((shape, host): (&AttnShape, &HostData), visible: &Visible, b: usize) -> Option<(Vec<f32>, usize)> {
    let seq = visible.seq;
    let (sq, sk) = (seq.q_len, seq.k_len);
    let heads = if host.has_alibi() || visible.per_head() { shape.num_heads } else { 1 };
    let unmasked = (0..heads).all(|h| (0..sq).all(|i| (0..sk).all(|j| visible.get(h, i, j))));
    if unmasked && !host.has_alibi() {
        return None;
    }
    let mut out = vec![0f32; heads * sq * sk];
    for head in 0..heads {
        let slope = host.alibi_slope(b, head);
        for i in 0..sq {
            let pos = i as isize + seq.diag_offset();
            let row = &mut out[(head * sq + i) * sk..(head * sq + i + 1) * sk];
            for (j, x) in row.iter_mut().enumerate() {
                *x = if !visible.get(head, i, j) {
                    f32::NEG_INFINITY
                } else if let Some(slope) = slope {
                    -slope * (pos - j as isize).unsigned_abs() as f32
                } else {
                    0.0
                };
            }
        }
    }
    Some((out, heads))
}

/// q `(Sq, H, D)`, k/v `(Sk, Hkv, D)` → out `(Sq, H, D)`, lse `(H, Sq)` f32 (when asked for).
#[allow(clippy::too_many_arguments)]
fn sequence_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttnOptions,
    (shape, host): (&AttnShape, &HostData),
    visible: &Visible,
    b: usize,
    (want_lse, p_e4m3): (bool, bool),
) -> Result<(Tensor, Option<Tensor>)> {
    let seq = visible.seq;
    let (h, hkv, d, dv) = (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.head_dim_v);
    let (sq, sk) = (seq.q_len, seq.k_len);
    let dtype = q.dtype();
    // The sink logits as (H, 1, 1), in the computation's dtype (autograd reaches a `Var`).
    let sinks =
        opts.sinks.as_ref().map(|s| s.to_device(q.device())?.to_dtype(dtype)?.reshape((h, 1, 1))).transpose()?;
    if sk == 0 || sq == 0 {
        // No key at all: every row is fully masked (output 0, lse -inf, or the sink's logit).
        // Multiplying by zero keeps q in the graph so that autograd still returns (zero) gradients.
        let out = Tensor::zeros((sq, h, dv), dtype, q.device())?.broadcast_add(&(q * 0.0)?.sum_keepdim(2)?)?;
        let lse = match &sinks {
            Some(s) => s.to_dtype(DType::F32)?.reshape((h, 1))?.broadcast_as((h, sq))?.contiguous()?.detach(),
            None => Tensor::full(f32::NEG_INFINITY, (h, sq), q.device())?,
        };
        return Ok((out, Some(lse)));
    }
    let group = h / hkv;
    let qh = q.transpose(0, 1)?.contiguous()?; // (H, Sq, D)
                                               // Repeat each KV head for its group of query heads (fine here: this is the reference).
    let expand = |t: &Tensor, d: usize| -> Result<Tensor> {
        t.transpose(0, 1)?.unsqueeze(1)?.expand((hkv, group, sk, d))?.reshape((h, sk, d))
    };
    let (kh, vh) = (expand(k, d)?, expand(v, dv)?);
    let mut s = (qh.matmul(&kh.t()?.contiguous()?)? * opts.softmax_scale as f64)?; // (H, Sq, Sk)
    if let Some(c) = opts.softcap {
        s = ((s / c as f64)?.tanh()? * c as f64)?;
    }
    if let Some((bias, heads)) = bias((shape, host), visible, b) {
        let bias = Tensor::from_vec(bias, (heads, sq, sk), q.device())?.to_dtype(dtype)?;
        s = s.broadcast_add(&bias)?;
    }
    let no_empty_row = (0..h).all(|head| (0..sq).all(|i| (0..sk).any(|j| visible.get(head, i, j))));
    let tracked = [q, k, v].iter().any(|t| t.track_op());
    if !want_lse && !tracked && no_empty_row && !p_e4m3 && sinks.is_none() {
        // Inference without empty rows: candle's fused softmax (no backward, no LSE needed).
        let p = candle_nn::ops::softmax_last_dim(&s)?;
        return Ok((p.matmul(&vh)?.transpose(0, 1)?, None));
    }
    // Softmax that gives 0 (not NaN) on rows with no visible key. The max only shifts the
    // exponent, so it is detached; fully masked rows shift by 0 and divide by 1.
    // A sink is one more logit in every row's softmax, with no value: it joins the max and the
    // sum (so a fully masked row has all its mass on the sink, sum 1, output 0).
    let m = s.max_keepdim(D::Minus1)?.detach();
    let m = match &sinks {
        Some(sink) => m.broadcast_maximum(&sink.detach())?,
        None => m,
    };
    let neg_inf = m.eq(f64::NEG_INFINITY)?;
    let m = neg_inf.where_cond(&m.zeros_like()?, &m)?;
    let e = s.broadcast_sub(&m)?.exp()?;
    let mut sum = e.sum_keepdim(D::Minus1)?;
    if let Some(sink) = &sinks {
        sum = (sum + sink.broadcast_sub(&m)?.exp()?)?;
    }
    let denom = (&sum + sum.eq(0.0)?.to_dtype(dtype)?.detach())?;
    let out = if p_e4m3 {
        // through f32: candle's CPU e4m3 <-> f64 casts are not usable (tests/fp8.rs)
        let e8 = crate::fp8::cast_e4m3(&e.to_dtype(DType::F32)?, DType::F8E4M3)?;
        let e8 = crate::fp8::cast_e4m3(&e8, DType::F32)?.to_dtype(dtype)?;
        e8.matmul(&vh)?.broadcast_div(&denom)?.transpose(0, 1)?
    } else {
        e.broadcast_div(&denom)?.matmul(&vh)?.transpose(0, 1)? // (Sq, H, D)
    };
    let lse = (m.to_dtype(DType::F32)? + sum.to_dtype(DType::F32)?.log()?)?.squeeze(D::Minus1)?;
    Ok((out, Some(lse)))
}
