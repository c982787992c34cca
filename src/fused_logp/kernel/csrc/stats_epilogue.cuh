// The forward's epilogue: contract v1 tile statistics (sections 3-4 of CONTRACT.md) of a 64 x WGN warpgroup tile,
// read from a shared-memory copy of the wgmma accumulators, plus the target logit and the optional logits.
#pragma once
#include "fused_params.cuh"

namespace sm90 {

// ---------------------------------------------------------------------------------------------------------
// Tile statistics of one row's 64-lane tile, held as in the wgmma accumulator layout: this thread has lanes
// 8j + 2q + e (j = 0..7, e = 0..1, q = lane % 4); the quad (xor 1, 2) holds the whole tile row.
// ---------------------------------------------------------------------------------------------------------
struct TileOut {
  float m, s;
};

__device__ __forceinline__ TileOut quad_tile_stats(const float (&zs)[16], uint32_t real_mask) {
  float m = __int_as_float(0xFF800000);
  int bad = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    if (real_mask & (1u << i)) {
      m = fmaxf(m, zs[i]);
      bad |= !isfinite(zs[i]);
    }
  }
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
  bad |= __shfl_xor_sync(0xffffffffu, bad, 1);
  bad |= __shfl_xor_sync(0xffffffffu, bad, 2);
  if (bad) m = __int_as_float(0x7FFFFFFF);
  float l3[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    // real lanes: z' - m_t is finite and <= 0 unless the tile is bad (then s_t is NaN below)
    const float e0 = (real_mask & (1u << (2 * j))) ? contract::contract_exp_nonpos(__fsub_rn(zs[2 * j], m)) : 0.0f;
    const float e1 =
        (real_mask & (1u << (2 * j + 1))) ? contract::contract_exp_nonpos(__fsub_rn(zs[2 * j + 1], m)) : 0.0f;
    float a = __fadd_rn(e0, e1);                                   // level 1: lanes (2q, 2q+1)
    a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, 1));          // level 2
    a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, 2));          // level 3: the 8-lane group j
    l3[j] = a;
  }
  const float l4a = __fadd_rn(l3[0], l3[1]), l4b = __fadd_rn(l3[2], l3[3]);
  const float l4c = __fadd_rn(l3[4], l3[5]), l4d = __fadd_rn(l3[6], l3[7]);
  float s = __fadd_rn(__fadd_rn(l4a, l4b), __fadd_rn(l4c, l4d));   // levels 4, 5, 6
  if (bad) s = m;                                                       // NaN, as exp(NaN) lanes would give
  return {m, s};
}

// One (row, 64-column tile) unit of the epilogue. zs[2j + e] holds this thread's accumulator for column
// tile_col + 8j + 2q + e of the row (q = lane % 4); the quad holds the whole tile row.
__device__ __forceinline__ void tile_unit(float (&zs)[16], const FusedParams& p, int row, int tile_col, int q,
                                          float T, long long tcol) {
  const bool row_ok = row < p.n_rows;
  uint32_t real = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = tile_col + 8 * j + 2 * q + e;
      const bool ok = col < p.n_real;
      if (ok) real |= 1u << (2 * j + e);
      if (p.bias != nullptr && ok) zs[2 * j + e] = __fadd_rn(zs[2 * j + e], p.bias[col]);
    }
  }
  if (p.logits != nullptr && row_ok) {
    // unscaled logits, streamed past L2 (written once, never read here): 8-byte pairs where aligned
    float* lr = p.logits + static_cast<long long>(row) * p.n_real;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int col = tile_col + 8 * j + 2 * q;
      if (p.logits_pairs && col + 1 < p.n_real) {
        __stcs(reinterpret_cast<float2*>(lr + col), make_float2(zs[2 * j], zs[2 * j + 1]));
      } else {
        if (col < p.n_real) __stcs(lr + col, zs[2 * j]);
        if (col + 1 < p.n_real) __stcs(lr + col + 1, zs[2 * j + 1]);
      }
    }
  }
  if (T != 1.0f) {                     // z / 1 == z exactly: the division is skipped only where it is exact
#pragma unroll
    for (int i = 0; i < 16; ++i) zs[i] = __fdiv_rn(zs[i], T);
  }
  const TileOut st = quad_tile_stats(zs, real);
  if (!row_ok) return;
  const long long tl = tcol - tile_col;
  if (tl >= 0 && tl < kTile && tl < p.n_real - tile_col && ((tl >> 1) & 3) == q) {
    float v = zs[0];
#pragma unroll
    for (int i = 0; i < 16; ++i)
      if ((i >> 1) == (tl >> 3) && (i & 1) == (tl & 1)) v = zs[i];
    p.target_logit[row] = v;
  }
  if (q == 0) {
    const long long o = static_cast<long long>(row) * p.nt + tile_col / kTile;
    p.tile_max[o] = st.m;
    p.tile_sum[o] = st.s;
  }
}

// The staged copy of a warpgroup's accumulators: thread tid owns the float4 column st[j * 128 + tid],
// j = 0 .. WGN/8 - 1, holding acc[4j .. 4j + 3] (rows h = 0 and 1 of 8-column group j). Each thread reads back
// only what it wrote, and a warp's 16-byte accesses are consecutive (no bank conflicts).
template <int WGN>
__device__ __forceinline__ void stage_acc(float4* st, const float (&acc)[WGN / 2]) {
#pragma unroll
  for (int j = 0; j < WGN / 8; ++j) st[j * 128] = make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
}

// Epilogue of one warpgroup tile, rows [row0, +64) and columns [col0, +WGN) of the (shard-local) logits, from the
// staged copy (st = this thread's column). A run-time loop over the WGN/64 vocabulary tiles keeps the code small
// (fully unrolled epilogues of 64 x 256 tiles from registers ran far slower); the next tile's values are loaded
// before this tile's arithmetic. A warp whose 16 rows all lie beyond N has nothing to write and returns.
template <int WGN>
__device__ __forceinline__ void wg_stats_epilogue(const float4* st, const FusedParams& p, int row0, int col0,
                                                  const RowInfo& ri) {
  if (row0 + 16 * ((threadIdx.x % 128) / 32) >= p.n_rows) return;
  constexpr int NV = WGN / kTile;
  const int q = threadIdx.x % 4;
  const int row_base = thread_row_base(row0);
  float4 cur[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) cur[j] = st[j * 128];
#pragma unroll 1
  for (int vt = 0; vt < NV; ++vt) {
    const int tile_col = col0 + vt * kTile;
    if (tile_col >= p.n_real) break;            // whole tile beyond the real columns: no statistic
    const int vn = min(vt + 1, NV - 1);
    float4 nxt[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) nxt[j] = st[(vn * 8 + j) * 128];
    float z0[16], z1[16];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      z0[2 * j] = cur[j].x;
      z0[2 * j + 1] = cur[j].y;
      z1[2 * j] = cur[j].z;
      z1[2 * j + 1] = cur[j].w;
    }
    tile_unit(z0, p, row_base, tile_col, q, ri.T[0], ri.tcol[0]);
    tile_unit(z1, p, row_base + 8, tile_col, q, ri.T[1], ri.tcol[1]);
#pragma unroll
    for (int j = 0; j < 8; ++j) cur[j] = nxt[j];
  }
}

}  // namespace sm90
