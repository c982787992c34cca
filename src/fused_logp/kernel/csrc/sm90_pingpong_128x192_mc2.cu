// The persistent ping-pong kernel with 128x192 consumer tiles in clusters of two CTAs along M, the weight tile
// multicast into both (pingpong_kernel.cuh, CLUSTER = 2; configuration pingpong-128x192-mc2, static schedule), forward
// statistics and the logits where asked for: its launch.
#include <atomic>

#include "launch.cuh"
#include "pingpong_kernel.cuh"

namespace sm90 {

constexpr int kMaxDevices = 64;
// clusters that run at once, by kernel (without, with the logits) and device; 0: not asked yet
static std::atomic<int> g_clusters[2][kMaxDevices];

void launch_pingpong_mc2(const torch::Tensor& hidden, const torch::Tensor& weight, const FusedParams& p,
                         cudaStream_t stream) {
  using C = PingPongCfg;
  constexpr int kCluster = 2;
  FusedParams q = register_tile_params(p, "pingpong-128x192-mc2", C::BM, C::BN);
  set_tile_counter(q, hidden, false);   // the static schedule: no counter
  const long long units = static_cast<long long>((q.num_m + kCluster - 1) / kCluster) * q.num_n;
  const CUtensorMap mh = make_map(hidden, C::BM);
  const CUtensorMap mw = make_map(weight, C::BN / kCluster);     // each CTA loads one half of the weight tile
  auto kern = p.logits != nullptr ? pingpong_kernel<true, kCluster> : pingpong_kernel<false, kCluster>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM));
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(kCluster, 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = C::SMEM;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  // persistent: as many clusters as the GPU runs at once (its GPCs may leave an SM of an odd count without a pair),
  // asked once per device and kernel
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  TORCH_CHECK(dev >= 0 && dev < kMaxDevices, "sm90: launch pingpong-128x192-mc2: device index out of range");
  std::atomic<int>& cached = g_clusters[p.logits != nullptr ? 1 : 0][dev];
  int clusters = cached.load();
  if (clusters == 0) {
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kern, &cfg));
    TORCH_CHECK(clusters > 0, "sm90: launch pingpong-128x192-mc2: this GPU runs no cluster of two of its CTAs");
    cached.store(clusters);
  }
  cfg.gridDim = dim3(static_cast<unsigned>(kCluster * std::min<long long>(units, clusters)), 1, 1);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, mh, mw, q));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace sm90
