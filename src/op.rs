//! The candle ops: [`FlashAttnOp`] (`CustomOp3` over q, k, v) and the backward dispatch.
//!
//! How the backward gets the forward's log-sum-exp: `CustomOp3::bwd` only receives q, k, v,
//! the output and its gradient. The op instance, however, is what candle stores in the output's
//! graph node (an `Arc`), and `bwd` is called on that same instance. So the forward writes its
//! LSE into a slot of the op (`LseSlot`), and `bwd` reads it from there: nothing is recomputed,
//! and the LSE lives exactly as long as the graph that may need it. The same slot hands the LSE
//! to callers of [`crate::flash_attn_with_lse`].
//!
//! Learnable sinks are a fourth differentiable input, and a `CustomOp3` has three. When the
//! sinks tensor tracks gradients, the attention's output therefore passes through
//! [`SinkGradOp`], a `CustomOp2` over (output, sinks) whose forward is the identity (one copy of
//! the output) and whose backward hands the output's gradient on unchanged and gives the sinks'
//! gradient, which needs only the output, its gradient and the LSE. The attention's own backward
//! then needs nothing new: its P = e^{x - lse} and D = rowsum(dO∘O) already include the sink.

use crate::params::{validate_backward, AttnShape, FlashAttnOptions};
use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Device, Error, Layout, Result, Shape, Storage, Tensor};
use std::sync::{Arc, Mutex};

use crate::inputs::device_storage;
pub use crate::inputs::BwdInputs;

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
    pub fp8: Option<crate::inputs::Fp8Kernel>,
}

impl FlashAttnOp {
    /// The output's shape: q's, with v's head dim.
    fn out_shape(&self, q_l: &Layout) -> Shape {
        let mut dims = q_l.dims().to_vec();
        *dims.last_mut().expect("q has rank 3 or 4") = self.shape.head_dim_v;
        Shape::from(dims)
    }
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
        Ok((out, self.out_shape(q_l)))
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
        Ok((out, self.out_shape(q_l)))
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
        // The sinks' gradient, when wanted, comes from the SinkGradOp node after this one.
        let g = backward(&self.shape, &self.opts, BwdInputs { q, k, v, out, grad_out, lse: &lse }, false)?;
        Ok((Some(g.dq), Some(g.dk), Some(g.dv)))
    }
}

/// The identity on the attention's output, differentiable in the sinks (module documentation):
/// inserted only when the sinks tensor tracks gradients.
pub(crate) struct SinkGradOp {
    pub shape: AttnShape,
    pub opts: FlashAttnOptions,
    /// The attention's inputs (the CUDA entry point checks them as the backward's) and its LSE.
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub lse: LseSlot,
}

impl CustomOp2 for SinkGradOp {
    fn name(&self) -> &'static str {
        "candle-flash-sinks"
    }

    fn cpu_fwd(&self, out: &CpuStorage, out_l: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((out.try_clone(out_l)?, out_l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        out: &candle_core::CudaStorage,
        out_l: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((out.try_clone(out_l)?, out_l.shape().clone()))
    }

    fn bwd(
        &self,
        out: &Tensor,
        _sinks: &Tensor,
        _res: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let lse = self.lse.get()?;
        let x = BwdInputs { q: &self.q, k: &self.k, v: &self.v, out, grad_out, lse: &lse };
        let dsinks = sink_grads(&self.shape, &self.opts, x)?;
        Ok((Some(grad_out.clone()), Some(dsinks)))
    }
}

/// The gradients of one backward: dq, dk, dv (dk and dv summed over each KV head's query
/// heads), and the sinks' gradient (f32 `[H]`) when the options have sinks.
#[derive(Clone, Debug)]
pub struct AttnGrads {
    pub dq: Tensor,
    pub dk: Tensor,
    pub dv: Tensor,
    pub dsinks: Option<Tensor>,
}

/// The plans of a CUDA call (the kernels' plan layer, `cf_fwd_describe` / `cf_bwd_describe` in
/// kernels/flash_api.h): which kernel family and configuration, head-dim tile, split, dQ mode,
/// CTA orders and workspace the forward and the backward run, one line each (e.g.
/// `"wgmma D128Long order=0 workspace=0"`). `backward` is `None` for forward-only calls (paged
/// K/V, multimodal prefix ranges).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelPlans {
    pub forward: String,
    pub backward: Option<String>,
}

/// The plans of a call on CUDA, from its (aligned) inputs and the forward's output and LSE.
pub(crate) fn describe_plans(shape: &AttnShape, opts: &FlashAttnOptions, x: BwdInputs<&Tensor>) -> Result<KernelPlans> {
    #[cfg(feature = "cuda")]
    if x.q.device().is_cuda() {
        let [gq, gk, gv] = [x.q, x.k, x.v].map(|t| t.storage_and_layout());
        let forward = crate::cuda::describe_forward(
            shape,
            opts,
            device_storage::<candle_core::CudaStorage>("q", &gq)?,
            device_storage::<candle_core::CudaStorage>("k", &gk)?,
            device_storage::<candle_core::CudaStorage>("v", &gv)?,
        )?;
        drop((gq, gk, gv));
        if opts.paged.is_some() || opts.mm_prefix_ranges.is_some() {
            return Ok(KernelPlans { forward, backward: None });
        }
        validate_backward(shape, opts, &x)?;
        let x = backward_inputs(x)?;
        let guards = x.as_ref().try_map(|_, t| Ok(t.storage_and_layout()))?;
        let inputs = guards.as_ref().try_map(|name, g| device_storage::<candle_core::CudaStorage>(name, g))?;
        let backward = crate::cuda::describe_backward(shape, opts, inputs)?;
        return Ok(KernelPlans { forward, backward: Some(backward) });
    }
    let _ = (shape, opts);
    bail!("candle-flash: kernel plans describe the CUDA kernels; {:?} has none", x.q.device().location())
}

/// CUDA: contiguous inputs keep the kernels' addressing simple (the gradient candle hands us
/// may be a broadcast view); copies are O(N) and only for strided inputs. The CPU path reads
/// any layout while it converts to f32 (`cpu::dense_f32`), so a copy there would be a second one.
fn backward_inputs(x: BwdInputs<&Tensor>) -> Result<BwdInputs<Tensor>> {
    let cuda = x.q.device().is_cuda();
    x.try_map(|_, t| if cuda { t.contiguous() } else { Ok(t.clone()) })
}

fn wrap(s: Storage, dims: &[usize]) -> Tensor {
    Tensor::from_storage(s, dims, BackpropOp::none(), false)
}

/// The one backward dispatch point: gradients of q, k, v (and of the sinks, with sinks and
/// `want_dsinks`) on whatever device they live.
pub(crate) fn backward(
    shape: &AttnShape,
    opts: &FlashAttnOptions,
    x: BwdInputs<&Tensor>,
    want_dsinks: bool,
) -> Result<AttnGrads> {
    validate_backward(shape, opts, &x)?;
    let x = backward_inputs(x)?;
    let guards = x.as_ref().try_map(|_, t| Ok(t.storage_and_layout()))?;
    let with_dsinks = want_dsinks && opts.sinks.is_some();
    let (dq, dk, dv, dsinks) = match x.q.device() {
        Device::Cpu => {
            let inputs = guards.as_ref().try_map(|name, g| device_storage::<CpuStorage>(name, g))?;
            let (dq, dk, dv) = crate::cpu::backward(shape, opts, inputs)?;
            let dsinks = if with_dsinks {
                let values = crate::cpu::sink_grads(shape, inputs.out, inputs.grad_out, inputs.lse)?;
                Some(Storage::Cpu(CpuStorage::F32(values)))
            } else {
                None
            };
            (Storage::Cpu(dq), Storage::Cpu(dk), Storage::Cpu(dv), dsinks)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let inputs = guards.as_ref().try_map(|name, g| device_storage::<candle_core::CudaStorage>(name, g))?;
            let (dq, dk, dv, dsinks) = crate::cuda::backward(shape, opts, inputs, with_dsinks)?;
            (Storage::Cuda(dq), Storage::Cuda(dk), Storage::Cuda(dv), dsinks.map(Storage::Cuda))
        }
        dev => bail!("candle-flash: backward is not implemented on {:?}", dev.location()),
    };
    let dsinks = dsinks.map(|s| wrap(s, &[shape.num_heads]));
    Ok(AttnGrads { dq: wrap(dq, x.q.dims()), dk: wrap(dk, x.k.dims()), dv: wrap(dv, x.v.dims()), dsinks })
}

/// The sinks' gradient alone (f32 `[H]`; the options have sinks): what [`SinkGradOp`] needs.
pub(crate) fn sink_grads(shape: &AttnShape, opts: &FlashAttnOptions, x: BwdInputs<&Tensor>) -> Result<Tensor> {
    validate_backward(shape, opts, &x)?;
    let x = backward_inputs(x)?;
    let guards = x.as_ref().try_map(|_, t| Ok(t.storage_and_layout()))?;
    let dsinks = match x.q.device() {
        Device::Cpu => {
            let inputs = guards.as_ref().try_map(|name, g| device_storage::<CpuStorage>(name, g))?;
            Storage::Cpu(CpuStorage::F32(crate::cpu::sink_grads(shape, inputs.out, inputs.grad_out, inputs.lse)?))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let inputs = guards.as_ref().try_map(|name, g| device_storage::<candle_core::CudaStorage>(name, g))?;
            Storage::Cuda(crate::cuda::sink_grads(shape, opts, inputs)?)
        }
        dev => bail!("candle-flash: backward is not implemented on {:?}", dev.location()),
    };
    Ok(wrap(dsinks, &[shape.num_heads]))
}
