//! The K/V cache of many sequences at once, in pages: one pool of pages per layer shared by
//! every sequence, a free list, and a block table per sequence (vLLM's layout, read by
//! [`candle_flash::flash_attn_varlen_paged_windowed`] and written by [`candle_flash::write_paged_kv`]).
//!
//! A contiguous cache per sequence must hold each sequence's maximal length from the start (or
//! copy itself when it grows), so a batch costs `batch × max length` rows. Here a sequence takes
//! one page at a time as it grows and gives its pages back when it leaves, so the rows allocated
//! follow the tokens in use, and a finished sequence's pages serve the next one without any copy.

use super::config::LlamaConfig;
use candle_core::{bail, DType, Device, Result, Tensor};
use std::collections::BTreeMap;

/// Identifies a sequence in a [`PagedKvCache`] (and in a [`super::Scheduler`]).
pub type SeqId = u64;

/// Pages the pool starts with on its first growth (a pool grows by doubling, capped at
/// `max_pages`, so a handful of small sequences does not reallocate it many times).
const MIN_POOL_PAGES: usize = 16;

#[derive(Clone, Debug, Default)]
struct SeqPages {
    pages: Vec<u32>,
    len: usize,
}

/// Per layer, K and V pages `(num_pages, page_size, Hkv, D)`; per sequence, its pages in order
/// and its length. Key `j` of a sequence is row `j % page_size` of its page `j / page_size`.
///
/// The pool starts empty and grows by doubling when the free list runs out (each growth copies
/// the pool once, so a row is copied O(1) times on average), up to `max_pages` when given; the
/// pages of a removed sequence go back to the free list and are handed out again before the pool
/// grows. Device-generic: the pool lives on the model's device and every write and read goes
/// through tensor ops.
#[derive(Debug)]
pub struct PagedKvCache {
    layers: Vec<(Tensor, Tensor)>,
    page_size: usize,
    num_kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
    /// Pages the pool holds (allocated), in use or free.
    capacity: usize,
    max_pages: Option<usize>,
    /// Free pages, the next one handed out last (a stack: a page just freed is reused first,
    /// while its memory is likely still in cache).
    free: Vec<u32>,
    seqs: BTreeMap<SeqId, SeqPages>,
    peak_pages_in_use: usize,
    /// Incremented by every reallocation of the pool ([`PagedKvCache::pool_generation`]).
    generation: u64,
}

/// One forward step's addressing, built by [`PagedKvCache::prepare`] for the packed new tokens of
/// the step's sequences (in the order given): everything the layers need, made once per step
/// and shared by all of them.
#[derive(Debug)]
pub(crate) struct PagedStep {
    /// `[T]` u32: the cache slot (page · page_size + row) of each new token.
    pub slots: Tensor,
    /// The position in its sequence of each new token (for the rotary embedding).
    pub positions: Vec<usize>,
    /// `[B, max_pages]` u32: each sequence's pages (rows padded with page 0, never read).
    pub block_table: Tensor,
    /// `[B + 1]` u32: cumulative new-token counts (the packed queries).
    pub seqlens_q: Tensor,
    /// `[B + 1]` u32: cumulative cache lengths after this step (the keys).
    pub seqlens_k: Tensor,
    pub max_seqlen_q: usize,
    pub max_seqlen_k: usize,
    /// The packed row of each sequence's last new token.
    pub last_rows: Vec<u32>,
    /// The block table on the host, `B × table_width` row-major (for the CPU decode kernel).
    pub host_table: Vec<u32>,
    pub table_width: usize,
    /// Each sequence's cache length after this step.
    pub k_lens: Vec<usize>,
    /// With `split_single`: the leading sequences that feed one token each (their attention is
    /// a row each, [`super::decode_attn::decode_attention_paged`]), and the attention arguments
    /// of the sequences after them, when there are any.
    pub single: usize,
    pub rest: Option<PagedRest>,
    pub page_size: usize,
    /// [`PagedStep::packed_key_rows`], made by the first layer that asks (construct empty).
    pub key_rows: std::sync::OnceLock<Tensor>,
}

impl PagedStep {
    /// The step's attention options: causal, varlen over its packed new queries and each
    /// sequence's cached keys, read through its block table.
    pub fn attn_options(&self, softmax_scale: f32) -> candle_flash::FlashAttnOptions {
        candle_flash::FlashAttnOptions::new(softmax_scale)
            .causal(true)
            .varlen(Some(candle_flash::VarLen {
                seqlens_q: self.seqlens_q.clone(),
                seqlens_k: self.seqlens_k.clone(),
                max_seqlen_q: self.max_seqlen_q,
                max_seqlen_k: self.max_seqlen_k,
            }))
            .paged(Some(candle_flash::PagedKv::new(&self.block_table, self.page_size)))
    }

    /// `[total_k]` u32: for every key `j` of every sequence, in order, its row
    /// `page(j / page_size) · page_size + j % page_size` of a layer's pool viewed as
    /// `(pages · page_size, Hkv, D)`. Gathering those rows turns the cache into the packed varlen
    /// layout whose offsets are [`PagedStep::seqlens_k`] (what [`candle_flash::reference::unpage`]
    /// does), for kernels that read no block table (the FP8 forward). Made once per step from
    /// the host's table and shared by every layer: no layer reads the device's seqlens or table
    /// back to the host.
    pub fn packed_key_rows(&self) -> Result<&Tensor> {
        if let Some(rows) = self.key_rows.get() {
            return Ok(rows);
        }
        if self.k_lens.len() + 1 != self.seqlens_k.dim(0)? {
            bail!("paged step: no host addressing to gather the keys by (a graph step)")
        }
        let w = self.table_width;
        let table = &self.host_table;
        let seqs = self.k_lens.iter().enumerate().map(|(b, &len)| (len, move |i: usize| table[b * w + i] as usize));
        let rows = candle_flash::reference::packed_key_rows(self.page_size, seqs);
        let n = rows.len();
        let rows = Tensor::from_vec(rows, n, self.slots.device())?;
        Ok(self.key_rows.get_or_init(|| rows))
    }
}

/// The paged-attention arguments of a step's sequences after its leading single-token ones.
/// A step's addressing on the host ([`PagedKvCache::plan`]): what [`PagedStep`] puts on the
/// device, with the block table `table (B, table_width)` row-major.
#[derive(Debug)]
pub(crate) struct HostStep {
    pub slots: Vec<u32>,
    pub positions: Vec<usize>,
    pub cu_q: Vec<u32>,
    pub cu_k: Vec<u32>,
    pub last_rows: Vec<u32>,
    pub table: Vec<u32>,
    pub table_width: usize,
    pub max_q: usize,
    pub max_k: usize,
}

#[derive(Debug)]
pub(crate) struct PagedRest {
    pub seqlens_q: Tensor,
    pub seqlens_k: Tensor,
    pub max_seqlen_q: usize,
    pub block_table: Tensor,
}

impl PagedKvCache {
    /// An empty cache for `cfg`'s layers and K/V heads, in `dtype` on `device`, with pages of
    /// `page_size` rows; at most `max_pages` pages per layer when given (None: the pool grows
    /// as long as memory allows).
    pub fn new(
        cfg: &LlamaConfig,
        page_size: usize,
        max_pages: Option<usize>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if page_size == 0 {
            bail!("paged kv cache: page_size must be at least 1")
        }
        if max_pages == Some(0) {
            bail!("paged kv cache: max_pages must be at least 1 (or None)")
        }
        let empty = Tensor::zeros((0, page_size, cfg.num_key_value_heads, cfg.head_dim), dtype, device)?;
        Ok(Self {
            layers: vec![(empty.clone(), empty); cfg.num_hidden_layers],
            page_size,
            num_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            dtype,
            device: device.clone(),
            capacity: 0,
            max_pages,
            free: vec![],
            seqs: BTreeMap::new(),
            peak_pages_in_use: 0,
            generation: 0,
        })
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Pages the pool holds per layer (in use or free).
    pub fn capacity_pages(&self) -> usize {
        self.capacity
    }

    /// The cap on [`Self::capacity_pages`], if any.
    pub fn max_pages(&self) -> Option<usize> {
        self.max_pages
    }

    /// Pages held by sequences (per layer).
    pub fn pages_in_use(&self) -> usize {
        self.capacity - self.free.len()
    }

    /// The most pages ever in use at once (per layer).
    pub fn peak_pages_in_use(&self) -> usize {
        self.peak_pages_in_use
    }

    /// Bytes of one page in one layer, K and V together.
    pub fn page_bytes(&self) -> usize {
        2 * self.page_size * self.num_kv_heads * self.head_dim * self.dtype.size_in_bytes()
    }

    /// Bytes the pool holds on the device, every layer, K and V.
    pub fn pool_bytes(&self) -> usize {
        self.capacity * self.page_bytes() * self.layers.len()
    }

    /// Tokens cached for `seq` (None: not in the cache).
    pub fn seq_len(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq).map(|s| s.len)
    }

    /// The sequences in the cache.
    pub fn sequences(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// Layer `i`'s K and V pools `(capacity_pages, page_size, Hkv, D)`.
    pub fn layer(&self, i: usize) -> Result<&(Tensor, Tensor)> {
        match self.layers.get(i) {
            Some(l) => Ok(l),
            None => bail!("paged kv cache: layer {i} of {}", self.layers.len()),
        }
    }

    /// Starts an empty sequence.
    pub fn add_sequence(&mut self, seq: SeqId) -> Result<()> {
        if self.seqs.contains_key(&seq) {
            bail!("paged kv cache: sequence {seq} is already in the cache")
        }
        self.seqs.insert(seq, SeqPages::default());
        Ok(())
    }

    /// Ends a sequence: its pages go back to the free list (their contents are left as they are
    /// and overwritten by the next owner's writes).
    pub fn remove_sequence(&mut self, seq: SeqId) -> Result<()> {
        match self.seqs.remove(&seq) {
            Some(s) => {
                // Reversed, so that the sequence's first page is handed out first again.
                self.free.extend(s.pages.into_iter().rev());
                Ok(())
            }
            None => bail!("paged kv cache: sequence {seq} is not in the cache"),
        }
    }

    /// Pages that `tokens` more tokens of `seq` need beyond those it holds.
    pub fn pages_needed(&self, seq: Option<SeqId>, tokens: usize) -> usize {
        let (len, held) = seq.and_then(|s| self.seqs.get(&s)).map_or((0, 0), |s| (s.len, s.pages.len()));
        (len + tokens).div_ceil(self.page_size).saturating_sub(held)
    }

    /// Pages that can still be handed out: the free list, plus what the pool may grow by.
    pub fn pages_available(&self) -> usize {
        self.free.len() + self.max_pages.map_or(usize::MAX - self.capacity, |m| m - self.capacity)
    }

    /// Grows every layer's pool to hold at least `needed` more free pages (doubling, capped).
    fn grow(&mut self, needed: usize) -> Result<()> {
        let want = self.capacity - self.free.len() + needed;
        let mut cap = (2 * self.capacity).max(want).max(MIN_POOL_PAGES);
        if let Some(max) = self.max_pages {
            if want > max {
                bail!(
                    "paged kv cache: {want} pages needed but the pool is capped at {max} pages of {} rows",
                    self.page_size
                )
            }
            cap = cap.min(max);
        }
        if cap > u32::MAX as usize / self.page_size {
            bail!("paged kv cache: {cap} pages of {} rows are more slots than u32 addresses", self.page_size)
        }
        let shape = (cap, self.page_size, self.num_kv_heads, self.head_dim);
        for (k, v) in self.layers.iter_mut() {
            for t in [k, v] {
                let new = Tensor::zeros(shape, self.dtype, &self.device)?;
                if self.capacity > 0 {
                    new.slice_set(t, 0, 0)?;
                }
                *t = new;
            }
        }
        // Highest page last out, so that pages are handed out in increasing order.
        self.free.splice(0..0, (self.capacity as u32..cap as u32).rev());
        self.capacity = cap;
        self.generation += 1;
        Ok(())
    }

    /// The host side of [`PagedKvCache::prepare`]: pages taken, lengths advanced, and the step's
    /// addressing as host vectors. `table_width`: the block table's row length when the caller
    /// needs a fixed one (a captured CUDA graph); an error, before anything changes, when a
    /// sequence would need more pages than that. Otherwise the widest sequence's page count.
    pub(crate) fn plan(&mut self, batch: &[(SeqId, usize)], table_width: Option<usize>) -> Result<HostStep> {
        if batch.is_empty() {
            bail!("paged kv cache: a step needs at least one sequence")
        }
        let mut needed = 0;
        for (i, &(seq, n)) in batch.iter().enumerate() {
            if n == 0 {
                bail!("paged kv cache: sequence {seq} has no new tokens in this step")
            }
            let Some(s) = self.seqs.get(&seq) else {
                bail!("paged kv cache: sequence {seq} is not in the cache (add_sequence first)")
            };
            if batch[..i].iter().any(|(s, _)| *s == seq) {
                bail!("paged kv cache: sequence {seq} appears twice in one step")
            }
            if let Some(w) = table_width {
                if (s.len + n).div_ceil(self.page_size) > w {
                    bail!(
                        "paged kv cache: sequence {seq} would reach {} tokens, past the {} the step addresses",
                        s.len + n,
                        w * self.page_size
                    )
                }
            }
            needed += self.pages_needed(Some(seq), n);
        }
        if needed > self.free.len() {
            self.grow(needed - self.free.len())?;
        }
        let total: usize = batch.iter().map(|(_, n)| n).sum();
        let (mut slots, mut positions) = (Vec::with_capacity(total), Vec::with_capacity(total));
        let (mut cu_q, mut cu_k, mut last) = (vec![0u32], vec![0u32], Vec::with_capacity(batch.len()));
        let (mut max_q, mut max_k, mut max_pages) = (0, 0, 0);
        for &(seq, n) in batch {
            let Some(s) = self.seqs.get_mut(&seq) else { bail!("paged kv cache: sequence {seq} vanished") };
            let end = s.len + n;
            while s.pages.len() < end.div_ceil(self.page_size) {
                let Some(p) = self.free.pop() else { bail!("paged kv cache: free list ran out after growth") };
                s.pages.push(p);
            }
            for pos in s.len..end {
                slots.push(s.pages[pos / self.page_size] * self.page_size as u32 + (pos % self.page_size) as u32);
                positions.push(pos);
            }
            s.len = end;
            cu_q.push(cu_q[cu_q.len() - 1] + n as u32);
            cu_k.push(cu_k[cu_k.len() - 1] + end as u32);
            last.push(cu_q[cu_q.len() - 1] - 1);
            (max_q, max_k, max_pages) = (max_q.max(n), max_k.max(end), max_pages.max(s.pages.len()));
        }
        let width = table_width.unwrap_or(max_pages);
        let mut table = vec![0u32; batch.len() * width];
        for (row, (seq, _)) in table.chunks_exact_mut(width).zip(batch) {
            let pages = &self.seqs[seq].pages;
            row[..pages.len()].copy_from_slice(pages);
        }
        self.peak_pages_in_use = self.peak_pages_in_use.max(self.pages_in_use());
        Ok(HostStep { slots, positions, cu_q, cu_k, last_rows: last, table, table_width: width, max_q, max_k })
    }

    /// Grows the pool to at least `pages` pages (within `max_pages`), so that later steps take
    /// pages without reallocating it: a captured CUDA graph addresses the pool's buffers, which
    /// growth replaces ([`PagedKvCache::pool_generation`] tells when that happened).
    pub fn reserve(&mut self, pages: usize) -> Result<()> {
        if pages > self.capacity {
            self.grow(pages - self.pages_in_use())?;
        }
        Ok(())
    }

    /// Changes whenever the pool's buffers are reallocated (growth).
    pub fn pool_generation(&self) -> u64 {
        self.generation
    }

    /// Appends `new_tokens` positions to each sequence of `batch` (allocating the pages they
    /// need) and returns the step's addressing for those tokens packed in the order given. The
    /// K/V rows themselves are written by each layer ([`candle_flash::write_paged_kv`] with
    /// `slots`). Errors leave the lengths unchanged; a sequence may appear once per step. With
    /// `split_single`, the leading single-token sequences are set apart (see
    /// [`PagedStep::single`]).
    pub(crate) fn prepare(&mut self, batch: &[(SeqId, usize)], split_single: bool) -> Result<PagedStep> {
        let HostStep { slots, positions, cu_q, cu_k, last_rows: last, table, table_width: max_pages, max_q, max_k } =
            self.plan(batch, None)?;
        let total = slots.len();
        let dev = &self.device;
        let b = batch.len();
        let single = if split_single { batch.iter().take_while(|(_, n)| *n == 1).count() } else { 0 };
        let rest = if single > 0 && single < b {
            let from = |cu: &[u32]| -> Result<Tensor> {
                let v: Vec<u32> = cu[single..].iter().map(|x| x - cu[single]).collect();
                Tensor::from_vec(v, b - single + 1, dev)
            };
            Some(PagedRest {
                seqlens_q: from(&cu_q)?,
                seqlens_k: from(&cu_k)?,
                max_seqlen_q: batch[single..].iter().map(|(_, n)| *n).max().unwrap_or(0),
                block_table: Tensor::from_vec(table[single * max_pages..].to_vec(), (b - single, max_pages), dev)?,
            })
        } else {
            None
        };
        let k_lens = cu_k.windows(2).map(|w| (w[1] - w[0]) as usize).collect();
        Ok(PagedStep {
            slots: Tensor::from_vec(slots, total, dev)?,
            positions,
            block_table: Tensor::from_slice(&table, (b, max_pages), dev)?,
            seqlens_q: Tensor::from_vec(cu_q, b + 1, dev)?,
            seqlens_k: Tensor::from_vec(cu_k, b + 1, dev)?,
            max_seqlen_q: max_q,
            max_seqlen_k: max_k,
            last_rows: last,
            host_table: table,
            table_width: max_pages,
            k_lens,
            single,
            rest,
            page_size: self.page_size,
            key_rows: std::sync::OnceLock::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_flash::{reference, FlashAttnOptions};

    /// `PagedStep::packed_key_rows` gathers exactly what `reference::unpage` gathers through
    /// the device's block table: three sequences whose pages interleave over three steps (page
    /// size 4, so every sequence spans pages that are not adjacent), on pools of distinct values.
    /// Both take their row formula from `reference::packed_key_rows`, so the gather is also
    /// checked against the cache's own writes: every new key is written through the step's slots
    /// with a tag (sequence, position), and the gathered rows must be each sequence's tags in
    /// order.
    #[test]
    fn packed_key_rows_match_unpage() -> Result<()> {
        let cfg = LlamaConfig {
            vocab_size: 8,
            hidden_size: 8,
            intermediate_size: 8,
            num_hidden_layers: 1,
            num_attention_heads: 2,
            num_key_value_heads: 2,
            head_dim: 4,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: super::super::rotary::RopeScaling::None,
            max_position_embeddings: 64,
            tie_word_embeddings: false,
        };
        let dev = Device::Cpu;
        let mut cache = PagedKvCache::new(&cfg, 4, None, DType::F32, &dev)?;
        for seq in 0..3 {
            cache.add_sequence(seq)?;
        }
        let tag = |seq: SeqId, pos: usize| (100 * seq as usize + pos) as f32;
        let mut lens = BTreeMap::new();
        for batch in [vec![(0, 5), (1, 3)], vec![(2, 6), (0, 2)], vec![(1, 7), (0, 1), (2, 1)]] {
            let step = cache.prepare(&batch, false)?;
            let tags: Vec<f32> = step
                .positions
                .iter()
                .zip(batch.iter().flat_map(|&(seq, n)| std::iter::repeat_n(seq, n)))
                .flat_map(|(&pos, seq)| [tag(seq, pos); 8])
                .collect();
            let new_keys = Tensor::from_vec(tags, (step.positions.len(), 2, 4), &dev)?;
            let (k_cache, v_cache) = cache.layer(0)?;
            candle_flash::write_paged_kv(k_cache, v_cache, &new_keys, &new_keys, &step.slots)?;
            let mut want = vec![];
            for &(seq, n) in &batch {
                let len = lens.entry(seq).or_insert(0usize);
                *len += n;
                want.extend((0..*len).map(|j| tag(seq, j)));
            }
            let gathered = k_cache.flatten_to(1)?.index_select(step.packed_key_rows()?, 0)?;
            let got = gathered.narrow(1, 0, 1)?.narrow(2, 0, 1)?.flatten_all()?.to_vec1::<f32>()?;
            assert_eq!(got, want, "batch {batch:?}");
            let pages = cache.capacity_pages();
            let pool = |offset: f32| -> Result<Tensor> {
                let n = pages * 4 * 2 * 4;
                Tensor::arange(0f32, n as f32, &dev)?.affine(1.0, offset as f64)?.reshape((pages, 4, 2, 4))
            };
            let (k_pool, v_pool) = (pool(0.0)?, pool(0.5)?);
            let rows = step.packed_key_rows()?;
            let gather = |t: &Tensor| t.flatten_to(1)?.index_select(rows, 0);
            let total_q: usize = batch.iter().map(|(_, n)| n).sum();
            let q = Tensor::zeros((total_q, 2, 4), DType::F32, &dev)?;
            let opts = step.attn_options(0.5);
            let (k_want, v_want, unpaged) = reference::unpage(&q, &k_pool, &v_pool, &opts)?;
            assert_eq!(gather(&k_pool)?.to_vec3::<f32>()?, k_want.to_vec3::<f32>()?, "batch {batch:?}");
            assert_eq!(gather(&v_pool)?.to_vec3::<f32>()?, v_want.to_vec3::<f32>()?, "batch {batch:?}");
            let offsets = |o: &FlashAttnOptions| o.varlen.as_ref().map(|v| v.seqlens_k.to_vec1::<u32>());
            assert_eq!(offsets(&unpaged).transpose()?, Some(step.seqlens_k.to_vec1::<u32>()?));
            // made once: the same tensor for every later layer
            assert!(std::ptr::eq(rows, step.packed_key_rows()?));
        }
        Ok(())
    }
}
