// Host side of the fused kernels: TMA tensor maps, the checks the forward and backward entries share, and the
// launch of each configuration (instantiated one per translation unit, sm90_cta_*.cu and sm90_pingpong_*.cu, so
// that the build compiles them in parallel).
#pragma once
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include "cta_kernel.cuh"

namespace sm90 {

// A number in an error message. The extension formats numbers with std::to_string, never through std::ostream: on
// the H200 machine's runtime a TORCH_CHECK that streamed an int crashed the process (a segfault in ostream's
// integer insertion inside the extension) instead of raising.
inline std::string num(long long v) { return std::to_string(v); }

inline PFN_cuTensorMapEncodeTiled_v12000 get_encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (fn == nullptr) {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q;
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q);
    TORCH_CHECK(err == cudaSuccess && q == cudaDriverEntryPointSuccess && ptr != nullptr,
                "sm90: cuTensorMapEncodeTiled not available from the driver");
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }
  return fn;
}

inline CUtensorMap make_map(const torch::Tensor& t, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(t.size(1)), static_cast<cuuint64_t>(t.size(0))};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(t.stride(0)) * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kBK), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t estr[2] = {1, 1};
  CUresult r = get_encode_fn()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, t.data_ptr(), dims, strides, box, estr,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "sm90: cuTensorMapEncodeTiled failed with code ", num(static_cast<int>(r)));
  return map;
}

// Host entries (forward statistics in sm90_linear_logp.cu, backward dz in sm90_backward.cu): the checks they
// share and the FusedParams fields they fill. hidden [N, D] and weight [R, D]: contiguous CUDA bfloat16, D a
// positive multiple of 16; n_real (named cols_name in messages) in [1, R]; targets [N] contiguous CUDA int64;
// temperature [N] contiguous CUDA float32; bias contiguous CUDA float32 covering the n_real columns, or none.
inline FusedParams entry_params(const char* who, const char* cols_name, const torch::Tensor& hidden,
                                const torch::Tensor& weight, const torch::Tensor& targets,
                                const torch::Tensor& temperature, const c10::optional<torch::Tensor>& bias,
                                long long vocab_start, long long n_real) {
  TORCH_CHECK(hidden.is_cuda() && weight.is_cuda() && hidden.scalar_type() == torch::kBFloat16 &&
                  weight.scalar_type() == torch::kBFloat16 && hidden.dim() == 2 && weight.dim() == 2 &&
                  hidden.size(1) == weight.size(1) && hidden.is_contiguous() && weight.is_contiguous(),
              who, ": hidden [N, D] and weight [R, D] must be contiguous CUDA bfloat16");
  const long long n = hidden.size(0), d = hidden.size(1);
  TORCH_CHECK(d % contract::K_GROUP == 0 && d > 0, who, ": D must be a positive multiple of 16");
  TORCH_CHECK(n_real >= 1 && n_real <= weight.size(0), who, ": ", cols_name, " must be in [1, ", num(weight.size(0)),
              "], got ", num(n_real));
  TORCH_CHECK(n < (1LL << 31) && n_real < (1LL << 31), who, ": sizes too large");
  TORCH_CHECK(targets.is_cuda() && targets.scalar_type() == torch::kInt64 && targets.is_contiguous() &&
                  targets.numel() == n, who, ": targets must be contiguous CUDA int64 [N]");
  TORCH_CHECK(temperature.is_cuda() && temperature.scalar_type() == torch::kFloat32 &&
                  temperature.is_contiguous() && temperature.numel() == n,
              who, ": temperature must be contiguous CUDA float32 [N]");
  FusedParams p{};
  p.n_rows = static_cast<int>(n);
  p.d = static_cast<int>(d);
  p.n_real = static_cast<int>(n_real);
  p.vocab_start = vocab_start;
  p.targets = targets.data_ptr<int64_t>();
  p.temperature = temperature.data_ptr<float>();
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_cuda() && bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                    bias->numel() >= n_real, who, ": bias must be contiguous CUDA float32 covering the ", cols_name,
                " columns");
    p.bias = bias->data_ptr<float>();
  }
  return p;
}

inline int sm_count() {
  int dev = 0, n = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

// One launch of a GEMM kernel (kThreads threads a CTA; `smem` bytes of dynamic shared memory, whose attribute is set
// first) on `blocks` CTAs, checked.
template <typename... Params, typename... Args>
void launch_kernel(void (*kern)(Params...), long long blocks, int smem, cudaStream_t stream, const Args&... args) {
  TORCH_CHECK(blocks < (1LL << 31), "sm90: grid too large");
  C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kern<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The dynamic schedule's tile counter (pingpong_kernel.cuh), set into q.tile_counter: a 4-byte counter on `like`'s
// device, zeroed on the current stream; the caller keeps the returned tensor until the launch is issued (the caching
// allocator orders its reuse on the stream). Not dynamic: q.tile_counter null (the static schedule), no tensor.
inline torch::Tensor set_tile_counter(FusedParams& q, const torch::Tensor& like, bool dynamic) {
  q.tile_counter = nullptr;
  if (!dynamic) return torch::Tensor();
  torch::Tensor counter = torch::zeros({1}, like.options().dtype(torch::kInt32));
  q.tile_counter = reinterpret_cast<unsigned*>(counter.data_ptr<int32_t>());
  return counter;
}

// The entry checks of a kernel whose consumer warps keep their tiles in registers (launch `name`: the ping-pong kernel
// on either schedule, the swapped-operand kernel), and its tile counts: D a multiple of 64 (every stage holds 4 k16
// groups), n_real a multiple of 64 (a 64-column slice is all real or all beyond it) and the logits 8-byte aligned
// (stored as pairs). -> p with num_m, num_n for bm x bn tiles.
inline FusedParams register_tile_params(const FusedParams& p, const char* name, int bm, int bn) {
  TORCH_CHECK(p.d % kBK == 0, "sm90: launch ", name, " takes D a multiple of 64, got D = ", num(p.d));
  TORCH_CHECK(p.n_real % kTile == 0, "sm90: launch ", name, " takes a vocabulary (shard) width that is a multiple "
              "of 64, got ", num(p.n_real));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(p.logits) % 8 == 0, "sm90: launch ", name, " stores the logits as 8-byte "
              "pairs: their start must be 8-byte aligned");
  FusedParams q = p;
  q.num_m = (p.n_rows + bm - 1) / bm;
  q.num_n = (p.n_real + bn - 1) / bn;
  TORCH_CHECK(static_cast<long long>(q.num_m) * q.num_n < (1LL << 31), "sm90: grid too large");
  return q;
}

// Forward statistics with the CTA kernel, CTA tile (64 WM) x (WGN kConsumers / WM); the logits, where asked for,
// stored by the producer warpgroup (fused_cta_kernel).
template <int WM, int WGN>
void launch_cta(const torch::Tensor& hidden, const torch::Tensor& weight, const FusedParams& p, cudaStream_t stream) {
  using C = Cfg<WM, WGN>;
  FusedParams q = p;
  q.num_m = (p.n_rows + C::BM - 1) / C::BM;
  q.num_n = (p.n_real + C::BN - 1) / C::BN;
  const CUtensorMap mh = make_map(hidden, C::BM);
  const CUtensorMap mw = make_map(weight, C::BN);
  const bool full_k = p.d % kBK == 0, logits = p.logits != nullptr;
  auto kern = full_k ? fused_cta_kernel<WM, WGN, true, false, false> : fused_cta_kernel<WM, WGN, false, false, false>;
  if (logits)
    kern = full_k ? fused_cta_kernel<WM, WGN, true, false, true> : fused_cta_kernel<WM, WGN, false, false, true>;
  q.logits_vec4 = p.logits != nullptr && p.n_real % 4 == 0 && reinterpret_cast<uintptr_t>(p.logits) % 16 == 0;
  launch_kernel(kern, static_cast<long long>(q.num_m) * q.num_n, C::SMEM, stream, mh, mw,
                mh /*map_o: dz kernels only*/, q);
}

extern template void launch_cta<2, 256>(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);
extern template void launch_cta<1, 128>(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);
extern template void launch_cta<1, 64>(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);

// Forward statistics with the persistent ping-pong kernel, 128x192 consumer tiles (sm90_pingpong_128x192.cu): D and
// n_real multiples of 64 (it refuses other calls). dynamic: the dynamic schedule (configuration
// pingpong-128x192-dyn), each CTA claiming its next tile from a counter.
void launch_pingpong(const torch::Tensor& hidden, const torch::Tensor& weight, const FusedParams& p,
                     cudaStream_t stream, bool dynamic = false);

// The same kernel in clusters of two CTAs along M, each weight tile multicast into both (sm90_pingpong_128x192_mc2.cu,
// configuration pingpong-128x192-mc2): D and n_real multiples of 64 (it refuses other calls).
void launch_pingpong_mc2(const torch::Tensor& hidden, const torch::Tensor& weight, const FusedParams& p,
                         cudaStream_t stream);

// Forward statistics with the swapped-operand kernel, 128 weight rows a CTA and row tiles of at most 256 rows
// (sm90_swapab_128.cu, configuration swapab-128): D and n_real multiples of 64 (it refuses other calls).
void launch_swap(const torch::Tensor& hidden, const torch::Tensor& weight, const FusedParams& p, cudaStream_t stream);

}  // namespace sm90
