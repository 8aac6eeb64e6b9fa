//! CPU forward: one rayon task per (sequence, query head, Q tile); online softmax over K tiles.
//! K/V rows come from packed tensors or a paged cache alike ([`KvRows`]).

use super::kv::KvRows;
use super::{dense_f32, exp_shifted_sum, logits_row, tile_matmul, MatRef, SharedMut, K_TILE, Q_TILE};
use crate::params::{AttnShape, FlashAttnOptions, HostData, RowKeys};
use candle_core::{CpuStorage, Layout, Result};
use rayon::prelude::*;

/// Per-worker scratch, O(tile): the packed Q tile, scores, output accumulator, running max
/// and sum, and (paged K/V only) the K and V tiles copied out of their pages.
struct Scratch {
    q_pack: Vec<f32>,
    k_tile: Vec<f32>,
    v_tile: Vec<f32>,
    scores: Vec<f32>,
    acc: Vec<f32>,
    row_max: Vec<f32>,
    row_sum: Vec<f32>,
}

impl Scratch {
    fn new(d: usize, rows: usize, paged: bool) -> Self {
        let kv_tile = if paged { K_TILE * d } else { 0 };
        Self {
            q_pack: vec![0.0; rows * d],
            k_tile: vec![0.0; kv_tile],
            v_tile: vec![0.0; kv_tile],
            scores: vec![0.0; rows * K_TILE],
            acc: vec![0.0; rows * d],
            row_max: vec![0.0; rows],
            row_sum: vec![0.0; rows],
        }
    }
}

/// Forward on the CPU. Returns the output (q's dtype, q's shape, contiguous) and the
/// log-sum-exp (f32, laid out as `shape.lse_dims()`).
///
/// A task covers a few query rows of *every* query head that shares one KV head (GQA/MQA),
/// packed into one tile of about [`Q_TILE`] rows: each K/V tile is then read once per group
/// rather than once per head, and decoding (one query row) still gets matrix-sized products.
pub(crate) fn forward(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    (q, q_l): (&CpuStorage, &Layout),
    (k, k_l): (&CpuStorage, &Layout),
    (v, v_l): (&CpuStorage, &Layout),
) -> Result<(CpuStorage, Vec<f32>)> {
    let host = shape.host()?;
    let q = dense_f32(q, q_l)?;
    let (k, v) = (KvRows::new(shape, host, k, k_l)?, KvRows::new(shape, host, v, v_l)?);
    let (h, d, group) = (shape.num_heads, shape.head_dim, shape.group_size());
    // NaN until written: every (row, head) slot is written below, masked rows included.
    let mut out = vec![f32::NAN; shape.total_q * h * d];
    let mut lse = vec![f32::NEG_INFINITY; shape.lse_dims().iter().product()];

    let rows_per_head = (Q_TILE / group).max(1);
    let tasks: Vec<(usize, usize, usize)> = host
        .seqs
        .iter()
        .enumerate()
        .flat_map(|(b, seq)| {
            (0..shape.num_kv_heads)
                .flat_map(move |kvh| (0..seq.q_len).step_by(rows_per_head).map(move |i0| (b, kvh, i0)))
        })
        .collect();
    let (out_ptr, lse_ptr) = (SharedMut(out.as_mut_ptr()), SharedMut(lse.as_mut_ptr()));
    tasks.par_iter().for_each_init(
        || Scratch::new(d, rows_per_head * group, shape.page_block_size.is_some()),
        |scratch, &(b, kv_head, i0)| {
            let rows = rows_per_head.min(host.seqs[b].q_len - i0);
            // SAFETY: the task (b, kv_head, i0) writes only the out and lse slots of rows
            // i0..i0+rows of sequence b for the query heads of `kv_head`; no two tasks share one.
            unsafe {
                forward_tile(shape, host, opts, (&q, &k, &v), (out_ptr, lse_ptr), (b, kv_head, i0, rows), scratch)
            }
        },
    );
    Ok((super::storage_from_f32(out, shape.dtype)?, lse))
}

/// # Safety
/// `out` and `lse` must point to buffers of `total_q*H*D` and `lse_dims` elements, and no
/// other thread may write the slots of this tile.
unsafe fn forward_tile(
    shape: &AttnShape,
    host: &HostData,
    opts: &FlashAttnOptions,
    (q, k, v): (&[f32], &KvRows, &KvRows),
    (out, lse): (SharedMut, SharedMut),
    (b, kv_head, i0, q_rows): (usize, usize, usize, usize),
    scratch: &mut Scratch,
) {
    let (h, d, group) = (shape.num_heads, shape.head_dim, shape.group_size());
    let seq = &host.seqs[b];
    let q_rs = h * d;
    // Packed row p is query row i0 + p % q_rows of head kv_head*group + p / q_rows.
    let rows = q_rows * group;
    let row_of = |p: usize| (kv_head * group + p / q_rows, i0 + p % q_rows);
    let Scratch { q_pack, k_tile, v_tile, scores, acc, row_max, row_sum } = scratch;
    for p in 0..rows {
        let (head, i) = row_of(p);
        let src = (seq.q_start + i) * q_rs + head * d;
        q_pack[p * d..(p + 1) * d].copy_from_slice(&q[src..src + d]);
    }

    let ranges: Vec<RowKeys> = (0..rows).map(|p| shape.row_keys(opts, host, b, row_of(p).1)).collect();
    // Each row's keys lie in its hull; K tiles outside the union of the hulls are skipped.
    let k_lo = ranges.iter().filter(|r| !r.is_empty()).map(|r| r.hull.0).min().unwrap_or(0);
    let k_hi = ranges.iter().map(|r| r.hull.1).max().unwrap_or(0);

    acc[..rows * d].fill(0.0);
    row_max[..rows].fill(f32::NEG_INFINITY);
    row_sum[..rows].fill(0.0);

    for j0 in (k_lo..k_hi).step_by(K_TILE) {
        let cols = K_TILE.min(k_hi - j0);
        let (k_ptr, k_rs) = k.tile(host, (b, kv_head, d), (j0, cols), k_tile);
        // S = Q Kᵀ for this tile.
        tile_matmul(
            (rows, cols, d),
            scores.as_mut_ptr(),
            K_TILE,
            false,
            MatRef::rows(q_pack.as_ptr(), d),
            MatRef::transposed(k_ptr, k_rs),
            1.0,
        );
        for r in 0..rows {
            let row = &mut scores[r * K_TILE..r * K_TILE + cols];
            let (head, i) = row_of(r);
            let alibi = host.alibi_slope(b, head).map(|s| (s, i as isize + seq.diag_offset()));
            logits_row(row, j0, ranges[r].hull, opts.softmax_scale, opts.softcap, alibi);
            if let Some((lo, hi)) = ranges[r].gap {
                // Keys between the window and an mm-prefix range stay masked.
                let (lo, hi) = (lo.clamp(j0, j0 + cols) - j0, hi.clamp(j0, j0 + cols) - j0);
                row[lo..hi].fill(f32::NEG_INFINITY);
            }
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
        let (v_ptr, v_rs) = v.tile(host, (b, kv_head, d), (j0, cols), v_tile);
        tile_matmul(
            (rows, d, cols),
            acc.as_mut_ptr(),
            d,
            true,
            MatRef::rows(scores.as_ptr(), K_TILE),
            MatRef::rows(v_ptr, v_rs),
            1.0,
        );
    }

    for r in 0..rows {
        let (head, i) = row_of(r);
        let dst = out.0.add((seq.q_start + i) * q_rs + head * d);
        let dst = std::slice::from_raw_parts_mut(dst, d);
        let (sum, max) = (row_sum[r], row_max[r]);
        if sum > 0.0 {
            let inv = 1.0 / sum;
            dst.iter_mut().zip(&acc[r * d..(r + 1) * d]).for_each(|(o, a)| *o = a * inv);
            *lse.0.add(shape.lse_index(seq, head, i)) = max + sum.ln();
        } else {
            // A row that sees no key: output 0, lse -inf (already filled).
            dst.fill(0.0);
        }
    }
}
