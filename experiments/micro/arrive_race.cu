// Does compute-sanitizer racecheck follow bar.arrive -> bar.sync? (bench/NOTES.md, 2026-11-27, commit df99929)
//   nvcc -O2 -lineinfo -arch=sm_90a -o /tmp/ar experiments/micro/arrive_race.cu
//   compute-sanitizer --tool racecheck /tmp/ar war; compute-sanitizer --tool racecheck /tmp/ar raw
#include <cstdio>
__global__ void war(float* out) {  // group B reads, arrives; group A syncs, then overwrites
    __shared__ float s[128];
    const int t = threadIdx.x;
    if (t < 128) s[t] = t;
    __syncthreads();
    if (t >= 128) {
        out[t] = s[t - 128];
        asm volatile("bar.arrive 1, 256;\n" ::: "memory");
    } else {
        asm volatile("bar.sync 1, 256;\n" ::: "memory");
        s[t] = 2.f * t;
    }
    __syncthreads();
    out[t] += s[t & 127];
}
__global__ void raw(float* out) {  // group A writes, arrives; group B syncs, then reads
    __shared__ float s[128];
    const int t = threadIdx.x;
    if (t < 128) {
        s[t] = t;
        asm volatile("bar.arrive 2, 256;\n" ::: "memory");
    } else {
        asm volatile("bar.sync 2, 256;\n" ::: "memory");
        out[t] = s[t - 128];
    }
}
int main(int argc, char** argv) {
    float* o;
    cudaMalloc(&o, 256 * 4);
    if (argc > 1 && argv[1][0] == 'r') raw<<<1, 256>>>(o); else war<<<1, 256>>>(o);
    printf("%s: %s\n", argc > 1 ? argv[1] : "war", cudaGetErrorString(cudaDeviceSynchronize()));
}
