//! The CPU path's instruction sets, chosen at run time, and the tile product every tile of the
//! forward and backward goes through.
//!
//! [`CpuIsa::active`] is the best set the CPU has (`is_x86_feature_detected!`, never compile
//! flags; AVX-512 BF16 where it pays, see there), chosen by
//! `CANDLE_FLASH_CPU_ISA=portable|avx2|avx512|avx512bf16|amx` (read once; a set the CPU lacks is
//! never used) or, for the calling thread only, by [`with_cpu_isa`] (tests run every path
//! this way). The forward and backward read it once per call, on the
//! calling thread, and hand it to their workers.
//!
//! [`tile_matmul`] is a register-blocked broadcast kernel, `C[m×n] (+)= alpha · A[m×k] ·
//! B[k×n]`: A is any strided view (so Aᵀ of a stored tile costs nothing), B has contiguous rows.
//! Per step of k it loads one row of B as `NV` vectors and broadcasts `MR` elements of A's
//! column, `MR × NV` FMAs on accumulators that stay in registers; nothing is packed. Every
//! attention product is of that form once the operand that is read across its rows (Qᵀ in the
//! forward, Kᵀ and Vᵀ in the backward) is packed once per task or per K tile.

use std::cell::Cell;
use std::sync::OnceLock;

/// An instruction set the CPU kernels can run with, weakest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CpuIsa {
    /// Plain Rust (the compiler's baseline vectorisation): any CPU.
    Portable,
    /// AVX2 + FMA: 8-lane f32 vectors.
    Avx2,
    /// AVX-512 F (with BW/VL for masks): 16-lane f32 vectors.
    Avx512,
    /// AVX-512 with the BF16 dot product (`vdpbf16ps`).
    Avx512Bf16,
    /// AVX-512 BF16 plus Intel AMX tiles (`tdpbf16ps`, [`super::amx`]) for the bf16-pair
    /// products, where the operating system grants the tile state.
    Amx,
}

impl CpuIsa {
    pub const ALL: [CpuIsa; 5] = [CpuIsa::Portable, CpuIsa::Avx2, CpuIsa::Avx512, CpuIsa::Avx512Bf16, CpuIsa::Amx];

    /// Whether bf16 inputs run their products on bf16 pairs (`vdpbf16ps` or AMX tiles).
    pub fn bf16_pairs(self) -> bool {
        self >= CpuIsa::Avx512Bf16
    }

    /// The best set this CPU supports.
    pub fn detected() -> CpuIsa {
        static DETECTED: OnceLock<CpuIsa> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                // F16C with AVX2: every AVX2 CPU has it, and the Llama application's quantized
                // kernels (f16 block scales) need it on the same switch.
                let avx2 = is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c");
                let avx512 = avx2
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl");
                if avx512 && is_x86_feature_detected!("avx512bf16") {
                    return if super::amx::os_grants() { CpuIsa::Amx } else { CpuIsa::Avx512Bf16 };
                }
                if avx512 {
                    return CpuIsa::Avx512;
                }
                if avx2 {
                    return CpuIsa::Avx2;
                }
            }
            CpuIsa::Portable
        })
    }

    /// What the CPU kernels use now on this thread: [`with_cpu_isa`]'s choice inside it, else
    /// the detected set, lowered by `CANDLE_FLASH_CPU_ISA` or by [`CpuIsa::bf16_pairs_pay`].
    pub fn active() -> CpuIsa {
        static FROM_ENV: OnceLock<CpuIsa> = OnceLock::new();
        if let Some(isa) = OVERRIDE.with(Cell::get) {
            return isa;
        }
        *FROM_ENV.get_or_init(|| {
            let detected = CpuIsa::detected();
            // AMX tiles always pay (16x the multiply-adds of `vdpbf16ps` per instruction);
            // `vdpbf16ps` alone only where `bf16_pairs_pay` says so.
            let default = if detected == CpuIsa::Amx || CpuIsa::bf16_pairs_pay() {
                detected
            } else {
                detected.min(CpuIsa::Avx512)
            };
            match std::env::var("CANDLE_FLASH_CPU_ISA").ok().as_deref().map(CpuIsa::parse) {
                Some(Some(wanted)) => wanted.min(detected),
                Some(None) => {
                    eprintln!("candle-flash: CANDLE_FLASH_CPU_ISA must be portable, avx2, avx512, avx512bf16 or amx; using {default:?}");
                    default
                }
                None => default,
            }
        })
    }

    /// Whether bf16 products on `vdpbf16ps` (bf16 pairs, [`CpuIsa::Avx512Bf16`]) beat bf16
    /// widened to f32 for the AVX-512 f32 kernel on this CPU, by vendor: AMD's AVX-512 cores
    /// (Zen 4 and later) issue one 512-bit FMA per cycle over two 256-bit halves, and
    /// `vdpbf16ps` does twice the multiply-adds in the same slot: the bf16 forward measured
    /// 1.45-1.55x the widened one there (bench/NOTES.md, v10). Intel's AVX-512 BF16 server
    /// cores have two 512-bit FMA ports and run `vdpbf16ps` on one of them, so the pair
    /// packing costs more than it saves: 50-110 against 62-137 GFLOP/s on the Xeon measured
    /// (bench/results/cpu-xeon-bf16-paths.txt at commit 24a52c4). Elsewhere `CANDLE_FLASH_CPU_ISA=avx512bf16`
    /// asks for the pairs. (Intel CPUs with AMX run the pairs on AMX tiles, [`CpuIsa::Amx`],
    /// whatever this says.)
    pub fn bf16_pairs_pay() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            // CPUID leaf 0: the vendor string.
            let id = std::arch::x86_64::__cpuid(0);
            let vendor = [id.ebx, id.edx, id.ecx].map(u32::to_le_bytes).concat();
            vendor == b"AuthenticAMD"
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// `portable`, `avx2`, `avx512`, `avx512bf16` or `amx`.
    pub fn parse(name: &str) -> Option<CpuIsa> {
        Some(match name.trim().to_ascii_lowercase().as_str() {
            "portable" => CpuIsa::Portable,
            "avx2" => CpuIsa::Avx2,
            "avx512" | "avx512f" => CpuIsa::Avx512,
            "avx512bf16" | "avx512_bf16" => CpuIsa::Avx512Bf16,
            "amx" => CpuIsa::Amx,
            _ => return None,
        })
    }
}

thread_local! {
    static OVERRIDE: Cell<Option<CpuIsa>> = const { Cell::new(None) };
}

/// The calling thread's [`with_cpu_isa`] choice, for [`with_isa_override`] on a worker thread.
pub(crate) fn isa_override() -> Option<CpuIsa> {
    OVERRIDE.with(Cell::get)
}

/// Runs `f` on this (worker) thread with the override another thread had ([`isa_override`]):
/// a task of [`super::for_each_task`] then sees the [`CpuIsa::active`] of the call that spawned it.
/// The previous value comes back also when `f` unwinds (a pool thread outlives the call).
pub(crate) fn with_isa_override<R>(isa: Option<CpuIsa>, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<CpuIsa>);
    impl Drop for Restore {
        fn drop(&mut self) {
            OVERRIDE.with(|o| o.set(self.0));
        }
    }
    let _restore = Restore(OVERRIDE.with(|o| o.replace(isa)));
    f()
}

/// Runs `f` with the CPU kernels limited to `isa` (or what the CPU has, if less) on this
/// thread, and returns the set actually used with `f`'s result. Calls made inside `f` hand
/// that set to their worker threads.
pub fn with_cpu_isa<R>(isa: CpuIsa, f: impl FnOnce() -> R) -> (CpuIsa, R) {
    let used = isa.min(CpuIsa::detected());
    let before = OVERRIDE.with(|o| o.replace(Some(used)));
    let result = f();
    OVERRIDE.with(|o| o.set(before));
    (used, result)
}

/// Defines `fn name(isa: CpuIsa, args...)` whose body (plain Rust, written to vectorise) is
/// compiled once per instruction set, inside a `#[target_feature]` function, and picked by
/// `isa` at run time: so the exp and the row/column reductions get AVX-512 or AVX2 code where
/// the CPU has it. Inside the body, the const `LANES` is the f32 vector width of that copy (4
/// portable, 8 AVX2, 16 AVX-512) and `FMA` says whether fused multiply-add is available. (A closure passed to a generic `#[target_feature]` runner is not enough:
/// LLVM keeps a large closure out of line, compiled for the baseline, SSE2; measured.)
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name(isa: $crate::cpu::CpuIsa, $($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            #[allow(unused)]
            fn body<const LANES: usize, const FMA: bool>($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
            unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                body::<16, true>($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                body::<8, true>($($arg),*)
            }
            match isa {
                // SAFETY: `isa` never exceeds `CpuIsa::detected()` (see `CpuIsa::active` and
                // `with_cpu_isa`), so the CPU has every feature these functions enable.
                #[cfg(target_arch = "x86_64")]
                $crate::cpu::CpuIsa::Avx512 | $crate::cpu::CpuIsa::Avx512Bf16 | $crate::cpu::CpuIsa::Amx => unsafe { avx512($($arg),*) },
                #[cfg(target_arch = "x86_64")]
                $crate::cpu::CpuIsa::Avx2 => unsafe { avx2($($arg),*) },
                _ => body::<4, false>($($arg),*),
            }
        }
    };
}
pub(crate) use multiversion;

/// A strided matrix view: element (r, c) at `ptr[r * row_stride + c * col_stride]`.
#[derive(Clone, Copy)]
pub(crate) struct MatRef {
    pub ptr: *const f32,
    pub row_stride: isize,
    pub col_stride: isize,
}

impl MatRef {
    /// A row-major matrix whose rows are `row_stride` elements apart.
    pub fn rows(ptr: *const f32, row_stride: usize) -> Self {
        Self { ptr, row_stride: row_stride as isize, col_stride: 1 }
    }
    /// The transpose of the row-major matrix at `ptr`, without moving data.
    pub fn transposed(ptr: *const f32, row_stride: usize) -> Self {
        Self { ptr, row_stride: 1, col_stride: row_stride as isize }
    }
}

/// `c (m×n, rows ldc apart) = [c +] alpha · a (m×k) · b (k×n, rows ldb apart, contiguous)`,
/// single-threaded (the callers are already parallel). With `accumulate == false`, `c` is only
/// written (it may hold anything, NaN included, before).
///
/// # Safety
/// Every pointer must be valid for the extents and strides given, `c` must not overlap `a` or
/// `b`, and `isa` must not exceed [`CpuIsa::detected`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile_matmul(
    isa: CpuIsa,
    (m, n, k): (usize, usize, usize),
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    a: MatRef,
    (b, ldb): (*const f32, usize),
    alpha: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    let out = Out { c, ldc, accumulate, alpha };
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY (both arms): the caller guarantees the pointers and that the CPU has `isa`.
        CpuIsa::Avx512 | CpuIsa::Avx512Bf16 | CpuIsa::Amx => return x86::matmul_avx512((m, n, k), out, a, (b, ldb)),
        CpuIsa::Avx2 => return x86::matmul_avx2((m, n, k), out, a, (b, ldb)),
        CpuIsa::Portable => {}
    }
    let _ = isa;
    matmul::<Portable>((m, n, k), out, a, (b, ldb))
}

/// [`tile_matmul`] on bf16 pairs with f32 accumulation (`vdpbf16ps`): every element of `a`
/// and `b` is a u32 holding two bf16 values (low half first), and `k` counts pairs, so
/// `c[i][j] (+)= alpha · Σ_p (a_lo·b_lo + a_hi·b_hi)` with each product exact in f32 (bf16
/// products fit f32's mantissa). Pad an odd length with a zero half. Returns false, doing
/// nothing, when `isa` has no BF16 dot product (the caller then uses the f32 path).
///
/// # Safety
/// As [`tile_matmul`], with `a` and `b` addressing u32 pairs (passed as f32 bit patterns).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile_matmul_bf16_pairs(
    isa: CpuIsa,
    (m, n, k): (usize, usize, usize),
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    a: MatRef,
    (b, ldb): (*const f32, usize),
    alpha: f32,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if isa == CpuIsa::Amx {
        // SAFETY: the caller guarantees the pointers; `isa` says the OS granted AMX.
        super::amx::matmul_bf16((m, n, k), (c, ldc, accumulate, alpha), a, (b.cast(), ldb));
        return true;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == CpuIsa::Avx512Bf16 {
        if m > 0 && n > 0 {
            // SAFETY: the caller guarantees the pointers; the CPU has AVX-512 BF16 (`isa`).
            x86::matmul_avx512_bf16((m, n, k), Out { c, ldc, accumulate, alpha }, a, (b, ldb));
        }
        return true;
    }
    let _ = (isa, m, n, k, c, ldc, accumulate, a, b, ldb, alpha);
    false
}

/// Two f32 values rounded to bf16 (to nearest, ties to even) and packed as one pair, `lo`
/// in the low half: the operand format of [`tile_matmul_bf16_pairs`]. Values that are already
/// bf16 (widened inputs) are kept exactly.
#[inline(always)]
pub(crate) fn bf16_pair(lo: f32, hi: f32) -> u32 {
    #[inline(always)]
    fn round(x: f32) -> u32 {
        let bits = x.to_bits();
        // Adding 0x7fff plus the lowest kept bit rounds to nearest even; NaN stays NaN
        // (its high mantissa bits are set by every NaN this code sees: quiet NaNs).
        (bits.wrapping_add(0x7fff + ((bits >> 16) & 1))) >> 16
    }
    round(lo) | (round(hi) << 16)
}

/// The transpose of a 16 × 16 block of 4-byte elements: `out[c * ld + r] = rows[r][c]`, in the
/// four shuffle stages of the classic 16 × 16 transpose (pairs of 32-bit, then 64-bit, then
/// 128-bit lanes twice).
///
/// # Safety
/// The CPU has AVX-512 F; each `rows[r]` is valid for 16 reads and `out` for 16 runs of 16
/// writes, `ld` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn transpose16_u32(rows: [*const u32; 16], out: *mut u32, ld: usize) {
    use std::arch::x86_64::*;
    let r: [__m512i; 16] = std::array::from_fn(|i| _mm512_loadu_si512(rows[i].cast()));
    // Stage 1: 32-bit interleave of rows 2k, 2k + 1.
    let t: [__m512i; 16] = std::array::from_fn(|i| {
        let (x, y) = (r[i & !1], r[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_epi32(x, y)
        } else {
            _mm512_unpackhi_epi32(x, y)
        }
    });
    // Stage 2, per group of four: (t0, t2) low and high, then (t1, t3) low and high.
    let u: [__m512i; 16] = std::array::from_fn(|i| {
        let (g, k) = (i / 4 * 4, i % 4);
        let (x, y) = (t[g + k / 2], t[g + k / 2 + 2]);
        if k % 2 == 0 {
            _mm512_unpacklo_epi64(x, y)
        } else {
            _mm512_unpackhi_epi64(x, y)
        }
    });
    // Stage 3, per half of eight: 128-bit lanes 0 and 2 (0x88), then 1 and 3 (0xdd), of rows k
    // and k + 4.
    let v: [__m512i; 16] = std::array::from_fn(|i| {
        let (h, k) = (i / 8 * 8, i % 8);
        let (x, y) = (u[h + k % 4], u[h + k % 4 + 4]);
        if k < 4 {
            _mm512_shuffle_i32x4::<0x88>(x, y)
        } else {
            _mm512_shuffle_i32x4::<0xdd>(x, y)
        }
    });
    // Stage 4: the same across the halves; result i is column i.
    for i in 0..16 {
        let (x, y) = (v[i % 8], v[i % 8 + 8]);
        let col = if i < 8 { _mm512_shuffle_i32x4::<0x88>(x, y) } else { _mm512_shuffle_i32x4::<0xdd>(x, y) };
        _mm512_storeu_si512(out.add(i * ld).cast(), col);
    }
}

/// Where and how a product's result is stored.
#[derive(Clone, Copy)]
struct Out {
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    alpha: f32,
}

/// One instruction set's f32 vectors, as the kernel needs them. `Mask` selects the first
/// lanes of a vector (the last, partial vector of a row).
pub(crate) trait Lanes {
    const LANES: usize;
    /// Rows of A per register block, and vectors of B per row: `MR × NV` accumulators plus
    /// `NV` B vectors and one broadcast fit the register file (16 ymm, 32 zmm).
    const MR: usize;
    const NV: usize;
    type V: Copy;
    type Mask: Copy;
    unsafe fn zero() -> Self::V;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    unsafe fn load_part(p: *const f32, mask: Self::Mask) -> Self::V;
    unsafe fn store_part(p: *mut f32, v: Self::V, mask: Self::Mask);
    /// `a * b + c`
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    /// The first `n` lanes, 1 <= n <= LANES.
    unsafe fn mask(n: usize) -> Self::Mask;
}

/// The portable fallback: 8-lane arrays that the compiler vectorises with what the baseline
/// target has (SSE2 on x86-64).
struct Portable;

impl Lanes for Portable {
    const LANES: usize = 8;
    const MR: usize = 4;
    const NV: usize = 2;
    type V = [f32; 8];
    type Mask = usize;
    #[inline(always)]
    unsafe fn zero() -> Self::V {
        [0.0; 8]
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self::V {
        [x; 8]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        p.cast::<[f32; 8]>().read_unaligned()
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        p.cast::<[f32; 8]>().write_unaligned(v)
    }
    #[inline(always)]
    unsafe fn load_part(p: *const f32, n: usize) -> Self::V {
        let mut v = [0.0; 8];
        v[..n].copy_from_slice(std::slice::from_raw_parts(p, n));
        v
    }
    #[inline(always)]
    unsafe fn store_part(p: *mut f32, v: Self::V, n: usize) {
        std::slice::from_raw_parts_mut(p, n).copy_from_slice(&v[..n])
    }
    #[inline(always)]
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        // Multiply then add (two roundings), like scalar code without FMA hardware.
        std::array::from_fn(|i| a[i] * b[i] + c[i])
    }
    #[inline(always)]
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] * b[i])
    }
    #[inline(always)]
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] + b[i])
    }
    #[inline(always)]
    unsafe fn mask(n: usize) -> usize {
        n
    }
}

/// The whole product: column blocks of `NV` vectors (the last one partial), row blocks of
/// `MR` rows, then 4, 2 and 1 for the rows left over.
#[inline(always)]
unsafe fn matmul<S: Lanes>((m, n, k): (usize, usize, usize), out: Out, a: MatRef, (b, ldb): (*const f32, usize)) {
    let block_cols = S::NV * S::LANES;
    let mut j0 = 0;
    while j0 < n {
        let width = block_cols.min(n - j0);
        let nv = width.div_ceil(S::LANES);
        let last = width - (nv - 1) * S::LANES;
        let mask = S::mask(last);
        let b = b.add(j0);
        let out = Out { c: out.c.add(j0), ..out };
        let mut i0 = 0;
        while i0 < m {
            let rows = m - i0;
            let a_rows = MatRef { ptr: a.ptr.offset(i0 as isize * a.row_stride), ..a };
            let out_rows = Out { c: out.c.add(i0 * out.ldc), ..out };
            let step = if rows >= S::MR {
                S::MR
            } else if rows >= 4 {
                4
            } else if rows >= 2 {
                2
            } else {
                1
            };
            block_dyn::<S>((step, nv, last != S::LANES), k, out_rows, a_rows, (b, ldb), mask);
            i0 += step;
        }
        j0 += width;
    }
}

/// The register-block shapes, from run-time sizes to the const instantiations.
#[inline(always)]
unsafe fn block_dyn<S: Lanes>(
    (rows, nv, partial): (usize, usize, bool),
    k: usize,
    out: Out,
    a: MatRef,
    b: (*const f32, usize),
    mask: S::Mask,
) {
    macro_rules! by_rows {
        ($nv:literal, $partial:literal) => {
            match rows {
                6 => block::<S, 6, $nv, $partial>(k, out, a, b, mask),
                4 => block::<S, 4, $nv, $partial>(k, out, a, b, mask),
                2 => block::<S, 2, $nv, $partial>(k, out, a, b, mask),
                _ => block::<S, 1, $nv, $partial>(k, out, a, b, mask),
            }
        };
    }
    match (nv, partial) {
        (1, false) => by_rows!(1, false),
        (1, true) => by_rows!(1, true),
        (2, false) => by_rows!(2, false),
        (2, true) => by_rows!(2, true),
        (3, false) => by_rows!(3, false),
        (3, true) => by_rows!(3, true),
        (4, false) => by_rows!(4, false),
        _ => by_rows!(4, true),
    }
}

/// `MR` rows × `NV` vectors of C, accumulated over all of k in registers, then stored once.
/// With `PARTIAL`, the last vector covers only the lanes of `mask`.
#[inline(always)]
unsafe fn block<S: Lanes, const MR: usize, const NV: usize, const PARTIAL: bool>(
    k: usize,
    out: Out,
    a: MatRef,
    (b, ldb): (*const f32, usize),
    mask: S::Mask,
) {
    let mut acc = [[S::zero(); NV]; MR];
    let mut a_ptr = a.ptr;
    let mut b_ptr = b;
    for _ in 0..k {
        let mut bv = [S::zero(); NV];
        for (v, bv) in bv.iter_mut().enumerate() {
            let p = b_ptr.add(v * S::LANES);
            *bv = if PARTIAL && v == NV - 1 { S::load_part(p, mask) } else { S::load(p) };
        }
        for (r, acc) in acc.iter_mut().enumerate() {
            let x = S::splat(*a_ptr.offset(r as isize * a.row_stride));
            for (acc, bv) in acc.iter_mut().zip(&bv) {
                *acc = S::fma(x, *bv, *acc);
            }
        }
        a_ptr = a_ptr.offset(a.col_stride);
        b_ptr = b_ptr.add(ldb);
    }
    let alpha = S::splat(out.alpha);
    for (r, acc) in acc.iter().enumerate() {
        for (v, acc) in acc.iter().enumerate() {
            let dst = out.c.add(r * out.ldc + v * S::LANES);
            let mut x = S::mul(*acc, alpha);
            if PARTIAL && v == NV - 1 {
                if out.accumulate {
                    x = S::add(x, S::load_part(dst, mask));
                }
                S::store_part(dst, x, mask);
            } else {
                if out.accumulate {
                    x = S::add(x, S::load(dst));
                }
                S::store(dst, x);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::Avx2;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{matmul, Lanes, MatRef, Out};
    use std::arch::x86_64::*;

    /// 8-lane AVX2 + FMA vectors; 6 × 2 accumulators (the classic 6×16 block).
    pub(crate) struct Avx2;

    impl Lanes for Avx2 {
        const LANES: usize = 8;
        const MR: usize = 6;
        const NV: usize = 2;
        type V = __m256;
        type Mask = __m256i;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m256 {
            _mm256_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            _mm256_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn load_part(p: *const f32, mask: __m256i) -> __m256 {
            _mm256_maskload_ps(p, mask)
        }
        #[inline(always)]
        unsafe fn store_part(p: *mut f32, v: __m256, mask: __m256i) {
            _mm256_maskstore_ps(p, mask, v)
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            _mm256_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            _mm256_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn mask(n: usize) -> __m256i {
            // Lane i is on when i < n (the sign bit of each 32-bit lane selects it).
            let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lanes)
        }
    }

    /// 16-lane AVX-512 vectors; 6 × 4 accumulators (29 of the 32 zmm registers in use).
    pub(super) struct Avx512;

    impl Lanes for Avx512 {
        const LANES: usize = 16;
        const MR: usize = 6;
        const NV: usize = 4;
        type V = __m512;
        type Mask = __mmask16;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            _mm512_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            _mm512_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn load_part(p: *const f32, mask: __mmask16) -> __m512 {
            _mm512_maskz_loadu_ps(mask, p)
        }
        #[inline(always)]
        unsafe fn store_part(p: *mut f32, v: __m512, mask: __mmask16) {
            _mm512_mask_storeu_ps(p, mask, v)
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            _mm512_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            _mm512_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn mask(n: usize) -> __mmask16 {
            ((1u32 << n) - 1) as __mmask16
        }
    }

    /// AVX-512 BF16 on bf16 pairs: `splat` broadcasts a pair's 32 bits, `load` reads 16 pairs,
    /// and the "FMA" is `vdpbf16ps` (two bf16 products per lane added to an f32 accumulator).
    /// The epilogue's `mul`/`add`/stores act on the f32 accumulators as in [`Avx512`].
    pub(super) struct Avx512Bf16Pairs;

    impl Lanes for Avx512Bf16Pairs {
        const LANES: usize = 16;
        const MR: usize = 6;
        const NV: usize = 4;
        type V = __m512;
        type Mask = __mmask16;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            Avx512::zero()
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            Avx512::splat(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            Avx512::load(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            Avx512::store(p, v)
        }
        #[inline(always)]
        unsafe fn load_part(p: *const f32, mask: __mmask16) -> __m512 {
            Avx512::load_part(p, mask)
        }
        #[inline(always)]
        unsafe fn store_part(p: *mut f32, v: __m512, mask: __mmask16) {
            Avx512::store_part(p, v, mask)
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            // SAFETY: __m512 and __m512bh are both 64 bytes of plain bits.
            let a = std::mem::transmute::<__m512, __m512bh>(a);
            let b = std::mem::transmute::<__m512, __m512bh>(b);
            _mm512_dpbf16_ps(c, a, b)
        }
        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            Avx512::mul(a, b)
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            Avx512::add(a, b)
        }
        #[inline(always)]
        unsafe fn mask(n: usize) -> __mmask16 {
            Avx512::mask(n)
        }
    }

    /// # Safety
    /// As `tile_matmul_bf16_pairs`, on a CPU with AVX-512 F, BW, VL and BF16.
    #[target_feature(enable = "avx512bf16,avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(super) unsafe fn matmul_avx512_bf16(dims: (usize, usize, usize), out: Out, a: MatRef, b: (*const f32, usize)) {
        matmul::<Avx512Bf16Pairs>(dims, out, a, b)
    }

    /// # Safety
    /// As `tile_matmul`, on a CPU with AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn matmul_avx2(dims: (usize, usize, usize), out: Out, a: MatRef, b: (*const f32, usize)) {
        matmul::<Avx2>(dims, out, a, b)
    }

    /// # Safety
    /// As `tile_matmul`, on a CPU with AVX-512 F, BW and VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(super) unsafe fn matmul_avx512(dims: (usize, usize, usize), out: Out, a: MatRef, b: (*const f32, usize)) {
        matmul::<Avx512>(dims, out, a, b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every instruction set the CPU has, against an f64 product: shapes that break every
    /// register block (rows 1..=13, columns up to 3 blocks plus a partial vector), strided and
    /// transposed A, accumulate or not, over a NaN-filled C when not accumulating.
    #[test]
    fn tile_matmul_matches_f64() {
        let mut seed = 1u64;
        let mut rand = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        for isa in CpuIsa::ALL.into_iter().filter(|&i| i <= CpuIsa::detected()) {
            for m in [1, 2, 3, 5, 6, 7, 13] {
                for n in [1, 7, 8, 9, 16, 17, 31, 48, 64, 65, 200] {
                    for k in [0, 1, 5, 64] {
                        for (transposed, accumulate) in [(false, false), (true, true), (true, false)] {
                            let (lda, ldb, ldc) = (k + 3, n + 5, n + 2);
                            let a: Vec<f32> = (0..m.max(k) * (lda + m + 3)).map(|_| rand()).collect();
                            let b: Vec<f32> = (0..k * ldb).map(|_| rand()).collect();
                            let c0: Vec<f32> = (0..m * ldc).map(|_| rand()).collect();
                            let a_at =
                                |r: usize, p: usize| if transposed { a[p * (m + 3) + r] } else { a[r * lda + p] };
                            let view = if transposed {
                                MatRef::transposed(a.as_ptr(), m + 3)
                            } else {
                                MatRef::rows(a.as_ptr(), lda)
                            };
                            let mut c = if accumulate { c0.clone() } else { vec![f32::NAN; m * ldc] };
                            // SAFETY: a, b and c hold every element the extents and strides address.
                            unsafe {
                                tile_matmul(
                                    isa,
                                    (m, n, k),
                                    c.as_mut_ptr(),
                                    ldc,
                                    accumulate,
                                    view,
                                    (b.as_ptr(), ldb),
                                    0.5,
                                )
                            };
                            for r in 0..m {
                                for j in 0..n {
                                    let dot: f64 = (0..k).map(|p| a_at(r, p) as f64 * b[p * ldb + j] as f64).sum();
                                    let want = 0.5 * dot + if accumulate { c0[r * ldc + j] as f64 } else { 0.0 };
                                    let got = c[r * ldc + j] as f64;
                                    assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "{isa:?} {m}x{n}x{k} t={transposed} acc={accumulate} ({r},{j}): {got} vs {want}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The AVX-512 block transpose against the definition, through `transpose_rows` (whole
    /// blocks and ragged edges, an output stride wider than the block).
    #[test]
    fn transpose_rows_matches_definition() {
        for (n, d, ld) in [(16usize, 16usize, 16usize), (32, 48, 40), (19, 33, 21), (1, 5, 1), (64, 32, 70)] {
            let src: Vec<u32> = (0..n * d).map(|i| i as u32 * 7 + 3).collect();
            let mut dst = vec![0u32; d * ld];
            crate::cpu::transpose_rows(|p| &src[p * d..(p + 1) * d], (n, d), &mut dst, ld);
            for p in 0..n {
                for c in 0..d {
                    assert_eq!(dst[c * ld + p], src[p * d + c], "{n}x{d} ld {ld} at ({p}, {c})");
                }
            }
        }
    }

    /// The bf16-pair product against f64 products of the same bf16 values (skipped without
    /// AVX-512 BF16): odd lengths padded with a zero half, partial vectors, accumulate.
    #[test]
    fn bf16_pair_matmul_matches_f64() {
        if CpuIsa::detected() < CpuIsa::Avx512Bf16 {
            println!("skipping: this CPU has at most {:?}", CpuIsa::detected());
            return;
        }
        for isa in [CpuIsa::Avx512Bf16, CpuIsa::Amx] {
            if isa > CpuIsa::detected() {
                println!("skipping {isa:?}: this CPU has at most {:?}", CpuIsa::detected());
                continue;
            }
            bf16_pair_matmul_on(isa);
        }
    }

    /// [`bf16_pair_matmul_matches_f64`] on one instruction set: A in rows and transposed,
    /// accumulating or over NaN, alpha 1 (AMX's in-place tiles) and 2; shapes with and without
    /// 16-multiples.
    fn bf16_pair_matmul_on(isa: CpuIsa) {
        let bf = |x: f32| half::bf16::from_f32(x).to_f32();
        let shapes = [
            (1usize, 1usize, 1usize),
            (7, 17, 5),
            (13, 64, 64),
            (6, 70, 33),
            (64, 64, 128),
            (48, 80, 96),
            (33, 47, 70),
        ];
        for (m, n, len) in shapes {
            for (transposed, accumulate, alpha) in
                [(false, true, 2.0f32), (true, true, 1.0), (false, false, 0.5), (true, false, 1.0), (false, true, 1.0)]
            {
                let pairs = len.div_ceil(2);
                let a: Vec<f32> = (0..m * len).map(|i| bf(((i * 37 % 101) as f32 - 50.0) / 25.0)).collect();
                let b: Vec<f32> = (0..len * n).map(|i| bf(((i * 53 % 97) as f32 - 48.0) / 24.0)).collect();
                let at = |r: usize, p: usize| if p < len { a[r * len + p] } else { 0.0 };
                let bt = |p: usize, j: usize| if p < len { b[p * n + j] } else { 0.0 };
                // A as rows of pairs along k (or its transpose: pairs x rows, 3 spare columns);
                // B as pairs of consecutive k rows, 5 spare columns; C with 2 spare columns.
                let (lda_t, ldb, ldc) = (m + 3, n + 5, n + 2);
                let pair = |r: usize, p: usize| bf16_pair(at(r, 2 * p), at(r, 2 * p + 1));
                let a2: Vec<u32> = if transposed {
                    (0..pairs * lda_t).map(|i| if i % lda_t < m { pair(i % lda_t, i / lda_t) } else { 0 }).collect()
                } else {
                    (0..m * pairs).map(|i| pair(i / pairs, i % pairs)).collect()
                };
                let view = if transposed {
                    MatRef::transposed(a2.as_ptr().cast(), lda_t)
                } else {
                    MatRef::rows(a2.as_ptr().cast(), pairs)
                };
                let b2: Vec<u32> = (0..pairs * ldb)
                    .map(|i| {
                        let (p, j) = (i / ldb, i % ldb);
                        if j < n {
                            bf16_pair(bt(2 * p, j), bt(2 * p + 1, j))
                        } else {
                            0
                        }
                    })
                    .collect();
                let c0: Vec<f32> = (0..m * ldc).map(|i| (i % 7) as f32 - 3.0).collect();
                let mut c = if accumulate { c0.clone() } else { vec![f32::NAN; m * ldc] };
                // SAFETY: a2, b2 and c hold every element addressed.
                let done = unsafe {
                    tile_matmul_bf16_pairs(
                        isa,
                        (m, n, pairs),
                        c.as_mut_ptr(),
                        ldc,
                        accumulate,
                        view,
                        (b2.as_ptr().cast(), ldb),
                        alpha,
                    )
                };
                assert!(done);
                for r in 0..m {
                    for j in 0..ldc {
                        let got = c[r * ldc + j] as f64;
                        if j >= n {
                            // Spare columns are never written.
                            assert!(got.is_nan() != accumulate, "{isa:?} wrote spare column {j}");
                            continue;
                        }
                        let dot = (0..len).map(|p| at(r, p) as f64 * bt(p, j) as f64).sum::<f64>();
                        let want = alpha as f64 * dot + if accumulate { c0[r * ldc + j] as f64 } else { 0.0 };
                        assert!(
                            (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{isa:?} {m}x{n}x{len} t={transposed} acc={accumulate} a={alpha} ({r},{j}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
