// Tensor-core backward instantiations for bf16 (one file per dtype so they compile in parallel).
#include "bwd.cuh"

namespace cf {
CF_INST_BWD(__nv_bfloat16, 32)
CF_INST_BWD(__nv_bfloat16, 64)
CF_INST_BWD(__nv_bfloat16, 96)
CF_INST_BWD(__nv_bfloat16, 128)
CF_INST_BWD(__nv_bfloat16, 192)
CF_INST_BWD(__nv_bfloat16, 256)
}  // namespace cf

#ifdef CF_BWD_TRACE
// The backward probe's buffer (experiments/bwd_trace.py): copies it out (then clears it); 0 on success.
extern "C" int cf_bwd_trace_read(long long* dst) { return cf::read_and_clear_trace(cf::g_bwd_trace, dst); }
#endif
