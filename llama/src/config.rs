//! The model hyper-parameters: filled in by the caller and checked with
//! [`LlamaConfig::validate`], or read from a Hugging Face `config.json`
//! (`LlamaConfig::from_hf_json`) or from GGUF metadata (`LlamaConfig::from_gguf`).

use super::rotary::RopeScaling;
use candle_core::{bail, Result};
use {super::rotary::Llama3RopeScaling, candle_core::quantized::gguf_file, serde::Deserialize};

#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    /// The output projection reuses the token embedding matrix.
    pub tie_word_embeddings: bool,
}

impl LlamaConfig {
    /// Checks what the layers rely on, so that a bad file fails at load with a message rather
    /// than in a reshape deep inside the forward.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        if c.vocab_size == 0 || c.hidden_size == 0 || c.intermediate_size == 0 || c.num_hidden_layers == 0 {
            bail!("llama config: vocab, hidden, intermediate sizes and layer count must be > 0: {c:?}")
        }
        if c.num_attention_heads == 0
            || c.num_key_value_heads == 0
            || !c.num_attention_heads.is_multiple_of(c.num_key_value_heads)
        {
            bail!(
                "llama config: {} attention heads is not a multiple of {} key/value heads",
                c.num_attention_heads,
                c.num_key_value_heads
            )
        }
        if c.head_dim == 0 || !c.head_dim.is_multiple_of(2) || c.head_dim > candle_flash::MAX_HEAD_DIM {
            bail!("llama config: head dim {} must be even and at most {}", c.head_dim, candle_flash::MAX_HEAD_DIM)
        }
        if !(c.rope_theta.is_finite() && c.rope_theta > 0.0) {
            bail!("llama config: rope theta must be > 0, got {}", c.rope_theta)
        }
        if let RopeScaling::FreqFactors(f) = &c.rope_scaling {
            if f.len() != c.head_dim / 2 {
                bail!("llama config: {} rope frequency factors for head dim {}", f.len(), c.head_dim)
            }
        }
        Ok(())
    }
}

/// Reading the config from model files.
impl LlamaConfig {
    /// From the text of a Hugging Face `config.json`.
    pub fn from_hf_json(text: &str) -> Result<Self> {
        let raw: HfConfig =
            serde_json::from_str(text).map_err(|e| candle_core::Error::Msg(format!("config.json: {e}")))?;
        if let Some(arch) = raw.model_type.as_deref() {
            if arch != "llama" {
                bail!("config.json: model_type is {arch:?}, only \"llama\" is supported")
            }
        }
        // Biases would be silently ignored by the bias-free projections: refuse instead.
        if raw.attention_bias == Some(true) || raw.mlp_bias == Some(true) {
            bail!("config.json: attention_bias / mlp_bias are not supported")
        }
        let rope_scaling = match raw.rope_scaling {
            None => RopeScaling::None,
            Some(s) => match s.rope_type.as_deref().or(s.type_.as_deref()) {
                Some("llama3") => RopeScaling::Llama3(Llama3RopeScaling {
                    factor: s.factor.unwrap_or(8.0),
                    low_freq_factor: s.low_freq_factor.unwrap_or(1.0),
                    high_freq_factor: s.high_freq_factor.unwrap_or(4.0),
                    original_max_position_embeddings: s.original_max_position_embeddings.unwrap_or(8192),
                }),
                Some("default") | None => RopeScaling::None,
                Some(other) => bail!("config.json: rope scaling type {other:?} is not supported (only llama3)"),
            },
        };
        let num_kv = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        let cfg = Self {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads: num_kv,
            head_dim: raw.head_dim.unwrap_or(raw.hidden_size / raw.num_attention_heads.max(1)),
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-5),
            rope_theta: raw.rope_theta.unwrap_or(10_000.0),
            rope_scaling,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// From the `llama.*` metadata of a GGUF file. Whether the embeddings are tied and the
    /// rope frequency factors come from the tensors, not the metadata: `output.weight` and
    /// `rope_freqs.weight` present or not; the loader fills them in.
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self> {
        let arch = md(ct, "general.architecture")?.to_string()?.clone();
        if arch != "llama" {
            bail!("gguf: architecture is {arch:?}, only \"llama\" is supported")
        }
        let get_usize = |k: &str| -> Result<usize> { md(ct, k).and_then(value_to_usize) };
        let opt_usize = |k: &str| -> Result<Option<usize>> { ct.metadata.get(k).map(value_to_usize).transpose() };
        let num_heads = get_usize("llama.attention.head_count")?;
        let hidden = get_usize("llama.embedding_length")?;
        let head_dim = opt_usize("llama.attention.key_length")?.unwrap_or(hidden / num_heads.max(1));
        if let Some(rot) = opt_usize("llama.rope.dimension_count")? {
            if rot != head_dim {
                bail!("gguf: rotary over {rot} of {head_dim} head dims (partial rotary) is not supported")
            }
        }
        let vocab_size = match opt_usize("llama.vocab_size")? {
            Some(v) => v,
            // Older files omit it; the token list has one entry per row of the embeddings.
            None => md(ct, "tokenizer.ggml.tokens")?.to_vec()?.len(),
        };
        let f64_or = |k: &str, default: f64| -> Result<f64> {
            ct.metadata
                .get(k)
                .map(|v| v.to_f32().map(f64::from).or_else(|_| v.to_f64()))
                .transpose()
                .map(|v| v.unwrap_or(default))
        };
        let cfg = Self {
            vocab_size,
            hidden_size: hidden,
            intermediate_size: get_usize("llama.feed_forward_length")?,
            num_hidden_layers: get_usize("llama.block_count")?,
            num_attention_heads: num_heads,
            num_key_value_heads: opt_usize("llama.attention.head_count_kv")?.unwrap_or(num_heads),
            head_dim,
            rms_norm_eps: f64_or("llama.attention.layer_norm_rms_epsilon", 1e-5)?,
            rope_theta: f64_or("llama.rope.freq_base", 10_000.0)?,
            rope_scaling: RopeScaling::None,
            max_position_embeddings: opt_usize("llama.context_length")?.unwrap_or(4096),
            tie_word_embeddings: !ct.tensor_infos.contains_key("output.weight"),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

pub(crate) fn md<'a>(ct: &'a gguf_file::Content, key: &str) -> Result<&'a gguf_file::Value> {
    ct.metadata.get(key).ok_or_else(|| candle_core::Error::Msg(format!("gguf: missing metadata key {key:?}")))
}

/// GGUF writers are not consistent about integer widths (u32, i32, u64 all occur).
pub(crate) fn value_to_usize(v: &gguf_file::Value) -> Result<usize> {
    use gguf_file::Value::*;
    let x: i128 = match v {
        U8(x) => *x as i128,
        I8(x) => *x as i128,
        U16(x) => *x as i128,
        I16(x) => *x as i128,
        U32(x) => *x as i128,
        I32(x) => *x as i128,
        U64(x) => *x as i128,
        I64(x) => *x as i128,
        other => bail!("gguf: expected an integer, got {other:?}"),
    };
    usize::try_from(x).map_err(|_| candle_core::Error::Msg(format!("gguf: expected a non-negative integer, got {x}")))
}

#[derive(Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<HfRopeScaling>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
}

#[derive(Deserialize)]
struct HfRopeScaling {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    type_: Option<String>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<usize>,
}
