// The row merge of CONTRACT.md section 5, the device function of merge_kernel and merge_ids_kernel
// (sm90_forward.cu): m = the NaN-propagating max of the row's m_t (order-free), the terms
// mul(s_t, ex2(mul(sub(m_t, m), LOG2E))), S = the terms added one after another in ascending tile order,
// lse = add(m, log(S)).
//
// One block of kMergeThreads threads a row. Its latency is one round trip to memory for the statistics and then
// the chain of additions (one dependent add a tile, thread 0, its shared-memory loads eight ahead): a row of up to
// kMergeDirect tiles (163,840 vocabulary columns) is loaded once, every thread holding its tiles' m_t in registers
// and their s_t in shared memory while the block finds m, then turning them into the terms for the chain. A longer row is
// merged kMergeDirect tiles at a time (its max first, over all of them; each later block of tiles is loaded again).
#pragma once
#include "contract_math.cuh"

namespace sm90 {

constexpr int kMergeThreads = 256;
constexpr int kMergePer = 10;                               // tiles a thread holds
constexpr int kMergeDirect = kMergeThreads * kMergePer;     // 2560 tiles a block of the row

// The merge of one row, by the whole block: -> lse in thread 0 (the other threads' value is unspecified).
// mx, sm: the row's n_tiles statistics; terms: kMergeDirect floats and red: kMergeThreads / 32 floats of shared
// memory.
__device__ __forceinline__ float block_row_lse(const float* __restrict__ mx, const float* __restrict__ sm,
                                               int n_tiles, float* terms, float* red) {
  const int tid = threadIdx.x;
  const float neg_inf = __int_as_float(0xFF800000);
  float a[kMergePer];
  // the first kMergeDirect tiles, every load in flight at once: m_t into registers, s_t into the terms' places
#pragma unroll
  for (int j = 0; j < kMergePer; ++j) {
    const int i = tid + j * kMergeThreads;
    a[j] = i < n_tiles ? mx[i] : neg_inf;
    if (i < n_tiles) terms[i] = sm[i];
  }
  float m = neg_inf;
#pragma unroll
  for (int j = 0; j < kMergePer; ++j) m = contract::nan_max(m, a[j]);
  for (int t = kMergeDirect + tid; t < n_tiles; t += kMergeThreads) m = contract::nan_max(m, mx[t]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = contract::nan_max(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (tid % 32 == 0) red[tid / 32] = m;
  __syncthreads();
  m = red[0];
#pragma unroll
  for (int i = 1; i < kMergeThreads / 32; ++i) m = contract::nan_max(m, red[i]);

  const float log2e = contract::bits(contract::EXP_LOG2E);
  float S = 0.0f;
  for (int base = 0; base < n_tiles; base += kMergeDirect) {
    if (base > 0) {
#pragma unroll
      for (int j = 0; j < kMergePer; ++j) {
        const int i = tid + j * kMergeThreads;
        a[j] = base + i < n_tiles ? mx[base + i] : neg_inf;
        if (base + i < n_tiles) terms[i] = sm[base + i];
      }
    }
    // each thread turns its own places into terms (no barrier: it wrote them itself)
#pragma unroll
    for (int j = 0; j < kMergePer; ++j) {
      const int i = tid + j * kMergeThreads;
      if (base + i < n_tiles)
        terms[i] = __fmul_rn(terms[i], contract::contract_ex2(__fmul_rn(__fsub_rn(a[j], m), log2e)));
    }
    __syncthreads();
    if (tid == 0) {
      const int cnt = min(kMergeDirect, n_tiles - base);
      int i = 0;
      if (base == 0) {
        S = terms[0];
        i = 1;
      }
      // the loads run ahead of the dependent additions: the next eight are read while these eight are added
      if (i + 8 <= cnt) {
        float v[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) v[q] = terms[i + q];
        for (i += 8; i + 8 <= cnt; i += 8) {
          float w[8];
#pragma unroll
          for (int q = 0; q < 8; ++q) w[q] = terms[i + q];
#pragma unroll
          for (int q = 0; q < 8; ++q) {
            S = __fadd_rn(S, v[q]);
            v[q] = w[q];
          }
        }
#pragma unroll
        for (int q = 0; q < 8; ++q) S = __fadd_rn(S, v[q]);
      }
      for (; i < cnt; ++i) S = __fadd_rn(S, terms[i]);
    }
    __syncthreads();
  }
  return __fadd_rn(m, contract::contract_log(S));
}

}  // namespace sm90
