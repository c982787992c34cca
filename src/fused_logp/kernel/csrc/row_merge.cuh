// The row merge of CONTRACT.md section 5, the device function of merge_kernel and merge_ids_kernel
// (sm90_forward.cu): m = the NaN-propagating max of the row's m_t (order-free), the terms
// mul(s_t, ex2(mul(sub(m_t, m), LOG2E))), S = the terms added one after another in ascending tile order,
// lse = add(m, log(S)).
//
// One block of THREADS threads a row. The chain of additions is the merge's latency (one dependent add a tile), so
// it starts as soon as the first terms exist: after the max, warps 1.. compute the terms a chunk at a time into one
// of two shared-memory buffers while thread 0 adds up the chunk before it from the other. 256 threads a block give a
// row the shortest latency (few rows: the whole call waits on one row's chain); 64 threads let four times as many
// rows, and chains, run on an SM at once (many rows).
#pragma once
#include "contract_math.cuh"

namespace sm90 {

template <int THREADS>
struct RowMerge {
  static_assert(THREADS >= 64 && THREADS % 32 == 0, "warp 0 chains, the other warps compute the terms");
  static constexpr int kWarps = THREADS / 32;
  static constexpr int kProducers = THREADS - 32;
  static constexpr int kPer = THREADS <= 64 ? 8 : 4;       // terms a producing thread computes a chunk
  static constexpr int kChunk = kProducers * kPer;         // 256 (64 threads) or 896 (256 threads) tiles
  static constexpr int kBufFloats = 2 * kChunk;            // the two chunk buffers
};

// The merge of one row, by the whole block: -> lse in thread 0 (the other threads' value is unspecified).
// mx, sm: the row's n_tiles statistics; buf: RowMerge<THREADS>::kBufFloats floats and red: THREADS / 32 floats of
// shared memory.
template <int THREADS>
__device__ __forceinline__ float block_row_lse(const float* __restrict__ mx, const float* __restrict__ sm,
                                               int n_tiles, float* buf, float* red) {
  using R = RowMerge<THREADS>;
  const int tid = threadIdx.x;
  // m: eight loads in flight a thread, then the warp's and the block's max
  float m = __int_as_float(0xFF800000);
  int t = tid;
  for (; t + 7 * THREADS < n_tiles; t += 8 * THREADS) {
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = mx[t + k * THREADS];
#pragma unroll
    for (int k = 0; k < 8; ++k) m = contract::nan_max(m, v[k]);
  }
  for (; t < n_tiles; t += THREADS) m = contract::nan_max(m, mx[t]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = contract::nan_max(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (tid % 32 == 0) red[tid / 32] = m;
  __syncthreads();
  m = red[0];
#pragma unroll
  for (int i = 1; i < R::kWarps; ++i) m = contract::nan_max(m, red[i]);

  // step k: warps 1.. write the terms of chunk k into buf[k % 2]; thread 0 adds up chunk k - 1 from buf[(k - 1) % 2]
  const float log2e = contract::bits(contract::EXP_LOG2E);
  const int n_chunks = (n_tiles + R::kChunk - 1) / R::kChunk;
  const int pt = tid - 32;
  float S = 0.0f;
  for (int k = 0; k <= n_chunks; ++k) {
    if (pt >= 0) {
      if (k < n_chunks) {
        float* dst = buf + (k % 2) * R::kChunk;
        const int base = k * R::kChunk;
        float a[R::kPer], b[R::kPer];
#pragma unroll
        for (int j = 0; j < R::kPer; ++j) {
          const int i = base + pt + j * R::kProducers;
          a[j] = i < n_tiles ? mx[i] : 0.0f;
          b[j] = i < n_tiles ? sm[i] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < R::kPer; ++j) {
          const int i = pt + j * R::kProducers;
          if (base + i < n_tiles)
            dst[i] = __fmul_rn(b[j], contract::contract_ex2(__fmul_rn(__fsub_rn(a[j], m), log2e)));
        }
      }
    } else if (tid == 0 && k > 0) {
      const float* src = buf + ((k - 1) % 2) * R::kChunk;
      const int cnt = min(R::kChunk, n_tiles - (k - 1) * R::kChunk);
      int i = 0;
      if (k == 1) {
        S = src[0];
        i = 1;
      }
      // the loads run ahead of the dependent additions: the next eight are read while these eight are added
      if (i + 8 <= cnt) {
        float v[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) v[q] = src[i + q];
        for (i += 8; i + 8 <= cnt; i += 8) {
          float w[8];
#pragma unroll
          for (int q = 0; q < 8; ++q) w[q] = src[i + q];
#pragma unroll
          for (int q = 0; q < 8; ++q) {
            S = __fadd_rn(S, v[q]);
            v[q] = w[q];
          }
        }
#pragma unroll
        for (int q = 0; q < 8; ++q) S = __fadd_rn(S, v[q]);
      }
      for (; i < cnt; ++i) S = __fadd_rn(S, src[i]);
    }
    __syncthreads();
  }
  return __fadd_rn(m, contract::contract_log(S));
}

}  // namespace sm90
