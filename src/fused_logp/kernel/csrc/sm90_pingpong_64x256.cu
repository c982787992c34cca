// The persistent ping-pong kernel, 64 x 256 tiles per consumer warpgroup, forward statistics.
#include "launch.cuh"

namespace sm90 {
template void launch_pingpong<256>(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);
}  // namespace sm90
