//! CPU forward: one rayon task per (sequence, KV head, Q tile); online softmax over K tiles.
//! K/V rows come from packed tensors or a paged cache alike ([`KvRows`]).
//!
//! The scores are computed transposed, Sᵀ = K Qᵀ (keys × query rows): Qᵀ is packed once per
//! task and K is read in place, so no K tile is ever transposed; the softmax then runs down the
//! columns, vectorised across query rows, and O += P V reads Pᵀ's columns as P's rows.

use super::kv::KvRows;
use super::simd::{bf16_pair, tile_matmul, tile_matmul_bf16_pairs, CpuIsa, MatRef};
use super::{dense_f32, exp_poly, logits_row, CpuTiles, SharedMut};
use crate::params::{AttnShape, FlashAttnOptions, HostData, RowKeys};
use candle_core::{CpuStorage, DType, Layout, Result};
use rayon::prelude::*;

/// Per-worker scratch, O(tile): Qᵀ, the K and V tiles (f32, contiguous), the transposed
/// scores, the output accumulator, running max and sum, and one score column.
struct Scratch {
    q_t: Vec<f32>,
    k_tile: Vec<f32>,
    v_tile: Vec<f32>,
    scores_t: Vec<f32>,
    acc: Vec<f32>,
    row_max: Vec<f32>,
    row_sum: Vec<f32>,
    correction: Vec<f32>,
    column: Vec<f32>,
    /// The bf16-pair operands (AVX-512 BF16 on bf16 inputs only, else empty): Qᵀ, K, P and V
    /// with pairs along the reduction axis of each product.
    pairs: PairScratch,
}

#[derive(Default)]
struct PairScratch {
    q_t: Vec<u32>,
    k: Vec<u32>,
    p: Vec<u32>,
    v: Vec<u32>,
}

impl Scratch {
    fn new(d: usize, rows: usize, k_cols: usize, bf16_pairs: bool) -> Self {
        let kv_tile = k_cols * d;
        let (d2, k2) = (d.div_ceil(2), k_cols.div_ceil(2));
        let pairs = if bf16_pairs {
            PairScratch { q_t: vec![0; d2 * rows], k: vec![0; k_cols * d2], p: vec![0; k2 * rows], v: vec![0; k2 * d] }
        } else {
            PairScratch::default()
        };
        Self {
            pairs,
            q_t: vec![0.0; d * rows],
            k_tile: vec![0.0; kv_tile],
            v_tile: vec![0.0; kv_tile],
            scores_t: vec![0.0; k_cols * rows],
            acc: vec![0.0; rows * d],
            row_max: vec![0.0; rows],
            row_sum: vec![0.0; rows],
            correction: vec![0.0; rows],
            column: vec![0.0; k_cols],
        }
    }
}

/// Forward on the CPU. Returns the output (q's dtype, q's shape, contiguous) and the
/// log-sum-exp (f32, laid out as `shape.lse_dims()`).
///
/// A task covers a few query rows of *every* query head that shares one KV head (GQA/MQA),
/// packed into one tile of about [`CpuTiles::q_rows`] rows: each K/V tile is then read once per group
/// rather than once per head, and decoding (one query row) still gets matrix-sized products.
pub(crate) fn forward(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    (q, q_l): (&CpuStorage, &Layout),
    (k, k_l): (&CpuStorage, &Layout),
    (v, v_l): (&CpuStorage, &Layout),
) -> Result<(CpuStorage, Vec<f32>)> {
    let host = shape.host()?;
    let (isa, tiles) = (CpuIsa::active(), CpuTiles::get());
    // bf16 inputs on a CPU with the BF16 dot product: both products on bf16 pairs with f32
    // accumulation (P rounded to bf16 for P V, as the GPU kernels do).
    let bf16_pairs = isa == CpuIsa::Avx512Bf16 && shape.dtype == DType::BF16;
    let q = dense_f32(q, q_l)?;
    let (k, v) = (KvRows::new(isa, shape, host, k, k_l)?, KvRows::new(isa, shape, host, v, v_l)?);
    let (h, d, group) = (shape.num_heads, shape.head_dim, shape.group_size());
    // NaN until written: every (row, head) slot is written below, masked rows included.
    let mut out = vec![f32::NAN; shape.total_q * h * d];
    let mut lse = vec![f32::NEG_INFINITY; shape.lse_dims().iter().product()];

    let rows_per_head = (tiles.q_rows / group).max(1);
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
        || Scratch::new(d, rows_per_head * group, tiles.k_cols, bf16_pairs),
        |scratch, &(b, kv_head, i0)| {
            let rows = rows_per_head.min(host.seqs[b].q_len - i0);
            // SAFETY: the task (b, kv_head, i0) writes only the out and lse slots of rows
            // i0..i0+rows of sequence b for the query heads of `kv_head`; no two tasks share one.
            unsafe {
                let task = Task { isa, bf16_pairs, k_cols: tiles.k_cols, b, kv_head, i0, q_rows: rows };
                forward_tile(shape, host, opts, (&q, &k, &v), (out_ptr, lse_ptr), task, scratch)
            }
        },
    );
    Ok((super::storage_from_f32(out, shape.dtype)?, lse))
}

/// One forward task: query rows `i0..i0 + q_rows` of sequence `b`, for every query head of
/// `kv_head`'s group, with the instruction set and key tile of the call.
#[derive(Clone, Copy)]
struct Task {
    isa: CpuIsa,
    bf16_pairs: bool,
    k_cols: usize,
    b: usize,
    kv_head: usize,
    i0: usize,
    q_rows: usize,
}

/// # Safety
/// `out` and `lse` must point to buffers of `total_q*H*D` and `lse_dims` elements, no other
/// thread may write the slots of this tile, and `task.isa` must not exceed the CPU's.
unsafe fn forward_tile(
    shape: &AttnShape,
    host: &HostData,
    opts: &FlashAttnOptions,
    (q, k, v): (&[f32], &KvRows, &KvRows),
    (out, lse): (SharedMut, SharedMut),
    Task { isa, bf16_pairs, k_cols, b, kv_head, i0, q_rows }: Task,
    scratch: &mut Scratch,
) {
    let (h, d, group) = (shape.num_heads, shape.head_dim, shape.group_size());
    let seq = &host.seqs[b];
    let q_rs = h * d;
    // Packed row p is query row i0 + p % q_rows of head kv_head*group + p / q_rows.
    let rows = q_rows * group;
    let row_of = |p: usize| (kv_head * group + p / q_rows, i0 + p % q_rows);
    let Scratch { q_t, k_tile, v_tile, scores_t, acc, row_max, row_sum, correction, column, pairs } = scratch;
    let d2 = d.div_ceil(2);
    // Qᵀ (d × rows): column p is packed row p.
    for p in 0..rows {
        let (head, i) = row_of(p);
        let src = (seq.q_start + i) * q_rs + head * d;
        for (c, &x) in q[src..src + d].iter().enumerate() {
            q_t[c * rows + p] = x;
        }
        if bf16_pairs {
            for c2 in 0..d2 {
                let hi = if 2 * c2 + 1 < d { q[src + 2 * c2 + 1] } else { 0.0 };
                pairs.q_t[c2 * rows + p] = bf16_pair(q[src + 2 * c2], hi);
            }
        }
    }

    let ranges: Vec<RowKeys> = (0..rows).map(|p| shape.row_keys(opts, host, b, row_of(p).1)).collect();
    // Each row's keys lie in its hull; K tiles outside the union of the hulls are skipped.
    let k_lo = ranges.iter().filter(|r| !r.is_empty()).map(|r| r.hull.0).min().unwrap_or(0);
    let k_hi = ranges.iter().map(|r| r.hull.1).max().unwrap_or(0);
    // Tiles inside every row's hull (and no gap) need no mask: the common case.
    let (all_lo, all_hi) = (
        ranges.iter().map(|r| r.hull.0).max().unwrap_or(0),
        ranges.iter().map(|r| if r.gap.is_some() { 0 } else { r.hull.1 }).min().unwrap_or(0),
    );
    let plain_logits = opts.softcap.is_none() && !host.has_alibi();

    acc[..rows * d].fill(0.0);
    row_max[..rows].fill(f32::NEG_INFINITY);
    row_sum[..rows].fill(0.0);

    for j0 in (k_lo..k_hi).step_by(k_cols) {
        let cols = k_cols.min(k_hi - j0);
        let s_t = &mut scores_t[..cols * rows];
        let k_rows = k.tile(host, (b, kv_head, d), (j0, cols), k_tile);
        // Sᵀ = scale · K Qᵀ for this tile (keys × rows).
        if bf16_pairs {
            pack_row_pairs(isa, k_rows, d, &mut pairs.k[..cols * d2]);
            let k2 = MatRef::rows(pairs.k.as_ptr().cast(), d2);
            tile_matmul_bf16_pairs(
                isa,
                (cols, rows, d2),
                s_t.as_mut_ptr(),
                rows,
                false,
                k2,
                (pairs.q_t.as_ptr().cast(), rows),
                opts.softmax_scale,
            );
        } else {
            let q_t = (q_t.as_ptr(), rows);
            tile_matmul(
                isa,
                (cols, rows, d),
                s_t.as_mut_ptr(),
                rows,
                false,
                MatRef::rows(k_rows.as_ptr(), d),
                q_t,
                opts.softmax_scale,
            );
        }
        if !(plain_logits && all_lo <= j0 && j0 + cols <= all_hi) {
            // Softcap, ALiBi and masks per query row, through the one row rule.
            for (r, keys) in ranges.iter().enumerate() {
                let column = &mut column[..cols];
                column.iter_mut().enumerate().for_each(|(j, x)| *x = s_t[j * rows + r]);
                let (head, i) = row_of(r);
                let alibi = host.alibi_slope(b, head).map(|s| (s, i as isize + seq.diag_offset()));
                logits_row(column, j0, keys.hull, 1.0, opts.softcap, alibi);
                if let Some((lo, hi)) = keys.gap {
                    // Keys between the window and an mm-prefix range stay masked.
                    let (lo, hi) = (lo.clamp(j0, j0 + cols) - j0, hi.clamp(j0, j0 + cols) - j0);
                    column[lo..hi].fill(f32::NEG_INFINITY);
                }
                column.iter().enumerate().for_each(|(j, &x)| s_t[j * rows + r] = x);
            }
        }
        online_softmax_columns(isa, s_t, rows, &mut row_max[..rows], &mut row_sum[..rows], &mut correction[..rows]);
        rescale_rows(isa, &mut acc[..rows * d], d, &correction[..rows]);
        // O += P V, P = (Sᵀ)ᵀ read in place (or as bf16 pairs of consecutive keys).
        let v_rows = v.tile(host, (b, kv_head, d), (j0, cols), v_tile);
        if bf16_pairs {
            let k2 = cols.div_ceil(2);
            for j2 in 0..k2 {
                let (j, next) = (2 * j2, (2 * j2 + 1 < cols).then_some(2 * j2 + 1));
                let p_rows = (&s_t[j * rows..(j + 1) * rows], next.map(|n| &s_t[n * rows..(n + 1) * rows]));
                pack_pairs(isa, p_rows.0, p_rows.1, &mut pairs.p[j2 * rows..(j2 + 1) * rows]);
                let v_pair = (&v_rows[j * d..(j + 1) * d], next.map(|n| &v_rows[n * d..(n + 1) * d]));
                pack_pairs(isa, v_pair.0, v_pair.1, &mut pairs.v[j2 * d..(j2 + 1) * d]);
            }
            let p2 = MatRef::transposed(pairs.p.as_ptr().cast(), rows);
            tile_matmul_bf16_pairs(
                isa,
                (rows, d, k2),
                acc.as_mut_ptr(),
                d,
                true,
                p2,
                (pairs.v.as_ptr().cast(), d),
                1.0,
            );
        } else {
            let p = MatRef::transposed(s_t.as_ptr(), rows);
            tile_matmul(isa, (rows, d, cols), acc.as_mut_ptr(), d, true, p, (v_rows.as_ptr(), d), 1.0);
        }
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

super::simd::multiversion! {
    /// One step of the online softmax on a transposed score tile (`s_t`: keys × `rows`, each
    /// column a query row), vectorised across the columns: new running max, `s_t ← exp(s_t −
    /// max)` (masked -inf → 0), running sum rescaled and extended, and the factor `correction`
    /// by which the row's accumulated output must be rescaled. A column that has seen no key
    /// keeps max -inf, sum 0, and gets zero probabilities (its shift is 0, so exp(-inf - 0) =
    /// 0, not NaN). Columns go 16 at a time so that max and sum stay in registers while the
    /// keys stream by (running them key-major, through memory, took twice as long; measured).
    fn online_softmax_columns(s_t: &mut [f32], rows: usize, row_max: &mut [f32], row_sum: &mut [f32], correction: &mut [f32]) {
        let full = rows - rows % 16;
        for c0 in (0..full).step_by(16) {
            softmax_column_block::<16>(s_t, rows, c0, (row_max, row_sum, correction));
        }
        for c0 in full..rows {
            softmax_column_block::<1>(s_t, rows, c0, (row_max, row_sum, correction));
        }
    }
}

/// [`online_softmax_columns`] for columns `c0..c0 + W`.
#[inline(always)]
fn softmax_column_block<const W: usize>(
    s_t: &mut [f32],
    rows: usize,
    c0: usize,
    (row_max, row_sum, correction): (&mut [f32], &mut [f32], &mut [f32]),
) {
    let mut max: [f32; W] = row_max[c0..c0 + W].try_into().unwrap();
    for key in s_t.chunks_exact(rows) {
        let key: &[f32; W] = key[c0..c0 + W].try_into().unwrap();
        for (m, &x) in max.iter_mut().zip(key) {
            *m = m.max(x);
        }
    }
    let mut shift = [0f32; W];
    for i in 0..W {
        let (old, new) = (row_max[c0 + i], max[i]);
        // exp(-inf) = 0 on a column's first visible tile; 1 while nothing is visible yet.
        let visible = new != f32::NEG_INFINITY;
        correction[c0 + i] = if visible { exp_poly(old - new) } else { 1.0 };
        shift[i] = if visible { new } else { 0.0 };
        row_max[c0 + i] = new;
    }
    let mut sum = [0f32; W];
    for key in s_t.chunks_exact_mut(rows) {
        let key: &mut [f32; W] = (&mut key[c0..c0 + W]).try_into().unwrap();
        for ((x, s), l) in key.iter_mut().zip(&shift).zip(sum.iter_mut()) {
            *x = exp_poly(*x - *s);
            *l += *x;
        }
    }
    for i in 0..W {
        row_sum[c0 + i] = row_sum[c0 + i] * correction[c0 + i] + sum[i];
    }
}

super::simd::multiversion! {
    /// Rescales each accumulator row by its softmax correction (rows of `d`; skipped where 1).
    fn rescale_rows(acc: &mut [f32], d: usize, correction: &[f32]) {
        for (row, &c) in acc.chunks_exact_mut(d).zip(correction) {
            if c != 1.0 {
                row.iter_mut().for_each(|x| *x *= c);
            }
        }
    }
}

super::simd::multiversion! {
    /// bf16 pairs for [`tile_matmul_bf16_pairs`] from two rows of the reduction axis side by
    /// side: `dst[i] = (even[i], odd[i])`, a zero half without `odd` (an odd length's end).
    fn pack_pairs(even: &[f32], odd: Option<&[f32]>, dst: &mut [u32]) {
        match odd {
            Some(odd) => dst.iter_mut().zip(even.iter().zip(odd)).for_each(|(o, (&lo, &hi))| *o = bf16_pair(lo, hi)),
            None => dst.iter_mut().zip(even).for_each(|(o, &lo)| *o = bf16_pair(lo, 0.0)),
        }
    }
}

super::simd::multiversion! {
    /// bf16 pairs along each row of `row` values (the reduction axis), a zero half after an odd
    /// length: rows of `row.div_ceil(2)` pairs.
    fn pack_row_pairs(src: &[f32], row: usize, dst: &mut [u32]) {
        let row2 = row.div_ceil(2);
        for (src, dst) in src.chunks_exact(row).zip(dst.chunks_exact_mut(row2)) {
            let mut pairs = src.chunks_exact(2);
            for (o, pair) in dst.iter_mut().zip(&mut pairs) {
                *o = bf16_pair(pair[0], pair[1]);
            }
            if let [last] = pairs.remainder() {
                dst[row2 - 1] = bf16_pair(*last, 0.0);
            }
        }
    }
}
