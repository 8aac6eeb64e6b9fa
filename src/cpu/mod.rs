//! The tiled CPU path: FlashAttention's algorithm (not matmul-softmax-matmul) on f32 tiles.
//!
//! Tiles of [`CpuTiles::q_rows`] query rows meet tiles of [`CpuTiles::k_cols`] key rows; each
//! worker keeps only tile-sized scratch, so memory stays O(N). f16/bf16 rows are widened to f32
//! as tiles and tasks read them (the forward's Q once on entry) and the results narrowed once on
//! exit: all accumulation is f32, as on the GPU. Work is spread over (sequence, head, tile) with
//! rayon; every tile product is [`simd::tile_matmul`], a register-blocked kernel for the
//! instruction set chosen at run time ([`CpuIsa`]), or [`simd::tile_matmul_bf16_pairs`] for bf16
//! on AVX-512 BF16 or AMX tiles, and the exp and reductions are vectorised for the same set (on
//! AVX-512 BF16 CPUs fused into one pass around the products, `fused.rs`). On AMX, bf16 rows are
//! read as they are, never widened.

#[cfg(target_arch = "x86_64")]
mod amx;
mod bwd;
#[cfg(target_arch = "x86_64")]
mod fused;
mod fwd;
mod kv;
pub mod simd;

pub(crate) use bwd::{backward, sink_grads};
pub(crate) use fwd::forward;
pub use simd::{with_cpu_isa, CpuIsa};

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use std::borrow::Cow;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// The CPU tile sizes: the one place they are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuTiles {
    /// Query rows per tile (per worker task in the forward; GQA packs the heads of a group
    /// into these rows).
    pub q_rows: usize,
    /// Query rows per tile when the products run on AMX tiles (bf16 on [`CpuIsa::Amx`]):
    /// larger, because each (query tile, key tile) pair pays fixed costs (tile configuration,
    /// the softmax state, the accumulator's tile loads and stores) that the AMX products no
    /// longer hide (bench/NOTES.md, issue 15 on AMX).
    pub q_rows_amx: usize,
    /// Key rows per tile.
    pub k_cols: usize,
    /// At most this many query tiles per forward task, run together against each K/V tile so
    /// the tile is copied and widened once for all of them (fewer when the call has too few
    /// tiles to give every thread four tasks).
    pub q_tiles_per_task: usize,
    /// The data cache sizes they were chosen for (bytes; 0 where unknown).
    pub l1_bytes: usize,
    pub l2_bytes: usize,
}

impl CpuTiles {
    /// This machine's tiles, chosen once from its cache sizes (read from
    /// /sys/devices/system/cpu/cpu0/cache; 32 KiB L1 and 512 KiB L2 assumed where absent).
    /// `CANDLE_FLASH_CPU_TILES=q,k` overrides them (for measuring alternatives; q sets both
    /// query tile sizes).
    pub fn get() -> CpuTiles {
        static TILES: OnceLock<CpuTiles> = OnceLock::new();
        *TILES.get_or_init(|| {
            let l1 = cache_bytes(1).unwrap_or(0);
            let l2 = cache_bytes(2).unwrap_or(0);
            let mut tiles = CpuTiles::for_caches(l1, l2);
            if let Some((q, k)) = std::env::var("CANDLE_FLASH_CPU_TILES").ok().and_then(|s| {
                let (q, k) = s.split_once(',')?;
                Some((q.trim().parse().ok()?, k.trim().parse().ok()?))
            }) {
                tiles.q_rows = q;
                tiles.q_rows_amx = q;
                tiles.k_cols = k;
            }
            tiles.q_rows = tiles.q_rows.max(1);
            tiles.q_rows_amx = tiles.q_rows_amx.max(1);
            tiles.k_cols = tiles.k_cols.max(1);
            tiles
        })
    }

    /// Query rows per tile for a call whose longest query sequence is `max_q`: the AMX rows
    /// only where the sequences are long enough to keep both the tiles and the threads busy
    /// (at N = 256 the 192-row tiles gave each thread fewer, lopsided tasks: 401 against 431
    /// GFLOP/s forward, 222 against 257 causal, two threads).
    pub fn q_rows_for(&self, amx: bool, max_q: usize) -> usize {
        if amx && max_q > 2 * self.q_rows_amx {
            self.q_rows_amx
        } else {
            self.q_rows
        }
    }

    /// The rule. The kernel's inner loop reads one row of its B operand per step and keeps the
    /// accumulators in registers, so L1 only has to hold a B panel (at most 256 × 64 floats,
    /// 64 KiB, for d = 256; 16 KiB for d = 64); the tiles themselves live in L2. A forward task
    /// touches the K and V tiles (2 · k_cols · d floats), the score tile (k_cols · q_rows) and
    /// Qᵀ and the accumulator (2 · q_rows · d): k_cols is the largest of 64, 128, 256 that keeps
    /// this within half of L2 at d = 128 (the other half: the next tile's K/V and the backward's
    /// extra dK/dV tiles). On the 512 KiB L2 development machine this gives 64 × 128; 64×64,
    /// 96×64, 128×128, 64×256 and 32×128 measured within that (loaded) machine's noise of it
    /// (bench/NOTES.md, issue 15).
    pub fn for_caches(l1_bytes: usize, l2_bytes: usize) -> CpuTiles {
        let (l1, l2) =
            (if l1_bytes == 0 { 32 << 10 } else { l1_bytes }, if l2_bytes == 0 { 512 << 10 } else { l2_bytes });
        let q_rows = 64;
        let d = 128;
        let bytes = |k: usize| 4 * (2 * k * d + k * q_rows + 2 * q_rows * d);
        let k_cols = [256, 128, 64].into_iter().find(|&k| bytes(k) <= l2 / 2).unwrap_or(64);
        // AMX: 192 query rows measured 1.07-1.18x the forward of 64 and 1.07-1.09x the fwd+bwd
        // (N = 1024 / 4096, one thread, Xeon with 2 MiB L2); the tile's scores (192 × 256
        // floats) and pairs still fit L2 with room.
        CpuTiles { q_rows, q_rows_amx: 192, k_cols, q_tiles_per_task: 8, l1_bytes: l1, l2_bytes: l2 }
    }
}

/// Size in bytes of cpu0's level-`level` data (or unified) cache, from sysfs.
fn cache_bytes(level: u32) -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.flatten().find_map(|entry| {
        let read = |name: &str| std::fs::read_to_string(entry.path().join(name)).ok();
        let kind = read("type")?;
        if read("level")?.trim() != level.to_string() || kind.trim() == "Instruction" {
            return None;
        }
        let size = read("size")?;
        let size = size.trim();
        let (digits, unit) = size.split_at(size.find(|c: char| !c.is_ascii_digit()).unwrap_or(size.len()));
        let n: usize = digits.parse().ok()?;
        Some(match unit {
            "K" => n << 10,
            "M" => n << 20,
            _ => n,
        })
    })
}

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
        CpuStorage::BF16(data) => Cow::Owned(match layout.contiguous_offsets() {
            Some((start, end)) => {
                let mut wide = vec![0f32; end - start];
                kv::widen_bf16(CpuIsa::active(), &data[start..end], &mut wide);
                wide
            }
            None => gather(data, layout, bf16::to_f32),
        }),
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

/// Narrows f32 results to the dtype of the inputs, in parts spread over the pool. The serial
/// narrowing of the backward's three outputs ran after its tasks with the other cores idle: bf16
/// backward, B = 1, H = 8, D = 64, 2 threads, from the last task to the return 1.1-2.1 ms -> 0.9-1.4
/// at N = 1024, 4.6-7.9 -> 2.8-4.5 ms at 4096 (the rest is the outputs' page faults).
pub(crate) fn storage_from_f32(data: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(data),
        DType::F16 => CpuStorage::F16(filled_then(data.len(), f16::ZERO, |start, dst| {
            dst.convert_from_f32_slice(&data[start..][..dst.len()])
        })),
        DType::BF16 => {
            let isa = CpuIsa::active();
            CpuStorage::BF16(filled_then(data.len(), bf16::ZERO, |start, dst| {
                narrow_bf16(isa, &data[start..][..dst.len()], dst)
            }))
        }
        dt => bail!("candle-flash: unsupported dtype {dt:?} on cpu"),
    })
}

/// `dst[c * ld + p] = row(p)[c]` for `p < n`, `c < d`: the transpose of `n` rows of `d`
/// values (f32, or bf16 pairs), in blocks of 16 rows × 16 columns, each read and written as whole runs. Writing
/// element by element down the columns (stores a row length apart) cost ~10 cycles an element:
/// 3.5% of the f32 forward at N = 2048 (perf).
pub(crate) fn transpose_rows<'a, T: Copy + Default + 'a>(
    row: impl Fn(usize) -> &'a [T],
    (n, d): (usize, usize),
    dst: &mut [T],
    ld: usize,
) {
    const BLOCK: usize = 16;
    // Whole 16 × 16 blocks of 4-byte elements (f32, bf16 pairs) on AVX-512: 16 loads, 64
    // shuffles, 16 stores (the element-wise block moves below took 15% of a bf16 forward at
    // N = 256, where three transposes run per query tile).
    #[cfg(target_arch = "x86_64")]
    let simd = std::mem::size_of::<T>() == 4 && CpuIsa::detected() >= CpuIsa::Avx512;
    for p0 in (0..n).step_by(BLOCK) {
        let pn = BLOCK.min(n - p0);
        let src: [&[T]; BLOCK] = std::array::from_fn(|u| row(p0 + u.min(pn - 1)));
        for c0 in (0..d).step_by(BLOCK) {
            let cn = BLOCK.min(d - c0);
            #[cfg(target_arch = "x86_64")]
            if simd && pn == BLOCK && cn == BLOCK {
                let rows: [*const u32; BLOCK] = std::array::from_fn(|u| src[u][c0..c0 + BLOCK].as_ptr().cast());
                let out = dst[c0 * ld + p0..(c0 + BLOCK - 1) * ld + p0 + BLOCK].as_mut_ptr().cast::<u32>();
                // SAFETY: the CPU has AVX-512 F (checked above); 16 rows of 16 elements are read
                // from `src` and 16 runs of 16, `ld` apart, written inside the slice just taken.
                unsafe { simd::transpose16_u32(rows, out, ld) };
                continue;
            }
            let mut block = [[T::default(); BLOCK]; BLOCK];
            // Whole blocks with fixed-size copies (inlined as vector moves; a variable-length
            // copy is a memmove call per 16 elements).
            for (dst_row, src) in block.iter_mut().zip(&src).take(pn) {
                if cn == BLOCK {
                    *dst_row = src[c0..c0 + BLOCK].try_into().expect("16 elements");
                } else {
                    dst_row[..cn].copy_from_slice(&src[c0..c0 + cn]);
                }
            }
            for c in 0..cn {
                if pn == BLOCK {
                    let out: &mut [T; BLOCK] =
                        (&mut dst[(c0 + c) * ld + p0..][..BLOCK]).try_into().expect("16 elements");
                    *out = std::array::from_fn(|r| block[r][c]);
                } else {
                    let out = &mut dst[(c0 + c) * ld + p0..][..pn];
                    out.iter_mut().zip(&block).for_each(|(o, r)| *o = r[c]);
                }
            }
        }
    }
}

simd::multiversion! {
    /// f32 → bf16 rounded to nearest even, NaN kept NaN (as `bf16::from_f32`), vectorised:
    /// half's conversion goes element by element (a few percent of a bf16 call at N = 256).
    fn narrow_bf16(src: &[f32], dst: &mut [bf16]) {
        dst.iter_mut().zip(src).for_each(|(o, &x)| {
            let bits = x.to_bits();
            let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
            let quiet_nan = ((bits >> 16) as u16) | 0x40;
            *o = bf16::from_bits(if x.is_nan() { quiet_nan } else { rounded });
        });
    }
}

/// A vector whose elements start on a 64-byte (cache line) boundary: AMX tile rows are 64
/// bytes, and a row that straddles two lines costs two (the forward's products measured ~15%
/// slower when the allocator happened to place their operands off the line).
pub(crate) struct AlignedVec<T> {
    buf: Vec<T>,
    start: usize,
    len: usize,
}

impl<T: Copy + Default> AlignedVec<T> {
    pub fn new(len: usize) -> Self {
        let spare = 64 / std::mem::size_of::<T>().max(1);
        let buf = vec![T::default(); len + spare];
        let start = buf.as_ptr().align_offset(64).min(spare);
        Self { buf, start, len }
    }

    /// The first `len` elements, zeroed (`T::default()`), the vector remade longer first if it
    /// is shorter: a per-thread buffer reused across calls of varying size.
    pub fn zeroed_prefix(&mut self, len: usize) -> &mut [T] {
        if self.len < len {
            *self = Self::new(len);
        }
        let prefix = &mut self[..len];
        prefix.fill(T::default());
        prefix
    }
}

impl<T: Copy + Default> Default for AlignedVec<T> {
    fn default() -> Self {
        Self::new(0)
    }
}

impl<T> std::ops::Deref for AlignedVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl<T> std::ops::DerefMut for AlignedVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

/// A call's output in its final dtype, zero-initialised by the allocator (pages mapped as the
/// tasks first write them, in parallel: no serial fill and no f32 copy narrowed at the end).
/// Tasks write disjoint rows through [`OutPtr`].
pub(crate) enum OutBuf {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl OutBuf {
    pub fn zeroed(dtype: DType, len: usize) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => OutBuf::F32(filled(len, 0f32)),
            DType::F16 => OutBuf::F16(filled(len, f16::ZERO)),
            DType::BF16 => OutBuf::BF16(filled(len, bf16::ZERO)),
            dt => bail!("candle-flash: unsupported dtype {dt:?} on cpu"),
        })
    }

    pub fn ptr(&mut self) -> OutPtr {
        match self {
            OutBuf::F32(v) => OutPtr::F32(v.as_mut_ptr()),
            OutBuf::F16(v) => OutPtr::F16(v.as_mut_ptr()),
            OutBuf::BF16(v) => OutPtr::BF16(v.as_mut_ptr()),
        }
    }

    pub fn into_storage(self) -> CpuStorage {
        match self {
            OutBuf::F32(v) => CpuStorage::F32(v),
            OutBuf::F16(v) => CpuStorage::F16(v),
            OutBuf::BF16(v) => CpuStorage::BF16(v),
        }
    }
}

/// Where the tasks write an [`OutBuf`]'s rows.
#[derive(Clone, Copy)]
pub(crate) enum OutPtr {
    F32(*mut f32),
    F16(*mut f16),
    BF16(*mut bf16),
}

// SAFETY: as `SharedMut`: each task writes a disjoint set of elements.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// `out[offset..offset + src.len()] = scale · src`, narrowed to the buffer's dtype (in one
    /// pass: a scaled copy re-read by the narrowing stalled on store forwarding, ~15% of a
    /// bf16 forward at N = 256).
    ///
    /// # Safety
    /// The range must lie inside the buffer and belong to the calling task alone.
    pub unsafe fn write_scaled(self, isa: CpuIsa, offset: usize, src: &[f32], scale: f32) {
        match self {
            OutPtr::F32(p) => {
                let dst = std::slice::from_raw_parts_mut(p.add(offset), src.len());
                dst.iter_mut().zip(src).for_each(|(o, x)| *o = x * scale);
            }
            #[cfg(target_arch = "x86_64")]
            OutPtr::BF16(p) if isa >= CpuIsa::Avx512Bf16 => fused::narrow_bf16_row(src, scale, p.add(offset).cast()),
            OutPtr::F16(_) | OutPtr::BF16(_) => {
                let mut scaled = [0f32; 64];
                for (j, chunk) in src.chunks(64).enumerate() {
                    let scaled = &mut scaled[..chunk.len()];
                    scaled.iter_mut().zip(chunk).for_each(|(o, x)| *o = x * scale);
                    let at = offset + 64 * j;
                    match self {
                        OutPtr::F16(p) => {
                            std::slice::from_raw_parts_mut(p.add(at), chunk.len()).convert_from_f32_slice(scaled)
                        }
                        OutPtr::BF16(p) => {
                            narrow_bf16(isa, scaled, std::slice::from_raw_parts_mut(p.add(at), chunk.len()))
                        }
                        OutPtr::F32(_) => unreachable!("handled above"),
                    }
                }
            }
        }
    }

    /// `out[offset..offset + len] = 0`.
    ///
    /// # Safety
    /// As [`OutPtr::write_scaled`].
    pub unsafe fn write_zeros(self, offset: usize, len: usize) {
        match self {
            OutPtr::F32(p) => std::slice::from_raw_parts_mut(p.add(offset), len).fill(0.0),
            OutPtr::F16(p) => std::slice::from_raw_parts_mut(p.add(offset), len).fill(f16::ZERO),
            OutPtr::BF16(p) => std::slice::from_raw_parts_mut(p.add(offset), len).fill(bf16::ZERO),
        }
    }
}

/// Runs `task(i)` for every `i` in `0..n`, on the calling thread and `threads − 1` rayon jobs,
/// where `threads` is rayon's thread count (at most `n`): the work of one attention call.
/// (Scratch that tasks need comes per thread from [`with_cached`].)
///
/// Why not `par_iter`: called from outside the pool, `par_iter` parks the caller and wakes the
/// pool's sleeping workers, and in a VM each futex wake-up and the caller's own wake-up at
/// the end cost tens of microseconds (perf: half of a tiny call's time in the scheduler, and a
/// fixed 30-100 µs per call). Here the caller starts on its share at once, so a late worker
/// only shortens the call; the pool sees `threads − 1` jobs, so no more than `threads` threads
/// run. Each participant owns a contiguous range of the tasks (neighbouring tasks share K/V
/// rows, which stay in that core's L2), claims from it in order, and then helps the others
/// through the same atomic cursors, so an unlucky split still ends together.
///
/// Public for candle-flash-llama's CPU kernels (quantized matmuls), which share this pool.
pub fn for_each_task(n: usize, task: impl Fn(usize) + Sync) {
    let threads = rayon::current_num_threads().min(n);
    if threads <= 1 {
        (0..n).for_each(task);
        return;
    }
    let ranges: Vec<(AtomicUsize, usize)> =
        (0..threads).map(|p| (AtomicUsize::new(p * n / threads), (p + 1) * n / threads)).collect();
    let finished = AtomicUsize::new(0);
    /// Counts a task as finished when it returns or unwinds, so the caller's wait below ends.
    struct Finish<'a>(&'a AtomicUsize);
    impl Drop for Finish<'_> {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Release);
        }
    }
    let drain = |me: usize| {
        for (cursor, end) in ranges[me..].iter().chain(&ranges[..me]) {
            loop {
                // (A cursor passes its end at most once per participant: no overflow.)
                let i = cursor.fetch_add(1, Ordering::Relaxed);
                if i >= *end {
                    break;
                }
                let _finish = Finish(&finished);
                task(i);
            }
        }
    };
    let drain = &drain;
    // Tasks that ask CpuIsa::active() see the caller's with_cpu_isa choice on every thread.
    let isa = simd::isa_override();
    rayon::in_place_scope(|scope| {
        for p in 1..threads {
            scope.spawn(move |_| simd::with_isa_override(isa, || drain(p)));
        }
        drain(0);
        // Every task is claimed now; the last few are running elsewhere, each for at most one
        // task's time. Spinning on them beats parking: the scope's own wait would put this
        // thread to sleep and pay a wake-up (tens of µs in a VM) after the last one. Past
        // 100 µs the spin yields, so that an oversubscribed machine (tests in parallel) can run
        // the thread that holds the last task. (Timed, not counted: a `pause` takes from ~10
        // to ~140 cycles depending on the CPU.)
        let start = std::time::Instant::now();
        let mut spins = 0u32;
        while finished.load(Ordering::Acquire) < n {
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) || start.elapsed() < std::time::Duration::from_micros(100) {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    });
}

/// A thread's cached scratch and the key it was made for.
pub(crate) type ScratchSlot<K, S> = std::cell::RefCell<Option<(K, S)>>;

/// Runs `f` with this thread's scratch in `slot` for `key`: made, or remade when the key
/// changed, and kept for the next call when `keep` (callers pass false for scratch too large
/// to hold on to between calls); a fresh one if the slot is in use further up the stack.
/// Allocating per call cost page faults and zeroing (the forward: 10% at N = 1024; the
/// backward: 3% at N = 256, perf).
pub(crate) fn with_cached<K: PartialEq + Copy + 'static, S: 'static, R>(
    slot: &'static std::thread::LocalKey<ScratchSlot<K, S>>,
    key: K,
    keep: bool,
    make: impl FnOnce() -> S,
    f: impl FnOnce(&mut S) -> R,
) -> R {
    slot.with(|cell| match cell.try_borrow_mut() {
        Ok(mut slot) if keep => {
            if slot.as_ref().is_none_or(|(k, _)| *k != key) {
                *slot = Some((key, make()));
            }
            f(&mut slot.as_mut().expect("just filled").1)
        }
        Ok(mut slot) => {
            // (Too large to keep: release the thread's old one as well.)
            *slot = None;
            f(&mut make())
        }
        Err(_) => f(&mut make()),
    })
}

/// `vec![value; len]`, filled by every thread of the pool. A fresh output of a few MB was
/// filled serially before: its memset and its page faults (the allocator hands out fresh pages
/// after each call's frees) ran on the calling thread alone, with the other cores idle, before
/// the tasks started. f32 backward at N = 1024 (B = 1, H = 8, D = 64, 2 threads; three outputs of
/// 2 MB): 2.4-3.1 ms of a ~25 ms call before the first task, 0.2-0.9 ms now.
pub(crate) fn filled<T: Copy + Send + Sync>(len: usize, value: T) -> Vec<T> {
    filled_then(len, value, |_, _| {})
}

/// [`filled`], and `then(start, part)` on each part right after it is filled (on the same thread,
/// while the part is in that core's cache), `start` being the part's first index: the output's
/// fill and what overwrites it in one parallel pass.
pub(crate) fn filled_then<T: Copy + Send + Sync>(
    len: usize,
    value: T,
    then: impl Fn(usize, &mut [T]) + Sync,
) -> Vec<T> {
    // Parts of 256 KB; below four of them a serial pass is cheaper than waking the pool.
    let chunk = (256 << 10) / std::mem::size_of::<T>().max(1);
    if len < 4 * chunk {
        let mut data = vec![value; len];
        then(0, &mut data);
        return data;
    }
    let mut data: Vec<std::mem::MaybeUninit<T>> = Vec::with_capacity(len);
    // SAFETY: MaybeUninit elements need no initialisation.
    unsafe { data.set_len(len) };
    for_each_chunk_mut(&mut data, chunk, |c, part| {
        part.fill(std::mem::MaybeUninit::new(value));
        // SAFETY: every element of the part was just written; MaybeUninit<T> has T's layout.
        let part = unsafe { &mut *(part as *mut [std::mem::MaybeUninit<T>] as *mut [T]) };
        then(c * chunk, part)
    });
    let mut data = std::mem::ManuallyDrop::new(data);
    // SAFETY: every element was written above; MaybeUninit<T> has T's size and alignment, and
    // the allocation is handed over whole (pointer, length, capacity).
    unsafe { Vec::from_raw_parts(data.as_mut_ptr().cast::<T>(), len, data.capacity()) }
}

/// `par_chunks_mut(chunk).enumerate().for_each(f)` through [`for_each_task`]: `f(c, part)` for
/// each `chunk`-long part `c` of `data` (the last one shorter).
///
/// Public for candle-flash-llama's CPU kernels (decode attention, quantized matmuls).
pub fn for_each_chunk_mut<T: Send>(data: &mut [T], chunk: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let (len, chunk) = (data.len(), chunk.max(1));
    let base = SendPtr(data.as_mut_ptr());
    let base = &base;
    for_each_task(len.div_ceil(chunk), |c| {
        let start = c * chunk;
        // SAFETY: the parts are disjoint, lie inside `data` (start < len), and `data` is
        // borrowed mutably for the whole call.
        let part = unsafe { std::slice::from_raw_parts_mut(base.0.add(start), chunk.min(len - start)) };
        f(c, part)
    });
}

/// A pointer handed to the tasks of [`for_each_chunk_mut`], each of which uses its own part.
struct SendPtr<T>(*mut T);
// SAFETY: see `for_each_chunk_mut`: every task touches a disjoint part, T is Send.
unsafe impl<T: Send> Sync for SendPtr<T> {}

/// A raw pointer that rayon tasks may share. Each task writes a disjoint set of elements:
/// the (row, head) slots of its own sequence, head and tile.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut(pub *mut f32);
// SAFETY: only used for writes to disjoint elements, as stated at each use.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

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

simd::multiversion! {
    /// `x ← exp(x - shift)` over a row, returning the row's sum. A polynomial exp (Cody-Waite
    /// reduction, degree-6 Taylor on [-ln2/2, ln2/2], ~2e-7 relative error) that the compiler
    /// vectorises for `isa`. On 64x64 tiles libm's scalar `expf` took longer than one of the
    /// tile's matrix products; this takes about a quarter of that (bench/NOTES.md).
    /// Arguments below -87 (including -inf, i.e. masked keys) give exactly 0.
    pub(crate) fn exp_shifted_sum(row: &mut [f32], shift: f32) -> f32 {
        row.iter_mut().for_each(|x| *x = exp_poly::<FMA>(*x - shift));
        row_sum(row)
    }
}

/// [`exp_shifted_sum`] for [`CpuIsa::active`] (the instruction set of the calling thread:
/// `CANDLE_FLASH_CPU_ISA`, [`with_cpu_isa`] or the detected one, never more than the CPU has):
/// `x ← exp(x - shift)` over a row, returning the row's sum. Public for candle-flash-llama's CPU
/// decode attention (its softmax).
pub fn exp_shifted_sum_active(row: &mut [f32], shift: f32) -> f32 {
    exp_shifted_sum(CpuIsa::active(), row, shift)
}

/// `a * b + c`: one fused instruction where the caller is compiled with FMA (`FMA` is then
/// true, see `simd::multiversion!`), two roundings otherwise (`mul_add` without FMA hardware
/// is a libm call).
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// exp(x) to ~2e-7 relative error: Cody-Waite reduction to r in [-ln2/2, ln2/2], degree-6
/// Taylor polynomial, 2^n from the exponent bits. Below -87 (and -inf) exactly 0.
#[inline(always)]
pub(crate) fn exp_poly<const FMA: bool>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding and subtracting rounds to an integer
    let xc = x.clamp(-87.0, 88.0);
    let shifted = madd::<FMA>(xc, LOG2E, ROUND);
    let n = shifted - ROUND;
    let r = madd::<FMA>(-n, LN2_LO, madd::<FMA>(-n, LN2_HI, xc));
    let p = madd::<FMA>(1.0 / 720.0, r, 1.0 / 120.0);
    let p = madd::<FMA>(p, r, 1.0 / 24.0);
    let p = madd::<FMA>(p, r, 1.0 / 6.0);
    let p = madd::<FMA>(p, r, 0.5);
    let p = madd::<FMA>(p, r, 1.0);
    let p = madd::<FMA>(p, r, 1.0);
    // 2^n straight from the bits of `shifted`, whose low mantissa bits hold n: integer ops only
    // (a float-to-int cast here kept the loop from vectorising).
    let scale = f32::from_bits(shifted.to_bits().wrapping_add(127) << 23);
    // A multiply by 0 or 1 rather than a branch: the loops that call this stay vectorised.
    let keep = if x < -87.0 { 0.0 } else { 1.0 };
    p * scale * keep
}

/// Sum of a row with 8 independent partial sums (vectorisable, unlike a sequential fold).
#[inline(always)]
/// The end of a row's online softmax (running max `max` and sum `sum` of e^(x - max), natural
/// units): the factor that normalises the accumulated output and the row's lse. An attention
/// sink's logit `sink` joins the denominator as one more term without a value (so a row that saw
/// no key, `sum == 0`, gets lse = sink and a zero output). Without a sink and keys: (0, -inf).
pub(crate) fn finish_row(max: f32, sum: f32, sink: Option<f32>) -> (f32, f32) {
    match sink {
        None if sum > 0.0 => (1.0 / sum, max + sum.ln()),
        None => (0.0, f32::NEG_INFINITY),
        Some(s) => {
            // Shift by the larger of the two maxima, so neither exponent overflows.
            let m = if sum > 0.0 { max.max(s) } else { s };
            let kept = if sum > 0.0 { (max - m).exp() } else { 0.0 };
            let l = sum * kept + (s - m).exp();
            (kept / l, m + l.ln())
        }
    }
}

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
/// Public for candle-flash-llama's CPU decode attention (its softmax).
#[inline(always)]
pub fn row_max(row: &[f32]) -> f32 {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every task runs exactly once, and a task that panics reaches the caller (no hang in the
    /// caller's wait): from outside the pool and from inside pools of 1-4 threads, for fewer
    /// tasks than threads, and many more.
    #[test]
    fn for_each_task_runs_every_task_once() {
        let check = |n: usize| {
            let runs: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            for_each_task(n, |i| {
                // uneven tasks, so that participants steal from each other
                if i % 7 == 0 {
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
                runs[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(runs.iter().all(|r| r.load(Ordering::Relaxed) == 1), "n = {n}");
            let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                for_each_task(n, |i| assert!(i != n / 2, "task {i}"));
            }));
            assert_eq!(panicked.is_err(), n > 0, "n = {n}");
        };
        for n in [0, 1, 2, 3, 5, 64, 257] {
            check(n);
            for threads in 1..=4 {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                pool.install(|| check(n));
            }
        }
    }

    /// `filled` gives `vec![value; len]` on both sides of its serial threshold and for a length
    /// that is no multiple of its parts, from outside the pool and from inside pools of 1-3
    /// threads. A NaN fill goes first, so that memory the allocator hands out again is dirty:
    /// a part the zero fill missed would show NaN.
    #[test]
    fn filled_writes_every_element() {
        for threads in [0, 1, 2, 3] {
            let run = || {
                for len in [0, 1, 1000, (1 << 18) - 1, 1 << 18, 3 << 18 | 12345] {
                    let dirty = filled(len, f32::NAN);
                    assert!(dirty.iter().all(|x| x.is_nan()));
                    drop(dirty);
                    let zeros = filled(len, 0f32);
                    assert_eq!(zeros.len(), len);
                    assert!(zeros.iter().all(|x| x.to_bits() == 0), "len {len}");
                    let ones = filled(len, bf16::ONE);
                    assert!(ones.len() == len && ones.iter().all(|x| *x == bf16::ONE), "len {len}");
                }
            };
            if threads == 0 {
                run();
            } else {
                rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(run);
            }
        }
    }

    /// `storage_from_f32` narrows in parts over the pool: every element, bit for bit as half's
    /// scalar conversions, for lengths below and above `filled_then`'s serial threshold (2-byte
    /// elements: 512K) and across its parts, in pools of 1-3 threads.
    #[test]
    fn storage_from_f32_narrows_every_element() {
        let mut state = 0x2545_f491_u32;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state as f32 / u32::MAX as f32 - 0.5) * 1e3
        };
        for threads in [1, 2, 3] {
            rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(|| {
                for len in [0, 1, 777, 1 << 16, (1 << 18) + 12345, 1 << 19, 3 << 19 | 12345] {
                    let x: Vec<f32> = (0..len).map(|_| next()).collect();
                    let CpuStorage::BF16(b) = storage_from_f32(x.clone(), DType::BF16).unwrap() else { panic!() };
                    assert!(
                        b.len() == len && b.iter().zip(&x).all(|(b, x)| b.to_bits() == bf16::from_f32(*x).to_bits())
                    );
                    let CpuStorage::F16(h) = storage_from_f32(x.clone(), DType::F16).unwrap() else { panic!() };
                    assert!(
                        h.len() == len && h.iter().zip(&x).all(|(h, x)| h.to_bits() == f16::from_f32(*x).to_bits())
                    );
                }
            });
        }
    }

    /// The vectorised narrowing agrees with `bf16::from_f32` bit for bit on every ISA:
    /// ties, carries into the exponent, overflow to inf, subnormals, signed zeros, NaN.
    #[test]
    fn narrow_bf16_matches_half() {
        let mut x: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            f32::from_bits(0x3f80_8000), // a tie, rounds to even (down)
            f32::from_bits(0x3f81_8000), // a tie, rounds to even (up)
            f32::from_bits(0x3fff_ffff), // carries into the exponent
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001), // a signalling NaN: stays NaN
            f32::from_bits(0x0000_8001), // subnormal
            f32::MIN_POSITIVE,
        ];
        let mut state = 0x9e37_79b9_u32;
        x.extend((0..1000).map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            f32::from_bits(state)
        }));
        for isa in CpuIsa::ALL.into_iter().filter(|&i| i <= CpuIsa::detected()) {
            let mut got = vec![bf16::ZERO; x.len()];
            narrow_bf16(isa, &x, &mut got);
            for (&v, g) in x.iter().zip(&got) {
                let want = bf16::from_f32(v);
                if v.is_nan() {
                    assert!(g.is_nan(), "{isa:?} {v:e}: {g:?}");
                } else {
                    assert_eq!(g.to_bits(), want.to_bits(), "{isa:?} {v:e}");
                }
            }
        }
    }
}
