// The CTA kernel with a 128x256 tile (rows x vocabulary columns), the lean item arithmetic and two items an iteration
// of the item loop, forward statistics.
#include "launch.cuh"

namespace sm90 {
template void launch_cta<2, 256, 2>(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);
}  // namespace sm90
