//! Shared test helpers: devices, seeded random inputs, and the parity checks against the
//! reference with tolerances relative to the naive same-dtype computation.
#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_flash::{reference, FlashAttnOptions, VarLen};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The CPU, plus the first CUDA GPU when built with `cuda` and one is present
/// (`CANDLE_FLASH_TEST_DEVICES=cuda`: the GPU alone, e.g. under compute-sanitizer).
pub fn devices() -> Vec<Device> {
    let cuda_only = std::env::var("CANDLE_FLASH_TEST_DEVICES").as_deref() == Ok("cuda");
    let mut devices = if cuda_only { vec![] } else { vec![Device::Cpu] };
    if let Some(gpu) = cuda_device() {
        devices.push(gpu);
    }
    devices
}

/// The first CUDA GPU, or None with the reason printed.
pub fn cuda_device() -> Option<Device> {
    if !cfg!(feature = "cuda") {
        println!("skipping CUDA: built without the `cuda` feature");
        return None;
    }
    match Device::new_cuda(0) {
        Ok(d) => {
            // NaN-fill every kernel output before launch so unwritten elements fail the checks
            // (not under compute-sanitizer's initcheck, which must see the unfilled outputs:
            // CANDLE_FLASH_NO_POISON=1).
            #[cfg(feature = "cuda")]
            candle_flash::cuda::set_poison_outputs(std::env::var("CANDLE_FLASH_NO_POISON").as_deref() != Ok("1"));
            Some(d)
        }
        Err(e) => {
            println!("skipping CUDA: no usable GPU ({e})");
            None
        }
    }
}

pub fn rng() -> (StdRng, u64) {
    let seed =
        std::env::var("CANDLE_FLASH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| rand::rng().random());
    (StdRng::seed_from_u64(seed), seed)
}

/// A random normal f32 tensor on the CPU (Box-Muller on the seeded generator).
pub fn randn(rng: &mut StdRng, dims: &[usize], std: f32) -> Result<Tensor> {
    let n: usize = dims.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|_| {
            let (u1, u2): (f32, f32) = (rng.random::<f32>().max(1e-7), rng.random());
            std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
        })
        .collect();
    Tensor::from_vec(data, dims, &Device::Cpu)
}

/// Largest |a - b| over all elements, +inf if `a` holds a NaN anywhere.
pub fn max_err(a: &Tensor, b: &Tensor) -> f64 {
    let values = |t: &Tensor| -> Vec<f64> {
        t.to_device(&Device::Cpu).unwrap().to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    };
    let (a, b) = (values(a), values(b));
    assert_eq!(a.len(), b.len());
    a.iter().zip(&b).fold(0.0, |m, (x, y)| {
        if x.is_nan() || y.is_nan() {
            f64::INFINITY
        } else if x == y {
            m // equal infinities count as agreement
        } else {
            m.max((x - y).abs())
        }
    })
}

/// The absolute error allowed on top of the relative rule, per dtype (covers the rounding of
/// the output itself and f32's summation-order noise).
pub fn floor(dtype: DType, grad: bool) -> f64 {
    let base = match dtype {
        DType::F32 => 2e-5,
        DType::F16 => 2e-4,
        _ => 2e-3,
    };
    if grad {
        base * 5.0
    } else {
        base
    }
}

/// One configuration of the parity matrix.
#[derive(Clone, Debug)]
pub struct Case {
    pub dtype: DType,
    pub batch: usize,
    pub sq: usize,
    pub sk: usize,
    pub h: usize,
    pub hkv: usize,
    pub d: usize,
    pub window: (Option<usize>, Option<usize>),
    pub softcap: Option<f32>,
    /// 0: none, 1: slopes [H], 2: slopes [B, H]
    pub alibi: u8,
    /// Per-sequence (q_len, k_len) for varlen; empty for the batched layout.
    pub varlen: Vec<(usize, usize)>,
    /// The backward's deterministic mode.
    pub deterministic: bool,
    /// q, k and v reach the flash op as views into rows one element longer (odd row strides, so
    /// not 16-byte aligned): f32 on CUDA then runs the SIMT kernels instead of tensor cores.
    pub odd_strides: bool,
    /// Learnable sinks, one per query head drawn uniformly from this range (a `Var`, so the
    /// gradient check covers dsinks too).
    pub sinks: Option<(f32, f32)>,
    /// v's head dim when it differs from q's and k's (MLA).
    pub dv: Option<usize>,
}

impl Case {
    pub fn new(dtype: DType, (sq, sk): (usize, usize), (h, hkv): (usize, usize), d: usize) -> Self {
        Self {
            dtype,
            batch: 2,
            sq,
            sk,
            h,
            hkv,
            d,
            window: (None, None),
            softcap: None,
            alibi: 0,
            varlen: vec![],
            deterministic: false,
            odd_strides: false,
            sinks: None,
            dv: None,
        }
    }
    pub fn dv(mut self, dv: usize) -> Self {
        self.dv = Some(dv);
        self
    }
    pub fn head_dim_v(&self) -> usize {
        self.dv.unwrap_or(self.d)
    }
    pub fn sinks(mut self, lo: f32, hi: f32) -> Self {
        self.sinks = Some((lo, hi));
        self
    }
    pub fn causal(mut self) -> Self {
        self.window = (None, Some(0));
        self
    }
    pub fn window(mut self, l: Option<usize>, r: Option<usize>) -> Self {
        self.window = (l, r);
        self
    }
    pub fn softcap(mut self, c: f32) -> Self {
        self.softcap = Some(c);
        self
    }
    pub fn alibi(mut self, kind: u8) -> Self {
        self.alibi = kind;
        self
    }
    pub fn deterministic(mut self) -> Self {
        self.deterministic = true;
        self
    }
    pub fn odd_strides(mut self) -> Self {
        self.odd_strides = true;
        self
    }
    pub fn varlen(mut self, seqs: &[(usize, usize)]) -> Self {
        self.varlen = seqs.to_vec();
        self.batch = seqs.len();
        self
    }
}

/// Inputs of one case, on the CPU in f32 (already rounded to the case's dtype), with options.
pub struct Inputs {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub dout: Tensor,
    pub alibi: Option<Tensor>,
    pub seqlens: Option<(Vec<u32>, Vec<u32>)>,
    /// f32 `[H]` sink logits.
    pub sinks: Option<Tensor>,
}

pub fn make_inputs(case: &Case, rng: &mut StdRng) -> Result<Inputs> {
    let (qd, kd): (Vec<usize>, Vec<usize>) = if case.varlen.is_empty() {
        (vec![case.batch, case.sq, case.h, case.d], vec![case.batch, case.sk, case.hkv, case.d])
    } else {
        let tq = case.varlen.iter().map(|s| s.0).sum();
        let tk = case.varlen.iter().map(|s| s.1).sum();
        (vec![tq, case.h, case.d], vec![tk, case.hkv, case.d])
    };
    // v and the output have v's head dim.
    let with_dv = |dims: &[usize]| -> Vec<usize> {
        let mut dims = dims.to_vec();
        *dims.last_mut().unwrap() = case.head_dim_v();
        dims
    };
    let round = |t: Tensor| t.to_dtype(case.dtype)?.to_dtype(DType::F32);
    let q = round(randn(rng, &qd, 1.0)?)?;
    let k = round(randn(rng, &kd, 1.0)?)?;
    let v = round(randn(rng, &with_dv(&kd), 1.0)?)?;
    let dout = round(randn(rng, &with_dv(&qd), 1.0)?)?;
    let mut slopes = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(0.05f32..0.5)).collect() };
    let alibi = match case.alibi {
        0 => None,
        1 => Some(Tensor::from_vec(slopes(case.h), case.h, &Device::Cpu)?),
        _ => Some(Tensor::from_vec(slopes(case.batch * case.h), (case.batch, case.h), &Device::Cpu)?),
    };
    let sinks = match case.sinks {
        Some((lo, hi)) => {
            let values: Vec<f32> = (0..case.h).map(|_| lo + (hi - lo) * rng.random::<f32>()).collect();
            Some(Tensor::from_vec(values, case.h, &Device::Cpu)?)
        }
        None => None,
    };
    let seqlens = (!case.varlen.is_empty()).then(|| {
        let cum = |f: fn(&(usize, usize)) -> usize| {
            std::iter::once(0u32)
                .chain(case.varlen.iter().scan(0u32, |acc, s| {
                    *acc += f(s) as u32;
                    Some(*acc)
                }))
                .collect::<Vec<u32>>()
        };
        (cum(|s| s.0), cum(|s| s.1))
    });
    Ok(Inputs { q, k, v, dout, alibi, seqlens, sinks })
}

pub fn options(case: &Case, inputs: &Inputs, device: &Device) -> Result<FlashAttnOptions> {
    let mut opts = FlashAttnOptions::new(1.0 / (case.d as f32).sqrt())
        .window(case.window.0, case.window.1)
        .softcap(case.softcap)
        .deterministic(case.deterministic);
    if let Some(a) = &inputs.alibi {
        opts = opts.alibi(Some(&a.to_device(device)?));
    }
    if let Some(s) = &inputs.sinks {
        opts = opts.sinks(Some(&s.to_device(device)?));
    }
    if let Some((sq, sk)) = &inputs.seqlens {
        opts = opts.varlen(Some(VarLen {
            seqlens_q: Tensor::new(sq.as_slice(), device)?,
            seqlens_k: Tensor::new(sk.as_slice(), device)?,
            max_seqlen_q: case.varlen.iter().map(|s| s.0).max().unwrap_or(0),
            max_seqlen_k: case.varlen.iter().map(|s| s.1).max().unwrap_or(0),
        }));
    }
    Ok(opts)
}

/// Output and (optionally) gradients of one implementation on one device, in `dtype`.
pub struct Run {
    pub out: Tensor,
    pub lse: Tensor,
    pub grads: Option<[Tensor; 3]>,
    /// The sinks' gradient (with sinks and gradients).
    pub dsinks: Option<Tensor>,
}

pub fn run(flash: bool, inputs: &Inputs, case: &Case, dtype: DType, device: &Device, with_grad: bool) -> Result<Run> {
    // The sinks as a Var (options() gives them as a plain tensor), so that dsinks is checked.
    let sinks = inputs.sinks.as_ref().map(|s| Var::from_tensor(&s.to_device(device)?)).transpose()?;
    let opts = options(case, inputs, device)?.sinks(sinks.as_ref().map(|s| s.as_tensor()));
    let to = |t: &Tensor| t.to_dtype(dtype)?.to_device(device);
    let (q, k, v) =
        (Var::from_tensor(&to(&inputs.q)?)?, Var::from_tensor(&to(&inputs.k)?)?, Var::from_tensor(&to(&inputs.v)?)?);
    let (out, lse) = if flash && case.odd_strides {
        // a zero column appended and narrowed away: same values, row stride d + 1
        let view = |x: &Var| -> Result<Tensor> {
            let last = x.rank() - 1;
            let mut dims = x.dims().to_vec();
            dims[last] = 1;
            Tensor::cat(&[x.as_tensor(), &Tensor::zeros(dims, dtype, device)?], last)?.narrow(last, 0, x.dim(last)?)
        };
        candle_flash::flash_attn_with_lse(&view(&q)?, &view(&k)?, &view(&v)?, &opts)?
    } else if flash {
        candle_flash::flash_attn_with_lse(&q, &k, &v, &opts)?
    } else {
        reference::attention_with_lse(&q, &k, &v, &opts)?
    };
    let (grads, dsinks) = if with_grad {
        let loss = (&out * to(&inputs.dout)?)?.sum_all()?;
        let g = loss.backward()?;
        let get = |x: &Var| g.get(x).cloned().unwrap_or_else(|| x.zeros_like().unwrap());
        (Some([get(&q), get(&k), get(&v)]), sinks.as_ref().map(get))
    } else {
        (None, None)
    };
    Ok(Run { out, lse, grads, dsinks })
}

/// Forward (and backward when `with_grad`) parity of the flash path on `device` against the
/// f64 reference, judged against the naive same-dtype error. Returns a one-line summary.
pub fn check_case(case: &Case, device: &Device, with_grad: bool) -> Result<String> {
    let (mut rng, seed) = rng();
    let inputs = make_inputs(case, &mut rng)?;
    let truth = run(false, &inputs, case, DType::F64, &Device::Cpu, with_grad)?;
    let naive = run(false, &inputs, case, case.dtype, &Device::Cpu, with_grad)?;
    let flash = run(true, &inputs, case, case.dtype, device, with_grad)?;
    let ctx = format!("{case:?} on {:?} (seed {seed})", device.location());

    assert_eq!(flash.out.dims(), truth.out.dims(), "{ctx}");
    assert_eq!(flash.out.dtype(), case.dtype, "{ctx}");
    let (ef, en) = (max_err(&flash.out, &truth.out), max_err(&naive.out, &truth.out));
    let tol = 2.0 * en + floor(case.dtype, false);
    assert!(ef <= tol, "forward error {ef:.3e} > {tol:.3e} (naive {en:.3e}): {ctx}");
    let el = max_err(&flash.lse, &truth.lse);
    assert!(el <= 1e-3 + 2.0 * max_err(&naive.lse, &truth.lse), "lse error {el:.3e}: {ctx}");
    let mut summary = format!("fwd {ef:.1e} (naive {en:.1e})");

    if with_grad {
        let (gf, gt, gn) = (flash.grads.unwrap(), truth.grads.unwrap(), naive.grads.unwrap());
        for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
            assert_eq!(gf[i].dims(), gt[i].dims(), "{name}: {ctx}");
            let (ef, en) = (max_err(&gf[i], &gt[i]), max_err(&gn[i], &gt[i]));
            let tol = 3.0 * en + floor(case.dtype, true);
            assert!(ef <= tol, "{name} error {ef:.3e} > {tol:.3e} (naive {en:.3e}): {ctx}");
            summary += &format!(", {name} {ef:.1e} (naive {en:.1e})");
        }
        if let (Some(df), Some(dt), Some(dn)) = (&flash.dsinks, &truth.dsinks, &naive.dsinks) {
            assert_eq!(df.dims(), dt.dims(), "dsinks: {ctx}");
            let (ef, en) = (max_err(df, dt), max_err(dn, dt));
            // dsinks sums a row term over every row of a head: scale the floor by the rows.
            let rows = (flash.lse.elem_count() / case.h).max(1) as f64;
            let tol = 3.0 * en + floor(case.dtype, true) * rows.sqrt();
            assert!(ef <= tol, "dsinks error {ef:.3e} > {tol:.3e} (naive {en:.3e}): {ctx}");
            summary += &format!(", dsinks {ef:.1e} (naive {en:.1e})");
        }
    }
    if device.is_cuda() {
        // CPU and CUDA flash agree on the same inputs.
        let cpu = run(true, &inputs, case, case.dtype, &Device::Cpu, false)?;
        let e = max_err(&flash.out, &cpu.out);
        assert!(e <= 2.0 * en + floor(case.dtype, false), "cpu vs cuda {e:.3e}: {ctx}");
    }
    Ok(summary)
}
