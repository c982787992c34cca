// CTA tile 64x128 (rows x vocabulary columns) of the fused kernel.
#include "sm90_fused.cuh"

namespace sm90 {
template void launch_fused<1, 64, 1>(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);
}  // namespace sm90
