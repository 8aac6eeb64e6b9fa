//! AVX-512 (BF16) row passes fused around the tile products: the forward's online softmax
//! step (exp, running max and sum, P written as bf16 pairs for the AMX products or as f32
//! for the f32 kernel; the f32 one also on AVX2) and the AMX backward's P and dS passes. Each
//! replaces two to four passes of the generic path over a tile that does not fit L1, and
//! computes the exp as exp2 with `vscalefps` (the hardware applies 2^n; on AVX2 the exponent
//! field).

use super::simd::{Avx2, Lanes};
use std::arch::x86_64::*;

/// Where [`online_softmax`] writes P.
#[derive(Clone, Copy)]
pub(crate) enum ProbsOut {
    /// bf16 pairs of key pairs, `p[j2 * rows + r]` = (P[2·j2][r], P[2·j2 + 1][r]): Pᵀ in the B
    /// layout of the AMX product Oᵀ += Vᵀ Pᵀ.
    Pairs(*mut u32),
    /// f32, laid out as the scores (`p[j * rows + r]`), for the f32 product O += P V.
    F32(*mut f32),
}

/// Defines an online softmax step function (the body of [`online_softmax`] and
/// [`online_softmax_f32`]) with the given target features. The body is expanded into each
/// function rather than shared through an inlined one: closures take the target features of
/// the function that contains them, and a shared body without them left its closures' AVX-512
/// intrinsics as out-of-line calls (the f32 forward ran 6x slower, measured).
macro_rules! online_softmax_fn {
    ($(#[$attr:meta])* $vis:vis fn $name:ident, $features:literal) => {
        $(#[$attr])*
        #[target_feature(enable = $features)]
        $vis unsafe fn $name(
            s_t: &[f32],
            (cols, rows): (usize, usize),
            scale: f32,
            (row_max, row_sum, correction): (&mut [f32], &mut [f32], &mut [f32]),
            out: ProbsOut,
        ) {
            debug_assert!(s_t.len() >= cols * rows);
            let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
            let c = _mm512_set1_ps(scale * std::f32::consts::LOG2_E);
            let interleave = interleave_halves();
            let s = s_t.as_ptr();
            let log2e = _mm512_set1_ps(std::f32::consts::LOG2_E);
            for c0 in (0..rows).step_by(16) {
                let lanes = 16.min(rows - c0);
                let m: __mmask16 = ((1u32 << lanes) - 1) as __mmask16;
                let at = |j: usize| _mm512_maskz_loadu_ps(m, s.add(j * rows + c0));
                // exp(x · scale − shift) of every key, written to `out`; returns the sum and the max
                // of the unscaled logits. `_mm512_max_ps(x, acc)` returns acc where either is NaN:
                // NaN logits do not set the max (they reach the sum, hence their row, as NaN).
                let exp_pass = |bias: __m512| {
                    let (mut sum0, mut sum1, mut max0, mut max1) = (_mm512_setzero_ps(), _mm512_setzero_ps(), neg_inf, neg_inf);
                    for j2 in 0..cols.div_ceil(2) {
                        let x0 = at(2 * j2);
                        let x1 = if 2 * j2 + 1 < cols { at(2 * j2 + 1) } else { neg_inf };
                        max0 = _mm512_max_ps(x0, max0);
                        max1 = _mm512_max_ps(x1, max1);
                        let (e0, e1) = (exp2(_mm512_fmadd_ps(x0, c, bias)), exp2(_mm512_fmadd_ps(x1, c, bias)));
                        sum0 = _mm512_add_ps(sum0, e0);
                        sum1 = _mm512_add_ps(sum1, e1);
                        match out {
                            ProbsOut::Pairs(p) => {
                                let halves = _mm512_cvtne2ps_pbh(e1, e0);
                                let pairs =
                                    _mm512_permutexvar_epi16(interleave, std::mem::transmute::<__m512bh, __m512i>(halves));
                                _mm512_mask_storeu_epi32(p.add(j2 * rows + c0).cast(), m, pairs);
                            }
                            ProbsOut::F32(p) => {
                                _mm512_mask_storeu_ps(p.add(2 * j2 * rows + c0), m, e0);
                                if 2 * j2 + 1 < cols {
                                    _mm512_mask_storeu_ps(p.add((2 * j2 + 1) * rows + c0), m, e1);
                                }
                            }
                        }
                    }
                    (_mm512_add_ps(sum0, sum1), _mm512_max_ps(max0, max1))
                };
                let old = _mm512_mask_loadu_ps(neg_inf, m, row_max.as_ptr().add(c0));
                let old_sum = _mm512_maskz_loadu_ps(m, row_sum.as_ptr().add(c0));
                // One pass with the running max as it stands (a stale max is exact: any shift gives
                // the same softmax), kept when no row's tile max exceeds it by more than STALE (P stays
                // below e^STALE, far from overflow); the max moves only then. Rows that have seen no
                // key yet (max -inf) take the two passes.
                if _mm512_mask_cmp_ps_mask::<_CMP_EQ_OQ>(m, old, neg_inf) == 0 {
                    let (sum, raw_max) = exp_pass(_mm512_mul_ps(old, _mm512_set1_ps(-std::f32::consts::LOG2_E)));
                    let limit = _mm512_add_ps(old, _mm512_set1_ps(STALE));
                    if _mm512_mask_cmp_ps_mask::<_CMP_GT_OQ>(m, _mm512_mul_ps(raw_max, _mm512_set1_ps(scale)), limit) == 0 {
                        _mm512_mask_storeu_ps(row_sum.as_mut_ptr().add(c0), m, _mm512_add_ps(old_sum, sum));
                        _mm512_mask_storeu_ps(correction.as_mut_ptr().add(c0), m, _mm512_set1_ps(1.0));
                        continue;
                    }
                }
                // Two passes: the tile's max first, then exp against the new running max.
                let mut mx = [neg_inf; 4];
                let mut j = 0;
                while j + 4 <= cols {
                    for (u, acc) in mx.iter_mut().enumerate() {
                        *acc = _mm512_max_ps(at(j + u), *acc);
                    }
                    j += 4;
                }
                while j < cols {
                    mx[0] = _mm512_max_ps(at(j), mx[0]);
                    j += 1;
                }
                let raw_max = _mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3]));
                let new = _mm512_max_ps(_mm512_mul_ps(raw_max, _mm512_set1_ps(scale)), old);
                let visible = _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(new, neg_inf);
                let corr =
                    _mm512_mask_blend_ps(visible, _mm512_set1_ps(1.0), exp2(_mm512_mul_ps(_mm512_sub_ps(old, new), log2e)));
                // t = x · scale · log2e − shift · log2e (shift 0 for a row that still sees nothing).
                let shift = _mm512_maskz_mov_ps(visible, new);
                let (sum, _) = exp_pass(_mm512_mul_ps(shift, _mm512_set1_ps(-std::f32::consts::LOG2_E)));
                _mm512_mask_storeu_ps(row_sum.as_mut_ptr().add(c0), m, _mm512_fmadd_ps(old_sum, corr, sum));
                _mm512_mask_storeu_ps(row_max.as_mut_ptr().add(c0), m, new);
                _mm512_mask_storeu_ps(correction.as_mut_ptr().add(c0), m, corr);
            }
        }
    };
}

online_softmax_fn! {
    /// The forward's online softmax step on a transposed tile of logits times `scale` (`s_t`:
    /// `cols` keys × `rows` query rows, masked keys -inf; AMX stores them unscaled, the f32 kernel
    /// scaled, with `scale` 1), fused with the writing of P (`out`: bf16 pairs, rounded to nearest
    /// even with zero past an odd `cols`, or f32): the running max (in scaled units),
    /// `correction = exp(old max - new max)` and the running sum. `s_t` is left as it is. The exp
    /// is [`exp2`] (masked keys give 0); a column with no visible key keeps max -inf, sum 0.
    /// NaN logits propagate into their rows, as in the generic path. Needs `scale > 0` (the max of
    /// the unscaled logits is then the max of the scaled ones).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL and BF16 must be present; `s_t` holds `cols * rows` values, the state
    /// slices `rows`; `out` addresses `cols.div_ceil(2) * rows` pairs or `cols * rows` floats.
    pub(crate) fn online_softmax, "avx512bf16,avx512f,avx512bw,avx512vl,avx2,fma"
}

online_softmax_fn! {
    /// [`online_softmax`] for AVX-512 F/BW/VL without BF16; only `ProbsOut::F32` may reach it
    /// (through [`online_softmax_f32`]).
    fn online_softmax_avx512, "avx512f,avx512bw,avx512vl,avx2,fma"
}

/// [`online_softmax`] writing f32 P into `probs` (`cols * rows` floats), which needs no AVX-512
/// BF16: the f32 forward on AVX-512 CPUs where bf16 pairs do not pay ([`super::CpuIsa::Avx512`]).
///
/// # Safety
/// AVX-512 F/BW/VL must be present; the slices and `probs` as for [`online_softmax`].
pub(crate) unsafe fn online_softmax_f32(
    s_t: &[f32],
    dims: (usize, usize),
    scale: f32,
    state: (&mut [f32], &mut [f32], &mut [f32]),
    probs: *mut f32,
) {
    online_softmax_avx512(s_t, dims, scale, state, ProbsOut::F32(probs))
}

/// [`online_softmax_f32`] on AVX2 + FMA, 8 query rows a vector: the same single pass on the
/// stale running max (kept while no row's tile max exceeds it by more than
/// [`STALE`]), with the tile's max and exact two passes as the fallback, so
/// that the generic path's separate max pass over the tile and most rescales of the output are
/// gone. `exp2_avx2` applies 2^n through the exponent bits (AVX2 has no `vscalefps`).
///
/// # Safety
/// AVX2 and FMA must be present; the slices and `probs` as for [`online_softmax`].
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn online_softmax_f32_avx2(
    s_t: &[f32],
    (cols, rows): (usize, usize),
    scale: f32,
    state: (&mut [f32], &mut [f32], &mut [f32]),
    probs: *mut f32,
) {
    debug_assert!(s_t.len() >= cols * rows);
    for c0 in (0..rows).step_by(8) {
        // Partial blocks (rows % 8) load and store through a lane mask; their spare lanes hold
        // 0 and are never written back. Full blocks are their own instantiation (a lane test
        // per key cost a compare and branch in the loop).
        let lanes = 8.min(rows - c0);
        let block = Lanes8 { base: c0, lanes, mask: Avx2::mask(lanes) };
        let state = (&mut *state.0, &mut *state.1, &mut *state.2);
        if lanes == 8 {
            softmax_block_avx2::<true>(s_t, (cols, rows), scale, state, probs, block);
        } else {
            softmax_block_avx2::<false>(s_t, (cols, rows), scale, state, probs, block);
        }
    }
}

/// [`online_softmax_f32_avx2`] on the query rows of one `block`.
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_block_avx2<const FULL: bool>(
    s_t: &[f32],
    dims: (usize, usize),
    scale: f32,
    (row_max, row_sum, correction): (&mut [f32], &mut [f32], &mut [f32]),
    probs: *mut f32,
    block: Lanes8,
) {
    let c = _mm256_set1_ps(scale * std::f32::consts::LOG2_E);
    let neg_log2e = _mm256_set1_ps(-std::f32::consts::LOG2_E);
    let old = block.load_or::<FULL>(row_max.as_ptr(), f32::NEG_INFINITY);
    let old_sum = block.load_or::<FULL>(row_sum.as_ptr(), 0.0);
    let live = block.bits();
    let unseen = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(old, _mm256_set1_ps(f32::NEG_INFINITY))) & live;
    if unseen == 0 {
        let (sum, raw_max) = exp_columns_avx2::<FULL>(s_t, dims, block, c, _mm256_mul_ps(old, neg_log2e), probs);
        let limit = _mm256_add_ps(old, _mm256_set1_ps(STALE));
        let over = _mm256_cmp_ps::<_CMP_GT_OQ>(_mm256_mul_ps(raw_max, _mm256_set1_ps(scale)), limit);
        if _mm256_movemask_ps(over) & live == 0 {
            block.store::<FULL>(row_sum.as_mut_ptr(), _mm256_add_ps(old_sum, sum));
            block.store::<FULL>(correction.as_mut_ptr(), _mm256_set1_ps(1.0));
            return;
        }
    }
    // The tile's max, then its exponentials against the new running max.
    let raw_max = max_columns_avx2::<FULL>(s_t, dims, block);
    let new = _mm256_max_ps(_mm256_mul_ps(raw_max, _mm256_set1_ps(scale)), old);
    let visible = _mm256_cmp_ps::<_CMP_NEQ_OQ>(new, _mm256_set1_ps(f32::NEG_INFINITY));
    let corr = _mm256_blendv_ps(
        _mm256_set1_ps(1.0),
        exp2_avx2(_mm256_mul_ps(_mm256_sub_ps(old, new), _mm256_set1_ps(std::f32::consts::LOG2_E))),
        visible,
    );
    let shift = _mm256_and_ps(visible, new);
    let (sum, _) = exp_columns_avx2::<FULL>(s_t, dims, block, c, _mm256_mul_ps(shift, neg_log2e), probs);
    block.store::<FULL>(row_sum.as_mut_ptr(), _mm256_fmadd_ps(old_sum, corr, sum));
    block.store::<FULL>(row_max.as_mut_ptr(), new);
    block.store::<FULL>(correction.as_mut_ptr(), corr);
}

/// Running max of a tile kept when it is stale by at most this (natural units): P stays below
/// e^8, far from overflow.
const STALE: f32 = 8.0;

/// Query rows `base..base + lanes` of a transposed tile, as one 8-lane vector.
#[derive(Clone, Copy)]
struct Lanes8 {
    base: usize,
    lanes: usize,
    mask: __m256i,
}

impl Lanes8 {
    /// The movemask bits of the live lanes.
    fn bits(self) -> i32 {
        (1 << self.lanes) - 1
    }
    /// `p[base..base + lanes]`, `fill` in the spare lanes (`FULL`: all 8 lanes are live).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load_or<const FULL: bool>(self, p: *const f32, fill: f32) -> __m256 {
        if FULL {
            _mm256_loadu_ps(p.add(self.base))
        } else {
            let x = _mm256_maskload_ps(p.add(self.base), self.mask);
            _mm256_blendv_ps(_mm256_set1_ps(fill), x, _mm256_castsi256_ps(self.mask))
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn store<const FULL: bool>(self, p: *mut f32, x: __m256) {
        if FULL {
            _mm256_storeu_ps(p.add(self.base), x)
        } else {
            _mm256_maskstore_ps(p.add(self.base), self.mask, x)
        }
    }
}

/// P = 2^(x·c + bias) of one 8-row block of every key, written to `probs` (laid out as the
/// tile); returns the block's sum of P and its max of x. `_mm256_max_ps(x, acc)` returns acc
/// where x is NaN: NaN logits do not set the max (they reach the sum, hence their row, as NaN).
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_columns_avx2<const FULL: bool>(
    s_t: &[f32],
    (cols, rows): (usize, usize),
    block: Lanes8,
    c: __m256,
    bias: __m256,
    probs: *mut f32,
) -> (__m256, __m256) {
    let s = s_t.as_ptr();
    let (mut sum0, mut sum1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let (mut max0, mut max1) = (_mm256_set1_ps(f32::NEG_INFINITY), _mm256_set1_ps(f32::NEG_INFINITY));
    let key = |j: usize, sum: &mut __m256, max: &mut __m256| {
        let x = block.load_or::<FULL>(s.add(j * rows), f32::NEG_INFINITY);
        let e = exp2_avx2(_mm256_fmadd_ps(x, c, bias));
        *max = _mm256_max_ps(x, *max);
        *sum = _mm256_add_ps(*sum, e);
        block.store::<FULL>(probs.add(j * rows), e);
    };
    // Two keys a step, each into its own sum and max (independent chains).
    for j in (0..cols - cols % 2).step_by(2) {
        key(j, &mut sum0, &mut max0);
        key(j + 1, &mut sum1, &mut max1);
    }
    if cols % 2 == 1 {
        key(cols - 1, &mut sum0, &mut max0);
    }
    (_mm256_add_ps(sum0, sum1), _mm256_max_ps(max0, max1))
}

/// The max of x over every key of one 8-row block (four chains: the loop is latency-bound
/// with one).
#[target_feature(enable = "avx2,fma")]
unsafe fn max_columns_avx2<const FULL: bool>(s_t: &[f32], (cols, rows): (usize, usize), block: Lanes8) -> __m256 {
    let s = s_t.as_ptr();
    let at = |j: usize| block.load_or::<FULL>(s.add(j * rows), f32::NEG_INFINITY);
    let mut max = [_mm256_set1_ps(f32::NEG_INFINITY); 4];
    for j in (0..cols - cols % 4).step_by(4) {
        for (u, m) in max.iter_mut().enumerate() {
            *m = _mm256_max_ps(at(j + u), *m);
        }
    }
    for j in cols - cols % 4..cols {
        max[0] = _mm256_max_ps(at(j), max[0]);
    }
    _mm256_max_ps(_mm256_max_ps(max[0], max[1]), _mm256_max_ps(max[2], max[3]))
}

/// 2^t on AVX2 with [`exp2`]'s polynomial and range: 0 below t = -125 (-inf included), NaN
/// kept; 2^n added to the exponent field (t is at most 127 here: clamped).
#[inline(always)]
unsafe fn exp2_avx2(t: __m256) -> __m256 {
    // min / max with the constant first return t where t is NaN (NaN stays NaN).
    let keep = _mm256_cmp_ps::<_CMP_NLT_UQ>(t, _mm256_set1_ps(-125.0));
    let t = _mm256_min_ps(_mm256_set1_ps(127.0), _mm256_max_ps(_mm256_set1_ps(-125.0), t));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
    let f = _mm256_sub_ps(t, n);
    let mut p = _mm256_set1_ps(EXP2_POLY[5]);
    for &coef in EXP2_POLY[..5].iter().rev() {
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(coef));
    }
    // 2^n for n in [-125, 127]: a normal number, built from its exponent field.
    let two_n =
        _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127))));
    _mm256_and_ps(keep, _mm256_mul_ps(p, two_n))
}

/// The AMX backward's P tile, fused: for query rows `0..rows` (row r at `probs[r * ld..]`,
/// columns `0..n`, holding the *unscaled* logits), P = exp(scale · x − lse) where the row
/// sees the key (`vis[r]`, columns relative to the tile), else 0 (all of a row whose lse is
/// -inf), written over the logits as f32 (for dS) and as bf16 pairs of row pairs,
/// `p_rows[r2 * ld + j]` = (P[2·r2][j], P[2·r2 + 1][j]) (zero past an odd `rows`): the B operand
/// of dVᵀ += dOᵀ P. Replaces the row pass (scale, mask), the exp pass and the pair packing.
///
/// # Safety
/// AVX-512 F/BW/VL and BF16; `probs` holds `rows` rows of `ld` (>= n) values, `p_rows`
/// `rows.div_ceil(2)` rows of `ld` pairs; `lse` and `vis` have `rows` entries.
#[target_feature(enable = "avx512bf16,avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) unsafe fn bwd_probs(
    (probs, ld): (*mut f32, usize),
    (rows, n): (usize, usize),
    scale: f32,
    (lse, vis): (&[f32], &[(usize, usize)]),
    p_rows: *mut u32,
) {
    let c = _mm512_set1_ps(scale * std::f32::consts::LOG2_E);
    let lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    let interleave = interleave_halves();
    // exp2(x · c − lse · log2e) on the visible lanes of row r, columns j..j + 16 (mask m).
    let row_probs = |r: usize, j: usize, m: __mmask16| {
        if r >= rows || lse[r] == f32::NEG_INFINITY {
            return _mm512_setzero_ps();
        }
        let col = _mm512_add_epi32(lanes, _mm512_set1_epi32(j as i32));
        let (lo, hi) = (vis[r].0.min(n) as i32, vis[r].1.min(n) as i32);
        let seen =
            _mm512_cmpge_epi32_mask(col, _mm512_set1_epi32(lo)) & _mm512_cmplt_epi32_mask(col, _mm512_set1_epi32(hi));
        let x = _mm512_maskz_loadu_ps(m, probs.add(r * ld + j));
        let bias = _mm512_set1_ps(-lse[r] * std::f32::consts::LOG2_E);
        _mm512_maskz_mov_ps(seen & m, exp2(_mm512_fmadd_ps(x, c, bias)))
    };
    for r2 in 0..rows.div_ceil(2) {
        let r = 2 * r2;
        for j in (0..n).step_by(16) {
            let m: __mmask16 = ((1u32 << 16.min(n - j)) - 1) as __mmask16;
            let (p0, p1) = (row_probs(r, j, m), row_probs(r + 1, j, m));
            _mm512_mask_storeu_ps(probs.add(r * ld + j), m, p0);
            if r + 1 < rows {
                _mm512_mask_storeu_ps(probs.add((r + 1) * ld + j), m, p1);
            }
            let pairs = _mm512_permutexvar_epi16(
                interleave,
                std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(p1, p0)),
            );
            _mm512_mask_storeu_epi32(p_rows.add(r2 * ld + j).cast(), m, pairs);
        }
    }
}

/// The AMX backward's dS tile, fused: dS = P ∘ (dP − D) for rows `0..rows` (P at
/// `probs[r * ld..]`, dP at `dprobs[r * ld..]`, columns `0..n`), written only as bf16 pairs:
/// along keys, `ds_keys[r * n.div_ceil(2) + j2]` (the A operand of dQ += dS K), and of row
/// pairs, `ds_rows[r2 * ld + j]` (the B operand of dKᵀ += Qᵀ dS); zero halves past odd ends.
/// Replaces the dS pass and two packing passes (dS in f32 is not needed on AMX).
///
/// # Safety
/// AVX-512 F/BW/VL and BF16; `probs`/`dprobs` hold `rows` rows of `ld` (>= n) values,
/// `ds_keys` `rows · n.div_ceil(2)` pairs, `ds_rows` `rows.div_ceil(2)` rows of `ld` pairs;
/// `delta` has `rows` entries.
#[target_feature(enable = "avx512bf16,avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) unsafe fn bwd_score_grads(
    (probs, dprobs, ld): (*const f32, *const f32, usize),
    (rows, n): (usize, usize),
    delta: &[f32],
    (ds_keys, ds_rows): (*mut u32, *mut u32),
) {
    let interleave = interleave_halves();
    let n2 = n.div_ceil(2);
    let grads = |r: usize, j: usize, m: __mmask16| {
        if r >= rows {
            return _mm512_setzero_ps();
        }
        let p = _mm512_maskz_loadu_ps(m, probs.add(r * ld + j));
        let dp = _mm512_maskz_loadu_ps(m, dprobs.add(r * ld + j));
        _mm512_mul_ps(p, _mm512_sub_ps(dp, _mm512_set1_ps(delta[r])))
    };
    for r2 in 0..rows.div_ceil(2) {
        let r = 2 * r2;
        for j in (0..n).step_by(16) {
            let m: __mmask16 = ((1u32 << 16.min(n - j)) - 1) as __mmask16;
            let (g0, g1) = (grads(r, j, m), grads(r + 1, j, m));
            // Along keys: 16 consecutive bf16 are 8 pairs (a masked-off lane is 0: the zero half).
            let words: __mmask16 = ((1u32 << (16.min(n - j).div_ceil(2) * 2)) - 1) as __mmask16;
            let keys0 = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(g0));
            _mm256_mask_storeu_epi16(ds_keys.add(r * n2 + j / 2).cast(), words, keys0);
            if r + 1 < rows {
                let keys1 = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(g1));
                _mm256_mask_storeu_epi16(ds_keys.add((r + 1) * n2 + j / 2).cast(), words, keys1);
            }
            let pairs = _mm512_permutexvar_epi16(
                interleave,
                std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(g1, g0)),
            );
            _mm512_mask_storeu_epi32(ds_rows.add(r2 * ld + j).cast(), m, pairs);
        }
    }
}

/// `dst[..src.len()]` = `scale · src` rounded to bf16 (nearest even, `vcvtneps2bf16`; NaN
/// stays NaN), 16 at a time: the forward's output rows.
///
/// # Safety
/// AVX-512 F/BW/VL and BF16; `dst` is valid for `src.len()` u16 writes.
#[target_feature(enable = "avx512bf16,avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) unsafe fn narrow_bf16_row(src: &[f32], scale: f32, dst: *mut u16) {
    let s = _mm512_set1_ps(scale);
    for j in (0..src.len()).step_by(16) {
        let m: __mmask16 = ((1u32 << 16.min(src.len() - j)) - 1) as __mmask16;
        let x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, src.as_ptr().add(j)), s);
        let words = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(x));
        _mm256_mask_storeu_epi16(dst.add(j).cast(), m, words);
    }
}

/// The word permutation that interleaves the two halves of a `cvtne2ps` result (word 2i from
/// word i, 2i + 1 from 16 + i): two rows of 16 values into 16 bf16 pairs.
#[inline(always)]
unsafe fn interleave_halves() -> __m512i {
    _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
        16, 0,
    )
}

/// 2^f on [-1/2, 1/2], degree 5 (constant term first), fitted for relative error (1.5e-7 at
/// most, measured on 200001 points; the degree-6 Taylor series it replaced was no better and one
/// FMA longer).
const EXP2_POLY: [f32; 6] = [1.000_000_1, 0.693_146_94, 0.240_221_2, 0.055_507_135, 0.009_675_542, 0.001_327_645_3];

/// 2^t, ~1.5e-7 relative error: t = n + f with n = round(t), f in [-1/2, 1/2], 2^f by a
/// degree-5 polynomial, then `vscalefps` multiplies by 2^n; 0 below t = -125 (-inf
/// included); NaN stays NaN (`max(lo, t)` returns t when t is NaN).
#[inline(always)]
unsafe fn exp2(t: __m512) -> __m512 {
    // Below 2^-125 the result is 0 (exp(x) below e^-86.6, as `exp_poly`), computed for no
    // lane: a result in the subnormal range, or an underflow, takes a microcode assist of
    // ~100+ cycles per instruction (masked causal tiles ran 5x slower when every -inf went
    // through 2^-200). The compare is "not less than", true for NaN, which is kept.
    let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(t, _mm512_set1_ps(-125.0));
    let t = _mm512_max_ps(_mm512_set1_ps(-125.0), t);
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
    let f = _mm512_sub_ps(t, n);
    let mut p = _mm512_set1_ps(EXP2_POLY[5]);
    for &coef in EXP2_POLY[..5].iter().rev() {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(coef));
    }
    _mm512_maskz_scalef_ps(keep, p, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fused softmax across several key tiles, as the forward uses it (O becomes
    /// O · correction plus P V, with the bf16 pairs it writes), against f64 softmax-weighted sums and the
    /// log-sum-exp: the first tile's two passes, a stale max kept, a max that jumps by more
    /// than the stale margin (the redo), rows that see nothing for a while or ever, a row
    /// with a NaN logit, partial column blocks and an odd key count.
    #[test]
    fn fused_softmax_matches_f64() {
        use super::super::CpuIsa;
        // bf16 pairs (`online_softmax`, AVX-512 BF16), then f32 P (`online_softmax_f32`,
        // AVX-512; `online_softmax_f32_avx2`, AVX2).
        for (kind, need) in
            [(Kind::Pairs, CpuIsa::Avx512Bf16), (Kind::F32, CpuIsa::Avx512), (Kind::F32Avx2, CpuIsa::Avx2)]
        {
            if CpuIsa::detected() < need {
                println!("skipping {kind:?}: this CPU has no {need:?}");
                continue;
            }
            fused_softmax_case(kind);
        }
    }

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Kind {
        Pairs,
        F32,
        F32Avx2,
    }

    fn fused_softmax_case(kind: Kind) {
        let f32_out = kind != Kind::Pairs;
        let mut seed = 7u64;
        let mut rand = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        let scale = 0.7f32;
        for (rows, tiles, cols) in [(20usize, 4usize, 33usize), (64, 3, 256), (5, 3, 1)] {
            // logits[tile][key][row]: row 0 jumps by 200 in tile 2 (e^140 would overflow
            // without the redo); in the last column block (so that rows 0-15 take the one-pass
            // path after tile 0), one row is masked in tile 0 and sees keys later, one sees
            // nothing, one has a NaN in tile 1.
            let (late, never, nan_row) = (rows - 3, rows - 2, rows - 1);
            let mut logits = vec![vec![0f32; cols * rows]; tiles];
            for (t, tile) in logits.iter_mut().enumerate() {
                for j in 0..cols {
                    for r in 0..rows {
                        let mut x = 6.0 * rand();
                        if r == 0 && t >= 2 {
                            x += 200.0;
                        }
                        if (r == late && t == 0) || r == never {
                            x = f32::NEG_INFINITY;
                        }
                        if r == nan_row && t == 1 && j == 0 {
                            x = f32::NAN;
                        }
                        tile[j * rows + r] = x;
                    }
                }
            }
            let v: Vec<Vec<f64>> = (0..tiles).map(|_| (0..cols).map(|_| rand() as f64).collect()).collect();
            let (mut max, mut sum, mut corr) = (vec![f32::NEG_INFINITY; rows], vec![0f32; rows], vec![0f32; rows]);
            let mut acc = vec![0f64; rows];
            let mut pairs = vec![0u32; cols.div_ceil(2) * rows];
            let mut probs = vec![0f32; cols * rows];
            for t in 0..tiles {
                let state = (&mut max[..], &mut sum[..], &mut corr[..]);
                // SAFETY: the caller checked the CPU's instructions; the slices have the sizes named.
                unsafe {
                    match kind {
                        Kind::F32 => online_softmax_f32(&logits[t], (cols, rows), scale, state, probs.as_mut_ptr()),
                        Kind::F32Avx2 => {
                            online_softmax_f32_avx2(&logits[t], (cols, rows), scale, state, probs.as_mut_ptr())
                        }
                        Kind::Pairs => {
                            online_softmax(&logits[t], (cols, rows), scale, state, ProbsOut::Pairs(pairs.as_mut_ptr()))
                        }
                    }
                };
                for r in 0..rows {
                    let p: f64 = (0..cols)
                        .map(|j| {
                            let pair = pairs[j / 2 * rows + r];
                            let bits = if j % 2 == 0 { pair & 0xffff } else { pair >> 16 };
                            let p = if f32_out { probs[j * rows + r] } else { f32::from_bits(bits << 16) };
                            p as f64 * v[t][j]
                        })
                        .sum();
                    acc[r] = acc[r] * corr[r] as f64 + p;
                }
            }
            for r in 0..rows {
                let all: Vec<(f64, f64)> = (0..tiles)
                    .flat_map(|t| (0..cols).map(move |j| (t, j)))
                    .map(|(t, j)| (scale as f64 * logits[t][j * rows + r] as f64, v[t][j]))
                    .collect();
                let m = all.iter().map(|x| x.0).fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = all.iter().map(|x| (x.0 - m).exp()).sum();
                let want = all.iter().map(|x| (x.0 - m).exp() * x.1).sum::<f64>() / z;
                let got = acc[r] / sum[r] as f64;
                let lse = max[r] as f64 + (sum[r] as f64).ln();
                if r == nan_row {
                    assert!(got.is_nan(), "{rows}x{cols}: the NaN row gave {got}");
                } else if r == never {
                    assert!(sum[r] == 0.0 && max[r] == f32::NEG_INFINITY, "{rows}x{cols}: a row with no key");
                } else {
                    // bf16 P carries 2^-9 relative rounding; f32 P the exp's 1.5e-7.
                    let tol = if f32_out { 1e-5 } else { 1e-2 };
                    assert!((got - want).abs() <= tol * (1.0 + want.abs()), "{rows}x{cols} row {r}: {got} vs {want}");
                    let lse_want = m + z.ln();
                    assert!(
                        (lse - lse_want).abs() <= 1e-5 * (1.0 + lse_want.abs()),
                        "{rows}x{cols} row {r}: lse {lse} vs {lse_want}"
                    );
                }
            }
        }
    }
}
