// The 192-row CTA kernel (tall_kernel.cuh, configuration cta-192x192), forward statistics and the logits where asked
// for: its launch.
#include "launch.cuh"
#include "tall_kernel.cuh"

namespace sm90 {

void launch_tall(const torch::Tensor& hidden, const torch::Tensor& weight, const FusedParams& p,
                 cudaStream_t stream) {
  using C = TallCfg;
  const FusedParams q = register_tile_params(p, "cta-192x192", C::BM, C::BN);
  const CUtensorMap mh = make_map(hidden, C::BM);
  const CUtensorMap mw = make_map(weight, C::BN);
  launch_kernel(p.logits != nullptr ? tall_kernel<true> : tall_kernel<false>,
                static_cast<long long>(q.num_m) * q.num_n, C::SMEM, stream, mh, mw, q);
}

}  // namespace sm90
