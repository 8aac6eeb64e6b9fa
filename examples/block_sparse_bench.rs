//! Block-sparse attention benchmark: flash through a `BlockMask`, forward and backward, on the
//! mask patterns of bench/flex_block_sparse.py (PyTorch FlexAttention's counterpart).
//!
//! `cargo run --release --features cuda --example block_sparse_bench` prints one JSON object per
//! line (keys: impl, pattern, mode, dtype, b, h, n, d, density, visited_blocks, ms,
//! tflops_visited, build_ms; `k` for the density sweep) and a table at the end. visited_blocks
//! counts the 128 × 128 blocks the call computes (partial and full, over every batch entry and
//! head); tflops_visited counts 4·D·128²·visited_blocks for the forward and 2.5× that for the
//! backward, so a sparse mask is not credited with the blocks it skips. build_ms is the time of
//! the mask builder alone (its inputs already on the device). A row that fails (a case the
//! kernels do not take) prints `error` and the run goes on.
//!
//! Patterns (N = 16384 unless said; `--n` sets every pattern's N, for smoke tests):
//! - `dense`, `dense_causal`: no block mask (plain and causal), the baselines;
//! - `document`: 16 equal documents packed, causal inside each;
//! - `prefix_lm`: N = 8192, a bidirectional prefix of N / 4, causal after it;
//! - `window_global`: causal, keys at most 1024 positions back, or one of the first 64 keys;
//! - `chunked`: causal inside chunks of 2048 (Llama-4);
//! - `topk`: each query block the diagonal block and 7 random earlier ones (per head), causal;
//! - `density`: each query block k random key blocks of 128 (per head, non-causal), k = 1, 2, 4,
//!   ..., 128: time against density.

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use candle_flash::block_mask::BLOCK_SIZE;
use candle_flash::{
    flash_attn_grads, flash_attn_with_lse, flash_attn_with_options, BlockMask, FlashAttnOptions, MaskSpec,
};
use clap::Parser;
use std::collections::hash_map::{Entry, HashMap};
use std::time::Instant;

#[path = "common/cli.rs"]
mod cli;

const ALL: &str = "dense,dense_causal,document,prefix_lm,window_global,chunked,topk,density";

#[derive(Parser, Debug)]
struct Args {
    /// cpu or cuda
    #[arg(long, default_value = "cuda")]
    device: String,
    /// f32, f16 or bf16
    #[arg(long, default_value = "bf16")]
    dtype: String,
    #[arg(long, default_value_t = 128)]
    hdim: usize,
    /// Query heads (K and V have as many)
    #[arg(long, default_value_t = 16)]
    heads: usize,
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Timed iterations (the median is reported)
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Comma-separated, or `all`: dense, dense_causal, document, prefix_lm, window_global,
    /// chunked, topk, density
    #[arg(long, default_value = "all")]
    patterns: String,
    /// Comma-separated: fwd, bwd
    #[arg(long, default_value = "fwd,bwd")]
    modes: String,
    /// Sequence length of every pattern (default: each pattern's own)
    #[arg(long)]
    n: Option<usize>,
}

/// How a case masks: not at all (the dense baselines) or through a block mask built by one of
/// the two builders.
enum Mask {
    Dense { causal: bool },
    Spec(MaskSpec),
    Indices { indices: Tensor, spec: Option<MaskSpec> },
}

struct Case {
    pattern: &'static str,
    n: usize,
    /// Key blocks per query block (the density sweep).
    k: Option<usize>,
    mask: Mask,
}

/// xorshift64 (Marsaglia's 13, 7, 17): the block picks, identical in bench/flex_block_sparse.py.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// `count` distinct values of `0..m` (a partial Fisher-Yates shuffle).
    fn pick(&mut self, m: usize, count: usize) -> Vec<usize> {
        let mut all: Vec<usize> = (0..m).collect();
        for i in 0..count.min(m) {
            let j = i + (self.next() % (m - i) as u64) as usize;
            all.swap(i, j);
        }
        all.truncate(count.min(m));
        all
    }
}

const SEED: u64 = 0x9E37_79B9_7F4A_7C15;
/// Key blocks each query block of `topk` visits: the diagonal and 7 earlier ones.
const TOPK: usize = 8;
const DOCUMENTS: usize = 16;
const WINDOW: usize = 1024;
const GLOBAL: usize = 64;
const CHUNK: usize = 2048;

/// i32 `(1, heads, qb, width)` block lists, -1 past each row's picks.
fn index_tensor(rows: Vec<Vec<usize>>, (heads, qb, width): (usize, usize, usize), device: &Device) -> Result<Tensor> {
    let mut flat = vec![-1i32; heads * qb * width];
    for (r, row) in rows.iter().enumerate() {
        for (c, &x) in row.iter().enumerate() {
            flat[r * width + c] = x as i32;
        }
    }
    Ok(Tensor::from_vec(flat, (1, heads, qb, width), device)?)
}

fn cases(pattern: &str, n_arg: Option<usize>, heads: usize, device: &Device) -> Result<Vec<Case>> {
    let n = n_arg.unwrap_or(if pattern == "prefix_lm" { 8192 } else { 16384 });
    let blocks = n.div_ceil(BLOCK_SIZE);
    let one = |mask| -> Result<Vec<Case>> { Ok(vec![Case { pattern: static_name(pattern), n, k: None, mask }]) };
    match pattern {
        "dense" => one(Mask::Dense { causal: false }),
        "dense_causal" => one(Mask::Dense { causal: true }),
        "document" => {
            let len = (n / DOCUMENTS).max(1);
            let ids: Vec<u32> = (0..n).map(|t| (t / len).min(DOCUMENTS - 1) as u32).collect();
            let ids = Tensor::from_vec(ids, (1, n), device)?;
            one(Mask::Spec(MaskSpec::causal().and(MaskSpec::same_document(&ids, &ids))))
        }
        "prefix_lm" => {
            let prefix = Tensor::from_vec(vec![(n / 4) as u32], 1, device)?;
            one(Mask::Spec(MaskSpec::prefix_lm(&prefix)))
        }
        "window_global" => one(Mask::Spec(MaskSpec::window(Some(WINDOW), Some(0)).or(MaskSpec::global_tokens(GLOBAL)))),
        "chunked" => one(Mask::Spec(MaskSpec::causal().and(MaskSpec::chunked(CHUNK)))),
        "topk" => {
            let mut rng = XorShift(SEED);
            let mut rows = vec![];
            for _ in 0..heads {
                for q in 0..blocks {
                    let mut row = vec![q];
                    row.extend(rng.pick(q, TOPK - 1));
                    rows.push(row);
                }
            }
            let indices = index_tensor(rows, (heads, blocks, TOPK), device)?;
            one(Mask::Indices { indices, spec: Some(MaskSpec::causal()) })
        }
        "density" => {
            let mut out = vec![];
            for k in [1, 2, 4, 8, 16, 32, 64, 128].into_iter().filter(|&k| k <= blocks) {
                let mut rng = XorShift(SEED ^ k as u64);
                let rows = (0..heads * blocks).map(|_| rng.pick(blocks, k)).collect();
                let indices = index_tensor(rows, (heads, blocks, k), device)?;
                out.push(Case { pattern: "density", n, k: Some(k), mask: Mask::Indices { indices, spec: None } });
            }
            Ok(out)
        }
        p => bail!("unknown pattern {p:?} (one of {ALL})"),
    }
}

fn static_name(pattern: &str) -> &'static str {
    ALL.split(',').find(|p| *p == pattern).unwrap_or("?")
}

fn sync(device: &Device) -> Result<()> {
    device.synchronize()?;
    Ok(())
}

/// Milliseconds of one call of `f`, the device synchronised before and after: on CUDA between
/// two events on candle's stream around the call (as examples/bench.rs and bench/sdpa.py time),
/// on the CPU by the wall clock.
fn time_once<F: FnMut() -> Result<()>>(device: &Device, f: &mut F) -> Result<f64> {
    sync(device)?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
        let stream = dev.cuda_stream();
        let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        f()?;
        let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        sync(device)?;
        return Ok(start.elapsed_ms(&end)? as f64);
    }
    let t = Instant::now();
    f()?;
    sync(device)?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

/// As examples/bench.rs: warm-up calls for at least this long, so the clocks are up.
const WARM_UP_MS: f64 = 50.0;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// The median of `iters` timed calls after the warm-up.
fn time<F: FnMut() -> Result<()>>(device: &Device, iters: usize, mut f: F) -> Result<f64> {
    let warm = Instant::now();
    loop {
        f()?;
        sync(device)?;
        if warm.elapsed().as_secs_f64() * 1e3 >= WARM_UP_MS {
            break;
        }
    }
    let samples = (0..iters.max(1)).map(|_| time_once(device, &mut f)).collect::<Result<Vec<_>>>()?;
    Ok(median(samples))
}

/// The blocks a call through `mask` computes for `(batch, heads)`, and the mask's density. The
/// lists are read on the host: candle's CUDA backend has no i32 casts, which the device-side
/// sum of `BlockMask::density` needs.
fn visited(mask: &BlockMask, (batch, heads): (usize, usize)) -> Result<(u64, f64)> {
    let count = |t: &Tensor| -> Result<u64> {
        Ok(t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<i32>()?.iter().map(|&x| x.max(0) as u64).sum())
    };
    let listed = count(mask.kv_num_blocks())? + count(mask.full_kv_num_blocks())?;
    let (mb, mh) = mask.batch_heads();
    let (qb, kb) = mask.num_blocks();
    let density = match mask.density() {
        Ok(d) => d,
        Err(e) => {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| eprintln!("BlockMask::density failed ({e}); density computed from the host copy"));
            listed as f64 / (mb * mh * qb * kb).max(1) as f64
        }
    };
    Ok((listed * (batch / mb) as u64 * (heads / mh) as u64, density))
}

/// The dense baselines' visited blocks and density (causal: the blocks on and below the diagonal).
fn dense_visited(n: usize, causal: bool, (batch, heads): (usize, usize)) -> (u64, f64) {
    let nb = n.div_ceil(BLOCK_SIZE) as u64;
    let per = if causal { nb * (nb + 1) / 2 } else { nb * nb };
    ((batch * heads) as u64 * per, per as f64 / (nb * nb) as f64)
}

struct Row {
    pattern: String,
    mode: String,
    n: usize,
    k: Option<usize>,
    density: Option<f64>,
    visited: Option<u64>,
    build_ms: Option<f64>,
    ms: Option<f64>,
    tflops: Option<f64>,
    error: Option<String>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = cli::device(&args.device)?;
    let dtype = cli::dtype(&args.dtype)?;
    let (b, h, d) = (args.batch, args.heads, args.hdim);
    let patterns: Vec<&str> = if args.patterns == "all" {
        ALL.split(',').collect()
    } else {
        args.patterns.split(',').map(str::trim).collect()
    };
    if let Some(p) = patterns.iter().find(|p| !ALL.split(',').any(|a| a == **p)) {
        bail!("unknown pattern {p:?} (one of {ALL}, or all)");
    }
    let modes: Vec<&str> = args.modes.split(',').map(str::trim).collect();
    if let Some(m) = modes.iter().find(|m| !["fwd", "bwd"].contains(m)) {
        bail!("unknown mode {m:?} (fwd or bwd)");
    }
    let scale = 1.0 / (d as f32).sqrt();
    // q, k, v and the output gradient, one set per N.
    let mut inputs: HashMap<usize, [Tensor; 4]> = HashMap::new();
    let mut rows: Vec<Row> = vec![];
    for pattern in patterns {
        for case in cases(pattern, args.n, h, &device)? {
            let n = case.n;
            if let Entry::Vacant(slot) = inputs.entry(n) {
                let rand = || Tensor::randn(0f32, 1., (b, n, h, d), &device)?.to_dtype(dtype);
                slot.insert([rand()?, rand()?, rand()?, rand()?]);
            }
            let [q, k, v, dout] = &inputs[&n];
            // The mask, built once for every mode (timed between synchronisations).
            let built = (|| -> Result<(Option<BlockMask>, Option<f64>, u64, f64)> {
                match &case.mask {
                    Mask::Dense { causal } => {
                        let (visited, density) = dense_visited(n, *causal, (b, h));
                        Ok((None, None, visited, density))
                    }
                    Mask::Spec(_) | Mask::Indices { .. } => {
                        sync(&device)?;
                        let t = Instant::now();
                        let mask = match &case.mask {
                            Mask::Spec(spec) => BlockMask::from_spec(spec, 1, 1, n, n, &device)?,
                            Mask::Indices { indices, spec } => {
                                BlockMask::from_block_indices(indices, spec.as_ref(), n, n)?
                            }
                            Mask::Dense { .. } => unreachable!(),
                        };
                        sync(&device)?;
                        let build_ms = t.elapsed().as_secs_f64() * 1e3;
                        let (visited, density) = visited(&mask, (b, h))?;
                        Ok((Some(mask), Some(build_ms), visited, density))
                    }
                }
            })();
            let causal = matches!(case.mask, Mask::Dense { causal: true });
            for &mode in &modes {
                let mut row = Row {
                    pattern: case.pattern.to_string(),
                    mode: mode.to_string(),
                    n,
                    k: case.k,
                    density: None,
                    visited: None,
                    build_ms: None,
                    ms: None,
                    tflops: None,
                    error: None,
                };
                let timed = match &built {
                    Err(e) => Err(anyhow::anyhow!("building the mask: {e}")),
                    Ok((mask, build_ms, visited, density)) => {
                        (row.density, row.visited, row.build_ms) = (Some(*density), Some(*visited), *build_ms);
                        let opts = FlashAttnOptions::new(scale).causal(causal).block_mask(mask.as_ref());
                        match mode {
                            "fwd" => time(&device, args.iters, || {
                                flash_attn_with_options(q, k, v, &opts)?;
                                Ok(())
                            }),
                            _ => flash_attn_with_lse(q, k, v, &opts).map_err(anyhow::Error::from).and_then(
                                |(out, lse)| {
                                    time(&device, args.iters, || {
                                        flash_attn_grads(q, k, v, &out, dout, &lse, &opts)?;
                                        Ok(())
                                    })
                                },
                            ),
                        }
                    }
                };
                match timed {
                    Ok(ms) => {
                        let flops = 4.0
                            * (d * BLOCK_SIZE * BLOCK_SIZE) as f64
                            * row.visited.unwrap_or(0) as f64
                            * if mode == "bwd" { 2.5 } else { 1.0 };
                        row.ms = Some(ms);
                        row.tflops = Some(flops / (ms * 1e-3) / 1e12);
                    }
                    Err(e) => row.error = Some(message(&e)),
                }
                print_json(&row, &args, (b, h, d));
                rows.push(row);
            }
        }
    }
    print_table(&rows);
    Ok(())
}

/// An error's message without the backtrace candle appends to it (with RUST_BACKTRACE set).
fn message(e: &anyhow::Error) -> String {
    let text = e.to_string();
    let frame = |l: &str| l.trim_start().split_once(':').is_some_and(|(n, _)| n.parse::<u32>().is_ok());
    text.lines().take_while(|l| !frame(l)).collect::<Vec<_>>().join("\n").trim_end().to_string()
}

fn print_json(row: &Row, args: &Args, (b, h, d): (usize, usize, usize)) {
    let mut json = serde_json::json!({
        "impl": "flash", "pattern": row.pattern, "mode": row.mode, "dtype": args.dtype,
        "b": b, "h": h, "n": row.n, "d": d,
        "density": row.density, "visited_blocks": row.visited, "build_ms": row.build_ms,
    });
    let obj = json.as_object_mut().unwrap();
    if let Some(k) = row.k {
        obj.insert("k".into(), k.into());
    }
    match &row.error {
        Some(e) => {
            obj.insert("error".into(), e.clone().into());
        }
        None => {
            obj.insert("ms".into(), row.ms.into());
            obj.insert("tflops_visited".into(), row.tflops.into());
        }
    }
    println!("{json}");
}

fn print_table(rows: &[Row]) {
    let opt = |x: Option<f64>, digits: usize| x.map(|x| format!("{x:.digits$}")).unwrap_or_else(|| "-".into());
    println!("\n| pattern | mode | n | density | visited blocks | build ms | ms | TFLOP/s (visited) |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in rows {
        let pattern = match r.k {
            Some(k) => format!("{} k={k}", r.pattern),
            None => r.pattern.clone(),
        };
        let (ms, tflops) = match &r.error {
            Some(e) => (format!("error: {}", e.lines().next().unwrap_or("")), "-".into()),
            None => (opt(r.ms, 3), opt(r.tflops, 2)),
        };
        println!(
            "| {pattern} | {} | {} | {} | {} | {} | {ms} | {tflops} |",
            r.mode,
            r.n,
            opt(r.density.map(|x| x * 100.0), 2) + "%",
            r.visited.map(|v| v.to_string()).unwrap_or_else(|| "-".into()),
            opt(r.build_ms, 2),
        );
    }
}
