// The producer / consumer ring of the warp-specialised Hopper kernels: kStages shared-memory
// buffers, each guarded by two mbarriers.
//   full[s]  : the producer's loads into stage s have landed (cp.async-tracking arrivals, one
//              per producer thread, plus, for a TMA load, its expected byte count);
//   empty[s] : every consumer warp is done reading stage s (one plain arrival per warp).
// Buffers are numbered n = 0, 1, 2, ... over the CTA's whole life (across tiles); buffer n uses
// stage n % kStages, and its barriers complete once per use of the stage, so the phase to wait
// for has parity (n / kStages) & 1. The producer waits on the *previous* phase of "empty"
// (parity ^ 1): a fresh barrier counts that phase as completed, so the first kStages
// acquisitions pass at once.
#pragma once
#include "wgmma.cuh"

namespace cf {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The barriers of one pipeline are uint64_t bars[2][kStages] (full, then empty) in shared
// memory; the object holds just their shared address (one register: kernels keep several
// pipelines live, and a warp-specialised producer runs with few registers).
template <int kStages>
struct Pipeline {
    static constexpr uint32_t kEmpty = 8 * kStages;  // byte offset of empty[0] from full[0]
    uint32_t full;

    __device__ __forceinline__ explicit Pipeline(uint32_t bars) : full(bars) {}

    static __device__ __forceinline__ uint32_t stage(uint32_t n) { return n % kStages; }
    static __device__ __forceinline__ uint32_t parity(uint32_t n) { return (n / kStages) & 1; }

    // One thread, before the CTA-wide barrier that publishes the initialisation.
    __device__ __forceinline__ void init(int producer_arrivals, int consumer_arrivals) const {
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full + 8 * s, producer_arrivals);
            mbar_init(full + kEmpty + 8 * s, consumer_arrivals);
        }
    }
    // Producer: wait until buffer n's stage is free, load, then commit (arrives when this
    // thread's cp.async copies so far have landed).
    __device__ __forceinline__ void producer_acquire(uint32_t n) const { mbar_wait(full + kEmpty + 8 * stage(n), parity(n) ^ 1); }
    __device__ __forceinline__ void producer_commit_cp_async(uint32_t n) const { mbar_arrive_cp_async(full + 8 * stage(n)); }
    // The "full" barrier of buffer n, for TMA copies (tma.cuh) that complete bytes on it; the
    // producer threads still commit as above (every thread arrives once per buffer, whichever
    // way its stage was loaded).
    __device__ __forceinline__ uint32_t full_bar(uint32_t n) const { return full + 8 * stage(n); }
    // Consumer: wait until buffer n has landed; its cp.async (generic proxy) writes are then
    // made visible to wgmma (async proxy). Release: one arrival per warp, after the wgmma that
    // read the buffer completed (wgmma.wait_group is warp-synchronous).
    __device__ __forceinline__ void consumer_wait(uint32_t n) const {
        mbar_wait(full + 8 * stage(n), parity(n));
        fence_async_smem();
    }
    __device__ __forceinline__ void consumer_release(uint32_t n, int lane) const {
        __syncwarp();  // every lane's reads of the stage happen before lane 0's arrival (racecheck)
        if (lane == 0) mbar_arrive(full + kEmpty + 8 * stage(n));
    }
};
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace cf
