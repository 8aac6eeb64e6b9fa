//! CPU backward (FlashAttention-2's algorithm): one rayon task per (sequence, query head).
//! Each task walks K/V tiles, recomputes P from Q, K and the forward's LSE tile by tile, and
//! accumulates dK/dV of the tile on-chip (in scratch) and dQ in its own rows of the output.
//! Per-query-head dK/dV are then summed over each KV head's group (GQA) in a fixed order, so
//! the result is deterministic.

use super::simd::{multiversion, tile_matmul, CpuIsa, MatRef};
use super::{dense_f32, exp_shifted_sum, logits_row, CpuTiles, SharedMut};
use crate::op::BwdInputs;
use crate::params::{AttnShape, FlashAttnOptions, HostData};
use candle_core::{CpuStorage, Layout, Result};
use rayon::prelude::*;

/// Per-worker scratch: the head's K, Q and dO as contiguous rows, gathered once per task (B
/// operands whose rows lie H·D floats apart in place share a few L1 sets; gathering per tile
/// instead cost 13% of the backward in `memmove` calls, measured), the K tile's Kᵀ and Vᵀ (packed once per K tile, the B operands of
/// S = Q Kᵀ and dP = dO Vᵀ), P and dP/dS (query rows × keys), tanh′ under softcap, the tile's
/// dK/dV accumulators and D = rowsum(dO ∘ O) of the head.
struct Scratch {
    k_head: Vec<f32>,
    q_head: Vec<f32>,
    do_head: Vec<f32>,
    k_t: Vec<f32>,
    v_t: Vec<f32>,
    probs: Vec<f32>,
    dprobs: Vec<f32>,
    /// 1 - tanh² of the softcapped logits (only with softcap).
    dtanh: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    delta: Vec<f32>,
}

impl Scratch {
    fn new(d: usize, tiles: CpuTiles, (max_q, max_k): (usize, usize)) -> Self {
        let (q, k) = (tiles.q_rows, tiles.k_cols);
        Self {
            k_head: vec![0.0; max_k * d],
            q_head: vec![0.0; max_q * d],
            do_head: vec![0.0; max_q * d],
            k_t: vec![0.0; d * k],
            v_t: vec![0.0; d * k],
            probs: vec![0.0; q * k],
            dprobs: vec![0.0; q * k],
            dtanh: vec![0.0; q * k],
            dk: vec![0.0; k * d],
            dv: vec![0.0; k * d],
            delta: vec![0.0; max_q],
        }
    }
}

/// Backward on the CPU: returns dq (q's layout), dk and dv (k's layout), contiguous, in the
/// inputs' dtype.
pub(crate) fn backward(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    x: BwdInputs<(&CpuStorage, &Layout)>,
) -> Result<(CpuStorage, CpuStorage, CpuStorage)> {
    let host = shape.host()?;
    let (isa, tiles) = (CpuIsa::active(), CpuTiles::get());
    let BwdInputs { q, k, v, out, grad_out: dout, lse } = x.try_map(|_, (s, l)| dense_f32(s, l))?;
    let (h, hkv, d) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);

    let mut dq = vec![0f32; shape.total_q * h * d];
    // dK/dV per *query* head, summed over each group below.
    let mut dk_heads = vec![0f32; shape.total_k * h * d];
    let mut dv_heads = vec![0f32; shape.total_k * h * d];
    let tasks: Vec<(usize, usize)> = (0..host.seqs.len()).flat_map(|b| (0..h).map(move |head| (b, head))).collect();
    let ptrs = (SharedMut(dq.as_mut_ptr()), SharedMut(dk_heads.as_mut_ptr()), SharedMut(dv_heads.as_mut_ptr()));
    let max_q = host.seqs.iter().map(|s| s.q_len).max().unwrap_or(0);
    let max_k = host.seqs.iter().map(|s| s.k_len).max().unwrap_or(0);
    let inputs = (&q[..], &k[..], &v[..], &out[..], &dout[..], &lse[..]);
    tasks.par_iter().for_each_init(
        || Scratch::new(d, tiles, (max_q, max_k)),
        |scratch, &(b, head)| {
            // SAFETY: task (b, head) writes only the (row, head) slots of sequence b and
            // head `head` in dq, dk_heads and dv_heads; no two tasks share one.
            unsafe { backward_head(shape, host, opts, inputs, ptrs, (isa, tiles), (b, head), scratch) }
        },
    );

    let group = shape.group_size();
    let sum_groups = |per_head: Vec<f32>| -> Vec<f32> {
        if group == 1 {
            return per_head;
        }
        let mut summed = vec![0f32; shape.total_k * hkv * d];
        summed.par_chunks_mut(hkv * d).zip(per_head.par_chunks(h * d)).for_each(|(dst, src)| {
            for kvh in 0..hkv {
                let dst = &mut dst[kvh * d..(kvh + 1) * d];
                for g in 0..group {
                    let src = &src[(kvh * group + g) * d..(kvh * group + g + 1) * d];
                    dst.iter_mut().zip(src).for_each(|(a, b)| *a += b);
                }
            }
        });
        summed
    };
    let dk = sum_groups(dk_heads);
    let dv = sum_groups(dv_heads);
    Ok((
        super::storage_from_f32(dq, shape.dtype)?,
        super::storage_from_f32(dk, shape.dtype)?,
        super::storage_from_f32(dv, shape.dtype)?,
    ))
}

type Inputs<'a> = (&'a [f32], &'a [f32], &'a [f32], &'a [f32], &'a [f32], &'a [f32]);

/// # Safety
/// The pointers must address `total_q*H*D` (dq) and `total_k*H*D` (dk, dv) elements, no
/// other thread may write the slots of (b, head), and `isa` must not exceed the CPU's.
#[allow(clippy::too_many_arguments)]
unsafe fn backward_head(
    shape: &AttnShape,
    host: &HostData,
    opts: &FlashAttnOptions,
    (q, k, v, out, dout, lse): Inputs,
    (dq, dk, dv): (SharedMut, SharedMut, SharedMut),
    (isa, tiles): (CpuIsa, CpuTiles),
    (b, head): (usize, usize),
    scratch: &mut Scratch,
) {
    let (h, hkv, d) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
    let (q_tile, k_tile) = (tiles.q_rows, tiles.k_cols);
    let seq = &host.seqs[b];
    let kv_head = head / shape.group_size();
    let (q_rs, kv_rs) = (h * d, hkv * d);
    let q_off = |i: usize| (seq.q_start + i) * q_rs + head * d;
    let kv_off = |j: usize| (seq.k_start + j) * kv_rs + kv_head * d;
    let dkv_off = |j: usize| (seq.k_start + j) * q_rs + head * d;
    let alibi = host.alibi_slope(b, head);
    let scale = opts.softmax_scale;
    let Scratch { k_head, q_head, do_head, k_t, v_t, probs, dprobs, dtanh, dk: dk_acc, dv: dv_acc, delta } = scratch;

    for (i, (q_row, do_row)) in q_head.chunks_exact_mut(d).zip(do_head.chunks_exact_mut(d)).take(seq.q_len).enumerate()
    {
        q_row.copy_from_slice(&q[q_off(i)..q_off(i) + d]);
        do_row.copy_from_slice(&dout[q_off(i)..q_off(i) + d]);
    }
    for (j, k_row) in k_head.chunks_exact_mut(d).take(seq.k_len).enumerate() {
        k_row.copy_from_slice(&k[kv_off(j)..kv_off(j) + d]);
    }
    // D_i = rowsum(dO ∘ O).
    for (i, di) in delta[..seq.q_len].iter_mut().enumerate() {
        *di = dot(isa, &out[q_off(i)..q_off(i) + d], &dout[q_off(i)..q_off(i) + d]);
    }

    for j0 in (0..seq.k_len).step_by(k_tile) {
        let cols = k_tile.min(seq.k_len - j0);
        // The rows that see some key of this tile form one interval (query ranges move
        // monotonically with the key); Q tiles outside it are skipped entirely.
        let ranges = (j0..j0 + cols).map(|j| shape.query_range(opts, seq, j)).filter(|r| r.1 > r.0);
        let (i_lo, i_hi) = ranges.fold((usize::MAX, 0), |(lo, hi), r| (lo.min(r.0), hi.max(r.1)));
        if i_hi <= i_lo {
            continue;
        }
        dk_acc[..cols * d].fill(0.0);
        dv_acc[..cols * d].fill(0.0);
        // Kᵀ and Vᵀ (d × cols), read by every Q tile below.
        for j in 0..cols {
            let (kr, vr) = (&k[kv_off(j0 + j)..kv_off(j0 + j) + d], &v[kv_off(j0 + j)..kv_off(j0 + j) + d]);
            for c in 0..d {
                k_t[c * cols + j] = kr[c];
                v_t[c * cols + j] = vr[c];
            }
        }

        for i0 in (i_lo..i_hi).step_by(q_tile) {
            let rows = q_tile.min(i_hi - i0);
            let (q_tile_rows, do_tile_rows) = (q_head[i0 * d..].as_ptr(), do_head[i0 * d..].as_ptr());
            // P = exp(scale · Q Kᵀ - lse), recomputed.
            tile_matmul(
                isa,
                (rows, cols, d),
                probs.as_mut_ptr(),
                k_tile,
                false,
                MatRef::rows(q_tile_rows, d),
                (k_t.as_ptr(), cols),
                scale,
            );
            for r in 0..rows {
                let i = i0 + r;
                let row = &mut probs[r * k_tile..r * k_tile + cols];
                if let Some(c) = opts.softcap {
                    let dt = &mut dtanh[r * k_tile..r * k_tile + cols];
                    for (t, x) in dt.iter_mut().zip(row.iter()) {
                        let th = (x / c).tanh();
                        *t = 1.0 - th * th;
                    }
                }
                let pos = i as isize + seq.diag_offset();
                logits_row(row, j0, shape.key_range(opts, seq, i), 1.0, opts.softcap, alibi.map(|s| (s, pos)));
                let row_lse = lse[shape.lse_index(seq, head, i)];
                if row_lse == f32::NEG_INFINITY {
                    row.fill(0.0); // the row saw no key: no gradient flows through it
                } else {
                    exp_shifted_sum(isa, row, row_lse);
                }
            }
            // dV += Pᵀ dO.
            tile_matmul(
                isa,
                (cols, d, rows),
                dv_acc.as_mut_ptr(),
                d,
                true,
                MatRef::transposed(probs.as_ptr(), k_tile),
                (do_tile_rows, d),
                1.0,
            );
            // dP = dO Vᵀ.
            tile_matmul(
                isa,
                (rows, cols, d),
                dprobs.as_mut_ptr(),
                k_tile,
                false,
                MatRef::rows(do_tile_rows, d),
                (v_t.as_ptr(), cols),
                1.0,
            );
            // dS = P ∘ (dP − D) (∘ tanh' under softcap), stored over dP.
            for r in 0..rows {
                let span = r * k_tile..r * k_tile + cols;
                let tanh_grad = opts.softcap.map(|_| &dtanh[span.clone()]);
                probs_to_score_grads(isa, &probs[span.clone()], &mut dprobs[span], delta[i0 + r], tanh_grad);
            }
            // dQ += scale · dS K ; dK += scale · dSᵀ Q.
            tile_matmul(
                isa,
                (rows, d, cols),
                dq.0.add(q_off(i0)),
                q_rs,
                true,
                MatRef::rows(dprobs.as_ptr(), k_tile),
                (k_head[j0 * d..].as_ptr(), d),
                scale,
            );
            tile_matmul(
                isa,
                (cols, d, rows),
                dk_acc.as_mut_ptr(),
                d,
                true,
                MatRef::transposed(dprobs.as_ptr(), k_tile),
                (q_tile_rows, d),
                scale,
            );
        }
        for c in 0..cols {
            let (dk_dst, dv_dst) = (dk.0.add(dkv_off(j0 + c)), dv.0.add(dkv_off(j0 + c)));
            std::slice::from_raw_parts_mut(dk_dst, d).copy_from_slice(&dk_acc[c * d..(c + 1) * d]);
            std::slice::from_raw_parts_mut(dv_dst, d).copy_from_slice(&dv_acc[c * d..(c + 1) * d]);
        }
    }
}

multiversion! {
    /// Σ a·b with 8 partial sums (vectorisable).
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        let mut partial = [0f32; 8];
        let (mut ca, mut cb) = (a.chunks_exact(8), b.chunks_exact(8));
        for (x, y) in (&mut ca).zip(&mut cb) {
            for i in 0..8 {
                partial[i] += x[i] * y[i];
            }
        }
        ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum::<f32>() + partial.iter().sum::<f32>()
    }
}

multiversion! {
    /// dS = P ∘ (dP − D), times tanh′ under softcap, written over dP.
    fn probs_to_score_grads(p: &[f32], dp: &mut [f32], delta: f32, tanh_grad: Option<&[f32]>) {
        dp.iter_mut().zip(p).for_each(|(g, p)| *g = p * (*g - delta));
        if let Some(t) = tanh_grad {
            dp.iter_mut().zip(t).for_each(|(g, t)| *g *= t);
        }
    }
}
