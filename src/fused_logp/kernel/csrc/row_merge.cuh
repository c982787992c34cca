// The row merge of CONTRACT.md section 5, the device function of merge_kernel and merge_ids_kernel
// (sm90_forward.cu).
#pragma once
#include "contract_math.cuh"

namespace sm90 {

// ---------------------------------------------------------------------------------------------------------
// Row merge: one block per row. tile_max/tile_sum [N, T] (row stride ld), target_logit [N].
// The block computes every term s_t * exp(m_t - m) into shared memory; one thread chains them in order.
// ---------------------------------------------------------------------------------------------------------
constexpr int kMergeThreads = 256;
constexpr int kMergeMaxSmemTiles = 12000;   // 47 KB of terms; longer rows are merged in chunks of this size

// The merge of one row, by the whole block: -> lse on thread 0 (the other threads' value is unspecified).
// mx/sm: the row's n_tiles statistics; terms: `chunk` floats of dynamic shared memory; red: kMergeThreads/32 floats.
__device__ __forceinline__ float block_row_lse(const float* __restrict__ mx, const float* __restrict__ sm,
                                               int n_tiles, int chunk, float* terms, float* red) {
  float m = __int_as_float(0xFF800000);
  for (int t = threadIdx.x; t < n_tiles; t += kMergeThreads) m = contract::nan_max(m, mx[t]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = contract::nan_max(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
  __syncthreads();
  m = red[0];
#pragma unroll
  for (int i = 1; i < kMergeThreads / 32; ++i) m = contract::nan_max(m, red[i]);
  float S = 0.0f;
  for (int base = 0; base < n_tiles; base += chunk) {
    const int cnt = min(chunk, n_tiles - base);
    for (int i = threadIdx.x; i < cnt; i += kMergeThreads)
      terms[i] = __fmul_rn(sm[base + i], contract::contract_ex2(__fmul_rn(__fsub_rn(mx[base + i], m),
                                                                         contract::bits(contract::EXP_LOG2E))));
    __syncthreads();
    if (threadIdx.x == 0) {
      int i = 0;
      if (base == 0) {
        S = terms[0];
        i = 1;
      }
      for (; i + 8 <= cnt; i += 8) {
        float v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = terms[i + k];
#pragma unroll
        for (int k = 0; k < 8; ++k) S = __fadd_rn(S, v[k]);
      }
      for (; i < cnt; ++i) S = __fadd_rn(S, terms[i]);
    }
    __syncthreads();
  }
  return __fadd_rn(m, contract::contract_log(S));
}

}  // namespace sm90
