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
use candle_core::{CpuStorage, DType, Device, Result, Storage, Tensor};
use rayon::prelude::*;

/// `q (B, 1, H, D)` against `k`, `v` `(B, Sk, Hkv, D)` (GQA: query head `h` reads KV head
/// `h / (H / Hkv)`), every key visible, f32 on the CPU → `(B, 1, H, D)`. `k` and `v` may be
/// views of larger buffers along the batch and sequence axes (the KV cache's), but each
/// position's heads must be contiguous. None when the inputs are not of this form; the caller
/// then uses the general kernel.
pub(crate) fn decode_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<Option<Tensor>> {
    let (b, s, h, d) = q.dims4()?;
    let (bk, sk, hkv, dk) = k.dims4()?;
    let cpu_f32 = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32;
    if s != 1
        || sk == 0
        || bk != b
        || dk != d
        || hkv == 0
        || !h.is_multiple_of(hkv)
        || v.dims() != k.dims()
        || !(cpu_f32(q) && cpu_f32(k) && cpu_f32(v))
    {
        return Ok(None);
    }
    let q = q.contiguous()?;
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (Storage::Cpu(CpuStorage::F32(qd)), Storage::Cpu(CpuStorage::F32(kd)), Storage::Cpu(CpuStorage::F32(vd))) =
        (&*qs, &*ks, &*vs)
    else {
        return Ok(None);
    };
    let row = hkv * d;
    // (offset, batch stride) of k or v when positions are `row` apart and heads `d` apart, with
    // the last element inside the storage.
    let view = |l: &candle_core::Layout, len: usize| {
        let st = l.stride();
        let heads_ok = (hkv == 1 || st[2] == d) && st[3] == 1;
        let positions_ok = sk == 1 || st[1] == row;
        let end = l.start_offset() + (b - 1) * st[0] + (sk - 1) * row + row;
        (heads_ok && positions_ok && end <= len).then_some((l.start_offset(), st[0]))
    };
    let (Some((k0, kb)), Some((v0, vb))) = (view(kl, kd.len()), view(vl, vd.len())) else {
        return Ok(None);
    };
    let qd = &qd[ql.start_offset()..ql.start_offset() + b * h * d];
    let group = h / hkv;
    let mut out = vec![0f32; b * h * d];
    out.par_chunks_mut(d).enumerate().for_each(|(bh, o)| {
        let (bi, kh) = (bh / h, bh % h / group);
        let keys = &kd[k0 + bi * kb..][..sk * row];
        let values = &vd[v0 + bi * vb..][..sk * row];
        head(&qd[bh * d..(bh + 1) * d], keys, values, row, kh * d, scale, o);
    });
    Ok(Some(Tensor::from_vec(out, (b, 1, h, d), &Device::Cpu)?))
}

/// One head: `o = softmax(scale · K q) V` with key/value rows `j` at `keys[j * row + off..][..d]`.
fn head(q: &[f32], keys: &[f32], values: &[f32], row: usize, off: usize, scale: f32, o: &mut [f32]) {
    let d = q.len();
    let mut p: Vec<f32> = keys.chunks_exact(row).map(|kr| dot_f32(q, &kr[off..off + d]) * scale).collect();
    let max = crate::cpu::row_max(&p);
    let sum = crate::cpu::exp_shifted_sum(&mut p, max);
    weighted_rows(&p, values, row, off, o);
    let inv = 1.0 / sum;
    o.iter_mut().for_each(|x| *x *= inv);
}

#[inline(always)]
fn weighted_rows_body(p: &[f32], values: &[f32], row: usize, off: usize, o: &mut [f32]) {
    for (pj, vr) in p.iter().zip(values.chunks_exact(row)) {
        for (x, v) in o.iter_mut().zip(&vr[off..]) {
            *x = pj.mul_add(*v, *x);
        }
    }
}

/// The same loop compiled for AVX2/FMA so that the row update vectorizes with 256-bit FMAs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn weighted_rows_avx2(p: &[f32], values: &[f32], row: usize, off: usize, o: &mut [f32]) {
    weighted_rows_body(p, values, row, off, o)
}

/// `o = Σ_j p[j] · values[j * row + off..][..o.len()]`.
fn weighted_rows(p: &[f32], values: &[f32], row: usize, off: usize, o: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports the features the function is compiled for.
        return unsafe { weighted_rows_avx2(p, values, row, off, o) };
    }
    weighted_rows_body(p, values, row, off, o)
}
