//! Continuous batching: many generation requests served together from one [`PagedKvCache`].
//!
//! Each [`Scheduler::step`] is one [`Llama::forward_paged`] over every running sequence: the
//! prompts of sequences that just joined (whole, or in chunks of `prefill_chunk` tokens) packed
//! beside the single tokens of those already decoding. A sequence leaves as soon as it samples a
//! stop token or reaches its token budget, its pages return to the pool, and the next waiting
//! request takes its place in the following step, so the batch stays full while requests of
//! different lengths come and go (Orca's iteration-level scheduling, vLLM's continuous batching).
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_flash_llama::{AttnImpl, Llama, LlamaConfig, Request, Scheduler, SchedulerConfig};
//! use candle_nn::{VarBuilder, VarMap};
//! # fn main() -> candle_core::Result<()> {
//! let cfg = LlamaConfig {
//!     vocab_size: 32, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
//!     num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8, rms_norm_eps: 1e-5,
//!     rope_theta: 10_000.0, rope_scaling: Default::default(), max_position_embeddings: 128,
//!     tie_word_embeddings: true,
//! };
//! let vars = VarMap::new(); // random weights, created on first use
//! let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
//! let model = Llama::load(vb, &cfg, AttnImpl::Flash, &mut |_, _| {})?;
//! let mut sched = Scheduler::new(&model, SchedulerConfig { max_batch: 2, page_size: 4, ..Default::default() })?;
//! for (prompt, n) in [(vec![1u32, 2, 3], 5), (vec![4], 2), (vec![5, 6, 7, 8, 9, 10], 3)] {
//!     sched.add(Request::new(prompt, n))?;
//! }
//! let done = sched.run(&mut |_, logits: &Tensor| Scheduler::greedy(logits))?;
//! assert_eq!(done.iter().map(|f| f.tokens.len()).sum::<usize>(), 10);
//! assert_eq!(sched.cache().pages_in_use(), 0); // every page back in the pool
//! # Ok(()) }
//! ```

use super::attention::AttnImpl;
use super::graph::{cuda_graphs_enabled, DecodeGraph};
use super::model::Llama;
use super::paged_cache::{PagedKvCache, SeqId};
use candle_core::{bail, Device, Result, Tensor, D};
use std::collections::VecDeque;

/// One generation request.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (at least 1).
    pub max_new_tokens: usize,
    /// Generation ends after any of these (it is kept in the output).
    pub stop_tokens: Vec<u32>,
}

impl Request {
    pub fn new(prompt: Vec<u32>, max_new_tokens: usize) -> Self {
        Self { prompt, max_new_tokens, stop_tokens: vec![] }
    }

    pub fn stop_tokens(mut self, stop_tokens: &[u32]) -> Self {
        self.stop_tokens = stop_tokens.to_vec();
        self
    }

    /// Tokens the cache holds for this request at most: the prompt and every generated token
    /// but the last (which is sampled, never fed back).
    fn max_cached(&self) -> usize {
        self.prompt.len() + self.max_new_tokens - 1
    }
}

/// Limits of a [`Scheduler`].
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Sequences running at once at most.
    pub max_batch: usize,
    /// Rows per cache page.
    pub page_size: usize,
    /// Pages per layer at most (None: unbounded). A request joins only when the pages it could
    /// need at its longest fit beside those reserved by the running ones, so a running sequence
    /// never runs out of pages (no preemption); pages are still allocated only as tokens arrive.
    pub max_pages: Option<usize>,
    /// Prompt tokens fed per sequence and step at most (None: the whole prompt in its first
    /// step). Smaller chunks bound a step's latency for the sequences decoding beside a long
    /// prompt; a chunked prompt rounds slightly differently from a whole one (another split of
    /// the same sums), so its greedy output may differ from an unchunked run on near ties.
    pub prefill_chunk: Option<usize>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self { max_batch: 8, page_size: 16, max_pages: None, prefill_chunk: None }
    }
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// It sampled one of its stop tokens.
    Stop,
    /// It reached `max_new_tokens`.
    Length,
}

/// A finished sequence.
#[derive(Clone, Debug)]
pub struct Finished {
    pub id: SeqId,
    pub prompt_tokens: usize,
    /// The generated tokens (with the stop token when one ended it).
    pub tokens: Vec<u32>,
    pub reason: FinishReason,
}

/// What one [`Scheduler::step`] did.
#[derive(Clone, Debug, Default)]
pub struct StepOutput {
    /// The token each sequence sampled this step (sequences still in their prompt sample none).
    pub tokens: Vec<(SeqId, u32)>,
    /// Sequences that ended this step.
    pub finished: Vec<Finished>,
    /// Prompt tokens fed this step.
    pub prefill_tokens: usize,
    /// Sequences that fed one generated token this step.
    pub decode_tokens: usize,
}

#[derive(Debug)]
struct Running {
    id: SeqId,
    req: Request,
    /// Prompt tokens already in the cache.
    fed: usize,
    generated: Vec<u32>,
    /// Pages reserved for this sequence at its longest (with `max_pages`).
    reserved: usize,
}

impl Running {
    /// The tokens this step feeds.
    fn input(&self, chunk: Option<usize>) -> &[u32] {
        let p = &self.req.prompt;
        if self.fed < p.len() {
            &p[self.fed..p.len().min(self.fed + chunk.unwrap_or(usize::MAX))]
        } else {
            &self.generated[self.generated.len() - 1..]
        }
    }
}

/// Runs many generation requests over one model and one paged cache (see the module
/// documentation). Requests wait in arrival order and join as soon as the batch has room.
#[derive(Debug)]
pub struct Scheduler<'m> {
    model: &'m Llama,
    cache: PagedKvCache,
    cfg: SchedulerConfig,
    waiting: VecDeque<(SeqId, Request)>,
    running: Vec<Running>,
    next_id: SeqId,
    reserved: usize,
    /// Captured decode steps (CUDA), by batch bucket; see [`Scheduler::decode_graph`].
    graphs: Vec<DecodeGraph>,
}

/// How a step chooses each sequence's token.
enum Choose<'a> {
    Sample(&'a mut dyn FnMut(SeqId, &Tensor) -> Result<u32>),
    /// The argmax, computed on the model's device (only the token ids come back).
    Greedy,
}

/// A step's results for choosing tokens: the logits rows on the host, or the argmax of each.
enum Rows {
    Logits(Tensor),
    Tokens(Vec<u32>),
}

/// Graphs a scheduler keeps at most (batch buckets 1, 2, 4, ... and their table widths).
const MAX_GRAPHS: usize = 8;

impl<'m> Scheduler<'m> {
    pub fn new(model: &'m Llama, cfg: SchedulerConfig) -> Result<Self> {
        if cfg.max_batch == 0 {
            bail!("scheduler: max_batch must be at least 1")
        }
        if cfg.prefill_chunk == Some(0) {
            bail!("scheduler: prefill_chunk must be at least 1 (or None)")
        }
        let cache = model.new_paged_cache(cfg.page_size, cfg.max_pages)?;
        Ok(Self {
            model,
            cache,
            cfg,
            waiting: VecDeque::new(),
            running: vec![],
            next_id: 0,
            reserved: 0,
            graphs: vec![],
        })
    }

    /// Queues a request; returns the id its tokens and result will carry.
    pub fn add(&mut self, req: Request) -> Result<SeqId> {
        if req.prompt.is_empty() {
            bail!("scheduler: the prompt has no tokens")
        }
        if req.max_new_tokens == 0 {
            bail!("scheduler: max_new_tokens must be at least 1")
        }
        let vocab = self.model.config().vocab_size;
        if let Some(t) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            bail!("scheduler: prompt token {t} is outside the vocabulary of {vocab}")
        }
        let pages = req.max_cached().div_ceil(self.cfg.page_size);
        if let Some(max) = self.cfg.max_pages {
            if pages > max {
                bail!(
                    "scheduler: a request of {} prompt + {} new tokens needs {pages} pages of {} rows, the cache holds {max}",
                    req.prompt.len(),
                    req.max_new_tokens,
                    self.cfg.page_size
                )
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back((id, req));
        Ok(id)
    }

    pub fn cache(&self) -> &PagedKvCache {
        &self.cache
    }

    /// Sequences in the running batch.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Requests not yet admitted.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Nothing running and nothing waiting.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// The greedy choice, for `sample` arguments: the argmax of `logits (vocab)`.
    pub fn greedy(logits: &Tensor) -> Result<u32> {
        logits.argmax(0)?.to_scalar::<u32>()
    }

    /// Moves waiting requests into the batch while it has room (and, with `max_pages`, while
    /// their longest length fits the pages not reserved), in arrival order.
    fn admit(&mut self) -> Result<()> {
        while self.running.len() < self.cfg.max_batch {
            let Some((_, req)) = self.waiting.front() else { break };
            let pages = req.max_cached().div_ceil(self.cfg.page_size);
            if self.cfg.max_pages.is_some_and(|max| self.reserved + pages > max) {
                break;
            }
            let Some((id, req)) = self.waiting.pop_front() else { break };
            self.cache.add_sequence(id)?;
            self.reserved += pages;
            self.running.push(Running { id, req, fed: 0, generated: vec![], reserved: pages });
        }
        Ok(())
    }

    /// One forward over the running batch (after admitting waiting requests): feeds each
    /// sequence its next prompt chunk or its last token, samples a token for every sequence
    /// whose prompt is complete with `sample(id, logits)` (f32 `(vocab)` on the CPU), and
    /// retires the sequences that stop. Nothing to do: an empty output. After an error (from
    /// the model or from `sample`) the batch's cache state is undefined: drop the scheduler.
    ///
    /// On CUDA, a step in which every sequence decodes replays a captured [`DecodeGraph`]
    /// (unless `CANDLE_FLASH_CUDA_GRAPHS=0`).
    pub fn step(&mut self, sample: &mut dyn FnMut(SeqId, &Tensor) -> Result<u32>) -> Result<StepOutput> {
        self.step_with(Choose::Sample(sample))
    }

    /// [`Scheduler::step`] with the greedy choice made on the model's device: only the chosen
    /// token ids come back to the host, not the `(B, vocab)` logits.
    pub fn step_greedy(&mut self) -> Result<StepOutput> {
        self.step_with(Choose::Greedy)
    }

    fn step_with(&mut self, mut choose: Choose) -> Result<StepOutput> {
        self.admit()?;
        let mut out = StepOutput::default();
        if self.running.is_empty() {
            return Ok(out);
        }
        let decoding = self.running.iter().all(|r| r.fed >= r.req.prompt.len());
        let use_graph = decoding && self.decode_graph()?;
        let chunk = self.cfg.prefill_chunk;
        let batch: Vec<(SeqId, &[u32])> = self.running.iter().map(|r| (r.id, r.input(chunk))).collect();
        let fed: Vec<usize> = batch.iter().map(|(_, t)| t.len()).collect();
        let greedy = matches!(choose, Choose::Greedy);
        let rows = if use_graph {
            let seqs: Vec<(SeqId, u32)> = batch.iter().map(|(id, t)| (*id, t[0])).collect();
            let Some(g) = self.graphs.last_mut() else { bail!("scheduler: decode graph vanished") };
            g.step(&mut self.cache, &seqs)?;
            if greedy {
                Rows::Tokens(g.tokens()?)
            } else {
                Rows::Logits(g.logits()?.to_device(&Device::Cpu)?)
            }
        } else {
            let logits = self.model.forward_paged(&batch, &mut self.cache)?;
            if greedy {
                Rows::Tokens(logits.argmax(D::Minus1)?.to_vec1::<u32>()?)
            } else {
                // One copy of the whole (B, vocab) to the host per step (none on the CPU), rather
                // than one device-to-host synchronisation per sequence when `sample` reads its row.
                Rows::Logits(logits.to_device(&Device::Cpu)?)
            }
        };
        for (i, n) in fed.into_iter().enumerate() {
            let r = &mut self.running[i];
            if r.fed < r.req.prompt.len() {
                r.fed += n;
                out.prefill_tokens += n;
                if r.fed < r.req.prompt.len() {
                    continue; // mid-prompt: these logits predict a prompt token
                }
            } else {
                out.decode_tokens += 1;
            }
            let token = match (&rows, &mut choose) {
                (Rows::Tokens(t), _) => t[i],
                (Rows::Logits(l), Choose::Sample(sample)) => sample(r.id, &l.get(i)?)?,
                (Rows::Logits(l), Choose::Greedy) => Self::greedy(&l.get(i)?)?,
            };
            r.generated.push(token);
            out.tokens.push((r.id, token));
        }
        // Retire finished sequences (in batch order; swap_remove would reorder the batch).
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            let reason = match r.generated.last() {
                Some(t) if r.req.stop_tokens.contains(t) => Some(FinishReason::Stop),
                _ if r.generated.len() >= r.req.max_new_tokens => Some(FinishReason::Length),
                _ => None,
            };
            match reason {
                Some(reason) => {
                    let r = self.running.remove(i);
                    self.cache.remove_sequence(r.id)?;
                    self.reserved -= r.reserved;
                    out.finished.push(Finished {
                        id: r.id,
                        prompt_tokens: r.req.prompt.len(),
                        tokens: r.generated,
                        reason,
                    });
                }
                None => i += 1,
            }
        }
        Ok(out)
    }

    /// Makes the last of `self.graphs` one that replays this step (every running sequence
    /// decoding): a captured graph whose batch is the running count rounded up to a power of two
    /// (at most `max_batch`; the extra rows are padding), whose table reaches every running
    /// sequence's longest length, over pages reserved for those lengths. Captures one when none
    /// fits. False (the step runs eagerly) off CUDA, with graphs disabled, or when the pool cannot
    /// be reserved within `max_pages`.
    fn decode_graph(&mut self) -> Result<bool> {
        if !self.model.device().is_cuda() || !cuda_graphs_enabled() || self.model.attn_impl() == AttnImpl::Fp8 {
            return Ok(false);
        }
        let n = self.running.len();
        let bucket = n.next_power_of_two().min(self.cfg.max_batch).max(n);
        let ids: Vec<SeqId> = self.running.iter().map(|r| r.id).collect();
        if let Some(i) = self.graphs.iter().position(|g| g.batch() == bucket && g.fits(&self.cache, &ids)) {
            let g = self.graphs.remove(i);
            self.graphs.push(g);
            return Ok(true);
        }
        // Pages for every running sequence at its longest, so that the pool does not grow (and
        // invalidate the graphs) while they run.
        let page = self.cfg.page_size;
        let longest = self.running.iter().map(|r| r.req.max_cached()).max().unwrap_or(1);
        let more: usize = self
            .running
            .iter()
            .map(|r| {
                self.cache
                    .pages_needed(Some(r.id), r.req.max_cached().saturating_sub(self.cache.seq_len(r.id).unwrap_or(0)))
            })
            .sum();
        let generation = self.cache.pool_generation();
        if self.cache.reserve(self.cache.pages_in_use() + more).is_err() {
            return Ok(false);
        }
        if self.cache.pool_generation() != generation {
            self.graphs.clear();
        }
        let max_len = longest.next_power_of_two().max(page);
        let g = DecodeGraph::capture(self.model, &self.cache, bucket, max_len)?;
        if self.graphs.len() >= MAX_GRAPHS {
            self.graphs.remove(0);
        }
        self.graphs.push(g);
        Ok(true)
    }

    /// Steps until every request has finished; the results in the order they finished.
    pub fn run(&mut self, sample: &mut dyn FnMut(SeqId, &Tensor) -> Result<u32>) -> Result<Vec<Finished>> {
        let mut done = vec![];
        while !self.is_idle() {
            done.extend(self.step(sample)?.finished);
        }
        Ok(done)
    }
}
