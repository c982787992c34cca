// The persistent ping-pong kernel with 128x192 consumer tiles (pingpong_kernel.cuh), forward statistics and the
// logits where asked for: its launch.
#include "launch.cuh"
#include "pingpong_kernel.cuh"

namespace sm90 {

void launch_pingpong(const torch::Tensor& hidden, const torch::Tensor& weight, const FusedParams& p,
                     cudaStream_t stream, bool dynamic) {
  using C = PingPongCfg;
  FusedParams q = register_tile_params(p, dynamic ? "pingpong-128x192-dyn" : "pingpong-128x192", C::BM, C::BN);
  const long long tiles = static_cast<long long>(q.num_m) * q.num_n;
  const torch::Tensor counter = set_tile_counter(q, hidden, dynamic);
  const CUtensorMap mh = make_map(hidden, C::BM);
  const CUtensorMap mw = make_map(weight, C::BN);
  launch_kernel(p.logits != nullptr ? pingpong_kernel<true> : pingpong_kernel<false>,
                std::min<long long>(tiles, sm_count()), C::SMEM, stream, mh, mw, q);
}

}  // namespace sm90
