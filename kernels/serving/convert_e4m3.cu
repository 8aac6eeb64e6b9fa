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
// Lanes along d, a warp per row of d values at a time: the (batch, row, head) of a row is
// derived once per row, not per element. Every rule here matches src/fp8.rs's composite path
// (to f32, |x| max per group, descale = amax * (1 / 448) as candle's affine computes it,
// x / descale, the e4m3 cast), so both give the same bits.
constexpr int kQuantThreads = 256;

// One CTA per group (blockIdx.x = (bi * nb + blk) * h + hi): the group's |x| max, written as the
// descale (CF_QUANT_FULL) or as it is (CF_QUANT_AMAX). A per-head group of a decode step's
// gathered keys is a few CTAs over thousands of rows, so each thread keeps several rows' loads in
// flight: CPR 32-column chunks per row, unrolled (CPR = 0: any d, a loop per row), and up to 1024
// threads (blockDim.x, a multiple of 32).
template <typename T, int CPR>
__global__ void __launch_bounds__(1024) group_amax_kernel(const CfQuantizeParams p, int64_t nb) {
    const int64_t g = blockIdx.x;
    const int64_t hi = g % p.h, blk = g / p.h % nb, bi = g / p.h / nb;
    const int64_t r0 = blk * p.block_rows;
    const int64_t rows = min(p.block_rows, p.s - r0);  // <= 0 only for s = 0: an all-zero group
    const T* x = static_cast<const T*>(p.x);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int d = (int)p.d;
    const T* x0 = x + ((bi * p.s + r0) * p.h + hi) * p.d;  // row r of the group: x0 + r * h * d
    const int64_t row_stride = p.h * p.d;
    float m = 0.f;
    if constexpr (CPR > 0) {
        // 4 rows per warp and pass, every load predicated (no branch between them)
        constexpr int U = 4;
        for (int64_t r = warp; r < rows; r += U * nwarps) {
            float v[U * CPR];
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int k = 0; k < CPR; ++k) {
                    const bool in = r + u * nwarps < rows && lane + 32 * k < d;
                    v[u * CPR + k] = in ? fabsf(to_float(x0[(r + u * nwarps) * row_stride + lane + 32 * k])) : 0.f;
                }
#pragma unroll
            for (int i = 0; i < U * CPR; ++i) m = fmaxf(m, v[i]);
        }
    } else {
        for (int64_t r = warp; r < rows; r += nwarps)
            for (int c = lane; c < d; c += 32) m = fmaxf(m, fabsf(to_float(x0[r * row_stride + c])));
    }
    __shared__ float warps[32];
    m = group_max<32>(m);
    if (lane == 0) warps[warp] = m;
    __syncthreads();
    if (warp == 0) {
        m = group_max<32>(lane < nwarps ? warps[lane] : 0.f);
        if (lane == 0)
            p.scale[g] = p.mode == CF_QUANT_AMAX ? m : m == 0.f ? 1.f : m * (float)(1.0 / 448.0);
    }
}

template <typename T, int CPR>
cudaError_t launch_group_amax(const CfQuantizeParams& p, int64_t nb, cudaStream_t s) {
    const int64_t group_rows = p.block_rows < p.s ? p.block_rows : p.s;
    const int threads = group_rows >= 512 ? 1024 : group_rows >= 64 ? 256 : 64;
    group_amax_kernel<T, CPR><<<(unsigned)(p.b * nb * p.h), threads, 0, s>>>(p, nb);
    return cudaGetLastError();
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

// nb: row blocks per sequence (cf_quantize_e4m3 computed it for its grid check)
template <typename T>
cudaError_t quantize(const CfQuantizeParams& p, int64_t nb, cudaStream_t s) {
    if (p.mode != CF_QUANT_APPLY) {
        const cudaError_t e = p.d <= 32    ? launch_group_amax<T, 1>(p, nb, s)
                              : p.d <= 64  ? launch_group_amax<T, 2>(p, nb, s)
                              : p.d <= 128 ? launch_group_amax<T, 4>(p, nb, s)
                              : p.d <= 256 ? launch_group_amax<T, 8>(p, nb, s)
                                           : launch_group_amax<T, 0>(p, nb, s);
        if (e != cudaSuccess || p.mode == CF_QUANT_AMAX) return e;
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
        case CF_F32: return (int)quantize<float>(*p, nb, stream);
        case CF_F16: return (int)quantize<__half>(*p, nb, stream);
        case CF_BF16: return (int)quantize<__nv_bfloat16>(*p, nb, stream);
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
