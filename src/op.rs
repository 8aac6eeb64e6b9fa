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
        let (out, lse) = crate::cuda::forward(&self.shape, &self.opts, (q, q_l), (k, k_l), (v, v_l))?;
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
        let lse = self.lse.get()?;
        let (dq, dk, dv) = backward(&self.shape, &self.opts, q, k, v, out, grad_out, &lse)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// The one backward dispatch point: gradients of q, k, v on whatever device they live.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    validate_backward(shape, q, out, grad_out, lse)?;
    let wrap = |s: Storage, dims: &[usize]| Tensor::from_storage(s, dims, BackpropOp::none(), false);
    match q.device() {
        Device::Cpu => {
            let guards = [q, k, v, out, grad_out, lse].map(|t| t.storage_and_layout());
            let cpu = |i: usize| -> Result<(&CpuStorage, &Layout)> {
                match &*guards[i].0 {
                    Storage::Cpu(s) => Ok((s, guards[i].1)),
                    _ => bail!("candle-flash: backward input {i} is not on the cpu"),
                }
            };
            let inputs = crate::cpu::BwdInputs {
                q: cpu(0)?,
                k: cpu(1)?,
                v: cpu(2)?,
                out: cpu(3)?,
                grad_out: cpu(4)?,
                lse: cpu(5)?,
            };
            let (dq, dk, dv) = crate::cpu::backward(shape, opts, inputs)?;
            Ok((wrap(Storage::Cpu(dq), q.dims()), wrap(Storage::Cpu(dk), k.dims()), wrap(Storage::Cpu(dv), v.dims())))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let (dq, dk, dv) = crate::cuda::backward(shape, opts, q, k, v, out, grad_out, lse)?;
            Ok((
                wrap(Storage::Cuda(dq), q.dims()),
                wrap(Storage::Cuda(dk), k.dims()),
                wrap(Storage::Cuda(dv), v.dims()),
            ))
        }
        dev => bail!("candle-flash: backward is not implemented on {:?}", dev.location()),
    }
}
