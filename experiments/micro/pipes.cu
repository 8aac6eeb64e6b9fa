// Issue-rate microbenchmark of the softmax's instruction kinds on one GPU (bench/NOTES.md:
// "Forward timeline"): each warp runs ITER rounds of 8 independent chains of one kind (or two
// kinds interleaved), 2 warps per SM sub-partition; prints cycles per warp-instruction per
// sub-partition. Two kinds whose mix costs the sum of their times share a pipe; the max, they do not.
// build: nvcc -arch=sm_90a -O3 -o pipes pipes.cu
#include <cstdio>
#include <cuda_runtime.h>
constexpr int ITER = 4096;

template <int KIND>
__device__ __forceinline__ void op(float& x, float y) {
    if constexpr (KIND == 0) asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(x));
    if constexpr (KIND == 1) {  // f32 pair -> bf16x2 (F2FP.BF16.F32.PACK_AB)
        unsigned r;
        asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x), "f"(y));
        x = __uint_as_float(r);
    }
    if constexpr (KIND == 2) {  // f32 pair -> e4m3x2
        unsigned short r;
        asm volatile("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(x), "f"(y));
        x = __uint_as_float((unsigned)r);
    }
    if constexpr (KIND == 3) asm volatile("fma.rn.f32 %0, %0, %1, %1;" : "+f"(x) : "f"(y));
    if constexpr (KIND == 4) asm volatile("max.f32 %0, %0, %1;" : "+f"(x) : "f"(y));
    if constexpr (KIND == 5) {
        unsigned r, a = __float_as_uint(x), b = __float_as_uint(y);
        asm volatile("prmt.b32 %0, %1, %2, 0x7632;" : "=r"(r) : "r"(a), "r"(b));
        x = __uint_as_float(r);
    }
    if constexpr (KIND == 6) asm volatile("add.f32 %0, %0, %1;" : "+f"(x) : "f"(y));
    if constexpr (KIND == 7) {  // integer add (rounding a bf16 by its bit pattern)
        unsigned a = __float_as_uint(x);
        asm volatile("add.u32 %0, %0, 0x7fff;" : "+r"(a));
        x = __uint_as_float(a);
    }
}

template <int A, int B>
__global__ void bench(float* out, long long* cyc, float seed) {
    float x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = seed * (threadIdx.x + i);
    const float y = seed * 0.5f;
    __syncthreads();
    const long long t0 = clock64();
    for (int it = 0; it < ITER; ++it) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            op<A>(x[i], y);
            if constexpr (B >= 0) op<B>(x[i], y);
        }
    }
    __syncthreads();
    const long long t1 = clock64();
    float s = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) s += x[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
    if (threadIdx.x == 0) cyc[blockIdx.x] = t1 - t0;
}

template <int A, int B>
void run(const char* name, int warps_per_smsp) {
    float* out;
    long long* cyc;
    const int threads = 128 * warps_per_smsp, blocks = 132;
    cudaMalloc(&out, sizeof(float) * threads * blocks);
    cudaMalloc(&cyc, sizeof(long long) * blocks);
    bench<A, B><<<blocks, threads>>>(out, cyc, 1e-3f);
    bench<A, B><<<blocks, threads>>>(out, cyc, 1e-3f);
    long long h[132];
    cudaMemcpy(h, cyc, sizeof(h), cudaMemcpyDeviceToHost);
    const double per = (double)h[0] / (ITER * 8.0 * (B >= 0 ? 2 : 1) * warps_per_smsp);
    printf("%-28s warps/SMSP %d: %6.2f cycles per warp-instruction per SMSP\n", name, warps_per_smsp, per);
    cudaFree(out);
    cudaFree(cyc);
}

int main() {
    for (int w : {1, 2, 4}) {
        run<0, -1>("ex2 (MUFU)", w);
        run<1, -1>("cvt bf16x2 (F2FP)", w);
        run<2, -1>("cvt e4m3x2 (F2FP)", w);
        run<3, -1>("ffma", w);
        run<4, -1>("fmnmx", w);
        run<5, -1>("prmt", w);
        run<6, -1>("fadd", w);
        run<7, -1>("iadd", w);
        run<0, 1>("ex2 + cvt bf16x2", w);
        run<0, 2>("ex2 + cvt e4m3x2", w);
        run<0, 3>("ex2 + ffma", w);
        run<0, 5>("ex2 + prmt", w);
        run<4, 6>("fmnmx + fadd", w);
        run<1, 3>("cvt bf16x2 + ffma", w);
    }
    return cudaDeviceSynchronize() != cudaSuccess;
}
