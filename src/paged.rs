//! Writing a paged K/V cache: new rows go straight into their pages, in place.

use crate::serving_params::{validate_cache_write, validate_rope_cache_write};
use candle_core::{DType, Result, Tensor};

/// Slot value that marks a row to skip (candle's scatter skips its index type's maximum).
const PADDING_SLOT: u32 = u32::MAX;

/// Writes new K/V rows into their pages, in place, without copying the caches (vLLM's
/// `reshape_and_cache`): row i of `k` and `v` `(N, Hkv, D)` goes to slot `slot_mapping[i] =
/// page * page_block_size + offset` of `k_cache` and `v_cache` `(num_blocks, page_block_size,
/// Hkv, D)`, which must be contiguous. `slot_mapping` is u32 or i64; u32::MAX or a negative
/// i64 marks a padding row, skipped. Two rows for one slot: one of them is written.
///
/// CPU and CUDA (through candle's in-place `scatter_set`). Slot values are checked on the CPU
/// always; on CUDA only with `CANDLE_FLASH_CHECK_DEVICE_DATA=1` (a host synchronisation), and
/// otherwise a slot past the cache is skipped like padding, never written out of bounds.
pub fn write_paged_kv(k_cache: &Tensor, v_cache: &Tensor, k: &Tensor, v: &Tensor, slot_mapping: &Tensor) -> Result<()> {
    let shape = validate_cache_write(k_cache, v_cache, k, v, slot_mapping)?;
    let n = slot_mapping.dim(0)?;
    if n == 0 {
        return Ok(());
    }
    let padding = Tensor::full(PADDING_SLOT, n, slot_mapping.device())?;
    let slots = match slot_mapping.dtype() {
        DType::I64 => slot_mapping.ge(0i64)?.where_cond(&slot_mapping.to_dtype(DType::U32)?, &padding)?,
        _ => slot_mapping.clone(),
    };
    // Tensor ops, not a host check, so that CUDA needs no synchronisation (padding stays
    // padding: u32::MAX is never below the slot count).
    let slots = slots.lt(shape.slots as f64)?.where_cond(&slots, &padding)?;
    // scatter_set takes one index per element written: each row's slot, repeated over the row.
    let index = slots.unsqueeze(1)?.broadcast_as((n, shape.row_len))?.contiguous()?;
    for (cache, rows) in [(k_cache, k), (v_cache, v)] {
        let rows = rows.reshape((n, shape.row_len))?.contiguous()?;
        // The caches are contiguous (validated), so this view shares their storage and
        // the write lands in them.
        cache.reshape((shape.slots, shape.row_len))?.scatter_set(&index, &rows, 0)?;
    }
    Ok(())
}

/// The Llama block's step between its projections and the attention: rotary embeddings on q
/// `(T, H, D)` and k `(T, Hkv, D)` (`(cos, sin)` `(T, D/2)` each, one row per token, non-interleaved
/// halves as candle-nn's `rope_thd`), the rotated k and v written into their cache slots as
/// [`write_paged_kv`] does; returns the rotated q `(T, H, D)`. q, k and v may be strided row-wise
/// (views of one fused projection) with contiguous heads.
///
/// On CUDA (u32 slots) one kernel does all of it in one pass, computing the rotation in f32 and
/// rounding once; elsewhere it is `rope_thd` on q and k followed by [`write_paged_kv`] (a decode
/// step runs this once per layer: on the GPU the composition is about ten small kernels).
pub fn rope_write_paged_kv(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    (k_cache, v_cache): (&Tensor, &Tensor),
    slot_mapping: &Tensor,
) -> Result<Tensor> {
    let shape = validate_rope_cache_write(q, k, v, (cos, sin), (k_cache, v_cache), slot_mapping)?;
    #[cfg(feature = "cuda")]
    if q.device().is_cuda()
        && slot_mapping.dtype() == DType::U32
        && matches!(q.dtype(), DType::F32 | DType::F16 | DType::BF16)
    {
        return crate::cuda::rope_kv_write([q, k, v], (cos, sin), (k_cache, v_cache), slot_mapping, &shape);
    }
    let _ = shape;
    let rope = |x: &Tensor| -> Result<Tensor> {
        candle_nn::rotary_emb::rope_thd(&x.unsqueeze(0)?.contiguous()?, cos, sin)?.squeeze(0)
    };
    write_paged_kv(k_cache, v_cache, &rope(k)?, v, slot_mapping)?;
    rope(q)
}
