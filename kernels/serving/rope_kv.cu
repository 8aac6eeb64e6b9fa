// cf_rope_kv_write (flash_api.h): the rotary embedding of q and k and the paged cache write of
// k and v in one pass. One CTA per row; its threads stride over (head, pair) of the row's
// h + 2 hkv heads, each pair (i, i + d/2) rotated in f32 (v heads are copied). Replaces, per
// decoder layer, the copies of the projection's q/k views, two rotary kernels and the cache
// write's slot checks and scatters (a decode step is hundreds of such small kernels).
#include "../flash_api.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace cf {

template <typename T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T>
__global__ void rope_kv_kernel(const CfRopeKvParams p) {
    const int t = blockIdx.x, half = p.d / 2, heads = p.h + 2 * p.hkv;
    const uint32_t slot = p.slots[t];
    const bool write = (int64_t)slot < p.num_slots;
    const T* cs = (const T*)p.cos + (int64_t)t * half;
    const T* sn = (const T*)p.sin + (int64_t)t * half;
    for (int e = threadIdx.x; e < heads * half; e += blockDim.x) {
        const int head = e / half, i = e % half;
        const T* src;
        T* dst;
        bool rotate = true;
        if (head < p.h) {
            src = (const T*)p.q_in + t * p.q_row_stride + (int64_t)head * p.d;
            dst = (T*)p.q_out + ((int64_t)t * p.h + head) * p.d;
        } else if (head < p.h + p.hkv) {
            if (!write) continue;
            const int hk = head - p.h;
            src = (const T*)p.k_in + t * p.k_row_stride + (int64_t)hk * p.d;
            dst = (T*)p.k_cache + ((int64_t)slot * p.hkv + hk) * p.d;
        } else {
            if (!write) continue;
            const int hk = head - p.h - p.hkv;
            src = (const T*)p.v_in + t * p.v_row_stride + (int64_t)hk * p.d;
            dst = (T*)p.v_cache + ((int64_t)slot * p.hkv + hk) * p.d;
            rotate = false;
        }
        const T x1 = src[i], x2 = src[i + half];
        if (rotate) {
            const float c = to_f(cs[i]), s = to_f(sn[i]), a = to_f(x1), b = to_f(x2);
            dst[i] = from_f<T>(a * c - b * s);
            dst[i + half] = from_f<T>(a * s + b * c);
        } else {
            dst[i] = x1;
            dst[i + half] = x2;
        }
    }
}

}  // namespace cf

extern "C" int cf_rope_kv_write(const CfRopeKvParams* p, cudaStream_t stream) {
    using namespace cf;
    if (p->t < 0 || p->h < 0 || p->hkv < 0 || p->d <= 0 || p->d % 2 != 0 || p->num_slots < 0)
        return CF_ERR_BAD_ARGUMENT;
    if (p->t == 0 || p->h + p->hkv == 0) return CF_OK;
    const int work = (p->h + 2 * p->hkv) * (p->d / 2);
    const int threads = work >= 256 ? 256 : ((work + 31) / 32) * 32;
    switch (p->dtype) {
        case CF_F32: rope_kv_kernel<float><<<p->t, threads, 0, stream>>>(*p); break;
        case CF_F16: rope_kv_kernel<__half><<<p->t, threads, 0, stream>>>(*p); break;
        case CF_BF16: rope_kv_kernel<__nv_bfloat16><<<p->t, threads, 0, stream>>>(*p); break;
        default: return CF_ERR_UNSUPPORTED_DTYPE;
    }
    return (int)cudaGetLastError();
}
