// Tensor-core backward instantiations for f16 (one file per dtype so they compile in parallel).
#include "bwd.cuh"

namespace cf {
template cudaError_t run_bwd_tc<__half, 32>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
template cudaError_t run_bwd_tc<__half, 64>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
template cudaError_t run_bwd_tc<__half, 96>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
template cudaError_t run_bwd_tc<__half, 128>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
template cudaError_t run_bwd_tc<__half, 192>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
template cudaError_t run_bwd_tc<__half, 256>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
}  // namespace cf
