//! The Llama attention block: projections, rotary embeddings, the KV cache, and the attention
//! itself through [`crate::flash_attn`] or the naive [`crate::reference::attention`].

use super::config::{LlamaConfig, RopeScaling};
use crate::{reference, FlashAttnOptions};
use candle_core::{bail, DType, Device, Module, Result, Tensor, D};
use candle_nn::{Linear, VarBuilder};
use std::str::FromStr;

/// Which attention computes `softmax(QKᵀ/√D)·V` inside the block. Both take the same
/// `(B, S, H, D)` / `(B, Sk, Hkv, D)` layouts, so switching changes nothing else.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttnImpl {
    /// [`crate::flash_attn`]: tiled, O(N) memory, no score matrix.
    #[default]
    Flash,
    /// [`crate::reference::attention`]: the full score matrix, for comparison.
    Naive,
}

impl FromStr for AttnImpl {
    type Err = candle_core::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "flash" => Ok(Self::Flash),
            "naive" | "reference" => Ok(Self::Naive),
            other => bail!("unknown attention implementation {other:?} (expected flash or naive)"),
        }
    }
}

/// Rotary frequencies of one model; hands out the cos/sin tables for a range of positions.
///
/// Tables are computed per call for exactly the positions of that forward (one row per new
/// token) instead of precomputed up to the maximal context: a Llama 3.1 context of 128k
/// positions would otherwise cost tens of MB per model for rows that are rarely used.
#[derive(Clone, Debug)]
pub struct RotaryEmbedding {
    inv_freq: Vec<f64>,
}

/// cos and sin `(S, D/2)` for positions `start..start + S`, in the activations' dtype.
#[derive(Clone, Debug)]
pub struct Rope {
    pub start: usize,
    pub cos: Tensor,
    pub sin: Tensor,
}

impl RotaryEmbedding {
    pub fn new(cfg: &LlamaConfig) -> Result<Self> {
        Self::from_parts(cfg.head_dim, cfg.rope_theta, &cfg.rope_scaling)
    }

    /// Frequencies `theta^(-2i/D)` for `i < D/2`, adjusted by `scaling`.
    pub fn from_parts(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Result<Self> {
        let d = head_dim;
        if d == 0 || !d.is_multiple_of(2) || !(theta.is_finite() && theta > 0.0) {
            bail!("rope: head dim {d} must be even and > 0, theta {theta} must be > 0")
        }
        let mut inv_freq: Vec<f64> = (0..d / 2).map(|i| 1.0 / theta.powf(2.0 * i as f64 / d as f64)).collect();
        match scaling {
            RopeScaling::None => {}
            RopeScaling::FreqFactors(factors) => {
                if factors.len() != inv_freq.len() {
                    bail!("rope: {} frequency factors for head dim {d}", factors.len())
                }
                for (f, k) in inv_freq.iter_mut().zip(factors) {
                    *f /= *k as f64;
                }
            }
            RopeScaling::Llama3(s) => {
                // The formula of Hugging Face's `_compute_llama3_parameters`.
                let old_ctx = s.original_max_position_embeddings as f64;
                let low_wavelen = old_ctx / s.low_freq_factor;
                let high_wavelen = old_ctx / s.high_freq_factor;
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f64::consts::PI / *f;
                    *f = if wavelen < high_wavelen {
                        *f
                    } else if wavelen > low_wavelen {
                        *f / s.factor
                    } else {
                        let smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                        (1.0 - smooth) * *f / s.factor + smooth * *f
                    };
                }
            }
        }
        Ok(Self { inv_freq })
    }

    pub fn head_dim(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// The (scaled) inverse frequencies, one per rotated pair.
    pub fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }

    /// The tables for positions `start..start + len`. Angles are formed in f64 so that late
    /// positions keep their precision before the cos/sin are rounded to `dtype`.
    pub fn rope(&self, start: usize, len: usize, dtype: DType, device: &Device) -> Result<Rope> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(len * half);
        let mut sin = Vec::with_capacity(len * half);
        for pos in start..start + len {
            for f in &self.inv_freq {
                let (s, c) = (pos as f64 * f).sin_cos();
                cos.push(c as f32);
                sin.push(s as f32);
            }
        }
        let cos = Tensor::from_vec(cos, (len, half), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (len, half), device)?.to_dtype(dtype)?;
        Ok(Rope { start, cos, sin })
    }
}

/// Rotary embedding ("rotate half", Hugging Face's layout) of `x` `(B, S, H, D)`.
///
/// candle-nn's fused `rope_thd` works in this layout directly, so q and k go from the
/// projection to the attention without a transpose; it has no backward, so when gradients are
/// being tracked the same formula is composed from differentiable tensor ops instead.
pub fn apply_rope(x: &Tensor, rope: &Rope) -> Result<Tensor> {
    let (_b, s, _h, d) = x.dims4()?;
    check_rope(rope, s, d)?;
    if x.track_op() || rope.cos.track_op() || rope.sin.track_op() {
        let cos = Tensor::cat(&[&rope.cos, &rope.cos], 1)?.reshape((s, 1, d))?;
        let sin = Tensor::cat(&[&rope.sin, &rope.sin], 1)?.reshape((s, 1, d))?;
        let x1 = x.narrow(D::Minus1, 0, d / 2)?;
        let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        return x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?;
    }
    candle_nn::rotary_emb::rope_thd(&x.contiguous()?, &rope.cos, &rope.sin)
}

/// The interleaved rotary variant (pairs `(x[2i], x[2i+1])` rotate together; llama.cpp's and
/// Meta's original layout) of `x` `(B, S, H, D)`, through candle-nn's `rope_i`. The model does
/// not use it: it un-permutes GGUF weights instead. It is here to show (in the tests) that the
/// two are the same computation on permuted rows. No backward.
pub fn apply_rope_interleaved(x: &Tensor, rope: &Rope) -> Result<Tensor> {
    let (_b, s, _h, d) = x.dims4()?;
    check_rope(rope, s, d)?;
    let xt = x.transpose(1, 2)?.contiguous()?; // rope_i wants (B, H, S, D)
    candle_nn::rotary_emb::rope_i(&xt, &rope.cos, &rope.sin)?.transpose(1, 2)?.contiguous()
}

fn check_rope(rope: &Rope, s: usize, d: usize) -> Result<()> {
    let (rs, half) = rope.cos.dims2()?;
    if rs != s || half * 2 != d || rope.sin.dims() != rope.cos.dims() {
        bail!("rope: tables {:?}/{:?} do not fit {s} positions of head dim {d}", rope.cos.dims(), rope.sin.dims())
    }
    Ok(())
}

/// The keys and values seen so far, `(B, len, Hkv, D)` each.
///
/// Appending must not copy the whole cache every step (that would make decoding quadratic in
/// memory traffic), so the cache keeps buffers with spare capacity along the sequence axis:
/// new rows are written in place with `slice_set`, the attention reads a `narrow` view of the
/// filled part (no copy: the flash kernels take strided K/V), and the buffers double when full,
/// so each row is copied O(1) times on average.
#[derive(Clone, Debug)]
pub struct KvCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
    len: usize,
    min_capacity: usize,
}

impl Default for KvCache {
    fn default() -> Self {
        Self::new(256)
    }
}

impl KvCache {
    /// An empty cache whose first buffers hold at least `min_capacity` positions.
    pub fn new(min_capacity: usize) -> Self {
        Self { k: None, v: None, len: 0, min_capacity: min_capacity.max(1) }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the current buffers hold before they must grow.
    pub fn capacity(&self) -> usize {
        self.k.as_ref().and_then(|k| k.dim(1).ok()).unwrap_or(0)
    }

    /// Forgets the contents (keeps the buffers for reuse).
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Views of the cached keys and values, `(B, len, Hkv, D)`.
    pub fn kv(&self) -> Result<Option<(Tensor, Tensor)>> {
        match (&self.k, &self.v) {
            (Some(k), Some(v)) => Ok(Some((k.narrow(1, 0, self.len)?, v.narrow(1, 0, self.len)?))),
            _ => Ok(None),
        }
    }

    /// Appends `k` and `v` `(B, S, Hkv, D)` and returns views of everything cached so far.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, s, hkv, d) = k.dims4()?;
        if v.dims() != k.dims() || v.dtype() != k.dtype() {
            bail!("kv cache: k {:?} {:?} and v {:?} {:?} differ", k.dims(), k.dtype(), v.dims(), v.dtype())
        }
        if let Some(buf) = &self.k {
            let (bb, _, bh, bd) = buf.dims4()?;
            if (bb, bh, bd) != (b, hkv, d) || buf.dtype() != k.dtype() {
                bail!(
                    "kv cache: appending {:?} {:?} to a cache of {:?} {:?}",
                    k.dims(),
                    k.dtype(),
                    buf.dims(),
                    buf.dtype()
                )
            }
        }
        let needed = self.len + s;
        if needed > self.capacity() {
            let mut cap = self.capacity().max(self.min_capacity);
            while cap < needed {
                cap *= 2;
            }
            let grow = |old: &Option<Tensor>| -> Result<Tensor> {
                let buf = Tensor::zeros((b, cap, hkv, d), k.dtype(), k.device())?;
                if let Some(old) = old {
                    // The whole old buffer (filled part and spare rows) is contiguous, which
                    // slice_set needs; copying a few spare rows is cheaper than gathering.
                    buf.slice_set(old, 1, 0)?;
                }
                Ok(buf)
            };
            self.k = Some(grow(&self.k)?);
            self.v = Some(grow(&self.v)?);
        }
        let (kb, vb) = match (&self.k, &self.v) {
            (Some(kb), Some(vb)) => (kb, vb),
            _ => bail!("kv cache: buffers missing after growth"),
        };
        kb.slice_set(&k.contiguous()?, 1, self.len)?;
        vb.slice_set(&v.contiguous()?, 1, self.len)?;
        self.len = needed;
        Ok((kb.narrow(1, 0, needed)?, vb.narrow(1, 0, needed)?))
    }
}

/// Llama self-attention: q/k/v/o projections without bias, rotary embeddings on q and k,
/// causal attention with grouped K/V heads, optional KV cache.
#[derive(Clone, Debug)]
pub struct LlamaAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    softmax_scale: f32,
    attn_impl: AttnImpl,
}

impl LlamaAttention {
    /// From the four projections (weights `(out, in)` as in `candle_nn::Linear`); the head dim
    /// follows from q's rows. Checks that the shapes fit together.
    pub fn new(
        q_proj: Linear,
        k_proj: Linear,
        v_proj: Linear,
        o_proj: Linear,
        num_heads: usize,
        num_kv_heads: usize,
        attn_impl: AttnImpl,
    ) -> Result<Self> {
        let (q_out, hidden) = q_proj.weight().dims2()?;
        if num_heads == 0
            || num_kv_heads == 0
            || !num_heads.is_multiple_of(num_kv_heads)
            || !q_out.is_multiple_of(num_heads)
        {
            bail!(
                "llama attention: {num_heads} heads / {num_kv_heads} kv heads do not fit q_proj {:?}",
                q_proj.weight().dims()
            )
        }
        let head_dim = q_out / num_heads;
        for (name, p, rows) in
            [("k_proj", &k_proj, num_kv_heads * head_dim), ("v_proj", &v_proj, num_kv_heads * head_dim)]
        {
            if p.weight().dims() != [rows, hidden] {
                bail!("llama attention: {name} is {:?}, expected [{rows}, {hidden}]", p.weight().dims())
            }
        }
        if o_proj.weight().dims2()?.1 != q_out {
            bail!("llama attention: o_proj is {:?}, expected [_, {q_out}]", o_proj.weight().dims())
        }
        let softmax_scale = 1.0 / (head_dim as f32).sqrt();
        Ok(Self { q_proj, k_proj, v_proj, o_proj, num_heads, num_kv_heads, head_dim, softmax_scale, attn_impl })
    }

    /// From Hugging Face names under `vb` (`q_proj.weight`, ...).
    pub fn load(vb: VarBuilder, cfg: &LlamaConfig, attn_impl: AttnImpl) -> Result<Self> {
        let (h, hkv, d, hidden) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size);
        let q = candle_nn::linear_no_bias(hidden, h * d, vb.pp("q_proj"))?;
        let k = candle_nn::linear_no_bias(hidden, hkv * d, vb.pp("k_proj"))?;
        let v = candle_nn::linear_no_bias(hidden, hkv * d, vb.pp("v_proj"))?;
        let o = candle_nn::linear_no_bias(h * d, hidden, vb.pp("o_proj"))?;
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
        let (b, s, _hidden) = x.dims3()?;
        let (h, hkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let q = apply_rope(&self.q_proj.forward(x)?.reshape((b, s, h, d))?, rope)?;
        let k = apply_rope(&self.k_proj.forward(x)?.reshape((b, s, hkv, d))?, rope)?;
        let v = self.v_proj.forward(x)?.reshape((b, s, hkv, d))?;
        let (k, v) = match cache {
            Some(cache) => {
                if cache.len() != rope.start {
                    bail!("llama attention: rope starts at position {} but the cache holds {}", rope.start, cache.len())
                }
                cache.append(&k, &v)?
            }
            None => (k, v),
        };
        let y = match self.attn_impl {
            AttnImpl::Flash => crate::flash_attn(&q, &k, &v, self.softmax_scale, true)?,
            AttnImpl::Naive => {
                reference::attention(&q, &k, &v, &FlashAttnOptions::new(self.softmax_scale).causal(true))?
            }
        };
        self.o_proj.forward(&y.reshape((b, s, h * d))?)
    }
}
