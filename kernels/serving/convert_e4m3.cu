// cf_convert_e4m3 (flash_api.h): elementwise conversions to and from FP8 e4m3, so that
// src/fp8.rs quantizes and dequantizes on the GPU (candle's own e4m3 casts are missing from its
// CUDA kernels in our builds, and went through the host: a copy each way per call).
#include "../flash_api.h"
#include "../common/tile.cuh"  // to_float / from_float

namespace cf {

// To e4m3: round to nearest even, saturated to +-448 (NaN stays NaN), like candle's CPU cast
// after quantize_e4m3's clamp.
template <typename T>
__global__ void to_e4m3_kernel(const T* __restrict__ src, __nv_fp8_e4m3* __restrict__ dst, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = __nv_fp8_e4m3(to_float(src[i]));  // __NV_SATFINITE, round to nearest even
}

template <typename T>
__global__ void from_e4m3_kernel(const __nv_fp8_e4m3* __restrict__ src, T* __restrict__ dst, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = from_float<T>(float(src[i]));
}

template <typename T>
cudaError_t convert(const CfConvertParams& p, cudaStream_t s) {
    const int threads = 256;
    const int64_t blocks64 = (p.n + threads - 1) / threads;
    const unsigned blocks = (unsigned)(blocks64 < 65535 * 8 ? blocks64 : 65535 * 8);
    if (p.src_dtype == CF_E4M3)
        from_e4m3_kernel<T><<<blocks, threads, 0, s>>>((const __nv_fp8_e4m3*)p.src, (T*)p.dst, p.n);
    else
        to_e4m3_kernel<T><<<blocks, threads, 0, s>>>((const T*)p.src, (__nv_fp8_e4m3*)p.dst, p.n);
    return cudaGetLastError();
}

// ------------------------------------------------------------------ per-group quantization
// One warp per row of d values at a time (lanes along d): the (batch, row, head) of a row is
// derived once per row, not per element. Every rule here matches src/fp8.rs's composite path
// (to f32, |x| max per group, descale = amax * (1 / 448) as candle's affine computes it,
// x / descale, the e4m3 cast), so both give the same bits.
constexpr int kQuantThreads = 256;

__device__ __forceinline__ float warp_max(float m) {
#pragma unroll
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}

// One CTA per group (blockIdx.x = (bi * nb + blk) * h + hi): the group's |x| max, written as the
// descale (CF_QUANT_FULL) or as it is (CF_QUANT_AMAX).
template <typename T>
__global__ void __launch_bounds__(kQuantThreads) group_amax_kernel(const CfQuantizeParams p, int64_t nb) {
    const int64_t g = blockIdx.x;
    const int64_t hi = g % p.h, blk = g / p.h % nb, bi = g / p.h / nb;
    const int64_t r0 = blk * p.block_rows;
    const int64_t rows = min(p.block_rows, p.s - r0);  // <= 0 only for s = 0: an all-zero group
    const T* x = static_cast<const T*>(p.x);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float m = 0.f;
    for (int64_t r = warp; r < rows; r += kQuantThreads / 32) {
        const T* row = x + ((bi * p.s + r0 + r) * p.h + hi) * p.d;
        for (int64_t c = lane; c < p.d; c += 32) m = fmaxf(m, fabsf(to_float(row[c])));
    }
    __shared__ float warps[kQuantThreads / 32];
    m = warp_max(m);
    if (lane == 0) warps[warp] = m;
    __syncthreads();
    if (warp == 0) {
        m = warp_max(lane < kQuantThreads / 32 ? warps[lane] : 0.f);
        if (lane == 0)
            p.scale[g] = p.mode == CF_QUANT_AMAX ? m : m == 0.f ? 1.f : m * (float)(1.0 / 448.0);
    }
}

// q = e4m3(x / scale of the row's group); warps stride over the b * s * h rows.
template <typename T>
__global__ void __launch_bounds__(kQuantThreads) apply_scale_kernel(const CfQuantizeParams p, int64_t nb) {
    const T* x = static_cast<const T*>(p.x);
    __nv_fp8_e4m3* q = static_cast<__nv_fp8_e4m3*>(p.q);
    const int lane = threadIdx.x & 31;
    const int64_t nrows = p.b * p.s * p.h, nwarps = (int64_t)gridDim.x * (kQuantThreads / 32);
    for (int64_t r = (int64_t)blockIdx.x * (kQuantThreads / 32) + (threadIdx.x >> 5); r < nrows; r += nwarps) {
        const int64_t hi = r % p.h, si = r / p.h % p.s, bi = r / p.h / p.s;
        const float ds = p.scale[(bi * nb + si / p.block_rows) * p.h + hi];
        for (int64_t c = lane; c < p.d; c += 32) q[r * p.d + c] = __nv_fp8_e4m3(to_float(x[r * p.d + c]) / ds);
    }
}

template <typename T>
cudaError_t quantize(const CfQuantizeParams& p, cudaStream_t s) {
    const int64_t nb = p.s > 0 ? (p.s + p.block_rows - 1) / p.block_rows : 1;
    if (p.mode != CF_QUANT_APPLY) {
        group_amax_kernel<T><<<(unsigned)(p.b * nb * p.h), kQuantThreads, 0, s>>>(p, nb);
        if (cudaError_t e = cudaGetLastError(); e != cudaSuccess || p.mode == CF_QUANT_AMAX) return e;
    }
    const int64_t rows = p.b * p.s * p.h;
    if (rows == 0) return cudaSuccess;
    const int64_t blocks = (rows + kQuantThreads / 32 - 1) / (kQuantThreads / 32);
    apply_scale_kernel<T><<<(unsigned)(blocks < 65535 * 16 ? blocks : 65535 * 16), kQuantThreads, 0, s>>>(p, nb);
    return cudaGetLastError();
}

}  // namespace cf

extern "C" int cf_quantize_e4m3(const CfQuantizeParams* p, cudaStream_t stream) {
    using namespace cf;
    if (p == nullptr || p->b < 0 || p->s < 0 || p->h < 0 || p->d < 0 || p->block_rows <= 0 || p->scale == nullptr)
        return CF_ERR_BAD_ARGUMENT;
    if (p->mode != CF_QUANT_FULL && p->mode != CF_QUANT_AMAX && p->mode != CF_QUANT_APPLY) return CF_ERR_BAD_ARGUMENT;
    const int64_t n = p->b * p->s * p->h * p->d;
    if (n > 0 && (p->x == nullptr || (p->mode != CF_QUANT_AMAX && p->q == nullptr))) return CF_ERR_BAD_ARGUMENT;
    const int64_t nb = p->s > 0 ? (p->s + p->block_rows - 1) / p->block_rows : 1;
    if (p->b * nb * p->h > 0x7fffffff) return CF_ERR_BAD_ARGUMENT;  // one CTA per group (grid.x)
    if (p->b * nb * p->h == 0) return CF_OK;
    switch (p->dtype) {
        case CF_F32: return (int)quantize<float>(*p, stream);
        case CF_F16: return (int)quantize<__half>(*p, stream);
        case CF_BF16: return (int)quantize<__nv_bfloat16>(*p, stream);
        default: return CF_ERR_UNSUPPORTED_DTYPE;
    }
}

extern "C" int cf_convert_e4m3(const CfConvertParams* p, cudaStream_t stream) {
    using namespace cf;
    if (p == nullptr || p->n < 0 || (p->n > 0 && (p->src == nullptr || p->dst == nullptr))) return CF_ERR_BAD_ARGUMENT;
    if ((p->src_dtype == CF_E4M3) == (p->dst_dtype == CF_E4M3)) return CF_ERR_UNSUPPORTED_DTYPE;  // exactly one side e4m3
    if (p->n == 0) return CF_OK;
    switch (p->src_dtype == CF_E4M3 ? p->dst_dtype : p->src_dtype) {
        case CF_F32: return (int)convert<float>(*p, stream);
        case CF_F16: return (int)convert<__half>(*p, stream);
        case CF_BF16: return (int)convert<__nv_bfloat16>(*p, stream);
        default: return CF_ERR_UNSUPPORTED_DTYPE;
    }
}
