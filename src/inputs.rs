//! What the op hands its kernels besides the options: the tensors of a backward call as one
//! value ([`BwdInputs`], for the validation in `params`, the op and both devices' launchers) and
//! the FP8 kernel's descales ([`Fp8Kernel`], for the op, `fp8` and `cuda`), and how an input's
//! storage is unwrapped for a device ([`device_storage`]). A leaf module (it imports nothing
//! from the crate), so that none of those modules needs another for them.

use candle_core::{bail, CpuStorage, Layout, Result, Storage, Tensor};

/// The tensors of a backward call, however each is held: `&Tensor` here, `(&CpuStorage,
/// &Layout)` in `crate::cpu` and `(&CudaStorage, &Layout)` in `crate::cuda`.
#[derive(Clone, Copy, Debug)]
pub struct BwdInputs<T> {
    pub q: T,
    pub k: T,
    pub v: T,
    pub out: T,
    pub grad_out: T,
    /// The forward's log-sum-exp (f32, `AttnShape::lse_dims`).
    pub lse: T,
}

impl<T> BwdInputs<T> {
    pub fn as_ref(&self) -> BwdInputs<&T> {
        let Self { q, k, v, out, grad_out, lse } = self;
        BwdInputs { q, k, v, out, grad_out, lse }
    }

    /// Applies `f(name, x)` to each input, in the order of the fields.
    pub fn try_map<U>(self, mut f: impl FnMut(&'static str, T) -> Result<U>) -> Result<BwdInputs<U>> {
        let Self { q, k, v, out, grad_out, lse } = self;
        Ok(BwdInputs {
            q: f("q", q)?,
            k: f("k", k)?,
            v: f("v", v)?,
            out: f("out", out)?,
            grad_out: f("grad_out", grad_out)?,
            lse: f("lse", lse)?,
        })
    }
}

/// How the FP8 kernel reads one input's descales (`flash_api.h`'s `CfDescale`):
/// `tensor[b * batch_stride + head / head_div]` (f32, contiguous), the head being the query head
/// for q and the KV head for k and v, b the sequence.
#[derive(Clone, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct KernelDescale {
    pub tensor: Tensor,
    pub batch_stride: usize,
    pub head_div: usize,
}

/// An FP8 call that the sm_90a kernel computes (`FlashAttnOp::fp8`): the descales of q, k, v
/// (`None`: 1).
#[derive(Clone, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Fp8Kernel {
    pub descales: [Option<KernelDescale>; 3],
}

/// A device's variant of [`Storage`], so that one helper unwraps inputs for either device.
pub(crate) trait DeviceStorage: Sized {
    const DEVICE: &'static str;
    fn of(storage: &Storage) -> Option<&Self>;
}

impl DeviceStorage for CpuStorage {
    const DEVICE: &'static str = "the CPU";
    fn of(storage: &Storage) -> Option<&Self> {
        match storage {
            Storage::Cpu(s) => Some(s),
            _ => None,
        }
    }
}

#[cfg(feature = "cuda")]
impl DeviceStorage for candle_core::CudaStorage {
    const DEVICE: &'static str = "CUDA";
    fn of(storage: &Storage) -> Option<&Self> {
        match storage {
            Storage::Cuda(s) => Some(s),
            _ => None,
        }
    }
}

/// What `Tensor::storage_and_layout` returns: the storage's read guard and the layout.
pub(crate) type StorageGuard<'a> = (candle_core::StorageRef<'a>, &'a Layout);

/// The storage (as device `S`'s variant) and layout behind a tensor's guard, or an error naming
/// the input. The one place where inputs are unwrapped, for the CPU and CUDA alike.
pub(crate) fn device_storage<'a, S: DeviceStorage>(
    name: &str,
    (storage, layout): &'a StorageGuard<'_>,
) -> Result<(&'a S, &'a Layout)> {
    match S::of(storage) {
        Some(s) => Ok((s, layout)),
        None => bail!("candle-flash: {name} is not on {} like q", S::DEVICE),
    }
}
