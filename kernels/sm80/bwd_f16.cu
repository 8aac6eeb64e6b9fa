// Tensor-core backward instantiations for f16 (one file per dtype so they compile in parallel).
#include "bwd.cuh"

namespace cf {
CF_INST_BWD(__half, 32)
CF_INST_BWD(__half, 64)
CF_INST_BWD(__half, 96)
CF_INST_BWD(__half, 128)
CF_INST_BWD(__half, 192)
CF_INST_BWD(__half, 256)
}  // namespace cf
