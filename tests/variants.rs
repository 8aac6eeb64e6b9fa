//! The attention variants of current models beyond the parity matrix (tests/parity.rs `sinks`,
//! `value_head_dims`, `wide_head_dims`; tests/paged.rs): learnable sinks (the explicit backward's
//! dsinks equals autograd's, a row that sees no key puts all its mass on the sink, the sink's
//! effect on a row that sees one key matches its definition, bad sinks are errors) and MLA's v
//! as a view of the key cache. Every device present.

mod common;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_flash::{flash_attn_grads, flash_attn_with_lse, FlashAttnOptions};
use common::{devices, max_err, randn};

fn inputs(device: &Device, (b, sq, sk, h, hkv, d): (usize, usize, usize, usize, usize, usize)) -> Result<[Tensor; 4]> {
    let (mut rng, _) = common::rng();
    let q = randn(&mut rng, &[b, sq, h, d], 1.0)?.to_device(device)?;
    let k = randn(&mut rng, &[b, sk, hkv, d], 1.0)?.to_device(device)?;
    let v = randn(&mut rng, &[b, sk, hkv, d], 1.0)?.to_device(device)?;
    let dout = randn(&mut rng, &[b, sq, h, d], 1.0)?.to_device(device)?;
    Ok([q, k, v, dout])
}

/// `flash_attn_grads` gives the gradients autograd gives through a sinks `Var`, and the
/// backward without the sinks' gradient the same dq / dk / dv.
#[test]
fn explicit_dsinks_match_autograd() -> Result<()> {
    for device in devices() {
        for dtype in [DType::F32, DType::BF16] {
            let [q, k, v, dout] = inputs(&device, (2, 37, 61, 4, 2, 64))?;
            let [q, k, v, dout] = [q, k, v, dout].map(|t| t.to_dtype(dtype).unwrap());
            let sinks = Var::from_tensor(&Tensor::new(&[-3f32, 0.5, 2.0, 5.0], &device)?)?;
            let opts = FlashAttnOptions::new(0.125).causal(true).sinks(Some(sinks.as_tensor()));
            let qv = Var::from_tensor(&q)?;
            let (out, lse) = flash_attn_with_lse(&qv, &k, &v, &opts)?;
            let grads = (&out * &dout)?.sum_all()?.backward()?;
            let auto_ds = grads.get(&sinks).expect("autograd returns the sinks' gradient");
            let auto_dq = grads.get(&qv).expect("dq");
            let explicit = flash_attn_grads(&q, &k, &v, &out.detach(), &dout, &lse, &opts)?;
            let ds = explicit.dsinks.as_ref().expect("the explicit backward returns dsinks");
            assert_eq!(ds.dims(), &[4]);
            let scale = max_err(auto_ds, &auto_ds.zeros_like()?).max(1e-3);
            assert!(max_err(ds, auto_ds) <= 1e-5 * scale, "{dtype:?} on {:?}: dsinks differ", device.location());
            assert!(max_err(&explicit.dq, auto_dq) == 0.0, "{dtype:?} on {:?}: dq differs", device.location());
            let (dq, _, _) = candle_flash::flash_attn_backward(&q, &k, &v, &out.detach(), &dout, &lse, &opts)?;
            assert!(max_err(&dq, &explicit.dq) == 0.0);
            // A sink that is not a Var: no sinks' gradient, the same output.
            let plain = opts.clone().sinks(Some(&sinks.as_tensor().detach()));
            let (out2, _) = flash_attn_with_lse(&q, &k, &v, &plain)?;
            assert!(max_err(&out2, &out) == 0.0);
        }
    }
    Ok(())
}

/// Rows that see no key: output 0, lse = the head's sink exactly, zero gradients; rows that see
/// one key j: out = v_j · σ(x_j - s), lse = log(e^{x_j} + e^{s}).
#[test]
fn sinks_on_empty_and_single_key_rows() -> Result<()> {
    for device in devices() {
        // Sq 6 > Sk 3 with a causal mask: rows 0..3 see no key, row 3 sees key 0 only.
        let [q, k, v, dout] = inputs(&device, (1, 6, 3, 2, 1, 32))?;
        let s = [-1.5f32, 4.0];
        let sinks = Tensor::new(&s, &device)?;
        let opts = FlashAttnOptions::new(0.2).causal(true).sinks(Some(&sinks));
        let (out, lse) = flash_attn_with_lse(&q, &k, &v, &opts)?;
        let (out, lse) = (out.to_device(&Device::Cpu)?, lse.to_device(&Device::Cpu)?);
        let lse = lse.to_vec3::<f32>()?;
        let (qc, kc, vc) = (q.to_device(&Device::Cpu)?, k.to_device(&Device::Cpu)?, v.to_device(&Device::Cpu)?);
        for (h, &sink) in s.iter().enumerate() {
            for (i, &row_lse) in lse[0][h][..3].iter().enumerate() {
                assert_eq!(row_lse, sink, "row {i} head {h} on {:?}", device.location());
                let row = out.narrow(1, i, 1)?.narrow(2, h, 1)?;
                assert!(max_err(&row, &row.zeros_like()?) == 0.0, "row {i} head {h}: output not 0");
            }
            let x = ((qc.narrow(1, 3, 1)?.narrow(2, h, 1)?.flatten_all()? * kc.narrow(1, 0, 1)?.flatten_all()?)?
                .sum_all()?
                .to_scalar::<f32>()?
                * 0.2) as f64;
            let want_lse = (x.exp() + (sink as f64).exp()).ln();
            assert!((lse[0][h][3] as f64 - want_lse).abs() < 1e-5, "lse of the one-key row, head {h}");
            let weight = 1.0 / (1.0 + (sink as f64 - x).exp());
            let want = (vc.narrow(1, 0, 1)?.flatten_all()? * weight)?;
            let got = out.narrow(1, 3, 1)?.narrow(2, h, 1)?.flatten_all()?;
            assert!(max_err(&got, &want) < 1e-5, "output of the one-key row, head {h}");
        }
        let g = flash_attn_grads(
            &q,
            &k,
            &v,
            &out.to_device(&device)?,
            &dout,
            &flash_attn_with_lse(&q, &k, &v, &opts)?.1,
            &opts,
        )?;
        let dq = g.dq.to_device(&Device::Cpu)?.narrow(1, 0, 3)?;
        assert!(max_err(&dq, &dq.zeros_like()?) == 0.0, "rows without keys have zero dq");
    }
    Ok(())
}

fn err_text(r: Result<impl std::fmt::Debug>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_sinks_are_errors() -> Result<()> {
    for device in devices() {
        let [q, k, v, _] = inputs(&device, (1, 4, 4, 4, 2, 16))?;
        let call = |s: &Tensor| flash_attn_with_lse(&q, &k, &v, &FlashAttnOptions::new(0.25).sinks(Some(s)));
        let e = err_text(call(&Tensor::zeros(2, DType::F32, &device)?));
        assert!(e.contains("sinks") && e.contains("[4]"), "{e}");
        let e = err_text(call(&Tensor::zeros(4, DType::F16, &device)?));
        assert!(e.contains("sinks") && e.contains("F16"), "{e}");
        let e = err_text(call(&Tensor::zeros((1, 4), DType::F32, &device)?));
        assert!(e.contains("sinks"), "{e}");
        if device.is_cpu() {
            let e = err_text(call(&Tensor::new(&[0f32, f32::NAN, 1.0, 2.0], &device)?));
            assert!(e.contains("finite") && e.contains("head 1"), "{e}");
            let e = err_text(call(&Tensor::new(&[0f32, 1.0, f32::NEG_INFINITY, 2.0], &device)?));
            assert!(e.contains("finite"), "{e}");
        } else {
            // Device values are read only on request (the device-data policy).
            let opts = FlashAttnOptions::new(0.25).check_device_data(true);
            let s = Tensor::new(&[0f32, f32::INFINITY, 1.0, 2.0], &device)?;
            let e = err_text(flash_attn_with_lse(&q, &k, &v, &opts.sinks(Some(&s))));
            assert!(e.contains("finite"), "{e}");
            let e = err_text(call(&Tensor::zeros(4, DType::F32, &Device::Cpu)?));
            assert!(e.contains("sinks"), "{e}");
        }
    }
    Ok(())
}

/// MLA's absorbed decode reads v as the first Dv columns of the same latent cache as k: v a
/// (strided) view of k (the CUDA kernels then load each key row once). Against the
/// reference on the same views, every device.
#[test]
fn value_as_a_view_of_the_key_cache() -> Result<()> {
    for device in devices() {
        let (mut rng, seed) = common::rng();
        // (576, 512): 48 rows of one KV head, one decode row of 16 heads, 128 heads (on CUDA the
        // wide-head split kernel's 64- and 16-row tiles, reading the values out of the key tile)
        let shapes = [((576, 512), 3, 16), ((576, 512), 1, 16), ((576, 512), 1, 128), ((192, 128), 3, 16)];
        for (((dqk, dv), sq, heads), dtype) in shapes.into_iter().flat_map(|s| [(s, DType::F32), (s, DType::BF16)]) {
            let q = randn(&mut rng, &[2, sq, heads, dqk], 1.0)?.to_dtype(dtype)?.to_device(&device)?;
            let kv = randn(&mut rng, &[2, 100, 1, dqk], 1.0)?.to_dtype(dtype)?.to_device(&device)?;
            let v = kv.narrow(3, 0, dv)?;
            let opts = FlashAttnOptions::new(0.05).causal(true);
            let (out, _) = flash_attn_with_lse(&q, &kv, &v, &opts)?;
            assert_eq!(out.dims(), &[2, sq, heads, dv]);
            let f64_on_cpu = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F64);
            let truth =
                candle_flash::reference::attention(&f64_on_cpu(&q)?, &f64_on_cpu(&kv)?, &f64_on_cpu(&v)?, &opts)?;
            let cpu = |t: &Tensor| t.to_device(&Device::Cpu);
            let naive = candle_flash::reference::attention(&cpu(&q)?, &cpu(&kv)?, &cpu(&v)?, &opts)?;
            let (ef, en) = (max_err(&out, &truth), max_err(&naive, &truth));
            let tol = 2.0 * en + common::floor(dtype, false);
            assert!(ef <= tol, "{dtype:?} on {:?}: error {ef:.2e} > {tol:.2e} (seed {seed})", device.location());
        }
    }
    Ok(())
}
