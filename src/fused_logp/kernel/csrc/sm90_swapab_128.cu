// The swapped-operand kernel (swap_kernel.cuh, configuration swapab-128), forward statistics and the logits where
// asked for: its launch, with the row tile NR that swap_row_tile picks.
#include "launch.cuh"
#include "swap_kernel.cuh"

namespace sm90 {

template <int NR>
static void launch_swap_rows(const torch::Tensor& hidden, const torch::Tensor& weight, const FusedParams& p,
                             cudaStream_t stream) {
  using C = SwapCfg<NR>;
  const FusedParams q = register_tile_params(p, "swapab-128", NR, kSwapBV);
  const CUtensorMap mh = make_map(hidden, NR);
  const CUtensorMap mw = make_map(weight, kSwapBV);
  launch_kernel(p.logits != nullptr ? swap_kernel<NR, true> : swap_kernel<NR, false>,
                static_cast<long long>(q.num_m) * q.num_n, C::SMEM, stream, mh, mw, q);
}

void launch_swap(const torch::Tensor& hidden, const torch::Tensor& weight, const FusedParams& p,
                 cudaStream_t stream) {
  switch (swap_row_tile(p.n_rows) / 32) {
    case 1: return launch_swap_rows<32>(hidden, weight, p, stream);
    case 2: return launch_swap_rows<64>(hidden, weight, p, stream);
    case 3: return launch_swap_rows<96>(hidden, weight, p, stream);
    case 4: return launch_swap_rows<128>(hidden, weight, p, stream);
    case 5: return launch_swap_rows<160>(hidden, weight, p, stream);
    case 6: return launch_swap_rows<192>(hidden, weight, p, stream);
    case 7: return launch_swap_rows<224>(hidden, weight, p, stream);
    default: return launch_swap_rows<256>(hidden, weight, p, stream);
  }
}

}  // namespace sm90
