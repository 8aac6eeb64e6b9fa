//! CPU backward (FlashAttention-2's algorithm): one rayon task per (sequence, query head).
//! Each task walks K/V tiles, recomputes P from Q, K and the forward's LSE tile by tile, and
//! accumulates dK/dV of the tile on-chip (in scratch) and dQ in its own rows of the output.
//! Per-query-head dK/dV are then summed over each KV head's group (GQA) in a fixed order, so
//! the result is deterministic.

use super::{dense_f32, exp_shifted_sum, logits_row, tile_matmul, MatRef, SharedMut, K_TILE, Q_TILE};
use crate::op::BwdInputs;
use crate::params::{AttnShape, FlashAttnOptions, HostData};
use candle_core::{CpuStorage, Layout, Result};
use rayon::prelude::*;

struct Scratch {
    probs: Vec<f32>,
    dprobs: Vec<f32>,
    /// 1 - tanh² of the softcapped logits (only with softcap).
    dtanh: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    delta: Vec<f32>,
}

impl Scratch {
    fn new(d: usize, max_q: usize) -> Self {
        Self {
            probs: vec![0.0; Q_TILE * K_TILE],
            dprobs: vec![0.0; Q_TILE * K_TILE],
            dtanh: vec![0.0; Q_TILE * K_TILE],
            dk: vec![0.0; K_TILE * d],
            dv: vec![0.0; K_TILE * d],
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
    let BwdInputs { q, k, v, out, grad_out: dout, lse } = x.try_map(|_, (s, l)| dense_f32(s, l))?;
    let (h, hkv, d) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);

    let mut dq = vec![0f32; shape.total_q * h * d];
    // dK/dV per *query* head, summed over each group below.
    let mut dk_heads = vec![0f32; shape.total_k * h * d];
    let mut dv_heads = vec![0f32; shape.total_k * h * d];
    let tasks: Vec<(usize, usize)> = (0..host.seqs.len()).flat_map(|b| (0..h).map(move |head| (b, head))).collect();
    let ptrs = (SharedMut(dq.as_mut_ptr()), SharedMut(dk_heads.as_mut_ptr()), SharedMut(dv_heads.as_mut_ptr()));
    let max_q = host.seqs.iter().map(|s| s.q_len).max().unwrap_or(0);
    let inputs = (&q[..], &k[..], &v[..], &out[..], &dout[..], &lse[..]);
    tasks.par_iter().for_each_init(
        || Scratch::new(d, max_q),
        |scratch, &(b, head)| {
            // SAFETY: task (b, head) writes only the (row, head) slots of sequence b and
            // head `head` in dq, dk_heads and dv_heads; no two tasks share one.
            unsafe { backward_head(shape, host, opts, inputs, ptrs, (b, head), scratch) }
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
/// The pointers must address `total_q*H*D` (dq) and `total_k*H*D` (dk, dv) elements, and no
/// other thread may write the slots of (b, head).
unsafe fn backward_head(
    shape: &AttnShape,
    host: &HostData,
    opts: &FlashAttnOptions,
    (q, k, v, out, dout, lse): Inputs,
    (dq, dk, dv): (SharedMut, SharedMut, SharedMut),
    (b, head): (usize, usize),
    scratch: &mut Scratch,
) {
    let (h, hkv, d) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
    let seq = &host.seqs[b];
    let kv_head = head / shape.group_size();
    let (q_rs, kv_rs) = (h * d, hkv * d);
    let q_off = |i: usize| (seq.q_start + i) * q_rs + head * d;
    let kv_off = |j: usize| (seq.k_start + j) * kv_rs + kv_head * d;
    let dkv_off = |j: usize| (seq.k_start + j) * q_rs + head * d;
    let alibi = host.alibi_slope(b, head);
    let scale = opts.softmax_scale;
    let Scratch { probs, dprobs, dtanh, dk: dk_acc, dv: dv_acc, delta } = scratch;

    // D_i = rowsum(dO ∘ O).
    for (i, di) in delta[..seq.q_len].iter_mut().enumerate() {
        let (o, g) = (&out[q_off(i)..q_off(i) + d], &dout[q_off(i)..q_off(i) + d]);
        *di = o.iter().zip(g).map(|(a, b)| a * b).sum();
    }

    for j0 in (0..seq.k_len).step_by(K_TILE) {
        let cols = K_TILE.min(seq.k_len - j0);
        // The rows that see some key of this tile form one interval (query ranges move
        // monotonically with the key); Q tiles outside it are skipped entirely.
        let ranges = (j0..j0 + cols).map(|j| shape.query_range(opts, seq, j)).filter(|r| r.1 > r.0);
        let (i_lo, i_hi) = ranges.fold((usize::MAX, 0), |(lo, hi), r| (lo.min(r.0), hi.max(r.1)));
        if i_hi <= i_lo {
            continue;
        }
        dk_acc[..cols * d].fill(0.0);
        dv_acc[..cols * d].fill(0.0);
        let k_tile = k.as_ptr().add(kv_off(j0));
        let v_tile = v.as_ptr().add(kv_off(j0));

        for i0 in (i_lo..i_hi).step_by(Q_TILE) {
            let rows = Q_TILE.min(i_hi - i0);
            let q_tile = q.as_ptr().add(q_off(i0));
            let do_tile = dout.as_ptr().add(q_off(i0));
            // P = exp(logits - lse), recomputed from Q and K.
            tile_matmul(
                (rows, cols, d),
                probs.as_mut_ptr(),
                K_TILE,
                false,
                MatRef::rows(q_tile, q_rs),
                MatRef::transposed(k_tile, kv_rs),
                1.0,
            );
            for r in 0..rows {
                let i = i0 + r;
                let row = &mut probs[r * K_TILE..r * K_TILE + cols];
                if let Some(c) = opts.softcap {
                    let dt = &mut dtanh[r * K_TILE..r * K_TILE + cols];
                    for (t, x) in dt.iter_mut().zip(row.iter()) {
                        let th = (x * scale / c).tanh();
                        *t = 1.0 - th * th;
                    }
                }
                let pos = i as isize + seq.diag_offset();
                logits_row(row, j0, shape.key_range(opts, seq, i), scale, opts.softcap, alibi.map(|s| (s, pos)));
                let row_lse = lse[shape.lse_index(seq, head, i)];
                if row_lse == f32::NEG_INFINITY {
                    row.fill(0.0); // the row saw no key: no gradient flows through it
                } else {
                    exp_shifted_sum(row, row_lse);
                }
            }
            // dV += Pᵀ dO.
            tile_matmul(
                (cols, d, rows),
                dv_acc.as_mut_ptr(),
                d,
                true,
                MatRef::transposed(probs.as_ptr(), K_TILE),
                MatRef::rows(do_tile, q_rs),
                1.0,
            );
            // dP = dO Vᵀ.
            tile_matmul(
                (rows, cols, d),
                dprobs.as_mut_ptr(),
                K_TILE,
                false,
                MatRef::rows(do_tile, q_rs),
                MatRef::transposed(v_tile, kv_rs),
                1.0,
            );
            // dS = P ∘ (dP − D) (∘ tanh' under softcap), stored over dP.
            for r in 0..rows {
                let di = delta[i0 + r];
                let (p, ds) = (&probs[r * K_TILE..r * K_TILE + cols], &mut dprobs[r * K_TILE..r * K_TILE + cols]);
                ds.iter_mut().zip(p).for_each(|(g, p)| *g = p * (*g - di));
                if opts.softcap.is_some() {
                    ds.iter_mut().zip(&dtanh[r * K_TILE..r * K_TILE + cols]).for_each(|(g, t)| *g *= t);
                }
            }
            // dQ += scale · dS K ; dK += scale · dSᵀ Q.
            tile_matmul(
                (rows, d, cols),
                dq.0.add(q_off(i0)),
                q_rs,
                true,
                MatRef::rows(dprobs.as_ptr(), K_TILE),
                MatRef::rows(k_tile, kv_rs),
                scale,
            );
            tile_matmul(
                (cols, d, rows),
                dk_acc.as_mut_ptr(),
                d,
                true,
                MatRef::transposed(dprobs.as_ptr(), K_TILE),
                MatRef::rows(q_tile, q_rs),
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
