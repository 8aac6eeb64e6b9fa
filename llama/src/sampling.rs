//! Choosing the next token from logits: greedy, temperature, or nucleus (top-p), seeded.

use candle_core::{bail, DType, Result, Tensor};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sampling {
    /// The most likely token (ties: the lowest id).
    Greedy,
    /// Sample from `softmax(logits / temperature)`.
    Temperature { temperature: f64 },
    /// Sample from the smallest set of most likely tokens whose probability reaches `top_p`.
    TopP { temperature: f64, top_p: f64 },
}

impl Sampling {
    /// The usual CLI mapping: temperature <= 0 is greedy; top-p outside (0, 1) is off.
    pub fn from_args(temperature: f64, top_p: Option<f64>) -> Self {
        if temperature <= 0.0 || !temperature.is_finite() {
            return Self::Greedy;
        }
        match top_p {
            Some(p) if p > 0.0 && p < 1.0 => Self::TopP { temperature, top_p: p },
            _ => Self::Temperature { temperature },
        }
    }
}

/// A sampler with its own random stream.
///
/// The generator is a small SplitMix64 written here rather than `rand`: the library then needs
/// no extra dependency, and a seed gives the same tokens across platforms and crate versions.
#[derive(Clone, Debug)]
pub struct LogitsProcessor {
    sampling: Sampling,
    state: u64,
}

impl LogitsProcessor {
    pub fn new(sampling: Sampling, seed: u64) -> Self {
        Self { sampling, state: seed }
    }

    /// Whether every choice is the argmax (no randomness), which callers may compute on the device.
    pub fn is_greedy(&self) -> bool {
        self.sampling == Sampling::Greedy
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Samples a token id from `logits` `(vocab,)`.
    pub fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        let logits: Vec<f32> = logits.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
        self.sample_slice(&logits)
    }

    pub fn sample_slice(&mut self, logits: &[f32]) -> Result<u32> {
        if logits.is_empty() {
            bail!("sampling: empty logits")
        }
        let (temperature, top_p) = match self.sampling {
            Sampling::Greedy => return Ok(argmax(logits)),
            Sampling::Temperature { temperature } => (temperature, 1.0),
            Sampling::TopP { temperature, top_p } => (temperature, top_p),
        };
        let max = logits.iter().copied().filter(|x| !x.is_nan()).fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() {
            bail!("sampling: logits have no finite maximum")
        }
        // Probabilities (unnormalised), in f64 so that tiny tails still add up correctly.
        let mut probs: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, if l.is_nan() { 0.0 } else { (((l - max) as f64) / temperature).exp() }))
            .collect();
        let mut total: f64 = probs.iter().map(|p| p.1).sum();
        if top_p < 1.0 {
            // Keep the smallest prefix of the sorted distribution that reaches top_p.
            probs.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let (mut acc, mut keep) = (0.0, probs.len());
            for (i, p) in probs.iter().enumerate() {
                acc += p.1;
                if acc >= top_p * total {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            total = acc.min(total);
        }
        let mut r = self.next_f64() * total;
        for &(id, p) in &probs {
            if r < p {
                return Ok(id);
            }
            r -= p;
        }
        // Rounding left r just past the end: the last kept token with weight.
        Ok(probs.iter().rev().find(|p| p.1 > 0.0).map_or(argmax(logits), |p| p.0))
    }
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best as u32
}
