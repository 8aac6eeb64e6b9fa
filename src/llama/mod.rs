//! A Llama-architecture language model on candle-nn whose attention runs through
//! [`crate::flash_attn`]: the block ([`LlamaAttention`]), the full model ([`Llama`]), loading
//! from GGUF files and Hugging Face safetensors folders ([`load`]), sampling
//! ([`LogitsProcessor`]) and chat templates ([`apply_chat_template`]).
//!
//! Layouts follow the flash kernels, not candle-transformers: activations stay `(B, S, H, D)`
//! from the projections to the attention, so that no transpose or copy sits between them,
//! and the K/V heads go to `flash_attn` as they are (GQA without repeat_kv). Rotary
//! embeddings use candle-nn's `rope_thd` (the non-interleaved "rotate half" variant in that
//! layout); GGUF Q/K weights, which llama.cpp stores permuted for the interleaved variant,
//! are un-permuted at load ([`unpermute_qk_rows`]).
//!
//! ```no_run
//! use candle_core::{DType, Device};
//! use candle_flash::llama::{load, AttnImpl, LogitsProcessor, Sampling};
//! let loaded = load(
//!     std::path::Path::new("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
//!     DType::F32,
//!     &Device::Cpu,
//!     AttnImpl::Flash,
//!     &mut |_, _| {},
//! )?;
//! let tokenizer = loaded.tokenizer.as_ref().expect("the GGUF has a tokenizer");
//! let prompt = tokenizer.encode("The capital of France is", true).map_err(candle_core::Error::wrap)?;
//! let mut sampler = LogitsProcessor::new(Sampling::Greedy, 0);
//! let out = loaded.model.generate(prompt.get_ids(), 16, &mut sampler, &loaded.stop_token_ids, |_| Ok(()))?;
//! println!("{}", tokenizer.decode(&out.tokens, true).map_err(candle_core::Error::wrap)?);
//! # Ok::<(), candle_core::Error>(())
//! ```

mod attention;
mod chat;
mod config;
mod load;
mod model;
mod sampling;

pub use attention::{apply_rope, apply_rope_interleaved, AttnImpl, KvCache, LlamaAttention, Rope, RotaryEmbedding};
pub use chat::{apply_chat_template, ChatMessage};
pub use config::{Llama3RopeScaling, LlamaConfig, RopeScaling};
pub use load::{
    gguf_to_hf_name, hf_to_gguf_name, load, load_gguf, load_safetensors_dir, permute_qk_rows, tokenizer_from_gguf,
    unpermute_qk_rows, LoadedLlama,
};
pub use model::{Cache, Generation, Llama};
pub use sampling::{LogitsProcessor, Sampling};
