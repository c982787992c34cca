// The forward's epilogue: the contract's tile statistics (sections 3-4 of CONTRACT.md) of a consumer warpgroup's
// tile, computed from its wgmma accumulator registers, plus the target logit; and the optional logits, stored by the
// producer warpgroup from a shared-memory copy of the accumulators.
#pragma once
#include "fused_params.cuh"
#include "ptx.cuh"

namespace sm90 {

// Per-row inputs of a thread's two rows (row, row + 8): the temperature and the target's column.
__device__ __forceinline__ void item_rows(const FusedParams& p, int row, float (&T)[2], long long (&tcol)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row + 8 * h;
    const bool ok = r < p.n_rows;
    T[h] = ok ? p.temperature[r] : 1.0f;
    tcol[h] = ok ? static_cast<long long>(p.targets[r]) - p.vocab_start : -1;
  }
}

// ---------------------------------------------------------------------------------------------------------
// The staged copy of the accumulators (only where the logits are asked for), swizzled: float4 j of accumulator
// thread tid is at st_c[j * 128 + (tid ^ ((j >> 1) & 3))], so that the stores and the producer warps' loads
// (producer_logits) are free of bank conflicts.
// ---------------------------------------------------------------------------------------------------------
template <int WGN>
__device__ __forceinline__ void stage_acc_swz(uint32_t st_c, const float (&acc)[WGN / 2]) {
  const int tid = threadIdx.x % 128;
#pragma unroll
  for (int j = 0; j < WGN / 8; ++j)
    st_shared_v4(st_c + 16u * (j * 128 + (tid ^ ((j >> 1) & 3))),
                 make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]));
}

__device__ __forceinline__ float max_nan(float a, float b) {
#ifdef FUSED_LOGP_SIMT   // the device code run on the CPU (tests/sm90/simt): the instruction's exact model
  return simt::max_nan(a, b);
#else
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
#endif
}

// x[i] where i is a run-time index: a chain of selects (no local memory).
template <int N>
__device__ __forceinline__ float pick(const float (&x)[N], int i) {
  float r = x[0];
#pragma unroll
  for (int k = 1; k < N; ++k) r = (k == i) ? x[k] : r;
  return r;
}

// One reduce-scatter level of the tree over the flattened nodes x: split bit S, partner lane xor XM. The thread keeps
// the nodes whose bit S equals mine, receives its partner's value of each (one shuffle a node) and adds; y[k] is the
// node k of x with bit S removed.
template <int S, int XM, int N>
__device__ __forceinline__ void reduce_scatter_level(const float (&x)[N], float (&y)[N / 2], int mine) {
#pragma unroll
  for (int k = 0; k < N / 2; ++k) {
    const int lo = ((k >> S) << (S + 1)) | (k & ((1 << S) - 1));
    const int hi = lo | (1 << S);
    const float send = mine ? x[lo] : x[hi];
    const float keep = mine ? x[hi] : x[lo];
    y[k] = __fadd_rn(keep, __shfl_xor_sync(0xffffffffu, send, XM));
  }
}

// ---------------------------------------------------------------------------------------------------------
// The statistics of one consumer warpgroup's tile, rows row0 + [0, 64) and columns col0 + [0, WGN), from its
// accumulator registers (after the bias, added in place). Thread (warp w, lane l; g = l / 4, q = l % 4) holds rows
// row0 + 16w + g + 8h (h = 0, 1) and, of vocabulary tile vt (columns col0 + 64 vt + [0, 64)), the lanes
// 8jj + 2q + e (jj = 0..7, e = 0, 1) at acc[4 (8 vt + jj) + 2h + e]. The thread's NP = 2 NV (row, tile) pairs are
// P = NV h + vt.
//
// Section 4 per pair: M = max over the real lanes (NaN-propagating max; a NaN or +-inf lane shows in M, a -inf lane
// in the min, whose flags are or-ed across the quad), c = div(LOG2E, T) once a row, each real lane's
// ex2(mul(sub(z, M), c)) (+0 for lanes beyond n_real), s_t by the adjacent-pairwise tree over the 64 lanes, and
// m_t = div(M, T). The tree's levels map onto the layout: level 1 is e (in the thread), level 2 is q's bit 0 (the
// lane xor 1), level 3 q's bit 1 (xor 2), levels 4-6 are jj's three bits (in the thread). Levels 2 and 3 are
// reduce-scatter steps over the flattened (P, jj) values: at each step a thread keeps the half of the nodes whose
// split bit equals its own bit of q, receives its partner's value of each (one shuffle a node) and adds; addition is
// commutative, so a node has the tree's bits whichever thread adds it. After both steps a thread holds whole subtrees
// of its own pairs (NP = 2: half of one pair's subtree, whose level 6 is one more shuffle), finishes them in order,
// and stores its pairs' tile_max and tile_sum.
//
// At T = 1 in every row of the warp (a vote) the divisions are skipped: div(LOG2E, 1) is LOG2E, and div(M, 1) = M for
// the finite M of every tile that is not non-finite, so the bytes are the same.
// ---------------------------------------------------------------------------------------------------------
// CHECKED: some lane of the warpgroup's tile lies beyond n_real (each lane is tested); otherwise none is tested.
template <int WGN, bool CHECKED>
__device__ __forceinline__ void wg_reg_stats_body(float (&acc)[WGN / 2], const FusedParams& p, int row0, int col0) {
  constexpr int NV = WGN / kTile;
  constexpr int NP = 2 * NV;
  constexpr int F = NP * 8;                                  // level-1 nodes of the thread
  static_assert(NP == 2 || NP == 4 || NP == 8, "1, 2 or 4 vocabulary tiles a warpgroup");
  // the split bits of the flattened index P * 8 + jj: level 2 (xor 1), level 3 (xor 2)
  constexpr int S1 = NP == 8 ? 4 : 3;                        // P bit 1 (NP = 8) or P bit 0
  constexpr int S2 = NP == 8 ? 5 : (NP == 4 ? 4 : 2);        // P bit 2, P bit 1, or jj bit 2 (NP = 2)
  const int lane = threadIdx.x % 32;
  const int q = lane % 4, b0 = q & 1, b1 = q >> 1;
  const int row = row0 + 16 * ((threadIdx.x % 128) / 32) + lane / 4;
  float T[2];
  long long tcol[2];
  item_rows(p, row, T, tcol);
  // warp-uniform: some row of the warp's second eight (h = 1) is real; where none is, the h = 1 pairs are skipped
  // (their nodes enter the shuffles as +0 and nothing of them is stored)
  const bool live1 = row - lane / 4 + 8 < p.n_rows;

  if (p.bias != nullptr) {
#pragma unroll
    for (int j = 0; j < WGN / 8; ++j) {
      const int col = col0 + 8 * j + 2 * q;
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (!CHECKED || col + e < p.n_real) {
          const float b = p.bias[col + e];
          acc[4 * j + e] = __fadd_rn(acc[4 * j + e], b);
          acc[4 * j + 2 + e] = __fadd_rn(acc[4 * j + 2 + e], b);
        }
    }
  }

  // the target's scaled logit, in the thread that holds its lane (a warp seldom holds one: a vote skips the search)
  bool hit[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const long long tl = tcol[h] - col0;
    hit[h] = row + 8 * h < p.n_rows && tl >= 0 && tl < WGN && tl < p.n_real - col0 && ((tl >> 1) & 3) == q;
  }
  if (__any_sync(0xffffffffu, hit[0] || hit[1])) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!hit[h]) continue;
      const int tl = static_cast<int>(tcol[h] - col0), jt = tl >> 3, e = tl & 1;
      float t = acc[2 * h];
#pragma unroll
      for (int j = 0; j < WGN / 8; ++j) {
        t = (j == jt && e == 0) ? acc[4 * j + 2 * h] : t;
        t = (j == jt && e == 1) ? acc[4 * j + 2 * h + 1] : t;
      }
      p.target_logit[row + 8 * h] = __fdiv_rn(t, T[h]);
    }
  }

  // M and the non-finite flags of each pair
  float M[NP];
  unsigned neg_inf = 0;
#pragma unroll
  for (int P = 0; P < NP; ++P) {
    const int h = P / NV, vt = P % NV;
    const int tile_col = col0 + kTile * vt;
    if (h == 1 && !live1) {
      M[P] = 0.0f;
      continue;
    }
    float mx = __int_as_float(0xFF800000), mn = __int_as_float(0x7F800000);
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float z = acc[4 * (8 * vt + jj) + 2 * h + e];
        if (!CHECKED || tile_col + 8 * jj + 2 * q + e < p.n_real) {
          mx = max_nan(mx, z);
          mn = fminf(mn, z);
        }
      }
    mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    M[P] = mx;
    neg_inf |= (mn == __int_as_float(0xFF800000) ? 1u : 0u) << P;
  }
  neg_inf |= __shfl_xor_sync(0xffffffffu, neg_inf, 1);
  neg_inf |= __shfl_xor_sync(0xffffffffu, neg_inf, 2);
  unsigned bad = 0;
#pragma unroll
  for (int P = 0; P < NP; ++P) {
    // a real lane is NaN or +-inf exactly when the max is NaN or +-inf or the min is -inf (section 4)
    const bool b = !(fabsf(M[P]) < __int_as_float(0x7F800000)) || ((neg_inf >> P) & 1u);
    bad |= (b ? 1u : 0u) << P;
    if (b) M[P] = __int_as_float(0x7FFFFFFF);
  }

  // the row scale c = div(LOG2E, T): one division for the warp's 16 rows (lane q takes row h = q's bit 0)
  const bool unit_t = __all_sync(0xffffffffu, T[0] == 1.0f && T[1] == 1.0f);
  float c[2];
  if (unit_t) {
    c[0] = c[1] = contract::bits(contract::EXP_LOG2E);
  } else {
    const float mine = __fdiv_rn(contract::bits(contract::EXP_LOG2E), b0 ? T[1] : T[0]);
    const float other = __shfl_xor_sync(0xffffffffu, mine, 1);
    c[0] = b0 ? other : mine;
    c[1] = b0 ? mine : other;
  }

  // level 1: the lane pairs' sums of the contract's exps
  float v[F];
#pragma unroll
  for (int P = 0; P < NP; ++P) {
    const int h = P / NV, vt = P % NV;
    const int tile_col = col0 + kTile * vt;
    if (h == 1 && !live1) {
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) v[8 * P + jj] = 0.0f;
      continue;
    }
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      float ex[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float z = acc[4 * (8 * vt + jj) + 2 * h + e];
        ex[e] = (!CHECKED || tile_col + 8 * jj + 2 * q + e < p.n_real)
                    ? contract::contract_ex2(__fmul_rn(__fsub_rn(z, M[P]), c[h]))
                    : 0.0f;
      }
      v[8 * P + jj] = __fadd_rn(ex[0], ex[1]);
    }
  }
  // level 2: split bit S1, partner lane xor 1; level 3: split bit S2 (of the index with bit S1 removed), xor 2
  float u[F / 2];
  reduce_scatter_level<S1, 1>(v, u, b0);
  constexpr int S2r = S2 > S1 ? S2 - 1 : S2;
  float t3[F / 4];
  reduce_scatter_level<S2r, 2>(u, t3, b1);
  // levels 4-6 and the stores of the thread's own pairs
  constexpr int OWN = NP == 8 ? 2 : 1;
#pragma unroll
  for (int o = 0; o < OWN; ++o) {
    int P;
    float s;
    if constexpr (NP == 2) {
      // t3 holds jj = 4 b1 + [0, 4) of pair b0: levels 4 and 5 here, level 6 across xor 2
      float a0 = __fadd_rn(t3[0], t3[1]), a1 = __fadd_rn(t3[2], t3[3]);
      s = __fadd_rn(a0, a1);
      s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 2));
      P = b0;
    } else {
      const float* x = t3 + 8 * o;
      float a[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = __fadd_rn(x[2 * i], x[2 * i + 1]);   // level 4
      const float l5a = __fadd_rn(a[0], a[1]), l5b = __fadd_rn(a[2], a[3]);  // level 5
      s = __fadd_rn(l5a, l5b);                                                 // level 6
      P = NP == 8 ? 4 * b1 + 2 * b0 + o : 2 * b1 + b0;
    }
    const int h = P / NV, vt = P % NV;
    const int r = row + 8 * h;
    const int tile_col = col0 + kTile * vt;
    const bool own = NP != 2 || b1 == 0;
    if (own && r < p.n_rows && (!CHECKED || tile_col < p.n_real)) {
      const float m = pick<NP>(M, P);
      const bool b = (bad >> P) & 1u;
      const long long off = static_cast<long long>(r) * p.nt + tile_col / kTile;
      p.tile_max[off] = (b || unit_t) ? m : __fdiv_rn(m, h ? T[1] : T[0]);
      p.tile_sum[off] = b ? m : s;
    }
  }
}

// -> whether the tile holds a real row of the warp and a real column (warp-uniform); nothing is computed where not.
// RAGGED: the tile may end beyond n_real (the lane-by-lane checked body is compiled in); a caller whose tiles never
// do (pingpong_kernel: n_real a multiple of 64, 64-column tiles) passes false and compiles the unchecked body alone.
template <int WGN, bool RAGGED = true>
__device__ __forceinline__ bool wg_reg_stats(float (&acc)[WGN / 2], const FusedParams& p, int row0, int col0) {
  if (row0 + 16 * ((threadIdx.x % 128) / 32) >= p.n_rows || col0 >= p.n_real) return false;
  if (!RAGGED || col0 + WGN <= p.n_real)
    wg_reg_stats_body<WGN, false>(acc, p, row0, col0);
  else if constexpr (RAGGED)
    wg_reg_stats_body<WGN, true>(acc, p, row0, col0);
  return true;
}

// The logits of a CTA's staged consumer tiles, stored by the producer warpgroup's NW warps (warp pw), which are
// otherwise idle once the staging barrier has passed: the consumer warps' statistics carry no logits code. Float4 j
// of accumulator thread src = 32 w + 4 g + s holds columns 8 j + 2 s + {0, 1} of rows g (x, y) and g + 8 (z, w) of
// warp w's 16 rows. A step of a warp takes columns [32 jg, 32 jg + 32) of one w, in four row pairs (g, g + 1 and
// their + 8): lane (s, gpar, jj) = (lane % 4, lane / 4 % 2, lane / 8) reads float4 4 jg + jj of src with
// g = 2 gp + gpar (each quarter warp's 8 loads hit 8 distinct 16-byte bank groups, 4 (g % 2) + (s ^ x)) and stores
// two 8-byte pairs, so that each store instruction writes two whole 128-byte row segments. A CTA whose rows and
// columns are all real, without bias and with 16-byte-aligned rows, stores without checks; others check each value
// and add the bias as the statistics add it.
template <int WM, int WGN, int NW>
__device__ __forceinline__ void producer_logits(uint32_t st, const FusedParams& p, int row0, int col0, int pw) {
  constexpr int NJ = WGN / 32;               // column groups of 32 a consumer tile
  constexpr int NS = kConsumers * 4 * NJ;    // steps: consumer tile, warp w, column group
  constexpr int BM = 64 * WM, BN = WGN * kConsumers / WM;
  const int lane = threadIdx.x % 32;
  const int s = lane % 4, gpar = (lane / 4) % 2, jj = lane / 8;
  const long long ld = p.n_real;
  const bool fast = row0 + BM <= p.n_rows && col0 + BN <= p.n_real && p.logits_vec4 != 0 && p.bias == nullptr;
#pragma unroll 1
  for (int k = pw; k < NS; k += NW) {
    const int jg = k % NJ, w = (k / NJ) % 4, c = k / (4 * NJ);
    const int j = 4 * jg + jj;
    const uint32_t sb = st + 16u * (c * (WGN * 16) + j * 128 + 32 * w + 4 * gpar + (s ^ ((j >> 1) & 3)));
    const int r0 = row0 + 64 * (c % WM) + 16 * w + gpar;   // the lane's rows: r0 + 2 gp and r0 + 2 gp + 8
    const int col = col0 + WGN * (c / WM) + 8 * j + 2 * s;
    if (fast) {
      float* base = p.logits + r0 * ld + col;
#pragma unroll
      for (int gp = 0; gp < 4; ++gp) {
        const float4 v = ld_shared_v4(sb + 16u * (8 * gp));
        __stcs(reinterpret_cast<float2*>(base + 2 * gp * ld), make_float2(v.x, v.y));
        __stcs(reinterpret_cast<float2*>(base + (2 * gp + 8) * ld), make_float2(v.z, v.w));
      }
      continue;
    }
    const float b0 = (p.bias != nullptr && col < p.n_real) ? p.bias[col] : 0.0f;
    const float b1 = (p.bias != nullptr && col + 1 < p.n_real) ? p.bias[col + 1] : 0.0f;
#pragma unroll 1
    for (int gp = 0; gp < 4; ++gp) {
      float4 v = ld_shared_v4(sb + 16u * (8 * gp));
      if (p.bias != nullptr) {
        v.x = __fadd_rn(v.x, b0);
        v.z = __fadd_rn(v.z, b0);
        v.y = __fadd_rn(v.y, b1);
        v.w = __fadd_rn(v.w, b1);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r0 + 2 * gp + 8 * h;
        if (r >= p.n_rows) continue;
        float* lr = p.logits + r * ld + col;
        const float a = h ? v.z : v.x, b = h ? v.w : v.y;
        if (p.logits_vec4 != 0 && col + 1 < p.n_real) {
          __stcs(reinterpret_cast<float2*>(lr), make_float2(a, b));
        } else {
          if (col < p.n_real) __stcs(lr, a);
          if (col + 1 < p.n_real) __stcs(lr + 1, b);
        }
      }
    }
  }
}

}  // namespace sm90
