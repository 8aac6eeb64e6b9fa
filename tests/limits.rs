//! Attention at the limits: batch x heads far beyond one grid dimension (every device), and on
//! CUDA a tensor of more than 2^31 elements, a million-token sequence (forward and backward,
//! with the pool's peak memory printed) and an out-of-memory failure inside the op that must
//! come back as an error and leave the device usable.
//!
//! The three CUDA tests need tens of GB of GPU memory and the whole GPU to themselves: they run
//! only with `CANDLE_FLASH_BIG_TESTS=1` (`scripts/gpu-run.sh` sets it and runs this binary with
//! one test thread); otherwise they print why they skip.

mod common;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_flash::{flash_attn_backward, flash_attn_with_lse, reference, FlashAttnOptions};
use std::sync::Mutex;
use std::time::Instant;

/// The big tests each want the GPU's memory to themselves.
static GPU: Mutex<()> = Mutex::new(());

#[test]
fn batch_times_heads_far_above_a_grid_dimension() {
    // 4096 sequences x 32 heads = 131072 (batch, head) pairs: twice the 65535 of a grid's y / z
    // dimension, which the kernels never put the product in. Short sequences, GQA 32 / 8. The
    // reference loops over sequences, so it runs on the same problem folded into one sequence
    // of 4096 * 32 heads (query head b*32 + h then reads KV head b*8 + h/4, as it should), on
    // the GPU too (the CPU takes minutes over it). A CUDA limit: the CPU has no grid.
    let (b, sq, sk, h, hkv) = (4096, 5, 9, 32, 8);
    let (mut rng, seed) = common::rng();
    if let Some(device) = common::cuda_device() {
        for (dtype, d) in [(DType::BF16, 64), (DType::F16, 128), (DType::F32, 32)] {
            let x = |rng: &mut _, s, heads| common::randn(rng, &[b, s, heads, d], 1.0)?.to_dtype(dtype);
            let (q, k, v, dout) = (x(&mut rng, sq, h), x(&mut rng, sk, hkv), x(&mut rng, sk, hkv), x(&mut rng, sq, h));
            let (q, k, v, dout) = (q.unwrap(), k.unwrap(), v.unwrap(), dout.unwrap());
            let opts = FlashAttnOptions::new(1.0 / (d as f32).sqrt()).causal(true);
            let on = |t: &Tensor| t.to_device(&device).unwrap();
            let ours = evaluate(true, [&on(&q), &on(&k), &on(&v)], &on(&dout), &opts, dtype).unwrap();
            let fold = |t: &Tensor| {
                let (b, s, heads, d) = t.dims4().unwrap();
                t.transpose(0, 1).unwrap().contiguous().unwrap().reshape((1, s, b * heads, d)).unwrap()
            };
            let unfold = |t: &Tensor, s: usize, heads: usize| {
                t.reshape((s, b, heads, d)).unwrap().transpose(0, 1).unwrap().contiguous().unwrap()
            };
            let folded = [&on(&fold(&q)), &on(&fold(&k)), &on(&fold(&v))];
            let [truth, naive] = [DType::F64, dtype].map(|t| {
                let (out, lse, g) = evaluate(false, folded, &on(&fold(&dout)), &opts, t).unwrap();
                let [dq, dk, dv] = g;
                (
                    unfold(&out, sq, h),
                    lse.reshape((b, h, sq)).unwrap(),
                    [unfold(&dq, sq, h), unfold(&dk, sk, hkv), unfold(&dv, sk, hkv)],
                )
            });
            let ctx = format!("{dtype:?} d={d} on {:?} (seed {seed})", device.location());
            let (eo, en) = (common::max_err(&ours.0, &truth.0), common::max_err(&naive.0, &truth.0));
            assert!(eo <= 2.0 * en + common::floor(dtype, false), "out error {eo:.3e} (naive {en:.3e}): {ctx}");
            let el = common::max_err(&ours.1, &truth.1);
            assert!(el <= 1e-3 + 2.0 * common::max_err(&naive.1, &truth.1), "lse error {el:.3e}: {ctx}");
            for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
                let (e, en) = (common::max_err(&ours.2[i], &truth.2[i]), common::max_err(&naive.2[i], &truth.2[i]));
                assert!(e <= 3.0 * en + common::floor(dtype, true), "{name} error {e:.3e} (naive {en:.3e}): {ctx}");
            }
            println!("B=4096 H=32: {ctx}: out {eo:.1e} (naive {en:.1e}), lse {el:.1e}");
        }
    }
}

/// The CUDA device when the big tests are asked for, else None with the reason printed.
fn big_gpu() -> Option<Device> {
    if std::env::var("CANDLE_FLASH_BIG_TESTS").as_deref() != Ok("1") {
        println!("skipping: set CANDLE_FLASH_BIG_TESTS=1 to run (needs a GPU with ~70 GB free, to itself)");
        return None;
    }
    common::cuda_device()
}

/// Peak bytes in use in the device's default memory pool, from which candle allocates every
/// tensor (stream-ordered `cuMemAllocAsync`): reset, then read after the work.
#[cfg(feature = "cuda")]
mod pool {
    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::Device;

    fn default_pool(device: &Device) -> sys::CUmemoryPool {
        let cu_device = device.as_cuda_device().unwrap().cuda_stream().context().cu_device();
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: a driver query on a valid device handle into a local.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, cu_device).result().unwrap() };
        pool
    }

    pub fn reset_peak(device: &Device) {
        device.synchronize().unwrap();
        let mut zero = 0u64;
        // SAFETY: the attribute takes a u64 (only 0 is allowed for the high watermark).
        unsafe {
            sys::cuMemPoolSetAttribute(
                default_pool(device),
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                &mut zero as *mut u64 as *mut std::ffi::c_void,
            )
            .result()
            .unwrap()
        };
    }

    pub fn peak_gib(device: &Device) -> f64 {
        device.synchronize().unwrap();
        let mut high = 0u64;
        // SAFETY: the attribute is a u64 written into a local.
        unsafe {
            sys::cuMemPoolGetAttribute(
                default_pool(device),
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                &mut high as *mut u64 as *mut std::ffi::c_void,
            )
            .result()
            .unwrap()
        };
        high as f64 / (1u64 << 30) as f64
    }
}
#[cfg(not(feature = "cuda"))]
mod pool {
    pub fn reset_peak(_: &candle_core::Device) {}
    pub fn peak_gib(_: &candle_core::Device) -> f64 {
        0.0
    }
}

/// A random normal bf16 tensor made on the device in slabs along dim 0 (no full-size f32 copy).
fn randn_bf16(dims: &[usize], device: &Device) -> Result<Tensor> {
    let slabs = dims[0].min(8);
    let mut parts = Vec::with_capacity(slabs);
    for s in 0..slabs {
        let mut d = dims.to_vec();
        d[0] = dims[0] * (s + 1) / slabs - dims[0] * s / slabs;
        parts.push(Tensor::randn(0f32, 1.0, d, device)?.to_dtype(DType::BF16)?);
    }
    Tensor::cat(&parts, 0)
}

/// max |a - b| computed on the device (f32), +inf when `a` holds a NaN.
fn max_err_dev(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F32).unwrap();
    let b = b.to_dtype(DType::F32).unwrap();
    let nans = a.ne(&a).unwrap().to_dtype(DType::F32).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
    if nans > 0.0 {
        return f64::INFINITY;
    }
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap() as f64
}

/// Output, lse and gradients (for the loss sum(out * dout)) of flash or the reference, in
/// `dtype`, on the inputs' device.
fn evaluate(
    flash: bool,
    [q, k, v]: [&Tensor; 3],
    dout: &Tensor,
    opts: &FlashAttnOptions,
    dtype: DType,
) -> Result<(Tensor, Tensor, [Tensor; 3])> {
    let var = |t: &Tensor| Var::from_tensor(&t.to_dtype(dtype)?);
    let (q, k, v) = (var(q)?, var(k)?, var(v)?);
    let (out, lse) =
        if flash { flash_attn_with_lse(&q, &k, &v, opts)? } else { reference::attention_with_lse(&q, &k, &v, opts)? };
    let g = (&out * dout.to_dtype(dtype)?)?.sum_all()?.backward()?;
    let grads = [&q, &k, &v].map(|x| g.get(x).unwrap().clone());
    Ok((out, lse, grads))
}

#[test]
fn tensors_above_2_pow_31_elements() {
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dev) = big_gpu() else { return };
    // (1536, 1024, 16, 128) bf16: 3 * 2^30 elements (6 GiB) per tensor, so every element offset
    // past 2^31 (the last ~third of each tensor) needs 64-bit arithmetic in the kernels.
    let dims = [1536, 1024, 16, 128];
    let n: usize = dims.iter().product();
    assert_eq!(n, 3 << 30);
    let opts = FlashAttnOptions::new(1.0 / (128f32).sqrt()).causal(true);
    pool::reset_peak(&dev);
    let q = randn_bf16(&dims, &dev).unwrap();
    let k = randn_bf16(&dims, &dev).unwrap();
    let v = randn_bf16(&dims, &dev).unwrap();
    let t0 = Instant::now();
    let (out, lse) = flash_attn_with_lse(&q, &k, &v, &opts).unwrap();
    dev.synchronize().unwrap();
    let t_fwd = t0.elapsed();
    let dout = randn_bf16(&dims, &dev).unwrap();
    let t0 = Instant::now();
    let (dq, dk, dv) = flash_attn_backward(&q, &k, &v, &out, &dout, &lse, &opts).unwrap();
    dev.synchronize().unwrap();
    let t_bwd = t0.elapsed();
    println!(
        "B=1536 S=1024 H=16 D=128 bf16 causal ({n} elements per tensor): fwd {:.1} ms, bwd {:.1} ms, pool peak {:.1} GiB",
        t_fwd.as_secs_f64() * 1e3,
        t_bwd.as_secs_f64() * 1e3,
        pool::peak_gib(&dev)
    );
    // Heads are independent (no GQA) and so are sequences: slices of the result must be the
    // reference on the same slices. The first and last sequence, first and last head.
    for (b, h) in [(0, 0), (1535, 15), (1535, 0), (1024, 7)] {
        let cut = |t: &Tensor| t.narrow(0, b, 1).unwrap().narrow(2, h, 1).unwrap().to_device(&Device::Cpu).unwrap();
        let [qs, ks, vs, gs] = [&q, &k, &v, &dout].map(cut);
        let (to, tl, tg) = evaluate(false, [&qs, &ks, &vs], &gs, &opts, DType::F64).unwrap();
        let (no, nl, ng) = evaluate(false, [&qs, &ks, &vs], &gs, &opts, DType::BF16).unwrap();
        let eo = common::max_err(&cut(&out), &to);
        let tol = 2.0 * common::max_err(&no, &to) + common::floor(DType::BF16, false);
        assert!(eo <= tol, "out error {eo:.3e} > {tol:.3e} at b={b} h={h}");
        let el = common::max_err(&lse.narrow(0, b, 1).unwrap().narrow(1, h, 1).unwrap(), &tl);
        assert!(el <= 1e-3 + 2.0 * common::max_err(&nl, &tl), "lse error {el:.3e} at b={b} h={h}");
        for (i, (name, g)) in [("dq", &dq), ("dk", &dk), ("dv", &dv)].into_iter().enumerate() {
            let e = common::max_err(&cut(g), &tg[i]);
            let tol = 3.0 * common::max_err(&ng[i], &tg[i]) + common::floor(DType::BF16, true);
            assert!(e <= tol, "{name} error {e:.3e} > {tol:.3e} at b={b} h={h}");
        }
        println!("  b={b} h={h}: out {eo:.2e}, lse {el:.2e}: within the parity rule");
    }
}

#[test]
fn a_million_tokens_forward_and_backward() {
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dev) = big_gpu() else { return };
    let (s, h, d) = (1usize << 20, 8, 128);
    let opts = FlashAttnOptions::new(1.0 / (d as f32).sqrt()).causal(true);
    pool::reset_peak(&dev);
    let q = randn_bf16(&[1, s, h, d], &dev).unwrap();
    let k = randn_bf16(&[1, s, h, d], &dev).unwrap();
    let v = randn_bf16(&[1, s, h, d], &dev).unwrap();
    // dO is zero except on a few rows, so the exact gradients are sums over those rows alone
    // and can be checked in full (every dk, dv row; dq is exactly 0 elsewhere), while the
    // kernels still do the whole causal backward.
    // Gradients are checked through dO rows in the first 2^16 keys (the reference with autograd
    // over a row's keys runs on the CPU: minutes for 10^6 keys); the outputs of two rows at the
    // end are checked forward-only on the GPU below.
    let rows = [0usize, 1, 4097, 65_535];
    let late_rows = [777_777usize, s - 1];
    let mut dout = Tensor::zeros((1, s, h, d), DType::BF16, &dev).unwrap();
    for &r in &rows {
        dout = dout.slice_assign(&[0..1, r..r + 1, 0..h, 0..d], &randn_bf16(&[1, 1, h, d], &dev).unwrap()).unwrap();
    }
    let t0 = Instant::now();
    let (out, lse) = flash_attn_with_lse(&q, &k, &v, &opts).unwrap();
    dev.synchronize().unwrap();
    let t_fwd = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let (dq, dk, dv) = flash_attn_backward(&q, &k, &v, &out, &dout, &lse, &opts).unwrap();
    dev.synchronize().unwrap();
    let t_bwd = t0.elapsed().as_secs_f64();
    let peak = pool::peak_gib(&dev);
    let flops = 4.0 * (h * d) as f64 * (s as f64) * (s as f64) / 2.0;
    println!(
        "S=2^20 H=8 D=128 bf16 causal: fwd {t_fwd:.2} s ({:.0} TFLOP/s), bwd {t_bwd:.2} s ({:.0} TFLOP/s), pool peak {peak:.1} GiB",
        flops / t_fwd / 1e12,
        2.5 * flops / t_bwd / 1e12
    );

    // Row r of a causal attention is the plain attention of that query over keys 0..=r. Truth
    // in f32 (its error is far below bf16's), the naive bf16 computation for the tolerance,
    // both on the CPU: the reference of one row over 10^6 keys keeps tens of GB of f32 and
    // autograd buffers, more than the GPU has left beside the flash tensors.
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
    let small = |t: &Tensor, r: usize| cpu(&t.narrow(1, r, 1).unwrap());
    let (out_rows, dq_rows, dout_rows): (Vec<_>, Vec<_>, Vec<_>) =
        rows.iter().map(|&r| (small(&out, r), small(&dq, r), small(&dout, r))).collect();
    let plain = FlashAttnOptions::new(opts.softmax_scale);
    for r in late_rows {
        // Forward only, no autograd buffers: f32 truth and the naive bf16 on the GPU.
        let keys = |t: &Tensor| t.narrow(1, 0, r + 1).unwrap();
        let run = |dtype| {
            let x = |t: &Tensor| t.to_dtype(dtype).unwrap();
            reference::attention_with_lse(&x(&q.narrow(1, r, 1).unwrap()), &x(&keys(&k)), &x(&keys(&v)), &plain)
                .unwrap()
        };
        let ((to, tl), (no, nl)) = (run(DType::F32), run(DType::BF16));
        let eo = max_err_dev(&out.narrow(1, r, 1).unwrap(), &to);
        let tol = 2.0 * max_err_dev(&no, &to) + common::floor(DType::BF16, false);
        assert!(eo <= tol, "out row {r}: error {eo:.3e} > {tol:.3e}");
        let el = max_err_dev(&lse.narrow(2, r, 1).unwrap(), &tl);
        assert!(el <= 1e-3 + 2.0 * max_err_dev(&nl, &tl), "lse row {r}: error {el:.3e}");
        println!("  row {r} (forward): out {eo:.2e} (tol {tol:.2e}), lse {el:.2e}");
    }
    // dq is exactly 0 on the rows whose dO is 0 (dS = P (dP - D) with dP = 0, D = 0).
    let mut dq_elsewhere = dq.clone();
    for &r in &rows {
        dq_elsewhere = dq_elsewhere
            .slice_assign(&[0..1, r..r + 1, 0..h, 0..d], &Tensor::zeros((1, 1, h, d), DType::BF16, &dev).unwrap())
            .unwrap();
    }
    assert_eq!(max_err_dev(&dq_elsewhere, &dq_elsewhere.zeros_like().unwrap()), 0.0, "dq nonzero outside the dO rows");
    drop((out, dq, dout, dq_elsewhere));
    // dk, dv: the sums over the rows of each row's gradients; their tolerance sums the naive
    // rows' errors (a bound on the naive sum's error).
    let (mut t_dk, mut t_dv) = (
        Tensor::zeros((1, s, h, d), DType::F32, &Device::Cpu).unwrap(),
        Tensor::zeros((1, s, h, d), DType::F32, &Device::Cpu).unwrap(),
    );
    let (mut naive_dk, mut naive_dv) = (0.0, 0.0);
    for (i, &r) in rows.iter().enumerate() {
        let keys = |t: &Tensor| cpu(&t.narrow(1, 0, r + 1).unwrap());
        let inputs = [&small(&q, r), &keys(&k), &keys(&v)];
        let (to, tl, tg) = evaluate(false, inputs, &dout_rows[i], &plain, DType::F32).unwrap();
        let (no, nl, ng) = evaluate(false, inputs, &dout_rows[i], &plain, DType::BF16).unwrap();
        let eo = max_err_dev(&out_rows[i], &to);
        let tol = 2.0 * max_err_dev(&no, &to) + common::floor(DType::BF16, false);
        assert!(eo <= tol, "out row {r}: error {eo:.3e} > {tol:.3e}");
        let el = max_err_dev(&cpu(&lse.narrow(2, r, 1).unwrap()), &tl);
        assert!(el <= 1e-3 + 2.0 * max_err_dev(&nl, &tl), "lse row {r}: error {el:.3e}");
        let eq = max_err_dev(&dq_rows[i], &tg[0]);
        let tol_q = 3.0 * max_err_dev(&ng[0], &tg[0]) + common::floor(DType::BF16, true);
        assert!(eq <= tol_q, "dq row {r}: error {eq:.3e} > {tol_q:.3e}");
        naive_dk += max_err_dev(&ng[1], &tg[1]);
        naive_dv += max_err_dev(&ng[2], &tg[2]);
        drop((no, ng));
        let add_keys = |acc: &Tensor, g: &Tensor| {
            let cur = acc.narrow(1, 0, r + 1).unwrap();
            acc.slice_assign(&[0..1, 0..r + 1, 0..h, 0..d], &(cur + g).unwrap()).unwrap()
        };
        (t_dk, t_dv) = (add_keys(&t_dk, &tg[1]), add_keys(&t_dv, &tg[2]));
        println!("  row {r}: out {eo:.2e} (tol {tol:.2e}), lse {el:.2e}, dq {eq:.2e} (tol {tol_q:.2e})");
    }
    for (name, ours, truth, naive) in [("dk", &dk, &t_dk, naive_dk), ("dv", &dv, &t_dv, naive_dv)] {
        let e = max_err_dev(&cpu(ours), truth);
        let tol = 3.0 * naive + common::floor(DType::BF16, true);
        println!("  {name}: {e:.2e} (tol {tol:.2e}) over all {s} rows");
        assert!(e <= tol, "{name} error {e:.3e} > {tol:.3e}");
    }
}

#[test]
fn out_of_memory_inside_the_op_is_an_error_and_the_device_recovers() {
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dev) = big_gpu() else { return };
    let opts = FlashAttnOptions::new(0.125).causal(true).deterministic(true);
    let x = |s| randn_bf16(&[2, s, 8, 128], &dev).unwrap();
    let (q, k, v, dout, q2) = (x(4096), x(4096), x(4096), x(4096), x(4096));
    let (out, lse) = flash_attn_with_lse(&q, &k, &v, &opts).unwrap();
    let before = flash_attn_backward(&q, &k, &v, &out, &dout, &lse, &opts).unwrap();
    // Fill the device: 1 GiB blocks, then ever smaller ones down to 1 MiB.
    let mut filler = Vec::new();
    let mut block = 1usize << 30;
    while block >= 1 << 20 {
        match Tensor::zeros(block, DType::U8, &dev) {
            Ok(t) => filler.push(t),
            Err(_) => block /= 4,
        }
    }
    let held: usize = filler.iter().map(|t| t.elem_count()).sum();
    // The backward needs its outputs (3 x 16 MiB) and an f32 workspace: it cannot get them.
    let bwd = flash_attn_backward(&q, &k, &v, &out, &dout, &lse, &opts);
    let fwd = flash_attn_with_lse(&q2, &k, &v, &opts);
    println!("device filled ({:.1} GiB held): backward -> {:?}", held as f64 / (1u64 << 30) as f64, bwd.as_ref().err());
    assert!(bwd.is_err(), "the backward succeeded on a full device");
    let msg = bwd.err().unwrap().to_string();
    assert!(msg.to_lowercase().contains("memory"), "not an out-of-memory error: {msg}");
    assert!(fwd.is_err(), "the forward succeeded on a full device");
    drop(filler);
    dev.synchronize().unwrap();
    // The device is usable again: the same backward gives the same bits (deterministic mode).
    let after = flash_attn_backward(&q, &k, &v, &out, &dout, &lse, &opts).unwrap();
    for (a, b) in [(&before.0, &after.0), (&before.1, &after.1), (&before.2, &after.2)] {
        assert_eq!(max_err_dev(a, b), 0.0, "results changed after the out-of-memory error");
    }
}
