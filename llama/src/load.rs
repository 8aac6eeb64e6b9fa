//! Loading a [`Llama`] with its tokenizer and chat template from a GGUF file (architecture
//! `llama`) or a Hugging Face folder (`config.json`, `*.safetensors`, `tokenizer.json`).

use super::attention::AttnImpl;
use super::config::{value_to_usize, LlamaConfig};
use super::model::Llama;
use super::qlinear::QLinear;
use super::rotary::{unpermute_qk_rows, RopeScaling};
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use candle_core::quantized::{gguf_file, QStorage, QTensor};
use candle_core::{bail, DType, Device, Result};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// A model and what generating text with it needs.
pub struct LoadedLlama {
    pub model: Llama,
    /// None when the file carries no tokenizer (GGUF without `tokenizer.ggml.*`, or a folder
    /// without `tokenizer.json`).
    pub tokenizer: Option<Tokenizer>,
    /// The Jinja chat template, when the model has one.
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Tokens that end generation: the declared end-of-sequence ids plus the common
    /// end-of-turn markers present in the vocabulary (GGUF files declare one eos id, while
    /// chat models end a turn with another token, e.g. `<|im_end|>` or `<|eot_id|>`).
    pub stop_token_ids: Vec<u32>,
}

/// What the GGUF loader does with quantized weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GgufWeights {
    /// Keep the linear weights and embeddings in their GGUF formats and multiply with them
    /// directly ([`QLinear`]): about 6x less memory for Q4_1 and the fastest decoding. Only on the
    /// CPU with `DType::F32` activations; otherwise the weights are dequantized.
    #[default]
    Quantized,
    /// Dequantize every weight to the requested dtype at load (the products are then exact
    /// float products of the dequantized weights: the reference for the quantized kernels).
    Dequantized,
}

impl std::str::FromStr for GgufWeights {
    type Err = candle_core::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "quantized" | "q" => Ok(Self::Quantized),
            "dequantized" | "dequant" | "f" => Ok(Self::Dequantized),
            other => bail!("unknown GGUF weight mode {other:?} (expected quantized or dequantized)"),
        }
    }
}

const END_MARKERS: &[&str] = &["<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>", "</s>"];

/// A GGUF file (by its content) or a Hugging Face folder (or a file inside one); GGUF weights
/// stay quantized where they can ([`GgufWeights::Quantized`], see [`load_with`]).
/// `progress(done, total)` reports tensors read (GGUF) or layers built (safetensors).
///
/// ```no_run
/// use candle_core::{DType, Device};
/// use candle_flash_llama::{load, AttnImpl, LogitsProcessor, Sampling};
/// let loaded = load(
///     std::path::Path::new("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
///     DType::F32,
///     &Device::Cpu,
///     AttnImpl::Flash,
///     &mut |_, _| {},
/// )?;
/// let tokenizer = loaded.tokenizer.as_ref().expect("the GGUF has a tokenizer");
/// let prompt = tokenizer.encode("The capital of France is", true).map_err(candle_core::Error::wrap)?;
/// let mut sampler = LogitsProcessor::new(Sampling::Greedy, 0);
/// let out = loaded.model.generate(prompt.get_ids(), 16, &mut sampler, &loaded.stop_token_ids, |_| Ok(()))?;
/// println!("{}", tokenizer.decode(&out.tokens, true).map_err(candle_core::Error::wrap)?);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn load(
    path: &Path,
    dtype: DType,
    device: &Device,
    attn_impl: AttnImpl,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<LoadedLlama> {
    load_with(path, dtype, device, attn_impl, GgufWeights::Quantized, progress)
}

/// [`load`] with the choice of what happens to GGUF weights (safetensors ignore it).
pub fn load_with(
    path: &Path,
    dtype: DType,
    device: &Device,
    attn_impl: AttnImpl,
    gguf_weights: GgufWeights,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<LoadedLlama> {
    if path.is_dir() {
        return load_safetensors_dir(path, dtype, device, attn_impl, progress);
    }
    if !path.exists() {
        bail!("model not found: {}", path.display())
    }
    let is_gguf = std::fs::File::open(path)
        .and_then(|mut f| {
            let mut magic = [0u8; 4];
            std::io::Read::read_exact(&mut f, &mut magic).map(|_| &magic == b"GGUF")
        })
        .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", path.display())))?;
    if is_gguf {
        return load_gguf(path, dtype, device, attn_impl, gguf_weights, progress);
    }
    match path.parent() {
        Some(dir) if dir.join("config.json").is_file() => load_safetensors_dir(dir, dtype, device, attn_impl, progress),
        _ => bail!("{}: neither a GGUF file nor a folder with config.json and *.safetensors", path.display()),
    }
}

/// GGUF tensor names and the Hugging Face names the model is built from (per layer after
/// `blk.N.` / `model.layers.N.`).
const LAYER_NAMES: &[(&str, &str)] = &[
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
];
const GLOBAL_NAMES: &[(&str, &str)] = &[
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
];

/// The Hugging Face name of a GGUF tensor of a Llama model (None for tensors the model does
/// not read as weights, such as `rope_freqs.weight`).
pub fn gguf_to_hf_name(name: &str) -> Option<String> {
    if let Some((_, hf)) = GLOBAL_NAMES.iter().find(|(g, _)| *g == name) {
        return Some(hf.to_string());
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (_, hf) = LAYER_NAMES.iter().find(|(g, _)| *g == suffix)?;
    Some(format!("model.layers.{layer}.{hf}"))
}

/// The GGUF name of a Hugging Face tensor of a Llama model (the inverse of
/// [`gguf_to_hf_name`]).
pub fn hf_to_gguf_name(name: &str) -> Option<String> {
    if let Some((g, _)) = GLOBAL_NAMES.iter().find(|(_, hf)| *hf == name) {
        return Some(g.to_string());
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (g, _) = LAYER_NAMES.iter().find(|(_, hf)| *hf == suffix)?;
    Some(format!("blk.{layer}.{g}"))
}

/// A GGUF file of architecture `llama`. With [`GgufWeights::Quantized`] on the CPU in f32, the
/// 2-D weights stay in their GGUF formats ([`QLinear`]); otherwise every tensor is dequantized
/// to `dtype` at load.
pub fn load_gguf(
    path: &Path,
    dtype: DType,
    device: &Device,
    attn_impl: AttnImpl,
    gguf_weights: GgufWeights,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<LoadedLlama> {
    let keep_quantized = gguf_weights == GgufWeights::Quantized && device.is_cpu() && dtype == DType::F32;
    let with_path = |e: candle_core::Error| candle_core::Error::Msg(format!("{}: {e}", path.display()));
    let mut file = std::fs::File::open(path).map_err(|e| with_path(e.into()))?;
    let ct = gguf_file::Content::read(&mut file).map_err(with_path)?;
    let mut cfg = LlamaConfig::from_gguf(&ct).map_err(with_path)?;
    if let Some(info) = ct.tensor_infos.get("rope_freqs.weight") {
        let factors = info.read(&mut file, ct.tensor_data_offset, &Device::Cpu)?.dequantize(&Device::Cpu)?;
        cfg.rope_scaling = RopeScaling::FreqFactors(factors.flatten_all()?.to_vec1()?);
        cfg.validate()?;
    }
    let mut names: Vec<&String> = ct.tensor_infos.keys().collect();
    names.sort();
    let mut tensors = HashMap::with_capacity(names.len());
    let mut quantized = HashMap::new();
    for (i, name) in names.iter().enumerate() {
        let Some(hf) = gguf_to_hf_name(name) else {
            progress(i + 1, names.len());
            continue;
        };
        let qt = ct.tensor(&mut file, name, device)?;
        if keep_quantized && qt.shape().rank() == 2 {
            let qt = if name.ends_with(".attn_q.weight") {
                unpermute_qtensor_rows(&qt, cfg.num_attention_heads)?
            } else if name.ends_with(".attn_k.weight") {
                unpermute_qtensor_rows(&qt, cfg.num_key_value_heads)?
            } else {
                qt
            };
            quantized.insert(hf, QLinear::from_qtensor(qt, dtype)?);
        } else {
            let t = qt.dequantize(device)?;
            let t = if name.ends_with(".attn_q.weight") {
                unpermute_qk_rows(&t, cfg.num_attention_heads)?
            } else if name.ends_with(".attn_k.weight") {
                unpermute_qk_rows(&t, cfg.num_key_value_heads)?
            } else {
                t
            };
            tensors.insert(hf, t.to_dtype(dtype)?);
        }
        progress(i + 1, names.len());
    }
    let vb = VarBuilder::from_tensors(tensors, dtype, device);
    let model = Llama::load_quantized(vb, quantized, &cfg, attn_impl, &mut |_, _| {}).map_err(with_path)?;

    let has_tokenizer = ct.metadata.contains_key("tokenizer.ggml.tokens");
    let tokenizer = if has_tokenizer { Some(tokenizer_from_gguf(&ct).map_err(with_path)?) } else { None };
    let token_name = |key: &str| -> Option<String> {
        let id = ct.metadata.get(key).and_then(|v| value_to_usize(v).ok())?;
        let tokens = ct.metadata.get("tokenizer.ggml.tokens")?.to_vec().ok()?;
        tokens.get(id)?.to_string().ok().cloned()
    };
    let mut stop = Vec::new();
    if let Some(id) = ct.metadata.get("tokenizer.ggml.eos_token_id").and_then(|v| value_to_usize(v).ok()) {
        stop.push(id as u32);
    }
    Ok(LoadedLlama {
        chat_template: ct.metadata.get("tokenizer.chat_template").and_then(|v| v.to_string().ok()).cloned(),
        bos_token: token_name("tokenizer.ggml.bos_token_id"),
        eos_token: token_name("tokenizer.ggml.eos_token_id"),
        stop_token_ids: with_end_markers(stop, tokenizer.as_ref()),
        tokenizer,
        model,
    })
}

/// [`unpermute_qk_rows`] on a quantized `(rows, cols)` weight: rows are whole blocks, so moving
/// their bytes moves the rows exactly, without dequantizing.
pub fn unpermute_qtensor_rows(w: &QTensor, n_head: usize) -> Result<QTensor> {
    let (rows, cols) = w.shape().dims2()?;
    let dt = w.dtype();
    if n_head == 0 || !rows.is_multiple_of(2 * n_head) || !cols.is_multiple_of(dt.block_size()) {
        bail!("unpermute: {rows}x{cols} {dt:?} weight does not split into {n_head} heads of pairs")
    }
    let (head, half) = (rows / n_head, rows / n_head / 2);
    let row_bytes = cols / dt.block_size() * dt.type_size();
    let data = w.data()?;
    if data.len() != rows * row_bytes {
        bail!("unpermute: {rows}x{cols} {dt:?} weight has {} bytes", data.len())
    }
    let mut out = vec![0u8; data.len()];
    for (o, dst) in out.chunks_exact_mut(row_bytes).enumerate() {
        // Output row h·head + j·half + i comes from input row h·head + 2i + j (see
        // `unpermute_qk_rows`).
        let (h, r) = (o / head, o % head);
        let (j, i) = (r / half, r % half);
        let src = h * head + 2 * i + j;
        dst.copy_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
    }
    let storage = QStorage::from_data(std::borrow::Cow::Owned(out), &w.device(), dt)?;
    QTensor::new(storage, (rows, cols))
}

fn with_end_markers(mut ids: Vec<u32>, tokenizer: Option<&Tokenizer>) -> Vec<u32> {
    if let Some(tok) = tokenizer {
        ids.extend(END_MARKERS.iter().filter_map(|m| tok.token_to_id(m)));
    }
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// The byte-level BPE tokenizer stored in GGUF metadata (`tokenizer.ggml.model == "gpt2"`),
/// through candle's `TokenizerFromGguf`, with the pre-tokenizer corrected where candle's
/// default does not match llama.cpp.
///
/// candle maps every `tokenizer.ggml.pre` it does not know to byte-level with
/// `add_prefix_space = true`, which turns "Hello" into " Hello" and changes the ids. llama.cpp
/// (and the original tokenizer.json) adds no space unless `tokenizer.ggml.add_space_prefix`
/// says so, and `smollm` also splits digits one by one before the GPT-2 regex.
pub fn tokenizer_from_gguf(ct: &gguf_file::Content) -> Result<Tokenizer> {
    use tokenizers::pre_tokenizers::{byte_level::ByteLevel, digits::Digits, sequence::Sequence, PreTokenizerWrapper};
    let mut tokenizer = <Tokenizer as TokenizerFromGguf>::from_gguf(ct)?;
    let pre = ct.metadata.get("tokenizer.ggml.pre").and_then(|v| v.to_string().ok()).map_or("gpt2", |s| s.as_str());
    let add_space_prefix =
        ct.metadata.get("tokenizer.ggml.add_space_prefix").and_then(|v| v.to_bool().ok()).unwrap_or(false);
    let byte_level = ByteLevel::new(add_space_prefix, true, true);
    let fixed: Option<PreTokenizerWrapper> = match pre {
        // candle reproduces these tokenizers' own regexes.
        "qwen2" | "smaug-bpe" | "lfm2" | "llama3" => None,
        "smollm" => Some(Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()),
        _ => Some(byte_level.into()),
    };
    if let Some(pt) = fixed {
        tokenizer.with_pre_tokenizer(Some(pt));
    }
    Ok(tokenizer)
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(path).map_err(|e| candle_core::Error::Msg(format!("{}: {e}", path.display())))?;
    serde_json::from_str(&text).map(Some).map_err(|e| candle_core::Error::Msg(format!("{}: {e}", path.display())))
}

/// `eos_token_id` is a number or a list of numbers in config.json / generation_config.json.
fn json_ids(v: Option<&serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect(),
        _ => vec![],
    }
}

/// Special tokens in tokenizer_config.json are a string or `{"content": ...}`.
fn json_token(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// A Hugging Face folder: `config.json`, `*.safetensors` (memory-mapped), and optionally
/// `tokenizer.json`, `tokenizer_config.json` (chat template, special tokens) and
/// `generation_config.json` (eos ids).
pub fn load_safetensors_dir(
    dir: &Path,
    dtype: DType,
    device: &Device,
    attn_impl: AttnImpl,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<LoadedLlama> {
    let config_path = dir.join("config.json");
    let config_text = std::fs::read_to_string(&config_path)
        .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", config_path.display())))?;
    let mut cfg = LlamaConfig::from_hf_json(&config_text)?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", dir.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        bail!("{}: no *.safetensors files", dir.display())
    }
    // SAFETY: the files are memory-mapped read-only; like every mmap-based loader we rely on
    // them not being modified while the model is alive.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, device)? };
    if !vb.contains_tensor("lm_head.weight") {
        // Some tied checkpoints do not say so in config.json; they just omit lm_head.
        cfg.tie_word_embeddings = true;
    }
    let model = Llama::load(vb, &cfg, attn_impl, progress)?;

    let tokenizer_path = dir.join("tokenizer.json");
    let tokenizer = if tokenizer_path.is_file() {
        Some(
            Tokenizer::from_file(&tokenizer_path)
                .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", tokenizer_path.display())))?,
        )
    } else {
        None
    };
    let config_json: Option<serde_json::Value> = serde_json::from_str(&config_text).ok();
    let tok_cfg = read_json(&dir.join("tokenizer_config.json"))?;
    let gen_cfg = read_json(&dir.join("generation_config.json"))?;
    let mut stop = json_ids(config_json.as_ref().and_then(|c| c.get("eos_token_id")));
    stop.extend(json_ids(gen_cfg.as_ref().and_then(|c| c.get("eos_token_id"))));
    let chat_template = tok_cfg.as_ref().and_then(|c| match c.get("chat_template")? {
        serde_json::Value::String(s) => Some(s.clone()),
        // Several named templates: [{"name": "default", "template": ...}, ...].
        serde_json::Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
        _ => None,
    });
    let eos_token = json_token(tok_cfg.as_ref().and_then(|c| c.get("eos_token")));
    if let (Some(tok), Some(eos)) = (&tokenizer, &eos_token) {
        stop.extend(tok.token_to_id(eos));
    }
    Ok(LoadedLlama {
        chat_template,
        bos_token: json_token(tok_cfg.as_ref().and_then(|c| c.get("bos_token"))),
        eos_token,
        stop_token_ids: with_end_markers(stop, tokenizer.as_ref()),
        tokenizer,
        model,
    })
}
