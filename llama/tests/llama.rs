//! The Llama block and model (candle-flash-llama).
//!
//! Rotary embeddings, the KV cache, the attention block's output and gradients (flash vs
//! naive), and a tiny random Llama built from its tensors (KV-cache decoding vs full
//! recomputation, CUDA vs CPU). Module `app`: the tiny model written as safetensors and as
//! GGUF and loaded back, generation, sampling, chat templates, and (when the workspace's
//! models/ has it) the real SmolLM2-135M-Instruct.

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_flash_llama::{
    apply_rope, apply_rope_interleaved, permute_qk_rows, unpermute_qk_rows, AttnImpl, Cache, DecodeGraph, FinishReason,
    KvCache, Llama, Llama3RopeScaling, LlamaAttention, LlamaConfig, Request, RopeScaling, RotaryEmbedding, Scheduler,
    SchedulerConfig,
};
use candle_nn::{Linear, VarBuilder};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::collections::HashMap;

const DEV: Device = Device::Cpu;

fn randn(rng: &mut StdRng, shape: &[usize], std: f32) -> Tensor {
    let n: usize = shape.iter().product();
    // Box-Muller from the seeded generator, so that every run builds the same model.
    let data: Vec<f32> = (0..n)
        .map(|_| {
            let (u1, u2): (f32, f32) = (rng.random::<f32>().max(1e-7), rng.random());
            std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
        })
        .collect();
    Tensor::from_vec(data, shape, &DEV).unwrap()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

fn max_abs(a: &Tensor) -> f32 {
    a.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

// The tiny model: GQA (4 query heads, 2 KV heads), two layers, Llama 3 rope scaling with a
// short original context so that the scaling changes most frequencies.
const VOCAB: usize = 97;
const HIDDEN: usize = 64;
const INTER: usize = 96;
const LAYERS: usize = 2;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 16;
const THETA: f64 = 10_000.0;
const ROPE_FACTOR: f64 = 4.0;
const ORIG_CTX: usize = 16;

/// Random weights under Hugging Face names.
fn tiny_weights(seed: u64, tied: bool) -> HashMap<String, Tensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut w = HashMap::new();
    let lin = |rng: &mut StdRng, out: usize, inp: usize| randn(rng, &[out, inp], 1.0 / (inp as f32).sqrt());
    let norm = |rng: &mut StdRng| (randn(rng, &[HIDDEN], 0.1) + 1.0).unwrap();
    w.insert("model.embed_tokens.weight".into(), randn(&mut rng, &[VOCAB, HIDDEN], 1.0));
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        w.insert(format!("{p}.input_layernorm.weight"), norm(&mut rng));
        w.insert(format!("{p}.post_attention_layernorm.weight"), norm(&mut rng));
        // Larger q/k weights make the attention peaked, so that a wrong rotary or mask shows.
        w.insert(format!("{p}.self_attn.q_proj.weight"), (lin(&mut rng, HEADS * HEAD_DIM, HIDDEN) * 3.0).unwrap());
        w.insert(format!("{p}.self_attn.k_proj.weight"), (lin(&mut rng, KV_HEADS * HEAD_DIM, HIDDEN) * 3.0).unwrap());
        w.insert(format!("{p}.self_attn.v_proj.weight"), lin(&mut rng, KV_HEADS * HEAD_DIM, HIDDEN));
        w.insert(format!("{p}.self_attn.o_proj.weight"), lin(&mut rng, HIDDEN, HEADS * HEAD_DIM));
        w.insert(format!("{p}.mlp.gate_proj.weight"), lin(&mut rng, INTER, HIDDEN));
        w.insert(format!("{p}.mlp.up_proj.weight"), lin(&mut rng, INTER, HIDDEN));
        w.insert(format!("{p}.mlp.down_proj.weight"), lin(&mut rng, HIDDEN, INTER));
    }
    w.insert("model.norm.weight".into(), norm(&mut rng));
    if !tied {
        w.insert("lm_head.weight".into(), lin(&mut rng, VOCAB, HIDDEN));
    }
    w
}

fn tiny_config(tied: bool) -> LlamaConfig {
    LlamaConfig {
        vocab_size: VOCAB,
        hidden_size: HIDDEN,
        intermediate_size: INTER,
        num_hidden_layers: LAYERS,
        num_attention_heads: HEADS,
        num_key_value_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        rms_norm_eps: 1e-5,
        rope_theta: THETA,
        rope_scaling: RopeScaling::Llama3(Llama3RopeScaling {
            factor: ROPE_FACTOR,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: ORIG_CTX,
        }),
        max_position_embeddings: 256,
        tie_word_embeddings: tied,
    }
}

/// The tiny model built from its tensors on `device` (no file).
fn tiny_model(seed: u64, tied: bool, attn: AttnImpl, device: &Device) -> Result<Llama> {
    let vb = VarBuilder::from_tensors(tiny_weights(seed, tied), DType::F32, device);
    Llama::load(vb, &tiny_config(tied), attn, &mut |_, _| {})
}

/// `n` greedy tokens after `prompt` through `forward` and a cache: what `generate` does with
/// `Sampling::Greedy` (module `app`'s tests check that the two agree).
fn greedy(model: &Llama, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
    let mut cache = Cache::new(model.config().num_hidden_layers, prompt.len() + n);
    let mut input = Tensor::new(prompt, model.device())?.unsqueeze(0)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let next = model.forward(&input, Some(&mut cache))?.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?;
        out.push(next);
        input = Tensor::new(&[next], model.device())?.unsqueeze(0)?;
    }
    Ok(out)
}

fn ids(tokens: &[u32]) -> Tensor {
    Tensor::new(tokens, &DEV).unwrap().unsqueeze(0).unwrap()
}

const PROMPT: &[u32] = &[5, 17, 42, 8, 91, 23, 64, 1, 33, 70, 12];

/// llama.cpp rotates interleaved pairs on permuted rows; the model rotates halves on
/// un-permuted rows. Same numbers, up to the order of the head dims.
#[test]
fn interleaved_rope_on_permuted_rows_equals_rope_on_hf_rows() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(7);
    let (b, s, h, d, hidden) = (2, 9, 3, 16, 24);
    let x = randn(&mut rng, &[b, s, hidden], 1.0);
    let w = randn(&mut rng, &[h * d, hidden], 0.3);
    let w_perm = permute_qk_rows(&w, h)?;
    assert_eq!(max_abs_diff(&unpermute_qk_rows(&w_perm, h)?, &w), 0.0);
    let rot = RotaryEmbedding::from_parts(d, 500.0, &RopeScaling::None)?;
    let rope = rot.rope(3, s, DType::F32, &DEV)?;
    let q_hf = apply_rope(&x.broadcast_matmul(&w.t()?)?.reshape((b, s, h, d))?, &rope)?;
    let q_cpp = apply_rope_interleaved(&x.broadcast_matmul(&w_perm.t()?)?.reshape((b, s, h, d))?, &rope)?;
    // Interleaved dim 2i+j is half-layout dim j*D/2 + i.
    let q_cpp_as_hf = q_cpp.reshape((b, s, h, d / 2, 2))?.transpose(3, 4)?.reshape((b, s, h, d))?;
    let diff = max_abs_diff(&q_hf, &q_cpp_as_hf);
    assert!(diff < 1e-5, "rope_i on permuted rows vs rope: {diff}");
    // And rope_i on the un-permuted rows is something else (the reason for all this).
    let wrong = apply_rope_interleaved(&x.broadcast_matmul(&w.t()?)?.reshape((b, s, h, d))?, &rope)?;
    assert!(max_abs_diff(&q_hf, &wrong) > 0.1);
    Ok(())
}

#[test]
fn kv_cache_decoding_equals_full_recomputation() -> Result<()> {
    for attn in [AttnImpl::Flash, AttnImpl::Naive] {
        let m = tiny_model(3, false, attn, &DEV)?;
        // Two sequences at once, so that the cache views are strided (B > 1).
        let other: Vec<u32> = PROMPT.iter().map(|t| (t * 7 + 3) % VOCAB as u32).collect();
        let full = Tensor::stack(&[Tensor::new(PROMPT, &DEV)?, Tensor::new(other.as_slice(), &DEV)?], 0)?;
        let reference = m.forward_all(&full, None)?; // (2, S, V)
                                                     // A small first buffer, so that the cache grows (doubles) twice on the way.
        let mut cache = Cache::new(LAYERS, 2);
        let mut pos = 0;
        // Prefill 4, then a chunk of 3 (Sq = 3 against Sk = 7: bottom-right causal), then one
        // token at a time.
        for chunk in [4, 3, 1, 1, 1, 1] {
            let logits = m.forward_all(&full.narrow(1, pos, chunk)?, Some(&mut cache))?;
            let want = reference.narrow(1, pos, chunk)?;
            let diff = max_abs_diff(&logits, &want);
            assert!(diff < 1e-4, "{attn:?}: positions {pos}..{}: cached vs full logits differ by {diff}", pos + chunk);
            pos += chunk;
            assert_eq!(cache.len(), pos);
        }
        assert!(cache.layers()[0].capacity() >= pos);
        assert_eq!(pos, PROMPT.len());
        // `forward` (lm_head on the last position only) is the last row of `forward_all`.
        let last = m.forward(&full, None)?;
        let diff = max_abs_diff(&last, &reference.narrow(1, pos - 1, 1)?.squeeze(1)?);
        assert!(diff < 1e-5, "{attn:?}: last-position logits differ by {diff}");
    }
    Ok(())
}

#[test]
fn kv_cache_appends_in_place_and_grows_by_doubling() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(11);
    let mut cache = KvCache::new(4);
    let mut all_k = vec![];
    for (step, s) in [3usize, 1, 1, 2, 5].into_iter().enumerate() {
        let k = randn(&mut rng, &[2, s, 2, 8], 1.0);
        let v = randn(&mut rng, &[2, s, 2, 8], 1.0);
        let (ck, cv) = cache.append(&k, &v)?;
        all_k.push(k);
        let want = Tensor::cat(&all_k, 1)?;
        assert_eq!(max_abs_diff(&ck, &want), 0.0, "step {step}");
        assert_eq!(cv.dims(), ck.dims());
    }
    assert_eq!(cache.len(), 12);
    assert_eq!(cache.capacity(), 16); // 4 -> 8 -> 16
                                      // Mismatched shapes are errors, not panics.
    assert!(cache
        .append(&Tensor::zeros((2, 1, 3, 8), DType::F32, &DEV)?, &Tensor::zeros((2, 1, 3, 8), DType::F32, &DEV)?)
        .is_err());
    Ok(())
}

/// The attention block through flash and through the naive reference: the same output and the
/// same gradients for the input and all four projections.
#[test]
fn attention_block_output_and_gradients_match_reference() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(5);
    let (b, s, hidden, h, hkv, d) = (2, 13, 48, 6, 2, 8);
    let mk = |rng: &mut StdRng, out: usize, inp: usize| {
        Var::from_tensor(&randn(rng, &[out, inp], 2.0 / (inp as f32).sqrt()))
    };
    let (wq, wk, wv, wo) = (
        mk(&mut rng, h * d, hidden)?,
        mk(&mut rng, hkv * d, hidden)?,
        mk(&mut rng, hkv * d, hidden)?,
        mk(&mut rng, hidden, h * d)?,
    );
    let x = Var::from_tensor(&randn(&mut rng, &[b, s, hidden], 1.0))?;
    let probe = randn(&mut rng, &[b, s, hidden], 1.0);
    let rot = RotaryEmbedding::from_parts(d, 10_000.0, &RopeScaling::None)?;
    let rope = rot.rope(0, s, DType::F32, &DEV)?;
    let block = |attn| {
        let lin = |w: &Var| Linear::new(w.as_tensor().clone(), None);
        LlamaAttention::new(lin(&wq), lin(&wk), lin(&wv), lin(&wo), h, hkv, attn)
    };
    let mut results = vec![];
    for attn in [AttnImpl::Flash, AttnImpl::Naive] {
        let y = block(attn)?.forward(x.as_tensor(), &rope, None)?;
        let grads = (&y * &probe)?.sum_all()?.backward()?;
        let g: Vec<Tensor> = [x.as_tensor(), wq.as_tensor(), wk.as_tensor(), wv.as_tensor(), wo.as_tensor()]
            .iter()
            .map(|t| grads.get(t).cloned().expect("gradient"))
            .collect();
        results.push((y, g));
    }
    let (yf, gf) = &results[0];
    let (yn, gn) = &results[1];
    let diff = max_abs_diff(yf, yn);
    assert!(diff <= 1e-5 * max_abs(yn).max(1.0), "block output: flash vs naive {diff}");
    for (name, (a, b)) in ["x", "wq", "wk", "wv", "wo"].iter().zip(gf.iter().zip(gn)) {
        let (diff, scale) = (max_abs_diff(a, b), max_abs(b));
        assert!(scale > 1e-3, "gradient of {name} is zero");
        assert!(diff <= 1e-4 * scale, "gradient of {name}: flash vs naive differ by {diff} (scale {scale})");
    }

    // The cached path of the same block (no autograd) gives the same output: prefill 9, then
    // decode the remaining 4 one by one.
    let block = block(AttnImpl::Flash)?;
    let x = x.as_tensor().detach();
    let mut cache = KvCache::new(4);
    let mut parts = vec![];
    let mut pos = 0;
    for chunk in [9, 1, 1, 1, 1] {
        let rope = rot.rope(pos, chunk, DType::F32, &DEV)?;
        parts.push(block.forward(&x.narrow(1, pos, chunk)?, &rope, Some(&mut cache))?);
        pos += chunk;
    }
    let diff = max_abs_diff(&Tensor::cat(&parts, 1)?, yf);
    assert!(diff < 1e-5 * max_abs(yf).max(1.0), "cached block output differs by {diff}");
    // A rope table for the wrong position is refused.
    let bad = rot.rope(0, 1, DType::F32, &DEV)?;
    assert!(block.forward(&x.narrow(1, 0, 1)?, &bad, Some(&mut cache)).is_err());
    Ok(())
}

/// Random q, k, v, o projections of an attention block (scaled for unit-variance outputs).
fn block_weights(rng: &mut StdRng, hidden: usize, h: usize, hkv: usize, d: usize) -> [Tensor; 4] {
    let mut mk = |out: usize, inp: usize| randn(rng, &[out, inp], 2.0 / (inp as f32).sqrt());
    [mk(h * d, hidden), mk(hkv * d, hidden), mk(hkv * d, hidden), mk(hidden, h * d)]
}

/// The attention block with projections `w` (`block_weights`).
fn attention_block(w: &[Tensor; 4], h: usize, hkv: usize, attn: AttnImpl) -> Result<LlamaAttention> {
    let lin = |w: &Tensor| Linear::new(w.clone(), None);
    LlamaAttention::new(lin(&w[0]), lin(&w[1]), lin(&w[2]), lin(&w[3]), h, hkv, attn)
}

/// The block with learnable sinks: flash and naive agree on the output and on the sinks'
/// gradient (a `Var`), and the cached path (prefill, then one-token decodes) on the output.
#[test]
fn attention_block_with_sinks_matches_reference() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(9);
    let (b, s, hidden, h, hkv, d) = (2, 11, 32, 4, 2, 8);
    let w = block_weights(&mut rng, hidden, h, hkv, d);
    let x = randn(&mut rng, &[b, s, hidden], 1.0);
    let probe = randn(&mut rng, &[b, s, hidden], 1.0);
    let sinks = Var::from_tensor(&Tensor::new(&[-6f32, -0.5, 1.5, 5.0], &DEV)?)?;
    let rot = RotaryEmbedding::from_parts(d, 10_000.0, &RopeScaling::None)?;
    let block = |attn| attention_block(&w, h, hkv, attn)?.with_sinks(Some(sinks.as_tensor().clone()));
    let rope = rot.rope(0, s, DType::F32, &DEV)?;
    let mut results = vec![];
    for attn in [AttnImpl::Flash, AttnImpl::Naive] {
        let y = block(attn)?.forward(&x, &rope, None)?;
        let grads = (&y * &probe)?.sum_all()?.backward()?;
        results.push((y, grads.get(sinks.as_tensor()).cloned().expect("the sinks' gradient")));
    }
    let ((yf, gf), (yn, gn)) = (&results[0], &results[1]);
    assert!(max_abs_diff(yf, yn) <= 1e-5 * max_abs(yn).max(1.0), "block output with sinks");
    assert!(max_abs(gn) > 1e-3, "the sinks' gradient is zero");
    assert!(max_abs_diff(gf, gn) <= 1e-4 * max_abs(gn), "sinks' gradient: flash {gf} vs naive {gn}");
    // Without the sinks the output differs (the sinks are used), and the cached path agrees.
    let plain = block(AttnImpl::Flash)?.with_sinks(None)?.forward(&x, &rope, None)?;
    assert!(max_abs_diff(&plain, yf) > 1e-3);
    assert!(block(AttnImpl::Flash)?.with_sinks(Some(Tensor::zeros(3, DType::F32, &DEV)?)).is_err());
    let block = block(AttnImpl::Flash)?;
    let mut cache = KvCache::new(4);
    let mut parts = vec![];
    let mut pos = 0;
    for chunk in [7, 1, 1, 1, 1] {
        let rope = rot.rope(pos, chunk, DType::F32, &DEV)?;
        parts.push(block.forward(&x.narrow(1, pos, chunk)?, &rope, Some(&mut cache))?);
        pos += chunk;
    }
    let diff = max_abs_diff(&Tensor::cat(&parts, 1)?, yf);
    assert!(diff < 1e-5 * max_abs(yf).max(1.0), "cached block output with sinks differs by {diff}");
    Ok(())
}

/// Two documents packed in one batch row through a same-document block mask: each document's
/// rows equal the block run on that document alone (RoPE is relative, so the second document
/// keeps its packed positions), flash and naive agree, and the input's gradient flows.
#[test]
fn attention_block_with_packed_documents() -> Result<()> {
    use candle_flash::{BlockMask, MaskSpec};
    let mut rng = StdRng::seed_from_u64(21);
    let (s, hidden, h, hkv, d, first) = (11, 32, 4, 2, 8, 5);
    let w = block_weights(&mut rng, hidden, h, hkv, d);
    let x = Var::from_tensor(&randn(&mut rng, &[1, s, hidden], 1.0))?;
    let rot = RotaryEmbedding::from_parts(d, 10_000.0, &RopeScaling::None)?;
    let block = |attn| attention_block(&w, h, hkv, attn);
    let docs: Vec<u32> = (0..s).map(|i| u32::from(i >= first)).collect();
    let ids = Tensor::from_vec(docs, (1, s), &DEV)?;
    let mask = BlockMask::from_spec(&MaskSpec::same_document(&ids, &ids), 1, 1, s, s, &DEV)?;
    let rope = rot.rope(0, s, DType::F32, &DEV)?;
    let yf = block(AttnImpl::Flash)?.forward_block_masked(&x, &rope, &mask)?;
    let yn = block(AttnImpl::Naive)?.forward_block_masked(&x, &rope, &mask)?;
    assert!(max_abs_diff(&yf, &yn) <= 1e-5 * max_abs(&yn).max(1.0), "packed block: flash vs naive");
    let alone = |start: usize, len: usize| -> Result<Tensor> {
        block(AttnImpl::Flash)?.forward(&x.narrow(1, start, len)?, &rot.rope(start, len, DType::F32, &DEV)?, None)
    };
    let separate = Tensor::cat(&[alone(0, first)?, alone(first, s - first)?], 1)?;
    let diff = max_abs_diff(&yf, &separate);
    assert!(diff <= 1e-5 * max_abs(&separate).max(1.0), "packed documents differ from separate runs by {diff}");
    // the mask is used: the causal block without it lets the second document see the first
    let causal = block(AttnImpl::Flash)?.forward(&x, &rope, None)?;
    assert!(max_abs_diff(&causal.narrow(1, first, s - first)?, &yf.narrow(1, first, s - first)?) > 1e-3);
    let grads = yf.sum_all()?.backward()?;
    assert!(max_abs(grads.get(x.as_tensor()).expect("the input's gradient")) > 0.0);
    assert!(block(AttnImpl::Fp8)?.forward_block_masked(&x, &rope, &mask).is_err());
    Ok(())
}

#[test]
fn bad_model_inputs_are_errors() -> Result<()> {
    let mut cfg = tiny_config(false);
    cfg.validate()?;
    cfg.num_key_value_heads = 3;
    assert!(cfg.validate().is_err());
    let vb = VarBuilder::from_tensors(tiny_weights(4, false), DType::F32, &DEV);
    assert!(Llama::load(vb, &cfg, AttnImpl::Flash, &mut |_, _| {}).is_err());
    assert!("flashy".parse::<AttnImpl>().is_err());
    assert_eq!("naive".parse::<AttnImpl>()?, AttnImpl::Naive);
    // A cache with the wrong number of layers, an empty input.
    let m = tiny_model(4, true, AttnImpl::Flash, &DEV)?;
    assert!(m.forward(&ids(&[1, 2]), Some(&mut Cache::new(1, 4))).is_err());
    assert!(m.forward(&ids(&[]), None).is_err());
    Ok(())
}

/// Per-sequence reference for the batched forward: the logits of every position of `prompt`
/// followed by `extra`, one sequence alone through the contiguous cache.
fn alone_logits(m: &Llama, tokens: &[u32]) -> Result<Tensor> {
    m.forward_all(&ids(tokens).to_device(m.device())?, None)?.squeeze(0)
}

/// The batched forward against a paged cache: sequences of different lengths join (prompt
/// prefills packed beside one-token decodes), one prompt arrives in chunks, one sequence
/// leaves and its pages serve a later one; every logit row equals that sequence's alone.
#[test]
fn paged_batch_logits_equal_per_sequence_logits() -> Result<()> {
    // On the CPU every row keeps its arithmetic alone (1e-4 is rounding in the logits' printout
    // sense: they agree to f32 noise); on CUDA the batched rows go through the paged kernels and
    // cuBLAS products of other shapes than alone, so f32 summation-order noise.
    let mut devices = vec![(DEV, 1e-4)];
    match candle_core::Device::new_cuda(0) {
        Ok(gpu) if cfg!(feature = "cuda") => devices.push((gpu, 1e-3)),
        _ => println!("paged batch on CUDA skipped: no GPU (or built without the `cuda` feature)"),
    }
    for (device, tol) in devices {
        paged_batch_on(&device, tol)?;
    }
    Ok(())
}

fn paged_batch_on(device: &Device, tol: f32) -> Result<()> {
    for attn in [AttnImpl::Flash, AttnImpl::Naive] {
        let m = tiny_model(6, false, attn, device)?;
        let seq = |seed: u32, n: usize| -> Vec<u32> {
            (0..n as u32).map(|i| (i * 31 + seed * 17 + 5) % VOCAB as u32).collect()
        };
        // Token streams (prompt then fed tokens): 0 long, 1 short (few-rows path), 2 joins late
        // and is chunked, 3 reuses 1's pages.
        let streams = [seq(1, 19), seq(2, 9), seq(3, 14), seq(4, 8)];
        let want: Vec<Tensor> = streams.iter().map(|s| alone_logits(&m, s)).collect::<Result<_>>()?;
        let mut cache = m.new_paged_cache(4, Some(32))?;
        // Each step: (sequence, tokens fed from its stream).
        let steps: &[&[(u64, usize)]] = &[
            &[(0, 11), (1, 3)],
            &[(0, 1), (1, 1), (2, 5)],
            &[(1, 1), (0, 1), (2, 6)],
            &[(0, 1), (1, 4), (2, 1)], // 1 ends after this step
            &[(2, 1), (3, 5), (0, 1)],
            &[(3, 3), (0, 4), (2, 1)],
        ];
        let mut fed = [0usize; 4];
        let mut peak_capacity = 0;
        for (i, step) in steps.iter().enumerate() {
            for &(s, _) in step.iter() {
                if fed[s as usize] == 0 {
                    cache.add_sequence(s)?;
                }
            }
            let batch: Vec<(u64, &[u32])> =
                step.iter().map(|&(s, n)| (s, &streams[s as usize][fed[s as usize]..fed[s as usize] + n])).collect();
            let logits = m.forward_paged(&batch, &mut cache)?;
            assert_eq!(logits.dims(), &[step.len(), VOCAB]);
            for (row, &(s, n)) in step.iter().enumerate() {
                let s = s as usize;
                fed[s] += n;
                assert_eq!(cache.seq_len(s as u64), Some(fed[s]));
                let diff = max_abs_diff(&logits.get(row)?, &want[s].get(fed[s] - 1)?);
                assert!(
                    diff < tol,
                    "{attn:?} on {device:?} step {i} sequence {s}: batched vs alone logits differ by {diff}"
                );
            }
            if i == 3 {
                let before = cache.pages_in_use();
                cache.remove_sequence(1)?;
                assert_eq!(cache.pages_in_use(), before - 9usize.div_ceil(4));
            }
            peak_capacity = peak_capacity.max(cache.capacity_pages());
        }
        assert_eq!(fed, [19, 9, 14, 8]);
        // Pages follow the tokens in use: 19 + 14 + 8 rows in pages of 4 at the end, 1's pages
        // reused by 3 (the pool never grew past its first 16 pages).
        assert_eq!(cache.pages_in_use(), 5 + 4 + 2);
        assert_eq!(peak_capacity, 16);
        for s in [0, 2, 3] {
            cache.remove_sequence(s)?;
        }
        assert_eq!(cache.pages_in_use(), 0);
    }
    Ok(())
}

/// Continuous batching: more requests than batch slots, of different prompt lengths and token
/// budgets, one ending on a stop token; each one's greedy tokens equal its run alone (through
/// the scheduler with one slot, bitwise, and through the contiguous cache), and the pages of
/// finished sequences serve the waiting ones (the pool stays within `max_pages`).
#[test]
fn scheduler_joins_leaves_and_reuses_pages() -> Result<()> {
    let m = tiny_model(7, true, AttnImpl::Flash, &DEV)?;
    let prompts: Vec<Vec<u32>> = [(1u32, 12usize), (2, 3), (3, 7), (4, 1), (5, 20), (6, 5)]
        .iter()
        .map(|&(seed, n)| (0..n as u32).map(|i| (i * 13 + seed * 29 + 1) % VOCAB as u32).collect())
        .collect();
    let budgets = [6usize, 9, 4, 7, 5, 8];
    let alone: Vec<Vec<u32>> = prompts.iter().zip(budgets).map(|(p, n)| greedy(&m, p, n)).collect::<Result<_>>()?;
    // Request 2 stops at its third token.
    let stop = alone[2][2];
    let want_len = |i: usize| if i == 2 { alone[2].iter().position(|&t| t == stop).unwrap() + 1 } else { budgets[i] };
    let run = |max_batch: usize, chunk: Option<usize>| -> Result<(Vec<Vec<u32>>, usize, usize)> {
        let cfg = SchedulerConfig { max_batch, page_size: 4, max_pages: Some(12), prefill_chunk: chunk };
        let mut sched = Scheduler::new(&m, cfg)?;
        for (i, (p, n)) in prompts.iter().zip(budgets).enumerate() {
            let req = Request::new(p.clone(), n);
            let id = sched.add(if i == 2 { req.stop_tokens(&[stop]) } else { req })?;
            assert_eq!(id, i as u64);
        }
        let (mut out, mut peak_running, mut peak_capacity) = (vec![vec![]; prompts.len()], 0, 0);
        while !sched.is_idle() {
            let step = sched.step(&mut |_, logits| Scheduler::greedy(logits))?;
            peak_running = peak_running.max(sched.running() + step.finished.len());
            peak_capacity = peak_capacity.max(sched.cache().capacity_pages());
            for f in step.finished {
                let i = f.id as usize;
                assert_eq!(f.reason, if i == 2 { FinishReason::Stop } else { FinishReason::Length });
                assert_eq!(f.prompt_tokens, prompts[i].len());
                out[i] = f.tokens;
            }
        }
        assert_eq!(sched.cache().pages_in_use(), 0);
        Ok((out, peak_running, peak_capacity))
    };
    let (one, _, _) = run(1, None)?;
    for (i, toks) in one.iter().enumerate() {
        assert_eq!(toks.as_slice(), &alone[i][..want_len(i)], "request {i}: scheduler alone vs contiguous");
    }
    for (max_batch, chunk) in [(3, None), (4, Some(3)), (6, None)] {
        let (out, peak_running, peak_capacity) = run(max_batch, chunk)?;
        // Not every request fits the 12 pages at once: the batch is full only up to that.
        assert!(peak_running <= max_batch && peak_running >= 2, "max_batch {max_batch}: peak {peak_running}");
        assert!(peak_capacity <= 12);
        if chunk.is_none() {
            assert_eq!(out, one, "max_batch {max_batch}: batched vs alone (bitwise)");
        } else {
            for (i, toks) in out.iter().enumerate() {
                assert_eq!(toks.as_slice(), &alone[i][..want_len(i)], "request {i}: chunked prefill");
            }
        }
    }
    Ok(())
}

#[test]
fn bad_batch_inputs_are_errors() -> Result<()> {
    let m = tiny_model(8, true, AttnImpl::Flash, &DEV)?;
    let sched = |cfg: SchedulerConfig| Scheduler::new(&m, cfg);
    assert!(sched(SchedulerConfig { max_batch: 0, ..Default::default() }).is_err());
    assert!(sched(SchedulerConfig { page_size: 0, ..Default::default() }).is_err());
    assert!(sched(SchedulerConfig { prefill_chunk: Some(0), ..Default::default() }).is_err());
    assert!(sched(SchedulerConfig { max_pages: Some(0), ..Default::default() }).is_err());
    let mut s = sched(SchedulerConfig { page_size: 4, max_pages: Some(2), ..Default::default() })?;
    assert!(s.add(Request::new(vec![], 3)).is_err());
    assert!(s.add(Request::new(vec![1], 0)).is_err());
    assert!(s.add(Request::new(vec![VOCAB as u32], 3)).is_err());
    let too_long = s.add(Request::new(vec![1; 6], 4)).unwrap_err().to_string();
    assert!(too_long.contains("needs 3 pages"), "{too_long}");
    assert!(s.is_idle());
    // The cache: unknown or repeated sequences, empty steps, a pool cap.
    let mut cache = m.new_paged_cache(4, Some(2))?;
    assert!(m.forward_paged(&[(0, &[1, 2][..])], &mut cache).is_err());
    cache.add_sequence(0)?;
    assert!(cache.add_sequence(0).is_err());
    assert!(cache.remove_sequence(5).is_err());
    assert!(m.forward_paged(&[], &mut cache).is_err());
    assert!(m.forward_paged(&[(0, &[][..])], &mut cache).is_err());
    assert!(m.forward_paged(&[(0, &[1][..]), (0, &[2][..])], &mut cache).is_err());
    let full = m.forward_paged(&[(0, &[1; 9][..])], &mut cache).unwrap_err().to_string();
    assert!(full.contains("capped at 2 pages"), "{full}");
    assert_eq!(cache.seq_len(0), Some(0));
    // A token outside the vocabulary (the scheduler checks prompts; the forward checks too).
    cache.add_sequence(1)?;
    assert!(m.forward_paged(&[(1, &[VOCAB as u32][..])], &mut cache).is_err());
    // A cache for another model shape.
    let mut cfg = tiny_config(true);
    cfg.num_hidden_layers = 1;
    let mut other = candle_flash_llama::PagedKvCache::new(&cfg, 4, None, DType::F32, &DEV)?;
    other.add_sequence(0)?;
    assert!(m.forward_paged(&[(0, &[1][..])], &mut other).is_err());
    Ok(())
}

/// The tiny model generates the same greedy tokens on CUDA (flash and naive) as on the CPU;
/// skipped with a printed reason when no GPU is present.
#[test]
fn cuda_greedy_tokens_equal_cpu() -> Result<()> {
    let gpu = match candle_core::Device::new_cuda(0) {
        Ok(d) if cfg!(feature = "cuda") => d,
        Ok(_) | Err(_) => {
            println!("skipping CUDA llama test: no GPU (or built without the `cuda` feature)");
            return Ok(());
        }
    };
    let cpu = greedy(&tiny_model(2, false, AttnImpl::Flash, &DEV)?, &PROMPT[..5], 40)?;
    for attn in [AttnImpl::Flash, AttnImpl::Naive] {
        assert_eq!(
            greedy(&tiny_model(2, false, attn, &gpu)?, &PROMPT[..5], 40)?,
            cpu,
            "{attn:?} on CUDA vs flash on CPU"
        );
    }
    Ok(())
}

/// `AttnImpl::Fp8` (q, k, v quantized to e4m3 per head at every call): the logits of every
/// prompt position stay near the flash model's (‖Δ‖ / ‖flash‖ < 25%: the tiny random model's
/// logits carry e4m3's ~4% input error through its layers, 10% measured on the CPU), through the
/// contiguous forward and through the paged one (keys gathered from the pages). CPU in f32 (the dequantizing path); CUDA in bf16 (the FP8 tensor-core
/// kernel on Hopper).
#[test]
fn fp8_attention_logits_stay_near_flash() -> Result<()> {
    let mut devices = vec![(DEV, DType::F32)];
    match candle_core::Device::new_cuda(0) {
        Ok(gpu) if cfg!(feature = "cuda") => devices.push((gpu, DType::BF16)),
        _ => println!("fp8 llama on CUDA skipped: no GPU (or built without the `cuda` feature)"),
    }
    let rel = |a: &Tensor, b: &Tensor| -> Result<f32> {
        let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
        Ok(((&a - &b)?.sqr()?.sum_all()?.to_scalar::<f32>()? / b.sqr()?.sum_all()?.to_scalar::<f32>()?).sqrt())
    };
    for (device, dtype) in devices {
        let model = |attn| {
            let vb = VarBuilder::from_tensors(tiny_weights(9, false), dtype, &device);
            Llama::load(vb, &tiny_config(false), attn, &mut |_, _| {})
        };
        let (flash, fp8) = (model(AttnImpl::Flash)?, model(AttnImpl::Fp8)?);
        let input = ids(PROMPT).to_device(&device)?;
        let (want, got) = (flash.forward_all(&input, None)?, fp8.forward_all(&input, None)?);
        let e = rel(&got, &want)?;
        println!("{:?} {dtype:?}: fp8 vs flash logits ‖Δ‖/‖ref‖ {e:.4}", device.location());
        assert!(e < 0.25, "{e}");
        // paged: two sequences in one step
        let (a, b) = (&PROMPT[..7], &PROMPT[3..]);
        let paged = |m: &Llama| -> Result<Tensor> {
            let mut cache = m.new_paged_cache(4, Some(16))?;
            cache.add_sequence(0)?;
            cache.add_sequence(1)?;
            m.forward_paged(&[(0, a), (1, b)], &mut cache)
        };
        let e = rel(&paged(&fp8)?, &paged(&flash)?)?;
        println!("{:?} {dtype:?}: fp8 vs flash paged logits ‖Δ‖/‖ref‖ {e:.4}", device.location());
        assert!(e < 0.25, "{e}");
    }
    assert_eq!("fp8".parse::<AttnImpl>()?, AttnImpl::Fp8);
    Ok(())
}

/// Decode steps replayed from a captured CUDA graph equal the eager paged forward: three
/// sequences of different lengths (a graph of batch 4, so one padding row), steps with all three
/// and with two (one more padding row), every logit row and greedy token compared; a step that
/// would outgrow the graph's length, or that follows a reallocation of the pool, is an error
/// that changes nothing. Without a GPU, capturing on the CPU is an error (and the rest skips);
/// capturing a model with FP8 attention is an error too.
#[test]
fn cuda_graph_decode_equals_eager_paged_forward() -> Result<()> {
    let cpu_model = tiny_model(3, true, AttnImpl::Flash, &DEV)?;
    let mut cpu_cache = cpu_model.new_paged_cache(4, None)?;
    cpu_cache.reserve(8)?;
    assert!(DecodeGraph::capture(&cpu_model, &cpu_cache, 1, 16).is_err(), "a graph on the CPU must be an error");
    let gpu = match candle_core::Device::new_cuda(0) {
        Ok(d) if cfg!(feature = "cuda") => d,
        Ok(_) | Err(_) => {
            println!("CUDA graph decode skipped: no GPU (or built without the `cuda` feature)");
            return Ok(());
        }
    };
    // FP8 attention is not captured (its steps gather the keys by a row list made on the host)
    let vb = VarBuilder::from_tensors(tiny_weights(3, true), DType::BF16, &gpu);
    let fp8 = Llama::load(vb, &tiny_config(true), AttnImpl::Fp8, &mut |_, _| {})?;
    let mut fp8_cache = fp8.new_paged_cache(4, None)?;
    fp8_cache.reserve(8)?;
    match DecodeGraph::capture(&fp8, &fp8_cache, 1, 16) {
        Err(e) => assert!(e.to_string().contains("FP8"), "{e}"),
        Ok(_) => panic!("a decode graph with FP8 attention was captured"),
    }
    for dtype in [DType::F32, DType::BF16] {
        let vb = VarBuilder::from_tensors(tiny_weights(3, true), dtype, &gpu);
        let m = Llama::load(vb, &tiny_config(true), AttnImpl::Flash, &mut |_, _| {})?;
        let prompts: [Vec<u32>; 3] = [PROMPT.to_vec(), PROMPT[..3].to_vec(), PROMPT[2..9].to_vec()];
        let (page, max_len) = (4, 40);
        // Two caches with the same history: one decoded eagerly, one through the graph.
        let mut eager = m.new_paged_cache(page, None)?;
        let mut graphed = m.new_paged_cache(page, None)?;
        graphed.reserve(3 * max_len / page)?;
        let mut next = [0u32; 3];
        for (c, cache) in [&mut eager, &mut graphed].into_iter().enumerate() {
            for (s, p) in prompts.iter().enumerate() {
                cache.add_sequence(s as u64)?;
                let logits = m.forward_paged(&[(s as u64, p)], cache)?;
                let t = logits.get(0)?.argmax(0)?.to_scalar::<u32>()?;
                if c == 0 {
                    next[s] = t;
                } else {
                    assert_eq!(t, next[s], "{dtype:?}: prefill differs between two identical caches");
                }
            }
        }
        println!("{dtype:?}: prefill done, capturing");
        let mut graph = DecodeGraph::capture(&m, &graphed, 4, max_len)?;
        println!("{dtype:?}: captured");
        // Relative to the largest logit: the two runs differ in the attention's split-KV plan.
        let tol = if dtype == DType::F32 { 1e-4 } else { 3e-2 };
        for step in 0..24 {
            // Sequence 1 leaves after 12 steps: the later steps run 2 rows of the 4.
            let live: Vec<u64> = if step < 12 { vec![0, 1, 2] } else { vec![0, 2] };
            let seqs: Vec<(u64, u32)> = live.iter().map(|&s| (s, next[s as usize])).collect();
            let want = m.forward_paged(
                &seqs.iter().map(|(s, t)| (*s, std::slice::from_ref(t))).collect::<Vec<_>>(),
                &mut eager,
            )?;
            graph.step(&mut graphed, &seqs)?;
            let got = graph.logits()?;
            println!("{dtype:?}: step {step} launched and read");
            let diff = max_abs_diff(&got, &want);
            assert!(diff <= tol * max_abs(&want), "{dtype:?} step {step}: graph vs eager logits differ by {diff}");
            let tokens = graph.tokens()?;
            assert_eq!(tokens, got.argmax(1)?.to_vec1::<u32>()?, "{dtype:?} step {step}: the graph's argmax");
            if dtype == DType::F32 {
                // (bf16 rounds the two attention split plans apart enough to flip near ties.)
                assert_eq!(tokens, want.argmax(1)?.to_vec1::<u32>()?, "{dtype:?} step {step}: greedy tokens");
            }
            for (&s, &t) in live.iter().zip(&tokens) {
                assert_eq!(graphed.seq_len(s), eager.seq_len(s));
                next[s as usize] = t;
            }
        }
        // Sequence 0 is at 11 + 24 = 35 tokens; 5 more steps reach 40, the sixth would pass it.
        for _ in 0..5 {
            graph.step(&mut graphed, &[(0, 1)])?;
        }
        assert_eq!(graphed.seq_len(0), Some(40));
        assert!(graph.step(&mut graphed, &[(0, 1)]).is_err(), "a step past max_seq_len must be an error");
        assert_eq!(graphed.seq_len(0), Some(40), "a refused step must not advance the cache");
        // Too many sequences for the graph's batch.
        graphed.add_sequence(7)?;
        graphed.add_sequence(8)?;
        let five: Vec<(u64, u32)> = [1, 2, 7, 8, 0].iter().map(|&s| (s, 1)).collect();
        assert!(graph.step(&mut graphed, &five).is_err(), "five sequences in a graph of four must be an error");
        // A reallocated pool: the graph's buffers are stale.
        let cap = graphed.capacity_pages();
        graphed.reserve(cap + 1)?;
        assert!(graph.step(&mut graphed, &[(2, 1)]).is_err(), "a step after the pool grew must be an error");
    }
    Ok(())
}

/// The scheduler on CUDA (decode steps through graphs, batch buckets 4 and 2, with padding
/// rows as sequences leave) generates for each request the greedy tokens of that request alone
/// through the contiguous cache.
#[test]
fn cuda_scheduler_with_graphs_equals_alone() -> Result<()> {
    let gpu = match candle_core::Device::new_cuda(0) {
        Ok(d) if cfg!(feature = "cuda") => d,
        Ok(_) | Err(_) => {
            println!("CUDA scheduler skipped: no GPU (or built without the `cuda` feature)");
            return Ok(());
        }
    };
    let m = tiny_model(5, true, AttnImpl::Flash, &gpu)?;
    let reqs: Vec<(Vec<u32>, usize)> =
        vec![(PROMPT.to_vec(), 20), (PROMPT[..2].to_vec(), 6), (PROMPT[3..].to_vec(), 14), (PROMPT[1..6].to_vec(), 9)];
    let mut sched = Scheduler::new(&m, SchedulerConfig { max_batch: 3, page_size: 4, ..Default::default() })?;
    for (p, n) in &reqs {
        sched.add(Request::new(p.clone(), *n))?;
    }
    let mut done = vec![];
    while !sched.is_idle() {
        done.extend(sched.step_greedy()?.finished);
    }
    done.sort_by_key(|f| f.id);
    for (f, (p, n)) in done.iter().zip(&reqs) {
        assert_eq!(f.tokens, greedy(&m, p, *n)?, "request {}: scheduler with graphs vs alone", f.id);
    }
    Ok(())
}

/// The fused residual add + RMSNorm and silu · mul against their candle compositions: rows 1,
/// 17 and 113 of 64 and 576 values, with and without a residual, gate and up as views of one
/// fused `[gate | up]` product. CPU: the compositions themselves (bitwise); CUDA: one kernel each,
/// in f32 rounded once, within two units of the dtype's last place of the largest value. Bad
/// shapes are errors.
#[test]
fn fused_add_rms_norm_and_silu_mul_match_composition() -> Result<()> {
    use candle_flash::fused::{add_rms_norm, silu_mul};
    let mut devices = vec![(DEV, [0.0f32; 3])];
    match candle_core::Device::new_cuda(0) {
        Ok(gpu) if cfg!(feature = "cuda") => devices.push((gpu, [1e-5, 2.0 / 1024.0, 2.0 / 128.0])),
        _ => println!("fused ops on CUDA skipped: no GPU (or built without the `cuda` feature)"),
    }
    for (dev, tols) in &devices {
        for (dtype, tol) in [DType::F32, DType::F16, DType::BF16].into_iter().zip(*tols) {
            for (rows, n) in [(1, 64), (17, 576), (113, 64)] {
                let r =
                    |shape: (usize, usize)| -> Result<Tensor> { Tensor::randn(0f32, 1., shape, dev)?.to_dtype(dtype) };
                let (x, res, w) = (r((rows, n))?, r((rows, n))?, r((1, n))?.squeeze(0)?);
                let ctx = format!("{dtype:?} {rows}x{n} on {:?}", dev.location());
                let close = |got: &Tensor, want: &Tensor, what: &str| -> Result<()> {
                    let scale = max_abs(&want.to_dtype(DType::F32)?).max(1.0);
                    let diff = max_abs_diff(&got.to_dtype(DType::F32)?, &want.to_dtype(DType::F32)?);
                    assert!(diff <= tol * scale, "{ctx}: {what} differs from the composition by {diff}");
                    Ok(())
                };
                for residual in [None, Some(&res)] {
                    let (sum, normed) = add_rms_norm(&x, residual, &w, 1e-5)?;
                    let want_sum = match residual {
                        Some(r) => (&x + r)?,
                        None => x.clone(),
                    };
                    assert_eq!(
                        max_abs_diff(&sum.to_dtype(DType::F32)?, &want_sum.to_dtype(DType::F32)?),
                        0.0,
                        "{ctx}: sum"
                    );
                    close(&normed, &candle_nn::ops::rms_norm(&want_sum, &w, 1e-5)?, "rms norm")?;
                }
                let fused = r((rows, 2 * n))?;
                let (gate, up) = (fused.narrow(1, 0, n)?, fused.narrow(1, n, n)?);
                let got = silu_mul(&gate, &up)?;
                assert_eq!(got.dims(), &[rows, n]);
                close(&got, &(candle_nn::ops::silu(&gate)? * &up)?, "silu * up")?;
            }
        }
    }
    let z = |dims: &[usize]| Tensor::zeros(dims, DType::F32, &DEV).unwrap();
    use candle_flash::fused::{add_rms_norm as arn, silu_mul as sm};
    assert!(arn(&z(&[3, 8]), None, &z(&[7]), 1e-5).is_err(), "weight of the wrong length");
    assert!(arn(&z(&[3, 8]), Some(&z(&[3, 7])), &z(&[8]), 1e-5).is_err(), "residual of another shape");
    assert!(arn(&z(&[3, 0]), None, &z(&[0]), 1e-5).is_err(), "empty rows");
    assert!(sm(&z(&[3, 8]), &z(&[3, 4])).is_err(), "gate and up of different shapes");
    Ok(())
}

/// The application side: files, tokenizer, sampling, generation, chat templates.
mod app {
    use super::*;
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    use candle_flash_llama::{
        apply_chat_template, hf_to_gguf_name, load, load_with, ChatMessage, GgufWeights, LoadedLlama, LogitsProcessor,
        Sampling,
    };
    use std::path::{Path, PathBuf};

    /// A scratch folder per test (the tests of this file run in parallel).
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("candle-flash-llama-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn config_json(tied: bool) -> String {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": VOCAB,
            "hidden_size": HIDDEN,
            "intermediate_size": INTER,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "rms_norm_eps": 1e-5,
            "rope_theta": THETA,
            "rope_scaling": {
                "rope_type": "llama3", "factor": ROPE_FACTOR, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": ORIG_CTX
            },
            "max_position_embeddings": 256,
            "tie_word_embeddings": tied,
            "eos_token_id": 3
        })
        .to_string()
    }

    fn write_safetensors_dir(dir: &Path, weights: &HashMap<String, Tensor>, tied: bool) {
        std::fs::write(dir.join("config.json"), config_json(tied)).unwrap();
        candle_core::safetensors::save(weights, dir.join("model.safetensors")).unwrap();
    }

    /// Llama 3 rope scaling as llama.cpp's converter stores it: one divisor per frequency in
    /// `rope_freqs.weight` (written here from the formula independently of the library).
    fn llama3_freq_factors() -> Vec<f32> {
        let (low, high) = (1.0, 4.0);
        let (low_wavelen, high_wavelen) = (ORIG_CTX as f64 / low, ORIG_CTX as f64 / high);
        (0..HEAD_DIM / 2)
            .map(|i| {
                let freq = 1.0 / THETA.powf(2.0 * i as f64 / HEAD_DIM as f64);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                let f = if wavelen < high_wavelen {
                    1.0
                } else if wavelen > low_wavelen {
                    ROPE_FACTOR
                } else {
                    let smooth = (ORIG_CTX as f64 / wavelen - low) / (high - low);
                    1.0 / ((1.0 - smooth) / ROPE_FACTOR + smooth)
                };
                f as f32
            })
            .collect()
    }

    /// The same weights as llama.cpp's converter writes them: GGUF names, Q/K rows permuted for
    /// the interleaved rotary (unless `permute` is false: the control that shows it matters),
    /// f32 tensors, no tokenizer.
    fn write_gguf(path: &Path, weights: &HashMap<String, Tensor>, permute: bool) {
        let mut qtensors = vec![];
        for (name, t) in weights {
            let gname = hf_to_gguf_name(name).unwrap();
            let t = if permute && gname.ends_with("attn_q.weight") {
                permute_qk_rows(t, HEADS).unwrap()
            } else if permute && gname.ends_with("attn_k.weight") {
                permute_qk_rows(t, KV_HEADS).unwrap()
            } else {
                t.clone()
            };
            qtensors.push((gname, QTensor::quantize(&t, GgmlDType::F32).unwrap()));
        }
        let factors = Tensor::new(llama3_freq_factors(), &DEV).unwrap();
        qtensors.push(("rope_freqs.weight".into(), QTensor::quantize(&factors, GgmlDType::F32).unwrap()));
        use gguf_file::Value as V;
        let md: Vec<(&str, V)> = vec![
            ("general.architecture", V::String("llama".into())),
            ("llama.vocab_size", V::U32(VOCAB as u32)),
            ("llama.embedding_length", V::U32(HIDDEN as u32)),
            ("llama.feed_forward_length", V::U32(INTER as u32)),
            ("llama.block_count", V::U32(LAYERS as u32)),
            ("llama.attention.head_count", V::U32(HEADS as u32)),
            ("llama.attention.head_count_kv", V::U32(KV_HEADS as u32)),
            ("llama.rope.dimension_count", V::U32(HEAD_DIM as u32)),
            ("llama.rope.freq_base", V::F32(THETA as f32)),
            ("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
            ("llama.context_length", V::U32(256)),
        ];
        let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (*k, v)).collect();
        let t_refs: Vec<(&str, &QTensor)> = qtensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let mut f = std::fs::File::create(path).unwrap();
        gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
    }

    fn load_tiny(path: &Path, attn: AttnImpl) -> LoadedLlama {
        load(path, DType::F32, &DEV, attn, &mut |_, _| {}).unwrap()
    }

    #[test]
    fn gguf_and_safetensors_load_the_same_model() -> Result<()> {
        for tied in [false, true] {
            let dir = scratch(&format!("formats-{tied}"));
            let weights = tiny_weights(1, tied);
            write_safetensors_dir(&dir, &weights, tied);
            write_gguf(&dir.join("tiny.gguf"), &weights, true);
            write_gguf(&dir.join("unpermuted.gguf"), &weights, false);

            let st = load_tiny(&dir, AttnImpl::Flash);
            let gg = load_tiny(&dir.join("tiny.gguf"), AttnImpl::Flash);
            assert_eq!(st.model.config().tie_word_embeddings, tied);
            assert_eq!(gg.model.config().tie_word_embeddings, tied);
            assert_eq!(st.model.config(), &tiny_config(tied));
            assert_eq!(st.stop_token_ids, vec![3]);
            // Llama 3 scaling from config.json and llama.cpp's stored factors: same frequencies.
            assert!(matches!(st.model.config().rope_scaling, RopeScaling::Llama3(_)));
            assert!(matches!(gg.model.config().rope_scaling, RopeScaling::FreqFactors(_)));
            let (a, b) = (RotaryEmbedding::new(st.model.config())?, RotaryEmbedding::new(gg.model.config())?);
            for (x, y) in a.inv_freq().iter().zip(b.inv_freq()) {
                assert!((x - y).abs() <= 1e-6 * x, "rope frequencies differ: {x} vs {y}");
            }

            let x = ids(PROMPT);
            let l_st = st.model.forward_all(&x, None)?;
            let l_gg = gg.model.forward_all(&x, None)?;
            let diff = max_abs_diff(&l_st, &l_gg);
            assert!(diff < 1e-4, "tied={tied}: GGUF vs safetensors logits differ by {diff}");

            // The control: the same weights without llama.cpp's Q/K permutation, loaded through the
            // GGUF path (which un-permutes), give a different model. So the permutation is real and
            // the un-permutation is what makes the two formats agree.
            let wrong = load_tiny(&dir.join("unpermuted.gguf"), AttnImpl::Flash);
            let diff_wrong = max_abs_diff(&l_st, &wrong.model.forward_all(&x, None)?);
            assert!(diff_wrong > 100.0 * diff.max(1e-6), "tied={tied}: unpermuted GGUF differs by only {diff_wrong}");
            let _ = std::fs::remove_dir_all(&dir);
        }
        Ok(())
    }

    #[test]
    fn greedy_tokens_flash_equal_naive() -> Result<()> {
        let dir = scratch("greedy");
        let weights = tiny_weights(2, false);
        write_safetensors_dir(&dir, &weights, false);
        write_gguf(&dir.join("tiny.gguf"), &weights, true);
        let mut outputs = vec![];
        for path in [dir.clone(), dir.join("tiny.gguf")] {
            for attn in [AttnImpl::Flash, AttnImpl::Naive] {
                let m = load_tiny(&path, attn);
                let mut sampler = LogitsProcessor::new(Sampling::Greedy, 0);
                let out = m.model.generate(&PROMPT[..5], 40, &mut sampler, &[], |_| Ok(()))?;
                assert_eq!(out.tokens.len(), 40);
                outputs.push((path.display().to_string(), attn, out.tokens));
            }
        }
        for o in &outputs[1..] {
            assert_eq!(o.2, outputs[0].2, "{} {:?} vs {} {:?}", o.0, o.1, outputs[0].0, outputs[0].1);
        }
        // `generate` with greedy sampling is the library-only `greedy` on the model built from tensors.
        assert_eq!(greedy(&tiny_model(2, false, AttnImpl::Flash, &DEV)?, &PROMPT[..5], 40)?, outputs[0].2);
        // Not a degenerate model that repeats one token.
        let distinct: std::collections::HashSet<_> = outputs[0].2.iter().collect();
        assert!(distinct.len() > 3, "{:?}", outputs[0].2);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[test]
    fn sampling_is_seeded_and_top_p_keeps_the_nucleus() -> Result<()> {
        let logits: Vec<f32> = vec![1.0, 3.0, 2.9, -1.0, 0.5, 2.0];
        assert_eq!(LogitsProcessor::new(Sampling::Greedy, 0).sample_slice(&logits)?, 1);
        let draw = |sampling, seed| -> Vec<u32> {
            let mut p = LogitsProcessor::new(sampling, seed);
            (0..200).map(|_| p.sample_slice(&logits).unwrap()).collect()
        };
        let t = Sampling::Temperature { temperature: 1.0 };
        assert_eq!(draw(t, 42), draw(t, 42));
        assert_ne!(draw(t, 42), draw(t, 43));
        let all: std::collections::HashSet<u32> = draw(t, 1).into_iter().collect();
        assert!(all.len() >= 4, "temperature 1 should visit most tokens: {all:?}");
        // Probabilities ~ [.05, .38, .35, .01, .03, .14]: top-p 0.5 keeps tokens 1 and 2 only.
        let nucleus: std::collections::HashSet<u32> =
            draw(Sampling::TopP { temperature: 1.0, top_p: 0.5 }, 1).into_iter().collect();
        assert_eq!(nucleus, [1, 2].into_iter().collect());
        assert_eq!(Sampling::from_args(0.0, Some(0.9)), Sampling::Greedy);
        assert!(LogitsProcessor::new(t, 0).sample_slice(&[]).is_err());
        Ok(())
    }

    const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn chat_template_renders_like_transformers() -> Result<()> {
        let text = apply_chat_template(
            SMOLLM2_TEMPLATE,
            &[ChatMessage::new("user", "Hi!")],
            true,
            "<|im_start|>",
            "<|im_end|>",
        )?;
        assert_eq!(
            text,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
        );
        let err = apply_chat_template("{{ raise_exception('no system role') }}", &[], false, "", "");
        assert!(err.unwrap_err().to_string().contains("no system role"));
        Ok(())
    }

    fn smollm2() -> Option<PathBuf> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
        if path.is_file() {
            Some(path)
        } else {
            println!("skipped: {} is missing (fetch it with `bash scripts/fetch-model.sh`)", path.display());
            None
        }
    }

    /// The model's chat template applied to one fixed user question.
    fn france_chat(loaded: &LoadedLlama) -> Result<String> {
        let template = loaded.chat_template.clone().expect("chat template");
        apply_chat_template(&template, &[ChatMessage::new("user", "What is the capital of France?")], true, "", "")
    }

    /// The real model: its tokenizer, fixed greedy continuations (recorded from this code on the
    /// CPU in f32 with dequantized weights), and flash vs naive logits.
    #[test]
    fn smollm2_greedy_output_and_flash_vs_naive() -> Result<()> {
        let Some(path) = smollm2() else { return Ok(()) };
        let mut loaded = load_with(&path, DType::F32, &DEV, AttnImpl::Flash, GgufWeights::Dequantized, &mut |_, _| {})?;
        let cfg = loaded.model.config().clone();
        assert_eq!(
            (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim),
            (30, 576, 9, 3, 64)
        );
        assert!(cfg.tie_word_embeddings);
        let tok = loaded.tokenizer.take().expect("tokenizer in the GGUF");
        let enc = |s: &str| tok.encode(s, true).map(|e| e.get_ids().to_vec()).map_err(candle_core::Error::wrap);
        // No prefix space, digits split one by one (the SmolLM2 pre-tokenizer), specials atomic.
        let toks: Vec<String> = enc("Hello world 2024")?.iter().map(|&i| tok.id_to_token(i).unwrap()).collect();
        assert_eq!(toks, ["Hello", "Ġworld", "Ġ", "2", "0", "2", "4"]);
        assert_eq!(enc("<|im_start|>user")?, [1, 4093]);
        assert!(loaded.stop_token_ids.contains(&2)); // <|im_end|>

        let chat = france_chat(&loaded)?;
        let cases = [
            (
                "Gravity is",
                "a fundamental concept in physics that describes the curvature of spacetime caused by the presence of",
            ),
            (chat.as_str(), "The capital of France is Paris."),
        ];
        for (prompt, want) in cases {
            let ids = enc(prompt)?;
            let mut sampler = LogitsProcessor::new(Sampling::Greedy, 0);
            let out = loaded.model.generate(&ids, 16, &mut sampler, &loaded.stop_token_ids, |_| Ok(()))?;
            let text = tok.decode(&out.tokens, true).map_err(candle_core::Error::wrap)?;
            assert_eq!(text.trim(), want, "prompt {prompt:?}");
        }

        // Flash vs naive logits over a longer prompt (all positions).
        let text = "The quick brown fox jumps over the lazy dog. ".repeat(12);
        let ids = Tensor::new(enc(&text)?, &DEV)?.unsqueeze(0)?;
        let flash = loaded.model.forward_all(&ids, None)?;
        loaded.model.set_attn_impl(AttnImpl::Naive);
        let naive = loaded.model.forward_all(&ids, None)?;
        let (diff, scale) = (max_abs_diff(&flash, &naive), max_abs(&naive));
        println!(
            "SmolLM2 flash vs naive: {} positions, max |logit diff| {diff:.2e} (max |logit| {scale:.1})",
            ids.dim(1)?
        );
        assert!(diff < 2e-3, "flash vs naive logits differ by {diff}");
        let argmax = |t: &Tensor| t.argmax(2).unwrap().flatten_all().unwrap().to_vec1::<u32>().unwrap();
        assert_eq!(argmax(&flash), argmax(&naive));
        Ok(())
    }

    /// Weights kept quantized (Q4_1/Q8_0 kernels, 8-bit activations for few rows) against the
    /// same weights dequantized to f32, on fixed prompts: logits of every prompt position
    /// (prefill, the gemm path) and of greedy decode steps (the matrix-vector path).
    #[test]
    fn smollm2_quantized_matches_dequantized() -> Result<()> {
        let Some(path) = smollm2() else { return Ok(()) };
        let deq = load_with(&path, DType::F32, &DEV, AttnImpl::Flash, GgufWeights::Dequantized, &mut |_, _| {})?;
        let q = load_with(&path, DType::F32, &DEV, AttnImpl::Flash, GgufWeights::Quantized, &mut |_, _| {})?;
        let tok = deq.tokenizer.as_ref().expect("tokenizer in the GGUF");
        let chat = france_chat(&deq)?;
        let prompts = ["Gravity is", "The quick brown fox jumps over the lazy dog. The capital of France is", &chat];
        let (mut agree, mut total, mut worst) = (0, 0, 0f32);
        for prompt in prompts {
            let ids = tok.encode(prompt, true).map_err(candle_core::Error::wrap)?.get_ids().to_vec();
            let (mut cd, mut cq) = (deq.model.new_cache(), q.model.new_cache());
            let mut input = Tensor::new(ids.as_slice(), &DEV)?.unsqueeze(0)?;
            for step in 0..8 {
                let ld = deq.model.forward_all(&input, Some(&mut cd))?;
                let lq = q.model.forward_all(&input, Some(&mut cq))?;
                let diff = max_abs_diff(&ld, &lq);
                worst = worst.max(diff);
                let top = |t: &Tensor| t.argmax(2).unwrap().flatten_all().unwrap().to_vec1::<u32>().unwrap();
                let (td, tq) = (top(&ld), top(&lq));
                agree += td.iter().zip(&tq).filter(|(a, b)| a == b).count();
                total += td.len();
                // Logits are O(10-30) here; 8-bit activation rounding moves them by up to ~1.2.
                assert!(diff < 2.5, "{prompt:?} step {step}: quantized vs dequantized logits differ by {diff}");
                // Both continue with the dequantized model's token, so that the inputs stay equal.
                input = Tensor::new(&[*td.last().unwrap()], &DEV)?.unsqueeze(0)?;
            }
        }
        println!("SmolLM2 quantized vs dequantized: top-1 agreement {agree}/{total}, max |logit diff| {worst:.3}");
        assert!(agree * 10 >= total * 9, "top-1 agreement {agree}/{total}");
        Ok(())
    }

    /// Batched generation with the real model (quantized weights, as the example runs it):
    /// prompts of different lengths and budgets, more of them than batch slots so that they
    /// join and leave mid-run; each sequence's greedy tokens equal its run alone through
    /// `generate` (the contiguous cache), and bitwise its run alone through the scheduler.
    #[test]
    fn smollm2_batched_greedy_equals_alone() -> Result<()> {
        let Some(path) = smollm2() else { return Ok(()) };
        let loaded = load_with(&path, DType::F32, &DEV, AttnImpl::Flash, GgufWeights::Quantized, &mut |_, _| {})?;
        let tok = loaded.tokenizer.as_ref().expect("tokenizer in the GGUF");
        let chat = france_chat(&loaded)?;
        let texts = [
            "Gravity is",
            "The quick brown fox jumps over the lazy dog. The capital of France is",
            chat.as_str(),
            "Hi",
            "Water boils at a temperature of",
            "Once upon a time, in a small village by the sea, there lived an old fisherman who",
        ];
        let budgets = [12, 6, 10, 8, 5, 9];
        let prompts: Vec<Vec<u32>> = texts
            .iter()
            .map(|t| tok.encode(*t, true).map(|e| e.get_ids().to_vec()).map_err(candle_core::Error::wrap))
            .collect::<Result<_>>()?;
        let stop = &loaded.stop_token_ids;
        let alone: Vec<Vec<u32>> = prompts
            .iter()
            .zip(budgets)
            .map(|(p, n)| {
                let mut sampler = LogitsProcessor::new(Sampling::Greedy, 0);
                Ok(loaded.model.generate(p, n, &mut sampler, stop, |_| Ok(()))?.tokens)
            })
            .collect::<Result<_>>()?;
        let run = |max_batch: usize| -> Result<Vec<Vec<u32>>> {
            let mut sched = Scheduler::new(&loaded.model, SchedulerConfig { max_batch, ..Default::default() })?;
            for (p, n) in prompts.iter().zip(budgets) {
                sched.add(Request::new(p.clone(), n).stop_tokens(stop))?;
            }
            let mut out = vec![vec![]; prompts.len()];
            for f in sched.run(&mut |_, logits| Scheduler::greedy(logits))? {
                out[f.id as usize] = f.tokens;
            }
            Ok(out)
        };
        let one = run(1)?;
        let batched = run(4)?;
        for (i, text) in texts.iter().enumerate() {
            assert_eq!(batched[i], one[i], "{text:?}: batched vs scheduler alone");
            assert_eq!(batched[i], alone[i], "{text:?}: batched vs generate alone");
        }
        let decoded = tok.decode(&batched[2], true).map_err(candle_core::Error::wrap)?;
        println!("SmolLM2 batched (4 of 6 at once): {:?} -> {decoded:?}", texts[2]);
        Ok(())
    }

    #[test]
    fn bad_inputs_are_errors() -> Result<()> {
        let missing = load(Path::new("/nonexistent/model.gguf"), DType::F32, &DEV, AttnImpl::Flash, &mut |_, _| {});
        assert!(missing.err().unwrap().to_string().contains("not found"));
        let bad_json = LlamaConfig::from_hf_json("{\"model_type\": \"llama\"}");
        assert!(bad_json.is_err());
        let mut json: serde_json::Value = serde_json::from_str(&config_json(false)).unwrap();
        json["num_key_value_heads"] = 3.into();
        assert!(LlamaConfig::from_hf_json(&json.to_string()).is_err());
        // An empty prompt.
        let m = tiny_model(4, true, AttnImpl::Flash, &DEV)?;
        let mut sampler = LogitsProcessor::new(Sampling::Greedy, 0);
        assert!(m.generate(&[], 4, &mut sampler, &[], |_| Ok(())).is_err());
        Ok(())
    }
}
