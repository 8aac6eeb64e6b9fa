//! Every kernel once, on small shapes: the subset `scripts/gpu-run.sh` runs under each
//! compute-sanitizer tool (memcheck, racecheck, synccheck, initcheck), on both kernel families
//! of a Hopper GPU (again with `CANDLE_FLASH_DISABLE_SM90A=1`). Each case is also a parity check
//! against the reference, so the subset cannot pass by computing nothing.
//!
//! What each case reaches (the plan layer decides, kernels/plan.cu; tests/plans.rs asserts it): per dtype (f16/bf16: tensor cores; f32:
//! tensor cores as 3xTF32 where the device has the shared memory of the tiles (the backward at
//! head dim 256: Hopper), else and for rows that are not 16-byte aligned the SIMT kernels,
//! `f32_simt_kernels`) and head-dim tile (32 ... 256),
//!   prefill      the one-pass forward (sm_90a: the persistent 128 x 128 configurations for
//!                d <= 128, 128 x 64 for 192 / 256; Q, K, V by TMA), the
//!                backward's dsum, dK/dV with atomic dQ, the dQ conversion, and the GQA split
//!                reduction (4 query heads over 2 KV heads);
//!   deterministic the dQ pass instead of atomics;
//!   decode       split-KV with GQA packing and its combine (head-dim tiles 64 and 128);
//!   varlen       packed sequences, one of them empty on the query side and one on the key side
//!                (sm_90a: key blocks that cross a sequence end load with cp.async, the rest by TMA);
//!   simt_wide    the SIMT kernels' wide shape for every dtype (head dims past 256, a value head
//!                dim of its own, v read with it; f16 / bf16 forwards of these shapes run on the
//!                wide-head split kernel);
//!   wide_split   the wide-head split-KV decode kernel in each configuration (16 / 64 rows a CTA,
//!                v a tensor of its own or a view of the key cache) and its combine;
//!   wgmma_wide   the sm_90a forward of 512-wide heads (TMA and cp.async loads, empty tiles);
//! and the sm_90a 192 x 96 forward for head dim 64 past 2048 query rows. Learnable sinks ride on
//! deterministic, decode (the combine adds them), varlen (rows without keys: lse = the sink; the
//! sinks' gradient kernel) and the f32 SIMT cases; prefill runs without them.

mod common;
use candle_core::{DType, Device, Tensor};
use common::Case;

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
const HEAD_DIMS: [usize; 6] = [32, 64, 96, 128, 192, 256];

fn sweep(make: impl Fn(DType, usize) -> Case) {
    for device in common::devices() {
        for dtype in DTYPES {
            for d in HEAD_DIMS {
                let case = make(dtype, d);
                let summary = common::check_case(&case, &device, true).unwrap();
                println!("{dtype:?} d={d} on {:?}: {summary}", device.location());
            }
        }
    }
}

#[test]
fn prefill() {
    sweep(|dtype, d| Case::new(dtype, (70, 90), (4, 2), d).causal());
}

#[test]
fn deterministic_backward() {
    sweep(|dtype, d| Case::new(dtype, (33, 65), (4, 2), d).window(Some(20), Some(3)).deterministic().sinks(-8.0, 6.0));
}

#[test]
fn decode() {
    sweep(|dtype, d| Case::new(dtype, (1, 700), (8, 2), d).softcap(15.0).sinks(-8.0, 6.0));
}

#[test]
fn varlen_with_empty_sequences() {
    sweep(|dtype, d| {
        Case::new(dtype, (0, 0), (2, 1), d).varlen(&[(30, 40), (0, 20), (17, 0)]).causal().sinks(-8.0, 6.0)
    });
}

#[test]
fn f32_simt_kernels() {
    for device in common::devices() {
        for d in HEAD_DIMS {
            for case in [
                Case::new(DType::F32, (70, 90), (4, 2), d).causal().odd_strides().sinks(-8.0, 6.0),
                Case::new(DType::F32, (33, 65), (4, 2), d).window(Some(20), Some(3)).deterministic().odd_strides(),
            ] {
                let summary = common::check_case(&case, &device, true).unwrap();
                println!("F32 odd strides d={d} on {:?}: {summary}", device.location());
            }
        }
    }
}

/// The SIMT kernels of every dtype: the wide shape (head dims past 256, MLA's (576, 512) with v a
/// head dim of its own, GQA, a varlen batch with an empty sequence) forward and backward.
#[test]
fn simt_wide_head_dims() {
    for device in common::devices() {
        for dtype in DTYPES {
            for case in [
                Case::new(dtype, (20, 37), (4, 2), 512).causal().sinks(-8.0, 6.0),
                Case::new(dtype, (0, 0), (4, 1), 576)
                    .dv(512)
                    .varlen(&[(9, 30), (0, 5), (17, 0)])
                    .window(Some(8), Some(2)),
            ] {
                let summary = common::check_case(&case, &device, true).unwrap();
                println!("{case:?} on {:?}: {summary}", device.location());
            }
        }
    }
}

/// The wide-head kernel (kernels/sm80/fwd_wide_split.cu) in each configuration an H100 / H200
/// picks: decode shapes with 16 and 64 rows a CTA (two row blocks at 128 heads) through the
/// split-KV partials and their combine, longer query blocks written directly, v a tensor of its
/// own and v a view of the key cache (MLA's latent); causal over 333 keys (a partial key block);
/// the forward against the f64 reference on the same views.
#[test]
fn wide_split_decode() {
    let Some(gpu) = common::cuda_device() else { return };
    let (mut rng, seed) = common::rng();
    let shapes = [
        (1, 16, 1, 576, 512, true),
        (2, 64, 1, 576, 512, true),
        (1, 128, 1, 576, 512, true),
        (1, 8, 4, 512, 512, false),
        (3, 16, 2, 512, 512, false),
        // query blocks of one head a CTA (more than 128 rows a KV group), o written directly
        (150, 4, 2, 512, 512, false),
        (140, 2, 1, 576, 512, true),
    ];
    for dtype in [DType::F16, DType::BF16] {
        for (sq, h, hkv, d, dv, view) in shapes {
            let randn = |rng: &mut _, dims: &[usize]| common::randn(rng, dims, 1.0).unwrap().to_dtype(dtype).unwrap();
            let q = randn(&mut rng, &[2, sq, h, d]);
            let k = randn(&mut rng, &[2, 333, hkv, d]);
            let v = if view { k.narrow(3, 0, dv).unwrap() } else { randn(&mut rng, &[2, 333, hkv, dv]) };
            let opts = candle_flash::FlashAttnOptions::new(0.05).causal(true);
            let on = |t: &Tensor, dev: &Device| t.to_device(dev).unwrap();
            // the view taken on the GPU: to_device copies a view's storage, so a view moved there
            // would be a tensor of its own
            let k_gpu = on(&k, &gpu);
            let v_gpu = if view { k_gpu.narrow(3, 0, dv).unwrap() } else { on(&v, &gpu) };
            let (out, _) = candle_flash::flash_attn_with_lse(&on(&q, &gpu), &k_gpu, &v_gpu, &opts).unwrap();
            let f64s = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
            let truth = candle_flash::reference::attention(&f64s(&q), &f64s(&k), &f64s(&v), &opts).unwrap();
            let naive = candle_flash::reference::attention(&q, &k, &v, &opts).unwrap();
            let (ef, en) = (common::max_err(&out, &truth), common::max_err(&naive, &truth));
            let tol = 2.0 * en + common::floor(dtype, false);
            let what = format!("{dtype:?} sq {sq} heads {h}/{hkv} ({d}, {dv}) view {view}");
            assert!(ef <= tol, "{what}: error {ef:.2e} > {tol:.2e} (seed {seed})");
            println!("{what}: {ef:.1e} (naive {en:.1e})");
        }
    }
}

/// The sm_90a wgmma forward of 512-wide heads (kernels/sm90/fwd_wide.cu; elsewhere these shapes
/// run the wide-head kernel): tile-breaking lengths (a partial last key block, a partial last
/// query tile), Sq != Sk, causal with Sq > Sk (tiles whose rows see no key: o = 0, lse = the sink),
/// windows, softcap with ALiBi (the general logits), GQA / MQA, sinks, and a varlen batch with
/// empty sequences whose key blocks cross sequence ends (those load with cp.async, the rest by
/// TMA). Forward against the reference (the gradients of these heads run on the SIMT kernels,
/// simt_wide_head_dims).
#[test]
fn wgmma_wide_prefill() {
    let Some(gpu) = common::cuda_device() else { return };
    for dtype in [DType::F16, DType::BF16] {
        for case in [
            Case::new(dtype, (1023, 1023), (2, 1), 512).causal(),
            Case::new(dtype, (129, 113), (2, 2), 512),
            Case::new(dtype, (200, 130), (2, 1), 512).causal().sinks(-8.0, 6.0),
            Case::new(dtype, (300, 300), (4, 2), 512).window(Some(100), Some(20)).softcap(30.0).alibi(1),
            Case::new(dtype, (0, 0), (2, 2), 512).varlen(&[(150, 170), (0, 20), (140, 0), (300, 257)]).causal(),
        ] {
            let summary = common::check_case(&case, &gpu, false).unwrap();
            println!("{case:?}: {summary}");
        }
    }
}

#[test]
fn long_queries_head_dim_64() {
    for device in common::devices() {
        for dtype in [DType::F16, DType::BF16] {
            let mut case = Case::new(dtype, (2100, 64), (1, 1), 64).alibi(1);
            case.batch = 1;
            let summary = common::check_case(&case, &device, true).unwrap();
            println!("{dtype:?} 2100 x 64 on {:?}: {summary}", device.location());
        }
    }
}
