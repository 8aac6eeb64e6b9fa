//! CPU forward: one rayon task per (sequence, KV head, a few Q tiles); online softmax over K
//! tiles.
//! K/V rows come from packed tensors or a paged cache alike ([`KvRows`]).
//!
//! The scores are computed transposed, Sᵀ = K Qᵀ (keys × query rows): Qᵀ is packed once per
//! task and K is read in place, so no K tile is ever transposed; the softmax then runs down the
//! columns, vectorised across query rows, and O += P V reads Pᵀ's columns as P's rows. On AMX
//! tiles the output is accumulated transposed, Oᵀ += Vᵀ Pᵀ (AMX reads its A operand by rows
//! only), and turned back once per query tile.

#[cfg(target_arch = "x86_64")]
use super::fused::ProbsOut;
use super::kv::KvRows;
use super::simd::{bf16_pair, tile_matmul, tile_matmul_bf16_pairs, CpuIsa, MatRef};
use super::{dense_f32, exp_poly, logits_row, transpose_rows, AlignedVec, CpuTiles, OutBuf, OutPtr, SharedMut};
use crate::block_mask::{listed_key_tiles, BlockClass, HostBlocks, BLOCK_SIZE};
use crate::params::{AttnShape, FlashAttnOptions, HostData, RowKeys};
use candle_core::{CpuStorage, DType, Layout, Result};
use std::borrow::Cow;

/// One query tile of a task: `q_rows` query rows from `i0` for every query head of the group
/// (packed row p is query row `i0 + p % q_rows` of the group's head `p / q_rows`), its Qᵀ,
/// output accumulator and online-softmax state, and the keys its rows see.
struct QueryTile {
    i0: usize,
    q_rows: usize,
    q_t: AlignedVec<f32>,
    /// Qᵀ as bf16 pairs along d (AVX-512 BF16 on bf16 inputs only, else empty).
    q_t_pairs: AlignedVec<u32>,
    /// The output accumulator: rows × d, or d × rows (Oᵀ) on AMX tiles (see `Task::amx`).
    acc: AlignedVec<f32>,
    row_max: Vec<f32>,
    row_sum: Vec<f32>,
    correction: Vec<f32>,
    ranges: Vec<RowKeys>,
    /// Each row's key hull as u32 bounds (saturated), for the key-major mask; and whether any
    /// row has a gap in it (then the mask goes through the row rule).
    hull_lo: Vec<u32>,
    hull_hi: Vec<u32>,
    any_gap: bool,
    /// The union of the rows' key hulls, and the keys every row sees whole (no mask edge).
    keys: (usize, usize),
    all_see: (usize, usize),
    /// With a block mask: what each key block holds for this tile's rows ([`KeyBlock`]).
    key_blocks: Vec<KeyBlock>,
}

/// A key block as seen by the rows of one query tile through a block mask.
#[derive(Clone, Copy, PartialEq, Eq)]
enum KeyBlock {
    /// No row lists it: skipped (masked where a key tile straddles it and a listed one).
    Unlisted,
    /// Some rows list it, not every one as full: each row's class (and the rule) per element.
    Mixed,
    /// Every row lists it as full: no element test.
    Full,
}

/// Each key block's [`KeyBlock`] for the rows `i0..i0 + q_rows` of query heads `heads` of
/// sequence `b`: the union of their query blocks' lists.
fn key_blocks(
    blocks: &HostBlocks,
    b: usize,
    heads: std::ops::Range<usize>,
    (i0, q_rows): (usize, usize),
    out: &mut Vec<KeyBlock>,
) {
    out.clear();
    let of_class = |c: BlockClass| match c {
        BlockClass::Empty => KeyBlock::Unlisted,
        BlockClass::Partial => KeyBlock::Mixed,
        BlockClass::Full => KeyBlock::Full,
    };
    let query_blocks = i0 / BLOCK_SIZE..(i0 + q_rows).div_ceil(BLOCK_SIZE);
    for head in heads {
        for qb in query_blocks.clone() {
            let row = blocks.kv_row(b, head, qb);
            if out.is_empty() {
                out.extend(row.iter().map(|&c| of_class(c)));
            }
            // Rows that agree keep the block's kind; rows that differ make it mixed.
            for (o, &c) in out.iter_mut().zip(row) {
                if *o != of_class(c) {
                    *o = KeyBlock::Mixed;
                }
            }
        }
    }
}

impl QueryTile {
    fn new(d: usize, rows: usize, bf16_pairs: bool) -> Self {
        Self {
            i0: 0,
            q_rows: 0,
            q_t: AlignedVec::new(d * rows),
            q_t_pairs: AlignedVec::new(if bf16_pairs { d.div_ceil(2) * rows } else { 0 }),
            acc: AlignedVec::new(rows * d),
            row_max: vec![0.0; rows],
            row_sum: vec![0.0; rows],
            correction: vec![0.0; rows],
            ranges: Vec::with_capacity(rows),
            hull_lo: vec![0; rows],
            hull_hi: vec![0; rows],
            any_gap: false,
            keys: (0, 0),
            all_see: (0, 0),
            key_blocks: vec![],
        }
    }
}

/// Per-worker scratch, O(tile): the task's query tiles, the K and V tiles (f32, contiguous),
/// the transposed scores, one score column, and the bf16-pair operands (AVX-512 BF16 on bf16
/// inputs only, else empty): Q rows (before their transpose), K, P and V with pairs along the
/// reduction axis of each product.
struct Scratch {
    tiles: Vec<QueryTile>,
    k_tile: AlignedVec<f32>,
    v_tile: AlignedVec<f32>,
    scores_t: AlignedVec<f32>,
    column: Vec<f32>,
    q_pairs: Vec<u32>,
    k_pairs: AlignedVec<u32>,
    p_pairs: AlignedVec<u32>,
    v_pairs: Vec<u32>,
    /// Vᵀ as bf16 pairs along keys (d × k_cols/2), the A operand of Oᵀ += Vᵀ Pᵀ on AMX tiles.
    vt_pairs: AlignedVec<u32>,
    /// P in f32 (keys × rows, as the scores) from the fused softmax step of the f32 products.
    probs: AlignedVec<f32>,
    /// The output rows of a query tile (rows × d; Oᵀ transposed back on AMX) before they are
    /// normalised and narrowed into the output.
    out_rows: Vec<f32>,
}

impl Scratch {
    fn new(d: usize, (rows, tiles_per_task): (usize, usize), k_cols: usize, bf16_pairs: bool) -> Self {
        let (d2, k2) = (d.div_ceil(2), k_cols.div_ceil(2));
        let pairs = |n: usize| if bf16_pairs { vec![0; n] } else { vec![] };
        let aligned_pairs = |n: usize| AlignedVec::new(if bf16_pairs { n } else { 0 });
        Self {
            tiles: (0..tiles_per_task).map(|_| QueryTile::new(d, rows, bf16_pairs)).collect(),
            k_tile: AlignedVec::new(k_cols * d),
            v_tile: AlignedVec::new(k_cols * d),
            scores_t: AlignedVec::new(k_cols * rows),
            column: vec![0.0; k_cols],
            q_pairs: pairs(d2 * rows),
            k_pairs: aligned_pairs(k_cols * d2),
            p_pairs: aligned_pairs(k2 * rows),
            v_pairs: pairs(k2 * d),
            vt_pairs: aligned_pairs(d * k2),
            out_rows: vec![0.0; rows * d],
            probs: AlignedVec::new(if bf16_pairs { 0 } else { k_cols * rows }),
        }
    }
}

/// Forward on the CPU. Returns the output (q's dtype, q's shape, contiguous) and the
/// log-sum-exp (f32, laid out as `shape.lse_dims()`).
///
/// A query tile holds a few query rows of *every* query head that shares one KV head
/// (GQA/MQA), about [`CpuTiles::q_rows`] rows in all: each K/V tile is read once per group
/// rather than once per head, and decoding (one query row) still gets matrix-sized products.
/// A task runs up to [`CpuTiles::q_tiles_per_task`] consecutive query tiles against each K/V
/// tile in turn, so the K/V tile is copied (and widened) once for all of them.
pub(crate) fn forward(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    (q, q_l): (&CpuStorage, &Layout),
    (k, k_l): (&CpuStorage, &Layout),
    (v, v_l): (&CpuStorage, &Layout),
) -> Result<(CpuStorage, Vec<f32>)> {
    let host = shape.host()?;
    let (isa, tiles) = (CpuIsa::active(), CpuTiles::get());
    // bf16 inputs with AVX-512 BF16 selected (by default on AMD, see `CpuIsa::active`): both
    // products on bf16 pairs with f32 accumulation (P rounded to bf16 for P V, as the GPU kernels do).
    let bf16_pairs = isa.bf16_pairs() && shape.dtype == DType::BF16;
    let amx = bf16_pairs && isa == CpuIsa::Amx;
    // On AMX, bf16 Q rows are read in place (their bf16 pairs along d as stored); otherwise Q
    // is widened to f32 once.
    let q_bf16 = if amx { Some(KvRows::queries(isa, shape, host, (q, q_l))?).filter(KvRows::is_bf16) } else { None };
    let q = if q_bf16.is_some() { Cow::Borrowed(&[][..]) } else { dense_f32(q, q_l)? };
    let (k, v) = (KvRows::new(isa, shape, host, k, k_l)?, KvRows::new(isa, shape, host, v, v_l)?);
    let (h, d, group) = (shape.num_heads, shape.head_dim, shape.group_size());
    // Every (row, head) slot is written below, masked rows included.
    let mut out = OutBuf::zeroed(shape.dtype, shape.total_q * h * d)?;
    let mut lse = vec![f32::NEG_INFINITY; shape.lse_dims().iter().product()];

    let max_q = host.seqs.iter().map(|s| s.q_len).max().unwrap_or(0);
    let rows_per_head = (tiles.q_rows_for(amx, max_q) / group).max(1);
    // Query tiles per task: as many as allowed while leaving every thread four tasks or more.
    let query_tiles: usize =
        host.seqs.iter().map(|s| s.q_len.div_ceil(rows_per_head)).sum::<usize>() * shape.num_kv_heads;
    let per_task = (query_tiles / (4 * rayon::current_num_threads())).clamp(1, tiles.q_tiles_per_task);
    let task_rows = rows_per_head * per_task;
    let tasks: Vec<(usize, usize, usize)> = host
        .seqs
        .iter()
        .enumerate()
        .flat_map(|(b, seq)| {
            (0..shape.num_kv_heads).flat_map(move |kvh| (0..seq.q_len).step_by(task_rows).map(move |i0| (b, kvh, i0)))
        })
        .collect();
    let (out_ptr, lse_ptr) = (out.ptr(), SharedMut(lse.as_mut_ptr()));
    let key = ScratchKey { d, rows: rows_per_head * group, per_task, k_cols: tiles.k_cols, bf16_pairs };
    let run = |&(b, kv_head, i0): &(usize, usize, usize)| {
        let q_rows = task_rows.min(host.seqs[b].q_len - i0);
        with_scratch(key, |scratch| {
            // SAFETY: the task (b, kv_head, i0) writes only the out and lse slots of rows
            // i0..i0+q_rows of sequence b for the query heads of `kv_head`; no two tasks share one.
            unsafe {
                let task = Task { isa, bf16_pairs, amx, k_cols: tiles.k_cols, b, kv_head, i0, q_rows, rows_per_head };
                let q = (&q[..], q_bf16.as_ref());
                forward_task(shape, host, opts, (q, &k, &v), (out_ptr, lse_ptr), task, scratch)
            }
        })
    };
    super::for_each_task(tasks.len(), |i| run(&tasks[i]));
    Ok((out.into_storage(), lse))
}

/// One forward task: query rows `i0..i0 + q_rows` of sequence `b`, for every query head of
/// `kv_head`'s group, in query tiles of `rows_per_head` rows per head, with the instruction
/// set and key tile of the call.
#[derive(Clone, Copy)]
struct Task {
    isa: CpuIsa,
    bf16_pairs: bool,
    /// bf16 pairs on AMX tiles: the output is accumulated transposed, Oᵀ += Vᵀ Pᵀ, so both
    /// products read their A operand (K, Vᵀ) in place and their B operand (Qᵀ, Pᵀ) in the
    /// pair layout the softmax writes: nothing is transposed per query tile.
    amx: bool,
    k_cols: usize,
    b: usize,
    kv_head: usize,
    i0: usize,
    q_rows: usize,
    rows_per_head: usize,
}

/// # Safety
/// `out` and `lse` must point to buffers of `total_q*H*D` and `lse_dims` elements, no other
/// thread may write the slots of this task, and `task.isa` must not exceed the CPU's.
unsafe fn forward_task(
    shape: &AttnShape,
    host: &HostData,
    opts: &FlashAttnOptions,
    ((q, q_bf16), k, v): ((&[f32], Option<&KvRows>), &KvRows, &KvRows),
    (out, lse): (OutPtr, SharedMut),
    Task { isa, bf16_pairs, amx, k_cols, b, kv_head, i0, q_rows, rows_per_head }: Task,
    scratch: &mut Scratch,
) {
    let (h, d, group) = (shape.num_heads, shape.head_dim, shape.group_size());
    let seq = &host.seqs[b];
    let blocks = host.block_mask.as_deref();
    let q_rs = h * d;
    let d2 = d.div_ceil(2);
    let Scratch {
        tiles,
        k_tile,
        v_tile,
        scores_t,
        column,
        q_pairs,
        k_pairs,
        p_pairs,
        v_pairs,
        vt_pairs,
        out_rows,
        probs,
    } = scratch;
    let tiles = &mut tiles[..q_rows.div_ceil(rows_per_head)];
    let row_of = |t: &QueryTile, p: usize| (kv_head * group + p / t.q_rows, t.i0 + p % t.q_rows);
    for (n, t) in tiles.iter_mut().enumerate() {
        t.i0 = i0 + n * rows_per_head;
        t.q_rows = rows_per_head.min(i0 + q_rows - t.i0);
        let rows = t.q_rows * group;
        // Qᵀ (d × rows): column p is packed row p (as bf16 pairs along d when the products
        // run on them: each row paired, then the pairs transposed).
        let (t_i0, t_rows) = (t.i0, t.q_rows);
        let q_row = |p: usize| {
            let (head, i) = (kv_head * group + p / t_rows, t_i0 + p % t_rows);
            &q[(seq.q_start + i) * q_rs + head * d..][..d]
        };
        if let Some(q_bf16) = q_bf16 {
            for p in 0..rows {
                let (head, i) = (kv_head * group + p / t_rows, t_i0 + p % t_rows);
                let row = q_bf16.bf16_row(host, (b, head, d), i).unwrap_or_default();
                bf16_row_pairs(row, &mut q_pairs[p * d2..(p + 1) * d2]);
            }
            transpose_rows(|p| &q_pairs[p * d2..(p + 1) * d2], (rows, d2), &mut t.q_t_pairs, rows);
        } else if bf16_pairs {
            for p in 0..rows {
                pack_row_pairs(isa, q_row(p), d, &mut q_pairs[p * d2..(p + 1) * d2]);
            }
            transpose_rows(|p| &q_pairs[p * d2..(p + 1) * d2], (rows, d2), &mut t.q_t_pairs, rows);
        } else {
            transpose_rows(q_row, (rows, d), &mut t.q_t, rows);
        }
        t.ranges.clear();
        t.ranges.extend((0..rows).map(|p| shape.row_keys(opts, host, b, t_i0 + p % t_rows)));
        let ranges = &t.ranges;
        let bound = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
        for (r, keys) in ranges.iter().enumerate() {
            (t.hull_lo[r], t.hull_hi[r]) = (bound(keys.hull.0), bound(keys.hull.1));
        }
        t.any_gap = ranges.iter().any(|r| r.gap.is_some());
        // Each row's keys lie in its hull; K tiles outside the union of the hulls are skipped.
        t.keys = (
            ranges.iter().filter(|r| !r.is_empty()).map(|r| r.hull.0).min().unwrap_or(0),
            ranges.iter().map(|r| r.hull.1).max().unwrap_or(0),
        );
        // Tiles inside every row's hull (and no gap) need no mask: the common case.
        t.all_see = (
            ranges.iter().map(|r| r.hull.0).max().unwrap_or(0),
            ranges.iter().map(|r| if r.gap.is_some() { 0 } else { r.hull.1 }).min().unwrap_or(0),
        );
        t.acc[..rows * d].fill(0.0);
        t.row_max[..rows].fill(f32::NEG_INFINITY);
        t.row_sum[..rows].fill(0.0);
        if let Some(blocks) = blocks {
            key_blocks(blocks, b, kv_head * group..(kv_head + 1) * group, (t.i0, t.q_rows), &mut t.key_blocks);
            // The tile's keys end at its last listed key block and start at its first (a key
            // tile that reaches past the last one is cut there, not computed and masked).
            let listed = |kb: &KeyBlock| *kb != KeyBlock::Unlisted;
            let first = t.key_blocks.iter().position(listed).unwrap_or(0);
            let end = t.key_blocks.iter().rposition(listed).map_or(0, |kb| kb + 1);
            t.keys = (t.keys.0.max(first * BLOCK_SIZE), t.keys.1.min(end * BLOCK_SIZE));
            if t.keys.1 <= t.keys.0 {
                t.keys = (0, 0);
            }
        }
    }
    let plain_logits = opts.softcap.is_none() && !host.has_alibi();
    // AMX with plain logits and a positive scale: Sᵀ stays unscaled (stored straight from the
    // tiles) and one fused softmax scales it, exponentiates and writes P's pairs.
    let fused = amx && plain_logits && opts.softmax_scale > 0.0;
    // The fused AVX-512 softmax step (any logits: it exponentiates what Sᵀ holds); its bf16
    // pairs need AVX-512 BF16 (`bf16_pairs` implies it), its f32 output AVX-512 F only.
    // On AVX2 the f32 step only (there are no bf16 pairs below AVX-512 BF16).
    let fused_softmax = cfg!(target_arch = "x86_64") && isa >= CpuIsa::Avx2;
    let k_lo = tiles.iter().filter(|t| t.keys.1 > t.keys.0).map(|t| t.keys.0).min().unwrap_or(0);
    let k_hi = tiles.iter().map(|t| t.keys.1).max().unwrap_or(0);

    for (j0, cols) in key_tiles(tiles, blocks.is_some(), (k_lo, k_hi), k_cols) {
        let k2 = cols.div_ceil(2);
        // AMX on bf16 K/V: K's rows read in place (bf16 rows are their pairs along d, even
        // element in the low half) and V's pairs built from its raw rows; nothing widened.
        let k_raw = amx && k.is_bf16();
        let k_in_place = if k_raw && d % 2 == 0 {
            // (Only on 64-byte lines: rows that straddle lines load at half speed; then K's
            // rows are copied into the aligned pairs below.)
            k.bf16_rows_in_place(host, (b, kv_head, d), (j0, cols))
                .filter(|&(ptr, stride)| (2 * stride).is_multiple_of(64) && (ptr as usize).is_multiple_of(64))
        } else {
            None
        };
        let v_direct = amx && v.is_bf16();
        let k_rows: &[f32] = if !k_raw { k.tile(host, (b, kv_head, d), (j0, cols), k_tile) } else { &[] };
        let v_rows: &[f32] = if !v_direct { v.tile(host, (b, kv_head, d), (j0, cols), v_tile) } else { &[] };
        if bf16_pairs && k_in_place.is_none() {
            if k_raw {
                for j in 0..cols {
                    let row = k.bf16_row(host, (b, kv_head, d), j0 + j).unwrap_or_default();
                    bf16_row_pairs(row, &mut k_pairs[j * d2..(j + 1) * d2]);
                }
            } else {
                pack_row_pairs(isa, k_rows, d, &mut k_pairs[..cols * d2]);
            }
        }
        if bf16_pairs && !v_direct {
            for j2 in 0..k2 {
                let (j, next) = (2 * j2, (2 * j2 + 1 < cols).then_some(2 * j2 + 1));
                let v_pair = (&v_rows[j * d..(j + 1) * d], next.map(|n| &v_rows[n * d..(n + 1) * d]));
                pack_pairs(isa, v_pair.0, v_pair.1, &mut v_pairs[j2 * d..(j2 + 1) * d]);
            }
        }
        // The K operand of Sᵀ = K Qᵀ on bf16 pairs: in place, or the packed pairs.
        let k_operand = match k_in_place {
            Some((ptr, stride)) => MatRef::rows(ptr.cast(), stride / 2),
            None => MatRef::rows(k_pairs.as_ptr().cast(), d2),
        };
        if amx {
            // Vᵀ paired along keys (d × k_cols/2): the A operand of Oᵀ += Vᵀ Pᵀ, for every
            // query tile of the task: V's pairs along keys (two raw bf16 rows interleaved, or
            // packed above from widened rows), then one 4-byte transpose.
            if v_direct {
                for j2 in 0..k2 {
                    let row = |j: usize| v.bf16_row(host, (b, kv_head, d), j0 + j).unwrap_or_default();
                    let odd = (2 * j2 + 1 < cols).then(|| row(2 * j2 + 1));
                    interleave_bf16(isa, row(2 * j2), odd, &mut v_pairs[j2 * d..(j2 + 1) * d]);
                }
            }
            transpose_rows(|j2| &v_pairs[j2 * d..(j2 + 1) * d], (k2, d), vt_pairs, k_cols.div_ceil(2));
        }
        for t in tiles.iter_mut().filter(|t| t.keys.0 < j0 + cols && j0 < t.keys.1) {
            let rows = t.q_rows * group;
            // Keys past every row's hull are not computed: a causal task's first query tiles
            // stop at their diagonal instead of running the whole key tile masked.
            let cols = cols.min(t.keys.1 - j0);
            // With a block mask: tiles whose key blocks none of these rows list are skipped,
            // and only tiles with a block not full for every row get the element pass.
            let block_pass = match blocks {
                None => false,
                Some(_) => {
                    let tile_blocks = &t.key_blocks[j0 / BLOCK_SIZE..(j0 + cols).div_ceil(BLOCK_SIZE)];
                    if tile_blocks.iter().all(|&kb| kb == KeyBlock::Unlisted) {
                        continue;
                    }
                    tile_blocks.iter().any(|&kb| kb != KeyBlock::Full)
                }
            };
            let k2 = cols.div_ceil(2);
            let s_t = &mut scores_t[..cols * rows];
            // Sᵀ = scale · K Qᵀ for this tile (keys × rows); unscaled when the AMX softmax
            // applies the scale (`fused`).
            if bf16_pairs {
                let alpha = if fused { 1.0 } else { opts.softmax_scale };
                let q2 = (t.q_t_pairs.as_ptr().cast(), rows);
                tile_matmul_bf16_pairs(isa, (cols, rows, d2), s_t.as_mut_ptr(), rows, false, k_operand, q2, alpha);
            } else {
                let (kv, qt) = (MatRef::rows(k_rows.as_ptr(), d), (t.q_t.as_ptr(), rows));
                tile_matmul(isa, (cols, rows, d), s_t.as_mut_ptr(), rows, false, kv, qt, opts.softmax_scale);
            }
            let whole = plain_logits && t.all_see.0 <= j0 && j0 + cols <= t.all_see.1;
            if whole {
                // Every row sees every key of the tile and the logits are plain: nothing to do.
            } else if plain_logits && !t.any_gap && u32::try_from(j0 + cols).is_ok() {
                // The hulls' edges only, key by key across the query rows (the row rule below
                // writes the tile column by column: a strided pass that missed L1).
                mask_keys_t(isa, s_t, rows, j0 as u32, &t.hull_lo[..rows], &t.hull_hi[..rows]);
            } else {
                // Softcap, ALiBi and masks per query row, through the one row rule.
                for (r, keys) in t.ranges.iter().enumerate() {
                    let column = &mut column[..cols];
                    column.iter_mut().enumerate().for_each(|(j, x)| *x = s_t[j * rows + r]);
                    let (head, i) = row_of(t, r);
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
            if let Some(blocks) = blocks.filter(|_| block_pass) {
                // The block mask on top of the masks above (their intersection).
                mask_blocks_t(blocks, s_t, (rows, b, j0), &t.key_blocks, |r| row_of(t, r));
            }
            let (max, sum, correction) = (&mut t.row_max[..rows], &mut t.row_sum[..rows], &mut t.correction[..rows]);
            // The softmax step writes P where the product reads it: on AVX-512 and AVX2 in one
            // fused pass (`fused::online_softmax`: bf16 pairs; `online_softmax_f32` and, on
            // AVX2, `online_softmax_f32_avx2`: f32 into `probs`), else (portable) in place over
            // Sᵀ, packed into pairs for the bf16 products.
            let probs_at: *const f32 = if fused_softmax {
                #[cfg(target_arch = "x86_64")]
                {
                    let scale = if fused { opts.softmax_scale } else { 1.0 };
                    let state = (&mut *max, &mut *sum, &mut *correction);
                    if bf16_pairs {
                        // SAFETY: `bf16_pairs` implies AVX-512 BF16; the buffers hold the tile.
                        let out = ProbsOut::Pairs(p_pairs.as_mut_ptr());
                        super::fused::online_softmax(s_t, (cols, rows), scale, state, out);
                    } else if isa >= CpuIsa::Avx512 {
                        // SAFETY: `isa` says AVX-512 F/BW/VL are present; `probs` holds the tile.
                        super::fused::online_softmax_f32(s_t, (cols, rows), scale, state, probs.as_mut_ptr());
                    } else {
                        // SAFETY: `fused_softmax` implies AVX2 and FMA; `probs` holds the tile.
                        super::fused::online_softmax_f32_avx2(s_t, (cols, rows), scale, state, probs.as_mut_ptr());
                    }
                }
                probs.as_ptr()
            } else {
                online_softmax_columns(isa, s_t, rows, max, sum, correction);
                if bf16_pairs {
                    for j2 in 0..k2 {
                        let (j, next) = (2 * j2, (2 * j2 + 1 < cols).then_some(2 * j2 + 1));
                        let p_rows = (&s_t[j * rows..(j + 1) * rows], next.map(|n| &s_t[n * rows..(n + 1) * rows]));
                        pack_pairs(isa, p_rows.0, p_rows.1, &mut p_pairs[j2 * rows..(j2 + 1) * rows]);
                    }
                }
                s_t.as_ptr()
            };
            if amx {
                rescale_columns(isa, &mut t.acc[..rows * d], rows, correction);
            } else {
                rescale_rows(isa, &mut t.acc[..rows * d], d, correction);
            }
            // O += P V (P = (Pᵀ)ᵀ read in place, or as bf16 pairs of consecutive keys), or on AMX
            // Oᵀ (d × rows) += Vᵀ Pᵀ (Pᵀ's pairs along keys are the B layout).
            if amx {
                let (vt2, p2) =
                    (MatRef::rows(vt_pairs.as_ptr().cast(), k_cols.div_ceil(2)), (p_pairs.as_ptr().cast(), rows));
                tile_matmul_bf16_pairs(isa, (d, rows, k2), t.acc.as_mut_ptr(), rows, true, vt2, p2, 1.0);
            } else if bf16_pairs {
                let (p2, v2) = (MatRef::transposed(p_pairs.as_ptr().cast(), rows), (v_pairs.as_ptr().cast(), d));
                tile_matmul_bf16_pairs(isa, (rows, d, k2), t.acc.as_mut_ptr(), d, true, p2, v2, 1.0);
            } else {
                let p = MatRef::transposed(probs_at, rows);
                tile_matmul(isa, (rows, d, cols), t.acc.as_mut_ptr(), d, true, p, (v_rows.as_ptr(), d), 1.0);
            }
        }
    }

    for t in tiles.iter() {
        let rows = t.q_rows * group;
        let acc: &[f32] = if amx {
            // Oᵀ (d × rows) back to rows.
            transpose_rows(|e| &t.acc[e * rows..(e + 1) * rows], (d, rows), out_rows, d);
            &out_rows[..rows * d]
        } else {
            &t.acc[..rows * d]
        };
        for r in 0..rows {
            let (head, i) = row_of(t, r);
            let (sum, max) = (t.row_sum[r], t.row_max[r]);
            let at = (seq.q_start + i) * q_rs + head * d;
            let (scale, row_lse) = super::finish_row(max, sum, host.sink(head));
            *lse.0.add(shape.lse_index(seq, head, i)) = row_lse;
            if sum > 0.0 {
                out.write_scaled(isa, at, &acc[r * d..(r + 1) * d], scale);
            } else {
                // A row that sees no key: output 0 (lse -inf, or the sink's logit).
                out.write_zeros(at, d);
            }
        }
    }
}

/// The key tiles `(j0, cols)` of a task: `[k_lo, k_hi)` in tiles of `k_cols`, or with a block
/// mask (`blocked`) only the key blocks some query tile lists ([`listed_key_tiles`]).
fn key_tiles(tiles: &[QueryTile], blocked: bool, (k_lo, k_hi): (usize, usize), k_cols: usize) -> Vec<(usize, usize)> {
    if !blocked {
        return (k_lo..k_hi).step_by(k_cols).map(|j0| (j0, k_cols.min(k_hi - j0))).collect();
    }
    let num_blocks = tiles.iter().map(|t| t.key_blocks.len()).max().unwrap_or(0);
    let listed = |c: usize| tiles.iter().any(|t| t.key_blocks[c] != KeyBlock::Unlisted);
    listed_key_tiles(num_blocks, listed, (k_lo, k_hi), k_cols)
}

/// -inf at the keys of a transposed score tile (`s_t`: keys `j0..j0 + cols` × `rows`, sequence
/// `b`) that the block mask hides from their row: every key of a block no row lists, and in the
/// mixed blocks the rows whose block is empty or whose partial block's rule hides the key.
/// `row_at(r)`: the query head and row of tile row r.
fn mask_blocks_t(
    blocks: &HostBlocks,
    s_t: &mut [f32],
    (rows, b, j0): (usize, usize, usize),
    key_blocks: &[KeyBlock],
    row_at: impl Fn(usize) -> (usize, usize),
) {
    let cols = s_t.len() / rows;
    // The tile's part of each key block it touches: keys [lo, hi) of block kb.
    let parts = (j0 / BLOCK_SIZE..(j0 + cols).div_ceil(BLOCK_SIZE))
        .map(|kb| (kb, (kb * BLOCK_SIZE).max(j0), ((kb + 1) * BLOCK_SIZE).min(j0 + cols)));
    for (_, lo, hi) in parts.clone().filter(|&(kb, ..)| key_blocks[kb] == KeyBlock::Unlisted) {
        s_t[(lo - j0) * rows..(hi - j0) * rows].fill(f32::NEG_INFINITY);
    }
    if !parts.clone().any(|(kb, ..)| key_blocks[kb] == KeyBlock::Mixed) {
        return;
    }
    // Row by row in the mixed blocks: each row's classes looked up once, the rule evaluated
    // per element of its partial blocks only.
    for r in 0..rows {
        let (head, i) = row_at(r);
        let classes = blocks.kv_row(b, head, i / BLOCK_SIZE);
        for (kb, lo, hi) in parts.clone().filter(|&(kb, ..)| key_blocks[kb] == KeyBlock::Mixed) {
            match classes[kb] {
                BlockClass::Full => {}
                BlockClass::Empty => (lo..hi).for_each(|j| s_t[(j - j0) * rows + r] = f32::NEG_INFINITY),
                BlockClass::Partial => {
                    for j in (lo..hi).filter(|&j| !blocks.partial_visible(b, head, i, j)) {
                        s_t[(j - j0) * rows + r] = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
}

/// What a forward scratch was sized for: a thread's scratch is kept across calls and reused
/// while the call's key matches (a fresh one per rayon split cost a tenth of a bf16 call at
/// N = 1024 in zeroing and page faults).
#[derive(Clone, Copy, PartialEq, Eq)]
struct ScratchKey {
    d: usize,
    rows: usize,
    per_task: usize,
    k_cols: usize,
    bf16_pairs: bool,
}

thread_local! {
    static SCRATCH: super::ScratchSlot<ScratchKey, Scratch> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` with this thread's forward scratch for `key` ([`super::with_cached`]).
fn with_scratch<R>(key: ScratchKey, f: impl FnOnce(&mut Scratch) -> R) -> R {
    let make = || Scratch::new(key.d, (key.rows, key.per_task), key.k_cols, key.bf16_pairs);
    super::with_cached(&SCRATCH, key, true, make, f)
}

super::simd::multiversion! {
    /// One step of the online softmax on a transposed score tile (`s_t`: keys × `rows`, each
    /// column a query row), vectorised across the columns: new running max, `s_t ← exp(s_t −
    /// max)` (masked -inf → 0), running sum rescaled and extended, and the factor `correction`
    /// by which the row's accumulated output must be rescaled. A column that has seen no key
    /// keeps max -inf, sum 0, and gets zero probabilities (its shift is 0, so exp(-inf - 0) =
    /// 0, not NaN). Columns go one vector (`LANES`) at a time so that max and sum stay in registers while the
    /// keys stream by (running them key-major, through memory, took twice as long; measured).
    fn online_softmax_columns(s_t: &mut [f32], rows: usize, row_max: &mut [f32], row_sum: &mut [f32], correction: &mut [f32]) {
        let full = rows - rows % LANES;
        for c0 in (0..full).step_by(LANES) {
            softmax_column_block::<LANES, FMA>(s_t, rows, c0, (row_max, row_sum, correction));
        }
        for c0 in full..rows {
            softmax_column_block::<1, FMA>(s_t, rows, c0, (row_max, row_sum, correction));
        }
    }
}

/// [`online_softmax_columns`] for columns `c0..c0 + W`.
#[inline(always)]
fn softmax_column_block<const W: usize, const FMA: bool>(
    s_t: &mut [f32],
    rows: usize,
    c0: usize,
    (row_max, row_sum, correction): (&mut [f32], &mut [f32], &mut [f32]),
) {
    // Four partial maxima and sums, keys taken four at a time (one running vector was a chain
    // of dependent max/add instructions, latency-bound: the max pass was a quarter of the
    // softmax, perf). `>` rather than `f32::max`: one instruction, NaN ignored alike.
    let mut max4 = [[f32::NEG_INFINITY; W]; 4];
    max4[0] = row_max[c0..c0 + W].try_into().unwrap();
    let mut groups = s_t.chunks_exact(4 * rows);
    for group in &mut groups {
        for (u, m) in max4.iter_mut().enumerate() {
            let key: &[f32; W] = group[u * rows + c0..][..W].try_into().unwrap();
            for (m, &x) in m.iter_mut().zip(key) {
                *m = if x > *m { x } else { *m };
            }
        }
    }
    for key in groups.remainder().chunks_exact(rows) {
        let key: &[f32; W] = key[c0..c0 + W].try_into().unwrap();
        for (m, &x) in max4[0].iter_mut().zip(key) {
            *m = if x > *m { x } else { *m };
        }
    }
    let larger = |a: f32, b: f32| if b > a { b } else { a };
    let max: [f32; W] = std::array::from_fn(|i| larger(larger(max4[0][i], max4[1][i]), larger(max4[2][i], max4[3][i])));
    let mut shift = [0f32; W];
    for i in 0..W {
        let (old, new) = (row_max[c0 + i], max[i]);
        // exp(-inf) = 0 on a column's first visible tile; 1 while nothing is visible yet.
        let visible = new != f32::NEG_INFINITY;
        correction[c0 + i] = if visible { exp_poly::<FMA>(old - new) } else { 1.0 };
        shift[i] = if visible { new } else { 0.0 };
        row_max[c0 + i] = new;
    }
    let mut sum4 = [[0f32; W]; 4];
    let mut groups = s_t.chunks_exact_mut(4 * rows);
    for group in &mut groups {
        for (u, l) in sum4.iter_mut().enumerate() {
            let key: &mut [f32; W] = (&mut group[u * rows + c0..][..W]).try_into().unwrap();
            for ((x, s), l) in key.iter_mut().zip(&shift).zip(l.iter_mut()) {
                *x = exp_poly::<FMA>(*x - *s);
                *l += *x;
            }
        }
    }
    for key in groups.into_remainder().chunks_exact_mut(rows) {
        let key: &mut [f32; W] = (&mut key[c0..c0 + W]).try_into().unwrap();
        for ((x, s), l) in key.iter_mut().zip(&shift).zip(sum4[0].iter_mut()) {
            *x = exp_poly::<FMA>(*x - *s);
            *l += *x;
        }
    }
    let sum: [f32; W] = std::array::from_fn(|i| (sum4[0][i] + sum4[1][i]) + (sum4[2][i] + sum4[3][i]));
    for i in 0..W {
        row_sum[c0 + i] = row_sum[c0 + i] * correction[c0 + i] + sum[i];
    }
}

super::simd::multiversion! {
    /// `-inf` at the keys of a transposed score tile (`s_t`: keys `j0..` × `rows`) that lie
    /// outside their row's hull `[lo[r], hi[r])`: the mask of plain logits, one key row at a
    /// time, vectorised across the query rows.
    fn mask_keys_t(s_t: &mut [f32], rows: usize, j0: u32, lo: &[u32], hi: &[u32]) {
        for (j, key) in s_t.chunks_exact_mut(rows).enumerate() {
            let j = j0 + j as u32;
            for ((x, &l), &h) in key.iter_mut().zip(lo).zip(hi) {
                *x = if j < l || j >= h { f32::NEG_INFINITY } else { *x };
            }
        }
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
    /// Rescales each column of a transposed accumulator (`acc`: d rows of `rows`) by its
    /// row's softmax correction.
    fn rescale_columns(acc: &mut [f32], rows: usize, correction: &[f32]) {
        if correction.iter().all(|&c| c == 1.0) {
            return;
        }
        for row in acc.chunks_exact_mut(rows) {
            row.iter_mut().zip(correction).for_each(|(x, c)| *x *= c);
        }
    }
}

/// A raw bf16 row's pairs along it (`dst[i]` = elements 2i, 2i + 1; a zero half after an odd
/// length): the bits as stored, two at a time.
fn bf16_row_pairs(row: &[u16], dst: &mut [u32]) {
    let even = row.len() / 2;
    // SAFETY: little-endian x86 (the only target with bf16 pairs): the pair (a, b) is the u32
    // a | b << 16, i.e. the two u16 as they lie in memory; `dst` holds at least `even` pairs.
    #[cfg(target_endian = "little")]
    unsafe {
        std::ptr::copy_nonoverlapping(
            row.as_ptr().cast::<u8>(),
            dst.as_mut_ptr().cast::<u8>(),
            4 * even.min(dst.len()),
        );
    }
    #[cfg(not(target_endian = "little"))]
    for (o, pair) in dst.iter_mut().zip(row.chunks_exact(2)) {
        *o = pair[0] as u32 | (pair[1] as u32) << 16;
    }
    if let [.., last] = row[2 * even..] {
        dst[even] = last as u32;
    }
}

super::simd::multiversion! {
    /// bf16 pairs of two raw bf16 rows side by side (`dst[i] = (even[i], odd[i])`, a zero half
    /// without `odd`): V's pairs along keys, without widening.
    fn interleave_bf16(even: &[u16], odd: Option<&[u16]>, dst: &mut [u32]) {
        match odd {
            Some(odd) => dst.iter_mut().zip(even.iter().zip(odd)).for_each(|(o, (&lo, &hi))| *o = lo as u32 | (hi as u32) << 16),
            None => dst.iter_mut().zip(even).for_each(|(o, &lo)| *o = lo as u32),
        }
    }
}

super::simd::multiversion! {
    /// bf16 pairs for [`tile_matmul_bf16_pairs`] from two rows of the reduction axis side by
    /// side: `dst[i] = (even[i], odd[i])`, a zero half without `odd` (an odd length's end).
    pub(crate) fn pack_pairs(even: &[f32], odd: Option<&[f32]>, dst: &mut [u32]) {
        match odd {
            Some(odd) => dst.iter_mut().zip(even.iter().zip(odd)).for_each(|(o, (&lo, &hi))| *o = bf16_pair(lo, hi)),
            None => dst.iter_mut().zip(even).for_each(|(o, &lo)| *o = bf16_pair(lo, 0.0)),
        }
    }
}

super::simd::multiversion! {
    /// bf16 pairs along each row of `row` values (the reduction axis), a zero half after an odd
    /// length: rows of `row.div_ceil(2)` pairs.
    pub(crate) fn pack_row_pairs(src: &[f32], row: usize, dst: &mut [u32]) {
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
