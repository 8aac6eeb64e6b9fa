//! Where the CPU forward reads K/V rows: packed tensors `(B, Sk, Hkv, D)` / `(total_k, Hkv,
//! D)` in any strides, or a paged cache `(num_blocks, page_block_size, Hkv, D)` read through
//! the block table, each in its own dtype. The backward reads Q, O and dO rows the same way
//! ([`KvRows::queries`]): packed `(B, Sq, H, D)` / `(total_q, H, D)`.
//!
//! Nothing is converted or gathered whole (a paged cache holds every sequence of a server,
//! most of which a call does not read). Per K/V tile the rows are copied, and widened to f32,
//! into the worker's tile scratch: O(tile) memory, one contiguous `cols × D` block. Copying
//! costs about 1/rows of the tile's products, and the contiguous block keeps the product's
//! B-operand rows in distinct L1 sets (rows H·D floats apart, read in place, map a 64-row tile
//! onto a few sets: 2 KiB apart at H·D = 512 on a 32 KiB 8-way L1).

use super::dense_f32;
use super::simd::{multiversion, CpuIsa};
use crate::params::{AttnShape, HostData};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Layout, Result};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use std::borrow::Cow;

pub(crate) struct KvRows<'a> {
    isa: CpuIsa,
    data: Elems<'a>,
    rows: RowAddr<'a>,
    head_stride: usize,
    /// Rows counted from each sequence's first key (K, V) or first query (Q, O, dO).
    queries: bool,
}

enum Elems<'a> {
    F32(Cow<'a, [f32]>),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

/// Element offset of (logical key row, head 0, column 0).
enum RowAddr<'a> {
    /// Row r of the packed row axis: `start + (r / per_batch) * batch_stride + (r % per_batch)
    /// * row_stride` (the batched layout is viewed as `(B·Sk, Hkv, D)`; varlen has one batch).
    Packed { start: usize, per_batch: usize, batch_stride: usize, row_stride: usize },
    /// Key j of sequence b: row `j % page_rows` of page `pages[b][j / page_rows]`.
    Paged { start: usize, page_stride: usize, row_stride: usize, page_rows: usize, pages: &'a [Vec<usize>] },
}

impl<'a> KvRows<'a> {
    /// K or V (packed or paged, as the call's shape says).
    pub fn new(
        isa: CpuIsa,
        shape: &AttnShape,
        host: &'a HostData,
        storage: &'a CpuStorage,
        layout: &Layout,
    ) -> Result<Self> {
        Self::with_axis(isa, shape, host, (storage, layout), false)
    }

    /// Q, O or dO: packed rows of the query axis, `num_heads` heads.
    pub fn queries(
        isa: CpuIsa,
        shape: &AttnShape,
        host: &'a HostData,
        (storage, layout): (&'a CpuStorage, &Layout),
    ) -> Result<Self> {
        Self::with_axis(isa, shape, host, (storage, layout), true)
    }

    fn with_axis(
        isa: CpuIsa,
        shape: &AttnShape,
        host: &'a HostData,
        (storage, layout): (&'a CpuStorage, &Layout),
        queries: bool,
    ) -> Result<Self> {
        let (dims, stride) = (layout.dims(), layout.stride());
        let rank = dims.len();
        let paged = shape.page_block_size.filter(|_| !queries);
        if stride[rank - 1] != 1 && paged.is_none() {
            // A view whose head dim is not contiguous: one dense f32 copy, read as packed rows.
            let heads = if queries { shape.num_heads } else { shape.num_kv_heads };
            let row_stride = heads * shape.head_dim;
            return Ok(Self {
                isa,
                data: Elems::F32(dense_f32(storage, layout)?),
                rows: RowAddr::Packed { start: 0, per_batch: usize::MAX, batch_stride: 0, row_stride },
                head_stride: shape.head_dim,
                queries,
            });
        }
        if stride[rank - 1] != 1 {
            bail!("candle-flash: a paged k/v cache needs a contiguous last dimension, got strides {stride:?}");
        }
        let data = match storage {
            CpuStorage::F32(x) => Elems::F32(Cow::Borrowed(x)),
            CpuStorage::F16(x) => Elems::F16(x),
            CpuStorage::BF16(x) => Elems::BF16(x),
            other => bail!("candle-flash: unsupported dtype {:?} on cpu", other.dtype()),
        };
        let start = layout.start_offset();
        let rows = match paged {
            Some(page_rows) => {
                let Some(pages) = &host.pages else {
                    bail!("candle-flash: paged K/V without its block table on the host")
                };
                RowAddr::Paged { start, page_stride: stride[0], row_stride: stride[1], page_rows, pages }
            }
            None if rank == 4 => {
                RowAddr::Packed { start, per_batch: dims[1], batch_stride: stride[0], row_stride: stride[1] }
            }
            None => RowAddr::Packed { start, per_batch: usize::MAX, batch_stride: 0, row_stride: stride[0] },
        };
        Ok(Self { isa, data, rows, head_stride: stride[rank - 2], queries })
    }

    /// Rows `j0..j0 + cols` (keys, or queries for [`KvRows::queries`]) of sequence `b`, head
    /// `kv_head`, as f32 rows of `head_dim` values, copied into `scratch` (at least
    /// `cols * head_dim` long) one after the other.
    pub fn tile<'s>(
        &self,
        host: &HostData,
        (b, kv_head, d): (usize, usize, usize),
        (j0, cols): (usize, usize),
        scratch: &'s mut [f32],
    ) -> &'s [f32] {
        let offset = |j: usize| self.offset(host, b, kv_head, j);
        let tile = &mut scratch[..cols * d];
        for (r, dst) in tile.chunks_exact_mut(d).enumerate() {
            let first = offset(j0 + r);
            match &self.data {
                Elems::F32(x) => dst.copy_from_slice(&x[first..first + d]),
                Elems::F16(x) => x[first..first + d].convert_to_f32_slice(dst),
                Elems::BF16(x) => widen_bf16(self.isa, &x[first..first + d], dst),
            }
        }
        tile
    }

    /// Whether the rows are bf16 (then [`KvRows::bf16_row`] reads them).
    pub fn is_bf16(&self) -> bool {
        matches!(self.data, Elems::BF16(_))
    }

    /// Row `j` of sequence `b`, head `head`, as its raw bf16 bits (`d` values), read in place:
    /// None unless the data is bf16.
    pub fn bf16_row(&self, host: &HostData, (b, head, d): (usize, usize, usize), j: usize) -> Option<&[u16]> {
        let Elems::BF16(x) = &self.data else { return None };
        let first = self.offset(host, b, head, j);
        Some(x[first..first + d].reinterpret_cast())
    }

    /// Rows `j0..j0 + cols` as raw bf16 in place, when they are equally spaced (packed rows of
    /// one batch; not a paged cache): a pointer to row `j0` and the distance between rows in
    /// elements. None for other element types and layouts.
    pub fn bf16_rows_in_place(
        &self,
        host: &HostData,
        (b, head, d): (usize, usize, usize),
        (j0, cols): (usize, usize),
    ) -> Option<(*const u16, usize)> {
        let RowAddr::Packed { per_batch, row_stride, .. } = self.rows else { return None };
        let seq = &host.seqs[b];
        let r0 = if self.queries { seq.q_start } else { seq.k_start } + j0;
        if cols == 0 || r0 / per_batch != (r0 + cols - 1) / per_batch {
            return None;
        }
        // Every row of the range lies inside the tensor (validate), so its slice exists.
        self.bf16_row(host, (b, head, d), j0 + cols - 1)?;
        Some((self.bf16_row(host, (b, head, d), j0)?.as_ptr(), row_stride))
    }

    /// Element offset of row `j` (a key, or a query for [`KvRows::queries`]) of sequence `b`,
    /// head `kv_head`, column 0.
    fn offset(&self, host: &HostData, b: usize, kv_head: usize, j: usize) -> usize {
        let seq = &host.seqs[b];
        // validate checked that every row addressed here exists (packed: below total_k; paged:
        // the page is in the table and j lies below the sequence's length, which it covers).
        let row = match &self.rows {
            RowAddr::Packed { start, per_batch, batch_stride, row_stride } => {
                let r = if self.queries { seq.q_start } else { seq.k_start } + j;
                start + (r / per_batch) * batch_stride + (r % per_batch) * row_stride
            }
            RowAddr::Paged { start, page_stride, row_stride, page_rows, pages } => {
                start + pages[b][j / page_rows] * page_stride + (j % page_rows) * row_stride
            }
        };
        row + kv_head * self.head_stride
    }
}

multiversion! {
    /// bf16 → f32 is a 16-bit shift: vectorised here (8-16 values per instruction). half's
    /// slice conversion went element by element and made the bf16 forward 1.6x slower than
    /// f32's, per-tile widening being 1/128 of the products' work at D = 64 (measured).
    pub(crate) fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
        dst.iter_mut().zip(src).for_each(|(o, x)| *o = f32::from_bits((x.to_bits() as u32) << 16));
    }
}
