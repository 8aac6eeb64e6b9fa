//! The tiled CPU path: FlashAttention's algorithm (not matmul-softmax-matmul) on f32 tiles.
//!
//! Tiles of [`Q_TILE`] query rows meet tiles of [`K_TILE`] key rows; each worker keeps only
//! tile-sized scratch, so memory stays O(N). f16/bf16 inputs are widened to f32 once on entry
//! and the results narrowed once on exit: all accumulation is f32, as on the GPU. Work is spread
//! over (sequence, head, tile) with rayon; tile products go through the `gemm` crate, which
//! candle itself uses for its CPU matmul.

mod bwd;
mod fwd;
mod kv;

pub(crate) use bwd::backward;
pub(crate) use fwd::forward;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result};
use half::{bf16, f16};
use std::borrow::Cow;

/// Query rows per tile (per worker task in the forward).
pub const Q_TILE: usize = 64;
/// Key rows per tile. 64x64 score tiles (16 KiB in f32) stay in L1/L2 next to a Q tile.
pub const K_TILE: usize = 64;

/// The tensor's elements in logical (row-major) order as f32: borrowed when the storage is
/// already contiguous f32, converted otherwise.
pub(crate) fn dense_f32<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<Cow<'a, [f32]>> {
    fn gather<T: Copy>(data: &[T], layout: &Layout, to_f32: impl Fn(T) -> f32) -> Vec<f32> {
        match layout.contiguous_offsets() {
            Some((start, end)) => data[start..end].iter().map(|&x| to_f32(x)).collect(),
            None => strided_offsets(layout).map(|i| to_f32(data[i])).collect(),
        }
    }
    Ok(match storage {
        CpuStorage::F32(data) => match layout.contiguous_offsets() {
            Some((start, end)) => Cow::Borrowed(&data[start..end]),
            None => Cow::Owned(gather(data, layout, |x| x)),
        },
        CpuStorage::F16(data) => Cow::Owned(gather(data, layout, f16::to_f32)),
        CpuStorage::BF16(data) => Cow::Owned(gather(data, layout, bf16::to_f32)),
        other => bail!("candle-flash: unsupported dtype {:?} on cpu", other.dtype()),
    })
}

/// Storage offsets of a strided layout's elements in logical (row-major) order.
fn strided_offsets(layout: &Layout) -> impl Iterator<Item = usize> + '_ {
    let (dims, strides) = (layout.dims(), layout.stride());
    let mut index = vec![0usize; dims.len()];
    let mut offset = layout.start_offset();
    (0..layout.shape().elem_count()).map(move |_| {
        let current = offset;
        // Advance the multi-index like an odometer, last axis fastest.
        for axis in (0..dims.len()).rev() {
            index[axis] += 1;
            offset += strides[axis];
            if index[axis] < dims[axis] {
                break;
            }
            offset -= strides[axis] * dims[axis];
            index[axis] = 0;
        }
        current
    })
}

/// Narrows f32 results to the dtype of the inputs.
pub(crate) fn storage_from_f32(data: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(data),
        DType::F16 => CpuStorage::F16(data.into_iter().map(f16::from_f32).collect()),
        DType::BF16 => CpuStorage::BF16(data.into_iter().map(bf16::from_f32).collect()),
        dt => bail!("candle-flash: unsupported dtype {dt:?} on cpu"),
    })
}

/// A raw pointer that rayon tasks may share. Each task writes a disjoint set of elements:
/// the (row, head) slots of its own sequence, head and tile.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut(pub *mut f32);
// SAFETY: only used for writes to disjoint elements, as stated at each use.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

/// A row-major matrix view: element (r, c) at `ptr[r * row_stride + c * col_stride]`.
#[derive(Clone, Copy)]
pub(crate) struct MatRef {
    pub ptr: *const f32,
    pub row_stride: isize,
    pub col_stride: isize,
}

impl MatRef {
    pub fn rows(ptr: *const f32, row_stride: usize) -> Self {
        Self { ptr, row_stride: row_stride as isize, col_stride: 1 }
    }
    /// The transpose of the row-major matrix at `ptr`, without moving data.
    pub fn transposed(ptr: *const f32, row_stride: usize) -> Self {
        Self { ptr, row_stride: 1, col_stride: row_stride as isize }
    }
}

/// `dst (m×n, row stride dst_rs) = [dst +] beta · a (m×k) · b (k×n)`, single-threaded (the
/// callers are already parallel).
///
/// # Safety
/// Every pointer must be valid for the extents and strides given.
pub(crate) unsafe fn tile_matmul(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_rs: usize,
    accumulate: bool,
    a: MatRef,
    b: MatRef,
    beta: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                std::slice::from_raw_parts_mut(dst.add(r * dst_rs), n).fill(0.0);
            }
        }
        return;
    }
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_rs as isize,
        accumulate,
        a.ptr,
        a.col_stride,
        a.row_stride,
        b.ptr,
        b.col_stride,
        b.row_stride,
        1.0,
        beta,
        false,
        false,
        false,
        gemm::Parallelism::None,
    )
}

/// Turns raw q·k products of one row into logits: scale, softcap, ALiBi, and -inf outside
/// the visible key range `[lo, hi)` (columns are keys `j0..j0 + row.len()`).
#[inline]
pub(crate) fn logits_row(
    row: &mut [f32],
    j0: usize,
    (lo, hi): (usize, usize),
    scale: f32,
    softcap: Option<f32>,
    alibi: Option<(f32, isize)>,
) {
    match softcap {
        None => row.iter_mut().for_each(|x| *x *= scale),
        Some(c) => row.iter_mut().for_each(|x| *x = c * (*x * scale / c).tanh()),
    }
    if let Some((slope, pos)) = alibi {
        for (c, x) in row.iter_mut().enumerate() {
            *x -= slope * (pos - (j0 + c) as isize).unsigned_abs() as f32;
        }
    }
    let n = row.len();
    let vis_lo = lo.saturating_sub(j0).min(n);
    let vis_hi = hi.saturating_sub(j0).min(n).max(vis_lo);
    row[..vis_lo].fill(f32::NEG_INFINITY);
    row[vis_hi..].fill(f32::NEG_INFINITY);
}

/// `x ← exp(x - shift)` over a row, returning the row's sum. A polynomial exp (Cody-Waite
/// reduction, degree-6 Taylor on [-ln2/2, ln2/2], ~2e-7 relative error) that the compiler
/// vectorises (AVX2 when the CPU has it). On 64x64 tiles libm's scalar `expf` took longer than
/// one of the tile's matrix products; this takes about a quarter of that (bench/NOTES.md).
/// Arguments below -87 (including -inf, i.e. masked keys) give exactly 0.
#[inline]
pub(crate) fn exp_shifted_sum(row: &mut [f32], shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA (checked just above).
        unsafe { exp_map_avx2(row, shift) };
        return row_sum(row);
    }
    exp_map(row, shift);
    row_sum(row)
}

#[inline(always)]
fn exp_poly(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding and subtracting rounds to an integer
    let xc = x.clamp(-87.0, 88.0);
    let shifted = xc * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2^n straight from the bits of `shifted`, whose low mantissa bits hold n: integer ops only
    // (a float-to-int cast here kept the loop from vectorising).
    let scale = f32::from_bits(shifted.to_bits().wrapping_add(127) << 23);
    let keep = if x < -87.0 { 0.0 } else { 1.0 };
    p * scale * keep
}

#[inline(always)]
fn exp_map(row: &mut [f32], shift: f32) {
    row.iter_mut().for_each(|x| *x = exp_poly(*x - shift));
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_map_avx2(row: &mut [f32], shift: f32) {
    exp_map(row, shift)
}

/// Sum of a row with 8 independent partial sums (vectorisable, unlike a sequential fold).
#[inline]
pub(crate) fn row_sum(row: &[f32]) -> f32 {
    let mut partial = [0f32; 8];
    let mut chunks = row.chunks_exact(8);
    for chunk in &mut chunks {
        for (acc, x) in partial.iter_mut().zip(chunk) {
            *acc += x;
        }
    }
    chunks.remainder().iter().sum::<f32>() + partial.iter().sum::<f32>()
}

/// Largest element of a row (-inf for an empty or fully masked row), vectorisable.
#[inline]
pub(crate) fn row_max(row: &[f32]) -> f32 {
    let mut partial = [f32::NEG_INFINITY; 8];
    let mut chunks = row.chunks_exact(8);
    for chunk in &mut chunks {
        for (m, x) in partial.iter_mut().zip(chunk) {
            *m = if *x > *m { *x } else { *m };
        }
    }
    let rest = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    partial.iter().fold(rest, |m, &x| if x > m { x } else { m })
}
