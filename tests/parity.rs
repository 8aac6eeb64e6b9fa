//! Forward and backward parity of the flash path (every device present) against the reference:
//! dtypes × masks × softcap × ALiBi × MHA/GQA/MQA × varlen × Sq≠Sk, with sizes that do not
//! divide the tiles. Each case draws fresh random inputs (CANDLE_FLASH_SEED pins them).

mod common;
use candle_core::{DType, Tensor};
use common::{check_case, devices, Case};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn sweep(cases: &[Case], with_grad: bool) {
    for device in devices() {
        for case in cases {
            let summary = check_case(case, &device, with_grad).unwrap_or_else(|e| panic!("{case:?}: {e}"));
            println!("{:?} {case:?}: {summary}", device.location());
        }
    }
}

/// Masks, each with Sq < Sk, Sq > Sk and Sq == Sk.
fn mask_cases(dtype: DType, with_grad: bool) -> Vec<Case> {
    let sizes: &[(usize, usize)] =
        if with_grad { &[(17, 113), (113, 17), (64, 64)] } else { &[(17, 113), (113, 17), (65, 65)] };
    let mut cases = vec![];
    for &s in sizes {
        let base = Case::new(dtype, s, (4, 2), 64);
        cases.push(base.clone());
        cases.push(base.clone().causal());
        cases.push(base.clone().window(Some(7), Some(3)));
        cases.push(base.clone().window(Some(0), None));
        cases.push(base.clone().window(None, Some(5)).softcap(4.0));
        cases.push(base.clone().alibi(1));
        cases.push(base.clone().causal().alibi(2).softcap(2.5));
    }
    cases
}

#[test]
fn forward_masks_all_dtypes() {
    for dtype in DTYPES {
        sweep(&mask_cases(dtype, false), false);
    }
}

#[test]
fn backward_masks_all_dtypes() {
    for dtype in DTYPES {
        sweep(&mask_cases(dtype, true), true);
    }
}

/// MHA, GQA and MQA, head dims including ones that are not powers of two. On Hopper, 72 / 96 run
/// on the 96-column wgmma tiles (128 columns in shared memory, zeros past d) and 160 / 192 / 256
/// on the wide backward kernel (two warpgroups, one per gradient); the varlen and softcap cases
/// take its general-logit path and its GQA partials.
#[test]
fn heads_and_head_dims() {
    let mut cases = vec![];
    for dtype in DTYPES {
        for (h, hkv) in [(4, 4), (6, 2), (4, 1)] {
            for d in [8, 32, 72, 96, 128, 192] {
                cases.push(Case::new(dtype, (33, 47), (h, hkv), d).causal());
            }
        }
        cases.push(Case::new(dtype, (20, 20), (2, 1), 256));
        cases.push(Case::new(dtype, (70, 90), (4, 2), 256).window(Some(30), Some(4)).softcap(3.0));
        cases.push(Case::new(dtype, (0, 0), (4, 2), 160).varlen(&[(17, 30), (0, 5), (70, 64), (1, 9)]).causal());
    }
    sweep(&cases, true);
}

/// Lengths that break tiles, single tokens, and one long sequence.
#[test]
fn tile_breaking_lengths() {
    let mut cases = vec![];
    for dtype in DTYPES {
        for (sq, sk) in [(1, 1), (1, 17), (17, 1), (1, 1023), (113, 203)] {
            cases.push(Case::new(dtype, (sq, sk), (2, 1), 32));
            cases.push(Case::new(dtype, (sq, sk), (2, 1), 32).causal());
        }
    }
    sweep(&cases, true);
    let long =
        [Case::new(DType::F32, (1023, 1023), (2, 1), 64).causal(), Case::new(DType::BF16, (1023, 1023), (2, 2), 64)];
    sweep(&long, false);
}

/// Keys seen by thousands of query rows (GQA 4:1 and MQA, 2047 rows per head): dV and dK are sums
/// of 8-16k terms per element (and, with the shape turned around, dQ of 2047). The f32 SIMT
/// backward (then d > 128 on CUDA) once summed them in one sequential chain, ~6x the naive f32
/// error at 800 terms (fuzz, d = 256); it now adds each block's sum into a compensated total. The
/// 3xTF32 backward (d = 256 on Hopper) stages its sums per call (docs/kernels.md).
/// Three keys, not one: with a single key dS = P (dP - D) is exactly zero in the reference
/// (D = rowsum(P dP) = dP), while D = rowsum(dO O) rounds differently from dP, and dK then
/// measures only that rounding summed over every row.
#[test]
fn long_gradient_sums() {
    let mut cases = vec![];
    for dtype in DTYPES {
        for d in [64, 256] {
            cases.push(Case::new(dtype, (2047, 3), (8, 2), d));
            cases.push(Case::new(dtype, (2047, 3), (8, 1), d));
            cases.push(Case::new(dtype, (3, 2047), (8, 2), d)); // dQ: sums over 2047 keys
        }
    }
    sweep(&cases, true);
}

/// GQA backward under a causal mask with 4096 keys and more: on Hopper (d <= 128) the backward
/// then gives every query head its own CTAs (kernels/plan.cuh plan_bwd_workspace,
/// kBwdGqaSplitKeys), with the f32 dK / dV partials of the group summed by the last CTA of
/// each key block (BwdWs::dkv_count). Few query rows keep the CPU reference cheap; the causal
/// mask aligns them to the last keys, so every row still sees ~4k keys.
#[test]
fn gqa_backward_many_keys() {
    let mut cases = vec![];
    for dtype in DTYPES {
        cases.push(Case::new(dtype, (130, 4100), (8, 2), 128).causal());
        cases.push(Case::new(dtype, (77, 4097), (4, 1), 64).causal());
    }
    sweep(&cases, true);
}

/// Rows that see no key: windows that leave rows empty and Sq > Sk with a causal mask.
#[test]
fn fully_masked_rows() {
    let mut cases = vec![];
    for dtype in DTYPES {
        cases.push(Case::new(dtype, (40, 8), (2, 2), 32).causal());
        cases.push(Case::new(dtype, (16, 64), (2, 1), 32).window(Some(0), Some(0)));
        cases.push(Case::new(dtype, (100, 30), (2, 2), 32).window(Some(2), Some(0)).alibi(1));
    }
    sweep(&cases, true);
}

/// Packed variable-length batches, including an empty sequence and Sq ≠ Sk per sequence.
#[test]
fn varlen() {
    let mut cases = vec![];
    for dtype in DTYPES {
        let seqs = [(17, 30), (0, 5), (64, 64), (113, 1), (1, 70)];
        cases.push(Case::new(dtype, (0, 0), (4, 2), 64).varlen(&seqs));
        cases.push(Case::new(dtype, (0, 0), (4, 2), 64).varlen(&seqs).causal());
        cases.push(Case::new(dtype, (0, 0), (4, 1), 64).varlen(&seqs).window(Some(9), Some(2)).alibi(2));
        cases.push(Case::new(dtype, (0, 0), (2, 2), 32).varlen(&seqs).softcap(3.0).alibi(1));
    }
    sweep(&cases, true);
}

/// Learnable sinks (logits from -8, where they barely matter, to +6, where they take most of the
/// mass): forward, LSE, dq / dk / dv and dsinks against the reference, with masks, softcap,
/// ALiBi, GQA / MQA, tile-breaking lengths, Sq ≠ Sk, rows that see no key (all mass on the sink:
/// output 0, lse = the sink), varlen with an empty sequence, decode shapes, head dims up to 256.
#[test]
fn sinks() {
    let mut cases = vec![];
    for dtype in DTYPES {
        for (lo, hi) in [(-8.0, -4.0), (-2.0, 2.0), (3.0, 6.0)] {
            cases.push(Case::new(dtype, (17, 113), (4, 2), 64).sinks(lo, hi));
            cases.push(Case::new(dtype, (113, 17), (4, 2), 64).causal().sinks(lo, hi));
        }
        cases.push(Case::new(dtype, (65, 65), (4, 1), 32).window(Some(7), Some(3)).softcap(4.0).sinks(-8.0, 6.0));
        cases.push(Case::new(dtype, (40, 8), (2, 2), 32).causal().alibi(1).sinks(-8.0, 6.0));
        cases.push(Case::new(dtype, (16, 64), (2, 1), 32).window(Some(0), Some(0)).sinks(-8.0, 6.0));
        cases.push(Case::new(dtype, (1, 1), (2, 1), 32).sinks(-8.0, 6.0));
        cases.push(Case::new(dtype, (1, 1023), (8, 2), 128).causal().sinks(-8.0, 6.0));
        cases.push(Case::new(dtype, (33, 47), (4, 2), 96).causal().sinks(-8.0, 6.0));
        cases.push(Case::new(dtype, (20, 20), (2, 1), 256).sinks(-8.0, 6.0));
        cases.push(Case::new(dtype, (70, 90), (4, 2), 192).window(Some(30), Some(4)).softcap(3.0).sinks(-8.0, 6.0));
        let seqs = [(17, 30), (0, 5), (64, 64), (113, 1), (1, 70), (5, 0)];
        cases.push(Case::new(dtype, (0, 0), (4, 2), 64).varlen(&seqs).causal().sinks(-8.0, 6.0));
        cases.push(
            Case::new(dtype, (0, 0), (4, 1), 64).varlen(&seqs).window(Some(9), Some(2)).alibi(2).sinks(-8.0, 6.0),
        );
        cases.push(Case::new(dtype, (200, 300), (8, 2), 64).causal().deterministic().sinks(-8.0, 6.0));
    }
    sweep(&cases, true);
}

/// A value head dim of its own (MLA's (192, 128), and narrower or wider v): forward and gradients,
/// GQA, masks, sinks, varlen with an empty sequence. Every device (CUDA: the tensor-core kernels
/// on zero-padded copies; with CANDLE_FLASH_PAD_VALUE_HEAD_DIM=0 the SIMT kernels' narrow shape,
/// which reads v with its own head dim).
#[test]
fn value_head_dims() {
    let mut cases = vec![];
    for dtype in DTYPES {
        cases.push(Case::new(dtype, (33, 47), (4, 2), 192).dv(128).causal());
        cases.push(Case::new(dtype, (17, 113), (4, 1), 64).dv(128));
        cases.push(Case::new(dtype, (113, 17), (4, 2), 128).dv(64).causal().sinks(-8.0, 6.0));
        cases.push(Case::new(dtype, (1, 300), (8, 1), 192).dv(128).causal());
        let seqs = [(17, 30), (0, 5), (40, 40)];
        cases.push(Case::new(dtype, (0, 0), (4, 2), 96).dv(32).varlen(&seqs).causal().softcap(5.0));
    }
    sweep(&cases, true);
}

/// Head dims past the tensor-core kernels' 256 (Gemma's 512; MLA's (576, 512) with one KV head;
/// widths that do not fill the SIMT kernels' column sets): forward and gradients against the
/// reference on every device (CUDA: the SIMT kernels' wide shape), with masks, softcap, sinks,
/// ALiBi, GQA / MQA, Sq ≠ Sk, varlen with an empty sequence.
#[test]
fn wide_head_dims() {
    let mut cases = vec![];
    for dtype in DTYPES {
        cases.push(Case::new(dtype, (33, 47), (4, 2), 512).causal());
        cases.push(Case::new(dtype, (17, 40), (2, 1), 512).window(Some(9), Some(2)).softcap(8.0).sinks(-8.0, 6.0));
        cases.push(Case::new(dtype, (1, 113), (16, 1), 576).dv(512).causal());
        cases.push(Case::new(dtype, (0, 0), (4, 1), 576).dv(512).varlen(&[(3, 40), (0, 9), (1, 17)]).causal());
        cases.push(Case::new(dtype, (20, 9), (4, 2), 264).dv(136).alibi(1));
        // past 128 rows a KV group (CUDA: one query block of one head a CTA, o written directly;
        // causal with Sq > Sk: rows that see no key)
        cases.push(Case::new(dtype, (200, 130), (2, 1), 512).causal().sinks(-8.0, 6.0));
        cases.push(
            Case::new(dtype, (0, 0), (2, 2), 576)
                .dv(512)
                .varlen(&[(150, 170), (0, 20), (140, 0)])
                .window(Some(40), Some(10)),
        );
    }
    sweep(&cases, true);
}

/// Decode shapes of wide heads (CUDA f16 / bf16: the wide-head split-KV kernel,
/// kernels/sm80/fwd_wide_split.cu): MLA's absorbed (576, 512) with one KV head and 16 to 128
/// query heads (16 and 64 rows a CTA, two row blocks of 64 at 128 rows), MTP-like 2-query steps,
/// 512-wide GQA heads with softcap, ALiBi, windows and sinks, caches of 1, 17, 113 and 1023 keys,
/// a varlen batch with an empty cache (forward; the gradients of these heads run on the SIMT
/// kernels, which wide_head_dims covers).
#[test]
fn wide_decode_shapes() {
    let mut cases = vec![];
    for dtype in DTYPES {
        cases.push(Case::new(dtype, (1, 1023), (16, 1), 576).dv(512).causal());
        cases.push(Case::new(dtype, (1, 1), (16, 1), 576).dv(512));
        cases.push(Case::new(dtype, (2, 113), (64, 1), 576).dv(512).causal().sinks(-8.0, 6.0));
        cases.push(Case::new(dtype, (1, 300), (128, 1), 576).dv(512).softcap(30.0));
        cases.push(Case::new(dtype, (1, 17), (8, 4), 512).alibi(1).softcap(8.0));
        cases.push(Case::new(dtype, (3, 900), (8, 2), 512).window(Some(300), Some(0)).sinks(-8.0, 6.0));
        cases.push(
            Case::new(dtype, (0, 0), (16, 1), 576).dv(512).varlen(&[(1, 300), (1, 0), (2, 513), (1, 17)]).causal(),
        );
    }
    sweep(&cases, false);
}

/// Deterministic backward: the same inputs give the same bits on every run, on every device.
#[test]
fn deterministic_backward_is_bitwise_stable() {
    for device in devices() {
        for dtype in DTYPES {
            let case = Case::new(dtype, (200, 300), (8, 2), 64).causal().sinks(-8.0, 6.0);
            let (mut rng, seed) = common::rng();
            let x = common::make_inputs(&case, &mut rng).unwrap();
            let opts = common::options(&case, &x, &device).unwrap().deterministic(true);
            let to = |t: &candle_core::Tensor| t.to_dtype(dtype).unwrap().to_device(&device).unwrap();
            let (q, k, v, dout) = (to(&x.q), to(&x.k), to(&x.v), to(&x.dout));
            let (out, lse) = candle_flash::flash_attn_with_lse(&q, &k, &v, &opts).unwrap();
            let grads = || candle_flash::flash_attn_grads(&q, &k, &v, &out, &dout, &lse, &opts).unwrap();
            let (a, b) = (grads(), grads());
            let (da, db) = (a.dsinks.as_ref().unwrap(), b.dsinks.as_ref().unwrap());
            for (x, y) in [(&a.dq, &b.dq), (&a.dk, &b.dk), (&a.dv, &b.dv), (da, db)] {
                let diff = common::max_err(x, y);
                assert!(diff == 0.0, "{dtype:?} on {:?}: runs differ by {diff} (seed {seed})", device.location());
            }
        }
    }
}

/// Decode shapes: a few query rows against long caches (the GPU's split-KV path), GQA, with
/// masks, ALiBi, softcap and a varlen batch that has an empty cache.
#[test]
fn decode_shapes() {
    let mut cases = vec![];
    for dtype in DTYPES {
        cases.push(Case::new(dtype, (1, 700), (8, 2), 128).causal());
        cases.push(Case::new(dtype, (4, 1500), (8, 1), 64).causal().alibi(2));
        cases.push(Case::new(dtype, (3, 900), (8, 2), 128).window(Some(300), Some(0)).softcap(20.0));
        cases.push(Case::new(dtype, (0, 0), (8, 2), 128).varlen(&[(1, 300), (1, 0), (1, 513), (2, 260)]).causal());
    }
    sweep(&cases, true);
}

/// More query tiles than an H100 has SMs (the sm_90a forward then runs persistent CTAs that loop
/// over tiles, loading the next tile while finishing this one), causal, GQA and varlen.
#[test]
fn many_tiles() {
    let mut cases = vec![];
    for dtype in [DType::F16, DType::BF16] {
        cases.push(Case::new(dtype, (600, 600), (32, 8), 128).causal());
        cases.push(Case::new(dtype, (700, 500), (24, 24), 64));
        cases.push(Case::new(dtype, (0, 0), (16, 4), 64).varlen(&[(700, 700), (0, 5), (513, 300), (1, 900)]).causal());
    }
    sweep(&cases, true);
}

/// The candle-flash-attn-compatible functions treat a window wider than the key length as
/// unbounded, as candle-flash-attn does (visible only when Sq > Sk); windows within it are
/// passed on unchanged. The options form keeps every window as given.
#[test]
fn compat_windows_wider_than_the_keys_are_unbounded() {
    let (mut rng, seed) = common::rng();
    let q = common::randn(&mut rng, &[1, 40, 2, 16], 1.0).unwrap();
    let k = common::randn(&mut rng, &[1, 8, 2, 16], 1.0).unwrap();
    let v = common::randn(&mut rng, &[1, 8, 2, 16], 1.0).unwrap();
    let bitwise = |a: &Tensor, b: &Tensor| common::max_err(a, b) == 0.0;
    let opts = |l, r| candle_flash::FlashAttnOptions::new(0.25).window(l, r);
    let with = |l, r| candle_flash::flash_attn_with_options(&q, &k, &v, &opts(l, r)).unwrap();
    let compat = candle_flash::flash_attn_windowed(&q, &k, &v, 0.25, None, Some(12)).unwrap();
    assert!(bitwise(&compat, &with(None, None)), "seed {seed}");
    assert!(!bitwise(&compat, &with(None, Some(12))), "the options form keeps the window (seed {seed})");
    let within = candle_flash::flash_attn_windowed(&q, &k, &v, 0.25, Some(3), Some(8)).unwrap();
    assert!(bitwise(&within, &with(Some(3), Some(8))), "seed {seed}");
}
