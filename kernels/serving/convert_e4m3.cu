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

}  // namespace cf

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
