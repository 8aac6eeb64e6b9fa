//! Rotary position embeddings: the frequencies (with Llama 3.1's scaling), the cos/sin tables
//! for a range of positions, their application to q/k in the `(B, S, H, D)` layout, and the
//! Q/K row permutation that relates llama.cpp's interleaved variant to Hugging Face's.

use super::config::LlamaConfig;
use candle_core::{bail, DType, Device, Result, Tensor, D};

/// Llama 3.1's frequency-dependent rotary scaling (`rope_scaling.rope_type == "llama3"`):
/// long wavelengths are slowed down by `factor`, short ones kept, and the band between is
/// interpolated, so that the model reaches past its original context.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// How the rotary frequencies `theta^(-2i/D)` are adjusted.
#[derive(Clone, Debug, PartialEq, Default)]
pub enum RopeScaling {
    #[default]
    None,
    Llama3(Llama3RopeScaling),
    /// One divisor per frequency, as llama.cpp stores Llama 3.1's scaling in GGUF files (the
    /// `rope_freqs.weight` tensor, already evaluated from the formula above).
    FreqFactors(Vec<f32>),
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
        self.tables(start, start..start + len, dtype, device)
    }

    /// The tables for arbitrary positions, one row each (a batch of packed sequences, each at
    /// its own position); `start` of the result is the first position (0 when empty).
    pub fn rope_at(&self, positions: &[usize], dtype: DType, device: &Device) -> Result<Rope> {
        let start = positions.first().copied().unwrap_or(0);
        self.tables(start, positions.iter().copied(), dtype, device)
    }

    fn tables(
        &self,
        start: usize,
        positions: impl ExactSizeIterator<Item = usize>,
        dtype: DType,
        device: &Device,
    ) -> Result<Rope> {
        let (half, len) = (self.inv_freq.len(), positions.len());
        let mut cos = Vec::with_capacity(len * half);
        let mut sin = Vec::with_capacity(len * half);
        for pos in positions {
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

fn qk_dims(w: &Tensor, n_head: usize) -> Result<(usize, usize, usize)> {
    let (rows, cols) = w.dims2()?;
    if n_head == 0 || !rows.is_multiple_of(n_head) || !(rows / n_head).is_multiple_of(2) {
        bail!("q/k weight {:?} does not split into {n_head} heads of even size", w.dims())
    }
    Ok((rows, cols, rows / n_head / 2))
}

/// llama.cpp's conversion permutes the rows of Q and K (per head, the two halves of the head
/// dim are interleaved) so that its interleaved rotary matches Hugging Face's "rotate half"
/// rotary. This is that permutation (`convert_hf_to_gguf.py`'s `permute`): used to write GGUF.
pub fn permute_qk_rows(w: &Tensor, n_head: usize) -> Result<Tensor> {
    let (rows, cols, half) = qk_dims(w, n_head)?;
    w.reshape((n_head, 2, half, cols))?.transpose(1, 2)?.reshape((rows, cols))
}

/// The inverse of [`permute_qk_rows`]: GGUF rows back to Hugging Face order, so that the
/// model's non-interleaved rotary (`rope_thd`, in the flash layout) applies to GGUF weights.
pub fn unpermute_qk_rows(w: &Tensor, n_head: usize) -> Result<Tensor> {
    let (rows, cols, half) = qk_dims(w, n_head)?;
    w.reshape((n_head, half, 2, cols))?.transpose(1, 2)?.reshape((rows, cols))
}
