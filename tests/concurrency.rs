//! Attention called from several threads at once, as a server does: forward and backward of
//! random cases from 8 threads on every device present (on CUDA all threads share the device
//! and candle's stream; and again with a stream per thread), each result checked against the
//! reference; and the forward's LSE,
//! which the op keeps for its backward, staying right when one output feeds several backward
//! passes and when graphs are built concurrently.

mod common;
use candle_core::{DType, Tensor, Var};
use candle_flash::{reference, FlashAttnOptions};
use common::Case;
use rand::Rng;

const THREADS: usize = 8;

fn random_case(rng: &mut impl Rng, cuda: bool) -> Case {
    let dtype = [DType::F32, DType::F16, DType::BF16][rng.random_range(0..3)];
    let hkv = rng.random_range(1..3);
    let d = if cuda { [32, 64, 128][rng.random_range(0..3)] } else { [8, 24, 64][rng.random_range(0..3)] };
    let mut c =
        Case::new(dtype, (rng.random_range(1..70), rng.random_range(1..70)), (hkv * rng.random_range(1..3), hkv), d);
    if rng.random_bool(0.5) {
        c = c.causal();
    }
    if rng.random_bool(0.2) {
        c = c.softcap(20.0);
    }
    if rng.random_bool(0.2) {
        c = c.varlen(&[
            (rng.random_range(0..30), rng.random_range(1..30)),
            (rng.random_range(1..30), rng.random_range(0..30)),
        ]);
    }
    c
}

#[test]
fn concurrent_forward_and_backward_on_every_device() {
    let (mut rng, seed) = common::rng();
    println!("seed {seed}");
    for device in common::devices() {
        let per_thread: Vec<Vec<Case>> =
            (0..THREADS).map(|_| (0..3).map(|_| random_case(&mut rng, device.is_cuda())).collect()).collect();
        std::thread::scope(|s| {
            let handles: Vec<_> = per_thread
                .iter()
                .map(|cases| {
                    let device = device.clone();
                    s.spawn(move || {
                        for c in cases {
                            common::check_case(c, &device, true).unwrap_or_else(|e| panic!("{e}: {c:?} (seed {seed})"));
                        }
                    })
                })
                .collect();
            for h in handles {
                h.join().expect("a thread's case failed (see its message above)");
            }
        });
    }
}

#[test]
fn concurrent_calls_on_separate_cuda_streams() {
    // candle gives each `Device::new_cuda_with_stream` its own stream on the same GPU: the
    // threads' kernels, workspaces and LSE slots then overlap on the device for real.
    if common::cuda_device().is_none() {
        return;
    }
    let (mut rng, seed) = common::rng();
    println!("seed {seed}");
    let per_thread: Vec<Vec<Case>> =
        (0..THREADS).map(|_| (0..3).map(|_| random_case(&mut rng, true)).collect()).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = per_thread
            .iter()
            .map(|cases| {
                s.spawn(move || {
                    let device = candle_core::Device::new_cuda_with_stream(0).unwrap();
                    for c in cases {
                        common::check_case(c, &device, true).unwrap_or_else(|e| panic!("{e}: {c:?} (seed {seed})"));
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("a thread's case failed (see its message above)");
        }
    });
}

/// Gradients of `loss(out)` for q, k, v through flash and through the reference, on one device.
fn grads_of(out: &Tensor, w: &Tensor, vars: &[&Var; 3]) -> [Tensor; 3] {
    let g = (out * w).unwrap().sum_all().unwrap().backward().unwrap();
    vars.map(|v| g.get(v).unwrap().clone())
}

#[test]
fn one_output_feeding_several_backward_passes() {
    let (mut rng, seed) = common::rng();
    for device in common::devices() {
        let dims = (2, 37, 4, 32);
        let kv = (2, 53, 2, 32);
        let var = |rng: &mut _, d: (usize, usize, usize, usize)| {
            Var::from_tensor(&common::randn(rng, &[d.0, d.1, d.2, d.3], 1.0).unwrap().to_device(&device).unwrap())
                .unwrap()
        };
        let (q, k, v) = (var(&mut rng, dims), var(&mut rng, kv), var(&mut rng, kv));
        let opts = FlashAttnOptions::new(0.2).causal(true);
        let out = candle_flash::flash_attn_with_lse(&q, &k, &v, &opts).unwrap().0;
        let out_ref = reference::attention_with_lse(&q, &k, &v, &opts).unwrap().0;
        // Three different losses over the same output, each backpropagated on its own: every
        // pass reads the LSE the forward left in the op.
        for pass in 0..3 {
            let w =
                common::randn(&mut rng, &[dims.0, dims.1, dims.2, dims.3], 1.0).unwrap().to_device(&device).unwrap();
            let ours = grads_of(&out, &w, &[&q, &k, &v]);
            let want = grads_of(&out_ref, &w, &[&q, &k, &v]);
            for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
                let e = common::max_err(&ours[i], &want[i]);
                assert!(e < 1e-3, "pass {pass} {name} error {e:.2e} on {:?} (seed {seed})", device.location());
            }
        }
    }
}

#[test]
fn graphs_built_concurrently_keep_their_own_lse() {
    let (_, seed) = common::rng();
    for device in common::devices() {
        // Each thread builds its own graph with its own shape, forward first on every thread,
        // then every backward: an LSE handed to the wrong op would have the wrong shape or values.
        let barrier = std::sync::Barrier::new(THREADS);
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let (device, barrier) = (device.clone(), &barrier);
                s.spawn(move || {
                    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed.wrapping_add(t as u64));
                    let sq = 5 + 7 * t;
                    let mk = |rng: &mut _, s: usize| {
                        Var::from_tensor(&common::randn(rng, &[1, s, 2, 16], 1.0).unwrap().to_device(&device).unwrap())
                            .unwrap()
                    };
                    let (q, k, v) = (mk(&mut rng, sq), mk(&mut rng, sq + 3), mk(&mut rng, sq + 3));
                    let opts = FlashAttnOptions::new(0.25);
                    let out = candle_flash::flash_attn_with_lse(&q, &k, &v, &opts).unwrap().0;
                    barrier.wait(); // every forward done before any backward
                    let w = common::randn(&mut rng, &[1, sq, 2, 16], 1.0).unwrap().to_device(&device).unwrap();
                    let ours = grads_of(&out, &w, &[&q, &k, &v]);
                    let out_ref = reference::attention_with_lse(&q, &k, &v, &opts).unwrap().0;
                    let want = grads_of(&out_ref, &w, &[&q, &k, &v]);
                    for i in 0..3 {
                        let e = common::max_err(&ours[i], &want[i]);
                        assert!(e < 1e-3, "thread {t} grad {i} error {e:.2e} (seed {seed})");
                    }
                });
            }
        });
    }
}

#[test]
fn thread_results_match_single_threaded_results_bitwise_on_cpu() {
    // The CPU path uses rayon inside each call; calls from several threads share its pool. The
    // result of a call must not depend on what else runs (no shared scratch between calls).
    let (mut rng, seed) = common::rng();
    let q = common::randn(&mut rng, &[2, 96, 4, 64], 1.0).unwrap().to_dtype(DType::BF16).unwrap();
    let k = common::randn(&mut rng, &[2, 130, 2, 64], 1.0).unwrap().to_dtype(DType::BF16).unwrap();
    let v = common::randn(&mut rng, &[2, 130, 2, 64], 1.0).unwrap().to_dtype(DType::BF16).unwrap();
    let alone = candle_flash::flash_attn(&q, &k, &v, 0.125, true).unwrap();
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            s.spawn(|| {
                let together = candle_flash::flash_attn(&q, &k, &v, 0.125, true).unwrap();
                let same = alone.eq(&together).unwrap().to_dtype(DType::U32).unwrap().min_all().unwrap();
                assert_eq!(same.to_scalar::<u32>().unwrap(), 1, "results differ under concurrency (seed {seed})");
            });
        }
    });
}
