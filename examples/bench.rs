//! Attention benchmark: flash vs the naive reference, forward, backward and both.
//!
//! `cargo run --release --example bench -- --device cpu` prints one JSON object per line
//! (keys: impl, mode, causal, dtype, b, h, hkv, nq, nk, d, dv, ms, tflops, peak_mb) and a table
//! at the end. TFLOP/s counts 2·B·H·Nq·Nk·(D + Dv) for the forward (4·B·H·Nq·Nk·D when Dv = D;
//! halved when causal), 2.5× that for the backward and 3.5× for forward+backward. peak_mb is the peak of heap memory allocated
//! during one call on the CPU (this binary counts allocations), and the growth of used device
//! memory on CUDA (a lower bound: candle's allocator frees eagerly).

use anyhow::{bail, Result};
use candle_core::{Device, Tensor, Var};
use candle_flash::{flash_attn_grads, flash_attn_with_lse, reference, FlashAttnOptions, PagedKv, VarLen};
use clap::Parser;
use std::time::Instant;

#[path = "common/cli.rs"]
mod cli;
#[path = "common/peak_alloc.rs"]
#[allow(dead_code)] // not every example uses every helper
mod peak_alloc;

#[global_allocator]
static GLOBAL: peak_alloc::CountingAlloc = peak_alloc::CountingAlloc;

#[derive(Parser, Debug)]
struct Args {
    /// cpu or cuda
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Comma-separated: flash, flash_sinks (with learnable sinks, logit 0.5 per head; the
    /// backward also gives their gradient), naive
    #[arg(long = "impl", default_value = "flash,naive")]
    implementation: String,
    /// Comma-separated: fwd, bwd, fwd_bwd
    #[arg(long, default_value = "fwd,bwd")]
    mode: String,
    /// Comma-separated sequence lengths (Nq = Nk)
    #[arg(long, default_value = "256,1024,2048,4096")]
    seqlens: String,
    /// Query heads; comma-separated list allowed
    #[arg(long, default_value = "8")]
    heads: String,
    /// KV heads (default: as many as query heads)
    #[arg(long)]
    hkv: Option<usize>,
    /// Head dims, comma-separated
    #[arg(long, default_value = "64")]
    hdim: String,
    /// v's head dim (MLA), when it differs from q's and k's; TFLOP/s then count
    /// 2·Nq·Nk·(D + Dv) per head for the forward
    #[arg(long)]
    dv: Option<usize>,
    /// v is k's first Dv columns (MLA's latent cache: `k.narrow(3, 0, dv)`); the K/V bytes read
    /// (kv_tbps) then count k alone
    #[arg(long)]
    v_view: bool,
    /// Forward through a paged K/V cache of pages of this many rows (varlen layout, the pages
    /// of each sequence in reverse order); flash impls, mode fwd
    #[arg(long)]
    page_size: Option<usize>,
    /// Batch sizes, comma-separated
    #[arg(long, default_value = "1")]
    batch: String,
    /// true, false or both
    #[arg(long, default_value = "both")]
    causal: String,
    /// f32, f16 or bf16
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Query length override (decode shapes: --nq 1); default Nq = Nk
    #[arg(long)]
    nq: Option<usize>,
    /// FlashAttention papers' grid: batch = tokens / N for each N (overrides --batch)
    #[arg(long)]
    tokens: Option<usize>,
    /// With --tokens: query heads = hidden / D (overrides --heads)
    #[arg(long)]
    hidden: Option<usize>,
    /// Timed iterations (the median is reported)
    #[arg(long, default_value_t = 3)]
    iters: usize,
    /// CUDA: keep the driver's default memory-pool behaviour (release at every sync) instead of
    /// letting it cache freed memory as PyTorch's allocator does
    #[arg(long)]
    no_pool_cache: bool,
    /// Skip naive runs whose score matrices would exceed this many GiB
    #[arg(long, default_value_t = 6.0)]
    naive_max_gib: f64,
    /// CUDA: also time the forward and the backward part of each flash fwd_bwd call (an event
    /// between them) and report them as parts_ms (every call reports host_ms, the host's time to
    /// enqueue it)
    #[arg(long)]
    split: bool,
    /// Print each point's start and end (Unix seconds) to stderr, as
    /// `point IMPL MODE NK CAUSAL D START END`, to match with clock samples
    #[arg(long)]
    stamp: bool,
    /// Idle this many milliseconds before each point (after a synchronisation), so that every
    /// point, of ours and of bench/sdpa.py's, starts from a rested card: under sustained load an
    /// H100 sits at its power cap with its clocks 10-20% lower, and a point's speed would depend
    /// on how busy the card was just before it (bench/NOTES.md, 2026-11-27, commit 378b375)
    #[arg(long, default_value_t = 0)]
    rest_ms: u64,
    /// CUDA: profile only these points' timed calls (comma-separated `mode:nk:causal`, e.g.
    /// `fwd_bwd:16384:false`) between cuProfilerStart / cuProfilerStop, for
    /// `ncu --profile-from-start off`
    #[arg(long)]
    profile_point: Option<String>,
}

/// Events recorded inside one timed call (`--split`): where its GPU time goes.
#[derive(Default)]
struct Marks {
    #[cfg(feature = "cuda")]
    events: std::cell::RefCell<Vec<candle_core::cuda_backend::cudarc::driver::CudaEvent>>,
}

impl Marks {
    /// Records an event on candle's stream (CUDA only; nothing elsewhere).
    fn mark(&self, device: &Device) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = device {
            use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
            let event = dev.cuda_stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            self.events.borrow_mut().push(event);
        }
        let _ = device;
        Ok(())
    }
}

/// One timed call: its time, the host's time to enqueue it, and its parts between marks.
struct Sample {
    ms: f64,
    host_ms: f64,
    parts_ms: Vec<f64>,
}

fn list<T: std::str::FromStr>(s: &str) -> Result<Vec<T>> {
    s.split(',').map(|x| x.trim().parse::<T>().map_err(|_| anyhow::anyhow!("bad list item {x:?}"))).collect()
}

struct Row {
    implementation: String,
    mode: String,
    causal: bool,
    dims: (usize, usize, usize, usize, usize, usize), // b, h, hkv, nq, nk, d
    ms: f64,
    tflops: f64,
    peak_mb: Option<f64>,
}

fn sync(device: &Device) -> Result<()> {
    device.synchronize()?;
    Ok(())
}

fn used_device_mb(device: &Device) -> Option<f64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(_) = device {
        use candle_core::cuda_backend::cudarc::driver::result::mem_get_info;
        return mem_get_info().ok().map(|(free, total)| (total - free) as f64 / 1e6);
    }
    let _ = device;
    None
}

/// Milliseconds of one call of `f`. On CUDA: between two events recorded on candle's stream
/// around the call (what bench/sdpa.py does for PyTorch, so both sides count the same thing:
/// the GPU time from the start event, host launch gaps included, without the wake-up of a
/// host synchronisation), and between the events `f` recorded in `marks`. On the CPU: wall
/// clock.
fn time_once<F: FnMut() -> Result<()>>(device: &Device, marks: &Marks, f: &mut F) -> Result<Sample> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
        let stream = dev.cuda_stream();
        marks.events.borrow_mut().clear();
        let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let t = Instant::now();
        f()?;
        let host_ms = t.elapsed().as_secs_f64() * 1e3;
        let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let ms = start.elapsed_ms(&end)? as f64;
        let events = marks.events.borrow();
        let mut parts_ms = vec![];
        if !events.is_empty() {
            let mut from = &start;
            for to in events.iter().chain(std::iter::once(&end)) {
                parts_ms.push(from.elapsed_ms(to)? as f64);
                from = to;
            }
        }
        return Ok(Sample { ms, host_ms, parts_ms });
    }
    let _ = marks;
    let t = Instant::now();
    f()?;
    sync(device)?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    Ok(Sample { ms, host_ms: ms, parts_ms: vec![] })
}

fn unix_seconds() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// How long the warm-up calls of a point run at least: after `--rest-ms` of idle the card's
/// clocks take a while to come back up, and a point of 10 calls of 50 us would be timed on the
/// way up (ours at N = 512 read 0.6x of its busy speed after 800 ms of rest with one warm-up).
const WARM_UP_MS: f64 = 50.0;

/// Median of `f`'s samples over `iters` runs after warm-up calls for at least `WARM_UP_MS`
/// (each field's own median), and the peak memory of one run.
fn time<F: FnMut() -> Result<()>>(
    device: &Device,
    iters: usize,
    marks: &Marks,
    mut f: F,
) -> Result<(Sample, Option<f64>)> {
    let warm = Instant::now();
    loop {
        f()?;
        sync(device)?;
        if warm.elapsed().as_secs_f64() * 1e3 >= WARM_UP_MS {
            break;
        }
    }
    let base_live = peak_alloc::reset_peak();
    let dev_before = used_device_mb(device);
    let mut samples = vec![];
    let mut dev_peak: Option<f64> = None;
    for _ in 0..iters.max(1) {
        samples.push(time_once(device, marks, &mut f)?);
        if let (Some(b), Some(a)) = (dev_before, used_device_mb(device)) {
            dev_peak = Some(dev_peak.unwrap_or(0.0).max(a - b));
        }
    }
    let parts = samples[0].parts_ms.len();
    let sample = Sample {
        ms: median(samples.iter().map(|s| s.ms).collect()),
        host_ms: median(samples.iter().map(|s| s.host_ms).collect()),
        parts_ms: (0..parts).map(|i| median(samples.iter().map(|s| s.parts_ms[i]).collect())).collect(),
    };
    let peak = if device.is_cpu() { Some(peak_alloc::peak_since(base_live) as f64 / 1e6) } else { dev_peak };
    Ok((sample, peak))
}

/// cuProfilerStart (`on`) or cuProfilerStop: brackets one point for `--profile-point`.
fn profiler(device: &Device, on: bool) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(_) = device {
        // The runtime's entry points: the driver's stub library here lacks cuProfilerStart.
        extern "C" {
            fn cudaProfilerStart() -> i32;
            fn cudaProfilerStop() -> i32;
        }
        sync(device)?;
        // SAFETY: argument-free runtime calls on the current context (candle's, bound above).
        let status = unsafe {
            if on {
                cudaProfilerStart()
            } else {
                cudaProfilerStop()
            }
        };
        if status != 0 {
            bail!("cudaProfilerStart/Stop failed: {status}");
        }
        return Ok(());
    }
    let _ = (device, on);
    bail!("--profile-point needs --device cuda")
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = match args.device.as_str() {
        "cuda" if args.no_pool_cache => Device::new_cuda(0)?,
        d => cli::device(d)?,
    };
    let dtype = cli::dtype(&args.dtype)?;
    let causals: Vec<bool> = match args.causal.as_str() {
        "both" => vec![false, true],
        c => vec![c.parse()?],
    };
    let impls: Vec<String> = list(&args.implementation)?;
    let modes: Vec<String> = list(&args.mode)?;
    let mut rows = vec![];
    for &b_arg in &list::<usize>(&args.batch)? {
        for &h_arg in &list::<usize>(&args.heads)? {
            for &d in &list::<usize>(&args.hdim)? {
                for &nk in &list::<usize>(&args.seqlens)? {
                    for &causal in &causals {
                        let nq = args.nq.unwrap_or(nk);
                        let b = args.tokens.map(|t| (t / nk).max(1)).unwrap_or(b_arg);
                        let h = args.hidden.map(|hd| hd / d).unwrap_or(h_arg);
                        let hkv = args.hkv.unwrap_or(h);
                        let q = Tensor::randn(0f32, 1., (b, nq, h, d), &device)?.to_dtype(dtype)?;
                        let k = Tensor::randn(0f32, 1., (b, nk, hkv, d), &device)?.to_dtype(dtype)?;
                        let dv = args.dv.unwrap_or(d);
                        if args.v_view && dv > d {
                            bail!("--v-view needs dv <= d");
                        }
                        let v = if args.v_view {
                            k.narrow(3, 0, dv)?
                        } else {
                            Tensor::randn(0f32, 1., (b, nk, hkv, dv), &device)?.to_dtype(dtype)?
                        };
                        let paged = match args.page_size {
                            Some(page) => Some(paged_inputs(&q, (b, nq, nk, hkv, d, dv), page, args.v_view, &device)?),
                            None => None,
                        };
                        let dout = Tensor::randn(0f32, 1., (b, nq, h, dv), &device)?.to_dtype(dtype)?;
                        let plain_opts = FlashAttnOptions::new(1.0 / (d as f32).sqrt()).causal(causal);
                        let sinks = Tensor::full(0.5f32, h, &device)?;
                        let fwd_flops = 2.0 * (b * h * nq * nk * (d + dv)) as f64 * if causal { 0.5 } else { 1.0 };
                        for implementation in &impls {
                            let naive_gib = (b * h * nq * nk * 4) as f64 * 4.0 / (1u64 << 30) as f64;
                            if implementation == "naive" && naive_gib > args.naive_max_gib {
                                eprintln!("skipping naive at b={b} h={h} n={nk}: ~{naive_gib:.1} GiB of scores");
                                continue;
                            }
                            let opts = match implementation.as_str() {
                                "flash_sinks" => plain_opts.clone().sinks(Some(&sinks)),
                                _ => plain_opts.clone(),
                            };
                            for mode in &modes {
                                let flash = match implementation.as_str() {
                                    "flash" | "flash_sinks" => true,
                                    "naive" => false,
                                    i => bail!("unknown impl {i}"),
                                };
                                let attn =
                                    |q: &Tensor, k: &Tensor, v: &Tensor| -> candle_core::Result<(Tensor, Tensor)> {
                                        if flash {
                                            flash_attn_with_lse(q, k, v, &opts)
                                        } else {
                                            // No LSE: lets the reference use candle's fused softmax
                                            // when nothing is tracked (the plain candle path).
                                            let out = reference::attention(q, k, v, &opts)?;
                                            Ok((out.clone(), out))
                                        }
                                    };
                                if args.rest_ms > 0 {
                                    sync(&device)?;
                                    std::thread::sleep(std::time::Duration::from_millis(args.rest_ms));
                                }
                                let marks = Marks::default();
                                let point = format!("{mode}:{nk}:{causal}");
                                let profiled =
                                    args.profile_point.as_deref().is_some_and(|p| p.split(',').any(|p| p == point));
                                if profiled {
                                    profiler(&device, true)?;
                                }
                                let wall_start = unix_seconds();
                                let (sample, peak) = match mode.as_str() {
                                    "fwd" if flash && paged.is_some() => {
                                        let (pq, pk, pv, popts) = paged.as_ref().unwrap();
                                        let popts = popts.clone().causal(causal).sinks(opts.sinks.as_ref());
                                        time(&device, args.iters, &marks, || {
                                            flash_attn_with_lse(pq, pk, pv, &popts)?;
                                            Ok(())
                                        })?
                                    }
                                    _ if paged.is_some() => bail!("--page-size: flash impls, mode fwd"),
                                    "fwd" => time(&device, args.iters, &marks, || {
                                        attn(&q, &k, &v)?;
                                        Ok(())
                                    })?,
                                    "bwd" if flash => {
                                        let (out, lse) = attn(&q, &k, &v)?;
                                        time(&device, args.iters, &marks, || {
                                            flash_attn_grads(&q, &k, &v, &out, &dout, &lse, &opts)?;
                                            Ok(())
                                        })?
                                    }
                                    "bwd" => {
                                        // candle's autograd through the naive graph, built once.
                                        let (qv, kv, vv) =
                                            (Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?);
                                        let loss = (attn(&qv, &kv, &vv)?.0 * &dout)?.sum_all()?;
                                        time(&device, args.iters, &marks, || {
                                            loss.backward()?;
                                            Ok(())
                                        })?
                                    }
                                    "fwd_bwd" if flash => time(&device, args.iters, &marks, || {
                                        // Forward, then the backward with the output gradient
                                        // given directly (as torch.autograd.grad does).
                                        let (out, lse) = attn(&q, &k, &v)?;
                                        if args.split {
                                            marks.mark(&device)?;
                                        }
                                        flash_attn_grads(&q, &k, &v, &out, &dout, &lse, &opts)?;
                                        Ok(())
                                    })?,
                                    "fwd_bwd" => time(&device, args.iters, &marks, || {
                                        let (qv, kv, vv) =
                                            (Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?);
                                        let loss = (attn(&qv, &kv, &vv)?.0 * &dout)?.sum_all()?;
                                        loss.backward()?;
                                        Ok(())
                                    })?,
                                    m => bail!("unknown mode {m}"),
                                };
                                if profiled {
                                    profiler(&device, false)?;
                                }
                                if args.stamp {
                                    eprintln!(
                                        "point {implementation} {mode} {nk} {causal} {d} {wall_start:.3} {:.3}",
                                        unix_seconds()
                                    );
                                }
                                let ms = sample.ms;
                                let flops = fwd_flops
                                    * match mode.as_str() {
                                        "fwd" => 1.0,
                                        "bwd" => 2.5,
                                        _ => 3.5,
                                    };
                                let row = Row {
                                    implementation: implementation.clone(),
                                    mode: mode.clone(),
                                    causal,
                                    dims: (b, h, hkv, nq, nk, d),
                                    ms,
                                    tflops: flops / (ms * 1e-3) / 1e12,
                                    peak_mb: peak,
                                };
                                println!(
                                    "{}",
                                    serde_json::json!({
                                        "impl": row.implementation, "mode": row.mode, "causal": causal, "dtype": args.dtype,
                                        "b": b, "h": h, "hkv": hkv, "nq": nq, "nk": nk, "d": d,
                                        "ms": row.ms, "tflops": row.tflops, "peak_mb": row.peak_mb,
                                        // K and V read once: the memory floor of decode shapes.
                                        "dv": dv,
                                        "kv_tbps": (b * nk * hkv * (d + if args.v_view { 0 } else { dv }) * dtype.size_in_bytes()) as f64
                                            / (ms * 1e-3)
                                            / 1e12,
                                        "v_view": args.v_view, "page_size": args.page_size,
                                        "host_ms": sample.host_ms, "parts_ms": sample.parts_ms,
                                    })
                                );
                                rows.push(row);
                            }
                        }
                    }
                }
            }
        }
    }
    print_table(&rows);
    Ok(())
}

fn print_table(rows: &[Row]) {
    println!("\n| impl | mode | causal | b | h | hkv | nq | nk | d | ms | GFLOP/s | peak MB | vs naive |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let naive = rows
            .iter()
            .find(|o| o.implementation == "naive" && o.mode == r.mode && o.causal == r.causal && o.dims == r.dims);
        let speedup = match (r.implementation.as_str(), naive) {
            ("naive", _) | (_, None) => "".to_string(),
            (_, Some(n)) => format!("{:.2}x", n.ms / r.ms),
        };
        let (b, h, hkv, nq, nk, d) = r.dims;
        let peak = r.peak_mb.map(|p| format!("{p:.1}")).unwrap_or_else(|| "-".into());
        println!(
            "| {} | {} | {} | {b} | {h} | {hkv} | {nq} | {nk} | {d} | {:.2} | {:.1} | {peak} | {speedup} |",
            r.implementation,
            r.mode,
            r.causal,
            r.ms,
            r.tflops * 1e3
        );
    }
}

/// The paged form of a decode point: q as (B·Nq, H, D) with cumulative offsets, a cache of
/// B·⌈Nk / page⌉ pages whose table lists each sequence's pages in reverse order (no two
/// neighbours adjacent in memory), v a view of the key cache with `v_view`.
fn paged_inputs(
    q: &Tensor,
    (b, nq, nk, hkv, d, dv): (usize, usize, usize, usize, usize, usize),
    page: usize,
    v_view: bool,
    device: &Device,
) -> Result<(Tensor, Tensor, Tensor, FlashAttnOptions)> {
    let per_seq = nk.div_ceil(page);
    let pages = b * per_seq;
    let dtype = q.dtype();
    let k_cache = Tensor::randn(0f32, 1., (pages, page, hkv, d), device)?.to_dtype(dtype)?;
    let v_cache = if v_view {
        k_cache.narrow(3, 0, dv)?
    } else {
        Tensor::randn(0f32, 1., (pages, page, hkv, dv), device)?.to_dtype(dtype)?
    };
    let table: Vec<u32> = (0..pages).map(|i| (pages - 1 - i) as u32).collect();
    let table = Tensor::from_vec(table, (b, per_seq), device)?;
    let offsets = |n: usize| Tensor::from_vec((0..=b).map(|i| (i * n) as u32).collect::<Vec<_>>(), b + 1, device);
    let varlen = VarLen { seqlens_q: offsets(nq)?, seqlens_k: offsets(nk)?, max_seqlen_q: nq, max_seqlen_k: nk };
    let h = q.dim(2)?;
    let opts =
        FlashAttnOptions::new(1.0 / (d as f32).sqrt()).varlen(Some(varlen)).paged(Some(PagedKv::new(&table, page)));
    Ok((q.reshape((b * nq, h, d))?, k_cache, v_cache, opts))
}
