//! Decode steps replayed from a captured CUDA graph.
//!
//! One decode step of a small model is hundreds of small kernels (SmolLM2-135M: 30 layers of
//! norms, products, rotary, cache writes and attention, ~20 kernels each). Candle issues each
//! from the host with its own allocation and launch, which takes longer than the kernel runs,
//! so the GPU mostly waits for the host. A CUDA graph records the step's kernels once and
//! replays them with one launch.
//!
//! A graph replays exactly what it recorded: the same kernels with the same arguments and
//! buffers. So everything that changes between steps is read from device memory that the graph
//! addresses: one packed `u32` buffer holding each sequence's token id, position, cache slot,
//! cumulative key length and block-table row, rewritten by one host-to-device copy before each
//! launch. The attention is the paged varlen one with the key length read from that buffer and
//! `max_seqlen_k` fixed at the longest sequence the graph serves (its split-KV plan follows
//! that bound; blocks past a sequence's length do no work). The rotary rows are gathered on the
//! device from tables of every position up to that bound. What must stay fixed:
//! - the batch size `B`: a step may have fewer sequences, the other rows are padding (no cache
//!   write, no keys, logits ignored);
//! - the pool's buffers: growing the pool reallocates them, so reserve pages
//!   ([`PagedKvCache::reserve`]) before capturing; a step after a reallocation is an error;
//! - the table width, i.e. the longest sequence (`max_seq_len`);
//! - the model and its dtype.
//!
//! Greedy decoding reads the argmax of each row (computed in the graph, 4 bytes per sequence);
//! other sampling reads the logits.

use super::model::Llama;
use super::paged_cache::{PagedKvCache, PagedStep, SeqId};
use super::rotary::Rope;
use candle_core::{bail, DType, Result, Tensor, D};

/// Whether CUDA decoding replays captured graphs (default) or launches every op
/// (`CANDLE_FLASH_CUDA_GRAPHS=0`, for comparison and debugging).
pub fn cuda_graphs_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("CANDLE_FLASH_CUDA_GRAPHS").map_or(true, |v| v != "0"))
}

/// A padding row's slot: [`candle_flash::write_paged_kv`] skips it.
const PADDING_SLOT: u32 = u32::MAX;

#[cfg(feature = "cuda")]
type GraphExec = candle_core::cuda_backend::cudarc::driver::CudaGraph;
/// Without the `cuda` feature no graph can exist ([`DecodeGraph::capture`] is an error).
#[cfg(not(feature = "cuda"))]
type GraphExec = std::convert::Infallible;

/// One decode step (one new token for each of up to `batch` sequences of a paged cache)
/// captured as a CUDA graph. See the module documentation for what the graph fixes.
pub struct DecodeGraph {
    batch: usize,
    table_width: usize,
    /// The cache pool the graph addresses ([`PagedKvCache::pool_generation`] at capture).
    generation: u64,
    /// `ids (B) | positions (B) | slots (B) | cumulative key lengths (B + 1) | table (B, W)`.
    inputs: Tensor,
    logits: Tensor,
    tokens: Tensor,
    /// Sequences in the last step (the rows that are not padding).
    rows: usize,
    /// Device buffers the graph reads that nothing else holds (the rotary tables and the query
    /// offsets): they must live as long as the graph.
    _held: [Tensor; 3],
    exec: GraphExec,
}

impl std::fmt::Debug for DecodeGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeGraph")
            .field("batch", &self.batch)
            .field("table_width", &self.table_width)
            .field("rows", &self.rows)
            .finish_non_exhaustive()
    }
}

/// Views of the packed input buffer, in the shapes the step's ops take.
struct InputViews {
    ids: Tensor,
    positions: Tensor,
    slots: Tensor,
    seqlens_k: Tensor,
    table: Tensor,
}

impl InputViews {
    fn new(inputs: &Tensor, b: usize, w: usize) -> Result<Self> {
        let at = |i: usize, len: usize| inputs.narrow(0, i, len);
        Ok(Self {
            ids: at(0, b)?,
            positions: at(b, b)?,
            slots: at(2 * b, b)?,
            seqlens_k: at(3 * b, b + 1)?,
            table: at(4 * b + 1, b * w)?.reshape((b, w))?,
        })
    }
}

/// Padding for every row: token 0 at position 0, no cache write, no keys, table row of page 0.
fn padding_inputs(b: usize, w: usize) -> Vec<u32> {
    let mut host = vec![0u32; 4 * b + 1 + b * w];
    host[2 * b..3 * b].fill(PADDING_SLOT);
    host
}

impl DecodeGraph {
    /// Records the decode step of `model` for up to `batch` sequences of `cache`, each at most
    /// `max_seq_len` tokens long. The cache must be on the model's CUDA device with pages
    /// reserved ([`PagedKvCache::reserve`]): the graph addresses the pool as it is now. Runs the
    /// step once eagerly first (on padding rows: the cache is not written), which loads every
    /// kernel and workspace, then captures it.
    pub fn capture(model: &Llama, cache: &PagedKvCache, batch: usize, max_seq_len: usize) -> Result<Self> {
        if batch == 0 || max_seq_len == 0 {
            bail!("decode graph: batch ({batch}) and max_seq_len ({max_seq_len}) must be at least 1")
        }
        if !model.device().is_cuda() {
            bail!("decode graph: CUDA graphs need a CUDA device, the model is on {:?}", model.device().location())
        }
        if cache.capacity_pages() == 0 {
            bail!("decode graph: the cache has no pages; reserve them before capturing")
        }
        if model.attn_impl() == super::attention::AttnImpl::Fp8 {
            // its steps gather the pages by a host-made row list and quantize per call
            bail!("decode graph: FP8 attention is not captured; decode it eagerly or use flash attention")
        }
        let (b, page_size) = (batch, cache.page_size());
        let w = max_seq_len.div_ceil(page_size);
        let max_seqlen_k = w * page_size;
        if 4 * b + 1 + b * w > u32::MAX as usize || max_seqlen_k > u32::MAX as usize {
            bail!("decode graph: batch {b} x {w} pages is too large")
        }
        let device = model.device();
        let padding = padding_inputs(b, w);
        let inputs = Tensor::from_slice(&padding, padding.len(), device)?;
        let views = InputViews::new(&inputs, b, w)?;
        let seqlens_q = Tensor::arange(0u32, b as u32 + 1, device)?;
        let tables = model.rotary().rope(0, max_seqlen_k, model.dtype(), device)?;
        let vocab = model.config().vocab_size;
        let logits = Tensor::zeros((b, vocab), DType::F32, device)?;
        let tokens = Tensor::zeros(b, DType::U32, device)?;
        // The step: every op reads the views, nothing comes from the host.
        let body = || -> Result<()> {
            let step = PagedStep {
                slots: views.slots.clone(),
                positions: vec![],
                block_table: views.table.clone(),
                seqlens_q: seqlens_q.clone(),
                seqlens_k: views.seqlens_k.clone(),
                max_seqlen_q: 1,
                max_seqlen_k,
                last_rows: vec![],
                host_table: vec![],
                table_width: w,
                k_lens: vec![],
                single: 0,
                rest: None,
                page_size: cache.page_size(),
                key_rows: Default::default(),
            };
            let rope = Rope {
                start: 0,
                cos: tables.cos.index_select(&views.positions, 0)?,
                sin: tables.sin.index_select(&views.positions, 0)?,
            };
            let (h, pending) = model.paged_rows(&views.ids, &rope, cache, &step, b)?;
            let l = model.head_few((&h, pending.as_ref()))?;
            logits.slice_set(&l, 0, 0)?;
            tokens.slice_set(&l.argmax(D::Minus1)?, 0, 0)
        };
        // Candle uploads some kernels' shape parameters from the host on each call; a graph
        // would keep the host pointer of a copy made during capture. With its graph cache on
        // (this thread, until the guard drops), the eager step uploads each parameter vector
        // once into a buffer that stays alive, and the capture reuses those buffers.
        #[cfg(feature = "cuda")]
        let _htod_cache = device.as_cuda_device()?.enable_cuda_graph_htod_cache();
        body()?;
        device.synchronize()?;
        let exec = record(device, &body)?;
        Ok(Self {
            batch: b,
            table_width: w,
            generation: cache.pool_generation(),
            inputs,
            logits,
            tokens,
            rows: 0,
            _held: [tables.cos, tables.sin, seqlens_q],
            exec,
        })
    }

    /// The most sequences a step takes.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// The longest sequence (cached tokens after the step) the graph addresses.
    pub fn max_seq_len(&self, cache: &PagedKvCache) -> usize {
        self.table_width * cache.page_size()
    }

    /// Whether a step of `seqs` sequences (ids) fits: at most `batch` of them, each within
    /// `max_seq_len` after one more token, its pages available in the pool as reserved.
    pub fn fits(&self, cache: &PagedKvCache, seqs: &[SeqId]) -> bool {
        let limit = self.max_seq_len(cache);
        let needed: usize = seqs.iter().map(|&s| cache.pages_needed(Some(s), 1)).sum();
        !seqs.is_empty()
            && seqs.len() <= self.batch
            && cache.pool_generation() == self.generation
            && needed <= cache.capacity_pages() - cache.pages_in_use()
            && seqs.iter().all(|&s| cache.seq_len(s).is_some_and(|n| n < limit))
    }

    /// One decode step: `seqs` gives each sequence and its new token (the one sampled last). Their
    /// K/V rows go into `cache`, whose lengths advance by one; then [`DecodeGraph::tokens`] and
    /// [`DecodeGraph::logits`] hold the step's results, in `seqs`' order. Errors before launch
    /// leave the cache unchanged; an error from the launch itself leaves the lengths advanced
    /// (remove those sequences).
    pub fn step(&mut self, cache: &mut PagedKvCache, seqs: &[(SeqId, u32)]) -> Result<()> {
        let (b, w, n) = (self.batch, self.table_width, seqs.len());
        let ids: Vec<SeqId> = seqs.iter().map(|s| s.0).collect();
        if !self.fits(cache, &ids) {
            bail!(
                "decode graph: a step of {n} sequences does not fit the graph (batch {b}, up to {} tokens, \
                 pool as at capture with its pages reserved)",
                self.max_seq_len(cache)
            )
        }
        let plan: Vec<(SeqId, usize)> = ids.iter().map(|&s| (s, 1)).collect();
        let hs = cache.plan(&plan, Some(w))?;
        let mut host = padding_inputs(b, w);
        for (i, &(_, token)) in seqs.iter().enumerate() {
            host[i] = token;
            host[b + i] = hs.positions[i] as u32;
            host[2 * b + i] = hs.slots[i];
        }
        let cu_k = &mut host[3 * b..4 * b + 1];
        cu_k[..=n].copy_from_slice(&hs.cu_k);
        let last = hs.cu_k[n];
        cu_k[n + 1..].fill(last); // padding rows: no keys
        host[4 * b + 1..4 * b + 1 + n * w].copy_from_slice(&hs.table);
        self.rows = n;
        launch(&self.inputs, &host, &self.exec)
    }

    /// The greedy choice of each sequence of the last step (the argmax of its logits).
    pub fn tokens(&self) -> Result<Vec<u32>> {
        self.tokens.narrow(0, 0, self.rows)?.to_vec1::<u32>()
    }

    /// The logits of each sequence of the last step, `(n, vocab)` f32 on the device (overwritten
    /// by the next step).
    pub fn logits(&self) -> Result<Tensor> {
        self.logits.narrow(0, 0, self.rows)
    }
}

/// Runs `body` under stream capture on candle's stream and instantiates the graph. The capture
/// is ended whatever `body` returns, so that the stream never stays in capture mode.
#[cfg(feature = "cuda")]
fn record(device: &candle_core::Device, body: &dyn Fn() -> Result<()>) -> Result<GraphExec> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let stream = device.as_cuda_device()?.cuda_stream();
    let err = |what: &str, e: candle_core::cuda_backend::cudarc::driver::DriverError| {
        candle_core::Error::Msg(format!("decode graph: {what}: {e:?}"))
    };
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| err("begin capture", e))?;
    let ran = body();
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    ran?;
    let graph = graph.map_err(|e| err("end capture", e))?;
    let Some(graph) = graph else { bail!("decode graph: the capture recorded nothing") };
    graph.upload().map_err(|e| err("upload", e))?;
    Ok(graph)
}

#[cfg(not(feature = "cuda"))]
fn record(_device: &candle_core::Device, _body: &dyn Fn() -> Result<()>) -> Result<GraphExec> {
    bail!("decode graph: CUDA graphs need the `cuda` feature")
}

/// Copies `host` into the packed input buffer (on candle's stream) and launches the graph after it.
#[cfg(feature = "cuda")]
fn launch(inputs: &Tensor, host: &[u32], exec: &GraphExec) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::{result::memcpy_htod_async, DevicePtr};
    let dev = inputs.device().as_cuda_device()?;
    let stream = dev.cuda_stream();
    let (storage, layout) = inputs.storage_and_layout();
    let candle_core::Storage::Cuda(s) = &*storage else { bail!("decode graph: inputs are not on CUDA") };
    let slice = s.as_cuda_slice::<u32>()?;
    if layout.start_offset() != 0 || slice.len() < host.len() {
        bail!("decode graph: the input buffer is {} values, the step {}", slice.len(), host.len())
    }
    let (ptr, _guard) = slice.device_ptr(&stream);
    // SAFETY: `ptr` addresses at least `host.len()` u32 values (checked above) of a buffer that
    // the graph reads on this stream after the copy; a copy from pageable host memory has read
    // `host` when the call returns.
    unsafe { memcpy_htod_async(ptr, host, stream.cu_stream()) }
        .map_err(|e| candle_core::Error::Msg(format!("decode graph: input copy: {e:?}")))?;
    exec.launch().map_err(|e| candle_core::Error::Msg(format!("decode graph: launch: {e:?}")))
}

#[cfg(not(feature = "cuda"))]
fn launch(_inputs: &Tensor, _host: &[u32], exec: &GraphExec) -> Result<()> {
    match *exec {}
}
