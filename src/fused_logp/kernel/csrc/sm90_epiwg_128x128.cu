// Persistent fused kernel with a dedicated epilogue warpgroup, CTA tile 128 x 128.
#include "sm90_fused.cuh"

namespace sm90 {
template void launch_epiwg<true>(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);
}  // namespace sm90
