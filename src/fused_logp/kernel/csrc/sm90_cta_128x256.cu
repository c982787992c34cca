// The CTA kernel with a 128x256 tile (rows x vocabulary columns), forward statistics.
#include "launch.cuh"

namespace sm90 {
template void launch_cta<2, 256>(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);
}  // namespace sm90
