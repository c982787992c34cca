// The persistent ping-pong kernel with 128x192 consumer tiles (pingpong_kernel.cuh), forward statistics and the
// logits where asked for: its launch.
#include "launch.cuh"
#include "pingpong_kernel.cuh"

namespace sm90 {

void launch_pingpong(const torch::Tensor& hidden, const torch::Tensor& weight, const FusedParams& p,
                     cudaStream_t stream) {
  using C = PingPongCfg;
  TORCH_CHECK(p.d % kBK == 0, "sm90: launch pingpong-128x192 takes D a multiple of 64, got D = ", num(p.d));
  TORCH_CHECK(p.n_real % kTile == 0, "sm90: launch pingpong-128x192 takes a vocabulary (shard) width that is a "
              "multiple of 64, got ", num(p.n_real));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(p.logits) % 8 == 0, "sm90: launch pingpong-128x192 stores the logits "
              "as 8-byte pairs: their start must be 8-byte aligned");
  FusedParams q = p;
  q.num_m = (p.n_rows + C::BM - 1) / C::BM;
  q.num_n = (p.n_real + C::BN - 1) / C::BN;
  const long long tiles = static_cast<long long>(q.num_m) * q.num_n;
  TORCH_CHECK(tiles < (1LL << 31), "sm90: grid too large");
  const CUtensorMap mh = make_map(hidden, C::BM);
  const CUtensorMap mw = make_map(weight, C::BN);
  auto kern = p.logits != nullptr ? pingpong_kernel<true> : pingpong_kernel<false>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM));
  const unsigned grid = static_cast<unsigned>(std::min<long long>(tiles, sm_count()));
  kern<<<grid, kThreads, C::SMEM, stream>>>(mh, mw, q);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace sm90
