//! Fused elementwise steps of the Llama block, for inference: the residual add with the RMSNorm
//! after it, and SwiGLU's `silu(gate) * up`. On CUDA each is one kernel
//! (`kernels/serving/norm_act.cu`) instead of two, computing in f32 and rounding once: a decode
//! step replayed from a CUDA graph is hundreds of small kernels, and their number sets its time.
//! Elsewhere, or when autograd tracks an input, they are the candle compositions (bitwise what
//! the model computed before).

use crate::serving_params::{validate_add_rms_norm, validate_silu_mul};
use candle_core::{Result, Tensor};

/// `(sum, rms_norm(sum) * weight)` with `sum = x + residual` (`x` itself without a residual),
/// over the last axis of `x`; `weight` has that axis' length. The sum is rounded to the dtype
/// before the norm, as the separate add stores it.
pub fn add_rms_norm(x: &Tensor, residual: Option<&Tensor>, weight: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    let shape = validate_add_rms_norm(x, residual, weight)?;
    let tracked = x.track_op() || weight.track_op() || residual.is_some_and(Tensor::track_op);
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && !tracked && shape.contiguous {
        return crate::cuda::add_rms_norm(x, residual, weight, eps, (shape.rows, shape.n));
    }
    let sum = match residual {
        Some(r) => (x + r)?,
        None => x.clone(),
    };
    let normed = if tracked {
        candle_nn::ops::rms_norm_slow(&sum, weight, eps)?
    } else {
        candle_nn::ops::rms_norm(&sum.contiguous()?, weight, eps)?
    };
    let _ = shape;
    Ok((sum, normed))
}

/// `silu(gate) * up`, elementwise; `gate` and `up` of one shape (rows may be strided: views of
/// one fused `[gate | up]` product). Returns a contiguous tensor.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let shape = validate_silu_mul(gate, up)?;
    #[cfg(feature = "cuda")]
    if gate.device().is_cuda() && !gate.track_op() && !up.track_op() && shape.strided_rows {
        return crate::cuda::silu_mul(gate, up, (shape.rows, shape.n));
    }
    let _ = shape;
    candle_nn::ops::silu(gate)? * up
}
