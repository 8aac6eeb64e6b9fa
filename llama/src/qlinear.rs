//! Linear layers and embeddings whose weights can stay in their GGUF block-quantized form.
//!
//! Decoding one token multiplies a single activation row by every weight matrix, so its speed is
//! the speed at which the weights stream from memory: Q4_1 weights are 5 bits per value where
//! their f32 dequantization is 32. [`QLinear`] therefore keeps GGUF weights as they are in the
//! file and multiplies with them directly on the CPU:
//!
//! - Q4_1 and Q8_0 (the formats of the default SmolLM2 GGUF) through the kernels of this file:
//!   the activation rows are quantized to 8-bit blocks and each output is an integer dot product
//!   per 32-value block (AVX2 where the CPU has it), split over the rayon threads by weight rows.
//!   candle-core 0.11's own Q4_1 dot product is scalar, and its f32 matmul asks
//!   `get_num_threads()` (which parses /proc/cpuinfo) on every call, hence our own kernels.
//! - Prefill-sized inputs (more than [`SMALL_M`] rows) dequantize the weight a slab of rows at a
//!   time into a reused f32 buffer and run one `gemm` per slab, which is faster than integer dot
//!   products once every weight value is reused by many rows.
//! - Other GGML formats (the K-quants, ...) go through candle's `QMatMul`, which has SIMD kernels
//!   for them.
//!
//! Dense weights (safetensors, or GGUF dequantized on request) keep `candle_nn::Linear`'s
//! semantics; on the CPU in f32 without gradient tracking they skip candle's matmul for the same
//! reasons (our parallel matrix-vector product for few rows, `gemm` with a fixed thread count
//! otherwise).

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{bail, CpuStorage, DType, Device, Module, Result, Storage, Tensor};
use candle_nn::{Linear, VarBuilder};
use half::f16;
use std::collections::HashMap;
use std::sync::Arc;

/// Up to this many activation rows, products use the quantized dot kernels (or, for dense f32
/// weights, the matrix-vector product); above it, `gemm` on dequantized slabs.
pub(crate) const SMALL_M: usize = 4;

/// f32 values of the dequantization buffer for the `gemm` path (4 MB): large enough that a layer
/// of a small model is one slab, small enough that a 49k-row lm_head never exists in f32.
const SLAB_VALUES: usize = 1 << 20;

/// Values per block in every format handled here.
const QK: usize = 32;

/// The block formats the kernels of this file multiply directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockKind {
    /// `d: f16, m: f16, qs: [u8; 16]`; value = d·q + m, q in 0..16, low nibbles are values
    /// 0..16 of the block and high nibbles 16..32.
    Q4_1,
    /// `d: f16, qs: [i8; 32]`; value = d·q.
    Q8_0,
}

impl BlockKind {
    fn bytes(self) -> usize {
        match self {
            BlockKind::Q4_1 => 20,
            BlockKind::Q8_0 => 34,
        }
    }
}

/// A `(rows, cols)` weight in Q4_1 or Q8_0 blocks: row-major (each row is `cols / 32` blocks,
/// as in the file) or, where the CPU has AVX2 and `rows % 8 == 0`, packed by groups of 8 rows
/// (see [`pack8`]), the same bytes reordered so that one 256-bit register holds four values of
/// each of 8 rows.
#[derive(Debug)]
pub struct BlockWeight {
    kind: BlockKind,
    rows: usize,
    cols: usize,
    packed: bool,
    data: Vec<u8>,
}

/// Rows per packed group.
const GROUP: usize = 8;

/// The 8-row interleaved layout of one block of 8 rows (the same bytes as 8 blocks).
///
/// Q4_1: `d[8]: f16`, `m[8]: f16`, then 4 chunks of 32 bytes, chunk `c` holding bytes
/// `4c..4c+4` of each row's `qs` (row `r` at `4r`): low nibbles are values `4c..4c+4`, high
/// nibbles `16+4c..16+4c+4`. Q8_0: `d[8]: f16`, then 8 chunks of 32 bytes, chunk `c` holding
/// values `4c..4c+4` of each row. A 32-bit lane of a chunk is one row, so the integer dot
/// products accumulate per lane against the activation's 4 values broadcast, and the scales of
/// the 8 rows convert with one instruction: the one-row kernel spends most of its time on
/// per-block scalar work (scale conversion, broadcasts, horizontal sums) that this amortizes.
fn pack8(kind: BlockKind, rows: usize, cols: usize, data: &[u8]) -> Vec<u8> {
    let (bb, nb) = (kind.bytes(), cols / QK);
    let mut out = vec![0u8; data.len()];
    for g in 0..rows / GROUP {
        for b in 0..nb {
            let dst = &mut out[(g * nb + b) * GROUP * bb..][..GROUP * bb];
            for r in 0..GROUP {
                let src = &data[((g * GROUP + r) * nb + b) * bb..][..bb];
                dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
                match kind {
                    BlockKind::Q4_1 => {
                        dst[16 + 2 * r..18 + 2 * r].copy_from_slice(&src[2..4]);
                        for c in 0..4 {
                            dst[32 + 32 * c + 4 * r..][..4].copy_from_slice(&src[4 + 4 * c..8 + 4 * c]);
                        }
                    }
                    BlockKind::Q8_0 => {
                        for c in 0..8 {
                            dst[16 + 32 * c + 4 * r..][..4].copy_from_slice(&src[2 + 4 * c..6 + 4 * c]);
                        }
                    }
                }
            }
        }
    }
    out
}

impl BlockWeight {
    fn new(kind: BlockKind, rows: usize, cols: usize, data: Vec<u8>) -> Self {
        #[cfg(target_arch = "x86_64")]
        if has_avx2() && rows.is_multiple_of(GROUP) {
            let data = pack8(kind, rows, cols, &data);
            return Self { kind, rows, cols, packed: true, data };
        }
        Self { kind, rows, cols, packed: false, data }
    }

    /// Row `r` in the file's block layout.
    fn row(&self, r: usize) -> std::borrow::Cow<'_, [u8]> {
        let (bb, nb) = (self.kind.bytes(), self.cols / QK);
        if !self.packed {
            return std::borrow::Cow::Borrowed(&self.data[r * nb * bb..(r + 1) * nb * bb]);
        }
        let (g, i) = (r / GROUP, r % GROUP);
        let mut row = vec![0u8; nb * bb];
        for (b, dst) in row.chunks_exact_mut(bb).enumerate() {
            let src = &self.data[(g * nb + b) * GROUP * bb..][..GROUP * bb];
            dst[0..2].copy_from_slice(&src[2 * i..2 * i + 2]);
            match self.kind {
                BlockKind::Q4_1 => {
                    dst[2..4].copy_from_slice(&src[16 + 2 * i..18 + 2 * i]);
                    for c in 0..4 {
                        dst[4 + 4 * c..8 + 4 * c].copy_from_slice(&src[32 + 32 * c + 4 * i..][..4]);
                    }
                }
                BlockKind::Q8_0 => {
                    for c in 0..8 {
                        dst[2 + 4 * c..6 + 4 * c].copy_from_slice(&src[16 + 32 * c + 4 * i..][..4]);
                    }
                }
            }
        }
        std::borrow::Cow::Owned(row)
    }

    /// `out[j]` = row `r0 + j` · `x`.
    fn dot_rows(&self, r0: usize, x: &[XBlock], out: &mut [f32]) {
        let rb = self.cols / QK * self.kind.bytes();
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if self.packed && r0.is_multiple_of(GROUP) {
            while done + GROUP <= out.len() {
                let group = &self.data[(r0 + done) * rb..(r0 + done + GROUP) * rb];
                // SAFETY: packed weights exist only where the CPU has AVX2 (`new`), and `out`
                // has the 8 values written.
                unsafe {
                    dot8_packed_rows_avx2::<1>(self.kind, group, x, x.len(), out[done..done + GROUP].as_mut_ptr(), 0)
                };
                done += GROUP;
            }
        }
        #[cfg(target_arch = "x86_64")]
        if has_avx2() && !self.packed {
            while done + 4 <= out.len() {
                let rows = &self.data[(r0 + done) * rb..(r0 + done + 4) * rb];
                // SAFETY: the CPU supports the features the function is compiled for.
                let v = unsafe { dot4_avx2(self.kind, rows, rb, x) };
                out[done..done + 4].copy_from_slice(&v);
                done += 4;
            }
        }
        for (j, o) in out.iter_mut().enumerate().skip(done) {
            *o = dot(self.kind, &self.row(r0 + j), x);
        }
    }

    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        dequantize_row(self.kind, &self.row(r), out)
    }
}

/// An activation block: `qs` quantized with scale `d`, and `s = d·Σqs` (what Q4_1's offset `m`
/// multiplies).
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct XBlock {
    qs: [i8; QK],
    d: f32,
    s: f32,
}

#[inline(always)]
fn quantize_row_body(x: &[f32], out: &mut [XBlock]) {
    for (xs, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in b.qs.iter_mut().zip(xs) {
            // `f32::round` (half away from zero) spelled with `trunc`, which vectorizes where
            // `round` is a libm call per value (~6% of a batch-32 decode step in perf). Exact:
            // `y - trunc(y)` has no rounding error.
            let y = v * inv;
            let t = y.trunc();
            *q = (t + if (y - t).abs() >= 0.5 { 1f32.copysign(y) } else { 0.0 }) as i8;
            sum += *q as i32;
        }
        b.d = d;
        b.s = d * sum as f32;
    }
}

/// The same code compiled for AVX2 (256-bit rounding and conversions).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_row_avx2(x: &[f32], out: &mut [XBlock]) {
    quantize_row_body(x, out)
}

/// Activation row `x` as 8-bit blocks (llama.cpp's Q8_1: scale `amax / 127`, values rounded
/// half away from zero).
fn quantize_row(x: &[f32], out: &mut [XBlock]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports the features the function is compiled for.
        return unsafe { quantize_row_avx2(x, out) };
    }
    quantize_row_body(x, out)
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

#[inline(always)]
fn dequantize_row_body(kind: BlockKind, row: &[u8], out: &mut [f32]) {
    match kind {
        BlockKind::Q4_1 => {
            for (b, o) in row.chunks_exact(20).zip(out.chunks_exact_mut(QK)) {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                let (lo, hi) = o.split_at_mut(QK / 2);
                for ((q, l), h) in b[4..20].iter().zip(lo).zip(hi) {
                    *l = (q & 0xF) as f32 * d + m;
                    *h = (q >> 4) as f32 * d + m;
                }
            }
        }
        BlockKind::Q8_0 => {
            for (b, o) in row.chunks_exact(34).zip(out.chunks_exact_mut(QK)) {
                let d = f16_at(b, 0);
                for (q, v) in b[2..34].iter().zip(o) {
                    *v = (*q as i8) as f32 * d;
                }
            }
        }
    }
}

/// The same code compiled for AVX2, so that the compiler vectorizes the unpacking with 256-bit
/// registers (the gemm path dequantizes every weight once per call).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_row_avx2(kind: BlockKind, row: &[u8], out: &mut [f32]) {
    dequantize_row_body(kind, row, out)
}

fn dequantize_row(kind: BlockKind, row: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports the features the function is compiled for.
        return unsafe { dequantize_row_avx2(kind, row, out) };
    }
    dequantize_row_body(kind, row, out)
}

/// Whether the AVX2 kernels run: the one ISA switch (`CpuIsa::active`, so `CANDLE_FLASH_CPU_ISA`
/// and `with_cpu_isa` reach them; its Avx2 level includes FMA and F16C). Weights packed for the
/// AVX2 kernels when they were loaded (`BlockWeight::new`) keep their AVX2 kernel: the CPU has it.
#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    candle_flash::cpu::CpuIsa::active() >= candle_flash::cpu::CpuIsa::Avx2
}

fn dot_scalar(kind: BlockKind, row: &[u8], x: &[XBlock]) -> f32 {
    let mut sum = 0f32;
    match kind {
        BlockKind::Q4_1 => {
            for (b, xb) in row.chunks_exact(20).zip(x) {
                let mut si = 0i32;
                for (j, q) in b[4..20].iter().enumerate() {
                    si += (q & 0xF) as i32 * xb.qs[j] as i32 + (q >> 4) as i32 * xb.qs[j + QK / 2] as i32;
                }
                sum += f16_at(b, 0) * xb.d * si as f32 + f16_at(b, 2) * xb.s;
            }
        }
        BlockKind::Q8_0 => {
            for (b, xb) in row.chunks_exact(34).zip(x) {
                let si: i32 = b[2..34].iter().zip(&xb.qs).map(|(q, y)| (*q as i8) as i32 * *y as i32).sum();
                sum += f16_at(b, 0) * xb.d * si as f32;
            }
        }
    }
    sum
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2(kind: BlockKind, row: &[u8], x: &[XBlock]) -> f32 {
    use std::arch::x86_64::*;
    let nb = x.len().min(row.len() / kind.bytes());
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    let p = row.as_ptr();
    match kind {
        BlockKind::Q4_1 => {
            let nib = _mm_set1_epi8(0xF);
            let mut offsets = 0f32;
            for (i, xb) in x.iter().enumerate().take(nb) {
                let b = p.add(i * 20);
                let d = f16_avx(b);
                let m = f16_avx(b.add(2));
                let q = _mm_loadu_si128(b.add(4) as *const __m128i);
                let w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), nib), _mm_and_si128(q, nib));
                let y = _mm256_load_si256(xb.qs.as_ptr() as *const __m256i);
                // u8 (0..16) x i8 pairs summed to i16 cannot saturate (2·15·127 < 2^15).
                let prod = _mm256_madd_epi16(_mm256_maddubs_epi16(w, y), ones);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), _mm256_cvtepi32_ps(prod), acc);
                offsets += m * xb.s;
            }
            hsum(acc) + offsets
        }
        BlockKind::Q8_0 => {
            for (i, xb) in x.iter().enumerate().take(nb) {
                let b = p.add(i * 34);
                let d = f16_avx(b);
                let w = _mm256_loadu_si256(b.add(2) as *const __m256i);
                let y = _mm256_load_si256(xb.qs.as_ptr() as *const __m256i);
                // maddubs wants one unsigned operand: |w| times y with w's sign moved onto y.
                let prod =
                    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w)), ones);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), _mm256_cvtepi32_ps(prod), acc);
            }
            hsum(acc)
        }
    }
}

/// The f16 at `p` (unaligned) as f32, with the F16C instruction.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_avx(p: *const u8) -> f32 {
    use std::arch::x86_64::*;
    let bits = std::ptr::read_unaligned(p as *const u16);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn hsum(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}

/// Activation rows per call of [`dot8_packed_rows_avx2`]: each weight vector loaded and unpacked
/// once serves this many rows, whose accumulators (two vectors each) still fit in the sixteen
/// AVX2 registers beside the weights.
const ROWS_PER_CALL: usize = 4;

/// 8 packed rows (one group, [`pack8`]) dotted with `R` activation rows (`x` holds them one after
/// the other, `nb` blocks each): `out[r * ldo + j]` = weight row `j` · activation row `r`.
///
/// A 32-bit lane is one weight row, so the integer dot products accumulate per lane against
/// the activation's 4 values broadcast, and the scales of the 8 rows convert with one
/// instruction. Each activation row gets the same operations in the same order whatever `R`
/// (the integer sums are exact, the float steps per block fixed), so a row's result is bitwise
/// the one-row call's (`R = 1`, the decode of one sequence): a sequence decoded in a batch
/// computes what it computes alone.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot8_packed_rows_avx2<const R: usize>(
    kind: BlockKind,
    group: &[u8],
    x: &[XBlock],
    nb: usize,
    out: *mut f32,
    ldo: usize,
) {
    use std::arch::x86_64::*;
    let gb = GROUP * kind.bytes();
    let nb = nb.min(group.len() / gb).min(x.len() / R);
    let p = group.as_ptr();
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    // Unchecked: `nb` is clamped above so that every `r * nb + b` is inside `x` (a bounds check
    // per broadcast cost the one-row decode a few percent).
    let xp = x.as_ptr();
    let x4 = |r: usize, b: usize, c: usize| {
        _mm256_set1_epi32(std::ptr::read_unaligned((*xp.add(r * nb + b)).qs.as_ptr().add(4 * c) as *const i32))
    };
    match kind {
        BlockKind::Q4_1 => {
            let nib = _mm256_set1_epi8(0xF);
            for b in 0..nb {
                let blk = p.add(b * gb);
                let mut s16 = [_mm256_setzero_si256(); R];
                for c in 0..4 {
                    let v = _mm256_loadu_si256(blk.add(32 + 32 * c) as *const __m256i);
                    let lo = _mm256_and_si256(v, nib);
                    let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                    for (r, s) in s16.iter_mut().enumerate() {
                        *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(lo, x4(r, b, c)));
                        *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(hi, x4(r, b, 4 + c)));
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
                let m = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i));
                for (r, (a, s)) in acc.iter_mut().zip(s16).enumerate() {
                    let xb = &*xp.add(r * nb + b);
                    let isum = _mm256_madd_epi16(s, ones);
                    *a = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xb.d)), _mm256_cvtepi32_ps(isum), *a);
                    *a = _mm256_fmadd_ps(m, _mm256_set1_ps(xb.s), *a);
                }
            }
        }
        BlockKind::Q8_0 => {
            for b in 0..nb {
                let blk = p.add(b * gb);
                let mut isum = [_mm256_setzero_si256(); R];
                for c in 0..8 {
                    let v = _mm256_loadu_si256(blk.add(16 + 32 * c) as *const __m256i);
                    let w = _mm256_sign_epi8(v, v);
                    for (r, s) in isum.iter_mut().enumerate() {
                        let prod = _mm256_maddubs_epi16(w, _mm256_sign_epi8(x4(r, b, c), v));
                        *s = _mm256_add_epi32(*s, _mm256_madd_epi16(prod, ones));
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
                for (r, (a, s)) in acc.iter_mut().zip(isum).enumerate() {
                    let xb = &*xp.add(r * nb + b);
                    *a = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xb.d)), _mm256_cvtepi32_ps(s), *a);
                }
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        _mm256_storeu_ps(out.add(r * ldo), *a);
    }
}

/// `x (m, k) · Wᵀ` for m > 1 activation rows (quantized, `nb` blocks each) and weights packed
/// by groups of 8 rows, into `(m, n)`. Parallel over weight rows; each task takes its groups one
/// at a time and runs every activation row against a group while it is in L1, several rows
/// per weight load ([`dot8_packed_rows_avx2`]). Through [`small_m_product`] instead, each
/// activation row re-read the task's whole slice of weights (from L2) and repeated the unpacking:
/// see bench/NOTES.md ("Batched Llama") for the measured difference.
#[cfg(target_arch = "x86_64")]
fn packed_rows_product(w: &BlockWeight, xq: &[XBlock], m: usize) -> Vec<f32> {
    let (n, nb) = (w.rows, w.cols / QK);
    let rb = nb * w.kind.bytes();
    let mut out = vec![0f32; m * n];
    let per = rows_per_task(n);
    let dst = out.as_mut_ptr() as usize;
    candle_flash::cpu::for_each_task(n.div_ceil(per), |c| {
        let r0 = c * per;
        for g in (r0..n.min(r0 + per)).step_by(GROUP) {
            let group = &w.data[g * rb..(g + GROUP) * rb];
            for i0 in (0..m).step_by(ROWS_PER_CALL) {
                let (x, o) = (&xq[i0 * nb..], (dst as *mut f32).wrapping_add(i0 * n + g));
                // SAFETY: packed weights exist only where the CPU has AVX2 (`BlockWeight::new`);
                // `out` is (m, n) and this task alone writes its columns g..g + 8 of rows
                // i0..i0 + R (R <= m - i0), and `out` outlives the parallel section.
                unsafe {
                    match m - i0 {
                        1 => dot8_packed_rows_avx2::<1>(w.kind, group, x, nb, o, n),
                        2 => dot8_packed_rows_avx2::<2>(w.kind, group, x, nb, o, n),
                        3 => dot8_packed_rows_avx2::<3>(w.kind, group, x, nb, o, n),
                        _ => dot8_packed_rows_avx2::<ROWS_PER_CALL>(w.kind, group, x, nb, o, n),
                    }
                }
            }
        }
    });
    out
}

fn dot(kind: BlockKind, row: &[u8], x: &[XBlock]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports the features the function is compiled for.
        return unsafe { dot_avx2(kind, row, x) };
    }
    dot_scalar(kind, row, x)
}

/// Four consecutive weight rows (`rows` holds them, `rb` bytes each) dotted with `x`. One row
/// at a time is bound by the latency of its accumulation chain (about 30 cycles per block);
/// four independent chains that share the activation loads keep the core busy instead.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot4_avx2(kind: BlockKind, rows: &[u8], rb: usize, x: &[XBlock]) -> [f32; 4] {
    use std::arch::x86_64::*;
    let nb = x.len().min(rb / kind.bytes()).min(rows.len() / 4 / kind.bytes());
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut off = [0f32; 4];
    let p = rows.as_ptr();
    match kind {
        BlockKind::Q4_1 => {
            let nib = _mm256_set1_epi8(0xF);
            for (i, xb) in x.iter().enumerate().take(nb) {
                let y = _mm256_load_si256(xb.qs.as_ptr() as *const __m256i);
                for (r, (a, o)) in acc.iter_mut().zip(off.iter_mut()).enumerate() {
                    let b = p.add(r * rb + i * 20);
                    let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(b.add(4) as *const __m128i));
                    // Low lane: the low nibbles (values 0..16); high lane: the high nibbles.
                    let w = _mm256_and_si256(_mm256_blend_epi32(q, _mm256_srli_epi16(q, 4), 0xF0), nib);
                    let prod = _mm256_madd_epi16(_mm256_maddubs_epi16(w, y), ones);
                    *a = _mm256_fmadd_ps(_mm256_set1_ps(f16_avx(b) * xb.d), _mm256_cvtepi32_ps(prod), *a);
                    *o += f16_avx(b.add(2)) * xb.s;
                }
            }
        }
        BlockKind::Q8_0 => {
            for (i, xb) in x.iter().enumerate().take(nb) {
                let y = _mm256_load_si256(xb.qs.as_ptr() as *const __m256i);
                for (r, a) in acc.iter_mut().enumerate() {
                    let b = p.add(r * rb + i * 34);
                    let w = _mm256_loadu_si256(b.add(2) as *const __m256i);
                    let prod =
                        _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w)), ones);
                    *a = _mm256_fmadd_ps(_mm256_set1_ps(f16_avx(b) * xb.d), _mm256_cvtepi32_ps(prod), *a);
                }
            }
        }
    }
    [hsum(acc[0]) + off[0], hsum(acc[1]) + off[1], hsum(acc[2]) + off[2], hsum(acc[3]) + off[3]]
}

#[inline(always)]
fn dot_f32_body(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent partial sums, so that the compiler can keep one vector of them.
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for ((a, x), y) in acc.iter_mut().zip(x).zip(y) {
            *a = x.mul_add(*y, *a);
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_f32_body(a, b)
}

pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports the features the function is compiled for.
        return unsafe { dot_f32_avx2(a, b) };
    }
    dot_f32_body(a, b)
}

/// Weight rows per parallel task of the matrix-vector products: a few tasks per thread so that
/// a core busy with other work does not hold the product back, but not so many that the
/// scheduling costs more than the rows.
fn rows_per_task(n: usize) -> usize {
    // A multiple of the 8-row groups of the packed kernels.
    (n / (rayon::current_num_threads() * 4)).max(16).next_multiple_of(GROUP)
}

/// `dst (m, n) = x (m, k) · Wᵀ` for few rows `m`, `fill(r0, i, out)` writing the dot products of
/// weight rows `r0..r0 + out.len()` with activation row `i`: parallel over weight rows, each
/// task's rows read from memory once and then from cache for the other activation rows.
fn small_m_product(m: usize, n: usize, fill: impl Fn(usize, usize, &mut [f32]) + Sync) -> Vec<f32> {
    if m == 0 || n == 0 {
        return vec![];
    }
    let per = rows_per_task(n);
    if m == 1 {
        let mut out = vec![0f32; n];
        candle_flash::cpu::for_each_chunk_mut(&mut out, per, |c, o| fill(c * per, 0, o));
        return out;
    }
    let mut out_t = vec![0f32; n * m]; // (n, m): each task writes a contiguous run
    candle_flash::cpu::for_each_chunk_mut(&mut out_t, per * m, |c, chunk| {
        let mut tmp = vec![0f32; chunk.len() / m];
        for i in 0..m {
            fill(c * per, i, &mut tmp);
            for (j, v) in tmp.iter().enumerate() {
                chunk[j * m + i] = *v;
            }
        }
    });
    let mut out = vec![0f32; m * n];
    for (r, o) in out_t.chunks_exact(m).enumerate() {
        for (i, v) in o.iter().enumerate() {
            out[i * n + r] = *v;
        }
    }
    out
}

thread_local! {
    /// Each thread's dequantization buffer for the gemm path, kept between calls (at most
    /// SLAB_VALUES f32).
    static SLAB: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `dst (m, n) = x (m, k) · w (n, k)ᵀ` with `gemm`, on all rayon threads when `parallel`.
///
/// # Safety
/// `x` holds (m, k) and `w` (n, k) row-major; `dst` is valid for m rows of stride `dst_rs >= n`.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_xwt(m: usize, n: usize, k: usize, x: &[f32], w: &[f32], dst: *mut f32, dst_rs: usize, parallel: bool) {
    let threads = rayon::current_num_threads();
    let par = if parallel && threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: w (n, k) row-major is read as its transpose (k, n) with column stride k; the rest
    // is the caller's contract.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

/// The contiguous f32 data of a CPU tensor, or None (other device, dtype or a strided layout).
fn with_cpu_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Option<R> {
    let (storage, layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Some(f(&v[a..b])),
        _ => None,
    }
}

#[derive(Clone, Debug)]
enum Inner {
    Dense(Linear),
    Blocks(Arc<BlockWeight>),
    Candle(Arc<QMatMul>, (usize, usize)),
}

/// A bias-free linear layer `y = x·Wᵀ` with `W (out, in)` dense or block-quantized (see the
/// module documentation).
#[derive(Clone, Debug)]
pub struct QLinear(Inner);

impl From<Linear> for QLinear {
    fn from(l: Linear) -> Self {
        Self(Inner::Dense(l))
    }
}

impl QLinear {
    /// A quantized weight `(out, in)` kept as it is: Q4_1 and Q8_0 on the CPU use this file's
    /// kernels, other quantized formats candle's `QMatMul`; float formats are dequantized to
    /// `dtype` (on the tensor's device).
    pub fn from_qtensor(w: QTensor, dtype: DType) -> Result<Self> {
        let (rows, cols) = w.shape().dims2()?;
        let kind = match w.dtype() {
            GgmlDType::Q4_1 => Some(BlockKind::Q4_1),
            GgmlDType::Q8_0 => Some(BlockKind::Q8_0),
            _ => None,
        };
        match (kind, w.dtype()) {
            (Some(kind), _) if w.device().is_cpu() && cols > 0 && cols.is_multiple_of(QK) => {
                let data = w.data()?.into_owned();
                if data.len() != rows * cols / QK * kind.bytes() {
                    bail!("quantized weight {rows}x{cols}: {} bytes of {kind:?} blocks", data.len())
                }
                Ok(Self(Inner::Blocks(Arc::new(BlockWeight::new(kind, rows, cols, data)))))
            }
            (_, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) => {
                let dev = w.device();
                Ok(Self(Inner::Dense(Linear::new(w.dequantize(&dev)?.to_dtype(dtype)?, None))))
            }
            _ => Ok(Self(Inner::Candle(Arc::new(QMatMul::from_qtensor(w)?), (rows, cols)))),
        }
    }

    /// `(out, in)`.
    pub fn dims(&self) -> Result<(usize, usize)> {
        match &self.0 {
            Inner::Dense(l) => l.weight().dims2(),
            Inner::Blocks(b) => Ok((b.rows, b.cols)),
            Inner::Candle(_, d) => Ok(*d),
        }
    }

    /// Whether the weight is kept quantized (false for dense weights).
    pub fn is_quantized(&self) -> bool {
        !matches!(self.0, Inner::Dense(_))
    }

    /// Rows `(out, in)` concatenated: `[a; b; ...]` (for fusing projections that read the same
    /// input). None when the parts do not share one block format or are not all dense.
    pub fn concat_rows(parts: &[&QLinear]) -> Result<Option<QLinear>> {
        let Some(first) = parts.first() else { return Ok(None) };
        match &first.0 {
            Inner::Blocks(b0) => {
                let mut data = Vec::new();
                let mut rows = 0;
                for p in parts {
                    match &p.0 {
                        // Packed groups of 8 rows concatenate as they are.
                        Inner::Blocks(b) if b.kind == b0.kind && b.cols == b0.cols && b.packed == b0.packed => {
                            data.extend_from_slice(&b.data);
                            rows += b.rows;
                        }
                        _ => return Ok(None),
                    }
                }
                let w = BlockWeight { kind: b0.kind, rows, cols: b0.cols, packed: b0.packed, data };
                Ok(Some(Self(Inner::Blocks(Arc::new(w)))))
            }
            Inner::Dense(_) => {
                let mut ws = vec![];
                for p in parts {
                    match &p.0 {
                        Inner::Dense(l) => ws.push(l.weight().clone()),
                        _ => return Ok(None),
                    }
                }
                Ok(Some(Self(Inner::Dense(Linear::new(Tensor::cat(&ws, 0)?, None)))))
            }
            Inner::Candle(..) => Ok(None),
        }
    }

    /// `x (.., in)` → `(.., out)` where the first `few` rows of `x` (its leading dimensions
    /// flattened) take the few-rows kernels whatever their number, and the rest are multiplied as
    /// [`Module::forward`] would multiply them alone. A batch of sequences puts its one-token
    /// decodes first and its prompts after, so that each row gets the arithmetic it would get if
    /// its sequence ran alone (the two paths round differently: the few-rows kernels quantize the
    /// activations to 8 bits) while the decodes still share one pass over the weights. On other
    /// devices and weight kinds, the same as `forward`.
    pub fn forward_split(&self, x: &Tensor, few: usize) -> Result<Tensor> {
        match &self.0 {
            Inner::Dense(l) => match Self::forward_dense_cpu(l.weight(), x, few)? {
                Some(y) => Ok(y),
                None => l.forward(x),
            },
            Inner::Blocks(w) => self.forward_blocks(w, x, few),
            Inner::Candle(q, _) => q.forward(x),
        }
    }

    fn forward_blocks(&self, w: &BlockWeight, x: &Tensor, few: usize) -> Result<Tensor> {
        let (n, k) = (w.rows, w.cols);
        let mut out_dims = x.dims().to_vec();
        match out_dims.last_mut() {
            Some(last) if *last == k => *last = n,
            _ => bail!("quantized linear: input {:?} does not end in {k}", x.dims()),
        }
        let x = x.contiguous()?;
        let out = with_cpu_f32(&x, |xs| {
            let m = xs.len() / k;
            match if m - few.min(m) <= SMALL_M { m } else { few.min(m) } {
                0 => blocks_gemm(w, xs),
                few if few == m => blocks_few_rows(w, xs),
                few => {
                    let mut out = blocks_few_rows(w, &xs[..few * k]);
                    out.extend(blocks_gemm(w, &xs[few * k..]));
                    out
                }
            }
        });
        match out {
            Some(out) => Tensor::from_vec(out, out_dims, &Device::Cpu),
            None => {
                bail!("quantized linear: the input must be f32 on the CPU, got {:?} on {:?}", x.dtype(), x.device())
            }
        }
    }

    /// Dense f32 weights on the CPU without gradient tracking: our products instead of candle's
    /// matmul (see the module documentation), the first `few` rows as in [`Self::forward_split`].
    /// None when that does not apply.
    fn forward_dense_cpu(w: &Tensor, x: &Tensor, few: usize) -> Result<Option<Tensor>> {
        if w.track_op() || x.track_op() || !x.device().is_cpu() || x.dtype() != DType::F32 {
            return Ok(None);
        }
        let (n, k) = w.dims2()?;
        let mut out_dims = x.dims().to_vec();
        match out_dims.last_mut() {
            Some(last) if *last == k && k > 0 => *last = n,
            _ => return Ok(None), // candle reports the shape error (or handles k = 0)
        }
        let x = x.contiguous()?;
        let out = with_cpu_f32(w, |ws| {
            with_cpu_f32(&x, |xs| {
                let m = xs.len() / k;
                let few = if m - few.min(m) <= SMALL_M { m } else { few.min(m) };
                let mut out = small_m_product(few, n, |r0, i, out| {
                    for (j, o) in out.iter_mut().enumerate() {
                        *o = dot_f32(&ws[(r0 + j) * k..(r0 + j + 1) * k], &xs[i * k..(i + 1) * k]);
                    }
                });
                if few < m {
                    out.resize(m * n, 0.0);
                    // SAFETY: xs[few * k..] is (m - few, k), ws (n, k), out[few * n..] (m - few, n).
                    unsafe { gemm_xwt(m - few, n, k, &xs[few * k..], ws, out[few * n..].as_mut_ptr(), n, true) };
                }
                out
            })
        });
        match out.flatten() {
            Some(out) => Ok(Some(Tensor::from_vec(out, out_dims, &Device::Cpu)?)),
            None => Ok(None),
        }
    }
}

/// `x (m, k) · Wᵀ` through the 8-bit activation kernels, for any m (see [`small_m_product`]).
fn blocks_few_rows(w: &BlockWeight, xs: &[f32]) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    let (m, nb) = (xs.len() / k, k / QK);
    let mut xq = vec![XBlock { qs: [0; QK], d: 0.0, s: 0.0 }; m * nb];
    for (row, q) in xs.chunks_exact(k).zip(xq.chunks_exact_mut(nb)) {
        quantize_row(row, q);
    }
    #[cfg(target_arch = "x86_64")]
    if w.packed && m > 1 {
        return packed_rows_product(w, &xq, m);
    }
    small_m_product(m, n, |r0, i, out| w.dot_rows(r0, &xq[i * nb..(i + 1) * nb], out))
}

/// `x (m, k) · Wᵀ` through dequantized slabs and `gemm`.
fn blocks_gemm(w: &BlockWeight, xs: &[f32]) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    let m = xs.len() / k;
    let mut out = vec![0f32; m * n];
    // Each task dequantizes a slab of weight rows into its thread's buffer and multiplies it
    // right away (single-threaded gemm into its own output columns), while the slab is still in
    // cache: one parallel section per product instead of a parallel dequantization followed by a
    // parallel gemm reading it back.
    let per = rows_per_task(n).min((SLAB_VALUES / k).max(GROUP));
    let dst = out.as_mut_ptr() as usize;
    candle_flash::cpu::for_each_task(n.div_ceil(per), |c| {
        let (r0, rows) = (c * per, per.min(n - c * per));
        SLAB.with(|slab| {
            let mut slab = slab.borrow_mut();
            slab.resize(rows * k, 0.0);
            for (j, o) in slab.chunks_exact_mut(k).enumerate() {
                w.dequantize_row(r0 + j, o);
            }
            // SAFETY: `out` is (m, n); this task writes columns r0..r0 + rows of it, which no
            // other task writes, and `out` outlives the parallel section.
            unsafe { gemm_xwt(m, rows, k, xs, &slab, (dst as *mut f32).add(r0), n, false) };
        });
    });
    out
}

impl Module for QLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match &self.0 {
            Inner::Dense(_) | Inner::Blocks(_) => self.forward_split(x, 0),
            Inner::Candle(q, _) => q.forward(x),
        }
    }
}

#[derive(Clone, Debug)]
enum EmbedInner {
    Dense(Tensor),
    Blocks(Arc<BlockWeight>),
    Candle(Arc<QTensor>),
}

/// Token embeddings `(vocab, hidden)`, dense or block-quantized (rows dequantized on lookup);
/// [`QEmbedding::as_linear`] shares the same weight as a tied lm_head.
#[derive(Clone, Debug)]
pub struct QEmbedding {
    inner: EmbedInner,
    hidden: usize,
}

impl QEmbedding {
    pub fn new(weight: Tensor) -> Result<Self> {
        let hidden = weight.dims2()?.1;
        Ok(Self { inner: EmbedInner::Dense(weight), hidden })
    }

    /// From a linear layer built by [`QLinear::from_qtensor`] (the same storage, not a copy).
    pub fn from_linear(l: &QLinear) -> Result<Self> {
        let hidden = l.dims()?.1;
        let inner = match &l.0 {
            Inner::Dense(l) => EmbedInner::Dense(l.weight().clone()),
            Inner::Blocks(b) => EmbedInner::Blocks(b.clone()),
            Inner::Candle(q, _) => match &**q {
                QMatMul::QTensor(t) => EmbedInner::Candle(t.clone()),
                QMatMul::Tensor(t) | QMatMul::TensorF16(t) => EmbedInner::Dense(t.clone()),
            },
        };
        Ok(Self { inner, hidden })
    }

    /// The same weight as a bias-free linear layer `(vocab, hidden)`.
    pub fn as_linear(&self) -> Result<QLinear> {
        Ok(QLinear(match &self.inner {
            EmbedInner::Dense(w) => Inner::Dense(Linear::new(w.clone(), None)),
            EmbedInner::Blocks(b) => Inner::Blocks(b.clone()),
            EmbedInner::Candle(t) => {
                let dims = t.shape().dims2()?;
                Inner::Candle(Arc::new(QMatMul::from_arc(t.clone())?), dims)
            }
        }))
    }

    pub fn hidden_size(&self) -> usize {
        self.hidden
    }

    /// `ids (..)` → `(.., hidden)`. Ids outside the vocabulary are errors.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        match &self.inner {
            EmbedInner::Dense(w) => candle_nn::Embedding::new(w.clone(), self.hidden).forward(ids),
            EmbedInner::Candle(t) => t.embedding(ids),
            EmbedInner::Blocks(w) => {
                let flat = ids.flatten_all()?.to_dtype(DType::U32)?.to_vec1::<u32>()?;
                let mut out = vec![0f32; flat.len() * w.cols];
                for (id, o) in flat.iter().zip(out.chunks_exact_mut(w.cols)) {
                    if *id as usize >= w.rows {
                        bail!("embedding: token id {id} is outside the vocabulary of {}", w.rows)
                    }
                    w.dequantize_row(*id as usize, o);
                }
                let mut dims = ids.dims().to_vec();
                dims.push(w.cols);
                Tensor::from_vec(out, dims, ids.device())
            }
        }
    }
}

/// Where a model's weights come from: a `VarBuilder` (Hugging Face names, dense tensors) and,
/// for a GGUF file kept quantized, the quantized weights by their full Hugging Face name, which
/// take precedence.
#[derive(Clone)]
pub(crate) struct WeightSource<'a> {
    vb: VarBuilder<'a>,
    quant: Option<Arc<HashMap<String, QLinear>>>,
}

impl<'a> WeightSource<'a> {
    pub(crate) fn new(vb: VarBuilder<'a>, quant: Option<Arc<HashMap<String, QLinear>>>) -> Self {
        Self { vb, quant }
    }

    pub(crate) fn pp(&self, s: impl ToString) -> Self {
        Self { vb: self.vb.pp(s), quant: self.quant.clone() }
    }

    pub(crate) fn vb(&self) -> &VarBuilder<'a> {
        &self.vb
    }

    fn quantized(&self, name: &str, (out, inp): (usize, usize)) -> Result<Option<QLinear>> {
        let full = format!("{}.weight", self.vb.pp(name).prefix());
        match self.quant.as_ref().and_then(|m| m.get(&full)) {
            Some(q) if q.dims()? == (out, inp) => Ok(Some(q.clone())),
            Some(q) => bail!("{full}: shape {:?}, expected ({out}, {inp})", q.dims()?),
            None => Ok(None),
        }
    }

    /// `name.weight`, `(out_dim, in_dim)`.
    pub(crate) fn linear(&self, in_dim: usize, out_dim: usize, name: &str) -> Result<QLinear> {
        match self.quantized(name, (out_dim, in_dim))? {
            Some(q) => Ok(q),
            None => Ok(candle_nn::linear_no_bias(in_dim, out_dim, self.vb.pp(name))?.into()),
        }
    }

    /// `name.weight`, `(vocab, hidden)`.
    pub(crate) fn embedding(&self, vocab: usize, hidden: usize, name: &str) -> Result<QEmbedding> {
        match self.quantized(name, (vocab, hidden))? {
            Some(q) => QEmbedding::from_linear(&q),
            None => QEmbedding::new(self.vb.pp(name).get((vocab, hidden), "weight")?),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo_random(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).max(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// The quantized kernels against the dequantized weight through candle's matmul, for the
    /// matrix-vector path (m <= SMALL_M) and the gemm path, and the scalar dot against AVX2, on
    /// each ISA path this CPU has (`with_cpu_isa`).
    #[test]
    fn quantized_products_match_dequantized_matmul() -> Result<()> {
        use candle_flash::cpu::{with_cpu_isa, CpuIsa};
        for isa in [CpuIsa::Portable, CpuIsa::Avx2] {
            if isa > CpuIsa::detected() {
                println!("skipping {isa:?}: this CPU has at most {:?}", CpuIsa::detected());
                continue;
            }
            let (used, r) = with_cpu_isa(isa, quantized_products_on_the_active_isa);
            assert_eq!(used, isa);
            r?;
        }
        Ok(())
    }

    fn quantized_products_on_the_active_isa() -> Result<()> {
        // 72 rows are packed by groups of 8 (on AVX2 CPUs), 70 are not.
        for (n, dtype) in [(72, GgmlDType::Q4_1), (72, GgmlDType::Q8_0), (70, GgmlDType::Q4_1), (70, GgmlDType::Q8_0)] {
            let k = 96;
            let wf = Tensor::from_vec(pseudo_random(n * k, 1), (n, k), &Device::Cpu)?;
            let q = QTensor::quantize(&wf, dtype)?;
            let deq = q.dequantize(&Device::Cpu)?;
            let lin = QLinear::from_qtensor(q, DType::F32)?;
            assert!(lin.is_quantized());
            for m in [1, 3, 9] {
                let x = Tensor::from_vec(pseudo_random(m * k, 2 + m as u32), (1, m, k), &Device::Cpu)?;
                let want = x.broadcast_matmul(&deq.t()?)?;
                let got = lin.forward(&x)?;
                assert_eq!(got.dims(), &[1, m, n]);
                let diff = (got - &want)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                let scale = want.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                // Small m quantizes the activations to 8 bits (relative error ~1/254 per value);
                // the gemm path is exact up to f32 rounding.
                let tol = if m <= SMALL_M { 2e-2 * scale } else { 1e-4 * scale };
                assert!(diff < tol, "{dtype:?} m={m}: diff {diff} (max {scale})");
            }
            if let Inner::Blocks(w) = &lin.0 {
                let mut xq = vec![XBlock { qs: [0; QK], d: 0.0, s: 0.0 }; k / QK];
                quantize_row(&pseudo_random(k, 9), &mut xq);
                for r in 0..n {
                    let (a, b) = (dot(w.kind, &w.row(r), &xq), dot_scalar(w.kind, &w.row(r), &xq));
                    assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{dtype:?} row {r}: {a} vs {b}");
                }
            } else {
                panic!("{dtype:?} is not kept in blocks");
            }
        }
        Ok(())
    }

    /// Rows through the few-rows kernels give bitwise the same values whatever the other rows
    /// (one row alone, or with 1..=12 others: the multi-row packed kernel and its remainders),
    /// and `forward_split` sends the leading rows there and the rest to the gemm path.
    #[test]
    fn few_rows_are_row_independent_and_split() -> Result<()> {
        for (n, dtype) in [(72, GgmlDType::Q4_1), (72, GgmlDType::Q8_0), (70, GgmlDType::Q4_1)] {
            let k = 96;
            let wf = Tensor::from_vec(pseudo_random(n * k, 11), (n, k), &Device::Cpu)?;
            let lin = QLinear::from_qtensor(QTensor::quantize(&wf, dtype)?, DType::F32)?;
            let x = Tensor::from_vec(pseudo_random(13 * k, 12), (13, k), &Device::Cpu)?;
            let alone: Vec<Vec<f32>> =
                (0..13).map(|i| lin.forward(&x.narrow(0, i, 1)?)?.flatten_all()?.to_vec1()).collect::<Result<_>>()?;
            for m in 1..=13 {
                let y = lin.forward_split(&x.narrow(0, 0, m)?, m)?.to_vec2::<f32>()?;
                for (i, row) in y.iter().enumerate() {
                    assert_eq!(row, &alone[i], "{dtype:?} n={n}: row {i} of {m}");
                }
            }
            // 3 leading rows on the few-rows path, 10 on gemm (as forward of those 10 alone).
            let y = lin.forward_split(&x, 3)?;
            let rest = lin.forward(&x.narrow(0, 3, 10)?)?;
            assert_eq!(y.narrow(0, 3, 10)?.to_vec2::<f32>()?, rest.to_vec2::<f32>()?);
            assert_eq!(y.narrow(0, 0, 3)?.to_vec2::<f32>()?, alone[..3].to_vec());
        }
        Ok(())
    }

    /// The vectorizable rounding is `f32::round` on every value the quantization meets,
    /// halfway cases and their neighbours included.
    #[test]
    fn quantized_rounding_is_round_half_away() {
        let mut x: Vec<f32> = pseudo_random(QK * 64, 21).iter().map(|v| v * 5.0).collect();
        // The block's amax is 127 exactly, so that values k + 0.5 stay halfway after scaling.
        for (i, v) in x.iter_mut().enumerate().take(QK) {
            *v = if i == 0 { 127.0 } else { (i as f32 - 16.0) + 0.5 };
        }
        x[QK + 1] = 0.49999997;
        x[QK + 2] = -0.49999997;
        let mut got = vec![XBlock { qs: [0; QK], d: 0.0, s: 0.0 }; 64];
        quantize_row(&x, &mut got);
        for (xs, b) in x.chunks_exact(QK).zip(&got) {
            let inv = if b.d > 0.0 { 1.0 / b.d } else { 0.0 };
            for (v, q) in xs.iter().zip(b.qs) {
                assert_eq!(q, (v * inv).round() as i8, "{v}");
            }
        }
    }

    #[test]
    fn dense_cpu_products_match_candle() -> Result<()> {
        let (n, k) = (33, 40);
        let w = Tensor::from_vec(pseudo_random(n * k, 5), (n, k), &Device::Cpu)?;
        let lin = QLinear::from(Linear::new(w.clone(), None));
        for m in [1, 2, 7] {
            let x = Tensor::from_vec(pseudo_random(m * k, 6), (m, k), &Device::Cpu)?;
            let diff = (lin.forward(&x)? - x.matmul(&w.t()?)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "m={m}: {diff}");
        }
        Ok(())
    }

    #[test]
    fn quantized_embedding_rows_and_errors() -> Result<()> {
        let (v, h) = (10, 64);
        let wf = Tensor::from_vec(pseudo_random(v * h, 3), (v, h), &Device::Cpu)?;
        let q = QTensor::quantize(&wf, GgmlDType::Q8_0)?;
        let deq = q.dequantize(&Device::Cpu)?;
        let emb = QEmbedding::from_linear(&QLinear::from_qtensor(q, DType::F32)?)?;
        let ids = Tensor::new(&[[3u32, 9, 0]], &Device::Cpu)?;
        let got = emb.forward(&ids)?;
        let want = deq.index_select(&ids.flatten_all()?, 0)?.unsqueeze(0)?;
        assert_eq!((got - want)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?, 0.0);
        assert!(emb.forward(&Tensor::new(&[[10u32]], &Device::Cpu)?).is_err());
        let lin = QLinear::from_qtensor(QTensor::quantize(&wf, GgmlDType::Q4_1)?, DType::F32)?;
        assert!(lin.forward(&Tensor::zeros((1, 32), DType::F32, &Device::Cpu)?).is_err());
        // No rows in, no rows out (both the few-rows and the dense path).
        assert_eq!(lin.forward(&Tensor::zeros((0, h), DType::F32, &Device::Cpu)?)?.dims(), &[0, v]);
        let dense = QLinear::from(Linear::new(wf.clone(), None));
        assert_eq!(dense.forward(&Tensor::zeros((2, 0, h), DType::F32, &Device::Cpu)?)?.dims(), &[2, 0, v]);
        Ok(())
    }
}
