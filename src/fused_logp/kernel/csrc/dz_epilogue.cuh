// The backward's epilogue: the bf16 logit gradient dz of a 64 x WGN warpgroup tile, from the accumulators of the
// recompute GEMM, staged in shared memory and stored with TMA (sm90_backward.cu): the whole tile at once
// (wg_dz_epilogue, the CTA kernel) or one 64-column slice at a time through one 8 KB buffer (half_dz_epilogue, the
// ping-pong kernel).
#pragma once
#include <cuda_bf16.h>
#include "fused_params.cuh"
#include "ptx.cuh"

namespace sm90 {

// Backward mode: per-row factors of this thread's two rows (loaded after the mainloop).
//   x = z * a - b = (z / T - lse) log2(e);  p = 2^x;  dz = cs * p (+ gt on the target column)
// Gradient bytes are not contract-bearing: the scaling multiplies by 1/T and the exp is the hardware ex2.approx
// (relative error ~2^-22, far below the bf16 rounding of dz, 2^-9). This is the only approximate function in
// the kernel sources, and it is reached only from the DZ kernels (tests/sm90/test_sm90_compile.py checks both).
struct DzRows {
  float a[2], b[2], cs[2], gt[2];
  long long tcol[2];   // target column relative to the chunk start; -1 for rows beyond N
};

__device__ __forceinline__ DzRows load_dz_rows(const FusedParams& p, int row_base) {
  constexpr float kLog2e = 1.4426950408889634f;
  DzRows r;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row_base + 8 * h;
    const bool ok = row < p.n_rows;
    const float rT = ok ? __frcp_rn(p.temperature[row]) : 1.0f;
    r.a[h] = rT * kLog2e;
    r.b[h] = ok ? p.lse[row] * kLog2e : 0.0f;
    r.cs[h] = ok ? p.coef[row] * rT : 0.0f;
    r.gt[h] = ok ? p.g_logp[row] * rT : 0.0f;
    r.tcol[h] = ok ? static_cast<long long>(p.targets[row]) - p.vocab_start : -1;
  }
  return r;
}

__device__ __forceinline__ float ex2_approx(float x) {
#ifdef FUSED_LOGP_SIMT   // the device code run on the CPU (tests/sm90/simt): the instruction's exact model (x <= 0)
  return simt::ex2_model(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// The dz of the pair of columns c, c + 1 of the thread's row h (logits z0, z1, bias added), rounded to bf16; t: the
// row's target column (on the same origin as c; outside the pair: no target here).
__device__ __forceinline__ __nv_bfloat162 dz_pair(float z0, float z1, const DzRows& r, int h, int t, int c) {
  const float p0 = ex2_approx(__fsub_rn(__fmul_rn(z0, r.a[h]), r.b[h]));
  const float p1 = ex2_approx(__fsub_rn(__fmul_rn(z1, r.a[h]), r.b[h]));
  float d0 = __fmul_rn(r.cs[h], p0), d1 = __fmul_rn(r.cs[h], p1);
  if (t == c) d0 = __fadd_rn(d0, r.gt[h]);
  if (t == c + 1) d1 = __fadd_rn(d1, r.gt[h]);
  return __floats2bfloat162_rn(d0, d1);
}

// Backward epilogue of one warpgroup tile (rows [row0, +64), columns [col0, +WGN)): every element's dz from
// registers (accumulator layout as in wg_epilogue) as bf16 into `stage`, WGN/64 sub-tiles of 64 x 64 in the
// 128-byte swizzle of map_o (conflict-free: the 8 rows of a store instruction hit 8 different 16-byte chunks), then
// one thread stores the sub-tiles with TMA, which clips rows >= N and columns >= n_real.
template <int WGN>
__device__ __forceinline__ void wg_dz_epilogue(const float (&acc)[WGN / 2], const FusedParams& p, int row0,
                                               int col0, const DzRows& r, uint8_t* stage, const CUtensorMap* map_o,
                                               int bar_id) {
  const int tid = threadIdx.x % 128;
  const int q = tid % 4;
  const int r0 = 16 * (tid / 32) + (tid % 32) / 4;     // tile row of h = 0; h = 1 is r0 + 8 (same row % 8)
  const int sw = r0 % 8;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const long long tl = r.tcol[h] - col0;
    const int t = (tl >= 0 && tl < WGN) ? static_cast<int>(tl) : -1;   // target column within this tile
    uint8_t* row_base = stage + (r0 + 8 * h) * 128 + 4 * q;
#pragma unroll
    for (int j = 0; j < WGN / 8; ++j) {
      const int c = 8 * j + 2 * q;
      float z0 = acc[j * 4 + 2 * h], z1 = acc[j * 4 + 2 * h + 1];
      if (p.bias != nullptr) {
        const int col = col0 + c;
        if (col < p.n_real) z0 = __fadd_rn(z0, p.bias[col]);
        if (col + 1 < p.n_real) z1 = __fadd_rn(z1, p.bias[col + 1]);
      }
      *reinterpret_cast<__nv_bfloat162*>(row_base + (j / 8) * 8192 + (((j % 8) ^ sw) * 16)) =
          dz_pair(z0, z1, r, h, t, c);
    }
  }
  fence_proxy_async_shared();   // the writes above, to the TMA (async) proxy
  named_bar_sync<128>(bar_id);
  if (tid == 0 && row0 < p.n_rows) {
#pragma unroll
    for (int k = 0; k < WGN / 64; ++k)
      if (col0 + 64 * k < p.n_real) tma_store_2d(map_o, stage + k * 8192, col0 + 64 * k, row0);
    bulk_commit_group();
    bulk_wait_group_read_all();   // shared memory is read before the CTA exits
  }
}

// Backward epilogue of a 64-row half of a ping-pong tile (rows [row0, +64), columns [n0, +BN)) whose accumulators
// are BN / 64 slices of 64 columns in the register layout of a 64 x 64 warpgroup tile (acc[32 k .. 32 k + 32):
// columns [64 k, +64)). Each slice's dz is computed into registers (16 bf16 pairs a thread), then written into
// `stage` (shared-window address of one 64 x 64 bf16 sub-tile, 8 KB, in map_o's 128-byte swizzle, as in
// wg_dz_epilogue) by 4-byte shared stores, and one thread (the warpgroup's first) stores it by TMA (clipping rows >= N
// and columns >= n_real). `stage` is rewritten only after barrier bar_id at the start of the slice, which that thread
// reaches once the previous slice's store has read `stage`: the slice's arithmetic runs while that store reads. Its
// last store's read is waited for by the caller before the CTA exits (bulk_wait_group_read_all). The target column is
// kept relative to n0 as an int. A half whose rows all lie beyond N does nothing.
template <int BN>
__device__ __forceinline__ void half_dz_epilogue(const float (&acc)[BN / 2], const FusedParams& p, int row0, int n0,
                                                 uint32_t stage, const CUtensorMap* map_o, int bar_id) {
  if (row0 >= p.n_rows) return;   // the whole warpgroup: row0 is the warpgroup's
  const DzRows r = load_dz_rows(p, thread_row_base(row0));
  const int tid = threadIdx.x % 128;
  const int q = tid % 4;
  const int r0 = 16 * (tid / 32) + (tid % 32) / 4;     // tile row of h = 0; h = 1 is r0 + 8 (same row % 8)
  int t[2];                                            // target column - n0, in [-1, BN]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const long long tl = r.tcol[h] - n0;
    t[h] = tl < 0 ? -1 : (tl > BN ? BN : static_cast<int>(tl));
  }
  const uint32_t base = stage + r0 * 128 + 4 * q;
#pragma unroll
  for (int k = 0; k < BN / kTile; ++k) {
    uint32_t pairs[2][kTile / 8];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int j = 0; j < kTile / 8; ++j) {
        const int c = kTile * k + 8 * j + 2 * q;       // column - n0
        float z0 = acc[(kTile / 2) * k + 4 * j + 2 * h], z1 = acc[(kTile / 2) * k + 4 * j + 2 * h + 1];
        if (p.bias != nullptr) {
          if (n0 + c < p.n_real) z0 = __fadd_rn(z0, p.bias[n0 + c]);
          if (n0 + c + 1 < p.n_real) z1 = __fadd_rn(z1, p.bias[n0 + c + 1]);
        }
        const __nv_bfloat162 d = dz_pair(z0, z1, r, h, t[h], c);
        pairs[h][j] = *reinterpret_cast<const uint32_t*>(&d);
      }
    }
    if (tid == 0) bulk_wait_group_read_all();   // the previous slice's store has read `stage`
    named_bar_sync<128>(bar_id);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int j = 0; j < kTile / 8; ++j) st_shared_b32(base + h * 8 * 128 + ((j ^ (r0 % 8)) * 16), pairs[h][j]);
    }
    fence_proxy_async_shared();   // the writes above, to the TMA (async) proxy
    named_bar_sync<128>(bar_id);
    if (tid == 0) {
      if (n0 + kTile * k < p.n_real) tma_store_2d(map_o, stage, n0 + kTile * k, row0);
      bulk_commit_group();
    }
  }
}

}  // namespace sm90
