// The sampling-transform program on the device (CONTRACT.md section 13.3): the top-p crossing.
//
// q [R, L] binary32: each row holds the probabilities q_v = exp(z'_v - lse_K) of the current kept set K in the
// order (z' descending, token id ascending), +0 for a token outside K. The contract's cumulative sum is the
// sequential chain c_0 = q_0, c_j = add(c_{j-1}, q_j): one binary32 round-to-nearest add per step, in order,
// never reassociated (a parallel scan rounds differently, so it is not used). first[r] is the smallest j with
// c_j >= p, or -1 when row r does not reach p within its L entries (a NaN sum never does).
//
// One warp per row. Every lane runs the same chain: the 32 values of a group are broadcast in order with
// __shfl_sync and added with __fadd_rn, so each lane's c is the sequential sum itself; lane i keeps the sum
// after element i of the group and one ballot finds the group's first crossing. The chain stops at the first
// crossing. Loads are coalesced (one group = 32 consecutive floats) and the next kScanDepth groups are loaded
// before the current ones are chained. The caller (kernel/transforms.py) passes p as a binary32 value.
//
// Light headers on purpose (not torch/extension.h, about 2.5 GB less compiler memory): this file holds no Python
// binding (its m.def line is in sm90_linear_logp.cu).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace sm90 {
namespace {
constexpr int kScanWarps = 4;                  // rows per block
constexpr int kScanDepth = 8;                  // 32-float groups per lane in flight
constexpr long long kScanSpan = 32LL * kScanDepth;

__global__ void __launch_bounds__(32 * kScanWarps)
topp_crossing_kernel(const float* __restrict__ q, long long ld, long long len, float p, long long n_rows,
                     int64_t* __restrict__ first) {
  const long long row = static_cast<long long>(blockIdx.x) * kScanWarps + threadIdx.x / 32;
  if (row >= n_rows) return;                   // a whole warp: all 32 lanes share the row
  const int lane = static_cast<int>(threadIdx.x % 32);
  const float* qr = q + row * ld;
  float cur[kScanDepth];
#pragma unroll
  for (int g = 0; g < kScanDepth; ++g) {
    const long long j = 32LL * g + lane;
    cur[g] = (j < len) ? qr[j] : 0.0f;
  }
  float c = 0.0f;                              // 0 + q_0 = q_0 exactly (q_0 >= +0 or NaN)
  long long found = -1;
  bool done = false;                           // warp-uniform: every lane computes the same c and ballots
  for (long long base = 0; base < len && !done; base += kScanSpan) {
    float nxt[kScanDepth];
#pragma unroll
    for (int g = 0; g < kScanDepth; ++g) {
      const long long j = base + kScanSpan + 32LL * g + lane;
      nxt[g] = (j < len) ? qr[j] : 0.0f;
    }
#pragma unroll
    for (int g = 0; g < kScanDepth; ++g) {
      if (!done) {
        float mine = 0.0f;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
          c = __fadd_rn(c, __shfl_sync(0xffffffffu, cur[g], i));   // entries past len are +0: c unchanged
          mine = (lane == i) ? c : mine;
        }
        const long long j0 = base + 32LL * g;
        const unsigned hit = __ballot_sync(0xffffffffu, (j0 + lane < len) && (mine >= p));
        if (hit != 0u) {
          found = j0 + (__ffs(static_cast<int>(hit)) - 1);
          done = true;
        } else if (c != c) {
          done = true;                         // NaN: c stays NaN and never reaches p
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kScanDepth; ++g) cur[g] = nxt[g];
  }
  if (lane == 0) first[row] = found;
}
}  // namespace

// first [R] int64 for q [R, L] (CUDA float32, unit column stride) and the binary32 threshold p. (L = 0: -1.)
at::Tensor topp_crossing(at::Tensor q, double p) {
  TORCH_CHECK(q.is_cuda() && q.scalar_type() == at::kFloat && q.dim() == 2 && q.stride(1) == 1 &&
                  (q.size(0) <= 1 || q.stride(0) >= q.size(1)),
              "sm90: topp_crossing: q must be a CUDA float32 [R, L] tensor with unit column stride");
  const long long n = q.size(0), len = q.size(1);
  const float p32 = static_cast<float>(p);
  TORCH_CHECK(static_cast<double>(p32) == p, "sm90: topp_crossing: p must be a binary32 value");
  at::Tensor first = at::empty({n}, q.options().dtype(at::kLong));
  if (n == 0) return first;
  const c10::cuda::CUDAGuard guard(q.device());
  const unsigned blocks = static_cast<unsigned>((n + kScanWarps - 1) / kScanWarps);
  topp_crossing_kernel<<<blocks, 32 * kScanWarps, 0, c10::cuda::getCurrentCUDAStream()>>>(
      q.data_ptr<float>(), q.size(0) <= 1 ? len : q.stride(0), len, p32, n, first.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return first;
}

}  // namespace sm90
