//! candle-transformers 0.11.1 with `[patch.crates-io] candle-flash-attn = { path = ".." }`: its
//! models' `use_flash_attn` path then runs candle-flash. This program shows it does, and that the
//! results match candle's plain attention:
//!
//! 1. `candle_flash_attn::flash_attn` on CPU tensors works and matches a plain attention
//!    (crates.io's candle-flash-attn has no CPU path: "no cpu support for flash-attn").
//! 2. Random-weight Llama, Mistral, Gemma, Gemma 2, Gemma 3 and Gemma 4 models, built from
//!    candle-transformers' own config structs, each built twice from the same weights with
//!    `use_flash_attn` true and false, run on the same tokens: a prefill of 40 tokens, then 4
//!    decode steps through the models' KV caches. Per step: max |logit diff| / max |logit|;
//!    a model passes when the worst step is <= 2%.
//!
//! Gemma 4's real configs have 512-dim global heads (on CUDA candle-flash's SIMT kernels run
//! them); a Gemma 4 with 256-dim global heads runs too.
//!
//! Default: CUDA device 0 in bf16; without a usable CUDA device it says why and exits 0.
//! `--cpu` runs the same comparison on the CPU (default f32; `--dtype bf16|f16|f32`).
//! Exit status 1 when anything failed.

use candle_core::{DType, Device, Result, Shape, Tensor, D};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Activation, Init, VarBuilder};
use candle_transformers::models::{gemma, gemma2, gemma3, gemma4, llama, mistral};

const PREFILL: usize = 40;
const DECODE_STEPS: usize = 4;
const VOCAB: usize = 1024;
const TOLERANCE: f64 = 0.02;
const SEED: u64 = 0x5eed_f1a5;
/// Standard deviation of the random weights, except for q_proj/k_proj ([`QK_STD`]) and the
/// per-model [`Spec::emb_std`] and [`Spec::vo_std`].
const WEIGHT_STD: f32 = 0.02;
/// q_proj and k_proj: larger, so that the attention of the models without q/k norms is not
/// close to uniform (with 0.02 their logits would spread by ~0.2 only, and a wrong mask would
/// barely show).
const QK_STD: f32 = 0.05;

/// splitmix64 with Box-Muller normals.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
    }
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// Weights made up on request: a tensor's values depend only on its name and shape, so two
/// models built from this backend (flash and plain) get identical weights. `Init::Const(c)`
/// (norm weights, biases) gives c; everything else normal with [`WEIGHT_STD`], [`QK_STD`] for
/// q_proj/k_proj, `emb_std` for the embeddings and `vo_std` for v_proj/o_proj. `round_through`: the values rounded to that dtype first (so that the f32
/// ground truth of a bf16 run has the bf16 models' very weights).
struct RandomWeights {
    round_through: Option<DType>,
    emb_std: f32,
    vo_std: f32,
}

impl SimpleBackend for RandomWeights {
    fn get(&self, s: Shape, name: &str, h: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        let t = match h {
            Init::Const(c) => Tensor::full(c as f32, s, &Device::Cpu)?,
            _ => {
                let std = if name.ends_with("q_proj.weight") || name.ends_with("k_proj.weight") {
                    QK_STD
                } else if name.ends_with("v_proj.weight") || name.ends_with("o_proj.weight") {
                    self.vo_std
                } else if name.ends_with("embed_tokens.weight") {
                    self.emb_std
                } else {
                    WEIGHT_STD
                };
                let mut rng = Rng(SEED ^ fnv1a(name));
                let data: Vec<f32> = (0..s.elem_count()).map(|_| rng.normal() * std).collect();
                Tensor::from_vec(data, s, &Device::Cpu)?
            }
        };
        let t = match self.round_through {
            Some(rounded) => t.to_dtype(rounded)?.to_dtype(DType::F32)?,
            None => t,
        };
        t.to_dtype(dtype)?.to_device(dev)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> Result<Tensor> {
        candle_core::bail!("random weights: {name} was asked for without a shape")
    }

    fn contains_tensor(&self, _: &str) -> bool {
        true
    }
}

enum Model {
    Llama(Box<llama::Llama>, Box<llama::Cache>),
    Mistral(Box<mistral::Model>),
    Gemma(Box<gemma::Model>),
    Gemma2(Box<gemma2::Model>),
    Gemma3(Box<gemma3::Model>),
    Gemma4(Box<gemma4::text::TextModel>),
}

impl Model {
    /// The logits of the last position, f32, flattened to `[vocab]`.
    fn step(&mut self, ids: &Tensor, pos: usize) -> Result<Tensor> {
        let logits = match self {
            Model::Llama(m, cache) => m.forward(ids, pos, cache)?,
            Model::Mistral(m) => m.forward(ids, pos)?,
            Model::Gemma(m) => m.forward(ids, pos)?,
            Model::Gemma2(m) => m.forward(ids, pos)?,
            Model::Gemma3(m) => m.forward(ids, pos)?,
            Model::Gemma4(m) => m.forward(ids, pos)?,
        };
        logits.flatten_all()?.to_dtype(DType::F32)
    }
}

struct Spec {
    name: &'static str,
    /// head dims as printed, e.g. "64" or "256/512" (sliding/global)
    head_dims: &'static str,
    heads: (usize, usize),
    /// Standard deviations of the token embeddings and of v_proj/o_proj: chosen per model so
    /// that attention has a large share of the last position's hidden state (a wrong causal
    /// mask then moves the logits by 10-20%, measured by running with a flash_attn that ignores
    /// `causal`) while bf16 rounding alone moves them by < 0.8% (on the CPU). With 0.02
    /// everywhere the Gemma models' attention hardly reached the logits (their embeddings,
    /// multiplied by sqrt(hidden), dominate), and with attention dominating bf16 noise
    /// reached 1-2%, the size of the tolerance. Gemma's embeddings are divided by
    /// sqrt(hidden) here, so the residual stream starts at rms 1.2.
    emb_std: f32,
    vo_std: f32,
    build: fn(bool, VarBuilder, &Device) -> Result<Model>,
}

fn llama_model(flash: bool, vb: VarBuilder, dev: &Device) -> Result<Model> {
    let cfg = llama::Config {
        hidden_size: 512,
        intermediate_size: 1024,
        vocab_size: VOCAB,
        num_hidden_layers: 2,
        num_attention_heads: 8,
        num_key_value_heads: 2,
        use_flash_attn: flash,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: 512,
        tie_word_embeddings: false,
    };
    let cache = llama::Cache::new(true, vb.dtype(), &cfg, dev)?;
    Ok(Model::Llama(Box::new(llama::Llama::load(vb, &cfg)?), Box::new(cache)))
}

fn mistral_model(flash: bool, vb: VarBuilder, _: &Device) -> Result<Model> {
    let cfg = mistral::Config {
        vocab_size: VOCAB,
        hidden_size: 512,
        intermediate_size: 1024,
        num_hidden_layers: 2,
        num_attention_heads: 8,
        head_dim: Some(128),
        num_key_value_heads: 4,
        hidden_act: Activation::Silu,
        max_position_embeddings: 512,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        // Wider than the test's 44 tokens: the plain path's window mask is then causal, as
        // candle-transformers' flash path is.
        sliding_window: Some(4096),
        use_flash_attn: flash,
    };
    Ok(Model::Mistral(Box::new(mistral::Model::new(&cfg, vb)?)))
}

fn gemma_model(flash: bool, vb: VarBuilder, _: &Device) -> Result<Model> {
    let cfg = gemma::Config {
        attention_bias: false,
        head_dim: 256,
        hidden_act: Some(Activation::GeluPytorchTanh),
        hidden_activation: None,
        hidden_size: 256,
        intermediate_size: 512,
        num_attention_heads: 8,
        num_hidden_layers: 2,
        num_key_value_heads: 2,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        vocab_size: VOCAB,
        max_position_embeddings: 512,
    };
    Ok(Model::Gemma(Box::new(gemma::Model::new(flash, &cfg, vb)?)))
}

fn gemma2_model(flash: bool, vb: VarBuilder, _: &Device) -> Result<Model> {
    let cfg = gemma2::Config {
        attention_bias: false,
        head_dim: 128,
        hidden_activation: Activation::GeluPytorchTanh,
        hidden_size: 256,
        intermediate_size: 512,
        num_attention_heads: 8,
        num_hidden_layers: 2,
        num_key_value_heads: 4,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        vocab_size: VOCAB,
        // Off (real configs: 30): the tied embeddings give logits of ~80 here, which a softcap
        // of 30 would flatten, hiding differences; it is not part of the attention.
        final_logit_softcapping: None,
        // candle-transformers' Gemma 2 flash path does not pass the attention softcap on (its
        // plain path applies it), so it is off here to compare like with like.
        attn_logit_softcapping: None,
        query_pre_attn_scalar: 128,
        sliding_window: Some(4096),
        max_position_embeddings: 512,
    };
    Ok(Model::Gemma2(Box::new(gemma2::Model::new(flash, &cfg, vb)?)))
}

fn gemma3_model(flash: bool, vb: VarBuilder, _: &Device) -> Result<Model> {
    let cfg = gemma3::Config {
        attention_bias: false,
        head_dim: 64,
        hidden_activation: Activation::GeluPytorchTanh,
        hidden_size: 384,
        intermediate_size: 768,
        num_attention_heads: 8,
        num_hidden_layers: 2,
        // One KV head (as Gemma 3 1B): candle-transformers 0.11.1's Gemma 3 appends the
        // transposed, non-contiguous values to its KV cache, which candle's slice_set rejects
        // ("slice-set only supports contiguous tensors") for a prefill with several KV heads,
        // in both paths.
        num_key_value_heads: 1,
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        rope_local_base_freq: 10_000.0,
        vocab_size: VOCAB,
        final_logit_softcapping: None,
        // As for Gemma 2: the flash path has no attention softcap.
        attn_logit_softcapping: None,
        query_pre_attn_scalar: 64,
        // Layer 0 sliding (rotating KV cache), layer 1 global; the window is wider than the
        // test's tokens, so both paths mask causally.
        sliding_window: 512,
        sliding_window_pattern: 2,
        max_position_embeddings: 512,
    };
    Ok(Model::Gemma3(Box::new(gemma3::Model::new(flash, &cfg, vb)?)))
}

fn gemma4_config(flash: bool, global_head_dim: usize) -> gemma4::Gemma4TextConfig {
    gemma4::Gemma4TextConfig {
        attention_bias: false,
        head_dim: 256,
        hidden_activation: Activation::GeluPytorchTanh,
        hidden_size: 256,
        intermediate_size: 512,
        num_attention_heads: 8,
        num_hidden_layers: 2,
        num_key_value_heads: 4,
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        vocab_size: VOCAB,
        sliding_window: 512,
        // Off, as for Gemma 2.
        final_logit_softcapping: None,
        query_pre_attn_scalar: 256,
        max_position_embeddings: 512,
        tie_word_embeddings: true,
        sliding_window_pattern: 2,
        layer_types: vec!["sliding_attention".into(), "full_attention".into()],
        global_head_dim,
        num_global_key_value_heads: Some(2),
        rope_parameters: None,
        use_bidirectional_attention: None,
        use_flash_attn: flash,
    }
}

fn gemma4_256(flash: bool, vb: VarBuilder, _: &Device) -> Result<Model> {
    let cfg = gemma4_config(flash, 256);
    Ok(Model::Gemma4(Box::new(gemma4::text::TextModel::new(&cfg, vb)?)))
}

fn gemma4_512(flash: bool, vb: VarBuilder, _: &Device) -> Result<Model> {
    let cfg = gemma4_config(flash, 512);
    Ok(Model::Gemma4(Box::new(gemma4::text::TextModel::new(&cfg, vb)?)))
}

fn specs() -> Vec<Spec> {
    // Gemma multiplies its embeddings by sqrt(hidden): drawn that much smaller.
    let gemma_emb = |hidden: f32| 1.2 / hidden.sqrt();
    vec![
        Spec { name: "llama", emb_std: 0.3, vo_std: WEIGHT_STD, head_dims: "64", heads: (8, 2), build: llama_model },
        Spec {
            name: "mistral",
            emb_std: 0.3,
            vo_std: WEIGHT_STD,
            head_dims: "128",
            heads: (8, 4),
            build: mistral_model,
        },
        Spec {
            name: "gemma",
            emb_std: gemma_emb(256.0),
            // No norm after its attention (Gemma 2-4 have one): larger V/O weights.
            vo_std: 0.06,
            head_dims: "256",
            heads: (8, 2),
            build: gemma_model,
        },
        Spec {
            name: "gemma2",
            emb_std: gemma_emb(256.0),
            vo_std: WEIGHT_STD,
            head_dims: "128",
            heads: (8, 4),
            build: gemma2_model,
        },
        Spec {
            name: "gemma3",
            emb_std: gemma_emb(384.0),
            vo_std: WEIGHT_STD,
            head_dims: "64",
            heads: (8, 1),
            build: gemma3_model,
        },
        Spec {
            name: "gemma4 (global 256)",
            emb_std: gemma_emb(256.0),
            vo_std: WEIGHT_STD,
            head_dims: "256/256",
            heads: (8, 4),
            build: gemma4_256,
        },
        Spec {
            name: "gemma4 (global 512)",
            emb_std: gemma_emb(256.0),
            vo_std: WEIGHT_STD,
            head_dims: "256/512",
            heads: (8, 4),
            build: gemma4_512,
        },
    ]
}

fn max_abs(t: &Tensor) -> Result<f64> {
    Ok(t.abs()?.max(0)?.to_scalar::<f32>()? as f64)
}

/// One model's numbers: `prefill` and `decode` (worst step) are max |flash - plain| / max |plain|,
/// the pass criterion; for a run in a reduced dtype, `*_vs_f32` is each path's worst
/// max |x - truth| / max |truth| against the plain model in f32 with the same (rounded) weights.
struct Outcome {
    prefill: f64,
    decode: f64,
    peak: f64,
    flash_vs_f32: Option<f64>,
    plain_vs_f32: Option<f64>,
}

fn rel(a: &Tensor, b: &Tensor) -> Result<f64> {
    Ok(max_abs(&(a - b)?)? / max_abs(b)?)
}

fn compare(spec: &Spec, dev: &Device, dtype: DType, tokens: &[u32]) -> Result<Outcome> {
    let vb = |dtype: DType, round_through: Option<DType>| {
        VarBuilder::from_backend(
            Box::new(RandomWeights { round_through, emb_std: spec.emb_std, vo_std: spec.vo_std }),
            dtype,
            dev.clone(),
        )
    };
    let mut plain = (spec.build)(false, vb(dtype, None), dev)?;
    let mut flash = (spec.build)(true, vb(dtype, None), dev)?;
    let mut truth = match dtype {
        DType::F32 => None,
        _ => Some((spec.build)(false, vb(DType::F32, Some(dtype)), dev)?),
    };
    let mut out = Outcome { prefill: 0.0, decode: 0.0, peak: 0.0, flash_vs_f32: None, plain_vs_f32: None };
    let mut pos = 0;
    let chunks = std::iter::once(&tokens[..PREFILL]).chain(tokens[PREFILL..].chunks(1));
    for (step, chunk) in chunks.enumerate() {
        let ids = Tensor::new(chunk, dev)?.unsqueeze(0)?;
        let want = plain.step(&ids, pos)?;
        let got = flash.step(&ids, pos)?;
        let top = max_abs(&want)?;
        if !top.is_finite() || top == 0.0 {
            candle_core::bail!("plain logits of step {step} have max |logit| {top}");
        }
        let ratio = rel(&got, &want)?;
        if !ratio.is_finite() {
            candle_core::bail!("flash logits of step {step} are not finite");
        }
        out.peak = out.peak.max(top);
        if step == 0 {
            out.prefill = ratio;
        } else {
            out.decode = out.decode.max(ratio);
        }
        if let Some(truth) = truth.as_mut() {
            let t = truth.step(&ids, pos)?;
            out.flash_vs_f32 = Some(out.flash_vs_f32.unwrap_or(0.0).max(rel(&got, &t)?));
            out.plain_vs_f32 = Some(out.plain_vs_f32.unwrap_or(0.0).max(rel(&want, &t)?));
        }
        pos += chunk.len();
    }
    Ok(out)
}

/// `candle_flash_attn::flash_attn` on CPU tensors against a plain causal GQA attention:
/// max |diff| / max |ref|. crates.io's candle-flash-attn returns "no cpu support for
/// flash-attn" here, so success means the patch is in effect.
fn probe_patch() -> Result<f64> {
    let dev = Device::Cpu;
    let (b, s, h, hkv, d) = (1, 12, 8, 2, 32);
    let mut rng = Rng(SEED);
    let mut rand = |shape: (usize, usize, usize, usize)| {
        let n = shape.0 * shape.1 * shape.2 * shape.3;
        Tensor::from_vec((0..n).map(|_| rng.normal()).collect::<Vec<f32>>(), shape, &dev)
    };
    let (q, k, v) = (rand((b, s, h, d))?, rand((b, s, hkv, d))?, rand((b, s, hkv, d))?);
    let scale = 1.0 / (d as f32).sqrt();
    let got = candle_flash_attn::flash_attn(&q, &k, &v, scale, true)?;
    // Plain: (b, h, s, d), KV heads repeated, causal mask, softmax.
    let rep = |t: &Tensor| -> Result<Tensor> {
        let t = t.transpose(1, 2)?.contiguous()?;
        Tensor::cat(&vec![&t; h / hkv], 2)?.reshape((b, h, s, d))
    };
    let qh = q.transpose(1, 2)?.contiguous()?;
    let att = (qh.matmul(&rep(&k)?.t()?)? * scale as f64)?;
    let mask: Vec<u8> = (0..s).flat_map(|i| (0..s).map(move |j| u8::from(j > i))).collect();
    let mask = Tensor::from_vec(mask, (s, s), &dev)?.broadcast_as(att.shape())?;
    let att = mask.where_cond(&Tensor::new(f32::NEG_INFINITY, &dev)?.broadcast_as(att.shape())?, &att)?;
    let att = candle_nn::ops::softmax(&att, D::Minus1)?;
    let want = att.matmul(&rep(&v)?)?.transpose(1, 2)?;
    let err = max_abs(&(&got - &want)?.flatten_all()?)? / max_abs(&want.flatten_all()?)?;
    Ok(err)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cpu = args.iter().any(|a| a == "--cpu");
    let dtype_arg = args.iter().position(|a| a == "--dtype").and_then(|i| args.get(i + 1)).map(String::as_str);
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("usage: candle-flash-attn-patch-test [--cpu] [--dtype bf16|f16|f32]");
        return;
    }

    let mut failed = false;
    match probe_patch() {
        Ok(err) if err <= 1e-5 => println!(
            "patch: candle_flash_attn::flash_attn ran on CPU tensors (crates.io's candle-flash-attn cannot): \
             candle-flash is in use; max |diff| / max |ref| vs plain attention = {err:.1e}"
        ),
        Ok(err) => {
            println!(
                "FAIL patch probe: candle_flash_attn::flash_attn on the CPU differs from plain attention by {err:e}"
            );
            failed = true;
        }
        Err(e) => {
            println!("FAIL patch probe: candle_flash_attn::flash_attn on CPU tensors: {e} (is the patch in effect?)");
            failed = true;
        }
    }

    let dev = if cpu {
        Device::Cpu
    } else {
        match Device::new_cuda(0) {
            Ok(dev) => dev,
            Err(e) => {
                let reason = e.to_string();
                let reason = reason.lines().next().unwrap_or("");
                println!("SKIP models: no usable CUDA device ({reason}); `--cpu` runs the comparison on the CPU");
                std::process::exit(i32::from(failed));
            }
        }
    };
    let dtype = match dtype_arg {
        Some("bf16") => DType::BF16,
        Some("f16") => DType::F16,
        Some("f32") => DType::F32,
        None if cpu => DType::F32,
        None => DType::BF16,
        Some(other) => {
            eprintln!("unknown --dtype {other} (bf16, f16, f32)");
            std::process::exit(2);
        }
    };
    let mut rng = Rng(SEED ^ 1);
    let tokens: Vec<u32> = (0..PREFILL + DECODE_STEPS).map(|_| (rng.next_u64() % VOCAB as u64) as u32).collect();

    println!(
        "device {}, {dtype:?}: prefill {PREFILL} tokens + {DECODE_STEPS} decode steps, \
         ratio = max |logit(flash) - logit(plain)| / max |logit(plain)|, pass <= {TOLERANCE}",
        if cpu { "cpu" } else { "cuda:0" }
    );
    println!(
        "{:<20} {:>8} {:>8} {:>9} {:>10} {:>10} {:>10} {:>10}  result",
        "model", "head dim", "heads/kv", "prefill", "decode max", "max|logit|", "flash-f32", "plain-f32"
    );
    for spec in specs() {
        let heads = format!("{}/{}", spec.heads.0, spec.heads.1);
        let row = |cols: [String; 5], result: &str| {
            let [p, d, peak, f, n] = cols;
            println!(
                "{:<20} {:>8} {:>8} {p:>9} {d:>10} {peak:>10} {f:>10} {n:>10}  {result}",
                spec.name, spec.head_dims, heads
            )
        };
        let opt = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.2e}"));
        match compare(&spec, &dev, dtype, &tokens) {
            Ok(o) => {
                let pass = o.prefill <= TOLERANCE && o.decode <= TOLERANCE;
                failed |= !pass;
                let result = if pass { "PASS" } else { "FAIL" };
                let cols = [
                    format!("{:.2e}", o.prefill),
                    format!("{:.2e}", o.decode),
                    format!("{:.3}", o.peak),
                    opt(o.flash_vs_f32),
                    opt(o.plain_vs_f32),
                ];
                row(cols, result);
            }
            Err(e) => {
                let msg = e.to_string();
                let msg = msg.lines().next().unwrap_or("");
                failed = true;
                row(std::array::from_fn(|_| "-".to_string()), &format!("ERROR: {msg}"));
            }
        }
    }
    println!(
        "prefill, decode max: max |logit(flash) - logit(plain)| / max |logit(plain)|; flash-f32, plain-f32 \
         (reduced dtypes): each path's worst max |x - truth| / max |truth|, truth = the plain model in f32 \
         with the same weights"
    );
    if failed {
        println!("FAILED");
        std::process::exit(1);
    }
    println!("all passed");
}
