//! Every public function of the crate against `candle_flash::reference::attention` (computed in
//! f64) on small CPU tensors, including the way candle-transformers calls `flash_attn`: q, k, v
//! built as `(b, h, s, d)`, K/V heads repeated with `repeat_kv`, then `.transpose(1, 2)` into
//! non-contiguous `(b, s, h, d)` views; causal prefill and non-causal one-token decode.
//! `cargo test -p candle-flash-attn --no-default-features`

use candle_core::{DType, Device, IndexOp, Result, Tensor};
use candle_flash::reference::attention;
use candle_flash::{FlashAttnOptions, VarLen};

/// f32 against the f64 reference: max |diff| / max |ref|.
const TOL: f64 = 1e-5;

/// Deterministic values in [-scale, scale) (a 64-bit LCG).
fn rand_tensor(shape: &[usize], scale: f32, seed: u64) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let data: Vec<f32> = (0..n)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu)
}

/// candle-transformers' `utils::repeat_kv` on `(b, n_kv, s, d)`.
fn repeat_kv(xs: &Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(xs.clone());
    }
    let (b, n_kv, s, d) = xs.dims4()?;
    Tensor::cat(&vec![xs; n_rep], 2)?.reshape((b, n_kv * n_rep, s, d))
}

fn max_abs(t: &Tensor) -> Result<f64> {
    t.to_dtype(DType::F64)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()
}

/// max |got - want| / max |want|.
fn rel_err(got: &Tensor, want: &Tensor) -> Result<f64> {
    assert_eq!(got.dims(), want.dims(), "shapes differ");
    let diff = (got.to_dtype(DType::F64)? - want.to_dtype(DType::F64)?)?;
    Ok(max_abs(&diff)? / max_abs(want)?)
}

fn assert_close(name: &str, got: &Tensor, want: &Tensor, tol: f64) -> Result<()> {
    assert!(max_abs(want)? > 1e-3, "{name}: reference is all zeros");
    let err = rel_err(got, want)?;
    assert!(err <= tol, "{name}: max |diff| / max |ref| = {err:e} > {tol:e}");
    Ok(())
}

/// The test's options really change the result: `other` (another mask, no softcap, ...) is far
/// from `want`, so a function that ignored the option would fail `assert_close`.
fn assert_differs(name: &str, want: &Tensor, other: &Tensor) -> Result<()> {
    let err = rel_err(other, want)?;
    assert!(err > 1e-3, "{name}: the option does not change the result ({err:e}); the test would not see it ignored");
    Ok(())
}

/// The reference in f64 on contiguous copies.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, opts: &FlashAttnOptions) -> Result<Tensor> {
    let f = |t: &Tensor| t.to_dtype(DType::F64)?.contiguous();
    attention(&f(q)?, &f(k)?, &f(v)?, opts)
}

/// q, k, v as candle-transformers hands them to `flash_attn`: `(b, s, h, d)` views of
/// `(b, h, s, d)` tensors, k and v with their `hkv` heads repeated to `h`.
fn transformers_qkv(
    b: usize,
    h: usize,
    hkv: usize,
    sq: usize,
    sk: usize,
    d: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let q = rand_tensor(&[b, h, sq, d], 1.0, 1)?;
    let k = repeat_kv(&rand_tensor(&[b, hkv, sk, d], 1.0, 2)?, h / hkv)?;
    let v = repeat_kv(&rand_tensor(&[b, hkv, sk, d], 1.0, 3)?, h / hkv)?;
    let (q, k, v) = (q.transpose(1, 2)?, k.transpose(1, 2)?, v.transpose(1, 2)?);
    // Views, as in the models (q of one row is contiguous anyway).
    assert!((sq == 1 || !q.is_contiguous()) && !k.is_contiguous() && !v.is_contiguous());
    assert_eq!(q.stride()[3], 1);
    Ok((q, k, v))
}

/// Batched q `(b, sq, h, d)`, k/v `(b, sk, hkv, d)` (GQA without repeating).
fn batched_qkv(b: usize, h: usize, hkv: usize, sq: usize, sk: usize, d: usize) -> Result<(Tensor, Tensor, Tensor)> {
    Ok((
        rand_tensor(&[b, sq, h, d], 1.0, 11)?,
        rand_tensor(&[b, sk, hkv, d], 1.0, 12)?,
        rand_tensor(&[b, sk, hkv, d], 1.0, 13)?,
    ))
}

fn scale(d: usize) -> f32 {
    1.0 / (d as f32).sqrt()
}

#[test]
#[allow(clippy::type_complexity)]
fn signatures_are_candle_flash_attn_0_11_1() {
    // Each function coerced to the type of candle-flash-attn 0.11.1's function of that name: a
    // signature that drifted would not compile.
    type T<'a> = &'a Tensor;
    let _: fn(T, T, T, f32, bool) -> Result<Tensor> = candle_flash_attn::flash_attn;
    let _: fn(T, T, T, f32, Option<usize>, Option<usize>) -> Result<Tensor> = candle_flash_attn::flash_attn_windowed;
    let _: fn(T, T, T, T, f32, bool) -> Result<Tensor> = candle_flash_attn::flash_attn_alibi;
    let _: fn(T, T, T, T, f32, Option<usize>, Option<usize>) -> Result<Tensor> =
        candle_flash_attn::flash_attn_alibi_windowed;
    let _: fn(T, T, T, Option<T>, f32, Option<usize>, Option<usize>, f32) -> Result<Tensor> =
        candle_flash_attn::flash_attn_alibi_windowed_softcap;
    let _: fn(T, T, T, T, T, usize, usize, f32, bool) -> Result<Tensor> = candle_flash_attn::flash_attn_varlen;
    let _: fn(T, T, T, T, T, usize, usize, f32, Option<usize>, Option<usize>) -> Result<Tensor> =
        candle_flash_attn::flash_attn_varlen_windowed;
    let _: fn(
        T,
        T,
        T,
        T,
        T,
        T,
        Option<T>,
        usize,
        usize,
        f32,
        Option<usize>,
        Option<usize>,
        usize,
        Option<f32>,
    ) -> Result<Tensor> = candle_flash_attn::flash_attn_varlen_paged_windowed;
    let _: fn(T, T, T, T, T, T, usize, usize, f32, bool) -> Result<Tensor> = candle_flash_attn::flash_attn_varlen_alibi;
    let _: fn(T, T, T, T, T, T, usize, usize, f32, Option<usize>, Option<usize>) -> Result<Tensor> =
        candle_flash_attn::flash_attn_varlen_alibi_windowed;
    let _: fn(T, T, T, Option<T>, T, T, usize, usize, f32, Option<usize>, Option<usize>, f32) -> Result<Tensor> =
        candle_flash_attn::flash_attn_varlen_alibi_windowed_softcap;
}

#[test]
fn flash_attn_as_candle_transformers_prefill() -> Result<()> {
    // Llama-like: 8 query heads, 2 KV heads repeated, causal because seq_len > 1.
    for (d, hkv) in [(64, 2), (128, 4), (32, 8)] {
        let (q, k, v) = transformers_qkv(2, 8, hkv, 37, 37, d)?;
        let got = candle_flash_attn::flash_attn(&q, &k, &v, scale(d), true)?;
        let want = reference(&q, &k, &v, &FlashAttnOptions::new(scale(d)).causal(true))?;
        assert_close(&format!("prefill d={d} hkv={hkv}"), &got, &want, TOL)?;
        let full = reference(&q, &k, &v, &FlashAttnOptions::new(scale(d)))?;
        assert_differs("causal", &want, &full)?;
        // And the way the models turn the output back: `.transpose(1, 2)` to (b, h, s, d).
        let back = got.transpose(1, 2)?.contiguous()?;
        assert_close("transposed back", &back, &want.transpose(1, 2)?.contiguous()?, TOL)?;
    }
    Ok(())
}

#[test]
fn flash_attn_as_candle_transformers_decode() -> Result<()> {
    // One new token against a 41-token KV cache: candle-transformers passes causal = false.
    let d = 64;
    let (q, k, v) = transformers_qkv(2, 8, 2, 1, 41, d)?;
    let got = candle_flash_attn::flash_attn(&q, &k, &v, scale(d), false)?;
    let want = reference(&q, &k, &v, &FlashAttnOptions::new(scale(d)))?;
    assert_close("decode", &got, &want, TOL)?;
    // causal = true is the same for one query row (bottom-right aligned mask).
    let causal = candle_flash_attn::flash_attn(&q, &k, &v, scale(d), true)?;
    assert_close("decode causal", &causal, &want, TOL)?;
    // The cache's last keys matter: dropping them changes the result.
    let short = reference(&q, &k.narrow(1, 0, 20)?, &v.narrow(1, 0, 20)?, &FlashAttnOptions::new(scale(d)))?;
    assert_differs("cache length", &want, &short)?;
    Ok(())
}

#[test]
fn flash_attn_prefill_after_cache() -> Result<()> {
    // A chunk of 5 queries after 30 cached keys (Sq < Sk): the causal mask is bottom-right aligned.
    let d = 64;
    let (q, k, v) = transformers_qkv(1, 4, 2, 5, 35, d)?;
    let got = candle_flash_attn::flash_attn(&q, &k, &v, scale(d), true)?;
    let want = reference(&q, &k, &v, &FlashAttnOptions::new(scale(d)).causal(true))?;
    assert_close("chunked prefill", &got, &want, TOL)?;
    assert_differs("chunk causal", &want, &reference(&q, &k, &v, &FlashAttnOptions::new(scale(d)))?)
}

#[test]
fn flash_attn_bf16() -> Result<()> {
    let d = 64;
    let (q, k, v) = transformers_qkv(1, 8, 2, 33, 33, d)?;
    let bf = |t: &Tensor| t.to_dtype(DType::BF16);
    let got = candle_flash_attn::flash_attn(&bf(&q)?, &bf(&k)?, &bf(&v)?, scale(d), true)?;
    assert_eq!(got.dtype(), DType::BF16);
    let want = reference(&q, &k, &v, &FlashAttnOptions::new(scale(d)).causal(true))?;
    assert_close("bf16", &got, &want, 1e-2)
}

#[test]
fn flash_attn_gqa_without_repeat() -> Result<()> {
    let d = 32;
    let (q, k, v) = batched_qkv(2, 6, 2, 19, 23, d)?;
    for causal in [false, true] {
        let got = candle_flash_attn::flash_attn(&q, &k, &v, scale(d), causal)?;
        let want = reference(&q, &k, &v, &FlashAttnOptions::new(scale(d)).causal(causal))?;
        assert_close(&format!("gqa causal={causal}"), &got, &want, TOL)?;
    }
    Ok(())
}

#[test]
fn flash_attn_windowed_matches() -> Result<()> {
    let d = 32;
    let (q, k, v) = transformers_qkv(2, 4, 2, 29, 29, d)?;
    let full = reference(&q, &k, &v, &FlashAttnOptions::new(scale(d)))?;
    for (l, r) in [(Some(5), Some(0)), (Some(3), Some(2)), (None, Some(0)), (Some(7), None), (None, None)] {
        let got = candle_flash_attn::flash_attn_windowed(&q, &k, &v, scale(d), l, r)?;
        let want = reference(&q, &k, &v, &FlashAttnOptions::new(scale(d)).window(l, r))?;
        assert_close(&format!("window ({l:?}, {r:?})"), &got, &want, TOL)?;
        if (l, r) != (None, None) {
            assert_differs("window", &want, &full)?;
        }
    }
    // As in candle-flash-attn, a window wider than Sk is unbounded: (1000, 0) is causal.
    let got = candle_flash_attn::flash_attn_windowed(&q, &k, &v, scale(d), Some(1000), Some(0))?;
    let want = reference(&q, &k, &v, &FlashAttnOptions::new(scale(d)).causal(true))?;
    assert_close("window wider than Sk", &got, &want, TOL)
}

fn slopes(h: usize) -> Result<Tensor> {
    Tensor::from_vec((0..h).map(|i| 0.5f32.powi(i as i32 + 1)).collect::<Vec<_>>(), h, &Device::Cpu)
}

#[test]
fn flash_attn_alibi_matches() -> Result<()> {
    let (d, h) = (32, 4);
    let (q, k, v) = transformers_qkv(2, h, 2, 21, 21, d)?;
    let s = slopes(h)?;
    for causal in [false, true] {
        let got = candle_flash_attn::flash_attn_alibi(&q, &k, &v, &s, scale(d), causal)?;
        let want = reference(&q, &k, &v, &FlashAttnOptions::new(scale(d)).causal(causal).alibi(Some(&s)))?;
        assert_close(&format!("alibi causal={causal}"), &got, &want, TOL)?;
        let plain = reference(&q, &k, &v, &FlashAttnOptions::new(scale(d)).causal(causal))?;
        assert_differs("alibi", &want, &plain)?;
    }
    let got = candle_flash_attn::flash_attn_alibi_windowed(&q, &k, &v, &s, scale(d), Some(4), Some(1))?;
    let want = reference(&q, &k, &v, &FlashAttnOptions::new(scale(d)).window(Some(4), Some(1)).alibi(Some(&s)))?;
    assert_close("alibi windowed", &got, &want, TOL)
}

#[test]
fn flash_attn_alibi_windowed_softcap_matches() -> Result<()> {
    let (d, h) = (32, 4);
    let (q, k, v) = transformers_qkv(1, h, 2, 25, 25, d)?;
    // Large logits, so that a softcap of 2 bites.
    let q = (q * 4.0)?;
    let s = slopes(h)?;
    for alibi in [None, Some(&s)] {
        let base = FlashAttnOptions::new(scale(d)).window(Some(6), Some(0)).alibi(alibi);
        let got =
            candle_flash_attn::flash_attn_alibi_windowed_softcap(&q, &k, &v, alibi, scale(d), Some(6), Some(0), 2.0)?;
        let want = reference(&q, &k, &v, &base.clone().softcap(Some(2.0)))?;
        assert_close(&format!("softcap alibi={}", alibi.is_some()), &got, &want, TOL)?;
        let uncapped = reference(&q, &k, &v, &base)?;
        assert_differs("softcap", &want, &uncapped)?;
        // candle-flash-attn's meaning of softcap <= 0: off.
        for off in [0.0, -1.0] {
            let got = candle_flash_attn::flash_attn_alibi_windowed_softcap(
                &q,
                &k,
                &v,
                alibi,
                scale(d),
                Some(6),
                Some(0),
                off,
            )?;
            assert_close(&format!("softcap {off} is off"), &got, &uncapped, TOL)?;
        }
    }
    Ok(())
}

/// Three packed sequences: q lengths 5, 17, 9 against k lengths 7, 17, 12.
struct Packed {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seqlens_q: Tensor,
    seqlens_k: Tensor,
    lens_q: Vec<usize>,
    lens_k: Vec<usize>,
}

const H: usize = 4;
const HKV: usize = 2;
const D: usize = 32;

fn cumulative(lens: &[usize]) -> Result<Tensor> {
    let mut c = vec![0u32];
    for &l in lens {
        c.push(c[c.len() - 1] + l as u32);
    }
    Tensor::new(c.as_slice(), &Device::Cpu)
}

fn packed() -> Result<Packed> {
    let (lens_q, lens_k) = (vec![5, 17, 9], vec![7, 17, 12]);
    let (tq, tk) = (lens_q.iter().sum::<usize>(), lens_k.iter().sum::<usize>());
    Ok(Packed {
        q: rand_tensor(&[tq, H, D], 1.0, 21)?,
        k: rand_tensor(&[tk, HKV, D], 1.0, 22)?,
        v: rand_tensor(&[tk, HKV, D], 1.0, 23)?,
        seqlens_q: cumulative(&lens_q)?,
        seqlens_k: cumulative(&lens_k)?,
        lens_q,
        lens_k,
    })
}

impl Packed {
    fn max_q(&self) -> usize {
        *self.lens_q.iter().max().unwrap()
    }
    fn max_k(&self) -> usize {
        *self.lens_k.iter().max().unwrap()
    }
    fn opts(&self) -> FlashAttnOptions {
        FlashAttnOptions::new(scale(D)).varlen(Some(VarLen {
            seqlens_q: self.seqlens_q.clone(),
            seqlens_k: self.seqlens_k.clone(),
            max_seqlen_q: self.max_q(),
            max_seqlen_k: self.max_k(),
        }))
    }
    fn reference(&self, opts: &FlashAttnOptions) -> Result<Tensor> {
        reference(&self.q, &self.k, &self.v, opts)
    }
    /// Sequence by sequence through the batched reference: the varlen reference itself is
    /// checked against per-sequence batched attention once.
    fn per_sequence(&self, opts: impl Fn(usize, usize) -> FlashAttnOptions) -> Result<Tensor> {
        let (mut oq, mut ok, mut outs) = (0, 0, vec![]);
        for (&lq, &lk) in self.lens_q.iter().zip(&self.lens_k) {
            let q = self.q.narrow(0, oq, lq)?.unsqueeze(0)?;
            let k = self.k.narrow(0, ok, lk)?.unsqueeze(0)?;
            let v = self.v.narrow(0, ok, lk)?.unsqueeze(0)?;
            outs.push(reference(&q, &k, &v, &opts(lq, lk))?.i(0)?);
            (oq, ok) = (oq + lq, ok + lk);
        }
        Tensor::cat(&outs, 0)
    }
}

#[test]
fn flash_attn_varlen_matches() -> Result<()> {
    let p = packed()?;
    for causal in [false, true] {
        let got = candle_flash_attn::flash_attn_varlen(
            &p.q,
            &p.k,
            &p.v,
            &p.seqlens_q,
            &p.seqlens_k,
            p.max_q(),
            p.max_k(),
            scale(D),
            causal,
        )?;
        let want = p.reference(&p.opts().causal(causal))?;
        assert_close(&format!("varlen causal={causal}"), &got, &want, TOL)?;
        let per_seq = p.per_sequence(|_, _| FlashAttnOptions::new(scale(D)).causal(causal))?;
        assert_close("varlen reference per sequence", &want, &per_seq, TOL)?;
    }
    assert_differs("varlen causal", &p.reference(&p.opts().causal(true))?, &p.reference(&p.opts())?)
}

#[test]
fn flash_attn_varlen_windowed_matches() -> Result<()> {
    let p = packed()?;
    for (l, r) in [(Some(3), Some(0)), (Some(2), Some(4)), (None, Some(0)), (Some(100), Some(0))] {
        let got = candle_flash_attn::flash_attn_varlen_windowed(
            &p.q,
            &p.k,
            &p.v,
            &p.seqlens_q,
            &p.seqlens_k,
            p.max_q(),
            p.max_k(),
            scale(D),
            l,
            r,
        )?;
        // A window wider than max_seqlen_k is unbounded, as in candle-flash-attn.
        let eff = |w: Option<usize>| w.filter(|&w| w <= p.max_k());
        let want = p.reference(&p.opts().window(eff(l), eff(r)))?;
        assert_close(&format!("varlen window ({l:?}, {r:?})"), &got, &want, TOL)?;
    }
    let w = p.reference(&p.opts().window(Some(3), Some(0)))?;
    assert_differs("varlen window", &w, &p.reference(&p.opts().causal(true))?)
}

#[test]
fn flash_attn_varlen_alibi_matches() -> Result<()> {
    let p = packed()?;
    let s = slopes(H)?;
    for causal in [false, true] {
        let got = candle_flash_attn::flash_attn_varlen_alibi(
            &p.q,
            &p.k,
            &p.v,
            &s,
            &p.seqlens_q,
            &p.seqlens_k,
            p.max_q(),
            p.max_k(),
            scale(D),
            causal,
        )?;
        let want = p.reference(&p.opts().causal(causal).alibi(Some(&s)))?;
        assert_close(&format!("varlen alibi causal={causal}"), &got, &want, TOL)?;
        assert_differs("varlen alibi", &want, &p.reference(&p.opts().causal(causal))?)?;
    }
    let got = candle_flash_attn::flash_attn_varlen_alibi_windowed(
        &p.q,
        &p.k,
        &p.v,
        &s,
        &p.seqlens_q,
        &p.seqlens_k,
        p.max_q(),
        p.max_k(),
        scale(D),
        Some(4),
        Some(0),
    )?;
    let want = p.reference(&p.opts().window(Some(4), Some(0)).alibi(Some(&s)))?;
    assert_close("varlen alibi windowed", &got, &want, TOL)
}

#[test]
fn flash_attn_varlen_alibi_windowed_softcap_matches() -> Result<()> {
    let mut p = packed()?;
    p.q = (&p.q * 4.0)?;
    let s = slopes(H)?;
    for alibi in [None, Some(&s)] {
        let call = |softcap: f32| {
            candle_flash_attn::flash_attn_varlen_alibi_windowed_softcap(
                &p.q,
                &p.k,
                &p.v,
                alibi,
                &p.seqlens_q,
                &p.seqlens_k,
                p.max_q(),
                p.max_k(),
                scale(D),
                Some(5),
                Some(1),
                softcap,
            )
        };
        let base = p.opts().window(Some(5), Some(1)).alibi(alibi);
        let want = p.reference(&base.clone().softcap(Some(2.0)))?;
        assert_close(&format!("varlen softcap alibi={}", alibi.is_some()), &call(2.0)?, &want, TOL)?;
        let uncapped = p.reference(&base)?;
        assert_differs("varlen softcap", &want, &uncapped)?;
        assert_close("varlen softcap 0 is off", &call(0.0)?, &uncapped, TOL)?;
    }
    Ok(())
}

/// The packed k/v of `p` written into a paged cache: `(num_blocks, page, HKV, D)` pages in a
/// shuffled order, and the `(B, max_blocks)` u32 block table that reads them back.
fn paginate(p: &Packed, page: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let blocks_per_seq: Vec<usize> = p.lens_k.iter().map(|l| l.div_ceil(page)).collect();
    let max_blocks = *blocks_per_seq.iter().max().unwrap();
    let num_blocks = blocks_per_seq.iter().sum::<usize>() + 2; // two pages never used
                                                               // Page ids handed out in a scrambled order (coprime stride).
    let ids: Vec<usize> = (0..num_blocks).map(|i| (i * 5 + 3) % num_blocks).collect();
    let zeros_k = Tensor::zeros((num_blocks * page, HKV, D), DType::F32, &Device::Cpu)?;
    let (mut kc, mut vc) = (zeros_k.clone(), zeros_k);
    let mut table = vec![0u32; p.lens_k.len() * max_blocks];
    let (mut next, mut off) = (0, 0);
    for (b, &lk) in p.lens_k.iter().enumerate() {
        for blk in 0..blocks_per_seq[b] {
            let id = ids[next];
            next += 1;
            table[b * max_blocks + blk] = id as u32;
            let rows = page.min(lk - blk * page);
            let src_k = p.k.narrow(0, off + blk * page, rows)?;
            let src_v = p.v.narrow(0, off + blk * page, rows)?;
            kc = kc.slice_scatter0(&src_k, id * page)?;
            vc = vc.slice_scatter0(&src_v, id * page)?;
        }
        off += lk;
    }
    let table = Tensor::from_vec(table, (p.lens_k.len(), max_blocks), &Device::Cpu)?;
    Ok((kc.reshape((num_blocks, page, HKV, D))?, vc.reshape((num_blocks, page, HKV, D))?, table))
}

#[test]
fn flash_attn_varlen_paged_windowed_matches() -> Result<()> {
    let mut p = packed()?;
    p.q = (&p.q * 4.0)?;
    for page in [4, 16] {
        let (kc, vc, table) = paginate(&p, page)?;
        let call = |l, r, softcap| {
            candle_flash_attn::flash_attn_varlen_paged_windowed(
                &p.q,
                &kc,
                &vc,
                &p.seqlens_q,
                &p.seqlens_k,
                &table,
                None,
                p.max_q(),
                p.max_k(),
                scale(D),
                l,
                r,
                page,
                softcap,
            )
        };
        // The same attention as on the packed rows the pages were filled from.
        for (l, r) in [(None, Some(0)), (Some(3), Some(0)), (None, None)] {
            let want = p.reference(&p.opts().window(l, r))?;
            assert_close(&format!("paged {page} ({l:?}, {r:?})"), &call(l, r, None)?, &want, TOL)?;
            assert_close("paged softcap Some(0) is off", &call(l, r, Some(0.0))?, &want, TOL)?;
            let capped = p.reference(&p.opts().window(l, r).softcap(Some(2.0)))?;
            assert_close("paged softcap", &call(l, r, Some(2.0))?, &capped, TOL)?;
            assert_differs("paged softcap", &capped, &want)?;
        }
    }
    Ok(())
}
