// Tensor-core backward instantiations for f32 (3xTF32 on mma.sync m16n8k8; d = 192 / 256 on
// 32 x 64 tiles where the device has the shared memory: config.cuh BwdTraits, dispatch.cu).
#include "bwd.cuh"

namespace cf {
template cudaError_t run_bwd_tc<float, 32>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
template cudaError_t run_bwd_tc<float, 64>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
template cudaError_t run_bwd_tc<float, 96>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
template cudaError_t run_bwd_tc<float, 128>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
template cudaError_t run_bwd_tc<float, 192>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
template cudaError_t run_bwd_tc<float, 256>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
}  // namespace cf
