//! Text generation with a [`Llama`]: prefill, then one token at a time against the KV cache,
//! with a [`LogitsProcessor`] choosing each token.

use super::attention::AttnImpl;
use super::graph::{cuda_graphs_enabled, DecodeGraph};
use super::model::{Cache, Llama};
use super::sampling::LogitsProcessor;
use candle_core::{bail, Result, Tensor};
use std::time::Instant;

/// What [`Llama::generate`] produced, with its timings.
#[derive(Clone, Debug)]
pub struct Generation {
    /// The generated tokens (without the prompt; with the stop token when one ended it).
    pub tokens: Vec<u32>,
    pub prompt_tokens: usize,
    /// Seconds for the prompt's forward and the first token's sampling.
    pub prefill_secs: f64,
    /// Seconds for the remaining tokens (one forward each).
    pub decode_secs: f64,
}

impl Generation {
    pub fn prefill_tokens_per_sec(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
    }

    /// Decode steps (tokens after the first) per second.
    pub fn decode_tokens_per_sec(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.decode_secs.max(1e-9)
    }
}

impl Llama {
    /// Generates up to `max_new_tokens` after `prompt` (one sequence), stopping after any
    /// token of `stop_tokens`. `on_token` sees each token as soon as it is sampled (for
    /// streaming). Prefill is one forward over the whole prompt; decode feeds one token at a
    /// time against the KV cache.
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new_tokens: usize,
        sampler: &mut LogitsProcessor,
        stop_tokens: &[u32],
        mut on_token: impl FnMut(u32) -> Result<()>,
    ) -> Result<Generation> {
        if prompt.is_empty() {
            bail!("llama: the prompt has no tokens")
        }
        // (FP8 attention over the paged cache gathers keys on the host side: not capturable)
        if self.device().is_cuda() && cuda_graphs_enabled() && self.attn_impl() != AttnImpl::Fp8 {
            return self.generate_graph(prompt, max_new_tokens, sampler, stop_tokens, on_token);
        }
        let mut cache = Cache::new(self.config().num_hidden_layers, prompt.len() + max_new_tokens);
        let mut tokens = Vec::with_capacity(max_new_tokens);
        let t0 = Instant::now();
        let (mut prefill_secs, mut input) = (0.0, Tensor::new(prompt, self.device())?.unsqueeze(0)?);
        for step in 0..max_new_tokens {
            let logits = self.forward(&input, Some(&mut cache))?.squeeze(0)?;
            let next = sampler.sample(&logits)?;
            if step == 0 {
                prefill_secs = t0.elapsed().as_secs_f64();
            }
            tokens.push(next);
            on_token(next)?;
            if stop_tokens.contains(&next) {
                break;
            }
            input = Tensor::new(&[next], self.device())?.unsqueeze(0)?;
        }
        let decode_secs = if tokens.is_empty() { 0.0 } else { t0.elapsed().as_secs_f64() - prefill_secs };
        Ok(Generation { tokens, prompt_tokens: prompt.len(), prefill_secs, decode_secs })
    }

    /// [`Llama::generate`] on CUDA: the prompt through the paged forward, then every decode step
    /// replayed from one captured [`DecodeGraph`] (captured after the prefill; its capture is
    /// part of the decode time).
    fn generate_graph(
        &self,
        prompt: &[u32],
        max_new_tokens: usize,
        sampler: &mut LogitsProcessor,
        stop_tokens: &[u32],
        mut on_token: impl FnMut(u32) -> Result<()>,
    ) -> Result<Generation> {
        const SEQ: u64 = 0;
        let mut tokens = Vec::with_capacity(max_new_tokens);
        if max_new_tokens == 0 {
            return Ok(Generation { tokens, prompt_tokens: prompt.len(), prefill_secs: 0.0, decode_secs: 0.0 });
        }
        let max_len = prompt.len() + max_new_tokens;
        let mut cache = self.new_paged_cache(GRAPH_PAGE_SIZE, None)?;
        cache.reserve(max_len.div_ceil(GRAPH_PAGE_SIZE))?;
        cache.add_sequence(SEQ)?;
        let t0 = Instant::now();
        let logits = self.forward_paged(&[(SEQ, prompt)], &mut cache)?;
        let mut next = sampler.sample(&logits.get(0)?)?;
        let prefill_secs = t0.elapsed().as_secs_f64();
        tokens.push(next);
        on_token(next)?;
        let mut graph: Option<DecodeGraph> = None;
        while tokens.len() < max_new_tokens && !stop_tokens.contains(&next) {
            let g = match &mut graph {
                Some(g) => g,
                None => graph.insert(DecodeGraph::capture(self, &cache, 1, max_len)?),
            };
            g.step(&mut cache, &[(SEQ, next)])?;
            next = if sampler.is_greedy() { g.tokens()?[0] } else { sampler.sample(&g.logits()?.get(0)?)? };
            tokens.push(next);
            on_token(next)?;
        }
        let decode_secs = t0.elapsed().as_secs_f64() - prefill_secs;
        Ok(Generation { tokens, prompt_tokens: prompt.len(), prefill_secs, decode_secs })
    }
}

/// Rows per page of the cache [`Llama::generate`] decodes from on CUDA: large pages (one table
/// entry per 256 keys) cost nothing for a single sequence and keep the table short.
const GRAPH_PAGE_SIZE: usize = 256;
