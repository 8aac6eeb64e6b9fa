// cf_add_rms_norm and cf_silu_mul (flash_api.h): the elementwise steps around the Llama block's
// products, each one kernel instead of two (residual add + norm; silu + product), so that a
// decode step replayed from a CUDA graph has fewer nodes.
#include "../flash_api.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace cf {

template <typename T> __device__ __forceinline__ float ld(const T* p, int64_t i);
template <> __device__ __forceinline__ float ld<float>(const float* p, int64_t i) { return p[i]; }
template <> __device__ __forceinline__ float ld<__half>(const __half* p, int64_t i) { return __half2float(p[i]); }
template <> __device__ __forceinline__ float ld<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i) {
    return __bfloat162float(p[i]);
}
template <typename T> __device__ __forceinline__ T cvt(float x);
template <> __device__ __forceinline__ float cvt<float>(float x) { return x; }
template <> __device__ __forceinline__ __half cvt<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 cvt<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

constexpr int kNormThreads = 256;

// One CTA per row: the sum (rounded to T, as the separate add would store it) is written and
// kept in registers-through-global for the second pass; the sum of squares is reduced in f32.
template <typename T>
__global__ void __launch_bounds__(kNormThreads) add_rms_norm_kernel(const CfAddRmsNormParams p) {
    const int64_t row = blockIdx.x;
    const int n = p.n;
    const T* x = (const T*)p.x + row * n;
    const T* r = p.residual ? (const T*)p.residual + row * n : nullptr;
    T* s = p.sum_out ? (T*)p.sum_out + row * n : nullptr;
    const T* w = (const T*)p.weight;
    T* out = (T*)p.out + row * n;
    float ss = 0.f;
    for (int c = threadIdx.x; c < n; c += kNormThreads) {
        float v = ld(x, c);
        if (r) {
            const T sum = cvt<T>(v + ld(r, c));
            s[c] = sum;
            v = ld(&sum, 0);
        }
        ss += v * v;
    }
    __shared__ float red[kNormThreads / 32];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float t = threadIdx.x < kNormThreads / 32 ? red[threadIdx.x] : 0.f;
        for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
        if (threadIdx.x == 0) red[0] = t;
    }
    __syncthreads();
    const float scale = rsqrtf(red[0] / (float)n + p.eps);
    // Each thread reads back the sums it wrote itself (same columns): no barrier needed.
    const T* src = r ? s : x;
    for (int c = threadIdx.x; c < n; c += kNormThreads) out[c] = cvt<T>(ld(src, c) * scale * ld(w, c));
}

template <typename T>
__global__ void silu_mul_kernel(const CfSiluMulParams p) {
    const int64_t total = p.rows * p.n;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = e / p.n;
        const int c = (int)(e % p.n);
        const float g = ld((const T*)p.gate, row * p.gate_row_stride + c);
        const float u = ld((const T*)p.up, row * p.up_row_stride + c);
        ((T*)p.out)[e] = cvt<T>(g / (1.f + __expf(-g)) * u);
    }
}

}  // namespace cf

extern "C" int cf_add_rms_norm(const CfAddRmsNormParams* p, cudaStream_t stream) {
    using namespace cf;
    if (p->rows < 0 || p->n < 0 || p->rows > 0x7fffffff || (p->residual && !p->sum_out)) return CF_ERR_BAD_ARGUMENT;
    if (p->rows == 0 || p->n == 0) return CF_OK;
    const dim3 grid((unsigned)p->rows);
    switch (p->dtype) {
        case CF_F32: add_rms_norm_kernel<float><<<grid, kNormThreads, 0, stream>>>(*p); break;
        case CF_F16: add_rms_norm_kernel<__half><<<grid, kNormThreads, 0, stream>>>(*p); break;
        case CF_BF16: add_rms_norm_kernel<__nv_bfloat16><<<grid, kNormThreads, 0, stream>>>(*p); break;
        default: return CF_ERR_UNSUPPORTED_DTYPE;
    }
    return (int)cudaGetLastError();
}

extern "C" int cf_silu_mul(const CfSiluMulParams* p, cudaStream_t stream) {
    using namespace cf;
    if (p->rows < 0 || p->n < 0) return CF_ERR_BAD_ARGUMENT;
    const int64_t total = p->rows * p->n;
    if (total == 0) return CF_OK;
    const int threads = 256;
    const int64_t blocks64 = (total + threads - 1) / threads;
    const unsigned blocks = (unsigned)(blocks64 < 65535 * 8 ? blocks64 : 65535 * 8);
    switch (p->dtype) {
        case CF_F32: silu_mul_kernel<float><<<blocks, threads, 0, stream>>>(*p); break;
        case CF_F16: silu_mul_kernel<__half><<<blocks, threads, 0, stream>>>(*p); break;
        case CF_BF16: silu_mul_kernel<__nv_bfloat16><<<blocks, threads, 0, stream>>>(*p); break;
        default: return CF_ERR_UNSUPPORTED_DTYPE;
    }
    return (int)cudaGetLastError();
}
