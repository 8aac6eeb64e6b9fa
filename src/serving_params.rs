//! Validation of the serving steps around the attention (`fused`: residual add + RMSNorm, SiLU ×
//! up; `paged`: the paged cache writes, plain and with rotary embeddings): the shapes, strides,
//! dtypes and devices their CPU code and CUDA kernels (`kernels/serving/`) rely on. The
//! attention's own validation is `params`.

use crate::params::{check_device_data_env, check_float_dtype, check_same_device};
use candle_core::{bail, DType, Tensor};

/// What [`validate_add_rms_norm`] found: rows and their length, and whether every tensor is
/// contiguous (what the CUDA kernel reads).
#[derive(Clone, Copy, Debug)]
pub struct NormShape {
    pub rows: usize,
    pub n: usize,
    pub contiguous: bool,
}

/// Checks [`crate::fused::add_rms_norm`]: `x` of rank ≥ 1, `residual` (if any) of its shape,
/// `weight` 1-D of its last axis' length, one float dtype and device.
pub fn validate_add_rms_norm(x: &Tensor, residual: Option<&Tensor>, weight: &Tensor) -> candle_core::Result<NormShape> {
    let n = match x.dims().last() {
        Some(&n) if n > 0 => n,
        _ => bail!("candle-flash: rms norm needs a non-empty last axis, x is {:?}", x.dims()),
    };
    check_float_dtype("x", x, true)?;
    for (name, t) in [("residual", residual), ("weight", Some(weight))] {
        let Some(t) = t else { continue };
        check_same_device(name, t, x.device())?;
        if t.dtype() != x.dtype() {
            bail!("candle-flash: {name} has dtype {:?} but x has {:?}", t.dtype(), x.dtype())
        }
    }
    if let Some(r) = residual {
        if r.dims() != x.dims() {
            bail!("candle-flash: residual {:?} and x {:?} differ in shape", r.dims(), x.dims())
        }
    }
    if weight.dims() != [n] {
        bail!("candle-flash: rms norm weight must be [{n}] (x's last axis), got {:?}", weight.dims())
    }
    let contiguous = x.is_contiguous() && weight.is_contiguous() && residual.is_none_or(Tensor::is_contiguous);
    Ok(NormShape { rows: x.elem_count() / n, n, contiguous })
}

/// What [`validate_silu_mul`] found: rows and their length, and whether both inputs are rows of
/// contiguous values at a fixed row stride (what the CUDA kernel reads).
#[derive(Clone, Copy, Debug)]
pub struct SiluMulShape {
    pub rows: usize,
    pub n: usize,
    pub strided_rows: bool,
}

/// Checks [`crate::fused::silu_mul`]: `gate` and `up` of one shape, float dtype and device.
pub fn validate_silu_mul(gate: &Tensor, up: &Tensor) -> candle_core::Result<SiluMulShape> {
    check_float_dtype("gate", gate, true)?;
    check_same_device("up", up, gate.device())?;
    if up.dtype() != gate.dtype() || up.dims() != gate.dims() {
        bail!(
            "candle-flash: silu_mul needs gate and up of one shape and dtype, got {:?} {:?} and {:?} {:?}",
            gate.dims(),
            gate.dtype(),
            up.dims(),
            up.dtype()
        )
    }
    let n = gate.dims().last().copied().unwrap_or(1);
    // Rows of contiguous values at one stride: rank 1, or rank 2 with a unit last stride, or
    // higher ranks whose leading axes merge into rows.
    let rows_ok = |t: &Tensor| -> bool {
        let (d, st) = (t.dims(), t.stride());
        match d.len() {
            0 => false,
            1 => st[0] == 1,
            r => st[r - 1] == 1 && (0..r - 2).all(|i| d[i + 1] == 1 || st[i] == st[i + 1] * d[i + 1]),
        }
    };
    Ok(SiluMulShape { rows: gate.elem_count() / n.max(1), n, strided_rows: n > 0 && rows_ok(gate) && rows_ok(up) })
}

/// What [`validate_rope_cache_write`] found.
#[derive(Clone, Copy, Debug)]
pub struct RopeCacheWriteShape {
    /// Rows (tokens), query heads, KV heads, head dim.
    pub t: usize,
    pub h: usize,
    pub hkv: usize,
    pub d: usize,
    pub cache: CacheWriteShape,
}

/// Checks a fused rotary embedding and paged cache write ([`crate::rope_write_paged_kv`]): q
/// `(T, H, D)`, k and v `(T, Hkv, D)` with their last two axes contiguous (rows may be strided:
/// views of one fused projection), cos and sin `(T, D/2)` contiguous, all of one float dtype and
/// device, D even; the caches and slots as [`validate_cache_write`] checks them.
pub fn validate_rope_cache_write(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    (k_cache, v_cache): (&Tensor, &Tensor),
    slot_mapping: &Tensor,
) -> candle_core::Result<RopeCacheWriteShape> {
    let cache = validate_cache_write(k_cache, v_cache, k, v, slot_mapping)?;
    let (t, hkv, d) = k.dims3()?;
    check_float_dtype("q", q, true)?;
    check_same_device("q", q, k.device())?;
    if q.dtype() != k.dtype() {
        bail!("candle-flash: q has dtype {:?} but k has {:?}", q.dtype(), k.dtype())
    }
    let h = match q.dims() {
        &[qt, h, qd] if qt == t && qd == d => h,
        dims => bail!("candle-flash: q must have shape [{t}, heads, {d}] (k's rows and head dim), got {dims:?}"),
    };
    if d % 2 != 0 {
        bail!("candle-flash: the rotary embedding needs an even head dim, got {d}")
    }
    for (name, x) in [("q", q), ("k", k), ("v", v)] {
        let st = x.stride();
        if st[2] != 1 || (x.dim(1)? > 1 && st[1] != d) {
            bail!("candle-flash: {name}'s heads must be contiguous (strides [_, {d}, 1]), got {st:?}")
        }
    }
    for (name, x) in [("cos", cos), ("sin", sin)] {
        check_same_device(name, x, k.device())?;
        if x.dtype() != k.dtype() || x.dims() != [t, d / 2] {
            bail!(
                "candle-flash: {name} must be [{t}, {}] {:?} (a row per token), got {:?} {:?}",
                d / 2,
                k.dtype(),
                x.dims(),
                x.dtype()
            )
        }
    }
    Ok(RopeCacheWriteShape { t, h, hkv, d, cache })
}

/// What [`validate_cache_write`] found: the cache's slot count and row width (Hkv · D).
#[derive(Clone, Copy, Debug)]
pub struct CacheWriteShape {
    pub slots: usize,
    pub row_len: usize,
}

/// Checks a paged cache write ([`crate::write_paged_kv`]): caches `(num_blocks,
/// page_block_size, Hkv, D)`, contiguous (the write goes through a flat view of their
/// storage), new rows `(N, Hkv, D)` of the caches' dtype and device, and `slot_mapping` `[N]`
/// u32 or i64. Its values (slots below `num_blocks * page_block_size`, or padding: u32::MAX,
/// negative i64) are read on the CPU always, on CUDA only with `CANDLE_FLASH_CHECK_DEVICE_DATA=1`.
pub fn validate_cache_write(
    k_cache: &Tensor,
    v_cache: &Tensor,
    k: &Tensor,
    v: &Tensor,
    slot_mapping: &Tensor,
) -> candle_core::Result<CacheWriteShape> {
    let device = k_cache.device();
    for (name, t) in [("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)] {
        // f64 too: the reference (the tests' ground truth) keeps f64 caches.
        check_float_dtype(name, t, true)?;
        check_same_device(name, t, device)?;
        if t.dtype() != k_cache.dtype() {
            bail!("candle-flash: {name} has dtype {:?} but k_cache has {:?}", t.dtype(), k_cache.dtype())
        }
    }
    for (name, t) in [("k_cache", k_cache), ("v_cache", v_cache)] {
        if t.rank() != 4 {
            bail!(
                "candle-flash: {name} must have rank 4 (num_blocks, page_block_size, heads, head_dim), got {:?}",
                t.dims()
            )
        }
        // A strided cache would be written through a copy, and the write lost.
        if !t.is_contiguous() {
            bail!("candle-flash: {name} must be contiguous to be written in place (strides {:?})", t.stride())
        }
    }
    if v_cache.dims() != k_cache.dims() {
        bail!("candle-flash: k_cache {:?} and v_cache {:?} differ in shape", k_cache.dims(), v_cache.dims())
    }
    let (num_blocks, page, hkv, d) = k_cache.dims4()?;
    let n = slot_mapping.dims().first().copied().unwrap_or(0);
    for (name, t) in [("k", k), ("v", v)] {
        if t.dims() != [n, hkv, d] {
            bail!("candle-flash: {name} must have shape [{n}, {hkv}, {d}] (slot_mapping's rows, the caches' heads and head dim), got {:?}", t.dims())
        }
    }
    check_same_device("slot_mapping", slot_mapping, device)?;
    if slot_mapping.rank() != 1 || !matches!(slot_mapping.dtype(), DType::U32 | DType::I64) {
        bail!(
            "candle-flash: slot_mapping must be a 1-D u32 or i64 tensor, got {:?} {:?}",
            slot_mapping.dtype(),
            slot_mapping.dims()
        )
    }
    let slots = num_blocks * page;
    if slots >= u32::MAX as usize {
        bail!("candle-flash: the cache has {slots} slots, more than u32 slot indices address")
    }
    if !device.is_cuda() || check_device_data_env() {
        let values: Vec<i64> = match slot_mapping.dtype() {
            DType::U32 => {
                slot_mapping.to_vec1::<u32>()?.into_iter().map(|s| if s == u32::MAX { -1 } else { s as i64 }).collect()
            }
            _ => slot_mapping.to_vec1::<i64>()?,
        };
        if let Some(i) = values.iter().position(|&s| s >= slots as i64) {
            bail!(
                "candle-flash: slot_mapping[{i}] = {} is past the cache's {num_blocks} pages of {page} rows ({slots} slots)",
                values[i]
            )
        }
    }
    Ok(CacheWriteShape { slots, row_len: hkv * d })
}
