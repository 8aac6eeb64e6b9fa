//! Which kernels the plan layer (kernels/plan.cu) chooses for a case, through
//! `describe_kernel_plans`: the choices the kernel notes measured, asserted, so that a change of
//! plan shows here and not only in timings. On a Hopper GPU for both kernel families
//! (`scripts/gpu-run.sh` runs it again with `CANDLE_FLASH_DISABLE_SM90A=1`, and with the wide-head
//! kernel, the f32 tensor cores and TMA switched off); on other GPUs the sm_80 expectations;
//! skipped without one.

mod common;
use candle_core::{DType, Device, Tensor};
use candle_flash::{describe_kernel_plans, FlashAttnOptions, KernelPlans};

fn env_on(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Whether the sm_90a (wgmma) kernels run on `device`: an sm_90 GPU, not switched off.
fn wgmma_kernels(device: &Device) -> bool {
    #[cfg(feature = "cuda")]
    if let Ok(cuda) = device.as_cuda_device() {
        let cc = cuda.cuda_stream().context().compute_capability().expect("compute capability");
        return cc == (9, 0) && !env_on("CANDLE_FLASH_DISABLE_SM90A");
    }
    let _ = device;
    false
}

struct Call {
    dtype: DType,
    sq: usize,
    sk: usize,
    h: usize,
    hkv: usize,
    d: usize,
    dv: usize,
    causal: bool,
    deterministic: bool,
    softcap: Option<f32>,
}

fn call(dtype: DType, (sq, sk): (usize, usize), (h, hkv): (usize, usize), d: usize) -> Call {
    Call { dtype, sq, sk, h, hkv, d, dv: d, causal: false, deterministic: false, softcap: None }
}

impl Call {
    fn causal(self) -> Self {
        Call { causal: true, ..self }
    }
    fn deterministic(self) -> Self {
        Call { deterministic: true, ..self }
    }
    fn softcap(self, c: f32) -> Self {
        Call { softcap: Some(c), ..self }
    }
    fn dv(self, dv: usize) -> Self {
        Call { dv, ..self }
    }
    fn plans(&self, device: &Device) -> KernelPlans {
        let t = |s: usize, h: usize, d: usize| {
            Tensor::randn(0f32, 1.0, (1, s, h, d), device).and_then(|t| t.to_dtype(self.dtype)).unwrap()
        };
        let (q, k, v) = (t(self.sq, self.h, self.d), t(self.sk, self.hkv, self.d), t(self.sk, self.hkv, self.dv));
        let opts = FlashAttnOptions::new(1.0 / (self.d as f32).sqrt()).causal(self.causal);
        let opts = if self.deterministic { opts.deterministic(true) } else { opts };
        let opts = opts.softcap(self.softcap);
        describe_kernel_plans(&q, &k, &v, &opts).unwrap()
    }
}

/// The plans of `c` start with `fwd` and `bwd` (the kernel family and configuration; the CTA
/// orders and sizes that follow depend on the device's SM count).
fn expect(device: &Device, what: &str, c: Call, fwd: &str, bwd: &str) {
    let plans = c.plans(device);
    println!("{what}: forward `{}`, backward `{}`", plans.forward, plans.backward.as_deref().unwrap_or("-"));
    assert!(plans.forward.starts_with(fwd), "{what}: forward plan `{}`, expected `{fwd}...`", plans.forward);
    let backward = plans.backward.expect("a backward plan");
    assert!(backward.starts_with(bwd), "{what}: backward plan `{backward}`, expected `{bwd}...`");
}

#[test]
fn kernel_plans() {
    let Some(device) = common::cuda_device() else { return };
    let wgmma = wgmma_kernels(&device);
    let wide_split = !env_on("CANDLE_FLASH_DISABLE_WIDE_SPLIT");
    let f32_tc = !env_on("CANDLE_FLASH_F32_SIMT");
    println!("wgmma kernels: {wgmma}, wide-head split kernel: {wide_split}, f32 on tensor cores: {f32_tc}");
    let bf16 = DType::BF16;
    // 16-bit prefill: the wgmma configurations by head dim and length (plan.cuh fwd_sm90_config)
    let cases = [
        ("d=64 1k", call(bf16, (1024, 1024), (4, 4), 64), "wgmma D64Persistent ", "wgmma tile=64 dq=atomic"),
        ("d=64 1k causal", call(bf16, (1024, 1024), (4, 4), 64).causal(), "wgmma D64Short ", "wgmma tile=64 dq=atomic"),
        ("d=64 4k", call(bf16, (4096, 4096), (2, 2), 64), "wgmma D64 ", "wgmma tile=64 dq=atomic"),
        ("d=96 1k", call(bf16, (1024, 1024), (4, 4), 96), "wgmma D96 ", "wgmma tile=96 dq=atomic"),
        ("d=128 1k", call(bf16, (1024, 1024), (4, 4), 128), "wgmma D128 ", "wgmma tile=128 dq=atomic"),
        ("d=128 4k", call(bf16, (4096, 4096), (2, 2), 128), "wgmma D128Long ", "wgmma tile=128 dq=atomic"),
        ("d=192 1k", call(bf16, (1024, 1024), (4, 4), 192), "wgmma D192Long ", "wgmma_wide tile=192 dq=atomic"),
        ("d=256 1k", call(bf16, (1024, 1024), (4, 4), 256), "wgmma D256 ", "wgmma_wide tile=256 dq=atomic"),
        ("d=256 8k causal", call(bf16, (8192, 8192), (1, 1), 256).causal(), "wgmma D256Long ", "wgmma_wide tile=256"),
        // a value head dim of its own up to 256: zero-padded to the wider one (src/lib.rs)
        ("(192, 128)", call(bf16, (512, 512), (2, 2), 192).dv(128), "wgmma D192 ", "wgmma_wide tile=192"),
    ];
    for (what, c, fwd, bwd) in cases {
        if wgmma {
            expect(&device, what, c, fwd, bwd);
        } else {
            let tile = format!("mma_sync tile={} ", c.d.max(c.dv));
            expect(&device, what, c, &tile, &tile);
        }
    }
    // TMA loads unless switched off (the cp.async paths, CANDLE_FLASH_DISABLE_TMA=1)
    if wgmma {
        let plans = call(bf16, (512, 512), (2, 2), 128).plans(&device);
        let off = env_on("CANDLE_FLASH_DISABLE_TMA");
        for plan in [&plans.forward, plans.backward.as_ref().unwrap()] {
            assert_eq!(plan.contains(" no_tma"), off, "`{plan}` with CANDLE_FLASH_DISABLE_TMA={off}");
        }
    }
    // d = 32 stays on the mma.sync kernels' own tile everywhere
    expect(&device, "d=32", call(bf16, (256, 256), (2, 2), 32), "mma_sync tile=32 ", "mma_sync tile=32 ");
    // deterministic: dQ in key-block order in the wgmma dK/dV kernel, else the separate dQ pass
    let (fwd, bwd) =
        if wgmma { ("wgmma D128 ", "wgmma tile=128 dq=ordered") } else { ("mma_sync", "mma_sync tile=128 dq=pass") };
    expect(&device, "deterministic", call(bf16, (512, 512), (2, 2), 128).deterministic(), fwd, bwd);
    // softcap: the general-logits instance of the wgmma dK/dV kernel (common/mask.cuh logits_general)
    let (fwd, bwd) =
        if wgmma { ("wgmma D128 ", "wgmma tile=128 general_logits dq=atomic") } else { ("mma_sync", "mma_sync") };
    expect(&device, "softcap", call(bf16, (512, 512), (2, 2), 128).softcap(20.0), fwd, bwd);
    // GQA causal from 4k keys on the wgmma d <= 128 kernel: every query head its own CTAs, the
    // partials summed in the kernel (plan.cuh plan_bwd_workspace)
    if wgmma {
        let c = call(bf16, (4096, 4096), (8, 2), 128).causal();
        expect(&device, "GQA 4:1 causal 4k", c, "wgmma D128Long ", "wgmma tile=128 dq=atomic nsplit=4 dkv_in_kernel");
    }
    // decode shapes: the split-KV kernel, a KV group's query heads packed in a CTA
    let bwd = if wgmma { "wgmma tile=128" } else { "mma_sync tile=128" };
    expect(&device, "decode d=128", call(bf16, (1, 8192), (8, 2), 128), "split tile=128 nsplit=", bwd);
    // f32: 3xTF32 on mma.sync, or the SIMT kernels where switched
    let f32_plan = if f32_tc { "mma_sync tile=128 " } else { "simt narrow" };
    expect(&device, "f32 d=128", call(DType::F32, (256, 256), (2, 2), 128), f32_plan, f32_plan);
    // heads past 256 columns: the wide-head kernel forward (f16 / bf16), the SIMT backward
    let wide_fwd = if wide_split { "wide_split Rows16V2 " } else { "simt wide" };
    expect(&device, "d=512 decode, 16 heads", call(bf16, (1, 2048), (16, 1), 512), wide_fwd, "simt wide");
    // past the decode shapes: the wgmma kernel of 512-wide heads where sm_90a runs, else the
    // wide-head kernel (the 64-row configuration where it fits the device's shared memory, else 16
    // rows); (576, 512) prefill stays on the wide-head kernel
    let wide_prefill = if wgmma {
        "wgmma_wide tile=512 "
    } else if wide_split {
        "wide_split Rows"
    } else {
        "simt wide"
    };
    expect(&device, "d=512 prefill", call(bf16, (512, 512), (2, 2), 512), wide_prefill, "simt wide");
    let mla_prefill = if wide_split { "wide_split Rows" } else { "simt wide" };
    expect(&device, "(576, 512) prefill", call(bf16, (512, 512), (2, 2), 576).dv(512), mla_prefill, "simt wide");
}

#[test]
fn plans_describe_cuda_only() {
    let t = Tensor::zeros((1, 4, 2, 64), DType::F32, &Device::Cpu).unwrap();
    let err = describe_kernel_plans(&t, &t, &t, &FlashAttnOptions::new(0.125)).unwrap_err().to_string();
    assert!(err.contains("CUDA"), "{err}");
}
