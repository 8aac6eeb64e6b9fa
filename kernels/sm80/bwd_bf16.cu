// Tensor-core backward instantiations for bf16 (one file per dtype so they compile in parallel).
#include "bwd.cuh"

namespace cf {
template cudaError_t run_bwd_tc<__nv_bfloat16, 32>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
template cudaError_t run_bwd_tc<__nv_bfloat16, 64>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
template cudaError_t run_bwd_tc<__nv_bfloat16, 96>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
template cudaError_t run_bwd_tc<__nv_bfloat16, 128>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
template cudaError_t run_bwd_tc<__nv_bfloat16, 192>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
template cudaError_t run_bwd_tc<__nv_bfloat16, 256>(const CfBwdParams&, const BwdWs&, bool, cudaStream_t);
}  // namespace cf

#ifdef CF_BWD_TRACE
// The backward probe's buffer (experiments/bwd_trace.py): copies it out (then clears it); 0 on success.
extern "C" int cf_bwd_trace_read(long long* dst) { return cf::read_and_clear_trace(cf::g_bwd_trace, dst); }
#endif
