//! Where the CPU forward reads K/V rows: a packed f32 buffer `(total_k, Hkv, D)`, or a paged
//! cache `(num_blocks, page_block_size, Hkv, D)` read through the block table.
//!
//! A paged cache is never converted or gathered whole (it holds every sequence of a server,
//! most of which a call does not read). Per K/V tile: f32 rows that lie in one page are read
//! in place like packed rows; a tile that crosses pages, or an f16/bf16 cache, is copied (and
//! widened) into the worker's tile scratch, O(tile) memory.

use super::dense_f32;
use crate::params::{AttnShape, HostData};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Layout, Result};
use half::{bf16, f16};
use std::borrow::Cow;

pub(crate) enum KvRows<'a> {
    /// Rows in logical order, `row_stride` elements apart (packed k/v, already f32).
    Packed {
        data: Cow<'a, [f32]>,
        row_stride: usize,
    },
    Paged(PagedRows<'a>),
}

/// A paged cache in its own dtype and layout (any strides but a contiguous last dimension).
pub(crate) struct PagedRows<'a> {
    data: PageData<'a>,
    start: usize,
    page_stride: usize,
    row_stride: usize,
    head_stride: usize,
    page_rows: usize,
    /// Each sequence's pages in logical order (checked by `params::validate`).
    pages: &'a [Vec<usize>],
}

enum PageData<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl<'a> KvRows<'a> {
    pub fn new(shape: &AttnShape, host: &'a HostData, storage: &'a CpuStorage, layout: &Layout) -> Result<Self> {
        let Some(page_rows) = shape.page_block_size else {
            let row_stride = shape.num_kv_heads * shape.head_dim;
            return Ok(Self::Packed { data: dense_f32(storage, layout)?, row_stride });
        };
        let Some(pages) = &host.pages else { bail!("candle-flash: paged K/V without its block table on the host") };
        let data = match storage {
            CpuStorage::F32(x) => PageData::F32(x),
            CpuStorage::F16(x) => PageData::F16(x),
            CpuStorage::BF16(x) => PageData::BF16(x),
            other => bail!("candle-flash: unsupported dtype {:?} on cpu", other.dtype()),
        };
        let stride = layout.stride();
        Ok(Self::Paged(PagedRows {
            data,
            start: layout.start_offset(),
            page_stride: stride[0],
            row_stride: stride[1],
            head_stride: stride[2],
            page_rows,
            pages,
        }))
    }

    /// Keys `j0..j0 + cols` of sequence `b`, head `kv_head`, as (pointer to the first row's
    /// `head_dim` values, row stride). Rows that are not one strided run in memory are copied
    /// into `scratch` (at least `cols * head_dim` long) and the pointer is into it.
    pub fn tile(
        &self,
        host: &HostData,
        (b, kv_head, head_dim): (usize, usize, usize),
        (j0, cols): (usize, usize),
        scratch: &mut [f32],
    ) -> (*const f32, usize) {
        match self {
            Self::Packed { data, row_stride } => {
                let first = (host.seqs[b].k_start + j0) * row_stride + kv_head * head_dim;
                (data[first..].as_ptr(), *row_stride)
            }
            Self::Paged(paged) => paged.tile((b, kv_head, head_dim), (j0, cols), scratch),
        }
    }
}

impl PagedRows<'_> {
    fn tile(
        &self,
        (b, kv_head, d): (usize, usize, usize),
        (j0, cols): (usize, usize),
        scratch: &mut [f32],
    ) -> (*const f32, usize) {
        let pages = &self.pages[b];
        // Element index of (logical key j, head kv_head, 0): validate checked that the page
        // exists and j lies below the sequence's length, which its pages cover.
        let offset = |j: usize| {
            self.start
                + pages[j / self.page_rows] * self.page_stride
                + (j % self.page_rows) * self.row_stride
                + kv_head * self.head_stride
        };
        if let PageData::F32(data) = &self.data {
            if j0 % self.page_rows + cols <= self.page_rows {
                return (data[offset(j0)..].as_ptr(), self.row_stride);
            }
        }
        for (r, dst) in scratch[..cols * d].chunks_exact_mut(d).enumerate() {
            let first = offset(j0 + r);
            match &self.data {
                PageData::F32(x) => dst.copy_from_slice(&x[first..first + d]),
                PageData::F16(x) => dst.iter_mut().zip(&x[first..first + d]).for_each(|(o, v)| *o = v.to_f32()),
                PageData::BF16(x) => dst.iter_mut().zip(&x[first..first + d]).for_each(|(o, v)| *o = v.to_f32()),
            }
        }
        (scratch.as_ptr(), d)
    }
}
