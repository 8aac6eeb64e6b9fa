//! End-to-end Llama benchmark: prefill and decode speed and peak memory, flash vs naive.
//!
//! `cargo run --release -p candle-flash-llama --example llama_bench` runs SmolLM2-135M-Instruct (see
//! `bash scripts/fetch-model.sh`) on prompts of 128, 1024 and 4096 tokens: one prefill forward
//! over the prompt (into a KV cache), then `--decode-tokens` greedy steps against that cache.
//! It prints one JSON object per measurement and a table at the end.
//!
//! Peak memory is the peak of heap bytes allocated above what was live before the step (this
//! binary counts allocations; CPU only): for the prefill it includes the KV cache buffers
//! (identical for both implementations) and every activation, so the difference between the
//! rows is the attention's own working memory. The process's peak RSS (VmHWM) is printed last.
//!
//! GGUF weights stay quantized unless `--weights dequantized`. Each measurement runs
//! `--repeats` times; the table shows the median and the best. With `--llama-cpp-python PYTHON`
//! (an interpreter with `llama-cpp-python` installed), `bench/llama_cpp_bench.py` then measures
//! llama.cpp on the same GGUF file and the same prompt tokens, with `--threads` threads, in the
//! same run (method: bench/NOTES.md).
//!
//! `--batch 1,8,32` measures batched generation instead: for each batch size B, B sequences
//! (prompts of the first `--prompts` length, each a different slice of the text) go through the
//! continuous-batching `Scheduler` from one paged KV cache: one step prefills all B prompts,
//! then `--decode-tokens` steps decode one token for each. The sizes take turns within each
//! repeat. It reports the aggregate decode tokens/s (B tokens per step), its ratio to batch 1
//! in the same run, and the cache's peak memory (pages in use, and the pool allocated).

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use candle_flash_llama::{
    load_with, AttnImpl, Cache, DecodeGraph, GgufWeights, Llama, LogitsProcessor, Request, Sampling, Scheduler,
    SchedulerConfig,
};
use clap::Parser;
use std::path::{Path, PathBuf};
use std::time::Instant;

// the examples of both crates share these helpers: one copy, in the root crate's examples
#[path = "../../examples/common/cli.rs"]
mod cli;
#[path = "../../examples/common/peak_alloc.rs"]
mod peak_alloc;

#[global_allocator]
static GLOBAL: peak_alloc::CountingAlloc = peak_alloc::CountingAlloc;

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value = DEFAULT_MODEL)]
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
    /// GGUF weights: quantized (kept in their formats) or dequantized (to --dtype at load)
    #[arg(long, default_value = "quantized")]
    weights: String,
    /// CPU threads (the rayon pool, built once here); 0: one per logical CPU
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Runs of each measurement (the table shows the median and the best)
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// A Python interpreter with llama-cpp-python: also measure llama.cpp on the same tokens
    #[arg(long)]
    llama_cpp_python: Option<PathBuf>,
    /// Comma-separated batch sizes: measure batched generation (see the module documentation)
    /// instead of the single-sequence runs
    #[arg(long)]
    batch: Option<String>,
    /// Rows per page of the batched mode's KV cache
    #[arg(long, default_value_t = 16)]
    page_size: usize,
    /// CUDA graphs for the flash decode (CUDA only): both (a row each, same run), on, off
    #[arg(long, default_value = "both")]
    graph: String,
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
    name: String,
    prompt: usize,
    /// (median, best) tokens/s.
    prefill_tps: (f64, f64),
    prefill_peak: Option<f64>,
    decode_tps: (f64, f64),
    decode_peak: Option<f64>,
}

/// (median, best) of the runs' tokens/s.
fn median_best(mut xs: Vec<f64>) -> (f64, f64) {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    let median = if n % 2 == 1 { xs[n / 2] } else { (xs[n / 2 - 1] + xs[n / 2]) / 2.0 };
    (median, xs[n - 1])
}

/// The process's peak resident set (VmHWM) in MB, where /proc tells it.
fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024.0 / 1e6)
}

/// llama.cpp through `bench/llama_cpp_bench.py` on the same prompts; its rows and peak RSS.
fn llama_cpp_rows(
    python: &std::path::Path,
    args: &Args,
    warmup: &[u32],
    prompts: &[Vec<u32>],
) -> Result<(Vec<Row>, Option<f64>)> {
    let tokens = std::env::temp_dir().join(format!("llama_bench_tokens_{}.json", std::process::id()));
    std::fs::write(&tokens, serde_json::json!({ "warmup": warmup, "prompts": prompts }).to_string())?;
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/llama_cpp_bench.py");
    let threads = if args.threads == 0 { rayon::current_num_threads() } else { args.threads };
    let out = std::process::Command::new(python)
        .arg(&script)
        .args(["--model", &args.model.to_string_lossy(), "--tokens", &tokens.to_string_lossy()])
        .args(["--threads", &threads.to_string(), "--decode-tokens", &args.decode_tokens.to_string()])
        .args(["--repeats", &args.repeats.to_string()])
        .output()
        .with_context(|| format!("running {}", python.display()))?;
    let _ = std::fs::remove_file(&tokens);
    if !out.status.success() {
        bail!("llama_cpp_bench.py failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr))
    }
    let (mut rows, mut rss) = (vec![], None);
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("llama_cpp_bench.py printed {line:?}"))?;
        println!("{v}");
        let f = |k: &str| v.get(k).and_then(|x| x.as_f64());
        if let Some(r) = f("peak_rss_mb") {
            rss = Some(r);
            continue;
        }
        let (Some(n), Some(pm), Some(pb), Some(dm), Some(db)) = (
            f("prompt_tokens"),
            f("prefill_tokens_per_s_median"),
            f("prefill_tokens_per_s_best"),
            f("decode_tokens_per_s_median"),
            f("decode_tokens_per_s_best"),
        ) else {
            bail!("llama_cpp_bench.py printed {line:?}")
        };
        rows.push(Row {
            name: "llama.cpp".into(),
            prompt: n as usize,
            prefill_tps: (pm, pb),
            prefill_peak: None,
            decode_tps: (dm, db),
            decode_peak: None,
        });
    }
    Ok((rows, rss))
}

/// A prompt of exactly `n` tokens: ordinary text, tokenized and repeated.
fn prompt_tokens(tokens: &[u32], n: usize) -> Vec<u32> {
    tokens.iter().copied().cycle().take(n).collect()
}

/// Prefill tokens/s and peak MB, decode tokens/s and peak MB, and the greedy tokens (what the
/// graph runs must reproduce).
type EagerRun = (f64, Option<f64>, f64, Option<f64>, Vec<u32>);

fn run(model: &Llama, prompt: &[u32], decode_tokens: usize, device: &Device) -> Result<EagerRun> {
    // Exactly the capacity needed, so that the cache never grows mid-measurement.
    let mut cache = Cache::new(model.config().num_hidden_layers, prompt.len() + decode_tokens);
    let ids = Tensor::new(prompt, device)?.unsqueeze(0)?;
    let mut sampler = LogitsProcessor::new(Sampling::Greedy, 0);
    // Allocated before the timed parts, so that the heap peaks do not count it.
    let mut tokens = Vec::with_capacity(decode_tokens + 1);
    let (mut next, prefill_secs, prefill_peak) =
        measure(device, || Ok(sampler.sample(&model.forward(&ids, Some(&mut cache))?.squeeze(0)?)?))?;
    tokens.push(next);
    let (_, decode_secs, decode_peak) = measure(device, || {
        for _ in 0..decode_tokens {
            let input = Tensor::new(&[next], device)?.unsqueeze(0)?;
            next = sampler.sample(&model.forward(&input, Some(&mut cache))?.squeeze(0)?)?;
            tokens.push(next);
        }
        Ok(())
    })?;
    Ok((prompt.len() as f64 / prefill_secs, prefill_peak, decode_tokens as f64 / decode_secs, decode_peak, tokens))
}

/// Rows per page of the graph runs' cache (one sequence: large pages, a short table).
const GRAPH_PAGE_SIZE: usize = 256;

/// Like [`run`] with the decode replayed from a CUDA graph (what `Llama::generate` does on
/// CUDA): the prompt through the paged forward, one capture (timed apart), then the steps.
/// Returns (prefill tokens/s, decode tokens/s, capture seconds, the generated tokens).
fn run_graph(
    model: &Llama,
    prompt: &[u32],
    decode_tokens: usize,
    device: &Device,
) -> Result<(f64, f64, f64, Vec<u32>)> {
    let max_len = prompt.len() + decode_tokens;
    let mut cache = model.new_paged_cache(GRAPH_PAGE_SIZE, None)?;
    cache.reserve(max_len.div_ceil(GRAPH_PAGE_SIZE))?;
    cache.add_sequence(0)?;
    let (logits, prefill_secs, _) = measure(device, || Ok(model.forward_paged(&[(0, prompt)], &mut cache)?))?;
    let mut next = Scheduler::greedy(&logits.get(0)?)?;
    let mut tokens = vec![next];
    let (mut graph, capture_secs, _) = measure(device, || Ok(DecodeGraph::capture(model, &cache, 1, max_len)?))?;
    let (_, decode_secs, _) = measure(device, || {
        for _ in 0..decode_tokens {
            graph.step(&mut cache, &[(0, next)])?;
            next = graph.tokens()?[0];
            tokens.push(next);
        }
        Ok(())
    })?;
    Ok((prompt.len() as f64 / prefill_secs, decode_tokens as f64 / decode_secs, capture_secs, tokens))
}

/// One batched measurement.
struct BatchRun {
    prefill_tps: f64,
    decode_tps: f64,
    /// The first decode step (on CUDA: the graph capture with one eager step).
    first_decode_ms: f64,
    /// MB of the pages in use at the peak, and of the pool allocated.
    cache_in_use_mb: f64,
    cache_pool_mb: f64,
}

/// `b` sequences of `prompt_len` tokens (each a different slice of `base`) through the
/// scheduler: one prefill step for all, then `decode_tokens` greedy decode steps (the first
/// one, which captures the CUDA graph there, timed apart).
fn run_batch(
    model: &Llama,
    base: &[u32],
    prompt_len: usize,
    b: usize,
    decode_tokens: usize,
    page_size: usize,
    device: &Device,
) -> Result<BatchRun> {
    let mut sched = Scheduler::new(model, SchedulerConfig { max_batch: b, page_size, ..Default::default() })?;
    for i in 0..b {
        let prompt: Vec<u32> = base.iter().copied().cycle().skip(i).take(prompt_len).collect();
        // The first token comes from the prefill step, then one per decode step.
        sched.add(Request::new(prompt, decode_tokens + 1))?;
    }
    let (first, prefill_secs, _) = measure(device, || Ok(sched.step_greedy()?))?;
    if first.prefill_tokens != b * prompt_len || sched.running() != b {
        bail!("batch {b}: the first step fed {} prompt tokens for {} sequences", first.prefill_tokens, sched.running())
    }
    // The first decode step stays out of the timing: on CUDA it captures the step's graph
    // (reported apart).
    let (_, capture_secs, _) = measure(device, || Ok(sched.step_greedy()?))?;
    let (steps, decode_secs, _) = measure(device, || {
        let mut steps = 0;
        while !sched.is_idle() {
            let step = sched.step_greedy()?;
            if step.decode_tokens != b || step.prefill_tokens != 0 {
                bail!("batch {b}: a decode step fed {} tokens", step.decode_tokens + step.prefill_tokens)
            }
            steps += 1;
        }
        Ok(steps)
    })?;
    let c = sched.cache();
    let layer_page_mb = c.page_bytes() as f64 * c.num_layers() as f64 / 1e6;
    Ok(BatchRun {
        prefill_tps: (b * prompt_len) as f64 / prefill_secs,
        decode_tps: (b * steps) as f64 / decode_secs,
        first_decode_ms: capture_secs * 1e3,
        cache_in_use_mb: c.peak_pages_in_use() as f64 * layer_page_mb,
        cache_pool_mb: c.pool_bytes() as f64 / 1e6,
    })
}

/// The batched mode: every batch size of `sizes`, `args.repeats` times each, then a table.
fn batch_mode(args: &Args, model: &Llama, base: &[u32], sizes: &str, device: &Device) -> Result<()> {
    let sizes: Vec<usize> = sizes.split(',').map(|s| s.trim().parse().context("--batch")).collect::<Result<_>>()?;
    let prompt_len: usize = args.prompts.split(',').next().unwrap_or("128").trim().parse().context("--prompts")?;
    if sizes.contains(&0) || prompt_len == 0 {
        bail!("--batch sizes and the prompt length must be at least 1")
    }
    let cfg = model.config();
    // Repeats outermost, batch sizes inside: on a shared machine the load drifts over minutes,
    // and interleaving gives every size the same mix of quiet and busy moments.
    let mut runs: Vec<Vec<BatchRun>> = sizes.iter().map(|_| vec![]).collect();
    for _ in 0..args.repeats {
        for (&b, runs) in sizes.iter().zip(runs.iter_mut()) {
            runs.push(run_batch(model, base, prompt_len, b, args.decode_tokens, args.page_size, device)?);
        }
    }
    let mut rows = vec![];
    for (&b, runs) in sizes.iter().zip(runs) {
        let pre = median_best(runs.iter().map(|r| r.prefill_tps).collect());
        let (prefill_tps, decode_tps) = (pre, median_best(runs.iter().map(|r| r.decode_tps).collect()));
        let Some(last) = runs.into_iter().last() else { bail!("--repeats must be at least 1") };
        // What contiguous per-sequence caches of the same lengths hold (f32 K and V).
        let contiguous_mb = (b
            * (prompt_len + args.decode_tokens)
            * 2
            * cfg.num_hidden_layers
            * cfg.num_key_value_heads
            * cfg.head_dim
            * model.dtype().size_in_bytes()) as f64
            / 1e6;
        println!(
            "{}",
            serde_json::json!({
                "batch": b, "prompt_tokens": prompt_len, "decode_tokens": args.decode_tokens,
                "page_size": args.page_size, "dtype": args.dtype, "weights": args.weights, "device": args.device,
                "prefill_tokens_per_s_median": prefill_tps.0, "decode_tokens_per_s_median": decode_tps.0,
                "decode_tokens_per_s_best": decode_tps.1, "cache_in_use_mb": last.cache_in_use_mb,
                "cache_pool_mb": last.cache_pool_mb, "contiguous_cache_mb": contiguous_mb,
                "first_decode_step_ms": last.first_decode_ms,
            })
        );
        rows.push((b, prefill_tps, decode_tps, last, contiguous_mb));
    }
    println!(
        "\n| batch | prompt | prefill tok/s (median) | aggregate decode tok/s ({} steps after the first, median / best) | vs batch {} | cache MB: peak in use / pool / contiguous |",
        args.decode_tokens.saturating_sub(1),
        sizes[0]
    );
    println!("|---|---|---|---|---|---|");
    let first = rows.first().map_or(1.0, |r| r.2 .0);
    for (b, pre, dec, r, contiguous) in &rows {
        println!(
            "| {b} | {prompt_len} | {:.1} | {:.1} / {:.1} | {:.2}x | {:.1} / {:.1} / {:.1} |",
            pre.0,
            dec.0,
            dec.1,
            dec.0 / first,
            r.cache_in_use_mb,
            r.cache_pool_mb,
            contiguous
        );
    }
    println!("\npeak RSS: {} MB", peak_rss_mb().map_or("-".to_string(), |x| format!("{x:.0}")));
    Ok(())
}

const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

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
        bail!("model not found: {} (fetch the default one with `bash scripts/fetch-model.sh`)", args.model.display())
    }
    if args.repeats == 0 {
        bail!("--repeats must be at least 1")
    }
    // The thread pool is set up once, here: our CPU products run on rayon's global pool (and
    // never ask candle for its thread count, which candle-core 0.11 recomputes from
    // /proc/cpuinfo on every matmul).
    if args.threads > 0 {
        rayon::ThreadPoolBuilder::new().num_threads(args.threads).build_global()?;
    }
    let device = cli::device(&args.device)?;
    let dtype = cli::dtype(&args.dtype)?;
    let weights: GgufWeights = args.weights.parse()?;
    let impls: Vec<AttnImpl> = args.attn.split(',').map(|s| s.trim().parse()).collect::<candle_core::Result<_>>()?;
    let lengths: Vec<usize> =
        args.prompts.split(',').map(|s| s.trim().parse().context("--prompts")).collect::<Result<_>>()?;

    let loaded = load_with(&args.model, dtype, &device, AttnImpl::Flash, weights, &mut |_, _| {})?;
    let mut model = loaded.model;
    let tokenizer = loaded.tokenizer.context("the model has no tokenizer")?;
    let text = "FlashAttention computes exact attention tile by tile, keeping a running maximum and sum \
                so that the full score matrix never exists in memory. ";
    let base = tokenizer.encode(text, false).map_err(anyhow::Error::msg)?.get_ids().to_vec();
    eprintln!(
        "model {} ({dtype:?} on {}, {weights:?} weights), weights and buffers live: {:.0} MB; {} threads",
        args.model.display(),
        args.device,
        peak_alloc::live() as f64 / 1e6,
        rayon::current_num_threads(),
    );

    // Warm-up: first-touch allocations and thread pools (and, on CUDA, kernel loading: the
    // first forward of a fresh process is timed here).
    let t = Instant::now();
    model.forward(&Tensor::new(&prompt_tokens(&base, 16)[..], &device)?.unsqueeze(0)?, None)?.to_vec2::<f32>()?;
    eprintln!("first forward of this process (16 tokens, no cache): {:.3} s", t.elapsed().as_secs_f64());
    run(&model, &prompt_tokens(&base, 16), 2, &device)?;
    if let Some(sizes) = &args.batch {
        return batch_mode(&args, &model, &base, sizes, &device);
    }

    let (graph_rows, eager_rows) = match (device.is_cuda(), args.graph.as_str()) {
        (false, _) | (true, "off") => (false, true),
        (true, "both") => (true, true),
        (true, "on") => (true, false),
        (_, other) => bail!("--graph {other:?}: expected both, on or off"),
    };
    let mut rows = vec![];
    for &n in &lengths {
        if graph_rows {
            // graphs decode with flash attention (the implementations' loop below may have left
            // another one set)
            model.set_attn_impl(AttnImpl::Flash);
            let prompt = prompt_tokens(&base, n);
            let (mut pre, mut dec, mut cap, mut same) = (vec![], vec![], vec![], true);
            let eager = run(&model, &prompt, args.decode_tokens, &device)?.4;
            for _ in 0..args.repeats {
                let (p, d, c, tokens) = run_graph(&model, &prompt, args.decode_tokens, &device)?;
                pre.push(p);
                dec.push(d);
                cap.push(c * 1e3);
                same &= tokens == eager;
            }
            let capture_ms = median_best(cap).0;
            let (prefill_tps, decode_tps) = (median_best(pre), median_best(dec));
            println!(
                "{}",
                serde_json::json!({
                    "attn": "flash+graph", "prompt_tokens": n, "dtype": args.dtype, "weights": args.weights,
                    "device": args.device, "prefill_tokens_per_s_median": prefill_tps.0,
                    "decode_tokens": args.decode_tokens, "decode_tokens_per_s_median": decode_tps.0,
                    "decode_tokens_per_s_best": decode_tps.1, "graph_capture_ms_median": capture_ms,
                    "greedy_tokens_equal_eager": same,
                })
            );
            rows.push(Row {
                name: "flash+graph".into(),
                prompt: n,
                prefill_tps,
                prefill_peak: None,
                decode_tps,
                decode_peak: None,
            });
        }
        if !eager_rows {
            continue;
        }
        for &attn in &impls {
            model.set_attn_impl(attn);
            let (mut pre, mut dec, mut prefill_peak, mut decode_peak) = (vec![], vec![], None, None);
            for _ in 0..args.repeats {
                let (p, pp, d, dp, _) = run(&model, &prompt_tokens(&base, n), args.decode_tokens, &device)?;
                pre.push(p);
                dec.push(d);
                (prefill_peak, decode_peak) = (pp, dp);
            }
            let (prefill_tps, decode_tps) = (median_best(pre), median_best(dec));
            let name = format!("{attn:?}").to_lowercase();
            println!(
                "{}",
                serde_json::json!({
                    "attn": name, "prompt_tokens": n, "dtype": args.dtype, "weights": args.weights,
                    "device": args.device, "prefill_tokens_per_s_median": prefill_tps.0,
                    "prefill_tokens_per_s_best": prefill_tps.1, "prefill_peak_mb": prefill_peak,
                    "decode_tokens": args.decode_tokens, "decode_tokens_per_s_median": decode_tps.0,
                    "decode_tokens_per_s_best": decode_tps.1, "decode_peak_mb": decode_peak,
                })
            );
            rows.push(Row { name, prompt: n, prefill_tps, prefill_peak, decode_tps, decode_peak });
        }
    }
    let ours_rss = peak_rss_mb();
    let theirs = match &args.llama_cpp_python {
        Some(python) => {
            let prompts: Vec<Vec<u32>> = lengths.iter().map(|&n| prompt_tokens(&base, n)).collect();
            Some(llama_cpp_rows(python, &args, &prompt_tokens(&base, 16), &prompts)?)
        }
        None => None,
    };

    let mb = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.0}"));
    println!(
        "\n| impl | prompt | prefill tok/s (median / best) | prefill peak MB | decode tok/s ({} steps, median / best) | decode peak MB | prefill vs naive | prefill / decode vs llama.cpp |",
        args.decode_tokens
    );
    println!("|---|---|---|---|---|---|---|---|");
    let cpp_rows = theirs.as_ref().map_or(&[][..], |t| &t.0[..]);
    for r in rows.iter().chain(cpp_rows) {
        let naive = rows.iter().find(|o| o.name == "naive" && o.prompt == r.prompt);
        let eager = rows.iter().find(|o| o.name == "flash" && o.prompt == r.prompt);
        let speedup = match (naive, eager) {
            (Some(n), _) if r.name == "flash" => format!("{:.2}x", r.prefill_tps.0 / n.prefill_tps.0),
            (_, Some(e)) if r.name == "flash+graph" => format!("decode {:.2}x flash", r.decode_tps.0 / e.decode_tps.0),
            _ => String::new(),
        };
        let vs_cpp = match cpp_rows.iter().find(|c| c.prompt == r.prompt) {
            Some(c) if r.name != "llama.cpp" => {
                format!("{:.2}x / {:.2}x", r.prefill_tps.0 / c.prefill_tps.0, r.decode_tps.0 / c.decode_tps.0)
            }
            _ => String::new(),
        };
        println!(
            "| {} | {} | {:.1} / {:.1} | {} | {:.1} / {:.1} | {} | {speedup} | {vs_cpp} |",
            r.name,
            r.prompt,
            r.prefill_tps.0,
            r.prefill_tps.1,
            mb(r.prefill_peak),
            r.decode_tps.0,
            r.decode_tps.1,
            mb(r.decode_peak),
        );
    }
    println!("\npeak RSS: ours {} MB", mb(ours_rss));
    if let Some((_, rss)) = &theirs {
        println!("peak RSS: llama.cpp {} MB (its Python process)", mb(*rss));
    }
    Ok(())
}
