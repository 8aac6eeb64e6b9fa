//! The candle ops: [`FlashAttnOp`] (`CustomOp3` over q, k, v) and the backward dispatch.
//!
//! How the backward gets the forward's log-sum-exp: `CustomOp3::bwd` only receives q, k, v,
//! the output and its gradient. The op instance, however, is what candle stores in the output's
//! graph node (an `Arc`), and `bwd` is called on that same instance. So the forward writes its
//! LSE into a slot of the op (`LseSlot`), and `bwd` reads it from there: nothing is recomputed,
//! and the LSE lives exactly as long as the graph that may need it. The same slot hands the LSE
//! to callers of [`crate::flash_attn_with_lse`].

use crate::params::{validate_backward, AttnShape, FlashAttnOptions};
use candle_core::op::BackpropOp;
use candle_core::{bail, CpuStorage, CustomOp3, Device, Error, Layout, Result, Shape, Storage, Tensor};
use std::sync::{Arc, Mutex};

/// Where the forward leaves its LSE (f32, `shape.lse_dims()`), for the backward and for callers.
#[derive(Clone, Default)]
pub(crate) struct LseSlot(Arc<Mutex<Option<Tensor>>>);

impl LseSlot {
    fn put(&self, lse: Tensor) -> Result<()> {
        *self.0.lock().map_err(|_| Error::Msg("candle-flash: lse slot poisoned".into()))? = Some(lse);
        Ok(())
    }

    pub(crate) fn get(&self) -> Result<Tensor> {
        self.0
            .lock()
            .map_err(|_| Error::Msg("candle-flash: lse slot poisoned".into()))?
            .clone()
            .ok_or_else(|| Error::Msg("candle-flash: the forward did not run, no lse to read".into()))
    }
}

/// Forward attention over (q, k, v) with validated shapes; differentiable through `bwd`.
pub(crate) struct FlashAttnOp {
    pub opts: FlashAttnOptions,
    pub shape: AttnShape,
    pub lse: LseSlot,
    /// `Some(what)`: a forward-only use of the op (FP8 attention): a backward through it is an
    /// error naming `what`.
    pub forward_only: Option<&'static str>,
    /// `Some`: q, k, v are e4m3 and the FP8 kernel computes the forward (CUDA, sm_90a only; the
    /// caller checked that it runs: `crate::fp8`).
    pub fp8: Option<crate::fp8::Fp8Kernel>,
}

impl CustomOp3 for FlashAttnOp {
    fn name(&self) -> &'static str {
        "candle-flash-attn"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_l: &Layout,
        k: &CpuStorage,
        k_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if self.fp8.is_some() {
            bail!("candle-flash: the FP8 kernel runs on CUDA only")
        }
        let (out, lse) = crate::cpu::forward(&self.shape, &self.opts, (q, q_l), (k, k_l), (v, v_l))?;
        self.lse.put(Tensor::from_vec(lse, self.shape.lse_dims(), &Device::Cpu)?)?;
        Ok((out, q_l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        q_l: &Layout,
        k: &candle_core::CudaStorage,
        k_l: &Layout,
        v: &candle_core::CudaStorage,
        v_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (out, lse) = match &self.fp8 {
            Some(fp8) => crate::cuda::forward_fp8(&self.shape, &self.opts, fp8, (q, q_l), (k, k_l), (v, v_l))?,
            None => crate::cuda::forward(&self.shape, &self.opts, (q, q_l), (k, k_l), (v, v_l))?,
        };
        let lse = Tensor::from_storage(Storage::Cuda(lse), self.shape.lse_dims(), BackpropOp::none(), false);
        self.lse.put(lse)?;
        Ok((out, q_l.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        if let Some(what) = self.forward_only {
            candle_core::bail!("candle-flash: {what} is forward only: no backward (autograd) through it")
        }
        let lse = self.lse.get()?;
        let (dq, dk, dv) = backward(&self.shape, &self.opts, BwdInputs { q, k, v, out, grad_out, lse: &lse })?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

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

/// The one backward dispatch point: gradients of q, k, v on whatever device they live.
pub(crate) fn backward(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    x: BwdInputs<&Tensor>,
) -> Result<(Tensor, Tensor, Tensor)> {
    validate_backward(shape, opts, &x)?;
    // CUDA: contiguous inputs keep the kernels' addressing simple (the gradient candle hands us
    // may be a broadcast view); copies are O(N) and only for strided inputs. The CPU path reads
    // any layout while it converts to f32 (`cpu::dense_f32`), so a copy here would be a second one.
    let cuda = x.q.device().is_cuda();
    let x = x.try_map(|_, t| if cuda { t.contiguous() } else { Ok(t.clone()) })?;
    let guards = x.as_ref().try_map(|_, t| Ok(t.storage_and_layout()))?;
    let (dq, dk, dv) = match x.q.device() {
        Device::Cpu => {
            let inputs = guards.as_ref().try_map(|name, g| device_storage::<CpuStorage>(name, g))?;
            let (dq, dk, dv) = crate::cpu::backward(shape, opts, inputs)?;
            (Storage::Cpu(dq), Storage::Cpu(dk), Storage::Cpu(dv))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let inputs = guards.as_ref().try_map(|name, g| device_storage::<candle_core::CudaStorage>(name, g))?;
            let (dq, dk, dv) = crate::cuda::backward(shape, opts, inputs)?;
            (Storage::Cuda(dq), Storage::Cuda(dk), Storage::Cuda(dv))
        }
        dev => bail!("candle-flash: backward is not implemented on {:?}", dev.location()),
    };
    let wrap = |s: Storage, t: &Tensor| Tensor::from_storage(s, t.dims(), BackpropOp::none(), false);
    Ok((wrap(dq, &x.q), wrap(dk, &x.k), wrap(dv, &x.v)))
}
