//! Text generation with a [`Llama`]: prefill, then one token at a time against the KV cache,
//! with a [`LogitsProcessor`] choosing each token (feature `llama`).

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
}
