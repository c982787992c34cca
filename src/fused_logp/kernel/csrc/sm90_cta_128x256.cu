// The CTA kernel with a 128x256 tile (rows x vocabulary columns), forward statistics; the logits, where asked for,
// stored by the producer warpgroup.
#include "launch.cuh"

namespace sm90 {
template void launch_cta<2, 256, true>(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);
}  // namespace sm90
