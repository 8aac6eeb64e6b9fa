//! CPU forward: one rayon task per (sequence, query head, Q tile); online softmax over K tiles.

use super::{dense_f32, exp_shifted_sum, logits_row, tile_matmul, MatRef, SharedMut, K_TILE, Q_TILE};
use crate::params::{AttnShape, FlashAttnOptions};
use candle_core::{CpuStorage, Layout, Result};
use rayon::prelude::*;

/// Per-worker scratch, O(tile): scores, output accumulator, running max and sum.
struct Scratch {
    scores: Vec<f32>,
    acc: Vec<f32>,
    row_max: Vec<f32>,
    row_sum: Vec<f32>,
}

impl Scratch {
    fn new(d: usize) -> Self {
        Self {
            scores: vec![0.0; Q_TILE * K_TILE],
            acc: vec![0.0; Q_TILE * d],
            row_max: vec![0.0; Q_TILE],
            row_sum: vec![0.0; Q_TILE],
        }
    }
}

/// Forward on the CPU. Returns the output (q's dtype, q's shape, contiguous) and the
/// log-sum-exp (f32, laid out as `shape.lse_dims()`).
pub(crate) fn forward(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    (q, q_l): (&CpuStorage, &Layout),
    (k, k_l): (&CpuStorage, &Layout),
    (v, v_l): (&CpuStorage, &Layout),
) -> Result<(CpuStorage, Vec<f32>)> {
    let (q, k, v) = (dense_f32(q, q_l)?, dense_f32(k, k_l)?, dense_f32(v, v_l)?);
    let (h, d) = (shape.num_heads, shape.head_dim);
    let mut out = vec![0f32; shape.total_q * h * d];
    let mut lse = vec![f32::NEG_INFINITY; shape.lse_dims().iter().product()];

    let tasks: Vec<(usize, usize, usize)> = shape
        .seqs
        .iter()
        .enumerate()
        .flat_map(|(b, seq)| (0..h).flat_map(move |head| (0..seq.q_len).step_by(Q_TILE).map(move |i0| (b, head, i0))))
        .collect();
    let (out_ptr, lse_ptr) = (SharedMut(out.as_mut_ptr()), SharedMut(lse.as_mut_ptr()));
    tasks.par_iter().for_each_init(
        || Scratch::new(d),
        |scratch, &(b, head, i0)| {
            // SAFETY: the task (b, head, i0) writes only the out and lse slots of rows
            // i0..i0+Q_TILE of sequence b and head `head`; tasks never share such a slot.
            unsafe { forward_tile(shape, opts, (&q, &k, &v), (out_ptr, lse_ptr), (b, head, i0), scratch) }
        },
    );
    Ok((super::storage_from_f32(out, shape.dtype)?, lse))
}

/// # Safety
/// `out` and `lse` must point to buffers of `total_q*H*D` and `lse_dims` elements, and no
/// other thread may write the slots of this (b, head, i0) tile.
unsafe fn forward_tile(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    (q, k, v): (&[f32], &[f32], &[f32]),
    (out, lse): (SharedMut, SharedMut),
    (b, head, i0): (usize, usize, usize),
    scratch: &mut Scratch,
) {
    let (h, hkv, d) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
    let seq = &shape.seqs[b];
    let kv_head = head / shape.group_size();
    let rows = Q_TILE.min(seq.q_len - i0);
    let (q_rs, kv_rs) = (h * d, hkv * d);
    let q_tile = q.as_ptr().add((seq.q_start + i0) * q_rs + head * d);
    let k_base = k.as_ptr().add(seq.k_start * kv_rs + kv_head * d);
    let v_base = v.as_ptr().add(seq.k_start * kv_rs + kv_head * d);
    let alibi = shape.alibi_slope(b, head);

    let ranges: Vec<(usize, usize)> = (0..rows).map(|r| shape.key_range(opts, seq, i0 + r)).collect();
    // Key ranges move monotonically with the row, so the tile's keys are one interval;
    // K tiles outside it are skipped entirely.
    let k_lo = ranges.iter().filter(|r| r.1 > r.0).map(|r| r.0).min().unwrap_or(0);
    let k_hi = ranges.iter().map(|r| r.1).max().unwrap_or(0);

    let Scratch { scores, acc, row_max, row_sum } = scratch;
    acc[..rows * d].fill(0.0);
    row_max[..rows].fill(f32::NEG_INFINITY);
    row_sum[..rows].fill(0.0);

    for j0 in (k_lo..k_hi).step_by(K_TILE) {
        let cols = K_TILE.min(k_hi - j0);
        // S = Q Kᵀ for this tile.
        tile_matmul(
            (rows, cols, d),
            scores.as_mut_ptr(),
            K_TILE,
            false,
            MatRef::rows(q_tile, q_rs),
            MatRef::transposed(k_base.add(j0 * kv_rs), kv_rs),
            1.0,
        );
        for r in 0..rows {
            let row = &mut scores[r * K_TILE..r * K_TILE + cols];
            let pos = (i0 + r) as isize + seq.diag_offset();
            logits_row(row, j0, ranges[r], opts.softmax_scale, opts.softcap, alibi.map(|s| (s, pos)));
            let new_max = row_max[r].max(super::row_max(row));
            if new_max == f32::NEG_INFINITY {
                // Nothing visible to this row yet: its probabilities are all zero.
                row.fill(0.0);
                continue;
            }
            let sum = exp_shifted_sum(row, new_max);
            // Rescale what was accumulated under the old max (exp(-inf) = 0 on the first tile).
            let correction = (row_max[r] - new_max).exp();
            if correction != 1.0 {
                acc[r * d..(r + 1) * d].iter_mut().for_each(|x| *x *= correction);
            }
            row_sum[r] = row_sum[r] * correction + sum;
            row_max[r] = new_max;
        }
        // O += P V.
        tile_matmul(
            (rows, d, cols),
            acc.as_mut_ptr(),
            d,
            true,
            MatRef::rows(scores.as_ptr(), K_TILE),
            MatRef::rows(v_base.add(j0 * kv_rs), kv_rs),
            1.0,
        );
    }

    for r in 0..rows {
        let dst = out.0.add((seq.q_start + i0 + r) * q_rs + head * d);
        let dst = std::slice::from_raw_parts_mut(dst, d);
        let (sum, max) = (row_sum[r], row_max[r]);
        if sum > 0.0 {
            let inv = 1.0 / sum;
            dst.iter_mut().zip(&acc[r * d..(r + 1) * d]).for_each(|(o, a)| *o = a * inv);
            *lse.0.add(shape.lse_index(b, head, i0 + r)) = max + sum.ln();
        } else {
            // A row that sees no key: output 0, lse -inf (already filled).
            dst.fill(0.0);
        }
    }
}
