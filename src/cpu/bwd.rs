//! CPU backward (FlashAttention-2's algorithm): one rayon task per (sequence, query head).
//! Each task walks K/V tiles, recomputes P from Q, K and the forward's LSE tile by tile, and
//! accumulates dK/dV of the tile on-chip (in scratch) and dQ in its own rows of the output.
//! Per-query-head dK/dV are then summed over each KV head's group (GQA) in a fixed order, so
//! the result is deterministic.

use super::fwd::{pack_pairs, pack_row_pairs};
use super::kv::KvRows;
use super::simd::{multiversion, tile_matmul, tile_matmul_bf16_pairs, CpuIsa, MatRef};
use super::{dense_f32, exp_shifted_sum, logits_row, transpose_rows, AlignedVec, CpuTiles, SharedMut};
use crate::block_mask::{listed_key_tiles, BlockClass, HostBlocks, BLOCK_SIZE};
use crate::inputs::BwdInputs;
use crate::params::{AttnShape, FlashAttnOptions, HostData};
use candle_core::{CpuStorage, DType, Layout, Result};

/// Per-worker scratch: the head's K, Q and dO as contiguous rows, gathered once per task (B
/// operands whose rows lie H·D floats apart in place share a few L1 sets; gathering per tile
/// instead cost 13% of the backward in `memmove` calls, measured), the K tile's Kᵀ and Vᵀ (packed once per K tile, the B operands of
/// S = Q Kᵀ and dP = dO Vᵀ), P and dP/dS (query rows × keys), tanh′ under softcap, the tile's
/// dK/dV accumulators and D = rowsum(dO ∘ O) of the head.
struct Scratch {
    k_head: AlignedVec<f32>,
    q_head: AlignedVec<f32>,
    do_head: AlignedVec<f32>,
    /// O's rows of the head (for D) and the K tile's V rows.
    o_head: AlignedVec<f32>,
    v_tile: AlignedVec<f32>,
    k_t: AlignedVec<f32>,
    v_t: AlignedVec<f32>,
    probs: AlignedVec<f32>,
    dprobs: AlignedVec<f32>,
    /// 1 - tanh² of the softcapped logits (only with softcap).
    dtanh: Vec<f32>,
    dk: AlignedVec<f32>,
    dv: AlignedVec<f32>,
    delta: Vec<f32>,
    /// AMX only: the head's dQ, unscaled, in aligned rows (q_len × d): its tiles are loaded and
    /// stored in place, and the softmax scale is applied once when it is written out.
    dq_head: AlignedVec<f32>,
    /// AMX with plain logits: each query row's visible keys within the tile and its lse, for
    /// the fused P and dS passes.
    row_vis: Vec<(usize, usize)>,
    row_lse: Vec<f32>,
    /// The bf16-pair operands (AVX-512 BF16 on bf16 inputs, else empty), pairs along the
    /// reduction axis of the product that reads them: [`Pairs`].
    pairs: Pairs,
}

/// bf16 pairs (`bf16_pair`) for the five backward products on `vdpbf16ps`. Per task: Q and
/// dO paired along d (the A operands of S and dP) and along query rows (the B operands of dK
/// and dV). Per K tile: Kᵀ and Vᵀ paired along d (B of S and dP), K paired along keys (B of
/// dQ). Per Q tile: P and dS paired along query rows (A of dV and dK, read transposed), dS
/// paired along keys (A of dQ). Query tiles start at even rows, so a tile's row pairs are a
/// slice of the task's; an odd end pairs with zero. `tile_d`: the K or V tile's rows paired
/// along d, before their transpose.
#[derive(Default)]
struct Pairs {
    q_d: AlignedVec<u32>,
    do_d: AlignedVec<u32>,
    q_rows: AlignedVec<u32>,
    do_rows: AlignedVec<u32>,
    tile_d: AlignedVec<u32>,
    kt_d: AlignedVec<u32>,
    vt_d: AlignedVec<u32>,
    k_keys: AlignedVec<u32>,
    p_rows: AlignedVec<u32>,
    ds_rows: AlignedVec<u32>,
    ds_keys: AlignedVec<u32>,
    /// AMX only: Qᵀ and dOᵀ paired along query rows (d × max_q/2), the A operands of
    /// dKᵀ += Qᵀ dS and dVᵀ += dOᵀ P, whose B operands (dS and P paired along rows) are the
    /// pair layout as built: the K-tile accumulators are then kept transposed (d × keys) and
    /// no P or dS tile is transposed.
    qt_rows: AlignedVec<u32>,
    dot_rows: AlignedVec<u32>,
}

impl Pairs {
    fn new(d: usize, (q, k): (usize, usize), max_q: usize, amx: bool) -> Self {
        let (d2, q2, k2, max_q2) = (d.div_ceil(2), q.div_ceil(2), k.div_ceil(2), max_q.div_ceil(2));
        Self {
            q_d: AlignedVec::new(max_q * d2),
            do_d: AlignedVec::new(max_q * d2),
            q_rows: AlignedVec::new(max_q2 * d),
            do_rows: AlignedVec::new(max_q2 * d),
            tile_d: AlignedVec::new(k * d2),
            kt_d: AlignedVec::new(d2 * k),
            vt_d: AlignedVec::new(d2 * k),
            k_keys: AlignedVec::new(k2 * d),
            p_rows: AlignedVec::new(q2 * k),
            ds_rows: AlignedVec::new(q2 * k),
            ds_keys: AlignedVec::new(q * k2),
            qt_rows: AlignedVec::new(if amx { d * max_q2 } else { 0 }),
            dot_rows: AlignedVec::new(if amx { d * max_q2 } else { 0 }),
        }
    }
}

impl Scratch {
    fn new(d: usize, (q, k): (usize, usize), (max_q, max_k): (usize, usize), (bf16_pairs, amx): (bool, bool)) -> Self {
        Self {
            k_head: AlignedVec::new(max_k * d),
            q_head: AlignedVec::new(max_q * d),
            do_head: AlignedVec::new(max_q * d),
            o_head: AlignedVec::new(max_q * d),
            v_tile: AlignedVec::new(k * d),
            k_t: AlignedVec::new(d * k),
            v_t: AlignedVec::new(d * k),
            probs: AlignedVec::new(q * k),
            dprobs: AlignedVec::new(q * k),
            dtanh: vec![0.0; q * k],
            dk: AlignedVec::new(k * d),
            dv: AlignedVec::new(k * d),
            delta: vec![0.0; max_q],
            dq_head: AlignedVec::new(if amx { max_q * d } else { 0 }),
            row_vis: vec![(0, 0); q],
            row_lse: vec![0.0; q],
            pairs: if bf16_pairs { Pairs::new(d, (q, k), max_q, amx) } else { Pairs::default() },
        }
    }
}

/// What a backward [`Scratch`] was made for.
#[derive(Clone, Copy, PartialEq, Eq)]
struct ScratchKey {
    d: usize,
    tiles: (usize, usize),
    max: (usize, usize),
    pairs: (bool, bool),
}

thread_local! {
    static SCRATCH: super::ScratchSlot<ScratchKey, Scratch> = const { std::cell::RefCell::new(None) };
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
    // bf16 inputs on AVX-512 BF16: the five products on bf16 pairs with f32 accumulation, P and
    // dS rounded to bf16 as the GPU kernels do (the forward's rule, `CpuIsa::active`).
    let bf16_pairs = isa.bf16_pairs() && shape.dtype == DType::BF16;
    let amx = bf16_pairs && isa == CpuIsa::Amx;
    // Rows are read (and widened) per task from the tensors as they are: no whole f32 copies
    // of bf16/f16 inputs (at N = 256 those copies and their page faults were a fifth of the
    // backward).
    let BwdInputs { q, k, v, out, grad_out: dout, lse } = x;
    let queries = |x| KvRows::queries(isa, shape, host, x);
    let (q, out, dout) = (queries(q)?, queries(out)?, queries(dout)?);
    let (k, v) = (KvRows::new(isa, shape, host, k.0, k.1)?, KvRows::new(isa, shape, host, v.0, v.1)?);
    let lse = dense_f32(lse.0, lse.1)?;
    let (h, hkv, d) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);

    let mut dq = super::filled(shape.total_q * h * d, 0f32);
    // dK/dV per *query* head, summed over each group below.
    let mut dk_heads = super::filled(shape.total_k * h * d, 0f32);
    let mut dv_heads = super::filled(shape.total_k * h * d, 0f32);
    let tasks: Vec<(usize, usize)> = (0..host.seqs.len()).flat_map(|b| (0..h).map(move |head| (b, head))).collect();
    let ptrs = (SharedMut(dq.as_mut_ptr()), SharedMut(dk_heads.as_mut_ptr()), SharedMut(dv_heads.as_mut_ptr()));
    let max_q = host.seqs.iter().map(|s| s.q_len).max().unwrap_or(0);
    let max_k = host.seqs.iter().map(|s| s.k_len).max().unwrap_or(0);
    let q_tile = query_tile(tiles, amx, max_q);
    let inputs = (&q, &k, &v, &out, &dout, &lse[..]);
    let key = ScratchKey { d, tiles: (q_tile, tiles.k_cols), max: (max_q, max_k), pairs: (bf16_pairs, amx) };
    // The scratch holds the head's Q, dO, O and K rows: kept between calls up to 16 MiB.
    let keep = 4 * d * (4 * max_q + max_k) <= 16 << 20;
    super::for_each_task(tasks.len(), |i| {
        let (b, head) = tasks[i];
        let task = (isa, bf16_pairs, amx, (q_tile, tiles.k_cols));
        let make = || Scratch::new(d, key.tiles, key.max, key.pairs);
        super::with_cached(&SCRATCH, key, keep, make, |scratch| {
            // SAFETY: task (b, head) writes only the (row, head) slots of sequence b and
            // head `head` in dq, dk_heads and dv_heads; no two tasks share one.
            unsafe { backward_head(shape, host, opts, inputs, ptrs, task, (b, head), scratch) }
        })
    });

    let group = shape.group_size();
    let sum_groups = |per_head: Vec<f32>| -> Vec<f32> {
        if group == 1 {
            return per_head;
        }
        let mut summed = vec![0f32; shape.total_k * hkv * d];
        // A few tasks per thread, each a run of whole key rows.
        let rows = shape.total_k.div_ceil(4 * rayon::current_num_threads()).max(1);
        super::for_each_chunk_mut(&mut summed, rows * hkv * d, |c, dst| {
            for (r, dst) in dst.chunks_exact_mut(hkv * d).enumerate() {
                let row = c * rows + r;
                let src = &per_head[row * h * d..(row + 1) * h * d];
                for kvh in 0..hkv {
                    let dst = &mut dst[kvh * d..(kvh + 1) * d];
                    for g in 0..group {
                        let src = &src[(kvh * group + g) * d..(kvh * group + g + 1) * d];
                        dst.iter_mut().zip(src).for_each(|(a, b)| *a += b);
                    }
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

/// The sinks' gradient on the CPU, f32 `[H]`: `dsinks[h] = -Σ_{b, i} e^{s_h - lse_i} · D_i` with
/// `D_i = rowsum(dO ∘ O)` (a sink carries no value, so its logit's gradient is `-P_sink · D`).
pub(crate) fn sink_grads(
    shape: &AttnShape,
    (out, out_l): (&CpuStorage, &Layout),
    (dout, dout_l): (&CpuStorage, &Layout),
    (lse, lse_l): (&CpuStorage, &Layout),
) -> Result<Vec<f32>> {
    let host = shape.host()?;
    let (out, dout, lse) = (dense_f32(out, out_l)?, dense_f32(dout, dout_l)?, dense_f32(lse, lse_l)?);
    let (h, d) = (shape.num_heads, shape.head_dim);
    Ok((0..h)
        .map(|head| {
            let Some(sink) = host.sink(head) else { return 0.0 };
            let mut total = 0f64;
            for seq in &host.seqs {
                for i in 0..seq.q_len {
                    let at = ((seq.q_start + i) * h + head) * d;
                    let dot: f32 = out[at..at + d].iter().zip(&dout[at..at + d]).map(|(o, g)| o * g).sum();
                    total += ((sink - lse[shape.lse_index(seq, head, i)]).exp() * dot) as f64;
                }
            }
            -total as f32
        })
        .collect())
}

/// Query rows per backward tile: the configured tile kept even, so that tiles start at even
/// rows (row pairs are slices of the task's).
fn query_tile(tiles: CpuTiles, amx: bool, max_q: usize) -> usize {
    tiles.q_rows_for(amx, max_q).next_multiple_of(2)
}

type Inputs<'a> = (&'a KvRows<'a>, &'a KvRows<'a>, &'a KvRows<'a>, &'a KvRows<'a>, &'a KvRows<'a>, &'a [f32]);

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
    (isa, bf16_pairs, amx, (q_tile, k_tile)): (CpuIsa, bool, bool, (usize, usize)),
    (b, head): (usize, usize),
    scratch: &mut Scratch,
) {
    let (h, d) = (shape.num_heads, shape.head_dim);
    let d2 = d.div_ceil(2);
    let seq = &host.seqs[b];
    let kv_head = head / shape.group_size();
    let q_rs = h * d;
    let q_off = |i: usize| (seq.q_start + i) * q_rs + head * d;
    let dkv_off = |j: usize| (seq.k_start + j) * q_rs + head * d;
    let alibi = host.alibi_slope(b, head);
    let blocks = host.block_mask.as_deref();
    let scale = opts.softmax_scale;
    let Scratch {
        k_head,
        q_head,
        do_head,
        o_head,
        v_tile,
        k_t,
        v_t,
        probs,
        dprobs,
        dtanh,
        dk: dk_acc,
        dv: dv_acc,
        delta,
        dq_head,
        row_vis,
        row_lse,
        pairs,
    } = scratch;

    q.tile(host, (b, head, d), (0, seq.q_len), q_head);
    dout.tile(host, (b, head, d), (0, seq.q_len), do_head);
    let o_rows = out.tile(host, (b, head, d), (0, seq.q_len), o_head);
    k.tile(host, (b, kv_head, d), (0, seq.k_len), k_head);
    if bf16_pairs {
        // Rows i and i + 1 of a (q_len × d) matrix, the second absent past the end.
        fn rows(x: &[f32], i: usize, (d, len): (usize, usize)) -> (&[f32], Option<&[f32]>) {
            (&x[i * d..(i + 1) * d], (i + 1 < len).then(|| &x[(i + 1) * d..(i + 2) * d]))
        }
        pack_row_pairs(isa, &q_head[..seq.q_len * d], d, &mut pairs.q_d[..seq.q_len * d2]);
        pack_row_pairs(isa, &do_head[..seq.q_len * d], d, &mut pairs.do_d[..seq.q_len * d2]);
        for i2 in 0..seq.q_len.div_ceil(2) {
            let ((q0, q1), (o0, o1)) = (rows(q_head, 2 * i2, (d, seq.q_len)), rows(do_head, 2 * i2, (d, seq.q_len)));
            pack_pairs(isa, q0, q1, &mut pairs.q_rows[i2 * d..(i2 + 1) * d]);
            pack_pairs(isa, o0, o1, &mut pairs.do_rows[i2 * d..(i2 + 1) * d]);
        }
        if amx {
            let q2 = seq.q_len.div_ceil(2);
            let ld = pairs.qt_rows.len() / d;
            transpose_rows(|i2| &pairs.q_rows[i2 * d..(i2 + 1) * d], (q2, d), &mut pairs.qt_rows, ld);
            transpose_rows(|i2| &pairs.do_rows[i2 * d..(i2 + 1) * d], (q2, d), &mut pairs.dot_rows, ld);
        }
    }
    if amx {
        dq_head[..seq.q_len * d].fill(0.0);
    }
    // D_i = rowsum(dO ∘ O).
    for ((di, o), g) in delta[..seq.q_len].iter_mut().zip(o_rows.chunks_exact(d)).zip(do_head.chunks_exact(d)) {
        *di = dot(isa, o, g);
    }

    // With a block mask, only the key blocks some query block lists (the q lists), in tiles that
    // hold no key of another block.
    let key_tiles: Vec<(usize, usize)> = match blocks {
        None => (0..seq.k_len).step_by(k_tile).map(|j0| (j0, k_tile.min(seq.k_len - j0))).collect(),
        Some(blocks) => {
            let listed = |kb: usize| blocks.q_row(b, head, kb).iter().any(|&c| c != BlockClass::Empty);
            listed_key_tiles(seq.k_len.div_ceil(BLOCK_SIZE), listed, (0, seq.k_len), k_tile)
        }
    };
    for (j0, cols) in key_tiles {
        // The rows that see some key of this tile form one interval (query ranges move
        // monotonically with the key); Q tiles outside it are skipped entirely. It starts at
        // an even row (the row before a range's start sees none of these keys: P = 0 there).
        let ranges = (j0..j0 + cols).map(|j| shape.query_range(opts, seq, j)).filter(|r| r.1 > r.0);
        let (i_lo, i_hi) = ranges.fold((usize::MAX, 0), |(lo, hi), r| (lo.min(r.0), hi.max(r.1)));
        // With a block mask, only the query blocks the tile's key blocks list (the q lists).
        let (i_lo, i_hi) = match blocks {
            None => (i_lo, i_hi),
            Some(blocks) => {
                let listed = listed_query_rows(blocks, (b, head), (j0, cols), seq.q_len);
                (i_lo.max(listed.0), i_hi.min(listed.1))
            }
        };
        if i_hi <= i_lo {
            continue;
        }
        let i_lo = i_lo - i_lo % 2;
        // (On AMX the accumulators are transposed, d rows of k_tile: zero them whole.)
        let acc_len = if amx { k_tile * d } else { cols * d };
        dk_acc[..acc_len].fill(0.0);
        dv_acc[..acc_len].fill(0.0);
        let v_rows = v.tile(host, (b, kv_head, d), (j0, cols), v_tile);
        if bf16_pairs {
            // Kᵀ and Vᵀ paired along d (d/2 × cols): each row paired, then transposed.
            let tile_d = &mut pairs.tile_d[..cols * d2];
            for (rows, t) in
                [(&k_head[j0 * d..(j0 + cols) * d], &mut pairs.kt_d), (&v_rows[..cols * d], &mut pairs.vt_d)]
            {
                pack_row_pairs(isa, rows, d, tile_d);
                transpose_rows(|j| &tile_d[j * d2..(j + 1) * d2], (cols, d2), t, cols);
            }
            // K paired along keys (cols/2 × d).
            for j2 in 0..cols.div_ceil(2) {
                let j = j0 + 2 * j2;
                let next = (2 * j2 + 1 < cols).then(|| &k_head[(j + 1) * d..(j + 2) * d]);
                pack_pairs(isa, &k_head[j * d..(j + 1) * d], next, &mut pairs.k_keys[j2 * d..(j2 + 1) * d]);
            }
        } else {
            // Kᵀ and Vᵀ (d × cols), read by every Q tile below.
            transpose_rows(|j| &k_head[(j0 + j) * d..][..d], (cols, d), k_t, cols);
            transpose_rows(|j| &v_rows[j * d..][..d], (cols, d), v_t, cols);
        }

        for i0 in (i_lo..i_hi).step_by(q_tile) {
            let rows = q_tile.min(i_hi - i0);
            if blocks.is_some_and(|blocks| !lists_rows(blocks, (b, head), (j0, cols), (i0, rows))) {
                continue; // none of these rows' query blocks is listed for this key tile
            }
            // The keys of this tile that these rows see, [c_lo, c_hi) (c_lo even: key pairs);
            // a causal diagonal tile stops at its last row's diagonal.
            let (c_lo, c_hi) = (i0..i0 + rows)
                .map(|i| shape.key_range(opts, seq, i))
                .filter(|r| r.1 > r.0 && r.0 < j0 + cols && r.1 > j0)
                .fold((cols, 0), |(lo, hi), r| (lo.min(r.0.max(j0) - j0), hi.max(r.1.min(j0 + cols) - j0)));
            if c_hi <= c_lo {
                continue;
            }
            let c_lo = c_lo - c_lo % 2;
            let n = c_hi - c_lo;
            let (rows2, n2) = (rows.div_ceil(2), n.div_ceil(2));
            let (q_tile_rows, do_tile_rows) = (q_head[i0 * d..].as_ptr(), do_head[i0 * d..].as_ptr());
            // The tile's columns c_lo..c_hi of P, dP and dS (rows k_tile apart).
            let (probs_c, dprobs_c) = (probs.as_mut_ptr().add(c_lo), dprobs.as_mut_ptr().add(c_lo));
            // P = exp(scale · Q Kᵀ - lse), recomputed. (On AMX, Q Kᵀ is stored unscaled, straight
            // from the tiles, and `logits_scale` applies the scale in the row pass.)
            let logits_scale = if amx { scale } else { 1.0 };
            if bf16_pairs {
                let a = MatRef::rows(pairs.q_d[i0 * d2..].as_ptr().cast(), d2);
                let b = (pairs.kt_d[c_lo..].as_ptr().cast(), cols);
                let alpha = if amx { 1.0 } else { scale };
                tile_matmul_bf16_pairs(isa, (rows, n, d2), probs_c, k_tile, false, a, b, alpha);
            } else {
                let b = (k_t[c_lo..].as_ptr(), cols);
                tile_matmul(isa, (rows, n, d), probs_c, k_tile, false, MatRef::rows(q_tile_rows, d), b, scale);
            }
            // AMX with plain logits: P (f32 and its row pairs) in one fused pass.
            let fused = amx && opts.softcap.is_none() && alibi.is_none() && blocks.is_none();
            for r in (0..rows).filter(|_| fused) {
                let (lo, hi) = shape.key_range(opts, seq, i0 + r);
                row_vis[r] = (lo.saturating_sub(j0 + c_lo), hi.saturating_sub(j0 + c_lo));
                row_lse[r] = lse[shape.lse_index(seq, head, i0 + r)];
            }
            if fused {
                #[cfg(target_arch = "x86_64")]
                super::fused::bwd_probs(
                    (probs_c, k_tile),
                    (rows, n),
                    scale,
                    (row_lse, row_vis),
                    pairs.p_rows.as_mut_ptr(),
                );
            }
            for r in (0..rows).filter(|_| !fused) {
                let i = i0 + r;
                let span = r * k_tile + c_lo..r * k_tile + c_hi;
                let row = &mut probs[span.clone()];
                if let Some(c) = opts.softcap {
                    for (t, x) in dtanh[span].iter_mut().zip(row.iter()) {
                        let th = (x * logits_scale / c).tanh();
                        *t = 1.0 - th * th;
                    }
                }
                let pos = i as isize + seq.diag_offset();
                let keys = shape.key_range(opts, seq, i);
                logits_row(row, j0 + c_lo, keys, logits_scale, opts.softcap, alibi.map(|s| (s, pos)));
                if let Some(blocks) = blocks {
                    mask_blocks_row(blocks, row, (b, head, i), j0 + c_lo);
                }
                let row_lse = lse[shape.lse_index(seq, head, i)];
                if row_lse == f32::NEG_INFINITY {
                    row.fill(0.0); // the row saw no key: no gradient flows through it
                } else {
                    exp_shifted_sum(isa, row, row_lse);
                }
            }
            // Row r of P, dP or dS, columns c_lo..c_hi.
            fn part(x: &[f32], r: usize, (ld, lo, hi): (usize, usize, usize)) -> &[f32] {
                &x[r * ld + lo..r * ld + hi]
            }
            let cut = (k_tile, c_lo, c_hi);
            // dV += Pᵀ dO.
            if bf16_pairs {
                for r2 in (0..rows2).filter(|_| !fused) {
                    let odd = (2 * r2 + 1 < rows).then(|| part(probs, 2 * r2 + 1, cut));
                    pack_pairs(isa, part(probs, 2 * r2, cut), odd, &mut pairs.p_rows[r2 * k_tile..][..n]);
                }
                if amx {
                    // dVᵀ (d × keys) += dOᵀ P.
                    let dv_t = dv_acc[c_lo..].as_mut_ptr();
                    add_transposed_product(isa, (&pairs.dot_rows, &pairs.p_rows), (i0, d, n, rows2, k_tile), dv_t);
                } else {
                    let a = MatRef::transposed(pairs.p_rows.as_ptr().cast(), k_tile);
                    let b = (pairs.do_rows[i0 / 2 * d..].as_ptr().cast(), d);
                    tile_matmul_bf16_pairs(isa, (n, d, rows2), dv_acc[c_lo * d..].as_mut_ptr(), d, true, a, b, 1.0);
                }
            } else {
                let a = MatRef::transposed(probs_c, k_tile);
                tile_matmul(isa, (n, d, rows), dv_acc[c_lo * d..].as_mut_ptr(), d, true, a, (do_tile_rows, d), 1.0);
            }
            // dP = dO Vᵀ.
            if bf16_pairs {
                let a = MatRef::rows(pairs.do_d[i0 * d2..].as_ptr().cast(), d2);
                let b = (pairs.vt_d[c_lo..].as_ptr().cast(), cols);
                tile_matmul_bf16_pairs(isa, (rows, n, d2), dprobs_c, k_tile, false, a, b, 1.0);
            } else {
                let b = (v_t[c_lo..].as_ptr(), cols);
                tile_matmul(isa, (rows, n, d), dprobs_c, k_tile, false, MatRef::rows(do_tile_rows, d), b, 1.0);
            }
            // dS = P ∘ (dP − D) (∘ tanh' under softcap), stored over dP (fused on AMX: straight
            // into its two pair layouts).
            if fused {
                #[cfg(target_arch = "x86_64")]
                super::fused::bwd_score_grads(
                    (probs_c, dprobs_c, k_tile),
                    (rows, n),
                    &delta[i0..i0 + rows],
                    (pairs.ds_keys.as_mut_ptr(), pairs.ds_rows.as_mut_ptr()),
                );
            }
            for r in (0..rows).filter(|_| !fused) {
                let span = r * k_tile + c_lo..r * k_tile + c_hi;
                let tanh_grad = opts.softcap.map(|_| &dtanh[span.clone()]);
                probs_to_score_grads(isa, &probs[span.clone()], &mut dprobs[span], delta[i0 + r], tanh_grad);
            }
            // dQ += scale · dS K ; dK += scale · dSᵀ Q.
            let (dq_rows, dk_rows) = (dq.0.add(q_off(i0)), dk_acc[c_lo * d..].as_mut_ptr());
            if bf16_pairs {
                for r in (0..rows).filter(|_| !fused) {
                    pack_row_pairs(isa, part(dprobs, r, cut), n, &mut pairs.ds_keys[r * n2..(r + 1) * n2]);
                }
                for r2 in (0..rows2).filter(|_| !fused) {
                    let odd = (2 * r2 + 1 < rows).then(|| part(dprobs, 2 * r2 + 1, cut));
                    pack_pairs(isa, part(dprobs, 2 * r2, cut), odd, &mut pairs.ds_rows[r2 * k_tile..][..n]);
                }
                let (a, b) = (MatRef::rows(pairs.ds_keys.as_ptr().cast(), n2), pairs.k_keys[c_lo / 2 * d..].as_ptr());
                if amx {
                    // dQ += dS K into the head's aligned rows, unscaled (scaled when written).
                    let dq_tile = dq_head[i0 * d..].as_mut_ptr();
                    tile_matmul_bf16_pairs(isa, (rows, d, n2), dq_tile, d, true, a, (b.cast(), d), 1.0);
                    // dKᵀ (d × keys) += Qᵀ dS, unscaled (scaled when written).
                    let dk_t = dk_acc[c_lo..].as_mut_ptr();
                    add_transposed_product(isa, (&pairs.qt_rows, &pairs.ds_rows), (i0, d, n, rows2, k_tile), dk_t);
                } else {
                    tile_matmul_bf16_pairs(isa, (rows, d, n2), dq_rows, q_rs, true, a, (b.cast(), d), scale);
                    let (a, b) = (
                        MatRef::transposed(pairs.ds_rows.as_ptr().cast(), k_tile),
                        pairs.q_rows[i0 / 2 * d..].as_ptr(),
                    );
                    tile_matmul_bf16_pairs(isa, (n, d, rows2), dk_rows, d, true, a, (b.cast(), d), scale);
                }
            } else {
                let (a, b) = (MatRef::rows(dprobs_c, k_tile), k_head[(j0 + c_lo) * d..].as_ptr());
                tile_matmul(isa, (rows, d, n), dq_rows, q_rs, true, a, (b, d), scale);
                let a = MatRef::transposed(dprobs_c, k_tile);
                tile_matmul(isa, (n, d, rows), dk_rows, d, true, a, (q_tile_rows, d), scale);
            }
        }
        for c in 0..cols {
            let (dk_dst, dv_dst) = (dk.0.add(dkv_off(j0 + c)), dv.0.add(dkv_off(j0 + c)));
            let (dk_dst, dv_dst) =
                (std::slice::from_raw_parts_mut(dk_dst, d), std::slice::from_raw_parts_mut(dv_dst, d));
            if amx {
                // The accumulators are dKᵀ (unscaled) and dVᵀ (d × k_tile).
                dk_dst.iter_mut().enumerate().for_each(|(e, x)| *x = scale * dk_acc[e * k_tile + c]);
                dv_dst.iter_mut().enumerate().for_each(|(e, x)| *x = dv_acc[e * k_tile + c]);
            } else {
                dk_dst.copy_from_slice(&dk_acc[c * d..(c + 1) * d]);
                dv_dst.copy_from_slice(&dv_acc[c * d..(c + 1) * d]);
            }
        }
    }
    if amx {
        for (i, row) in dq_head[..seq.q_len * d].chunks_exact(d).enumerate() {
            let dst = std::slice::from_raw_parts_mut(dq.0.add(q_off(i)), d);
            dst.iter_mut().zip(row).for_each(|(o, x)| *o = scale * x);
        }
    }
}

/// The query rows `[lo, hi)` (cut to `[0, q_len)`) from the first to the last query block that
/// the q lists of key tile `[j0, j0 + cols)` name for sequence `b`, head `head`; empty when
/// none does. The rows in between whose blocks are not listed are masked per row.
fn listed_query_rows(
    blocks: &HostBlocks,
    (b, head): (usize, usize),
    (j0, cols): (usize, usize),
    q_len: usize,
) -> (usize, usize) {
    let (mut first, mut last) = (usize::MAX, 0);
    for kb in j0 / BLOCK_SIZE..(j0 + cols).div_ceil(BLOCK_SIZE) {
        let row = blocks.q_row(b, head, kb);
        if let Some(qb) = row.iter().position(|&c| c != BlockClass::Empty) {
            first = first.min(qb);
        }
        if let Some(qb) = row.iter().rposition(|&c| c != BlockClass::Empty) {
            last = last.max(qb + 1);
        }
    }
    if first >= last {
        return (0, 0);
    }
    (first * BLOCK_SIZE, (last * BLOCK_SIZE).min(q_len))
}

/// Whether the q lists of key tile `[j0, j0 + cols)` name a query block of rows `[i0, i0 + rows)`.
fn lists_rows(
    blocks: &HostBlocks,
    (b, head): (usize, usize),
    (j0, cols): (usize, usize),
    (i0, rows): (usize, usize),
) -> bool {
    (j0 / BLOCK_SIZE..(j0 + cols).div_ceil(BLOCK_SIZE)).any(|kb| {
        let row = blocks.q_row(b, head, kb);
        row[i0 / BLOCK_SIZE..(i0 + rows).div_ceil(BLOCK_SIZE)].iter().any(|&c| c != BlockClass::Empty)
    })
}

/// -inf at the keys of one row of logits (keys from `j0`; query row `i` of sequence `b`, head
/// `head`) that the block mask hides: those of key blocks whose q list leaves out the row's
/// query block, and in partial blocks those the rule hides.
fn mask_blocks_row(blocks: &HostBlocks, row: &mut [f32], (b, head, i): (usize, usize, usize), j0: usize) {
    let qb = i / BLOCK_SIZE;
    let end = j0 + row.len();
    // One key block's part of the row at a time: full parts untouched, empty ones masked whole.
    let mut start = j0;
    while start < end {
        let kb = start / BLOCK_SIZE;
        let stop = ((kb + 1) * BLOCK_SIZE).min(end);
        let part = &mut row[start - j0..stop - j0];
        match blocks.q_row(b, head, kb)[qb] {
            BlockClass::Full => {}
            BlockClass::Empty => part.fill(f32::NEG_INFINITY),
            BlockClass::Partial => {
                for (j, x) in (start..stop).zip(part) {
                    if !blocks.partial_visible(b, head, i, j) {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
        start = stop;
    }
}

/// On AMX, `c_t` (d rows, `k_tile` apart) += Xᵀ Y over the query row pairs of the tile at `i0`:
/// `x_t` is X's rows paired along query rows and transposed (d × its length / d), `y` the
/// tile's row pairs of Y (`rows2` rows of `k_tile`, `n` keys used). dVᵀ += dOᵀ P, dKᵀ += Qᵀ dS.
///
/// # Safety
/// As `tile_matmul_bf16_pairs`: `c_t` valid for d rows of `n` keys, `k_tile` apart.
unsafe fn add_transposed_product(
    isa: CpuIsa,
    (x_t, y): (&[u32], &[u32]),
    (i0, d, n, rows2, k_tile): (usize, usize, usize, usize, usize),
    c_t: *mut f32,
) {
    let a = MatRef::rows(x_t[i0 / 2..].as_ptr().cast(), x_t.len() / d);
    tile_matmul_bf16_pairs(isa, (d, n, rows2), c_t, k_tile, true, a, (y.as_ptr().cast(), k_tile), 1.0);
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
