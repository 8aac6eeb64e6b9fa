//! The Llama attention block: q/k/v/o projections, rotary embeddings ([`super::rotary`]), the
//! KV cache ([`super::kv_cache`]), and the attention itself through [`candle_flash::flash_attn`], the
//! naive [`candle_flash::reference::attention`], or FP8 ([`candle_flash::fp8`]).

use super::config::LlamaConfig;
use super::kv_cache::KvCache;
use super::paged_cache::PagedStep;
use super::qlinear::QLinear;
use super::qlinear::WeightSource;
use super::rotary::{apply_rope, Rope};
use candle_core::{bail, Module, Result, Tensor};
use candle_flash::{reference, BlockMask, FlashAttnOptions, PagedKv, VarLen};
use candle_nn::VarBuilder;
use std::str::FromStr;

/// Which attention computes `softmax(QKᵀ/√D)·V` inside the block. Both take the same
/// `(B, S, H, D)` / `(B, Sk, Hkv, D)` layouts, so switching changes nothing else.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttnImpl {
    /// [`candle_flash::flash_attn`]: tiled, O(N) memory, no score matrix.
    #[default]
    Flash,
    /// [`candle_flash::reference::attention`]: the full score matrix, for comparison.
    Naive,
    /// FP8 attention ([`candle_flash::fp8::flash_attn_fp8`]): q, k and v quantized to e4m3 with one
    /// scale per head at every call, output in the model's dtype (the FP8 tensor-core kernel on
    /// Hopper for f16 / bf16 models). Over a paged cache (the batched mode) the cached keys are
    /// first gathered into contiguous rows (FP8 has no paged kernel), and decode runs without
    /// CUDA graphs.
    Fp8,
}

impl FromStr for AttnImpl {
    type Err = candle_core::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "flash" => Ok(Self::Flash),
            "naive" | "reference" => Ok(Self::Naive),
            "fp8" => Ok(Self::Fp8),
            other => bail!("unknown attention implementation {other:?} (expected flash, naive or fp8)"),
        }
    }
}

/// Llama self-attention: q/k/v/o projections without bias, rotary embeddings on q and k,
/// causal attention with grouped K/V heads, optional KV cache.
#[derive(Clone, Debug)]
pub struct LlamaAttention {
    proj: Projections,
    o_proj: QLinear,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    softmax_scale: f32,
    attn_impl: AttnImpl,
    /// Learnable attention sinks (gpt-oss), f32 `[num_heads]`: [`FlashAttnOptions::sinks`].
    sinks: Option<Tensor>,
}

impl LlamaAttention {
    /// From the four projections (weights `(out, in)` as in `candle_nn::Linear`, dense or
    /// quantized); the head dim follows from q's rows. Checks that the shapes fit together.
    pub fn new(
        q_proj: impl Into<QLinear>,
        k_proj: impl Into<QLinear>,
        v_proj: impl Into<QLinear>,
        o_proj: impl Into<QLinear>,
        num_heads: usize,
        num_kv_heads: usize,
        attn_impl: AttnImpl,
    ) -> Result<Self> {
        let (q_proj, k_proj, v_proj, o_proj) = (q_proj.into(), k_proj.into(), v_proj.into(), o_proj.into());
        let (q_out, hidden) = q_proj.dims()?;
        if num_heads == 0
            || num_kv_heads == 0
            || !num_heads.is_multiple_of(num_kv_heads)
            || !q_out.is_multiple_of(num_heads)
        {
            bail!("llama attention: {num_heads} heads / {num_kv_heads} kv heads do not fit q_proj {:?}", q_proj.dims()?)
        }
        let head_dim = q_out / num_heads;
        for (name, p, rows) in
            [("k_proj", &k_proj, num_kv_heads * head_dim), ("v_proj", &v_proj, num_kv_heads * head_dim)]
        {
            if p.dims()? != (rows, hidden) {
                bail!("llama attention: {name} is {:?}, expected [{rows}, {hidden}]", p.dims()?)
            }
        }
        if o_proj.dims()?.1 != q_out {
            bail!("llama attention: o_proj is {:?}, expected [_, {q_out}]", o_proj.dims()?)
        }
        let softmax_scale = 1.0 / (head_dim as f32).sqrt();
        let proj = Projections::new(q_proj, k_proj, v_proj)?;
        Ok(Self { proj, o_proj, num_heads, num_kv_heads, head_dim, softmax_scale, attn_impl, sinks: None })
    }

    /// The block with learnable attention sinks (f32 `[num_heads]`, one logit per query head that
    /// joins every row's softmax denominator: [`FlashAttnOptions::sinks`]); `None` removes them.
    /// A `Var` is trained through `Tensor::backward()` like the projections.
    pub fn with_sinks(mut self, sinks: Option<Tensor>) -> Result<Self> {
        if let Some(s) = &sinks {
            if s.dtype() != candle_core::DType::F32 || s.dims() != [self.num_heads] {
                bail!("llama attention: sinks must be f32 [{}], got {:?} {:?}", self.num_heads, s.dtype(), s.dims())
            }
        }
        self.sinks = sinks;
        Ok(self)
    }

    pub fn sinks(&self) -> Option<&Tensor> {
        self.sinks.as_ref()
    }

    /// The causal attention options of this block (scale, sinks).
    fn attn_options(&self) -> FlashAttnOptions {
        FlashAttnOptions::new(self.softmax_scale).causal(true).sinks(self.sinks.as_ref())
    }

    /// From Hugging Face names under `vb` (`q_proj.weight`, ...).
    pub fn load(vb: VarBuilder, cfg: &LlamaConfig, attn_impl: AttnImpl) -> Result<Self> {
        Self::load_from(&WeightSource::new(vb, None), cfg, attn_impl)
    }

    pub(crate) fn load_from(ws: &WeightSource, cfg: &LlamaConfig, attn_impl: AttnImpl) -> Result<Self> {
        let (h, hkv, d, hidden) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size);
        let q = ws.linear(hidden, h * d, "q_proj")?;
        let k = ws.linear(hidden, hkv * d, "k_proj")?;
        let v = ws.linear(hidden, hkv * d, "v_proj")?;
        let o = ws.linear(h * d, hidden, "o_proj")?;
        Self::new(q, k, v, o, h, hkv, attn_impl)
    }

    pub fn attn_impl(&self) -> AttnImpl {
        self.attn_impl
    }

    pub fn set_attn_impl(&mut self, attn_impl: AttnImpl) {
        self.attn_impl = attn_impl;
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// `x` `(B, S, hidden)` at positions `rope.start..rope.start + S` → `(B, S, hidden)`.
    ///
    /// With a cache, the new keys/values are appended and the queries attend to everything
    /// cached; `rope.start` must equal the cache length. Prefill (S > 1) and decode (S = 1) are
    /// the same call: the causal mask is aligned bottom-right, so query i sees keys
    /// `0..=rope.start + i`. Without a cache the keys are just this call's, and autograd
    /// differentiates the whole block (the cache writes in place, which autograd cannot follow).
    pub fn forward(&self, x: &Tensor, rope: &Rope, cache: Option<&mut KvCache>) -> Result<Tensor> {
        let (q, k, v) = self.rotated_qkv(x, rope)?;
        let (k, v) = match cache {
            Some(cache) => {
                if cache.len() != rope.start {
                    bail!("llama attention: rope starts at position {} but the cache holds {}", rope.start, cache.len())
                }
                cache.append(&k, &v)?
            }
            None => (k, v),
        };
        let opts = self.attn_options();
        let y = match self.attn_impl {
            // With sinks, the attention op (the decode kernel knows none).
            AttnImpl::Flash if self.sinks.is_some() => candle_flash::flash_attn_with_options(&q, &k, &v, &opts)?,
            // One query position on the CPU (decode): see `decode_attn` for why not the tiled kernel.
            AttnImpl::Flash => match super::decode_attn::decode_attention(&q, &k, &v, self.softmax_scale)? {
                Some(y) => y,
                None => candle_flash::flash_attn_with_options(&q, &k, &v, &opts)?,
            },
            AttnImpl::Naive => reference::attention(&q, &k, &v, &opts)?,
            AttnImpl::Fp8 => fp8_attention(&q, &k, &v, &opts)?,
        };
        self.out(x, &y)
    }

    /// q `(B, S, H, D)` and k with the rotary embedding of `rope`, v `(B, S, Hkv, D)`, from `x`.
    fn rotated_qkv(&self, x: &Tensor, rope: &Rope) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, s, _hidden) = x.dims3()?;
        let (h, hkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let (q, k, v) = self.proj.forward(x, 0)?;
        let q = apply_rope(&q.reshape((b, s, h, d))?, rope)?;
        let k = apply_rope(&k.reshape((b, s, hkv, d))?, rope)?;
        Ok((q, k, v.reshape((b, s, hkv, d))?))
    }

    /// The output projection of the attention `y` of `x`'s `B` x `S` positions.
    fn out(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        let (b, s, _hidden) = x.dims3()?;
        self.o_proj.forward(&y.reshape((b, s, self.num_heads * self.head_dim))?)
    }

    /// [`forward`](Self::forward) without a cache, through a block mask that intersects the
    /// causal one: several documents packed in one batch row for training and prefill
    /// ([`BlockMask::from_spec`] with [`candle_flash::MaskSpec::same_document`]), or any other
    /// block-sparse pattern. The mask's lengths are the call's (`S` queries and keys); autograd
    /// differentiates the block as without a mask. Flash and naive only (the e4m3 path has no
    /// block masks).
    pub fn forward_block_masked(&self, x: &Tensor, rope: &Rope, mask: &BlockMask) -> Result<Tensor> {
        let (q, k, v) = self.rotated_qkv(x, rope)?;
        let opts = self.attn_options().block_mask(Some(mask));
        let y = match self.attn_impl {
            AttnImpl::Flash => candle_flash::flash_attn_with_options(&q, &k, &v, &opts)?,
            AttnImpl::Naive => reference::attention(&q, &k, &v, &opts)?,
            AttnImpl::Fp8 => bail!("llama attention: the fp8 path takes no block mask"),
        };
        self.out(x, &y)
    }
}

/// [`AttnImpl::Fp8`]: q, k, v quantized to e4m3 per head, attention with the output in q's
/// dtype (f32 models: f32, on the dequantizing path).
fn fp8_attention(q: &Tensor, k: &Tensor, v: &Tensor, opts: &FlashAttnOptions) -> Result<Tensor> {
    use candle_flash::fp8::{flash_attn_fp8, quantize_e4m3, Fp8Scaling};
    let (q8, k8, v8) = (
        quantize_e4m3(q, Fp8Scaling::PerHead)?,
        quantize_e4m3(k, Fp8Scaling::PerHead)?,
        quantize_e4m3(v, Fp8Scaling::PerHead)?,
    );
    flash_attn_fp8(&q8, &k8, &v8, opts, q.dtype())
}

impl LlamaAttention {
    /// The packed new tokens `x (T, hidden)` of several sequences against a paged cache (one
    /// layer's K/V pools `(pages, page_size, Hkv, D)`): rotary embeddings at each token's own
    /// position (`rope` from [`RotaryEmbedding::rope_at`]), the new K/V rows written into their
    /// slots, then causal varlen attention of each sequence's new queries over all its cached
    /// keys through the block table. `few`: the leading rows that take the few-rows linear
    /// kernels ([`QLinear::forward_split`]). → `(T, hidden)`.
    ///
    /// [`RotaryEmbedding::rope_at`]: super::rotary::RotaryEmbedding::rope_at
    pub(crate) fn forward_paged(
        &self,
        x: &Tensor,
        rope: &Rope,
        (k_cache, v_cache): &(Tensor, Tensor),
        step: &PagedStep,
        few: usize,
    ) -> Result<Tensor> {
        let (t, _hidden) = x.dims2()?;
        let (h, hkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let (q, k, v) = self.proj.forward_heads(x, few, (h, hkv, d))?;
        // Each packed token at its own position (one row of the tables each); on CUDA one
        // kernel rotates q and k and writes k and v into their slots.
        let tables = (&rope.cos, &rope.sin);
        let q = candle_flash::rope_write_paged_kv(&q, &k, &v, tables, (k_cache, v_cache), &step.slots)?;
        let opts = step.attn_options(self.softmax_scale).sinks(self.sinks.as_ref());
        let y = match self.attn_impl {
            AttnImpl::Flash if step.single > 0 && self.sinks.is_none() => {
                self.attend_split(&q, k_cache, v_cache, step, &opts)?
            }
            AttnImpl::Flash => candle_flash::flash_attn_with_options(&q, k_cache, v_cache, &opts)?,
            AttnImpl::Naive => reference::attention(&q, k_cache, v_cache, &opts)?,
            AttnImpl::Fp8 => {
                // The FP8 kernel reads no block table: the pages gathered into the packed varlen
                // layout, whose offsets are the step's cumulative key lengths (opts' seqlens_k).
                let rows = step.packed_key_rows()?;
                let gather = |t: &Tensor| t.flatten_to(1)?.index_select(rows, 0);
                fp8_attention(&q, &gather(k_cache)?, &gather(v_cache)?, &opts.clone().paged(None))?
            }
        };
        self.o_proj.forward_split(&y.reshape((t, h * d))?, few)
    }

    /// The step's leading single-token sequences through the CPU decode kernel (what a sequence
    /// decoding alone runs, see `decode_attn`), the others through the paged attention op.
    fn attend_split(
        &self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        step: &PagedStep,
        opts: &FlashAttnOptions,
    ) -> Result<Tensor> {
        let n = step.single;
        let w = step.table_width;
        let seqs: Vec<(&[u32], usize)> =
            (0..n).map(|i| (&step.host_table[i * w..(i + 1) * w], step.k_lens[i])).collect();
        let q1 = q.narrow(0, 0, n)?;
        let Some(y1) = super::decode_attn::decode_attention_paged(&q1, k_cache, v_cache, &seqs, self.softmax_scale)?
        else {
            return candle_flash::flash_attn_with_options(q, k_cache, v_cache, opts);
        };
        let Some(rest) = &step.rest else { return Ok(y1) };
        let opts = opts
            .clone()
            .varlen(Some(VarLen {
                seqlens_q: rest.seqlens_q.clone(),
                seqlens_k: rest.seqlens_k.clone(),
                max_seqlen_q: rest.max_seqlen_q,
                max_seqlen_k: step.max_seqlen_k,
            }))
            .paged(Some(PagedKv::new(&rest.block_table, k_cache.dim(1)?)));
        let y2 = candle_flash::flash_attn_with_options(&q.narrow(0, n, q.dim(0)? - n)?, k_cache, v_cache, &opts)?;
        Tensor::cat(&[&y1, &y2], 0)
    }
}

/// The q/k/v projections. Quantized weights are fused into one `(q + 2·kv, hidden)` matrix: one
/// product per layer instead of three (on the CPU each product is a parallel section with its
/// own scheduling cost, which matters at one token per step). Dense weights stay separate so
/// that autograd sees the three weights the caller gave.
#[derive(Clone, Debug)]
enum Projections {
    Separate { q: QLinear, k: QLinear, v: QLinear },
    Fused { qkv: QLinear, q_out: usize, kv_out: usize },
}

impl Projections {
    fn new(q: QLinear, k: QLinear, v: QLinear) -> Result<Self> {
        if q.is_quantized() {
            if let Some(qkv) = QLinear::concat_rows(&[&q, &k, &v])? {
                return Ok(Self::Fused { qkv, q_out: q.dims()?.0, kv_out: k.dims()?.0 });
            }
        }
        Ok(Self::Separate { q, k, v })
    }

    /// q, k and v of the rows `x (T, hidden)` shaped `(T, heads, D)` without copies: views of
    /// the fused product (heads contiguous, rows strided) or the separate ones reshaped.
    fn forward_heads(
        &self,
        x: &Tensor,
        few: usize,
        (h, hkv, d): (usize, usize, usize),
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let t = x.dim(0)?;
        match self {
            Self::Separate { q, k, v } => Ok((
                q.forward_split(x, few)?.reshape((t, h, d))?,
                k.forward_split(x, few)?.reshape((t, hkv, d))?,
                v.forward_split(x, few)?.reshape((t, hkv, d))?,
            )),
            Self::Fused { qkv, .. } => {
                let y = qkv.forward_split(x, few)?.reshape((t, h + 2 * hkv, d))?;
                Ok((y.narrow(1, 0, h)?, y.narrow(1, h, hkv)?, y.narrow(1, h + hkv, hkv)?))
            }
        }
    }

    /// `few`: see [`QLinear::forward_split`].
    fn forward(&self, x: &Tensor, few: usize) -> Result<(Tensor, Tensor, Tensor)> {
        match self {
            Self::Separate { q, k, v } => {
                Ok((q.forward_split(x, few)?, k.forward_split(x, few)?, v.forward_split(x, few)?))
            }
            Self::Fused { qkv, q_out, kv_out } => {
                let y = qkv.forward_split(x, few)?;
                let last = y.rank() - 1;
                Ok((
                    y.narrow(last, 0, *q_out)?,
                    y.narrow(last, *q_out, *kv_out)?,
                    y.narrow(last, q_out + kv_out, *kv_out)?,
                ))
            }
        }
    }
}
