// Statistics from FP32 logits (CONTRACT.md section 4; for vLLM's gathered TP rows), the device function of
// logits_stats_kernel (sm90_forward.cu): one warp per (row, tile); lane l holds tile lanes 2l, 2l+1, the same
// operations as the fused kernel's epilogue, levels 2-6 of the tree as xor-shuffles.
// logits [N, ld] unscaled; statistics [N, nt]; target_logit [N].
#pragma once
#include "fused_params.cuh"

namespace sm90 {

// The statistics of item = row * nt + tile, by the calling warp (warp-uniform: an item beyond the last does nothing).
__device__ __forceinline__ void warp_logits_tile_stats(const float* __restrict__ logits, long long ld,
                                                       const int64_t* __restrict__ targets,
                                                       const float* __restrict__ temperature, int n_rows,
                                                       int vocab_size, int nt, float* __restrict__ tile_max,
                                                       float* __restrict__ tile_sum, float* __restrict__ target_logit,
                                                       long long item) {
  const int lane = threadIdx.x % 32;
  if (item >= static_cast<long long>(n_rows) * nt) return;
  const int row = static_cast<int>(item / nt), t = static_cast<int>(item % nt);
  const float T = temperature[row];
  const int c0 = t * kTile + 2 * lane;
  const bool r0 = c0 < vocab_size, r1 = c0 + 1 < vocab_size;
  const float* zr = logits + row * ld;
  const float z0 = r0 ? zr[c0] : 0.0f, z1 = r1 ? zr[c0 + 1] : 0.0f;
  float m = __int_as_float(0xFF800000);
  int bad = 0;
  if (r0) { m = fmaxf(m, z0); bad |= !isfinite(z0); }
  if (r1) { m = fmaxf(m, z1); bad |= !isfinite(z1); }
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    bad |= __shfl_xor_sync(0xffffffffu, bad, o);
  }
  if (bad) m = __int_as_float(0x7FFFFFFF);
  const float c = __fdiv_rn(contract::bits(contract::EXP_LOG2E), T);
  const float e0 = r0 ? contract::contract_ex2(__fmul_rn(__fsub_rn(z0, m), c)) : 0.0f;
  const float e1 = r1 ? contract::contract_ex2(__fmul_rn(__fsub_rn(z1, m), c)) : 0.0f;
  float a = __fadd_rn(e0, e1);                                     // level 1
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, o));   // levels 2..6
  if (lane == 0) {
    tile_max[item] = bad ? m : __fdiv_rn(m, T);
    tile_sum[item] = bad ? m : a;
  }
  const long long tc = targets[row] - static_cast<long long>(t) * kTile;
  if (tc >= 0 && tc < kTile && (tc >> 1) == lane) target_logit[row] = __fdiv_rn((tc & 1) ? z1 : z0, T);
}

}  // namespace sm90
