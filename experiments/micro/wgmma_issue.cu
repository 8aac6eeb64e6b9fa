// Does issuing wgmma block the issuing warpgroup? (bench/NOTES.md "Forward timeline")
// One CTA per SM, WGS consumer warpgroups; each issues NW wgmma m64n128k16 (bf16, A and B from
// shared memory, one commit group) and records clock64() before the issue, after the last
// issue and after wgmma.wait_group 0. If the issue time stays small as NW grows, issue is
// asynchronous; if it grows with NW (about 64 cycles per m64n128k16 at the full rate), the warp
// waits for queue room while the products run.
// build (device): nvcc -arch=sm_90a -O3 -I kernels -o /tmp/wgi experiments/micro/wgmma_issue.cu
#include <cstdio>
#include <cuda_runtime.h>
#include "sm90/wgmma.cuh"

using namespace cf;

template <int NW>
__global__ void issue_kernel(long long* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t a = smem_addr(smem) + (threadIdx.x / 128) * 16384, b = smem_addr(smem) + 65536;
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    long long t_issue = 0, t_wait = 0;
    for (int rep = 0; rep < 8; ++rep) {
        __syncthreads();
        const long long t0 = clock64();
        wg_fence();
#pragma unroll
        for (int k = 0; k < NW; ++k)
            wgmma_ss<128, __nv_bfloat16, 0, 0>(acc, desc_k_major(a, 64, k & 3), desc_k_major(b, 128, k & 3), 1);
        wg_commit();
        const long long t1 = clock64();
        wg_wait<0>();
        reg_fence(acc);
        const long long t2 = clock64();
        if (rep >= 2) t_issue += t1 - t0, t_wait += t2 - t1;
    }
    float s = 0;
#pragma unroll
    for (int i = 0; i < 64; ++i) s += acc[i];
    if (threadIdx.x % 128 == 0) {
        out[(blockIdx.x * 4 + threadIdx.x / 128) * 3 + 0] = t_issue / 6;
        out[(blockIdx.x * 4 + threadIdx.x / 128) * 3 + 1] = t_wait / 6;
        out[(blockIdx.x * 4 + threadIdx.x / 128) * 3 + 2] = (long long)s;  // keeps acc alive
    }
#endif
}

template <int NW>
void run(int wgs) {
    long long* d;
    cudaMalloc(&d, 132 * 4 * 3 * sizeof(long long));
    const int smem = 65536 + 32768;
    cudaFuncSetAttribute(issue_kernel<NW>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    issue_kernel<NW><<<132, 128 * wgs, smem>>>(d);
    long long h[12];
    cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost);
    printf("wgs %d  NW %2d (%4d cycles of tensor work at the full rate each): wg0 issue %5lld wait %5lld", wgs, NW,
           64 * NW, h[0], h[1]);
    if (wgs > 1) printf(" | wg1 issue %5lld wait %5lld", h[3], h[4]);
    printf("  %s\n", cudaGetErrorString(cudaGetLastError()));
    cudaFree(d);
}

int main() {
    for (int wgs : {1, 2}) {
        run<1>(wgs);
        run<2>(wgs);
        run<4>(wgs);
        run<8>(wgs);
        run<16>(wgs);
    }
    return 0;
}
