// Persistent ping-pong fused kernel, warpgroup tile 64 x 128.
#include "sm90_fused.cuh"

namespace sm90 {
template void launch_pingpong<128>(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);
}  // namespace sm90
