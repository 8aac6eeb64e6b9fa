// Tensor-core backward instantiations for f32 (3xTF32 on mma.sync m16n8k8; d = 192 / 256 on
// 32 x 64 tiles where the device has the shared memory: config.cuh BwdTraits, plan.cu).
#include "bwd.cuh"

namespace cf {
CF_INST_BWD(float, 32)
CF_INST_BWD(float, 64)
CF_INST_BWD(float, 96)
CF_INST_BWD(float, 128)
CF_INST_BWD(float, 192)
CF_INST_BWD(float, 256)
}  // namespace cf
