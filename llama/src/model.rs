//! The full Llama: embeddings, decoder layers (RMSNorm, attention, RMSNorm, SwiGLU MLP),
//! final norm, lm_head, built from a `VarBuilder` with Hugging Face tensor names. The
//! generation loop (with sampling) is in `generate.rs`.

use super::attention::{AttnImpl, LlamaAttention};
use super::config::LlamaConfig;
use super::kv_cache::KvCache;
use super::paged_cache::{PagedKvCache, PagedStep, SeqId};
use super::qlinear::{QEmbedding, QLinear, WeightSource};
use super::rotary::{Rope, RotaryEmbedding};
use candle_core::{bail, DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::sync::Arc;

/// RMSNorm with candle-nn's fused kernel, or its differentiable composition when gradients are
/// tracked (the fused op has no backward).
#[derive(Clone, Debug)]
struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    fn load(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Self { weight: vb.get(size, "weight")?, eps: eps as f32 })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.track_op() || self.weight.track_op() {
            candle_nn::ops::rms_norm_slow(x, &self.weight, self.eps)
        } else {
            candle_nn::ops::rms_norm(&x.contiguous()?, &self.weight, self.eps)
        }
    }

    /// `(x + residual, norm(x + residual))` (`x` and `norm(x)` without a residual): on CUDA one
    /// kernel ([`candle_flash::fused::add_rms_norm`]).
    fn forward_add(&self, x: &Tensor, residual: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        candle_flash::fused::add_rms_norm(x, residual, &self.weight, self.eps)
    }
}

/// SwiGLU: `down(silu(gate(x)) * up(x))`.
#[derive(Clone, Debug)]
struct Mlp {
    gate_up: GateUp,
    down_proj: QLinear,
}

/// Quantized gate and up weights are fused into one `(2·inter, hidden)` matrix (one product per
/// layer instead of two, as for q/k/v in the attention); dense ones stay separate for autograd.
#[derive(Clone, Debug)]
enum GateUp {
    Separate(QLinear, QLinear),
    Fused(QLinear, usize),
}

impl Mlp {
    fn load(ws: &WeightSource, cfg: &LlamaConfig) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let gate = ws.linear(h, i, "gate_proj")?;
        let up = ws.linear(h, i, "up_proj")?;
        let fused = if gate.is_quantized() { QLinear::concat_rows(&[&gate, &up])? } else { None };
        let gate_up = match fused {
            Some(gu) => GateUp::Fused(gu, i),
            None => GateUp::Separate(gate, up),
        };
        Ok(Self { gate_up, down_proj: ws.linear(i, h, "down_proj")? })
    }

    /// `few`: see [`QLinear::forward_split`].
    fn forward(&self, x: &Tensor, few: usize) -> Result<Tensor> {
        let (gate, up) = match &self.gate_up {
            GateUp::Separate(g, u) => (g.forward_split(x, few)?, u.forward_split(x, few)?),
            GateUp::Fused(gu, i) => {
                let y = gu.forward_split(x, few)?;
                if let Some(h) = silu_mul_halves(&y, *i)? {
                    return self.down_proj.forward_split(&h, few);
                }
                let last = y.rank() - 1;
                (y.narrow(last, 0, *i)?, y.narrow(last, *i, *i)?)
            }
        };
        self.down_proj.forward_split(&candle_flash::fused::silu_mul(&gate, &up)?, few)
    }
}

/// `silu(gate) * up` for the fused `[gate | up]` rows of a CPU f32 tensor `(.., 2i)` → `(.., i)`
/// in one pass (None otherwise). Through candle this is two strided narrows, a silu and a
/// product: four ops and three temporaries per layer, which at one token per step cost more
/// than the arithmetic.
fn silu_mul_halves(y: &Tensor, i: usize) -> Result<Option<Tensor>> {
    if !y.device().is_cpu() || y.dtype() != DType::F32 || y.dims().last() != Some(&(2 * i)) {
        return Ok(None);
    }
    let (storage, layout) = y.storage_and_layout();
    let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)), Some((a, b))) =
        (&*storage, layout.contiguous_offsets())
    else {
        return Ok(None);
    };
    let out: Vec<f32> = v[a..b]
        .chunks_exact(2 * i)
        .flat_map(|r| r[..i].iter().zip(&r[i..]).map(|(g, u)| g / (1.0 + (-g).exp()) * u))
        .collect();
    let mut dims = y.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = i;
    }
    Ok(Some(Tensor::from_vec(out, dims, &Device::Cpu)?))
}

#[derive(Clone, Debug)]
struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: LlamaAttention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    fn forward(&self, x: &Tensor, rope: &Rope, cache: Option<&mut KvCache>) -> Result<Tensor> {
        let h = (x + self.self_attn.forward(&self.input_layernorm.forward(x)?, rope, cache)?)?;
        &h + self.mlp.forward(&self.post_attention_layernorm.forward(&h)?, 0)?
    }

    /// The packed tokens of a batch against one layer of a paged cache. The layer's input is
    /// `x + pending` (`pending`: the previous layer's MLP output, not yet added, so that the add
    /// and this layer's first norm are one step); returns the same pair for the next layer:
    /// `(h, mlp)` with the layer's output `h + mlp`.
    fn forward_paged(
        &self,
        x: &Tensor,
        pending: Option<&Tensor>,
        rope: &Rope,
        kv: &(Tensor, Tensor),
        step: &PagedStep,
        few: usize,
    ) -> Result<(Tensor, Tensor)> {
        let (x, normed) = self.input_layernorm.forward_add(x, pending)?;
        let attn = self.self_attn.forward_paged(&normed, rope, kv, step, few)?;
        let (h, normed) = self.post_attention_layernorm.forward_add(&x, Some(&attn))?;
        let mlp = self.mlp.forward(&normed, few)?;
        Ok((h, mlp))
    }
}

/// One KV cache per layer, for one batch of sequences that advance together.
#[derive(Clone, Debug)]
pub struct Cache {
    layers: Vec<KvCache>,
}

impl Cache {
    pub fn new(num_layers: usize, min_capacity: usize) -> Self {
        Self { layers: (0..num_layers).map(|_| KvCache::new(min_capacity)).collect() }
    }

    /// Tokens cached so far (the position of the next token).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, KvCache::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn layers(&self) -> &[KvCache] {
        &self.layers
    }

    pub fn reset(&mut self) {
        self.layers.iter_mut().for_each(KvCache::reset);
    }
}

#[derive(Clone, Debug)]
pub struct Llama {
    embed_tokens: QEmbedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: QLinear,
    rotary: RotaryEmbedding,
    cfg: LlamaConfig,
    dtype: DType,
    device: Device,
}

impl Llama {
    /// From Hugging Face tensor names (`model.embed_tokens.weight`, `model.layers.N...`,
    /// `model.norm.weight`, `lm_head.weight` unless tied). `progress(done, total)` is called
    /// after each layer.
    pub fn load(
        vb: VarBuilder,
        cfg: &LlamaConfig,
        attn_impl: AttnImpl,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        Self::load_from(&WeightSource::new(vb, None), cfg, attn_impl, progress)
    }

    /// Like [`Llama::load`], with the linear weights (and embeddings) found in `quantized`
    /// (Hugging Face names, e.g. from a GGUF file) taken from there as they are; `vb` supplies
    /// the rest (the norms). See [`QLinear`] for how they are multiplied.
    pub fn load_quantized(
        vb: VarBuilder,
        quantized: HashMap<String, QLinear>,
        cfg: &LlamaConfig,
        attn_impl: AttnImpl,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        Self::load_from(&WeightSource::new(vb, Some(Arc::new(quantized))), cfg, attn_impl, progress)
    }

    fn load_from(
        ws: &WeightSource,
        cfg: &LlamaConfig,
        attn_impl: AttnImpl,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        cfg.validate()?;
        let vb = ws.vb();
        let vm = ws.pp("model");
        let embed_tokens = vm.embedding(cfg.vocab_size, cfg.hidden_size, "embed_tokens")?;
        let n = cfg.num_hidden_layers;
        let mut layers = Vec::with_capacity(n);
        for i in 0..n {
            let vl = vm.pp(format!("layers.{i}"));
            layers.push(DecoderLayer {
                input_layernorm: RmsNorm::load(cfg.hidden_size, cfg.rms_norm_eps, vl.vb().pp("input_layernorm"))?,
                self_attn: LlamaAttention::load_from(&vl.pp("self_attn"), cfg, attn_impl)?,
                post_attention_layernorm: RmsNorm::load(
                    cfg.hidden_size,
                    cfg.rms_norm_eps,
                    vl.vb().pp("post_attention_layernorm"),
                )?,
                mlp: Mlp::load(&vl.pp("mlp"), cfg)?,
            });
            progress(i + 1, n);
        }
        let norm = RmsNorm::load(cfg.hidden_size, cfg.rms_norm_eps, vm.vb().pp("norm"))?;
        let lm_head = if cfg.tie_word_embeddings {
            embed_tokens.as_linear()?
        } else {
            ws.linear(cfg.hidden_size, cfg.vocab_size, "lm_head")?
        };
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
            rotary: RotaryEmbedding::new(cfg)?,
            cfg: cfg.clone(),
            dtype: vb.dtype(),
            device: vb.device().clone(),
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn set_attn_impl(&mut self, attn_impl: AttnImpl) {
        self.layers.iter_mut().for_each(|l| l.self_attn.set_attn_impl(attn_impl));
    }

    /// The attention the layers run (the first layer's; [`Self::set_attn_impl`] sets them all).
    pub fn attn_impl(&self) -> AttnImpl {
        self.layers.first().map_or(AttnImpl::Flash, |l| l.self_attn.attn_impl())
    }

    /// An empty cache for this model.
    pub fn new_cache(&self) -> Cache {
        Cache::new(self.layers.len(), 256)
    }

    /// The hidden states after the final norm, `(B, S, hidden)`.
    fn hidden(&self, input_ids: &Tensor, cache: Option<&mut Cache>) -> Result<Tensor> {
        let (_b, s) = input_ids.dims2()?;
        if s == 0 {
            bail!("llama: empty input")
        }
        let mut cache_layers = match cache {
            Some(c) if c.layers.len() != self.layers.len() => {
                bail!("llama: cache has {} layers, the model {}", c.layers.len(), self.layers.len())
            }
            Some(c) => Some(c.layers.as_mut_slice()),
            None => None,
        };
        let start = cache_layers.as_deref().and_then(|l| l.first()).map_or(0, KvCache::len);
        let rope = self.rotary.rope(start, s, self.dtype, &self.device)?;
        let mut x = self.embed_tokens.forward(input_ids)?;
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&x, &rope, cache_layers.as_deref_mut().map(|l| &mut l[i]))?;
        }
        self.norm.forward(&x)
    }

    /// Logits (f32) of the last position of each sequence, `(B, vocab)`. Only that position
    /// goes through lm_head: a 4096-token prompt would otherwise produce a 4096 x vocab matrix
    /// (800 MB for a 49k vocabulary) to read one row of it.
    pub fn forward(&self, input_ids: &Tensor, cache: Option<&mut Cache>) -> Result<Tensor> {
        let x = self.hidden(input_ids, cache)?;
        let s = x.dim(1)?;
        self.lm_head.forward(&x.narrow(1, s - 1, 1)?.contiguous()?)?.squeeze(1)?.to_dtype(DType::F32)
    }

    /// An empty paged cache for this model (its dtype and device), pages of `page_size` rows,
    /// at most `max_pages` pages per layer when given.
    pub fn new_paged_cache(&self, page_size: usize, max_pages: Option<usize>) -> Result<PagedKvCache> {
        PagedKvCache::new(&self.cfg, page_size, max_pages, self.dtype, &self.device)
    }

    /// One step of several sequences at once: `batch` lists each sequence's new tokens (a whole
    /// prompt, a chunk of one, or the one token sampled last), which are packed into one
    /// `(T, hidden)` activation, each at its own position; their K/V rows go into `cache`'s
    /// pages and each sequence attends to its own cached keys (the paged varlen attention).
    /// Returns the logits (f32) of each sequence's last new token, `(B, vocab)`, in `batch`'s
    /// order. Every sequence must have been added to the cache ([`PagedKvCache::add_sequence`])
    /// and appear at most once.
    ///
    /// Rows keep the arithmetic they would have alone: sequences with at most a few new tokens
    /// (decodes) are packed first and take the few-rows linear kernels together, longer chunks
    /// after them take the prefill path ([`QLinear::forward_split`]); every other part of the
    /// step works row by row. On error the cache must be considered corrupt for the sequences of
    /// the batch (their lengths have advanced); remove them.
    pub fn forward_paged(&self, batch: &[(SeqId, &[u32])], cache: &mut PagedKvCache) -> Result<Tensor> {
        let cfg = &self.cfg;
        if cache.num_layers() != self.layers.len() {
            bail!("llama: paged cache has {} layers, the model {}", cache.num_layers(), self.layers.len())
        }
        let (k0, _) = cache.layer(0)?;
        let (_, _, hkv, d) = k0.dims4()?;
        if (hkv, d) != (cfg.num_key_value_heads, cfg.head_dim) || k0.dtype() != self.dtype {
            bail!(
                "llama: paged cache of {hkv} kv heads of dim {d} in {:?}, the model has {} of {} in {:?}",
                k0.dtype(),
                cfg.num_key_value_heads,
                cfg.head_dim,
                self.dtype
            )
        }
        // Few-row sequences first (stable), so that their rows form one leading block, and
        // among them the one-token decodes first, for the CPU decode attention.
        let few_seq = |n: usize| n <= super::qlinear::SMALL_M;
        let mut order: Vec<usize> = (0..batch.len()).collect();
        order.sort_by_key(|&i| (!few_seq(batch[i].1.len()), batch[i].1.len() > 1));
        let few: usize = batch.iter().map(|(_, t)| t.len()).filter(|&n| few_seq(n)).sum();
        let plan: Vec<(SeqId, usize)> = order.iter().map(|&i| (batch[i].0, batch[i].1.len())).collect();
        // The decode kernel is the CPU f32 one (the attention `forward` uses for one query row).
        let split_single = self.device.is_cpu() && self.dtype == DType::F32;
        let step = cache.prepare(&plan, split_single)?;
        let tokens: Vec<u32> = order.iter().flat_map(|&i| batch[i].1.iter().copied()).collect();
        let t = tokens.len();
        let ids = Tensor::from_vec(tokens, t, &self.device)?;
        let rope = self.rotary.rope_at(&step.positions, self.dtype, &self.device)?;
        let (h, pending) = self.paged_rows(&ids, &rope, cache, &step, few)?;
        // Each sequence's last row, back in the caller's order.
        let mut last = vec![0u32; batch.len()];
        for (&i, &row) in order.iter().zip(&step.last_rows) {
            last[i] = row;
        }
        let last = Tensor::from_vec(last, batch.len(), &self.device)?;
        let pending = pending.map(|p| p.index_select(&last, 0)).transpose()?;
        // Every row through the few-rows kernels, as a sequence alone has one row here.
        self.head_few((&h.index_select(&last, 0)?, pending.as_ref()))
    }

    /// The decoder stack over the packed tokens `ids (T)` of a paged step (rotary tables `rope`
    /// one row per token, the step's addressing in `step`): the hidden states `(T, hidden)`
    /// before the final norm, as the pair `(h, mlp)` whose sum they are (see
    /// [`DecoderLayer::forward_paged`]). Only device work: no value is read back, nothing is
    /// copied from the host (what a captured CUDA graph replays, see [`super::graph`]).
    pub(crate) fn paged_rows(
        &self,
        ids: &Tensor,
        rope: &Rope,
        cache: &PagedKvCache,
        step: &PagedStep,
        few: usize,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let mut x = self.embed_tokens.forward(ids)?;
        let mut pending = None;
        for (i, layer) in self.layers.iter().enumerate() {
            let (h, mlp) = layer.forward_paged(&x, pending.as_ref(), rope, cache.layer(i)?, step, few)?;
            (x, pending) = (h, Some(mlp));
        }
        Ok((x, pending))
    }

    /// The final add and norm and lm_head over rows `h + pending` (`(T, hidden)`, as
    /// [`Llama::paged_rows`] returns them) that all take the few-rows kernels (each row is one
    /// sequence's last token): logits `(T, vocab)` in f32.
    pub(crate) fn head_few(&self, (h, pending): (&Tensor, Option<&Tensor>)) -> Result<Tensor> {
        let (_, normed) = self.norm.forward_add(h, pending)?;
        self.lm_head.forward_split(&normed, h.dim(0)?)?.to_dtype(DType::F32)
    }

    pub(crate) fn rotary(&self) -> &RotaryEmbedding {
        &self.rotary
    }

    /// Logits (f32) of every position, `(B, S, vocab)`.
    pub fn forward_all(&self, input_ids: &Tensor, cache: Option<&mut Cache>) -> Result<Tensor> {
        self.lm_head.forward(&self.hidden(input_ids, cache)?)?.to_dtype(DType::F32)
    }
}
