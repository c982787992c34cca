// The forward's epilogue: the contract's tile statistics (sections 3-4 of CONTRACT.md) of the CTA's tiles, read from a
// shared-memory copy of the wgmma accumulators, plus the target logit and the optional logits.
#pragma once
#include "fused_params.cuh"
#include "ptx.cuh"

namespace sm90 {

// ---------------------------------------------------------------------------------------------------------
// The epilogue as work items shared by the consumer warps: an item is (consumer warpgroup c, its warp w,
// vocabulary tile vt), 16 rows x 64 columns of c's staged tile, taken by any warp once all staging is written.
// ---------------------------------------------------------------------------------------------------------

// Per-row inputs of an item's two rows (row, row + 8): the temperature and the target's column.
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
// The staged copy is swizzled so that the reading quad's thread q holds lanes
// [16q, 16q + 16) of its two rows: the tree's levels 1-4 are thread-local (15 adds, no shuffles), levels 5 and 6
// are one xor-shuffle each. Float4 j of accumulator thread tid is at st_c[j * 128 + (tid ^ ((j >> 1) & 3))]:
// conflict-free 16-byte stores (the xor permutes within each quad) and loads (see load_item).
// ---------------------------------------------------------------------------------------------------------
template <int WGN>
__device__ __forceinline__ void stage_acc_swz(uint32_t st_c, const float (&acc)[WGN / 2]) {
  const int tid = threadIdx.x % 128;
#pragma unroll
  for (int j = 0; j < WGN / 8; ++j)
    st_shared_v4(st_c + 16u * (j * 128 + (tid ^ ((j >> 1) & 3))),
                 make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]));
}

// Thread (g = lane / 4, q = lane % 4) of the item's warp takes float4 jj of source thread 32w + 4g + s, for the
// 8-column groups j = 8vt + 2q + jj (jj = 0, 1) and s = 0..3: the source wrote lanes 8j + 2s + {0, 1} of rows g
// (x, y) and g + 8 (z, w), i.e. tile lanes 16q + 8jj + 2s + e. Load (jj, s) of the 8 threads of a quarter warp
// hits float4 slots 4 (g % 2) + (s ^ q): 8 distinct, no bank conflict.
__device__ __forceinline__ void load_item(float4 (&v)[8], uint32_t st_c, int w, int vt) {
  const int lane = threadIdx.x % 32;
  const int q = lane % 4;
  const uint32_t b = st_c + 16u * ((8 * vt + 2 * q) * 128 + 32 * w + 4 * (lane / 4));
#pragma unroll
  for (int jj = 0; jj < 2; ++jj)
#pragma unroll
    for (int s = 0; s < 4; ++s) v[4 * jj + s] = ld_shared_v4(b + 16u * (jj * 128 + (s ^ q)));
}

__device__ __forceinline__ float max_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// Lanes 16q + i (i = 0..15) of one row: the thread-local levels 1-4 of the tree, then levels 5 and 6 across the quad.
__device__ __forceinline__ float tree16(const float (&e)[16]) {
  float a[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) a[i] = __fadd_rn(e[2 * i], e[2 * i + 1]);               // level 1
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = __fadd_rn(a[2 * i], a[2 * i + 1]);               // level 2
#pragma unroll
  for (int i = 0; i < 2; ++i) a[i] = __fadd_rn(a[2 * i], a[2 * i + 1]);               // level 3
  float s = __fadd_rn(a[0], a[1]);                                                     // level 4: [16q, +16)
  s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 1));                                // level 5: [32(q/2), +32)
  s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 2));                                // level 6
  return s;
}

// One item: z[h][i] is column tile_col + 16q + i of row row + 8h; T and tcol are the two rows' item_rows. Every
// thread of the warp calls it. Section 4: M = max z over the real lanes (NaN if any is non-finite), the lanes'
// ex2(mul(sub(z, M), c)) with c = div(LOG2E, T) summed by the tree, m_t = div(M, T); the target's z' = div(z, T).
// The per-logit work is one max, one sub, one mul, one ex2 and one add; the divisions are per row or per tile.
// LOGITS (p.logits is set exactly when it is true): the unscaled logits are stored after the row maximum's shuffles,
// so that the stores do not queue ahead of the shuffles; they drain under the exp's arithmetic.
template <bool LOGITS>
__device__ __forceinline__ void item_stats(const float4 (&v)[8], const float (&T)[2], const long long (&tcol)[2],
                                           const FusedParams& p, int row, int tile_col) {
  const int q = threadIdx.x % 4;
  const int c0 = tile_col + 16 * q;
  const bool full = tile_col + kTile <= p.n_real;   // warp-uniform
  float z[2][16];
#pragma unroll
  for (int jj = 0; jj < 2; ++jj)
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      z[0][8 * jj + 2 * s] = v[4 * jj + s].x;
      z[0][8 * jj + 2 * s + 1] = v[4 * jj + s].y;
      z[1][8 * jj + 2 * s] = v[4 * jj + s].z;
      z[1][8 * jj + 2 * s + 1] = v[4 * jj + s].w;
    }
  if (p.bias != nullptr) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if (c0 + i < p.n_real) {
        const float b = p.bias[c0 + i];
        z[0][i] = __fadd_rn(z[0][i], b);
        z[1][i] = __fadd_rn(z[1][i], b);
      }
    }
  }
  // unscaled logits, streamed past L2: 64 contiguous bytes a row, as four 16-byte stores where aligned
  auto store_logits = [&]() {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (row + 8 * h >= p.n_rows) continue;
      float* lr = p.logits + static_cast<long long>(row + 8 * h) * p.n_real + c0;
      if (full && p.logits_vec4) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
          __stcs(reinterpret_cast<float4*>(lr) + i, make_float4(z[h][4 * i], z[h][4 * i + 1], z[h][4 * i + 2],
                                                                z[h][4 * i + 3]));
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i)
          if (c0 + i < p.n_real) __stcs(lr + i, z[h][i]);
      }
    }
  };
  // M (max over real lanes; NaN if any real lane is non-finite)
  float m[2];
  bool bad[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = __int_as_float(0xFF800000), mn = __int_as_float(0x7F800000);
    if (full) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        mx = max_nan(mx, z[h][i]);     // NaN-propagating: a NaN lane makes mx NaN
        mn = fminf(mn, z[h][i]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        if (c0 + i < p.n_real) {
          mx = max_nan(mx, z[h][i]);
          mn = fminf(mn, z[h][i]);
        }
      }
    }
    mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, 1));
    mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, 2));
    // a real lane is NaN or +-inf exactly when the row's max is NaN or +-inf or its min is -inf
    bad[h] = !(fabsf(mx) < __int_as_float(0x7F800000)) || mn == __int_as_float(0xFF800000);
    m[h] = bad[h] ? __int_as_float(0x7FFFFFFF) : mx;
  }
  if constexpr (LOGITS) store_logits();
  float s[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float c = __fdiv_rn(contract::bits(contract::EXP_LOG2E), T[h]);
    float e[16];
    if (full) {
#pragma unroll
      for (int i = 0; i < 16; ++i) e[i] = contract::contract_ex2(__fmul_rn(__fsub_rn(z[h][i], m[h]), c));
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i)
        e[i] = (c0 + i < p.n_real) ? contract::contract_ex2(__fmul_rn(__fsub_rn(z[h][i], m[h]), c)) : 0.0f;
    }
    s[h] = tree16(e);
    if (bad[h]) s[h] = m[h];          // NaN, as ex2(NaN) lanes would give
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row + 8 * h;
    if (r >= p.n_rows) continue;
    const long long tl = tcol[h] - tile_col;
    if (tl >= 0 && tl < kTile && tl < p.n_real - tile_col && (tl >> 4) == q) {
      float t = z[h][0];
#pragma unroll
      for (int i = 1; i < 16; ++i)
        if (i == (tl & 15)) t = z[h][i];
      p.target_logit[r] = __fdiv_rn(t, T[h]);
    }
    if (q == 0) {
      const long long o = static_cast<long long>(r) * p.nt + tile_col / kTile;
      p.tile_max[o] = bad[h] ? m[h] : __fdiv_rn(m[h], T[h]);
      p.tile_sum[o] = s[h];
    }
  }
}

// The epilogue of a CTA's staged consumer tiles as items: NI = kConsumers * 4 * (WGN / 64) items, item k taken by
// warp k % NW (warp index gw among the NW epilogue warps), the next item's values and its rows' temperatures and
// targets loaded before this item's arithmetic (global loads: their latency falls under it). Consumer c's tile:
// rows row0 + 64 (c % WM), columns col0 + WGN (c / WM), staged at byte st + c * WGN * 256 of the shared window.
template <int WM, int WGN, int NW, bool LOGITS>
__device__ __forceinline__ void cta_items_epilogue(uint32_t st, const FusedParams& p, int row0, int col0, int gw) {
  constexpr int NV = WGN / kTile;
  constexpr int NI = kConsumers * 4 * NV;
  const int lane = threadIdx.x % 32;
  auto coords = [&](int k, int& c, int& w, int& vt) {
    c = k / (4 * NV);
    w = (k / NV) % 4;
    vt = k % NV;
  };
  // item kk's staged values and its rows' temperatures and targets; item kk's statistics from them
  auto fetch = [&](int kk, float4 (&v)[8], float (&T)[2], long long (&tcol)[2]) {
    int c, w, vt;
    coords(kk, c, w, vt);
    load_item(v, st + 16u * (c * (WGN * 16)), w, vt);
    item_rows(p, row0 + 64 * (c % WM) + 16 * w + lane / 4, T, tcol);
  };
  auto stats = [&](int kk, const float4 (&v)[8], const float (&T)[2], const long long (&tcol)[2]) {
    int c, w, vt;
    coords(kk, c, w, vt);
    const int rbase = row0 + 64 * (c % WM) + 16 * w;
    const int tile_col = col0 + WGN * (c / WM) + kTile * vt;
    if (rbase < p.n_rows && tile_col < p.n_real)   // warp-uniform: rows or columns beyond the real ones skip
      item_stats<LOGITS>(v, T, tcol, p, rbase + lane / 4, tile_col);
  };
  int k = gw;
  if (k >= NI) return;
  float4 cur[8];
  float T[2];
  long long tcol[2];
  fetch(k, cur, T, tcol);
#pragma unroll 1
  for (; k < NI; k += NW) {
    float4 nxt[8];
    float Tn[2];
    long long tcoln[2];
    fetch(k + NW < NI ? k + NW : k, nxt, Tn, tcoln);
    stats(k, cur, T, tcol);
#pragma unroll
    for (int j = 0; j < 8; ++j) cur[j] = nxt[j];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      T[h] = Tn[h];
      tcol[h] = tcoln[h];
    }
  }
}

// The logits of a CTA's staged consumer tiles, stored by the producer warpgroup's NW warps (warp pw), which are
// otherwise idle once the staging barrier has passed: the consumer warps' items then carry no logits code. Float4 j
// of accumulator thread src = 32 w + 4 g + s holds columns 8 j + 2 s + {0, 1} of rows g (x, y) and g + 8 (z, w) of
// warp w's 16 rows. A step of a warp takes columns [32 jg, 32 jg + 32) of one w, in four row pairs (g, g + 1 and
// their + 8): lane (s, gpar, jj) = (lane % 4, lane / 4 % 2, lane / 8) reads float4 4 jg + jj of src with
// g = 2 gp + gpar (each quarter warp's 8 loads hit 8 distinct 16-byte bank groups, 4 (g % 2) + (s ^ x)) and stores
// two 8-byte pairs, so that each store instruction writes two whole 128-byte row segments. A CTA whose rows and
// columns are all real, without bias and with 16-byte-aligned rows, stores without checks; others check each value
// and add the bias as item_stats adds it.
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
