//! Paged K/V: the forward (CPU, and CUDA when a GPU is present) read through shuffled block
//! tables against the reference (f64 truth, tolerance relative to the naive same-dtype error)
//! and against the contiguous op on the same logical cache and device (bitwise), page sizes 1,
//! 3, 16 and 256 (CUDA: also 7, 48, 64, 128), prefill and decode, GQA, windows, softcap, ALiBi,
//! empty sequences, mm_prefix_ranges, a value head dim of its own (CUDA); cache writes; bad input, and on CUDA bad tables
//! clamped without a fault; candle-flash-attn / candle-flash-attn-v3 snippets.

mod common;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_flash::{reference, rope_write_paged_kv, write_paged_kv, FlashAttnOptions, PagedKv};
use common::{floor, make_inputs, max_err, options, Case};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// A paged copy of packed K/V rows: caches, block table, page size.
struct PagedCache {
    k: Tensor,
    v: Tensor,
    table: Tensor,
    page: usize,
}

/// Pages `k`/`v` `(total_k, Hkv, D)` (sequences of `k_lens` keys) into a cache of shuffled
/// pages plus spare ones, through [`write_paged_kv`]. Every cache row no key was written to is
/// NaN and every table entry past a sequence's pages is garbage, so reading either fails the
/// checks.
fn page_out(
    k: &Tensor,
    v: &Tensor,
    k_lens: &[usize],
    page: usize,
    table_dtype: DType,
    rng: &mut StdRng,
) -> Result<PagedCache> {
    let (_, hkv, d) = k.dims3()?;
    let dv = v.dim(2)?;
    let used: Vec<usize> = k_lens.iter().map(|l| l.div_ceil(page)).collect();
    let num_blocks = used.iter().sum::<usize>() + 3;
    let mut physical: Vec<usize> = (0..num_blocks).collect();
    physical.shuffle(rng);
    let width = used.iter().max().copied().unwrap_or(0) + 1;
    let garbage = if table_dtype == DType::I32 { -1i64 } else { 7_777_777 };
    let mut table = vec![];
    let mut slots = vec![];
    let mut next = physical.iter();
    for (&len, &n) in k_lens.iter().zip(&used) {
        let pages: Vec<usize> = next.by_ref().take(n).copied().collect();
        slots.extend((0..len).map(|j| (pages[j / page] * page + j % page) as u32));
        table.extend(pages.iter().map(|&p| p as i64).chain(std::iter::repeat(garbage)).take(width));
    }
    let table = Tensor::new(table, &Device::Cpu)?.reshape((k_lens.len(), width))?.to_dtype(table_dtype)?;
    let cache = |d: usize| Tensor::full(f32::NAN, (num_blocks, page, hkv, d), &Device::Cpu)?.to_dtype(k.dtype());
    let (k_cache, v_cache) = (cache(d)?, cache(dv)?);
    let slots = Tensor::new(slots, &Device::Cpu)?;
    if dv == d {
        write_paged_kv(&k_cache, &v_cache, k, v, &slots)?;
    } else {
        // one row width a write: each cache on its own
        write_paged_kv(&k_cache, &k_cache, k, k, &slots)?;
        write_paged_kv(&v_cache, &v_cache, v, v, &slots)?;
    }
    Ok(PagedCache { k: k_cache, v: v_cache, table, page })
}

/// One paged parity case: the case's varlen sequences, paged with `page` rows per page; the
/// flash runs on `device`, the reference on the CPU.
fn check_paged(
    case: &Case,
    page: usize,
    prefix_ranges: Option<&[[i32; 2]]>,
    device: &Device,
    rng: &mut StdRng,
    seed: u64,
) -> Result<String> {
    let x = make_inputs(case, rng)?;
    let k_lens: Vec<usize> = case.varlen.iter().map(|s| s.1).collect();
    let table_dtype = if rng.random::<bool>() { DType::U32 } else { DType::I32 };
    let ctx = format!(
        "{case:?} page {page} {table_dtype:?} ranges {prefix_ranges:?} on {:?} (seed {seed})",
        device.location()
    );
    let ranges = match prefix_ranges {
        Some(r) => {
            let per_seq: Vec<i32> = (0..case.batch).flat_map(|_| r.iter().flatten().copied()).collect();
            Some(Tensor::new(per_seq, &Device::Cpu)?.reshape((case.batch, r.len(), 2))?)
        }
        None => None,
    };
    // One page layout for every run of the case (truth, naive, flash), drawn from the case's rng.
    let layout_seed: u64 = rng.random();
    let run = |dtype: DType, flash: bool, paged: bool| -> Result<(Tensor, Tensor)> {
        let dev = if flash { device } else { &Device::Cpu };
        let ranges = ranges.as_ref().map(|r| r.to_device(dev)).transpose()?;
        let contiguous_opts = options(case, &x, dev)?.mm_prefix_ranges(ranges.as_ref());
        let to = |t: &Tensor| t.to_dtype(dtype);
        let (q, k, v) = (to(&x.q)?, to(&x.k)?, to(&x.v)?);
        let (k, v, opts) = if paged {
            let cache = page_out(&k, &v, &k_lens, page, table_dtype, &mut StdRng::seed_from_u64(layout_seed))?;
            let opts = contiguous_opts.paged(Some(PagedKv::new(&cache.table.to_device(dev)?, cache.page)));
            (cache.k, cache.v, opts)
        } else {
            (k, v, contiguous_opts)
        };
        let (q, k, v) = (q.to_device(dev)?, k.to_device(dev)?, v.to_device(dev)?);
        if flash {
            candle_flash::flash_attn_with_lse(&q, &k, &v, &opts)
        } else {
            reference::attention_with_lse(&q, &k, &v, &opts)
        }
    };
    let truth = run(DType::F64, false, true)?;
    let naive = run(case.dtype, false, true)?;
    let paged = run(case.dtype, true, true)?;
    let contiguous = run(case.dtype, true, false)?;

    // Same values, same tiles, same arithmetic: only where the rows are read from differs.
    for (what, a, b) in [("out", &paged.0, &contiguous.0), ("lse", &paged.1, &contiguous.1)] {
        let (a, b) = (
            a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
            b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
        );
        let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "paged and contiguous {what} differ: {ctx}");
    }
    let (ef, en) = (max_err(&paged.0, &truth.0), max_err(&naive.0, &truth.0));
    let tol = 2.0 * en + floor(case.dtype, false);
    assert!(ef <= tol, "forward error {ef:.3e} > {tol:.3e} (naive {en:.3e}): {ctx}");
    let el = max_err(&paged.1, &truth.1);
    assert!(el <= 1e-3 + 2.0 * max_err(&naive.1, &truth.1), "lse error {el:.3e}: {ctx}");
    Ok(format!("fwd {ef:.1e} (naive {en:.1e})"))
}

fn sweep_on(device: &Device, cases: &[(Case, usize)], prefix_ranges: Option<&[[i32; 2]]>) {
    let (mut rng, seed) = common::rng();
    for (case, page) in cases {
        let summary = check_paged(case, *page, prefix_ranges, device, &mut rng, seed)
            .unwrap_or_else(|e| panic!("{case:?} page {page} on {:?}: {e}", device.location()));
        println!("{case:?} page {page} on {:?}: {summary}", device.location());
    }
}

fn sweep(cases: &[(Case, usize)], prefix_ranges: Option<&[[i32; 2]]>) {
    sweep_on(&Device::Cpu, cases, prefix_ranges);
}

/// Prefill: many query rows per sequence (Sq ≠ Sk, an empty cache, an empty query), every
/// page size, GQA, masks, softcap, ALiBi.
#[test]
fn prefill_matches_reference_and_contiguous() {
    let seqs = [(17, 30), (0, 5), (40, 40), (3, 0), (1, 70)];
    let mut cases = vec![];
    for dtype in DTYPES {
        for page in [1, 3, 16, 256] {
            cases.push((Case::new(dtype, (0, 0), (4, 2), 32).varlen(&seqs).causal(), page));
        }
        cases.push((Case::new(dtype, (0, 0), (4, 1), 64).varlen(&seqs).window(Some(7), Some(2)).softcap(5.0), 16));
        cases.push((Case::new(dtype, (0, 0), (6, 2), 24).varlen(&seqs).alibi(2), 3));
        cases.push((Case::new(dtype, (0, 0), (2, 2), 16).varlen(&seqs), 1));
        cases.push((Case::new(dtype, (0, 0), (4, 2), 32).varlen(&seqs).causal().sinks(-8.0, 6.0), 16));
    }
    sweep(&cases, None);
}

/// Decode: one query row per sequence against caches that span many pages (and one empty).
#[test]
fn decode_matches_reference_and_contiguous() {
    let seqs = [(1, 300), (1, 0), (1, 513), (1, 17)];
    let mut cases = vec![];
    for dtype in DTYPES {
        for page in [1, 16, 256] {
            cases.push((Case::new(dtype, (0, 0), (8, 2), 64).varlen(&seqs).causal(), page));
        }
        cases.push((Case::new(dtype, (0, 0), (8, 1), 64).varlen(&seqs).window(Some(100), Some(0)).softcap(20.0), 3));
        cases.push((Case::new(dtype, (0, 0), (8, 2), 64).varlen(&seqs).causal().sinks(-8.0, 6.0), 16));
    }
    sweep(&cases, None);
}

/// mm_prefix_ranges: ranges that overlap the window, lie outside it, are empty or reach past
/// the cache, under causal and sliding-window masks.
#[test]
fn mm_prefix_ranges_match_reference() {
    let seqs = [(40, 40), (12, 50), (1, 33)];
    let ranges: &[[i32; 2]] = &[[4, 20], [30, 45], [9, 9], [-3, 2]];
    let mut cases = vec![];
    for dtype in DTYPES {
        cases.push((Case::new(dtype, (0, 0), (4, 2), 32).varlen(&seqs).causal(), 16));
        cases.push((Case::new(dtype, (0, 0), (4, 2), 32).varlen(&seqs).window(Some(3), Some(0)), 3));
    }
    sweep(&cases, Some(ranges));
}

/// CUDA: every kernel family reads the pages (f32 SIMT; sm80 mma.sync for head-dim tile 32, the
/// sm90 wgmma kernel on Hopper for 64 / 128; split-KV decode), pages that hold whole key tiles
/// (one lookup per tile) and smaller or odd ones (one lookup per row); bitwise equal to the
/// contiguous CUDA op on the same rows. Skipped without a GPU.
#[test]
fn cuda_prefill_matches_reference_and_contiguous() {
    let Some(gpu) = common::cuda_device() else { return };
    let seqs = [(17, 30), (0, 5), (113, 113), (3, 0), (1, 70), (200, 300)];
    let mut cases = vec![];
    for dtype in DTYPES {
        for page in [1, 16, 256, 7] {
            cases.push((Case::new(dtype, (0, 0), (4, 2), 64).varlen(&seqs).causal(), page));
        }
        cases.push((Case::new(dtype, (0, 0), (4, 2), 128).varlen(&seqs).causal(), 64));
        cases.push((Case::new(dtype, (0, 0), (4, 1), 32).varlen(&seqs).window(Some(7), Some(2)).softcap(5.0), 16));
        cases.push((Case::new(dtype, (0, 0), (6, 2), 24).varlen(&seqs).alibi(2), 3));
        // Left-bounded windows at d <= 64: the sm_80 kernel's paged tiles for d = 96 / 128 differ
        // from its contiguous ones, and there the last bits may too (README, docs/kernels.md).
        cases.push((Case::new(dtype, (0, 0), (2, 2), 64).varlen(&seqs).window(Some(40), None), 128));
        cases.push((Case::new(dtype, (0, 0), (4, 2), 128).varlen(&seqs).causal().sinks(-8.0, 6.0), 64));
        cases.push((Case::new(dtype, (0, 0), (4, 1), 64).varlen(&seqs).window(Some(7), Some(2)).sinks(-8.0, 6.0), 7));
    }
    sweep_on(&gpu, &cases, None);
}

#[test]
fn cuda_decode_matches_reference_and_contiguous() {
    let Some(gpu) = common::cuda_device() else { return };
    let seqs = [(1, 1300), (1, 0), (1, 513), (1, 17), (1, 2048)];
    let mut cases = vec![];
    for dtype in DTYPES {
        for page in [1, 16, 256, 48] {
            cases.push((Case::new(dtype, (0, 0), (8, 2), 128).varlen(&seqs).causal(), page));
        }
        cases.push((Case::new(dtype, (0, 0), (8, 1), 64).varlen(&seqs).window(Some(300), Some(0)).softcap(20.0), 16));
        cases.push((Case::new(dtype, (0, 0), (4, 2), 64).varlen(&seqs).alibi(1), 32));
        let q4 = [(4, 1000), (1, 1), (3, 700)];
        cases.push((Case::new(dtype, (0, 0), (8, 2), 128).varlen(&q4).causal(), 256));
        // Split-KV decode: the combine adds the sink once.
        cases.push((Case::new(dtype, (0, 0), (8, 2), 128).varlen(&seqs).causal().sinks(-8.0, 6.0), 16));
        cases.push((Case::new(dtype, (0, 0), (8, 1), 64).varlen(&seqs).softcap(20.0).sinks(-8.0, 6.0), 48));
    }
    sweep_on(&gpu, &cases, None);
}

/// CUDA: mm_prefix_ranges (the SIMT kernel, which reads a second key interval per row) and a
/// value head dim of its own on paged caches (MLA decode's (576, 512), a wide head, and, with
/// CANDLE_FLASH_PAD_VALUE_HEAD_DIM=0, a narrow one), bitwise equal to the contiguous op.
#[test]
fn cuda_mm_prefix_ranges_and_value_head_dims() {
    let Some(gpu) = common::cuda_device() else { return };
    let seqs = [(40, 40), (12, 50), (1, 33), (0, 7), (113, 200)];
    let ranges: &[[i32; 2]] = &[[4, 20], [30, 45], [9, 9], [-3, 2], [150, 1 << 30]];
    let mut cases = vec![];
    for dtype in DTYPES {
        cases.push((Case::new(dtype, (0, 0), (4, 2), 64).varlen(&seqs).causal(), 16));
        cases.push((Case::new(dtype, (0, 0), (4, 2), 32).varlen(&seqs).window(Some(3), Some(0)).sinks(-8.0, 6.0), 3));
        cases.push((Case::new(dtype, (0, 0), (4, 1), 128).varlen(&seqs).window(Some(20), Some(0)).alibi(1), 64));
        cases.push((Case::new(dtype, (0, 0), (8, 1), 576).dv(512).varlen(&seqs).causal(), 16));
    }
    sweep_on(&gpu, &cases, Some(ranges));
    let decode = [(1, 300), (1, 0), (1, 513), (4, 17)];
    let mut cases = vec![];
    for dtype in DTYPES {
        cases.push((Case::new(dtype, (0, 0), (16, 1), 576).dv(512).varlen(&decode).causal(), 64));
        cases.push((Case::new(dtype, (0, 0), (4, 2), 512).varlen(&decode).softcap(20.0).sinks(-8.0, 6.0), 7));
        // 512-wide prefill (sm_90a: the wgmma kernel of these heads, K / V by cp.async from the
        // pages; a page of 64 keys is one key block, 7 is gathered row by row)
        let prefill = [(150, 300), (0, 20), (200, 200)];
        cases.push((Case::new(dtype, (0, 0), (4, 2), 512).varlen(&prefill).causal(), 64));
        cases.push((Case::new(dtype, (0, 0), (4, 2), 512).varlen(&prefill).sinks(-8.0, 6.0), 7));
        if std::env::var("CANDLE_FLASH_PAD_VALUE_HEAD_DIM").as_deref() == Ok("0") {
            cases.push((Case::new(dtype, (0, 0), (8, 2), 192).dv(128).varlen(&decode).causal(), 16));
        }
    }
    sweep_on(&gpu, &cases, None);
}

/// The same prefix range makes a difference: rows inside it see later keys of the range.
#[test]
fn mm_prefix_ranges_unmask_the_range() -> Result<()> {
    let dev = Device::Cpu;
    let (q, kv) = (Tensor::randn(0f32, 1., (8, 1, 8), &dev)?, Tensor::randn(0f32, 1., (8, 1, 8), &dev)?);
    let seqlens = Tensor::new(&[0u32, 8], &dev)?;
    let table = Tensor::new(&[[0u32, 1]], &dev)?;
    let (k, v) = (kv.reshape((2, 4, 1, 8))?, kv.reshape((2, 4, 1, 8))?);
    let ranges = Tensor::new(&[[[2i32, 6]]], &dev)?;
    let call = |r: Option<&Tensor>| {
        candle_flash::flash_attn_varlen_paged_windowed(
            &q,
            &k,
            &v,
            &seqlens,
            &seqlens,
            &table,
            r,
            8,
            8,
            0.3,
            None,
            Some(0),
            4,
            None,
        )
    };
    let (causal, prefixed) = (call(None)?, call(Some(&ranges))?);
    let full = candle_flash::flash_attn_varlen(&q, &kv, &kv, &seqlens, &seqlens, 8, 8, 0.3, false)?;
    for i in 0..8 {
        let row = |t: &Tensor| t.narrow(0, i, 1);
        // Rows 2..6 see keys 0..6; rows 2, 3 and 4 gain keys by it, row 5 saw them causally.
        let changed = max_err(&row(&causal)?, &row(&prefixed)?) > 0.0;
        assert_eq!(changed, (2..5).contains(&i), "row {i}");
    }
    // Outside the range, nothing changes; the last row sees everything either way.
    assert_eq!(max_err(&causal.narrow(0, 7, 1)?, &full.narrow(0, 7, 1)?), 0.0);
    Ok(())
}

/// Upstream's window rule: a window wider than max_seqlen_k is unbounded, which differs from a
/// bounded right window when Sq > Sk + 1 (early rows would otherwise see no key).
#[test]
fn windows_wider_than_max_seqlen_k_are_unbounded() -> Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1., (10, 2, 8), &dev)?;
    let kv = Tensor::randn(0f32, 1., (1, 4, 2, 8), &dev)?;
    let (seqlens_q, seqlens_k) = (Tensor::new(&[0u32, 10], &dev)?, Tensor::new(&[0u32, 4], &dev)?);
    let table = Tensor::new(&[[0i32]], &dev)?;
    let out = candle_flash::flash_attn_varlen_paged_windowed(
        &q,
        &kv,
        &kv,
        &seqlens_q,
        &seqlens_k,
        &table,
        None,
        10,
        4,
        0.5,
        Some(9),
        Some(5),
        4,
        None,
    )?;
    let full = candle_flash::flash_attn_varlen(
        &q,
        &kv.squeeze(0)?,
        &kv.squeeze(0)?,
        &seqlens_q,
        &seqlens_k,
        10,
        4,
        0.5,
        false,
    )?;
    assert_eq!(max_err(&out, &full), 0.0);
    Ok(())
}

/// Written exactly as a candle-flash-attn 0.11.1 user calls its paged function (shuffled pages
/// of 32 rows in a larger pool, causal within a 1024-token window); only the `use` differs.
#[test]
fn candle_flash_attn_snippet() -> Result<()> {
    use candle_flash as candle_flash_attn;
    let device = Device::Cpu;
    let (seq_len, n_heads, n_kv_heads, head_dim, block_size) = (96usize, 4usize, 2usize, 64usize, 32usize);
    let num_blocks = seq_len.div_ceil(block_size);
    let pool_blocks = num_blocks + 5;
    let perm: Vec<u32> = (0..num_blocks).map(|i| ((i * 5 + 3) % pool_blocks) as u32).collect();
    let q = Tensor::randn(0f32, 1., (seq_len, n_heads, head_dim), &device)?.to_dtype(DType::BF16)?;
    let k_seq = Tensor::randn(0f32, 1., (seq_len, n_kv_heads, head_dim), &device)?.to_dtype(DType::BF16)?;
    let v_seq = Tensor::randn(0f32, 1., (seq_len, n_kv_heads, head_dim), &device)?.to_dtype(DType::BF16)?;
    let pool = || Tensor::zeros((pool_blocks, block_size, n_kv_heads, head_dim), DType::BF16, &device);
    let (k_paged, v_paged) = (pool()?, pool()?);
    let slots: Vec<u32> =
        (0..seq_len).map(|j| perm[j / block_size] * block_size as u32 + (j % block_size) as u32).collect();
    candle_flash::write_paged_kv(&k_paged, &v_paged, &k_seq, &v_seq, &Tensor::new(slots, &device)?)?;
    let seqlens = Tensor::new(&[0u32, seq_len as u32], &device)?;
    let block_table = Tensor::new(perm.clone(), &device)?.reshape((1, num_blocks))?;

    let ys = candle_flash_attn::flash_attn_varlen_paged_windowed(
        &q,
        &k_paged,
        &v_paged,
        &seqlens,
        &seqlens,
        &block_table,
        None,
        seq_len,
        seq_len,
        1.0,
        Some(1024),
        Some(0),
        block_size,
        None,
    )?
    .to_dtype(DType::F32)?;

    let causal = candle_flash::flash_attn_varlen(&q, &k_seq, &v_seq, &seqlens, &seqlens, seq_len, seq_len, 1.0, true)?;
    assert_eq!(ys.dims(), &[seq_len, n_heads, head_dim]);
    assert_eq!(max_err(&ys, &causal), 0.0);
    Ok(())
}

/// candle-flash-attn-v3's signatures through `compat::v3`: the packing flag changes nothing.
#[test]
fn candle_flash_attn_v3_snippet() -> Result<()> {
    use candle_flash::compat::v3 as candle_flash_attn_v3;
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1., (1, 20, 8, 64), &dev)?.to_dtype(DType::F16)?;
    let k = Tensor::randn(0f32, 1., (1, 20, 2, 64), &dev)?.to_dtype(DType::F16)?;
    let v = Tensor::randn(0f32, 1., (1, 20, 2, 64), &dev)?.to_dtype(DType::F16)?;
    let ours = candle_flash::flash_attn(&q, &k, &v, 0.125, true)?;
    for packing in [false, true] {
        let out = candle_flash_attn_v3::flash_attn(&q, &k, &v, 0.125, true, packing)?;
        assert_eq!(max_err(&out, &ours), 0.0);
        let win = candle_flash_attn_v3::flash_attn_windowed(&q, &k, &v, 0.125, None, Some(0), packing)?;
        assert_eq!(max_err(&win, &ours), 0.0);
    }
    let (qv, kv, vv) = (q.squeeze(0)?, k.squeeze(0)?, v.squeeze(0)?);
    let seqlens = Tensor::new(&[0u32, 20], &dev)?;
    let varlen = candle_flash_attn_v3::flash_attn_varlen(&qv, &kv, &vv, &seqlens, &seqlens, 20, 20, 0.125, true, true)?;
    assert_eq!(max_err(&varlen, &ours.squeeze(0)?), 0.0);
    let slopes = Tensor::new(&[0.1f32, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8], &dev)?;
    let alibi = candle_flash_attn_v3::flash_attn_varlen_alibi_windowed(
        &qv,
        &kv,
        &vv,
        &slopes,
        &seqlens,
        &seqlens,
        20,
        20,
        0.125,
        Some(4),
        Some(0),
        false,
    )?;
    let expected = candle_flash::flash_attn_varlen_alibi_windowed(
        &qv,
        &kv,
        &vv,
        &slopes,
        &seqlens,
        &seqlens,
        20,
        20,
        0.125,
        Some(4),
        Some(0),
    )?;
    assert_eq!(max_err(&alibi, &expected), 0.0);
    Ok(())
}

/// Cache writes land in the caller's tensors at their slots, skip padding rows (u32::MAX,
/// negative i64), and leave every other row alone.
#[test]
fn write_paged_kv_writes_in_place() -> Result<()> {
    let dev = Device::Cpu;
    for dtype in DTYPES {
        let k_cache = Tensor::zeros((4, 3, 2, 5), dtype, &dev)?;
        let v_cache = Tensor::zeros((4, 3, 2, 5), dtype, &dev)?;
        let k = Tensor::randn(0f32, 1., (3, 2, 5), &dev)?.to_dtype(dtype)?;
        let v = Tensor::randn(0f32, 1., (3, 2, 5), &dev)?.to_dtype(dtype)?;
        for slots in [Tensor::new(&[7u32, u32::MAX, 0], &dev)?, Tensor::new(&[7i64, -1, 0], &dev)?] {
            write_paged_kv(&k_cache, &v_cache, &k, &v, &slots)?;
            for (cache, rows) in [(&k_cache, &k), (&v_cache, &v)] {
                let flat = cache.flatten_to(1)?;
                assert_eq!(max_err(&flat.get(7)?, &rows.get(0)?), 0.0);
                assert_eq!(max_err(&flat.get(0)?, &rows.get(2)?), 0.0);
                let untouched: Vec<usize> = (0..12).filter(|s| ![0, 7].contains(s)).collect();
                for s in untouched {
                    assert_eq!(
                        flat.get(s)?.abs()?.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()?,
                        0.0,
                        "slot {s}"
                    );
                }
            }
        }
    }
    Ok(())
}

/// The fused rotary embedding + cache write against its composition (candle-nn's `rope_thd` on
/// q and k, then [`write_paged_kv`]), on one device: q / k / v as views of one fused projection
/// (strided rows), T = 1, 17 and 113 rows, padding (u32::MAX) and out-of-range slots that must
/// write nothing. On the CPU the op is that composition (bitwise); on CUDA one kernel that
/// rotates in f32 and rounds once (within a rounding of the dtype). Bad shapes are errors.
#[test]
fn rope_write_paged_kv_matches_composition() -> Result<()> {
    // Tolerances relative to the largest value: CUDA rounds once from f32, the composition
    // (candle's kernel) may round its products and sums apart: two units of the last place.
    let mut devices = vec![(Device::Cpu, [0.0, 0.0, 0.0])];
    if let Some(gpu) = common::cuda_device() {
        devices.push((gpu, [1e-6, 2.0 / 1024.0, 2.0 / 128.0]));
    }
    let (h, hkv, d, pages, page) = (6, 2, 32, 9, 16);
    let mut rng = StdRng::seed_from_u64(11);
    for (dev, tols) in &devices {
        for (dtype, tol) in DTYPES.into_iter().zip(*tols) {
            for t in [1usize, 17, 113] {
                let fused = Tensor::randn(0f32, 1., (t, h + 2 * hkv, d), dev)?.to_dtype(dtype)?;
                let (q, k, v) = (fused.narrow(1, 0, h)?, fused.narrow(1, h, hkv)?, fused.narrow(1, h + hkv, hkv)?);
                let angles = Tensor::randn(0f32, 3., (t, d / 2), dev)?;
                let (cos, sin) = (angles.cos()?.to_dtype(dtype)?, angles.sin()?.to_dtype(dtype)?);
                // Distinct slots in random order, some padding, some past the cache.
                let mut slots: Vec<u32> = (0..(pages * page) as u32).collect();
                slots.shuffle(&mut rng);
                slots.truncate(t);
                for (i, s) in slots.iter_mut().enumerate() {
                    match i % 7 {
                        3 => *s = u32::MAX,
                        5 => *s = (pages * page) as u32 + i as u32,
                        _ => {}
                    }
                }
                if dev.is_cpu() {
                    // The CPU checks slot values: only padding is allowed there.
                    slots
                        .iter_mut()
                        .filter(|s| **s != u32::MAX && **s >= (pages * page) as u32)
                        .for_each(|s| *s = u32::MAX);
                }
                let slots = Tensor::new(slots.as_slice(), dev)?;
                let caches = |fill: f64| -> Result<(Tensor, Tensor)> {
                    let c = (Tensor::ones((pages, page, hkv, d), DType::F32, dev)? * fill)?.to_dtype(dtype)?;
                    Ok((c.clone(), c.copy()?))
                };
                let (kc, vc) = caches(0.5)?;
                let (kc_ref, vc_ref) = caches(0.5)?;
                let q_out = rope_write_paged_kv(&q, &k, &v, (&cos, &sin), (&kc, &vc), &slots)?;
                let rope = |x: &Tensor| -> Result<Tensor> {
                    candle_nn::rotary_emb::rope_thd(&x.unsqueeze(0)?.contiguous()?, &cos, &sin)?.squeeze(0)
                };
                let q_ref = rope(&q)?;
                write_paged_kv(&kc_ref, &vc_ref, &rope(&k)?, &v, &slots)?;
                let ctx = format!("{dtype:?} t={t} on {:?}", dev.location());
                assert_eq!(q_out.dims(), &[t, h, d], "{ctx}");
                for (name, got, want) in [("q", &q_out, &q_ref), ("k_cache", &kc, &kc_ref), ("v_cache", &vc, &vc_ref)] {
                    let scale = want.abs()?.flatten_all()?.max(0)?.to_dtype(DType::F32)?.to_scalar::<f32>()?.max(1.0);
                    let err = max_err(got, want);
                    assert!(
                        err <= tol * scale as f64,
                        "{ctx}: {name} differs from the composition by {err} (tol {tol} x {scale})"
                    );
                }
            }
        }
    }
    // Bad shapes.
    let dev = Device::Cpu;
    let x = |dims: &[usize]| Tensor::zeros(dims, DType::F32, &dev).unwrap();
    let (kc, vc, slots) = (x(&[2, 4, 2, 8]), x(&[2, 4, 2, 8]), Tensor::new(&[0u32, 1], &dev)?);
    let (q, k, cs) = (x(&[2, 4, 8]), x(&[2, 2, 8]), x(&[2, 4]));
    expect_err(rope_write_paged_kv(&q, &k, &k, (&cs, &x(&[2, 3])), (&kc, &vc), &slots), &["sin", "[2, 4]"]);
    expect_err(rope_write_paged_kv(&x(&[2, 4, 6]), &k, &k, (&cs, &cs), (&kc, &vc), &slots), &["q must have shape"]);
    expect_err(
        rope_write_paged_kv(&q.transpose(0, 1)?, &k, &k, (&cs, &cs), (&kc, &vc), &slots),
        &["q must have shape"],
    );
    let q_strided_heads = x(&[2, 8, 4]).transpose(1, 2)?;
    expect_err(
        rope_write_paged_kv(&q_strided_heads, &k, &k, (&cs, &cs), (&kc, &vc), &slots),
        &["heads must be contiguous"],
    );
    let (k_odd, kc_odd, cs_odd) = (x(&[2, 2, 7]), x(&[2, 4, 2, 7]), x(&[2, 3]));
    expect_err(
        rope_write_paged_kv(&x(&[2, 4, 7]), &k_odd, &k_odd, (&cs_odd, &cs_odd), (&kc_odd, &kc_odd), &slots),
        &["even head dim"],
    );
    Ok(())
}

fn err_text(r: Result<impl std::fmt::Debug>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.to_string(),
    }
}

fn expect_err(r: Result<impl std::fmt::Debug>, needles: &[&str]) {
    let msg = err_text(r);
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} does not mention {n:?}");
    }
}

/// A small valid paged call (2 sequences, pages of 4) for the bad-input tests to break.
struct Small {
    q: Tensor,
    k: Tensor,
    seqlens_q: Tensor,
    seqlens_k: Tensor,
    table: Tensor,
}

fn small() -> Result<Small> {
    let dev = Device::Cpu;
    Ok(Small {
        q: Tensor::randn(0f32, 1., (3, 4, 8), &dev)?,
        k: Tensor::randn(0f32, 1., (5, 4, 2, 8), &dev)?,
        seqlens_q: Tensor::new(&[0u32, 1, 3], &dev)?,
        seqlens_k: Tensor::new(&[0u32, 6, 9], &dev)?,
        table: Tensor::new(&[[4u32, 0, 9], [2, 3, 9]], &dev)?,
    })
}

fn call(s: &Small, k: &Tensor, seqlens_k: &Tensor, table: &Tensor, page: usize) -> Result<Tensor> {
    candle_flash::flash_attn_varlen_paged_windowed(
        &s.q,
        k,
        k,
        &s.seqlens_q,
        seqlens_k,
        table,
        None,
        2,
        9,
        0.3,
        None,
        Some(0),
        page,
        None,
    )
}

#[test]
fn bad_paged_inputs_are_errors() -> Result<()> {
    let s = small()?;
    let dev = Device::Cpu;
    call(&s, &s.k, &s.seqlens_k, &s.table, 4)?;
    // A table entry past the cache, negative (i32) and past (u32).
    expect_err(
        call(&s, &s.k, &s.seqlens_k, &Tensor::new(&[[4u32, 5, 9], [2, 3, 9]], &dev)?, 4),
        &["block_table[0][1] = 5", "0..5"],
    );
    expect_err(
        call(&s, &s.k, &s.seqlens_k, &Tensor::new(&[[4i32, 0, 0], [-1, 3, 0]], &dev)?, 4),
        &["block_table[1][0] = -1"],
    );
    // Page size that does not match the pages, and zero.
    expect_err(call(&s, &s.k, &s.seqlens_k, &s.table, 8), &["page_block_size 8", "4 rows"]);
    expect_err(call(&s, &s.k.narrow(1, 0, 0)?, &s.seqlens_k, &s.table, 0), &["page_block_size must be at least 1"]);
    // A sequence longer than its table row holds (2 pages of 4 = 8 keys, 9 asked).
    let narrow_table = s.table.narrow(1, 0, 2)?;
    expect_err(
        call(&s, &s.k, &Tensor::new(&[0u32, 9, 12], &dev)?, &narrow_table, 4),
        &["sequence 0 has 9 keys", "2 pages of 4 rows"],
    );
    // Table dtype, shape, device-independent shape checks.
    expect_err(call(&s, &s.k, &s.seqlens_k, &s.table.to_dtype(DType::F32)?, 4), &["block_table must be u32 or i32"]);
    expect_err(
        call(&s, &s.k, &s.seqlens_k, &s.table.narrow(0, 0, 1)?, 4),
        &["block_table must have shape [2, max_blocks]"],
    );
    // k/v of the packed rank, and paged options without varlen.
    expect_err(call(&s, &s.k.flatten_to(1)?, &s.seqlens_k, &s.table, 4), &["k must have rank 4", "num_blocks"]);
    let batched_q = s.q.unsqueeze(0)?;
    let opts = FlashAttnOptions::new(0.3).paged(Some(PagedKv::new(&s.table, 4)));
    expect_err(
        candle_flash::flash_attn_with_options(&batched_q, &s.k, &s.k, &opts),
        &["paged K/V needs the varlen layout"],
    );
    // mm_prefix_ranges of the wrong dtype or shape.
    let bad_ranges = [Tensor::new(&[[[1u32, 2]], [[0, 1]]], &dev)?, Tensor::new(&[[[1i32, 2, 3]], [[0, 1, 2]]], &dev)?];
    for ranges in &bad_ranges {
        let r = candle_flash::flash_attn_varlen_paged_windowed(
            &s.q,
            &s.k,
            &s.k,
            &s.seqlens_q,
            &s.seqlens_k,
            &s.table,
            Some(ranges),
            2,
            9,
            0.3,
            None,
            Some(0),
            4,
            None,
        );
        expect_err(r, &["mm_prefix_ranges must"]);
    }
    Ok(())
}

/// Paged K/V is forward only: autograd and the explicit backward both refuse it clearly.
#[test]
fn backward_through_paged_is_an_error() -> Result<()> {
    let s = small()?;
    let q = Var::from_tensor(&s.q)?;
    let out = call(&Small { q: q.as_tensor().clone(), ..small()? }, &s.k, &s.seqlens_k, &s.table, 4)?;
    expect_err(out.sum_all()?.backward(), &["paged K/V is forward only"]);
    let opts = FlashAttnOptions::new(0.3)
        .varlen(Some(candle_flash::VarLen {
            seqlens_q: s.seqlens_q.clone(),
            seqlens_k: s.seqlens_k.clone(),
            max_seqlen_q: 2,
            max_seqlen_k: 9,
        }))
        .paged(Some(PagedKv::new(&s.table, 4)));
    let (out, lse) = candle_flash::flash_attn_with_lse(&s.q, &s.k, &s.k, &opts)?;
    expect_err(
        candle_flash::flash_attn_backward(&s.q, &s.k, &s.k, &out, &out, &lse, &opts),
        &["paged K/V is forward only"],
    );
    Ok(())
}

#[test]
fn bad_cache_writes_are_errors() -> Result<()> {
    let dev = Device::Cpu;
    let cache = Tensor::zeros((2, 4, 2, 8), DType::F32, &dev)?;
    let rows = Tensor::zeros((3, 2, 8), DType::F32, &dev)?;
    let slots = Tensor::new(&[0u32, 1, 2], &dev)?;
    expect_err(
        write_paged_kv(&cache, &cache.clone(), &rows, &rows, &Tensor::new(&[0u32, 8, 2], &dev)?),
        &["slot_mapping[1] = 8", "8 slots"],
    );
    expect_err(
        write_paged_kv(&cache, &cache, &rows, &rows, &Tensor::new(&[0f32, 1., 2.], &dev)?),
        &["slot_mapping must be a 1-D u32 or i64"],
    );
    expect_err(write_paged_kv(&cache, &cache, &rows.narrow(0, 0, 2)?, &rows, &slots), &["k must have shape [3, 2, 8]"]);
    let strided = Tensor::zeros((2, 2, 4, 8), DType::F32, &dev)?.transpose(1, 2)?;
    expect_err(write_paged_kv(&strided, &strided, &rows, &rows, &slots), &["k_cache must be contiguous"]);
    expect_err(write_paged_kv(&cache, &cache, &rows.to_dtype(DType::F16)?, &rows, &slots), &["k has dtype F16"]);
    Ok(())
}

/// CUDA: a bad table is an error naming the entry when the device data is checked; unchecked,
/// entries outside the cache are clamped (the call succeeds, nothing faults: the sanitizer run
/// of `bench/kernel_check.py --bad-tables` proves the bounds); unchecked prefix ranges far
/// outside the keys give finite rows; a backward is a clear error; cache writes go through candle's in-place scatter, equal to the CPU's.
#[test]
fn cuda_paged_errors_and_clamping() -> Result<()> {
    let Some(gpu) = common::cuda_device() else { return Ok(()) };
    let s = small()?;
    let to = |t: &Tensor| t.to_dtype(DType::BF16)?.to_device(&gpu);
    let on_gpu = Small {
        q: to(&s.q)?,
        k: to(&s.k)?,
        seqlens_q: s.seqlens_q.to_device(&gpu)?,
        seqlens_k: s.seqlens_k.to_device(&gpu)?,
        table: s.table.to_device(&gpu)?,
    };
    call(&on_gpu, &on_gpu.k, &on_gpu.seqlens_k, &on_gpu.table, 4)?;
    for bad in [Tensor::new(&[[4u32, 5, 9], [2, 3, 9]], &gpu)?, Tensor::new(&[[4i32, 0, 0], [-1, 3, 0]], &gpu)?] {
        let opts = |check: bool| {
            FlashAttnOptions::new(0.3)
                .causal(true)
                .varlen(Some(candle_flash::VarLen {
                    seqlens_q: on_gpu.seqlens_q.clone(),
                    seqlens_k: on_gpu.seqlens_k.clone(),
                    max_seqlen_q: 2,
                    max_seqlen_k: 9,
                }))
                .paged(Some(PagedKv::new(&bad, 4)))
                .check_device_data(check)
        };
        let r = candle_flash::flash_attn_with_options(&on_gpu.q, &on_gpu.k, &on_gpu.k, &opts(true));
        expect_err(r, &["block_table[", "is not a page of the cache (0..5)"]);
        if std::env::var(candle_flash::CHECK_DEVICE_DATA_ENV).is_ok_and(|v| !v.is_empty() && v != "0") {
            continue; // every call is checked: the unchecked path cannot be reached
        }
        // Unchecked: clamped, the call succeeds and the output is finite (page 0 is real data).
        let out = candle_flash::flash_attn_with_options(&on_gpu.q, &on_gpu.k, &on_gpu.k, &opts(false))?;
        let v = out.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        assert!(v.iter().all(|x| x.is_finite()), "clamped table gave non-finite values");
    }
    let ranges = Tensor::new(&[[[1i32, 2], [-7, 1 << 30]], [[i32::MIN, i32::MAX], [5, -5]]], &gpu)?;
    let r = candle_flash::flash_attn_varlen_paged_windowed(
        &on_gpu.q,
        &on_gpu.k,
        &on_gpu.k,
        &on_gpu.seqlens_q,
        &on_gpu.seqlens_k,
        &on_gpu.table,
        Some(&ranges),
        2,
        9,
        0.3,
        None,
        Some(0),
        4,
        None,
    );
    let v = r?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    assert!(v.iter().all(|x| x.is_finite()), "prefix ranges outside the keys gave non-finite values");
    let q = Var::from_tensor(&on_gpu.q)?;
    let (k, seqlens_k, table) = (on_gpu.k.clone(), on_gpu.seqlens_k.clone(), on_gpu.table.clone());
    let out = call(&Small { q: q.as_tensor().clone(), ..on_gpu }, &k, &seqlens_k, &table, 4)?;
    expect_err(out.sum_all()?.backward(), &["paged K/V is forward only"]);

    let rows = Tensor::randn(0f32, 1., (3, 2, 8), &Device::Cpu)?;
    let slots = Tensor::new(&[5i64, -1, 0], &Device::Cpu)?;
    let write = |dev: &Device| -> Result<Tensor> {
        let cache = Tensor::zeros((2, 4, 2, 8), DType::F32, dev)?;
        let (rows, slots) = (rows.to_device(dev)?, slots.to_device(dev)?);
        write_paged_kv(&cache, &cache.zeros_like()?, &rows, &rows, &slots)?;
        cache.to_device(&Device::Cpu)
    };
    assert_eq!(max_err(&write(&gpu)?, &write(&Device::Cpu)?), 0.0);
    Ok(())
}

/// MLA's paged decode on CUDA: one latent cache, v the first 512 of its 576 columns (a view of
/// the same pages: the wide-head split kernel reads each page once), 16 query heads over one KV
/// head, pages of 64 and 16 rows, shuffled, unwritten rows NaN; against the reference on the
/// same views.
#[test]
fn cuda_latent_cache_paged() -> Result<()> {
    let Some(gpu) = common::cuda_device() else { return Ok(()) };
    let (mut rng, seed) = common::rng();
    let k_lens = [300usize, 0, 513, 17];
    let b = k_lens.len();
    let offsets = |lens: &[usize]| -> Result<Tensor> {
        let mut acc = vec![0u32];
        for &l in lens {
            acc.push(acc.last().unwrap() + l as u32);
        }
        Tensor::new(acc, &Device::Cpu)
    };
    let (seqlens_q, seqlens_k) = (offsets(&[1; 4])?, offsets(&k_lens)?);
    for (page, dtype) in [(64, DType::BF16), (16, DType::F16)] {
        let latent = common::randn(&mut rng, &[k_lens.iter().sum(), 1, 576], 1.0)?;
        let q = common::randn(&mut rng, &[b, 16, 576], 1.0)?;
        let cache = page_out(&latent, &latent, &k_lens, page, DType::U32, &mut rng)?;
        let run = |dev: &Device, dt: DType, flash: bool| -> Result<(Tensor, Tensor)> {
            let k = cache.k.to_dtype(dt)?.to_device(dev)?;
            let v = k.narrow(3, 0, 512)?;
            let varlen = candle_flash::VarLen {
                seqlens_q: seqlens_q.to_device(dev)?,
                seqlens_k: seqlens_k.to_device(dev)?,
                max_seqlen_q: 1,
                max_seqlen_k: 513,
            };
            let opts = FlashAttnOptions::new(0.05)
                .causal(true)
                .varlen(Some(varlen))
                .paged(Some(PagedKv::new(&cache.table.to_device(dev)?, page)));
            let q = q.to_dtype(dt)?.to_device(dev)?;
            if flash {
                candle_flash::flash_attn_with_lse(&q, &k, &v, &opts)
            } else {
                reference::attention_with_lse(&q, &k, &v, &opts)
            }
        };
        let truth = run(&Device::Cpu, DType::F64, false)?;
        let naive = run(&Device::Cpu, dtype, false)?;
        let flash = run(&gpu, dtype, true)?;
        assert_eq!(flash.0.dims(), &[b, 16, 512]);
        let (ef, en) = (max_err(&flash.0, &truth.0), max_err(&naive.0, &truth.0));
        let tol = 2.0 * en + floor(dtype, false);
        assert!(ef <= tol, "{dtype:?} page {page}: error {ef:.3e} > {tol:.3e} (seed {seed})");
        let el = max_err(&flash.1, &truth.1);
        assert!(
            el <= 1e-3 + 2.0 * max_err(&naive.1, &truth.1),
            "{dtype:?} page {page}: lse error {el:.3e} (seed {seed})"
        );
        println!("{dtype:?} page {page}: fwd {ef:.1e} (naive {en:.1e})");
    }
    Ok(())
}
