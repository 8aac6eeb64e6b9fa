//! A Llama-architecture language model on candle-nn whose attention runs through
//! [`candle_flash::flash_attn`].
//!
//! The attention block ([`LlamaAttention`], in `attention.rs`), rotary embeddings
//! ([`RotaryEmbedding`], [`apply_rope`], in `rotary.rs`), the KV cache ([`KvCache`], in
//! `kv_cache.rs`), the config ([`LlamaConfig`]), the full model's forward ([`Llama`], built from
//! a `VarBuilder` with Hugging Face tensor names), and batched serving: a paged KV cache shared
//! by many sequences ([`PagedKvCache`], in `paged_cache.rs`), the forward of several sequences'
//! new tokens packed together ([`Llama::forward_paged`]) and continuous batching over it
//! ([`Scheduler`], in `batch.rs`).
//!
//! The application (with tokenizers, serde, serde_json and minijinja): loading from GGUF files
//! and Hugging Face safetensors folders with the tokenizer ([`load()`]), reading `config.json` /
//! GGUF metadata ([`LlamaConfig::from_hf_json`], [`LlamaConfig::from_gguf`]), sampling
//! ([`LogitsProcessor`]), generation ([`Llama::generate`]) and chat templates
//! ([`apply_chat_template`]). The `llama` example is that application. With the cargo feature
//! `cuda` (candle-flash's CUDA kernels), the decode step runs from a CUDA graph ([`DecodeGraph`]).
//!
//! Layouts follow the flash kernels, not candle-transformers: activations stay `(B, S, H, D)`
//! from the projections to the attention, so that no transpose or copy sits between them,
//! and the K/V heads go to `flash_attn` as they are (GQA without repeat_kv). Rotary
//! embeddings use candle-nn's `rope_thd` (the non-interleaved "rotate half" variant in that
//! layout); GGUF Q/K weights, which llama.cpp stores permuted for the interleaved variant,
//! are un-permuted at load ([`unpermute_qk_rows`]).
//!
//! The block on its own, prefill then one decode step against its cache:
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_flash_llama::{AttnImpl, KvCache, LlamaAttention, RopeScaling, RotaryEmbedding};
//! use candle_nn::Linear;
//! let dev = Device::Cpu;
//! let (hidden, heads, kv_heads, head_dim) = (64, 4, 2, 16);
//! let proj = |out: usize, inp: usize| -> candle_core::Result<Linear> {
//!     Ok(Linear::new(Tensor::randn(0f32, 0.1, (out, inp), &dev)?, None))
//! };
//! let block = LlamaAttention::new(
//!     proj(heads * head_dim, hidden)?,
//!     proj(kv_heads * head_dim, hidden)?,
//!     proj(kv_heads * head_dim, hidden)?,
//!     proj(hidden, heads * head_dim)?,
//!     heads,
//!     kv_heads,
//!     AttnImpl::Flash,
//! )?;
//! let rotary = RotaryEmbedding::from_parts(head_dim, 10_000.0, &RopeScaling::None)?;
//! let mut cache = KvCache::default();
//! let x = Tensor::randn(0f32, 1., (1, 7, hidden), &dev)?;
//! let y = block.forward(&x, &rotary.rope(0, 7, DType::F32, &dev)?, Some(&mut cache))?;
//! let next = Tensor::randn(0f32, 1., (1, 1, hidden), &dev)?;
//! let y1 = block.forward(&next, &rotary.rope(7, 1, DType::F32, &dev)?, Some(&mut cache))?;
//! assert_eq!((y.dims(), y1.dims(), cache.len()), (&[1, 7, hidden][..], &[1, 1, hidden][..], 8));
//! # Ok::<(), candle_core::Error>(())
//! ```
//!
//! [`load()`] documents loading a model and generating text.

mod attention;
mod batch;
mod chat;
mod config;
mod decode_attn;
mod generate;
mod graph;
mod kv_cache;
mod load;
mod model;
mod paged_cache;
mod qlinear;
mod rotary;
mod sampling;

pub use attention::{AttnImpl, LlamaAttention};
pub use batch::{FinishReason, Finished, Request, Scheduler, SchedulerConfig, StepOutput};
pub use config::LlamaConfig;
pub use graph::{cuda_graphs_enabled, DecodeGraph};
pub use kv_cache::KvCache;
pub use model::{Cache, Llama};
pub use paged_cache::{PagedKvCache, SeqId};
pub use qlinear::{QEmbedding, QLinear};
pub use rotary::{
    apply_rope, apply_rope_interleaved, permute_qk_rows, unpermute_qk_rows, Llama3RopeScaling, Rope, RopeScaling,
    RotaryEmbedding,
};

pub use chat::{apply_chat_template, ChatMessage};
pub use generate::Generation;
pub use load::{
    gguf_to_hf_name, hf_to_gguf_name, load, load_gguf, load_safetensors_dir, load_with, tokenizer_from_gguf,
    unpermute_qtensor_rows, GgufWeights, LoadedLlama,
};
pub use sampling::{LogitsProcessor, Sampling};
