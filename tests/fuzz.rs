//! Seeded randomized testing: random shapes, strided views (`narrow` of packed QKV,
//! `transpose` of a (B, H, S, D) layout), dtypes, every option, varlen batches with empty
//! sequences and GQA ratios, forward and backward, on every device present, each result judged
//! against the f64 reference with the parity rule (error within 2x (forward) / 3x (gradients)
//! of the naive same-dtype computation, plus a floor; NaN never passes). On CUDA the flash result
//! is also compared with the CPU flash path.
//!
//! `CANDLE_FLASH_FUZZ_CASES` sets the number of cases per device (default 24: a few seconds in
//! `cargo test`), `CANDLE_FLASH_FUZZ_SECONDS` a time budget per device instead (the device script
//! gives it minutes); `CANDLE_FLASH_SEED` replays a run. A failure prints the seed and the case.

mod common;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_flash::{reference, FlashAttnOptions, VarLen};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// How q, k and v are laid out in memory (the head dim always contiguous).
#[derive(Clone, Copy, Debug)]
enum Layout {
    Contiguous,
    /// Stored as (B, H, S, D), passed as its (B, S, H, D) transpose.
    HeadsFirst,
    /// q, k and v are column slices (`narrow` on the head axis) of one packed QKV tensor.
    PackedQkv,
}

#[derive(Clone, Debug)]
struct FuzzCase {
    dtype: DType,
    layout: Layout,
    batch: usize,
    sq: usize,
    sk: usize,
    h: usize,
    hkv: usize,
    d: usize,
    window: (Option<usize>, Option<usize>),
    softcap: Option<f32>,
    alibi: bool,
    /// Per-sequence (q_len, k_len); empty: batched.
    varlen: Vec<(usize, usize)>,
    with_grad: bool,
    deterministic: bool,
}

fn pick<T: Copy>(rng: &mut StdRng, xs: &[T]) -> T {
    xs[rng.random_range(0..xs.len())]
}

fn random_case(rng: &mut StdRng, cuda: bool) -> FuzzCase {
    let dtype = pick(rng, &[DType::F32, DType::F16, DType::BF16]);
    // CUDA needs d % 8 == 0; the CPU takes any d.
    let d =
        if cuda { pick(rng, &[8, 32, 40, 64, 72, 96, 128, 160, 256]) } else { pick(rng, &[1, 7, 16, 40, 64, 96, 128]) };
    let hkv = pick(rng, &[1, 2]);
    let h = hkv * pick(rng, &[1, 2, 4]);
    let len =
        |rng: &mut StdRng| if rng.random_bool(0.15) { pick(rng, &[113, 200, 257]) } else { rng.random_range(1..48) };
    let varlen: Vec<(usize, usize)> = if rng.random_bool(0.3) {
        (0..rng.random_range(1..4))
            .map(|_| {
                // empty query or key sequences now and then
                let q = if rng.random_bool(0.15) { 0 } else { len(rng) };
                let k = if rng.random_bool(0.15) { 0 } else { len(rng) };
                (q, k)
            })
            .collect()
    } else {
        vec![]
    };
    let window_side = |rng: &mut StdRng| if rng.random_bool(0.5) { None } else { Some(rng.random_range(0..40)) };
    let window = match rng.random_range(0..4) {
        0 => (None, None),
        1 => (None, Some(0)), // causal
        _ => (window_side(rng), window_side(rng)),
    };
    FuzzCase {
        dtype,
        // the varlen layout is (total, H, D): only contiguous or packed there
        layout: if varlen.is_empty() {
            pick(rng, &[Layout::Contiguous, Layout::HeadsFirst, Layout::PackedQkv])
        } else {
            pick(rng, &[Layout::Contiguous, Layout::PackedQkv])
        },
        batch: if varlen.is_empty() { rng.random_range(1..4) } else { varlen.len() },
        sq: len(rng),
        sk: len(rng),
        h,
        hkv,
        d,
        window,
        softcap: rng.random_bool(0.25).then(|| rng.random_range(5.0f32..50.0)),
        alibi: rng.random_bool(0.2),
        varlen,
        with_grad: rng.random_bool(0.6),
        deterministic: rng.random_bool(0.3),
    }
}

/// q, k, v in the case's dtype on `device`, laid out as the case says (views into the stored
/// tensors, so the flash path sees the strides), and the output gradient (contiguous).
fn inputs(c: &FuzzCase, rng: &mut StdRng, device: &Device) -> Result<[Tensor; 4]> {
    let round = |t: Tensor| -> Result<Tensor> {
        if t.elem_count() == 0 && device.is_cuda() {
            // candle cannot allocate an empty CUDA buffer (cudarc asks the driver for 0 bytes):
            // an empty tensor there is a view of zero rows of a non-empty one, as a narrow gives.
            let one: Vec<usize> = t.dims().iter().map(|&n| n.max(1)).collect();
            let mut view = Tensor::zeros(one, c.dtype, device)?;
            for (axis, &n) in t.dims().iter().enumerate() {
                view = view.narrow(axis, 0, n)?;
            }
            return Ok(view);
        }
        t.to_dtype(c.dtype)?.to_device(device)
    };
    let (tq, tk): (usize, usize) = if c.varlen.is_empty() {
        (c.sq, c.sk)
    } else {
        (c.varlen.iter().map(|s| s.0).sum(), c.varlen.iter().map(|s| s.1).sum())
    };
    let lead = |rows: usize| if c.varlen.is_empty() { vec![c.batch, rows] } else { vec![rows] };
    let dims = |rows: usize, heads: usize| [lead(rows), vec![heads, c.d]].concat();
    let [q, k, v] = match c.layout {
        Layout::Contiguous => [
            round(common::randn(rng, &dims(tq, c.h), 1.0)?)?,
            round(common::randn(rng, &dims(tk, c.hkv), 1.0)?)?,
            round(common::randn(rng, &dims(tk, c.hkv), 1.0)?)?,
        ],
        Layout::HeadsFirst => {
            let heads_first = |rng: &mut StdRng, s: usize, h: usize| {
                round(common::randn(rng, &[c.batch, h, s, c.d], 1.0)?)?.transpose(1, 2)
            };
            [heads_first(rng, tq, c.h)?, heads_first(rng, tk, c.hkv)?, heads_first(rng, tk, c.hkv)?]
        }
        Layout::PackedQkv => {
            // q, k and v as head slices of one tensor: only when they have the same rows.
            let rows = tq.max(tk);
            let packed = round(common::randn(rng, &dims(rows, c.h + 2 * c.hkv), 1.0)?)?;
            let axis = packed.rank() - 2;
            let row_axis = axis - 1;
            [
                packed.narrow(axis, 0, c.h)?.narrow(row_axis, 0, tq)?,
                packed.narrow(axis, c.h, c.hkv)?.narrow(row_axis, 0, tk)?,
                packed.narrow(axis, c.h + c.hkv, c.hkv)?.narrow(row_axis, 0, tk)?,
            ]
        }
    };
    let dout = round(common::randn(rng, q.dims(), 1.0)?)?;
    Ok([q, k, v, dout])
}

fn options(c: &FuzzCase, rng: &mut StdRng, device: &Device) -> Result<FlashAttnOptions> {
    let mut opts = FlashAttnOptions::new(1.0 / (c.d as f32).sqrt())
        .window(c.window.0, c.window.1)
        .softcap(c.softcap)
        .deterministic(c.deterministic);
    if c.alibi {
        let slopes: Vec<f32> = (0..c.h).map(|_| rng.random_range(0.05f32..0.5)).collect();
        opts = opts.alibi(Some(&Tensor::from_vec(slopes, c.h, device)?));
    }
    if !c.varlen.is_empty() {
        let cum = |f: fn(&(usize, usize)) -> usize| -> Vec<u32> {
            std::iter::once(0)
                .chain(c.varlen.iter().scan(0u32, |a, s| Some(*a + f(s) as u32).inspect(|x| *a = *x)))
                .collect()
        };
        opts = opts.varlen(Some(VarLen {
            seqlens_q: Tensor::new(cum(|s| s.0).as_slice(), device)?,
            seqlens_k: Tensor::new(cum(|s| s.1).as_slice(), device)?,
            max_seqlen_q: c.varlen.iter().map(|s| s.0).max().unwrap_or(0),
            max_seqlen_k: c.varlen.iter().map(|s| s.1).max().unwrap_or(0),
        }));
    }
    Ok(opts)
}

struct Outcome {
    out: Tensor,
    grads: Option<[Tensor; 3]>,
}

/// One implementation on one device in `dtype`. Inputs already in that dtype on that device are
/// used as they are (strided views: the flash path's own addressing); others are converted.
fn evaluate(
    flash: bool,
    x: &[Tensor; 4],
    opts: &FlashAttnOptions,
    dtype: DType,
    device: &Device,
    with_grad: bool,
) -> Result<Outcome> {
    let prepare = |t: &Tensor| -> Result<Tensor> {
        if t.dtype() == dtype && t.device().same_device(device) {
            Ok(t.clone())
        } else {
            // Move first, then convert there: an empty CUDA tensor is a view of a non-empty
            // buffer, which moves, while a conversion on CUDA would ask for a 0-byte buffer.
            t.to_device(device)?.to_dtype(dtype)
        }
    };
    let [q, k, v] = [&x[0], &x[1], &x[2]].map(|t| prepare(t).and_then(|t| Var::from_tensor(&t)));
    let (q, k, v) = (q?, k?, v?);
    let out = if flash {
        candle_flash::flash_attn_with_lse(&q, &k, &v, opts)?.0
    } else {
        reference::attention_with_lse(&q.contiguous()?, &k.contiguous()?, &v.contiguous()?, opts)?.0
    };
    let grads = if with_grad {
        let g = (&out * prepare(&x[3])?)?.sum_all()?.backward()?;
        let get = |t: &Var| g.get(t).cloned().map_or_else(|| t.zeros_like(), Ok);
        Some([get(&q)?, get(&k)?, get(&v)?])
    } else {
        None
    };
    Ok(Outcome { out, grads })
}

fn check(c: &FuzzCase, device: &Device, rng: &mut StdRng, ctx: &str) -> Result<()> {
    let x = inputs(c, rng, device)?;
    let opts = options(c, rng, device)?;
    // The reference runs on the CPU: the same option values there.
    let mut cpu_opts = opts.clone();
    cpu_opts.alibi_slopes = cpu_opts.alibi_slopes.map(|t| t.to_device(&Device::Cpu)).transpose()?;
    if let Some(vl) = cpu_opts.varlen.as_mut() {
        vl.seqlens_q = vl.seqlens_q.to_device(&Device::Cpu)?;
        vl.seqlens_k = vl.seqlens_k.to_device(&Device::Cpu)?;
    }
    let truth = evaluate(false, &x, &cpu_opts, DType::F64, &Device::Cpu, c.with_grad)?;
    let naive = evaluate(false, &x, &cpu_opts, c.dtype, &Device::Cpu, c.with_grad)?;
    let flash = evaluate(true, &x, &opts, c.dtype, device, c.with_grad)?;
    let (ef, en) = (common::max_err(&flash.out, &truth.out), common::max_err(&naive.out, &truth.out));
    let tol = 2.0 * en + common::floor(c.dtype, false);
    assert!(ef <= tol, "forward error {ef:.3e} > {tol:.3e} (naive {en:.3e}): {ctx}");
    if let (Some(gf), Some(gt), Some(gn)) = (flash.grads, truth.grads, naive.grads) {
        for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
            let (ef, en) = (common::max_err(&gf[i], &gt[i]), common::max_err(&gn[i], &gt[i]));
            let tol = 3.0 * en + common::floor(c.dtype, true);
            assert!(ef <= tol, "{name} error {ef:.3e} > {tol:.3e} (naive {en:.3e}): {ctx}");
        }
    }
    if device.is_cuda() {
        let cpu = evaluate(true, &x, &cpu_opts, c.dtype, &Device::Cpu, false)?;
        let e = common::max_err(&flash.out, &cpu.out);
        assert!(e <= 2.0 * en + common::floor(c.dtype, false), "cpu vs cuda {e:.3e}: {ctx}");
    }
    Ok(())
}

#[test]
fn fuzz_against_the_reference() {
    let env = |name: &str| std::env::var(name).ok().and_then(|s| s.parse::<u64>().ok());
    // A case count, or (for the device script) a time budget per device: cases run until it is
    // spent, at least one.
    let seconds = env("CANDLE_FLASH_FUZZ_SECONDS");
    let cases = env("CANDLE_FLASH_FUZZ_CASES").unwrap_or(if seconds.is_some() { u64::MAX } else { 24 });
    let (_, seed) = common::rng();
    println!("fuzz seed {seed} (replay with CANDLE_FLASH_SEED={seed}), {cases} cases / {seconds:?} s per device");
    for device in common::devices() {
        let mut rng = StdRng::seed_from_u64(seed);
        let start = std::time::Instant::now();
        let mut done = 0;
        while done < cases && seconds.is_none_or(|s| done == 0 || start.elapsed().as_secs() < s) {
            let c = random_case(&mut rng, device.is_cuda());
            let ctx = format!("case {done} {c:?} on {:?} (CANDLE_FLASH_SEED={seed})", device.location());
            check(&c, &device, &mut rng, &ctx).unwrap_or_else(|e| panic!("{e}: {ctx}"));
            done += 1;
        }
        println!(
            "fuzz: {done} cases passed on {:?} in {:.0} s (seed {seed})",
            device.location(),
            start.elapsed().as_secs_f64()
        );
    }
}
