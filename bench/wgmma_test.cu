// Unit test of kernels/wgmma.cuh on an sm_90 GPU: one warpgroup computes D[64][N] = A * B with
// K = 128 (two panels) for every operand placement the attention kernels use, against a
// double-precision host product. Build: nvcc -std=c++17 -arch=sm_90a -I kernels bench/wgmma_test.cu
#include "wgmma.cuh"
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>

using namespace cf;
using T = __nv_bfloat16;
constexpr int M = 64, K = 128;

// MODE 0: SS, A K-major, B K-major    (A [M][K], B stored [N][K])
// MODE 1: SS, A MN-major, B MN-major  (A stored [K][M], B stored [K][N])
// MODE 2: RS, B K-major
// MODE 3: RS, B MN-major
// MODE 4: SS, A K-major, B MN-major
template <int N, int MODE>
__global__ void __launch_bounds__(128) wg_test(const T* a, const T* b, float* d) {
    extern __shared__ __align__(1024) unsigned char smem[];
    T* sA = reinterpret_cast<T*>(smem);
    T* sB = sA + M * K;
    const int tid = threadIdx.x;
    constexpr bool a_mn = MODE == 1, b_mn = MODE == 1 || MODE == 3 || MODE == 4;
    if (a_mn) load_panels<K, M / 8, 128>(sA, a, M, K, M / 8, tid, a);
    else load_panels<M, K / 8, 128>(sA, a, K, M, K / 8, tid, a);
    if (b_mn) load_panels<K, N / 8, 128>(sB, b, N, K, N / 8, tid, b);
    else load_panels<N, K / 8, 128>(sB, b, K, N, K / 8, tid, b);
    cp_async_commit();
    cp_async_wait<0>();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    fence_async_smem();
    __syncthreads();
    float acc[N / 2];
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    uint32_t afrag[K / 16][4];
    if (MODE == 2 || MODE == 3) {
        const uint32_t* a32 = reinterpret_cast<const uint32_t*>(a);
        for (int ks = 0; ks < K / 16; ++ks) {
            const int r = 16 * warp + g, c = 16 * ks + 2 * q;
            afrag[ks][0] = a32[(r * K + c) / 2];
            afrag[ks][1] = a32[((r + 8) * K + c) / 2];
            afrag[ks][2] = a32[(r * K + c + 8) / 2];
            afrag[ks][3] = a32[((r + 8) * K + c + 8) / 2];
        }
    }
    const uint32_t tA = smem_addr(sA), tB = smem_addr(sB);
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < K / 16; ++ks) {
        const uint64_t db = b_mn ? desc_mn_major(tB, K, ks) : desc_k_major(tB, N, ks);
        if constexpr (MODE == 2 || MODE == 3) {
            if constexpr (b_mn) wgmma_rs<N, T, 1>(acc, afrag[ks], db, ks > 0);
            else wgmma_rs<N, T, 0>(acc, afrag[ks], db, ks > 0);
        } else {
            const uint64_t da = a_mn ? desc_mn_major(tA, K, ks) : desc_k_major(tA, M, ks);
            if constexpr (MODE == 1) wgmma_ss<N, T, 1, 1>(acc, da, db, ks > 0);
            else if constexpr (MODE == 4) wgmma_ss<N, T, 0, 1>(acc, da, db, ks > 0);
            else wgmma_ss<N, T, 0, 0>(acc, da, db, ks > 0);
        }
    }
    wg_commit();
    wg_wait<0>();
    reg_fence(acc);
    for (int j = 0; j < N / 8; ++j)
        for (int e = 0; e < 4; ++e) {
            const int r = 16 * warp + g + 8 * (e >> 1), c = 8 * j + 2 * q + (e & 1);
            d[r * N + c] = acc[4 * j + e];
        }
#endif
}

template <int N, int MODE>
int run(const char* name) {
    std::vector<T> ha(M * K), hb(K * N);
    std::vector<float> fa(M * K), fb(K * N);
    for (size_t i = 0; i < ha.size(); ++i) { ha[i] = __float2bfloat16((rand() % 2001 - 1000) / 1000.f); fa[i] = __bfloat162float(ha[i]); }
    for (size_t i = 0; i < hb.size(); ++i) { hb[i] = __float2bfloat16((rand() % 2001 - 1000) / 1000.f); fb[i] = __bfloat162float(hb[i]); }
    T *da, *db; float* dd;
    cudaMalloc(&da, ha.size() * 2); cudaMalloc(&db, hb.size() * 2); cudaMalloc(&dd, M * N * 4);
    cudaMemcpy(da, ha.data(), ha.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(db, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice);
    cudaMemset(dd, 0xff, M * N * 4);  // NaN poison
    const int smem = (M * K + K * N) * 2;
    cudaFuncSetAttribute(wg_test<N, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    wg_test<N, MODE><<<1, 128, smem>>>(da, db, dd);
    cudaError_t e = cudaDeviceSynchronize();
    std::vector<float> hd(M * N);
    cudaMemcpy(hd.data(), dd, M * N * 4, cudaMemcpyDeviceToHost);
    double worst = 0;
    const bool a_mn = MODE == 1, b_mn = MODE == 1 || MODE == 3 || MODE == 4;
    for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) {
            double s = 0;
            for (int k = 0; k < K; ++k) {
                const double x = a_mn ? fa[k * M + m] : fa[m * K + k];
                const double y = b_mn ? fb[k * N + n] : fb[n * K + k];
                s += x * y;
            }
            const double err = std::fabs(s - hd[m * N + n]);
            worst = std::isnan(hd[m * N + n]) ? 1e30 : std::max(worst, err);
        }
    const bool ok = e == cudaSuccess && worst < 1e-3;
    printf("%-28s N=%3d  %s  max_err=%.3g  (%s)\n", name, N, ok ? "PASS" : "FAIL", worst, cudaGetErrorString(e));
    cudaFree(da); cudaFree(db); cudaFree(dd);
    return ok ? 0 : 1;
}

int main() {
    int fails = 0;
    fails += run<64, 0>("ss A:K-major B:K-major");
    fails += run<128, 0>("ss A:K-major B:K-major");
    fails += run<64, 1>("ss A:MN-major B:MN-major");
    fails += run<128, 1>("ss A:MN-major B:MN-major");
    fails += run<64, 2>("rs B:K-major");
    fails += run<128, 2>("rs B:K-major");
    fails += run<64, 3>("rs B:MN-major");
    fails += run<128, 3>("rs B:MN-major");
    fails += run<128, 4>("ss A:K-major B:MN-major");
    printf("%s: %d failed\n", fails ? "FAIL" : "OK", fails);
    return fails != 0;
}
