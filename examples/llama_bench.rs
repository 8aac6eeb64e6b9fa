//! End-to-end Llama benchmark: prefill and decode speed and peak memory, flash vs naive.
//!
//! `cargo run --release --features llama --example llama_bench` runs SmolLM2-135M-Instruct (see
//! `bash scripts/fetch-model.sh`) on prompts of 128, 1024 and 4096 tokens: one prefill forward
//! over the prompt (into a KV cache), then `--decode-tokens` greedy steps against that cache.
//! It prints one JSON object per measurement and a table at the end.
//!
//! Peak memory is the peak of heap bytes allocated above what was live before the step (this
//! binary counts allocations; CPU only): for the prefill it includes the KV cache buffers
//! (identical for both implementations) and every activation, so the difference between the
//! rows is the attention's own working memory.

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use candle_flash::llama::{load, AttnImpl, Cache, Llama, LogitsProcessor, Sampling};
use clap::Parser;
use std::path::PathBuf;
use std::time::Instant;

#[path = "common/cli.rs"]
mod cli;
#[path = "common/peak_alloc.rs"]
mod peak_alloc;

#[global_allocator]
static GLOBAL: peak_alloc::CountingAlloc = peak_alloc::CountingAlloc;

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,
    /// Comma-separated prompt lengths in tokens
    #[arg(long, default_value = "128,1024,4096")]
    prompts: String,
    /// Greedy decode steps after each prompt
    #[arg(long, default_value_t = 32)]
    decode_tokens: usize,
    /// Comma-separated: flash, naive
    #[arg(long, default_value = "flash,naive")]
    attn: String,
    /// f32, f16 or bf16
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// cpu or cuda
    #[arg(long, default_value = "cpu")]
    device: String,
}

/// Runs `f` and returns its result, its seconds and its peak heap growth in MB (CPU only).
fn measure<T>(device: &Device, f: impl FnOnce() -> Result<T>) -> Result<(T, f64, Option<f64>)> {
    device.synchronize()?;
    let base = peak_alloc::reset_peak();
    let t = Instant::now();
    let out = f()?;
    device.synchronize()?;
    let secs = t.elapsed().as_secs_f64();
    let peak = device.is_cpu().then(|| peak_alloc::peak_since(base) as f64 / 1e6);
    Ok((out, secs, peak))
}

struct Row {
    attn: AttnImpl,
    prompt: usize,
    prefill_tps: f64,
    prefill_peak: Option<f64>,
    decode_tps: f64,
    decode_peak: Option<f64>,
}

/// A prompt of exactly `n` tokens: ordinary text, tokenized and repeated.
fn prompt_tokens(tokens: &[u32], n: usize) -> Vec<u32> {
    tokens.iter().copied().cycle().take(n).collect()
}

fn run(
    model: &Llama,
    prompt: &[u32],
    decode_tokens: usize,
    device: &Device,
) -> Result<(f64, Option<f64>, f64, Option<f64>)> {
    // Exactly the capacity needed, so that the cache never grows mid-measurement.
    let mut cache = Cache::new(model.config().num_hidden_layers, prompt.len() + decode_tokens);
    let ids = Tensor::new(prompt, device)?.unsqueeze(0)?;
    let mut sampler = LogitsProcessor::new(Sampling::Greedy, 0);
    let (mut next, prefill_secs, prefill_peak) =
        measure(device, || Ok(sampler.sample(&model.forward(&ids, Some(&mut cache))?.squeeze(0)?)?))?;
    let (_, decode_secs, decode_peak) = measure(device, || {
        for _ in 0..decode_tokens {
            let input = Tensor::new(&[next], device)?.unsqueeze(0)?;
            next = sampler.sample(&model.forward(&input, Some(&mut cache))?.squeeze(0)?)?;
        }
        Ok(())
    })?;
    Ok((prompt.len() as f64 / prefill_secs, prefill_peak, decode_tokens as f64 / decode_secs, decode_peak))
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !args.model.exists() {
        bail!("model not found: {} (fetch the default one with `bash scripts/fetch-model.sh`)", args.model.display())
    }
    let device = cli::device(&args.device)?;
    let dtype = cli::dtype(&args.dtype)?;
    let impls: Vec<AttnImpl> = args.attn.split(',').map(|s| s.trim().parse()).collect::<candle_core::Result<_>>()?;
    let lengths: Vec<usize> =
        args.prompts.split(',').map(|s| s.trim().parse().context("--prompts")).collect::<Result<_>>()?;

    let loaded = load(&args.model, dtype, &device, AttnImpl::Flash, &mut |_, _| {})?;
    let mut model = loaded.model;
    let tokenizer = loaded.tokenizer.context("the model has no tokenizer")?;
    let text = "FlashAttention computes exact attention tile by tile, keeping a running maximum and sum \
                so that the full score matrix never exists in memory. ";
    let base = tokenizer.encode(text, false).map_err(anyhow::Error::msg)?.get_ids().to_vec();
    eprintln!(
        "model {} ({dtype:?} on {}), weights and buffers live: {:.0} MB; {} threads",
        args.model.display(),
        args.device,
        peak_alloc::live() as f64 / 1e6,
        rayon::current_num_threads(),
    );

    // Warm-up: first-touch allocations and thread pools.
    run(&model, &prompt_tokens(&base, 16), 2, &device)?;

    let mut rows = vec![];
    for &n in &lengths {
        for &attn in &impls {
            model.set_attn_impl(attn);
            let (prefill_tps, prefill_peak, decode_tps, decode_peak) =
                run(&model, &prompt_tokens(&base, n), args.decode_tokens, &device)?;
            println!(
                "{}",
                serde_json::json!({
                    "attn": format!("{attn:?}").to_lowercase(), "prompt_tokens": n, "dtype": args.dtype,
                    "device": args.device, "prefill_tokens_per_s": prefill_tps, "prefill_peak_mb": prefill_peak,
                    "decode_tokens": args.decode_tokens, "decode_tokens_per_s": decode_tps, "decode_peak_mb": decode_peak,
                })
            );
            rows.push(Row { attn, prompt: n, prefill_tps, prefill_peak, decode_tps, decode_peak });
        }
    }

    let mb = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.0}"));
    println!(
        "\n| attn | prompt | prefill tok/s | prefill peak MB | decode tok/s ({} steps) | decode peak MB | prefill vs naive |",
        args.decode_tokens
    );
    println!("|---|---|---|---|---|---|---|");
    for r in &rows {
        let naive = rows.iter().find(|o| o.attn == AttnImpl::Naive && o.prompt == r.prompt);
        let speedup = match (r.attn, naive) {
            (AttnImpl::Flash, Some(n)) => format!("{:.2}x", r.prefill_tps / n.prefill_tps),
            _ => String::new(),
        };
        println!(
            "| {} | {} | {:.1} | {} | {:.1} | {} | {speedup} |",
            format!("{:?}", r.attn).to_lowercase(),
            r.prompt,
            r.prefill_tps,
            mb(r.prefill_peak),
            r.decode_tps,
            mb(r.decode_peak),
        );
    }
    Ok(())
}
