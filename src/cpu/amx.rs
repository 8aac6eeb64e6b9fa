//! Intel AMX tile products for the bf16-pair operands ([`super::simd::tile_matmul_bf16_pairs`]
//! on [`CpuIsa::Amx`](super::CpuIsa::Amx)).
//!
//! AMX (Sapphire Rapids and later) adds eight tile registers of 16 rows × 64 bytes and
//! `tdpbf16ps`: C (16 × 16 f32) += A (16 × 16 bf16 pairs) · B (16 pair rows × 16 columns), 8192
//! multiply-adds per instruction, 16 times what one `vdpbf16ps` does. Its B operand is the
//! layout the pair kernels already use (rows of pairs along the reduction axis, "VNNI"), and
//! its A operand is rows of pairs: a row-major A is loaded in place, a transposed one (the
//! attention products read Pᵀ and dSᵀ that way) is packed first.
//!
//! The instructions are written with `asm!` (Rust's AMX intrinsics are unstable): the tile
//! registers are not allocated by the compiler, so each block names them, and every block
//! leaves them as the next one expects. Linux hands a process the 8 KiB of tile state only
//! after it asks (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`): [`os_grants`] asks
//! once, and the ISA is not offered without that permission.

use super::simd::MatRef;
use super::AlignedVec;
use std::arch::asm;
use std::cell::RefCell;

/// Whether this process may use AMX: the CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7) and the
/// kernel granted the tile data state (asked once; Linux only).
pub(crate) fn os_grants() -> bool {
    use std::sync::OnceLock;
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| {
        #[cfg(target_os = "linux")]
        {
            // CPUID leaf 7 exists on every CPU that has AVX-512 (the caller's condition).
            let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
            let (amx_bf16, amx_tile) = (leaf7.edx & (1 << 22) != 0, leaf7.edx & (1 << 24) != 0);
            if !(amx_bf16 && amx_tile) {
                return false;
            }
            const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
            const XFEATURE_XTILEDATA: i64 = 18;
            const SYS_ARCH_PRCTL: i64 = 158;
            let ret: i64;
            // SAFETY: arch_prctl only changes this process's permitted xsave features.
            unsafe {
                asm!("syscall", inlateout("rax") SYS_ARCH_PRCTL => ret, in("rdi") ARCH_REQ_XCOMP_PERM,
                     in("rsi") XFEATURE_XTILEDATA, lateout("rcx") _, lateout("r11") _, options(nostack));
            }
            ret == 0
        }
        #[cfg(not(target_os = "linux"))]
        false
    })
}

/// The one tile configuration: palette 1, all eight tiles 16 rows × 64 bytes (tmm0-3: a 2 × 2
/// block of C; tmm4-5: two A tiles; tmm6-7: two B tiles). Edges are zero-padded in memory
/// instead of configured, so the configuration never changes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

const CONFIG: TileConfig = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64; // bytes per row
        c[48 + t] = 16; // rows
        t += 1;
    }
    TileConfig(c)
};

/// Tile side: 16 rows, 16 f32 or 16 bf16 pairs per row.
const T: usize = 16;

macro_rules! tile_load {
    ($tmm:literal, $ptr:expr, $stride_bytes:expr) => {
        asm!(concat!("tileloadd tmm", $tmm, ", [{p} + {s}*1]"), p = in(reg) $ptr, s = in(reg) $stride_bytes, options(nostack, readonly))
    };
}
macro_rules! tile_store {
    ($tmm:literal, $ptr:expr, $stride_bytes:expr) => {
        asm!(concat!("tilestored [{p} + {s}*1], tmm", $tmm), p = in(reg) $ptr, s = in(reg) $stride_bytes, options(nostack))
    };
}
macro_rules! tile_zero {
    ($tmm:literal) => {
        asm!(concat!("tilezero tmm", $tmm), options(nostack, nomem))
    };
}
macro_rules! tile_dp {
    ($c:literal, $a:literal, $b:literal) => {
        asm!(concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b), options(nostack, nomem))
    };
}

thread_local! {
    /// Zero-padded copies of A and B for the calls that need them (transposed A, edges):
    /// per thread, on 64-byte lines, grown to the largest call and reused.
    static PANELS: RefCell<(AlignedVec<u32>, AlignedVec<u32>)> = RefCell::new(Default::default());
}

/// `c (m×n, rows ldc apart) = [c +] alpha · a · b` on bf16 pairs, `k2` pairs deep: `a` is an
/// m × k2 view of u32 pairs, `b` k2 rows of n pairs (`ldb` apart). As
/// [`super::simd::tile_matmul_bf16_pairs`], which calls it for [`CpuIsa::Amx`](super::CpuIsa::Amx).
///
/// # Safety
/// The pointers must be valid for the extents and strides given, `c` must not overlap `a` or
/// `b`, and [`os_grants`] must have returned true (the CPU has AMX and AVX-512).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) unsafe fn matmul_bf16(
    (m, n, k2): (usize, usize, usize),
    (c, ldc, accumulate, alpha): (*mut f32, usize, bool, f32),
    a: MatRef,
    (b, ldb): (*const u32, usize),
) {
    if m == 0 || n == 0 {
        return;
    }
    let (mt, nt, kt) = (m.div_ceil(T), n.div_ceil(T), k2.div_ceil(T));
    let a_in_place = a.col_stride == 1 && m % T == 0 && k2 % T == 0;
    let b_in_place = n % T == 0 && k2 % T == 0;
    PANELS.with(|panels| {
        let mut panels = panels.borrow_mut();
        let (a_panel, b_panel) = &mut *panels;
        // A's tiles: (pointer to tile (0, 0), bytes between rows); tile (i, k) is at
        // `+ i·16 rows + k·16 pairs`.
        let (a_ptr, a_ld) = if a_in_place {
            (a.ptr.cast::<u32>(), a.row_stride as usize)
        } else {
            let ld = kt * T;
            let a_panel = a_panel.zeroed_prefix(mt * T * ld);
            let src = a.ptr.cast::<u32>();
            for r in 0..m {
                let dst = &mut a_panel[r * ld..r * ld + k2];
                for (p, x) in dst.iter_mut().enumerate() {
                    // Unaligned: a bf16 tensor's pairs may start at an odd element.
                    *x = src.offset(r as isize * a.row_stride + p as isize * a.col_stride).read_unaligned();
                }
            }
            (a_panel.as_ptr(), ld)
        };
        let (b_ptr, b_ld) = if b_in_place {
            (b, ldb)
        } else {
            let ld = nt * T;
            let b_panel = b_panel.zeroed_prefix(kt * T * ld);
            for p in 0..k2 {
                // (Byte copies: no alignment assumed.)
                std::ptr::copy_nonoverlapping(
                    b.add(p * ldb).cast::<u8>(),
                    b_panel.as_mut_ptr().add(p * ld).cast::<u8>(),
                    4 * n,
                );
            }
            (b_panel.as_ptr(), ld)
        };
        asm!("ldtilecfg [{0}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly));
        let (a_bytes, b_bytes, c_bytes) = (4 * a_ld, 4 * b_ld, 4 * ldc);
        let a_tile = |i: usize, k: usize| a_ptr.add(i * T * a_ld + k * T);
        let b_tile = |k: usize, j: usize| b_ptr.add(k * T * b_ld + j * T);
        // Full C tiles with alpha 1 are loaded (when accumulating) and stored in place; the
        // others go through a 16 × 16 buffer.
        let direct = alpha == 1.0;
        let full = |i: usize, j: usize| direct && (i + 1) * T <= m && (j + 1) * T <= n;
        let c_tile = |i: usize, j: usize| c.add(i * T * ldc + j * T);
        let mut buf = [[0f32; T]; T];
        let buf_ptr = buf.as_mut_ptr().cast::<f32>();
        // C tile (i, j) from/into accumulator `tmm` (0-3).
        let start = |tmm: u8, i: usize, j: usize| {
            if accumulate && full(i, j) {
                match tmm {
                    0 => tile_load!("0", c_tile(i, j), c_bytes),
                    1 => tile_load!("1", c_tile(i, j), c_bytes),
                    2 => tile_load!("2", c_tile(i, j), c_bytes),
                    _ => tile_load!("3", c_tile(i, j), c_bytes),
                }
            } else {
                match tmm {
                    0 => tile_zero!("0"),
                    1 => tile_zero!("1"),
                    2 => tile_zero!("2"),
                    _ => tile_zero!("3"),
                }
            }
        };
        let finish = |tmm: u8, i: usize, j: usize| {
            let (dst, stride) = if full(i, j) { (c_tile(i, j), c_bytes) } else { (buf_ptr, 4 * T) };
            match tmm {
                0 => tile_store!("0", dst, stride),
                1 => tile_store!("1", dst, stride),
                2 => tile_store!("2", dst, stride),
                _ => tile_store!("3", dst, stride),
            }
            if full(i, j) {
                return;
            }
            let (r0, c0) = (i * T, j * T);
            let (rows, cols) = (T.min(m - r0), T.min(n - c0));
            for r in 0..rows {
                let row = std::slice::from_raw_parts(buf_ptr.add(r * T), cols);
                let dst = std::slice::from_raw_parts_mut(c.add((r0 + r) * ldc + c0), cols);
                if accumulate {
                    dst.iter_mut().zip(row).for_each(|(o, x)| *o += alpha * x);
                } else {
                    dst.iter_mut().zip(row).for_each(|(o, x)| *o = alpha * x);
                }
            }
        };
        // The C tiles of a block present at its edges: (accumulator, row block, column block).
        let block = |two_i: bool, two_j: bool| {
            [(0u8, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
                .into_iter()
                .filter(move |&(_, ii, jj)| (ii == 0 || two_i) && (jj == 0 || two_j))
        };
        if kt <= 2 {
            // Shallow products (Sᵀ = K Qᵀ at d <= 64): a tile load costs about three
            // `tdpbf16ps` here (measured: ~16 ns per 1 KiB tile against 5 ns per product), so
            // B's tiles for two column blocks stay in tmm4-7 while A streams through tmm2/tmm3
            // into C tiles tmm0/tmm1: half a load per product instead of one.
            for j in (0..nt).step_by(2) {
                let two_j = j + 1 < nt;
                tile_load!("4", b_tile(0, j), b_bytes);
                if two_j {
                    tile_load!("5", b_tile(0, j + 1), b_bytes);
                }
                if kt == 2 {
                    tile_load!("6", b_tile(1, j), b_bytes);
                    if two_j {
                        tile_load!("7", b_tile(1, j + 1), b_bytes);
                    }
                }
                for i in 0..mt {
                    block(false, two_j).for_each(|(tmm, _, jj)| start(tmm, i, j + jj));
                    tile_load!("2", a_tile(i, 0), a_bytes);
                    tile_dp!("0", "2", "4");
                    if two_j {
                        tile_dp!("1", "2", "5");
                    }
                    if kt == 2 {
                        tile_load!("3", a_tile(i, 1), a_bytes);
                        tile_dp!("0", "3", "6");
                        if two_j {
                            tile_dp!("1", "3", "7");
                        }
                    }
                    block(false, two_j).for_each(|(tmm, _, jj)| finish(tmm, i, j + jj));
                }
            }
            return;
        }
        // Deeper products: 2 × 2 blocks of C (tmm0-3), two A tiles (tmm4/5) and two B tiles
        // (tmm6/7) per step of 16 pairs: one load per product.
        for i in (0..mt).step_by(2) {
            let two_i = i + 1 < mt;
            for j in (0..nt).step_by(2) {
                let two_j = j + 1 < nt;
                block(two_i, two_j).for_each(|(tmm, ii, jj)| start(tmm, i + ii, j + jj));
                for k in 0..kt {
                    tile_load!("4", a_tile(i, k), a_bytes);
                    tile_load!("6", b_tile(k, j), b_bytes);
                    tile_dp!("0", "4", "6");
                    if two_j {
                        tile_load!("7", b_tile(k, j + 1), b_bytes);
                        tile_dp!("1", "4", "7");
                    }
                    if two_i {
                        tile_load!("5", a_tile(i + 1, k), a_bytes);
                        tile_dp!("2", "5", "6");
                        if two_j {
                            tile_dp!("3", "5", "7");
                        }
                    }
                }
                block(two_i, two_j).for_each(|(tmm, ii, jj)| finish(tmm, i + ii, j + jj));
            }
        }
    });
}
