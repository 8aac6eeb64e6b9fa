//! Block-sparse attention ([`BlockMask`], FlexAttention's layout) on the CPU and on the CUDA
//! kernels that read block masks (sm_90a, f16 / bf16): the builders' block lists against a
//! brute-force classification of every element, the forward and the gradients (through
//! `Tensor::backward()`) against the f64 reference with the equivalent dense mask for every rule
//! and combinations of them, with tile-breaking lengths, Sq ≠ Sk, rows that see no key, top-k
//! block indices with duplicates and out-of-range entries, the other options on top (GQA, causal
//! / window, softcap, ALiBi, sinks), f32, f16 and bf16; and the errors.

mod common;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_flash::block_mask::{BlockClass, BLOCK_SIZE};
use candle_flash::{describe_kernel_plans, flash_attn_with_lse, reference, BlockMask, FlashAttnOptions, MaskSpec};
use common::{floor, max_err, randn};
use rand::rngs::StdRng;
use rand::Rng;

const CPU: Device = Device::Cpu;

/// Sequence and head sizes of one call: (batch, Sq, Sk, H, Hkv, D).
type Dims = (usize, usize, usize, usize, usize, usize);

/// The class of every block of entry (b, h) of `mask`, `[Qb][Kb]`, read from its kv lists, and
/// checked against its q lists (the same classes transposed).
fn listed_classes(mask: &BlockMask, b: usize, h: usize) -> Result<Vec<Vec<BlockClass>>> {
    let (qb, kb) = mask.num_blocks();
    let read = |counts: &Tensor, indices: &Tensor, rows: usize, width: usize| -> Result<Vec<Vec<i32>>> {
        let counts = counts.to_vec3::<i32>()?[b][h].clone();
        let indices = indices.flatten_all()?.to_vec1::<i32>()?;
        let base = (b * mask.batch_heads().1 + h) * rows * width;
        Ok((0..rows).map(|r| indices[base + r * width..][..counts[r] as usize].to_vec()).collect())
    };
    let mut classes = vec![vec![BlockClass::Empty; kb]; qb];
    let partial = read(mask.kv_num_blocks(), mask.kv_indices(), qb, kb)?;
    let full = read(mask.full_kv_num_blocks(), mask.full_kv_indices(), qb, kb)?;
    for q in 0..qb {
        for (list, class) in [(&partial[q], BlockClass::Partial), (&full[q], BlockClass::Full)] {
            assert!(list.windows(2).all(|w| w[0] < w[1]), "lists ascend without duplicates: {list:?}");
            for &c in list {
                assert_eq!(classes[q][c as usize], BlockClass::Empty, "block ({q}, {c}) listed twice");
                classes[q][c as usize] = class;
            }
        }
    }
    let q_partial = read(mask.q_num_blocks(), mask.q_indices(), kb, qb)?;
    let q_full = read(mask.full_q_num_blocks(), mask.full_q_indices(), kb, qb)?;
    for c in 0..kb {
        for (q, row) in classes.iter().enumerate() {
            let want = row[c];
            let got = if q_partial[c].contains(&(q as i32)) {
                BlockClass::Partial
            } else if q_full[c].contains(&(q as i32)) {
                BlockClass::Full
            } else {
                BlockClass::Empty
            };
            assert_eq!(got, want, "q lists disagree with the kv lists at block ({q}, {c})");
        }
    }
    Ok(classes)
}

/// The class of block (q, c) by evaluating every element with `visible`.
fn brute_class(visible: impl Fn(usize, usize) -> bool, (sq, sk): (usize, usize), (q, c): (usize, usize)) -> BlockClass {
    let rows = q * BLOCK_SIZE..((q + 1) * BLOCK_SIZE).min(sq);
    let cols = c * BLOCK_SIZE..((c + 1) * BLOCK_SIZE).min(sk);
    let area = rows.len() * cols.len();
    let seen = rows.flat_map(|i| cols.clone().map(move |j| (i, j))).filter(|&(i, j)| visible(i, j)).count();
    match seen {
        0 => BlockClass::Empty,
        n if n == area => BlockClass::Full,
        _ => BlockClass::Partial,
    }
}

/// Sorted segment ids over `len` tokens (documents of 1 to 150 tokens).
fn segments(rng: &mut StdRng, len: usize) -> Vec<u32> {
    let (mut ids, mut id) = (Vec::with_capacity(len), 0u32);
    while ids.len() < len {
        let n = rng.random_range(1..150usize).min(len - ids.len());
        ids.extend(std::iter::repeat_n(id, n));
        id += 1;
    }
    ids
}

/// Document ids `[batch, Sq]`, `[batch, Sk]`: packed documents over the keys; each query row takes
/// the id of its key position (`i + Sk - Sq`), and rows before key 0 an id no key has.
fn documents(rng: &mut StdRng, batch: usize, (sq, sk): (usize, usize)) -> Result<(Tensor, Tensor)> {
    let (mut q_ids, mut k_ids) = (vec![], vec![]);
    for _ in 0..batch {
        let keys = segments(rng, sk);
        q_ids.extend((0..sq).map(|i| {
            let pos = i as isize + sk as isize - sq as isize;
            if pos < 0 {
                u32::MAX
            } else {
                keys[pos as usize]
            }
        }));
        k_ids.extend(keys);
    }
    Ok((Tensor::from_vec(q_ids, (batch, sq), &CPU)?, Tensor::from_vec(k_ids, (batch, sk), &CPU)?))
}

/// Every rule alone and combinations of them, for `batch` sequences of lengths (Sq, Sk).
fn rules(rng: &mut StdRng, batch: usize, (sq, sk): (usize, usize)) -> Result<Vec<(String, MaskSpec)>> {
    let (q_doc, k_doc) = documents(rng, batch, (sq, sk))?;
    let documents = MaskSpec::same_document(&q_doc, &k_doc);
    // Ids that repeat out of order (each id in many runs), one row for every sequence.
    let scattered =
        |len: usize| Tensor::from_vec((0..len as u32).map(|j| (j / 7) % 3).collect::<Vec<_>>(), (1, len), &CPU);
    let scattered = MaskSpec::same_document(&scattered(sq)?, &scattered(sk)?);
    let prefixes: Vec<u32> = (0..batch).map(|_| rng.random_range(0..=sk as u32 + 10)).collect();
    let prefix = MaskSpec::prefix_lm(&Tensor::new(prefixes.as_slice(), &CPU)?);
    Ok(vec![
        ("causal".into(), MaskSpec::causal()),
        ("window(40, 7)".into(), MaskSpec::window(Some(40), Some(7))),
        ("window(0, None)".into(), MaskSpec::window(Some(0), None)),
        ("documents".into(), documents.clone()),
        ("scattered documents".into(), scattered),
        (format!("prefix_lm {prefixes:?}"), prefix.clone()),
        ("chunked(64)".into(), MaskSpec::chunked(64)),
        ("global(5)".into(), MaskSpec::global_tokens(5)),
        ("causal and documents".into(), MaskSpec::causal().and(documents.clone())),
        ("causal and chunked(100)".into(), MaskSpec::causal().and(MaskSpec::chunked(100))),
        ("window(20, 0) or global(9)".into(), MaskSpec::window(Some(20), Some(0)).or(MaskSpec::global_tokens(9))),
        (
            "(documents and window(150, 0)) or prefix".into(),
            documents.and(MaskSpec::window(Some(150), Some(0))).or(prefix),
        ),
        ("and()".into(), MaskSpec::And(vec![])),
        ("or()".into(), MaskSpec::Or(vec![])),
    ])
}

const LENGTHS: [(usize, usize); 6] = [(1, 1), (17, 17), (113, 300), (300, 113), (300, 300), (1, 300)];

/// `from_spec` lists exactly the blocks with a visible element, as full exactly those whose every
/// element is visible; each row's key intervals are exactly its visible keys.
#[test]
fn from_spec_classifies_every_block_exactly() -> Result<()> {
    let (mut rng, seed) = common::rng();
    for (sq, sk) in LENGTHS {
        for (name, spec) in rules(&mut rng, 2, (sq, sk))? {
            let eval = spec.evaluator(2, (sq, sk))?;
            let mask = BlockMask::from_spec(&spec, 2, 1, sq, sk, &CPU)?;
            let (qb, kb) = mask.num_blocks();
            assert_eq!((qb, kb), (sq.div_ceil(BLOCK_SIZE), sk.div_ceil(BLOCK_SIZE)));
            for b in 0..2 {
                for i in 0..sq {
                    let keys: Vec<usize> = eval.row_keys(b, i).into_iter().flat_map(|(lo, hi)| lo..hi).collect();
                    let want: Vec<usize> = (0..sk).filter(|&j| eval.visible(b, 0, i, j)).collect();
                    assert_eq!(keys, want, "{name} ({sq}, {sk}) row {i} of sequence {b} (seed {seed})");
                }
                let classes = listed_classes(&mask, b, 0)?;
                for (q, row) in classes.iter().enumerate() {
                    for (c, &class) in row.iter().enumerate() {
                        let want = brute_class(|i, j| eval.visible(b, 0, i, j), (sq, sk), (q, c));
                        assert_eq!(class, want, "{name} ({sq}, {sk}) block ({q}, {c}) of {b} (seed {seed})");
                    }
                }
            }
        }
    }
    Ok(())
}

/// Random top-k lists `(B, H, Qb, k)` with duplicates and entries outside the key blocks
/// (negative and past the end), as i32 or u32.
fn top_k(
    rng: &mut StdRng,
    (batch, heads): (usize, usize),
    (sq, sk): (usize, usize),
    k: usize,
    u32s: bool,
) -> Result<Tensor> {
    let (qb, kb) = (sq.div_ceil(BLOCK_SIZE) as i32, sk.div_ceil(BLOCK_SIZE) as i32);
    let n = batch * heads * qb as usize * k;
    let picks: Vec<i32> = (0..n)
        .map(|_| match rng.random_range(0..10) {
            0 if !u32s => -1 - rng.random_range(0..3),
            1 => kb + rng.random_range(0..3),
            2 => 0, // a duplicate-prone favourite
            _ => rng.random_range(0..kb),
        })
        .collect();
    let dims = (batch, heads, qb as usize, k);
    if u32s {
        Tensor::from_vec(picks.into_iter().map(|x| x as u32).collect::<Vec<_>>(), dims, &CPU)
    } else {
        Tensor::from_vec(picks, dims, &CPU)
    }
}

/// `from_block_indices` lists each valid index once, with the class the rule gives it there
/// (full without a rule), and nothing else.
#[test]
fn from_block_indices_lists_the_valid_unique_blocks() -> Result<()> {
    let (mut rng, seed) = common::rng();
    for (sq, sk) in [(300, 300), (113, 700), (600, 113), (1, 1)] {
        for (spec, u32s) in
            [(None, false), (Some(MaskSpec::causal()), true), (Some(MaskSpec::window(Some(100), Some(0))), false)]
        {
            let indices = top_k(&mut rng, (2, 3), (sq, sk), 4, u32s)?;
            let mask = BlockMask::from_block_indices(&indices, spec.as_ref(), sq, sk)?;
            assert_eq!(mask.batch_heads(), (2, 3));
            let kb = sk.div_ceil(BLOCK_SIZE) as i64;
            let picks: Vec<i64> = indices.to_dtype(DType::I64)?.flatten_all()?.to_vec1()?;
            let picks: Vec<i64> =
                if u32s { picks.into_iter().map(|x| x as u32 as i32 as i64).collect() } else { picks };
            let eval = spec.as_ref().map(|s| s.evaluator(2, (sq, sk))).transpose()?;
            for b in 0..2 {
                for h in 0..3 {
                    let classes = listed_classes(&mask, b, h)?;
                    for (q, row) in classes.iter().enumerate() {
                        let list = &picks[((b * 3 + h) * classes.len() + q) * 4..][..4];
                        for (c, &class) in row.iter().enumerate() {
                            let picked = list.iter().any(|&x| x == c as i64 && x < kb);
                            let want = match (&eval, picked) {
                                (_, false) => BlockClass::Empty,
                                (None, true) => BlockClass::Full,
                                (Some(e), true) => brute_class(|i, j| e.visible(b, h, i, j), (sq, sk), (q, c)),
                            };
                            assert_eq!(
                                class, want,
                                "({sq}, {sk}) {spec:?} ({b}, {h}) block ({q}, {c}) {list:?} (seed {seed})"
                            );
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Output, LSE and the gradients of q, k, v (through `Tensor::backward()` of `sum(out · dout)`).
fn run(x: &[Tensor; 4], opts: &FlashAttnOptions, dtype: DType, flash: bool) -> Result<(Tensor, Tensor, [Tensor; 3])> {
    let [q, k, v, dout] = x.clone().map(|t| t.to_dtype(dtype).unwrap());
    let (q, k, v) = (Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?);
    let (out, lse) =
        if flash { flash_attn_with_lse(&q, &k, &v, opts)? } else { reference::attention_with_lse(&q, &k, &v, opts)? };
    let grads = (&out * &dout)?.sum_all()?.backward()?;
    let get = |x: &Var| grads.get(x).cloned().unwrap_or_else(|| x.zeros_like().unwrap());
    Ok((out, lse, [get(&q), get(&k), get(&v)]))
}

/// Random inputs q, k, v, dout of `dims`, rounded to `dtype` (as f32 on the CPU).
fn inputs(rng: &mut StdRng, (b, sq, sk, h, hkv, d): Dims, dtype: DType) -> Result<[Tensor; 4]> {
    let round = |t: Tensor| t.to_dtype(dtype)?.to_dtype(DType::F32);
    Ok([
        round(randn(rng, &[b, sq, h, d], 1.0)?)?,
        round(randn(rng, &[b, sk, hkv, d], 1.0)?)?,
        round(randn(rng, &[b, sk, hkv, d], 1.0)?)?,
        round(randn(rng, &[b, sq, h, d], 1.0)?)?,
    ])
}

/// The CPU flash forward and gradients through `opts` against the f64 reference with the same
/// options (the block mask's dense element mask), judged against the naive same-dtype error as
/// the parity tests do; returns the flash output and gradients.
fn check(x: &[Tensor; 4], opts: &FlashAttnOptions, dtype: DType, ctx: &str) -> Result<(Tensor, [Tensor; 3])> {
    let truth = run(x, opts, DType::F64, false)?;
    let naive = run(x, opts, dtype, false)?;
    let flash = run(x, opts, dtype, true)?;
    assert_eq!(flash.0.dtype(), dtype, "{ctx}");
    let (ef, en) = (max_err(&flash.0, &truth.0), max_err(&naive.0, &truth.0));
    let tol = 2.0 * en + floor(dtype, false);
    assert!(ef <= tol, "forward error {ef:.3e} > {tol:.3e} (naive {en:.3e}): {ctx}");
    let el = max_err(&flash.1, &truth.1);
    assert!(el <= 1e-3 + 2.0 * max_err(&naive.1, &truth.1), "lse error {el:.3e}: {ctx}");
    for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
        let (ef, en) = (max_err(&flash.2[i], &truth.2[i]), max_err(&naive.2[i], &truth.2[i]));
        let tol = 3.0 * en + floor(dtype, true);
        assert!(ef <= tol, "{name} error {ef:.3e} > {tol:.3e} (naive {en:.3e}): {ctx}");
    }
    Ok((flash.0, flash.2))
}

/// `spec` with its data tensors on `dev` (the CUDA kernels read the rule's data where it lives).
fn spec_on(spec: &MaskSpec, dev: &Device) -> Result<MaskSpec> {
    Ok(match spec {
        MaskSpec::SameDocument { q_doc, k_doc } => {
            MaskSpec::same_document(&q_doc.to_device(dev)?, &k_doc.to_device(dev)?)
        }
        MaskSpec::PrefixLm { prefix } => MaskSpec::prefix_lm(&prefix.to_device(dev)?),
        MaskSpec::And(rules) => MaskSpec::And(rules.iter().map(|r| spec_on(r, dev)).collect::<Result<_>>()?),
        MaskSpec::Or(rules) => MaskSpec::Or(rules.iter().map(|r| spec_on(r, dev)).collect::<Result<_>>()?),
        rule => rule.clone(),
    })
}

/// `opts` with every tensor option on `dev` and the block mask `mask` (built for `dev`).
fn opts_on(opts: &FlashAttnOptions, mask: &BlockMask, dev: &Device) -> Result<FlashAttnOptions> {
    let mut o = opts.clone().block_mask(Some(mask));
    o.alibi_slopes = opts.alibi_slopes.as_ref().map(|t| t.to_device(dev)).transpose()?;
    o.sinks = opts.sinks.as_ref().map(|t| t.to_device(dev)).transpose()?;
    Ok(o)
}

/// [`check`] on the GPU: the flash call on `gpu` through `gpu_opts` (the same mask built there)
/// against the f64 reference and the naive same-dtype computation on the CPU through `opts`.
fn check_gpu(
    gpu: &Device,
    x: &[Tensor; 4],
    opts: &FlashAttnOptions,
    gpu_opts: &FlashAttnOptions,
    dtype: DType,
    ctx: &str,
) -> Result<()> {
    let truth = run(x, opts, DType::F64, false)?;
    let naive = run(x, opts, dtype, false)?;
    let xg = x.clone().map(|t| t.to_device(gpu).unwrap());
    let flash = run(&xg, gpu_opts, dtype, true)?;
    let cpu = |t: &Tensor| t.to_device(&CPU).unwrap();
    let (ef, en) = (max_err(&cpu(&flash.0), &truth.0), max_err(&naive.0, &truth.0));
    let tol = 2.0 * en + floor(dtype, false);
    assert!(ef <= tol, "forward error {ef:.3e} > {tol:.3e} (naive {en:.3e}): {ctx}");
    let el = max_err(&cpu(&flash.1), &truth.1);
    assert!(el <= 1e-3 + 2.0 * max_err(&naive.1, &truth.1), "lse error {el:.3e}: {ctx}");
    for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
        let (ef, en) = (max_err(&cpu(&flash.2[i]), &truth.2[i]), max_err(&naive.2[i], &truth.2[i]));
        let tol = 3.0 * en + floor(dtype, true);
        assert!(ef <= tol, "{name} error {ef:.3e} > {tol:.3e} (naive {en:.3e}): {ctx}");
    }
    Ok(())
}

/// The CUDA kernels through block masks (the sm_90a forward and backward, f16 / bf16) against the
/// reference: every rule at tile-breaking lengths and Sq ≠ Sk, each head-dim tile (64, 96, 128,
/// 192, 256), top-k lists per head with duplicates and out-of-range entries, and the other options
/// on top (GQA, causal, windows, softcap, ALiBi, sinks).
#[test]
fn cuda_kernels_match_the_reference() -> Result<()> {
    let Some(gpu) = common::cuda_device() else { return Ok(()) };
    let (mut rng, seed) = common::rng();
    for (sq, sk) in [(1, 300), (17, 17), (113, 300), (300, 113), (1023, 1023)] {
        for (name, spec) in rules(&mut rng, 2, (sq, sk))? {
            let dtype = if name.len() % 2 == 0 { DType::BF16 } else { DType::F16 };
            let mask = BlockMask::from_spec(&spec, 2, 1, sq, sk, &CPU)?;
            let gmask = BlockMask::from_spec(&spec_on(&spec, &gpu)?, 2, 1, sq, sk, &gpu)?;
            let opts = FlashAttnOptions::new(0.17).block_mask(Some(&mask));
            let x = inputs(&mut rng, (2, sq, sk, 2, 1, 64), dtype)?;
            let ctx = format!("cuda {name} ({sq}, {sk}) {dtype:?} (seed {seed})");
            check_gpu(&gpu, &x, &opts, &opts_on(&opts, &gmask, &gpu)?, dtype, &ctx)?;
        }
    }
    // Each head-dim tile, a rule with partial blocks of every kind.
    let (sq, sk) = (300, 260);
    let (q_doc, k_doc) = documents(&mut rng, 2, (sq, sk))?;
    let spec = MaskSpec::causal().and(MaskSpec::same_document(&q_doc, &k_doc)).or(MaskSpec::global_tokens(3));
    let mask = BlockMask::from_spec(&spec, 2, 1, sq, sk, &CPU)?;
    let gmask = BlockMask::from_spec(&spec_on(&spec, &gpu)?, 2, 1, sq, sk, &gpu)?;
    for (d, dtype) in [(40, DType::BF16), (96, DType::F16), (128, DType::BF16), (192, DType::F16), (256, DType::BF16)] {
        let opts = FlashAttnOptions::new(0.12).block_mask(Some(&mask));
        let x = inputs(&mut rng, (2, sq, sk, 4, 2, d), dtype)?;
        let ctx = format!("cuda d = {d} {dtype:?} (seed {seed})");
        check_gpu(&gpu, &x, &opts, &opts_on(&opts, &gmask, &gpu)?, dtype, &ctx)?;
    }
    // Top-k lists per (batch, head), with duplicates and bad entries, alone and causal inside.
    for (spec, u32s) in [(None, true), (Some(MaskSpec::causal()), false)] {
        let (sq, sk) = (400, 530);
        let indices = top_k(&mut rng, (2, 4), (sq, sk), 3, u32s)?;
        let mask = BlockMask::from_block_indices(&indices, spec.as_ref(), sq, sk)?;
        let gmask = BlockMask::from_block_indices(&indices.to_device(&gpu)?, spec.as_ref(), sq, sk)?;
        for (h, hkv) in [(4, 4), (4, 1)] {
            let opts = FlashAttnOptions::new(0.2).block_mask(Some(&mask));
            let x = inputs(&mut rng, (2, sq, sk, h, hkv, 128), DType::BF16)?;
            let ctx = format!("cuda top-k {spec:?} ({h}, {hkv}) (seed {seed})");
            check_gpu(&gpu, &x, &opts, &opts_on(&opts, &gmask, &gpu)?, DType::BF16, &ctx)?;
        }
    }
    // The other options on top.
    let docs = BlockMask::from_spec(&MaskSpec::same_document(&q_doc, &k_doc), 2, 1, sq, sk, &CPU)?;
    let gdocs = BlockMask::from_spec(&spec_on(&MaskSpec::same_document(&q_doc, &k_doc), &gpu)?, 2, 1, sq, sk, &gpu)?;
    let alibi = Tensor::new(&[0.3f32, 0.1, 0.05, 0.2], &CPU)?;
    let sinks = Tensor::new(&[1.0f32, -2.0, 0.5, 3.0], &CPU)?;
    let base = FlashAttnOptions::new(0.2);
    for (name, opts) in [
        ("causal", base.clone().causal(true)),
        ("window(50, 10), softcap", base.clone().window(Some(50), Some(10)).softcap(Some(3.0))),
        ("alibi, causal", base.clone().alibi(Some(&alibi)).causal(true)),
        ("sinks", base.clone().sinks(Some(&sinks))),
    ] {
        for ((h, hkv), dtype) in [((4, 1), DType::BF16), ((4, 4), DType::F16)] {
            let opts = opts.clone().block_mask(Some(&docs));
            let x = inputs(&mut rng, (2, sq, sk, h, hkv, 64), dtype)?;
            let ctx = format!("cuda documents, {name} ({h}, {hkv}) {dtype:?} (seed {seed})");
            check_gpu(&gpu, &x, &opts, &opts_on(&opts, &gdocs, &gpu)?, dtype, &ctx)?;
        }
    }
    Ok(())
}

/// The kernels a block mask runs on: the sm_90a forward's 128-row tiles whose key blocks divide
/// the mask's (not the long-block or 192-row tiles the same call takes without a mask), the
/// sm_90a backward with atomic dQ.
#[test]
fn cuda_block_mask_plans() -> Result<()> {
    let Some(gpu) = common::cuda_device() else { return Ok(()) };
    let n = 4096;
    let mask = BlockMask::from_spec(&MaskSpec::causal(), 1, 1, n, n, &gpu)?;
    for (d, fwd, bwd) in [
        (64, "wgmma D64Short ", "wgmma tile=64 dq=atomic"),
        (128, "wgmma D128 ", "wgmma tile=128 dq=atomic"),
        (256, "wgmma D256 ", "wgmma_wide tile=256 dq=atomic"),
    ] {
        let q = Tensor::zeros((1, n, 2, d), DType::BF16, &gpu)?;
        let plans = describe_kernel_plans(&q, &q, &q, &FlashAttnOptions::new(0.1).block_mask(Some(&mask)))?;
        assert!(plans.forward.starts_with(fwd), "d = {d}: forward plan {:?}", plans.forward);
        let backward = plans.backward.unwrap_or_default();
        assert!(backward.starts_with(bwd), "d = {d}: backward plan {backward:?}");
    }
    Ok(())
}

/// On CUDA, what the block-mask kernels do not take is an error that says what they take: f32,
/// head dims up to 32, the deterministic backward, rule data on another device.
#[test]
fn cuda_block_masks_outside_the_kernels_are_errors() -> Result<()> {
    let Some(gpu) = common::cuda_device() else { return Ok(()) };
    let mask = BlockMask::from_spec(&MaskSpec::causal(), 1, 1, 200, 300, &gpu)?;
    let opts = FlashAttnOptions::new(0.25).block_mask(Some(&mask));
    let t = |dims: &[usize], dtype: DType| Tensor::zeros(dims, dtype, &gpu).unwrap();
    for (d, dtype) in [(64, DType::F32), (32, DType::BF16)] {
        let (q, k) = (t(&[1, 200, 2, d], dtype), t(&[1, 300, 2, d], dtype));
        let e = err_text(flash_attn_with_lse(&q, &k, &k, &opts));
        assert!(e.contains("block masks run on CUDA on the sm_90a"), "d = {d} {dtype:?}: {e}");
    }
    let (q, k) = (t(&[1, 200, 2, 64], DType::BF16), t(&[1, 300, 2, 64], DType::BF16));
    let (out, lse) = flash_attn_with_lse(&q, &k, &k, &opts)?;
    let det = opts.clone().deterministic(true);
    let e = err_text(candle_flash::flash_attn_grads(&q, &k, &k, &out, &out, &lse, &det).map(|g| g.dq));
    assert!(e.contains("not deterministic"), "{e}");
    let ids = Tensor::zeros((1, 300), DType::U32, &CPU)?;
    let cpu_rule = BlockMask::from_spec(&MaskSpec::same_document(&ids, &ids), 1, 1, 300, 300, &gpu)?;
    let k = t(&[1, 300, 2, 64], DType::BF16);
    let e = err_text(flash_attn_with_lse(&k, &k, &k, &FlashAttnOptions::new(0.25).block_mask(Some(&cpu_rule))));
    assert!(e.contains("rule's data is on"), "{e}");
    Ok(())
}

/// [`check`] of attention through `mask` alone, on fresh inputs of `dims` in each of `dtypes`.
fn check_dtypes(rng: &mut StdRng, mask: &BlockMask, dims: Dims, dtypes: &[DType], ctx: &str) -> Result<()> {
    let opts = FlashAttnOptions::new(0.17).block_mask(Some(mask));
    for &dtype in dtypes {
        check(&inputs(rng, dims, dtype)?, &opts, dtype, &format!("{ctx} {dtype:?}"))?;
    }
    Ok(())
}

/// Every rule and combination at tile-breaking lengths, Sq ≠ Sk included, f32; bf16 at two of them.
#[test]
fn every_rule_matches_the_reference() -> Result<()> {
    let (mut rng, seed) = common::rng();
    for (sq, sk) in LENGTHS {
        let dtypes: &[DType] =
            if [(113, 300), (300, 113)].contains(&(sq, sk)) { &[DType::F32, DType::BF16] } else { &[DType::F32] };
        for (name, spec) in rules(&mut rng, 2, (sq, sk))? {
            let mask = BlockMask::from_spec(&spec, 2, 1, sq, sk, &CPU)?;
            check_dtypes(
                &mut rng,
                &mask,
                (2, sq, sk, 2, 1, 32),
                dtypes,
                &format!("{name} ({sq}, {sk}) (seed {seed})"),
            )?;
        }
    }
    Ok(())
}

/// Top-k block lists (per batch entry and head, duplicates and bad entries in them), alone and
/// with a causal rule inside the blocks, with i32 and u32 indices.
#[test]
fn top_k_blocks_match_the_reference() -> Result<()> {
    let (mut rng, seed) = common::rng();
    for (sq, sk) in [(300, 300), (113, 400), (400, 113)] {
        for (spec, u32s) in [(None, true), (Some(MaskSpec::causal()), false)] {
            let indices = top_k(&mut rng, (2, 4), (sq, sk), 2, u32s)?;
            let mask = BlockMask::from_block_indices(&indices, spec.as_ref(), sq, sk)?;
            let ctx = format!("top-k {spec:?} ({sq}, {sk}) (seed {seed})");
            check_dtypes(&mut rng, &mask, (2, sq, sk, 4, 2, 48), &[DType::F32, DType::BF16], &ctx)?;
        }
    }
    Ok(())
}

/// The block mask intersected with the other options: causal and windows of the options, softcap,
/// ALiBi, sinks, MQA / GQA, f16 and bf16, and a mask per head.
#[test]
fn block_masks_with_the_other_options() -> Result<()> {
    let (mut rng, seed) = common::rng();
    let (sq, sk) = (300, 260);
    let (q_doc, k_doc) = documents(&mut rng, 2, (sq, sk))?;
    let docs = BlockMask::from_spec(&MaskSpec::same_document(&q_doc, &k_doc), 2, 1, sq, sk, &CPU)?;
    let chunks = BlockMask::from_spec(&MaskSpec::chunked(96).or(MaskSpec::global_tokens(3)), 1, 1, sq, sk, &CPU)?;
    let per_head = BlockMask::from_block_indices(&top_k(&mut rng, (1, 4), (sq, sk), 2, false)?, None, sq, sk)?;
    let alibi = Tensor::new(&[0.3f32, 0.1, 0.05, 0.2], &CPU)?;
    let sinks = Tensor::new(&[1.0f32, -2.0, 0.5, 3.0], &CPU)?;
    let base = FlashAttnOptions::new(0.2);
    let cases = [
        ("documents, causal", &docs, base.clone().causal(true)),
        ("documents, window(50, 10), softcap", &docs, base.clone().window(Some(50), Some(10)).softcap(Some(3.0))),
        ("chunks, alibi, causal", &chunks, base.clone().alibi(Some(&alibi)).causal(true)),
        ("chunks, sinks", &chunks, base.clone().sinks(Some(&sinks))),
        ("per head, sinks, softcap", &per_head, base.clone().sinks(Some(&sinks)).softcap(Some(5.0))),
        ("per head, causal, alibi", &per_head, base.clone().causal(true).alibi(Some(&alibi))),
    ];
    for (name, mask, opts) in cases {
        let opts = opts.block_mask(Some(mask));
        for ((h, hkv), dtype) in [((4, 1), DType::F32), ((4, 2), DType::BF16), ((4, 4), DType::F16)] {
            let x = inputs(&mut rng, (2, sq, sk, h, hkv, 40), dtype)?;
            check(&x, &opts, dtype, &format!("{name} ({h}, {hkv}) {dtype:?} (seed {seed})"))?;
        }
    }
    Ok(())
}

/// The mask's causal rule is the options' causal mask (bottom-right aligned for Sq ≠ Sk), and a
/// window rule the options' window: the same results, on the same kernels.
#[test]
fn rules_follow_the_options_conventions() -> Result<()> {
    let (mut rng, seed) = common::rng();
    for (sq, sk) in [(113, 300), (300, 113), (1, 300)] {
        let x = inputs(&mut rng, (1, sq, sk, 2, 2, 32), DType::F32)?;
        for (spec, opts) in [
            (MaskSpec::causal(), FlashAttnOptions::new(0.2).causal(true)),
            (MaskSpec::window(Some(30), Some(4)), FlashAttnOptions::new(0.2).window(Some(30), Some(4))),
        ] {
            let mask = BlockMask::from_spec(&spec, 1, 1, sq, sk, &CPU)?;
            let masked = run(&x, &FlashAttnOptions::new(0.2).block_mask(Some(&mask)), DType::F32, true)?;
            let plain = run(&x, &opts, DType::F32, true)?;
            let e = max_err(&masked.0, &plain.0);
            assert!(e <= 1e-5, "{spec:?} ({sq}, {sk}): {e:.2e} from the options' mask (seed {seed})");
            for i in 0..3 {
                assert!(max_err(&masked.2[i], &plain.2[i]) <= 1e-4, "{spec:?} ({sq}, {sk}) gradient {i} (seed {seed})");
            }
        }
    }
    Ok(())
}

/// Rows that see no key through the mask: output 0, LSE -inf (or the sink's logit), zero dq; keys
/// that no row sees get zero dk and dv.
#[test]
fn rows_without_keys_give_zeros() -> Result<()> {
    let (mut rng, seed) = common::rng();
    let (sq, sk) = (200, 300);
    // Query rows 0..100 belong to no key's document; keys 150..300 to no query's.
    let q_doc: Vec<u32> = (0..sq as u32).map(|i| if i < 100 { 7 } else { 1 }).collect();
    let k_doc: Vec<u32> = (0..sk as u32).map(|j| if j < 150 { 1 } else { 2 }).collect();
    let spec = MaskSpec::same_document(
        &Tensor::new(q_doc.as_slice(), &CPU)?.unsqueeze(0)?,
        &Tensor::new(k_doc.as_slice(), &CPU)?.unsqueeze(0)?,
    );
    let mask = BlockMask::from_spec(&spec, 1, 1, sq, sk, &CPU)?;
    let sinks = Tensor::new(&[0.5f32, -1.0], &CPU)?;
    for sink in [None, Some(&sinks)] {
        let opts = FlashAttnOptions::new(0.2).block_mask(Some(&mask)).sinks(sink);
        for dtype in [DType::F32, DType::BF16] {
            let x = inputs(&mut rng, (2, sq, sk, 2, 1, 32), dtype)?;
            let (out, [dq, dk, dv]) =
                check(&x, &opts, dtype, &format!("empty rows, sinks {sink:?} {dtype:?} (seed {seed})"))?;
            let zero = |t: &Tensor| max_err(t, &t.zeros_like().unwrap()) == 0.0;
            assert!(zero(&out.narrow(1, 0, 100)?), "rows without keys: output 0");
            assert!(zero(&dq.narrow(1, 0, 100)?), "rows without keys: dq 0");
            assert!(zero(&dk.narrow(1, 150, 150)?) && zero(&dv.narrow(1, 150, 150)?), "keys nobody sees: dk, dv 0");
            assert!(!zero(&out.narrow(1, 100, 100)?), "the other rows see keys");
            let (_, lse) =
                flash_attn_with_lse(&x[0].to_dtype(dtype)?, &x[1].to_dtype(dtype)?, &x[2].to_dtype(dtype)?, &opts)?;
            let lse = lse.to_vec3::<f32>()?;
            for (h, row) in lse[0].iter().enumerate() {
                let want = sink.map_or(f32::NEG_INFINITY, |_| [0.5f32, -1.0][h]);
                assert!(row[..100].iter().all(|&l| l == want), "lse of rows without keys, head {h}: {:?}", &row[..3]);
            }
        }
    }
    Ok(())
}

fn err_text<T: std::fmt::Debug>(r: Result<T>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.to_string(),
    }
}

/// Bad masks and bad builder arguments are errors naming the values, never panics.
#[test]
fn bad_block_masks_are_errors() -> Result<()> {
    let t = |dims: &[usize]| Tensor::zeros(dims, DType::F32, &CPU).unwrap();
    let (q, k) = (t(&[2, 200, 4, 16]), t(&[2, 300, 2, 16]));
    let call = |mask: &BlockMask| flash_attn_with_lse(&q, &k, &k, &FlashAttnOptions::new(0.25).block_mask(Some(mask)));
    let other_lengths = BlockMask::from_spec(&MaskSpec::causal(), 1, 1, 200, 299, &CPU)?;
    let e = err_text(call(&other_lengths));
    assert!(e.contains("seqlen_k 299") && e.contains("300"), "{e}");
    let batch_3 = BlockMask::from_spec(&MaskSpec::causal(), 3, 1, 200, 300, &CPU)?;
    let e = err_text(call(&batch_3));
    assert!(e.contains("batch 3") && e.contains("batch 2"), "{e}");
    let heads_2 = BlockMask::from_spec(&MaskSpec::causal(), 1, 2, 200, 300, &CPU)?;
    let e = err_text(call(&heads_2));
    assert!(e.contains("heads 2") && e.contains("4 query heads"), "{e}");
    // The varlen layout with a block mask.
    let ok = BlockMask::from_spec(&MaskSpec::causal(), 1, 1, 200, 300, &CPU)?;
    let seqlens = Tensor::new(&[0u32, 200], &CPU)?;
    let varlen =
        candle_flash::VarLen { seqlens_q: seqlens.clone(), seqlens_k: seqlens, max_seqlen_q: 200, max_seqlen_k: 200 };
    let opts = FlashAttnOptions::new(0.25).varlen(Some(varlen)).block_mask(Some(&ok));
    let e = err_text(flash_attn_with_lse(&t(&[200, 4, 16]), &t(&[200, 2, 16]), &t(&[200, 2, 16]), &opts));
    assert!(e.contains("varlen"), "{e}");
    // Builders.
    let e = err_text(BlockMask::from_block_indices(&Tensor::zeros((1, 1, 3, 2), DType::I32, &CPU)?, None, 200, 300));
    assert!(e.contains("(B, H, 2, k)") && e.contains("[1, 1, 3, 2]"), "{e}");
    let e = err_text(BlockMask::from_block_indices(&t(&[1, 1, 2, 2]), None, 200, 300));
    assert!(e.contains("u32 or i32") && e.contains("F32"), "{e}");
    let e = err_text(BlockMask::from_spec(&MaskSpec::chunked(0), 1, 1, 200, 300, &CPU));
    assert!(e.contains("chunk") && e.contains("0"), "{e}");
    let ids = Tensor::zeros((2, 199), DType::U32, &CPU)?;
    let e = err_text(BlockMask::from_spec(&MaskSpec::same_document(&ids, &ids), 2, 1, 200, 300, &CPU));
    assert!(e.contains("[2, 200]") && e.contains("[2, 199]"), "{e}");
    let e =
        err_text(BlockMask::from_spec(&MaskSpec::prefix_lm(&Tensor::new(&[1u32, 2, 3], &CPU)?), 2, 1, 200, 300, &CPU));
    assert!(e.contains("prefix") && e.contains("[3]"), "{e}");
    let e = err_text(BlockMask::from_spec(&MaskSpec::causal(), 0, 1, 200, 300, &CPU));
    assert!(e.contains("batch 0"), "{e}");
    // A mask built for another device than the call's.
    if let Some(gpu) = common::cuda_device() {
        let (q, k) = (q.to_device(&gpu)?, k.to_device(&gpu)?);
        let e = err_text(flash_attn_with_lse(&q, &k, &k, &FlashAttnOptions::new(0.25).block_mask(Some(&ok))));
        assert!(e.contains("block_mask is on"), "{e}");
    }
    Ok(())
}

/// One mask serves many calls (layers) and clones: the same results as a freshly built one.
#[test]
fn a_mask_is_reused_across_calls() -> Result<()> {
    let (mut rng, seed) = common::rng();
    let spec = MaskSpec::causal().and(MaskSpec::chunked(128 + 37));
    let mask = BlockMask::from_spec(&spec, 1, 1, 300, 300, &CPU)?;
    let opts = FlashAttnOptions::new(0.2).block_mask(Some(&mask));
    for layer in 0..3 {
        let x = inputs(&mut rng, (1, 300, 300, 2, 2, 16), DType::F32)?;
        let fresh = BlockMask::from_spec(&spec, 1, 1, 300, 300, &CPU)?;
        let a = flash_attn_with_lse(&x[0], &x[1], &x[2], &opts)?.0;
        let b = flash_attn_with_lse(&x[0], &x[1], &x[2], &opts.clone().block_mask(Some(&fresh.clone())))?.0;
        assert!(max_err(&a, &b) == 0.0, "layer {layer} (seed {seed})");
    }
    assert!(mask.density()? > 0.0 && mask.density()? < 1.0);
    Ok(())
}

/// Key blocks that no query block lists are never read, forward or backward: NaN keys and values
/// there reach no output or gradient, and their dk and dv are 0.
#[test]
fn unlisted_key_blocks_are_never_read() -> Result<()> {
    let (mut rng, seed) = common::rng();
    let (sq, sk) = (400, 512);
    // Every query block picks among key blocks 0 and 2 (and entries outside the blocks).
    let picks: Vec<i32> = (0..2 * 4 * 4).map(|n| [0, 2, -1, 9][n % 4]).collect();
    let indices = Tensor::from_vec(picks, (2, 1, 4, 4), &CPU)?;
    for spec in [None, Some(MaskSpec::causal())] {
        let mask = BlockMask::from_block_indices(&indices, spec.as_ref(), sq, sk)?;
        let opts = FlashAttnOptions::new(0.2).block_mask(Some(&mask));
        for dtype in [DType::F32, DType::BF16] {
            let [q, k, v, dout] = inputs(&mut rng, (2, sq, sk, 4, 2, 32), dtype)?;
            let unread = |t: &Tensor| -> Result<Tensor> {
                let nan = Tensor::full(f32::NAN, (2, 128, 2, 32), &CPU)?;
                Tensor::cat(&[&t.narrow(1, 0, 128)?, &nan, &t.narrow(1, 256, 128)?, &nan], 1)
            };
            let x = [q, unread(&k)?, unread(&v)?, dout];
            let ctx = format!("{spec:?} {dtype:?} (seed {seed})");
            let (out, _, [dq, dk, dv]) = run(&x, &opts, dtype, true)?;
            for (name, t) in [("out", &out), ("dq", &dq)] {
                assert!(max_err(t, &t.zeros_like()?).is_finite(), "{name} holds a NaN: {ctx}");
            }
            for (name, t) in [("dk", &dk), ("dv", &dv)] {
                for (start, unlisted) in [(0, false), (128, true), (256, false), (384, true)] {
                    let part = t.narrow(1, start, 128)?;
                    let e = max_err(&part, &part.zeros_like()?);
                    assert!(e.is_finite() && (e == 0.0) == unlisted, "{name} keys {start}.. ({e:e}): {ctx}");
                }
            }
        }
    }
    Ok(())
}

/// Through a block mask, the sinks' gradient (sinks as a `Var`) matches the reference's, and the
/// explicit backward gives autograd's gradients.
#[test]
fn sinks_gradient_and_explicit_backward() -> Result<()> {
    let (mut rng, seed) = common::rng();
    let (sq, sk) = (260, 300);
    let mask = BlockMask::from_spec(&MaskSpec::causal().and(MaskSpec::chunked(100)), 1, 1, sq, sk, &CPU)?;
    let x = inputs(&mut rng, (2, sq, sk, 4, 2, 32), DType::F32)?;
    let sink_logits = Tensor::new(&[0.5f32, -1.0, 2.0, 0.0], &CPU)?;
    let dsinks = |dtype: DType, flash: bool| -> Result<Tensor> {
        let sinks = Var::from_tensor(&sink_logits)?;
        let opts = FlashAttnOptions::new(0.2).block_mask(Some(&mask)).sinks(Some(sinks.as_tensor()));
        let [q, k, v, dout] = x.clone().map(|t| t.to_dtype(dtype).unwrap());
        let out =
            if flash { flash_attn_with_lse(&q, &k, &v, &opts)?.0 } else { reference::attention(&q, &k, &v, &opts)? };
        let grads = (&out * &dout)?.sum_all()?.backward()?;
        Ok(grads.get(&sinks).expect("the sinks' gradient").clone())
    };
    let (truth, naive, flash) = (dsinks(DType::F64, false)?, dsinks(DType::F32, false)?, dsinks(DType::F32, true)?);
    let (ef, en) = (max_err(&flash, &truth), max_err(&naive, &truth));
    // dsinks sums a term over every row of a head (as in tests/parity.rs).
    let tol = 3.0 * en + floor(DType::F32, true) * ((2 * sq) as f64).sqrt();
    assert!(ef <= tol, "dsinks error {ef:.3e} > {tol:.3e} (naive {en:.3e}, seed {seed})");

    let opts = FlashAttnOptions::new(0.2).block_mask(Some(&mask)).sinks(Some(&sink_logits));
    let (out, _, autograd) = run(&x, &opts, DType::F32, true)?;
    let lse = flash_attn_with_lse(&x[0], &x[1], &x[2], &opts)?.1;
    let (dq, dk, dv) = candle_flash::flash_attn_backward(&x[0], &x[1], &x[2], &out.detach(), &x[3], &lse, &opts)?;
    for (name, explicit, auto) in [("dq", &dq, &autograd[0]), ("dk", &dk, &autograd[1]), ("dv", &dv, &autograd[2])] {
        assert!(max_err(explicit, auto) == 0.0, "{name}: the explicit backward differs from autograd's (seed {seed})");
    }
    Ok(())
}

/// Empty query or key sequences: masks with no blocks on that axis, zero outputs and gradients.
#[test]
fn empty_sequences() -> Result<()> {
    let (mut rng, seed) = common::rng();
    for (sq, sk) in [(0, 5), (5, 0), (0, 0)] {
        let mask = BlockMask::from_spec(&MaskSpec::causal().or(MaskSpec::global_tokens(2)), 1, 1, sq, sk, &CPU)?;
        assert_eq!(mask.num_blocks(), (sq.div_ceil(BLOCK_SIZE), sk.div_ceil(BLOCK_SIZE)));
        let opts = FlashAttnOptions::new(0.3).block_mask(Some(&mask));
        let x = inputs(&mut rng, (2, sq, sk, 2, 1, 8), DType::F32)?;
        let (out, _, [dq, dk, dv]) = run(&x, &opts, DType::F32, true)?;
        assert_eq!(out.dims(), &[2, sq, 2, 8]);
        for t in [&out, &dq, &dk, &dv] {
            assert!(max_err(t, &t.zeros_like()?) == 0.0, "({sq}, {sk}) (seed {seed})");
        }
    }
    Ok(())
}
