//! Attention for one new query position per sequence (a decode step) on the CPU.
//!
//! With a single query row there is nothing for the flash kernel's tiling to save: the scores
//! are one row of at most a few thousand f32 per head, while the tiled kernel still issues a
//! small `gemm` per key tile, and on the CPU those 1-row products took ~37% of a decode step
//! after a 1024-token prompt (perf, bench/NOTES.md). Here each (sequence, head) computes its
//! score row with vectorized dot products, an exact softmax, and the weighted sum of the value
//! rows, the heads split over the rayon threads. Same result as the flash kernel up to f32
//! rounding order (the tests compare cached decoding against a full flash forward).

use super::qlinear::dot_f32;
#[cfg(target_arch = "x86_64")]
use super::qlinear::hsum;
use candle_core::{CpuStorage, DType, Device, Layout, Result, Storage, Tensor};

/// `q (B, 1, H, D)` against `k`, `v` `(B, Sk, Hkv, D)` (GQA: query head `h` reads KV head
/// `h / (H / Hkv)`), every key visible, f32 on the CPU → `(B, 1, H, D)`. `k` and `v` may be
/// views of larger buffers along the batch and sequence axes (the KV cache's), but each
/// position's heads must be contiguous. None when the inputs are not of this form; the caller
/// then uses the general kernel (also when any input is tracked for autograd: this path has
/// no backward).
pub(crate) fn decode_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<Option<Tensor>> {
    let (b, s, h, d) = q.dims4()?;
    let (bk, sk, hkv, dk) = k.dims4()?;
    let cpu_f32 = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32;
    if s != 1
        || b == 0
        || h == 0
        || d == 0
        || sk == 0
        || bk != b
        || dk != d
        || hkv == 0
        || !h.is_multiple_of(hkv)
        || v.dims() != k.dims()
        || !(cpu_f32(q) && cpu_f32(k) && cpu_f32(v))
        // The result is built from raw storage, outside candle's graph: when a gradient may be
        // asked for, the differentiable op must run instead.
        || q.track_op()
        || k.track_op()
        || v.track_op()
    {
        return Ok(None);
    }
    let row = hkv * d;
    // (offset, batch stride) of k or v when positions are `row` apart and heads `d` apart, with
    // the last element inside the storage.
    let view = |l: &Layout, len: usize| {
        let st = l.stride();
        let heads_ok = (hkv == 1 || st[2] == d) && st[3] == 1;
        let positions_ok = sk == 1 || st[1] == row;
        let end = l.start_offset() + (b - 1) * st[0] + (sk - 1) * row + row;
        (heads_ok && positions_ok && end <= len).then_some((l.start_offset(), st[0]))
    };
    let out = attend_runs(q, k, v, (h, hkv, d), scale, |kl, klen, vl, vlen| {
        let ((k0, kb), (v0, vb)) = (view(kl, klen)?, view(vl, vlen)?);
        Some((0..b).map(|bi| vec![Run { k: k0 + bi * kb, v: v0 + bi * vb, rows: sk }]).collect())
    })?;
    out.map(|out| Tensor::from_vec(out, (b, 1, h, d), &Device::Cpu)).transpose()
}

/// The same for one query row per sequence against a paged cache: `q (B, H, D)`, `k_cache` and
/// `v_cache` `(pages, page_size, Hkv, D)` contiguous, and sequence b's keys the first `len`
/// rows of its `pages` in order. A page is a run of consecutive rows for the kernels below,
/// which keep their accumulators across runs: the result is bitwise what [`decode_attention`]
/// gives on the same keys in a contiguous cache (a sequence decoded in a batch computes what it
/// computes alone). None when the inputs are not CPU f32 of this form.
pub(crate) fn decode_attention_paged(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    seqs: &[(&[u32], usize)],
    scale: f32,
) -> Result<Option<Tensor>> {
    let (b, h, d) = q.dims3()?;
    let (num_pages, page, hkv, dk) = k_cache.dims4()?;
    let cpu_f32 = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32 && !t.track_op();
    if b != seqs.len()
        || b == 0
        || h == 0
        || d == 0
        || dk != d
        || hkv == 0
        || !h.is_multiple_of(hkv)
        || v_cache.dims() != k_cache.dims()
        || !(cpu_f32(q) && cpu_f32(k_cache) && cpu_f32(v_cache))
        || !(k_cache.is_contiguous() && v_cache.is_contiguous())
        || seqs.iter().any(|(pages, len)| {
            *len == 0 || pages.len() * page < *len || pages.iter().any(|&p| p as usize >= num_pages)
        })
    {
        return Ok(None);
    }
    let row = hkv * d;
    let out = attend_runs(q, k_cache, v_cache, (h, hkv, d), scale, |kl, klen, vl, vlen| {
        let (k0, v0) = (kl.start_offset(), vl.start_offset());
        if k0 + num_pages * page * row > klen || v0 + num_pages * page * row > vlen {
            return None;
        }
        let runs = seqs.iter().map(|(pages, len)| {
            let run = |(i, p): (usize, &u32)| {
                let o = *p as usize * page * row;
                Run { k: k0 + o, v: v0 + o, rows: page.min(len - i * page) }
            };
            pages[..len.div_ceil(page)].iter().enumerate().map(run).collect()
        });
        Some(runs.collect())
    })?;
    out.map(|out| Tensor::from_vec(out, (b, h, d), &Device::Cpu)).transpose()
}

/// Every (sequence, query head) of `q` (`B·H` rows of `d` values) against the keys and values
/// of `k`, `v` (CPU f32) that `runs` locates from their layouts and storage lengths: one list
/// of runs per sequence, each head's keys in order (None: not of a form the kernels read).
/// The heads are split over the rayon threads; → the `B·H·d` outputs.
fn attend_runs(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    (h, hkv, d): (usize, usize, usize),
    scale: f32,
    runs: impl FnOnce(&Layout, usize, &Layout, usize) -> Option<Vec<Vec<Run>>>,
) -> Result<Option<Vec<f32>>> {
    let q = q.contiguous()?;
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (Storage::Cpu(CpuStorage::F32(qd)), Storage::Cpu(CpuStorage::F32(kd)), Storage::Cpu(CpuStorage::F32(vd))) =
        (&*qs, &*ks, &*vs)
    else {
        return Ok(None);
    };
    let Some(runs) = runs(kl, kd.len(), vl, vd.len()) else { return Ok(None) };
    let (b, row, group) = (runs.len(), hkv * d, h / hkv);
    let qd = &qd[ql.start_offset()..ql.start_offset() + b * h * d];
    let mut out = vec![0f32; b * h * d];
    candle_flash::cpu::for_each_chunk_mut(&mut out, d, |bh, o| {
        let (bi, kh) = (bh / h, bh % h / group);
        head(&qd[bh * d..(bh + 1) * d], kd, vd, &runs[bi], row, kh * d, scale, o);
    });
    Ok(Some(out))
}

/// `rows` consecutive key/value rows starting at element offsets `k` and `v` of the storage.
#[derive(Clone, Copy, Debug)]
struct Run {
    k: usize,
    v: usize,
    rows: usize,
}

/// One head: `o = softmax(scale · K q) V` over the keys of `runs` in order, key/value row `j` of
/// a run at `kd[run.k + j * row + off..][..d]` (and `vd` likewise).
#[allow(clippy::too_many_arguments)]
fn head(q: &[f32], kd: &[f32], vd: &[f32], runs: &[Run], row: usize, off: usize, scale: f32, o: &mut [f32]) {
    let d = q.len();
    let mut p = vec![0f32; runs.iter().map(|r| r.rows).sum()];
    #[cfg(target_arch = "x86_64")]
    // the one ISA switch (CANDLE_FLASH_CPU_ISA and with_cpu_isa reach it)
    let simd = d.is_multiple_of(8)
        && d <= 8 * MAX_CHUNKS
        && candle_flash::cpu::CpuIsa::active() >= candle_flash::cpu::CpuIsa::Avx2;
    #[cfg(not(target_arch = "x86_64"))]
    let simd = false;
    let mut j0 = 0;
    for run in runs {
        let (keys, p) = (&kd[run.k..run.k + run.rows * row], &mut p[j0..j0 + run.rows]);
        j0 += run.rows;
        if simd {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has AVX2 and FMA, d is a multiple of 8 within MAX_CHUNKS vectors,
            // and every row `j < p.len()` of keys holds `off + d <= row` values.
            unsafe {
                scores_avx2(q, keys, row, off, scale, p)
            };
        } else {
            for (s, kr) in p.iter_mut().zip(keys.chunks_exact(row)) {
                *s = dot_f32(q, &kr[off..off + d]) * scale;
            }
        }
    }
    let max = candle_flash::cpu::row_max(&p);
    let sum = candle_flash::cpu::exp_shifted_sum_active(&mut p, max);
    if simd {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for the value rows of every run.
        unsafe {
            weighted_rows_avx2(&p, vd, runs, row, off, o)
        };
    } else {
        o.fill(0.0);
        let mut j0 = 0;
        for run in runs {
            let values = &vd[run.v..run.v + run.rows * row];
            for (pj, vr) in p[j0..j0 + run.rows].iter().zip(values.chunks_exact(row)) {
                for (x, v) in o.iter_mut().zip(&vr[off..]) {
                    *x = pj.mul_add(*v, *x);
                }
            }
            j0 += run.rows;
        }
    }
    let inv = 1.0 / sum;
    o.iter_mut().for_each(|x| *x *= inv);
}

/// Head dims up to 8 · this take the AVX2 path.
const MAX_CHUNKS: usize = 32;

/// `p[j] = scale · q · keys[j * row + off..][..d]`, one whole row of scores per call (a call
/// per key cost more than its 64 multiply-adds).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_avx2(q: &[f32], keys: &[f32], row: usize, off: usize, scale: f32, p: &mut [f32]) {
    use std::arch::x86_64::*;
    let nc = q.len() / 8;
    let mut qv = [_mm256_setzero_ps(); MAX_CHUNKS];
    for (c, v) in qv.iter_mut().enumerate().take(nc) {
        *v = _mm256_loadu_ps(q.as_ptr().add(8 * c));
    }
    for (j, s) in p.iter_mut().enumerate() {
        let kr = keys.as_ptr().add(j * row + off);
        // Two accumulators halve the FMA latency chain.
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut c = 0;
        while c + 1 < nc {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(kr.add(8 * c)), qv[c], a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(kr.add(8 * c + 8)), qv[c + 1], a1);
            c += 2;
        }
        if c < nc {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(kr.add(8 * c)), qv[c], a0);
        }
        *s = hsum(_mm256_add_ps(a0, a1)) * scale;
    }
}

/// `o = Σ_j p[j] · value row j [off..][..o.len()]` over the rows of `runs` in order (row `j` of
/// a run at `vd[run.v + j * row..]`): up to 64 output lanes at a time held in eight registers,
/// so that the value rows stream through once, in order (a pass per 8 lanes read each row eight
/// times, strided, and took longer than the scores). The registers carry over from one run to
/// the next, so the sums do not depend on how the rows are split into runs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn weighted_rows_avx2(p: &[f32], vd: &[f32], runs: &[Run], row: usize, off: usize, o: &mut [f32]) {
    use std::arch::x86_64::*;
    let nc = o.len() / 8;
    for c0 in (0..nc).step_by(8) {
        let width = (nc - c0).min(8);
        let mut a = [_mm256_setzero_ps(); 8];
        let mut j0 = 0;
        for run in runs {
            let base = vd.as_ptr().add(run.v + off + 8 * c0);
            let p = &p[j0..j0 + run.rows];
            j0 += run.rows;
            if width == 8 {
                for (j, pj) in p.iter().enumerate() {
                    let (w, v) = (_mm256_set1_ps(*pj), base.add(j * row));
                    for (c, acc) in a.iter_mut().enumerate() {
                        *acc = _mm256_fmadd_ps(w, _mm256_loadu_ps(v.add(8 * c)), *acc);
                    }
                }
            } else {
                for (j, pj) in p.iter().enumerate() {
                    let (w, v) = (_mm256_set1_ps(*pj), base.add(j * row));
                    for (c, acc) in a.iter_mut().enumerate().take(width) {
                        *acc = _mm256_fmadd_ps(w, _mm256_loadu_ps(v.add(8 * c)), *acc);
                    }
                }
            }
        }
        for (c, acc) in a.iter().enumerate().take(width) {
            _mm256_storeu_ps(o.as_mut_ptr().add(8 * (c0 + c)), *acc);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_flash::cpu::{with_cpu_isa, CpuIsa};

    /// Each ISA path this CPU has (`with_cpu_isa`) against a plain softmax(q Kᵀ) V, GQA, a head
    /// dim the AVX2 kernels take (64) and one they leave to the portable code (20).
    #[test]
    fn every_isa_path_matches_plain_attention() -> Result<()> {
        for d in [64, 20] {
            let (b, sk, h, hkv) = (2, 37, 4, 2);
            let q = Tensor::randn(0f32, 1., (b, 1, h, d), &Device::Cpu)?;
            let k = Tensor::randn(0f32, 1., (b, sk, hkv, d), &Device::Cpu)?;
            let v = Tensor::randn(0f32, 1., (b, sk, hkv, d), &Device::Cpu)?;
            let scale = 0.125;
            // plain: heads to the front, KV heads repeated for their query heads
            let rep = |t: &Tensor| -> Result<Tensor> {
                let t = t.transpose(1, 2)?.contiguous()?; // (b, hkv, sk, d)
                let t = t.unsqueeze(2)?.broadcast_as((b, hkv, h / hkv, sk, d))?;
                t.reshape((b, h, sk, d))
            };
            let qh = q.transpose(1, 2)?.contiguous()?; // (b, h, 1, d)
            let scores = (qh.matmul(&rep(&k)?.t()?)? * scale as f64)?;
            let want = candle_nn::ops::softmax_last_dim(&scores)?.matmul(&rep(&v)?)?.transpose(1, 2)?;
            for isa in [CpuIsa::Portable, CpuIsa::Avx2] {
                if isa > CpuIsa::detected() {
                    println!("skipping {isa:?}: this CPU has at most {:?}", CpuIsa::detected());
                    continue;
                }
                let (used, got) = with_cpu_isa(isa, || decode_attention(&q, &k, &v, scale));
                assert_eq!(used, isa);
                let got = got?.expect("a decode shape");
                let err = (got - &want)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                assert!(err < 1e-5, "d = {d} on {isa:?}: max error {err}");
            }
        }
        Ok(())
    }
}
