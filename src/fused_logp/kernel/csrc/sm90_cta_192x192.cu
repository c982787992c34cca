// The 192-row CTA kernel (tall_kernel.cuh, configuration cta-192x192), forward statistics and the logits where asked
// for: its launch.
#include "launch.cuh"
#include "tall_kernel.cuh"

namespace sm90 {

void launch_tall(const torch::Tensor& hidden, const torch::Tensor& weight, const FusedParams& p,
                 cudaStream_t stream) {
  using C = TallCfg;
  TORCH_CHECK(p.d % kBK == 0, "sm90: launch cta-192x192 takes D a multiple of 64, got D = ", num(p.d));
  TORCH_CHECK(p.n_real % kTile == 0, "sm90: launch cta-192x192 takes a vocabulary (shard) width that is a "
              "multiple of 64, got ", num(p.n_real));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(p.logits) % 8 == 0, "sm90: launch cta-192x192 stores the logits "
              "as 8-byte pairs: their start must be 8-byte aligned");
  FusedParams q = p;
  q.num_m = (p.n_rows + C::BM - 1) / C::BM;
  q.num_n = (p.n_real + C::BN - 1) / C::BN;
  const long long tiles = static_cast<long long>(q.num_m) * q.num_n;
  TORCH_CHECK(tiles < (1LL << 31), "sm90: grid too large");
  const CUtensorMap mh = make_map(hidden, C::BM);
  const CUtensorMap mw = make_map(weight, C::BN);
  auto kern = p.logits != nullptr ? tall_kernel<true> : tall_kernel<false>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM));
  kern<<<static_cast<unsigned>(tiles), kThreads, C::SMEM, stream>>>(mh, mw, q);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace sm90
