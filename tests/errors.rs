//! Bad input gives a clear `candle_core::Error` (naming the tensor and the values), never a
//! panic; plus a property test over random valid and invalid shapes, and bad varlen offsets on
//! the device (unchecked by default on CUDA: never a fault; checked on request or on the CPU).

mod common;
use candle_core::{DType, Device, Tensor};
use candle_flash::{
    flash_attn, flash_attn_alibi, flash_attn_alibi_windowed_softcap, flash_attn_backward, flash_attn_varlen,
    flash_attn_with_lse, FlashAttnOptions, VarLen,
};
use rand::Rng;

/// NaN and infinities in the inputs are computed with, not rejected (reading every value would
/// cost a pass over the tensors, and a host synchronisation on CUDA): no panic, the right shape,
/// and they reach only the rows that read them. A NaN in query row i of sequence 0 and an
/// infinity in a key of sequence 1 leave sequence 2 and the other query rows of sequence 0
/// exactly as without them (key rows of sequence 0 are clean).
#[test]
fn non_finite_inputs_reach_only_the_rows_that_read_them() {
    for device in common::devices() {
        for dtype in [DType::F32, DType::BF16] {
            let (mut rng, seed) = common::rng();
            let dims = [3, 40, 2, 64];
            let mut x =
                || common::randn(&mut rng, &dims, 1.0).unwrap().to_dtype(dtype).unwrap().to_device(&device).unwrap();
            let (q, k, v) = (x(), x(), x());
            let poke = |t: &Tensor, b: usize, row: usize, value: f32| {
                let src = Tensor::full(value, (1, 1, 2, 64), &device).unwrap().to_dtype(dtype).unwrap();
                t.slice_assign(&[b..b + 1, row..row + 1, 0..2, 0..64], &src).unwrap()
            };
            let (bad_q, bad_k) = (poke(&q, 0, 7, f32::NAN), poke(&k, 1, 11, f32::INFINITY));
            let clean = flash_attn(&q, &k, &v, 0.125, true).unwrap();
            let dirty = flash_attn(&bad_q, &bad_k, &v, 0.125, true).unwrap();
            assert_eq!(dirty.dims(), clean.dims());
            let same = |a: &Tensor, b: &Tensor| {
                let eq = a.eq(b).unwrap().to_dtype(DType::F32).unwrap().min_all().unwrap().to_scalar::<f32>().unwrap();
                eq == 1.0
            };
            let rows = |t: &Tensor, b: usize, r0: usize, n: usize| t.narrow(0, b, 1).unwrap().narrow(1, r0, n).unwrap();
            assert!(same(&rows(&dirty, 2, 0, 40), &rows(&clean, 2, 0, 40)), "sequence 2 changed (seed {seed})");
            assert!(same(&rows(&dirty, 0, 0, 7), &rows(&clean, 0, 0, 7)), "rows 0..7 changed (seed {seed})");
            assert!(same(&rows(&dirty, 0, 8, 32), &rows(&clean, 0, 8, 32)), "rows 8.. changed (seed {seed})");
            println!("{dtype:?} on {:?}: non-finite inputs stayed in their rows", device.location());
        }
    }
}

fn t(dims: &[usize], dtype: DType) -> Tensor {
    Tensor::zeros(dims, dtype, &Device::Cpu).unwrap()
}

fn err_of(r: candle_core::Result<Tensor>) -> String {
    match r {
        Ok(t) => panic!("expected an error, got a tensor of shape {:?}", t.dims()),
        Err(e) => e.to_string(),
    }
}

fn expect(r: candle_core::Result<Tensor>, needles: &[&str]) {
    let msg = err_of(r);
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} should mention {n:?}");
    }
}

#[test]
fn bad_rank_dtype_and_dims() {
    let f = DType::F32;
    expect(
        flash_attn(&t(&[2, 8, 4], f), &t(&[2, 8, 4, 16], f), &t(&[2, 8, 4, 16], f), 1.0, false),
        &["q", "rank 4", "[2, 8, 4]"],
    );
    expect(
        flash_attn(&t(&[2, 8, 4, 16], DType::U32), &t(&[2, 8, 4, 16], f), &t(&[2, 8, 4, 16], f), 1.0, false),
        &["q", "U32"],
    );
    expect(
        flash_attn(&t(&[2, 8, 4, 16], f), &t(&[2, 8, 4, 16], DType::F16), &t(&[2, 8, 4, 16], f), 1.0, false),
        &["dtype mismatch", "F16"],
    );
    expect(
        flash_attn(&t(&[2, 8, 4, 16], f), &t(&[2, 8, 4, 32], f), &t(&[2, 8, 4, 32], f), 1.0, false),
        &["head dims differ", "16", "32"],
    );
    expect(
        flash_attn(&t(&[2, 8, 4, 16], f), &t(&[2, 8, 4, 16], f), &t(&[2, 9, 4, 16], f), 1.0, false),
        &["k and v", "[2, 9, 4, 16]"],
    );
    expect(
        flash_attn(&t(&[2, 8, 4, 600], f), &t(&[2, 8, 4, 600], f), &t(&[2, 8, 4, 600], f), 1.0, false),
        &["head dim 600", "576"],
    );
    expect(
        flash_attn(&t(&[2, 8, 4, 64], f), &t(&[2, 8, 4, 64], f), &t(&[2, 8, 4, 640], f), 1.0, false),
        &["value head dim 640"],
    );
    expect(
        flash_attn(&t(&[2, 8, 6, 16], f), &t(&[2, 8, 4, 16], f), &t(&[2, 8, 4, 16], f), 1.0, false),
        &["6 heads", "4 heads"],
    );
    expect(
        flash_attn(&t(&[2, 8, 4, 16], f), &t(&[3, 8, 4, 16], f), &t(&[3, 8, 4, 16], f), 1.0, false),
        &["batch", "2", "3"],
    );
    expect(
        flash_attn(&t(&[1, 8, 4, 16], f), &t(&[1, 8, 4, 16], f), &t(&[1, 8, 4, 16], f), f32::NAN, false),
        &["softmax_scale"],
    );
    // Last dim not contiguous.
    let q = t(&[1, 8, 16, 4], f).transpose(2, 3).unwrap();
    expect(
        flash_attn(&q, &t(&[1, 8, 4, 16], f), &t(&[1, 8, 4, 16], f), 1.0, false),
        &["last dimension of q", "contiguous"],
    );
}

#[test]
fn bad_alibi_and_softcap() {
    let (q, k) = (t(&[2, 8, 4, 16], DType::F32), t(&[2, 8, 2, 16], DType::F32));
    expect(flash_attn_alibi(&q, &k, &k, &t(&[3], DType::F32), 1.0, false), &["alibi_slopes", "[3]", "[4]"]);
    expect(flash_attn_alibi(&q, &k, &k, &t(&[4], DType::F16), 1.0, false), &["alibi_slopes", "f32"]);
    expect(flash_attn_alibi(&q, &k, &k, &t(&[3, 4], DType::F32), 1.0, false), &["alibi_slopes", "[3, 4]"]);
    for c in [0.0, -1.0, f32::NAN] {
        expect(flash_attn_alibi_windowed_softcap(&q, &k, &k, None, 1.0, None, None, c), &["softcap"]);
    }
}

#[test]
fn bad_varlen() {
    let f = DType::F32;
    let (q, k) = (t(&[10, 2, 16], f), t(&[12, 2, 16], f));
    let s = |v: &[u32]| Tensor::new(v, &Device::Cpu).unwrap();
    expect(
        flash_attn_varlen(&q, &k, &k, &s(&[0, 6, 4, 10]), &s(&[0, 4, 8, 12]), 10, 10, 1.0, false),
        &["seqlens_q", "not monotonic"],
    );
    expect(
        flash_attn_varlen(&q, &k, &k, &s(&[0, 6, 9]), &s(&[0, 4, 12]), 10, 10, 1.0, false),
        &["seqlens_q", "ends at 9", "10 rows"],
    );
    expect(
        flash_attn_varlen(&q, &k, &k, &s(&[0, 6, 10]), &s(&[0, 4, 12]), 10, 5, 1.0, false),
        &["seqlens_k", "length 8", "max_seqlen 5"],
    );
    expect(flash_attn_varlen(&q, &k, &k, &s(&[0, 6, 10]), &s(&[0, 4, 8, 12]), 10, 10, 1.0, false), &["entries"]);
    expect(
        flash_attn_varlen(&q, &k, &k, &s(&[1, 6, 10]), &s(&[0, 4, 12]), 10, 10, 1.0, false),
        &["seqlens_q", "start at 0"],
    );
    let wrong = Tensor::new(&[0i64, 10], &Device::Cpu).unwrap();
    expect(flash_attn_varlen(&q, &k, &k, &wrong, &s(&[0, 12]), 10, 12, 1.0, false), &["seqlens_q", "u32"]);
    expect(
        flash_attn_varlen(&t(&[1, 10, 2, 16], f), &k, &k, &s(&[0, 10]), &s(&[0, 12]), 10, 12, 1.0, false),
        &["q", "rank 3"],
    );
}

#[test]
fn bad_backward_inputs() {
    let (q, k) = (t(&[1, 8, 2, 16], DType::F32), t(&[1, 8, 2, 16], DType::F32));
    let opts = FlashAttnOptions::new(0.25);
    let (out, lse) = flash_attn_with_lse(&q, &k, &k, &opts).unwrap();
    let bad_lse = t(&[1, 2, 9], DType::F32);
    let r = flash_attn_backward(&q, &k, &k, &out, &out, &bad_lse, &opts).map(|x| x.0);
    expect(r, &["lse", "[1, 2, 8]"]);
    let r = flash_attn_backward(&q, &k, &k, &out, &t(&[1, 8, 2, 8], DType::F32), &lse, &opts).map(|x| x.0);
    expect(r, &["grad_out", "[1, 8, 2, 8]"]);
    let r = flash_attn_backward(&q, &k, &k, &out.to_dtype(DType::F16).unwrap(), &out, &lse, &opts).map(|x| x.0);
    expect(r, &["out", "F16"]);
}

/// Random shapes, some valid and some broken in one random way: every call returns Ok with the
/// right shape or an Err, and never panics; on every device present.
#[test]
fn property_random_shapes_never_panic() {
    for device in common::devices() {
        property_random_shapes_on(&device);
    }
}

fn property_random_shapes_on(device: &Device) {
    let t = |dims: &[usize], dtype: DType| Tensor::zeros(dims, dtype, device).unwrap();
    let (mut rng, seed) = common::rng();
    for _ in 0..300 {
        // CUDA kernels need head dims that are multiples of 8 (a clear error otherwise).
        let d_ok = |d: usize| !device.is_cuda() || d.is_multiple_of(8);
        let (b, sq, sk) = (rng.random_range(1..3), rng.random_range(0..20), rng.random_range(0..20));
        let hkv = rng.random_range(1..4);
        let h = hkv * rng.random_range(1..4);
        let d = rng.random_range(1..40);
        let dtype = [DType::F32, DType::F16, DType::BF16][rng.random_range(0..3)];
        let mut qd = vec![b, sq, h, d];
        let mut kd = vec![b, sk, hkv, d];
        let mut vd = kd.clone();
        let breakage = rng.random_range(0..6);
        match breakage {
            1 => qd[3] += 1,
            2 => qd[2] += 1,
            3 => vd[1] += 1,
            4 => kd.pop().map(|_| ()).unwrap(),
            5 => qd[0] += 1,
            _ => {}
        }
        let valid = breakage == 0 || (breakage == 2 && (h + 1) % hkv == 0 && kd.len() == 4);
        let mut opts = FlashAttnOptions::new(0.3).window(
            rng.random_bool(0.5).then(|| rng.random_range(0..8)),
            rng.random_bool(0.5).then(|| rng.random_range(0..8)),
        );
        if rng.random_bool(0.3) {
            opts = opts.softcap(Some(rng.random_range(-1.0f32..5.0)));
        }
        let valid = valid && opts.softcap.is_none_or(|c| c > 0.0);
        if rng.random_bool(0.2) {
            let tq = b * sq;
            let tk = b * sk;
            let cut = |total: usize| Tensor::new(&[0u32, (total / 2) as u32, total as u32], device).unwrap();
            opts = opts.varlen(Some(VarLen {
                seqlens_q: cut(tq),
                seqlens_k: cut(tk),
                max_seqlen_q: tq,
                max_seqlen_k: tk,
            }));
            qd = vec![tq, qd[2], qd[3]];
            kd = vec![tk, kd[kd.len() - 2], kd[kd.len() - 1]];
            vd = vec![vd[0] * vd[1], vd[2], vd[3]];
        }
        let (q, k, v) = (t(&qd, dtype), t(&kd, dtype), t(&vd, dtype));
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            candle_flash::flash_attn_with_options(&q, &k, &v, &opts)
        }));
        match result {
            Err(_) => panic!("panicked on q {qd:?} k {kd:?} v {vd:?} {opts:?} on {device:?} (seed {seed})"),
            Ok(Ok(out)) => assert_eq!(out.dims(), q.dims(), "seed {seed}"),
            Ok(Err(e)) => assert!(
                !valid || opts.varlen.is_some() || !d_ok(qd[qd.len() - 1]),
                "valid input rejected: {e} (q {qd:?} k {kd:?} on {device:?}, seed {seed})"
            ),
        }
    }
}

/// Bad varlen offsets for q of 40 rows and k of 48 rows (4 query and 2 KV heads, head dim 64,
/// max_seqlen 24 on both sides), each with what the checked error must say.
struct BadSeqlens {
    what: &'static str,
    q: Vec<u32>,
    k: Vec<u32>,
    needles: &'static [&'static str],
}

const BAD_TOTALS: (usize, usize, usize) = (40, 48, 24);

fn bad_seqlens_cases() -> Vec<BadSeqlens> {
    let case = |what, q: &[u32], k: &[u32], needles| BadSeqlens { what, q: q.to_vec(), k: k.to_vec(), needles };
    let huge = u32::MAX;
    vec![
        case("past the total", &[0, 20, 44], &[0, 24, 48], &["seqlens_q", "ends at 44", "40 rows"]),
        case("decreasing", &[0, 10, 20, 40], &[0, 20, 10, 48], &["seqlens_k", "not monotonic"]),
        case("longer than max_seqlen", &[0, 30, 40], &[0, 24, 48], &["seqlens_q", "length 30", "max_seqlen 24"]),
        case("huge length", &[0, 20, huge], &[0, 24, 48], &["seqlens_q", "length 4294967275"]),
        case("huge offsets", &[0, 20, 40], &[0, huge, huge], &["seqlens_k", "length 4294967295"]),
        case("not starting at 0", &[huge, 20, 40], &[0, 24, 48], &["seqlens_q", "start at 0"]),
    ]
}

/// (q, k, v, dout) for [`bad_seqlens_cases`] on `device`, and options with those offsets and
/// ALiBi slopes `[H]` (so that the slopes' pointer is exercised too).
fn bad_seqlens_call(
    bad: &BadSeqlens,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<([Tensor; 4], FlashAttnOptions)> {
    let (tq, tk, max) = BAD_TOTALS;
    let (mut rng, _) = common::rng();
    let to = |t: Tensor| t.to_dtype(dtype)?.to_device(device);
    let q = to(common::randn(&mut rng, &[tq, 4, 64], 1.0)?)?;
    let k = to(common::randn(&mut rng, &[tk, 2, 64], 1.0)?)?;
    let v = to(common::randn(&mut rng, &[tk, 2, 64], 1.0)?)?;
    let dout = to(common::randn(&mut rng, &[tq, 4, 64], 1.0)?)?;
    let opts = FlashAttnOptions::new(0.125).causal(true).alibi(Some(&Tensor::new(&[0.1f32, 0.2, 0.3, 0.4], device)?));
    let opts = opts.varlen(Some(VarLen {
        seqlens_q: Tensor::new(bad.q.as_slice(), device)?,
        seqlens_k: Tensor::new(bad.k.as_slice(), device)?,
        max_seqlen_q: max,
        max_seqlen_k: max,
    }));
    Ok(([q, k, v, dout], opts))
}

/// Forward then (if the forward gave one) backward of a bad-seqlens call.
fn bad_seqlens_fwd_bwd(x: &[Tensor; 4], opts: &FlashAttnOptions) -> candle_core::Result<Tensor> {
    let [q, k, v, dout] = x;
    let (out, lse) = flash_attn_with_lse(q, k, v, opts)?;
    flash_attn_backward(q, k, v, &out, dout, &lse, opts).map(|g| g.0)
}

/// On the CPU the offsets' values are always checked: forward and backward give an error that
/// names the tensor and the problem.
#[test]
fn bad_seqlens_values_are_errors_on_cpu() {
    for bad in bad_seqlens_cases() {
        let (x, opts) = bad_seqlens_call(&bad, DType::F32, &Device::Cpu).unwrap();
        let [q, k, v, dout] = &x;
        expect(flash_attn_with_lse(q, k, v, &opts).map(|r| r.0), bad.needles);
        // The backward validates on its own (the forward's outputs of a good call).
        let good = opts.clone().varlen(Some(VarLen {
            seqlens_q: Tensor::new(&[0u32, 16, 40], &Device::Cpu).unwrap(),
            seqlens_k: Tensor::new(&[0u32, 24, 48], &Device::Cpu).unwrap(),
            max_seqlen_q: 24,
            max_seqlen_k: 24,
        }));
        let (out, lse) = flash_attn_with_lse(q, k, v, &good).unwrap();
        expect(flash_attn_backward(q, k, v, &out, dout, &lse, &opts).map(|g| g.0), bad.needles);
        println!("{}: rejected", bad.what);
    }
    let (q, k) = (t(&[2, 8, 4, 16], DType::F32), t(&[2, 8, 2, 16], DType::F32));
    let slopes = Tensor::new(&[0.1f32, f32::NAN, 0.3, 0.4], &Device::Cpu).unwrap();
    expect(flash_attn_alibi(&q, &k, &k, &slopes, 1.0, false), &["alibi_slopes", "finite", "NaN"]);
}

/// On CUDA, bad offsets (past the total, decreasing, longer than max_seqlen, huge) are not read
/// by default: forward and backward return Ok (unspecified values) or a clean error, never a
/// fault, and a good call on the same device afterwards is correct. With
/// `check_device_data(true)` the same offsets are an error naming the problem. Meant to run
/// under compute-sanitizer memcheck too (filter: `bad_seqlens`).
#[test]
fn bad_seqlens_on_cuda_never_fault() {
    let Some(device) = common::cuda_device() else { return };
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for bad in bad_seqlens_cases() {
            let (x, opts) = bad_seqlens_call(&bad, dtype, &device).unwrap();
            match bad_seqlens_fwd_bwd(&x, &opts) {
                Ok(_) => println!("{dtype:?} {}: unchecked, Ok", bad.what),
                Err(e) => println!("{dtype:?} {}: unchecked, error {e}", bad.what),
            }
            // A kernel fault would surface here (and poison every later call).
            device.synchronize().unwrap_or_else(|e| panic!("{dtype:?} {}: device fault: {e}", bad.what));
            let checked = opts.clone().check_device_data(true);
            expect(bad_seqlens_fwd_bwd(&x, &checked), bad.needles);
        }
        let slopes = Tensor::new(&[0.1f32, f32::NAN, 0.3, 0.4], &device).unwrap();
        let good_offsets = BadSeqlens { what: "good", q: vec![0, 16, 40], k: vec![0, 24, 48], needles: &[] };
        let (x, opts) = bad_seqlens_call(&good_offsets, dtype, &device).unwrap();
        let opts = opts.alibi(Some(&slopes)).check_device_data(true);
        expect(bad_seqlens_fwd_bwd(&x, &opts), &["alibi_slopes", "finite"]);
        // The device still computes correctly.
        let good = common::Case::new(dtype, (0, 0), (4, 2), 64).varlen(&[(17, 30), (0, 5), (23, 13)]).causal().alibi(1);
        let summary = common::check_case(&good, &device, true).unwrap();
        println!("{dtype:?} good call after the bad ones: {summary}");
    }
}

/// The CUDA launch limits are clear errors from the validation, not launch failures: batch or
/// heads above the grids' 65535. (The max_seqlen_q + max_seqlen_k < 2^29 limit needs tensors of
/// 2^28 rows to reach, since varlen maxima are capped at the packed totals: not run here.)
#[test]
fn cuda_size_limits_are_errors() {
    let Some(device) = common::cuda_device() else { return };
    let big = candle_flash::MAX_CUDA_GRID_YZ + 1;
    let q = Tensor::zeros((big, 1, 1, 8), DType::F16, &device).unwrap();
    expect(flash_attn(&q, &q, &q, 1.0, false), &["batch", "65535"]);
    let q = Tensor::zeros((1, 1, big, 8), DType::F16, &device).unwrap();
    expect(flash_attn(&q, &q, &q, 1.0, false), &["heads", "65535"]);
}
