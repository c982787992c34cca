// Row hashes of the lm_head weight fingerprint (shared_contract/fingerprint.py, FINGERPRINT_ID): unsigned
// 64-bit integer arithmetic, which wraps modulo 2^64 exactly as the torch construction does, so the bytes are
// the same; one read of the weight instead of one pass per lane plus temporaries.
//   rowsum_L = sum_j u_j * P_L[j]            u_j: the row's j-th 64-bit word (4 bf16), L in {0, 1}
//   hash_L   = mix64(rowsum_L + (first_row + r + 1) * G_L)     splitmix64 finaliser
// One warp per row; the caller sums the [V, 2] hashes (mod 2^64).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace sm90 {
namespace {
constexpr int kHashWarps = 8;   // rows per block

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__global__ void __launch_bounds__(32 * kHashWarps)
row_hash_kernel(const uint64_t* __restrict__ words, long long ld, int n_words, const uint64_t* __restrict__ mult,
                long long first_row, long long n_rows, uint64_t g0, uint64_t g1, uint64_t* __restrict__ out) {
  const long long row = static_cast<long long>(blockIdx.x) * kHashWarps + threadIdx.x / 32;
  if (row >= n_rows) return;   // a whole warp: all 32 lanes share the row
  const int lane = static_cast<int>(threadIdx.x % 32);
  const uint64_t* wr = words + row * ld;
  uint64_t s0 = 0, s1 = 0;
  for (int j = lane; j < n_words; j += 32) {
    const uint64_t u = wr[j];
    s0 += u * mult[j];
    s1 += u * mult[n_words + j];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    s0 += __shfl_xor_sync(0xffffffffu, s0, o);
    s1 += __shfl_xor_sync(0xffffffffu, s1, o);
  }
  if (lane == 0) {
    const uint64_t idx = static_cast<uint64_t>(first_row + row + 1);
    out[2 * row] = mix64(s0 + idx * g0);
    out[2 * row + 1] = mix64(s1 + idx * g1);
  }
}
}  // namespace

// words [V, W] int64 (the bf16 rows viewed as 64-bit words, unit column stride), mult [2, W] int64 (contiguous);
// returns [V, 2] int64 row hashes. g0, g1 are the lanes' G_L as signed 64-bit values.
at::Tensor fingerprint_rows(at::Tensor words, at::Tensor mult, int64_t first_row, int64_t g0, int64_t g1) {
  TORCH_CHECK(words.is_cuda() && words.scalar_type() == at::kLong && words.dim() == 2 && words.stride(1) == 1,
              "sm90: fingerprint_rows: words must be a CUDA int64 [V, W] tensor with unit column stride");
  TORCH_CHECK(mult.is_cuda() && mult.scalar_type() == at::kLong && mult.is_contiguous() && mult.dim() == 2 &&
                  mult.size(0) == 2 && mult.size(1) == words.size(1),
              "sm90: fingerprint_rows: mult must be a contiguous CUDA int64 [2, W] tensor");
  TORCH_CHECK(words.size(1) < (1LL << 31), "sm90: fingerprint_rows: rows too long");
  const long long n = words.size(0);
  at::Tensor out = at::empty({n, 2}, words.options());
  if (n == 0) return out;
  const c10::cuda::CUDAGuard guard(words.device());
  const unsigned blocks = static_cast<unsigned>((n + kHashWarps - 1) / kHashWarps);
  row_hash_kernel<<<blocks, 32 * kHashWarps, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint64_t*>(words.data_ptr<int64_t>()), words.size(0) <= 1 ? words.size(1) : words.stride(0),
      static_cast<int>(words.size(1)), reinterpret_cast<const uint64_t*>(mult.data_ptr<int64_t>()), first_row, n,
      static_cast<uint64_t>(g0), static_cast<uint64_t>(g1), reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace sm90
