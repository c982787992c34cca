// CTA tile 128x256 (rows x vocabulary columns) of the fused kernel.
#include "sm90_fused.cuh"

namespace sm90 {
template void launch_fused<2, 256, 1>(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);
template void launch_fused<2, 256, 2>(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);
}  // namespace sm90
