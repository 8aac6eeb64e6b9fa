//! Command-line values shared by the examples.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};

/// `cpu`, or `cuda` (GPU 0, with candle-flash's caching memory pool).
pub fn device(name: &str) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => {
            candle_flash::new_cuda_device(0).context("no CUDA device (build with `--features cuda` and run on a GPU)")
        }
        other => bail!("unknown device {other:?} (cpu or cuda)"),
    }
}

/// `f32`, `f16` or `bf16`.
pub fn dtype(name: &str) -> Result<DType> {
    Ok(match name {
        "f32" => DType::F32,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        other => bail!("unknown dtype {other:?} (f32, f16 or bf16)"),
    })
}
