// Tensor-core backward instantiations for f32 (3xTF32 on mma.sync m16n8k8; head-dim tiles up to
// 128, larger ones run the SIMT kernels: dispatch.cu).
#include "bwd.cuh"

namespace cf {
template cudaError_t run_bwd_tc<float, 32>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
template cudaError_t run_bwd_tc<float, 64>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
template cudaError_t run_bwd_tc<float, 96>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
template cudaError_t run_bwd_tc<float, 128>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
}  // namespace cf
