// Fused GEMM + contract tile statistics kernel for sm_90a (shared by the launch units of each CTA shape).
// See sm90_linear_logp.cu for the contract summary.
#pragma once
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include "contract_math.cuh"
#include "wgmma_ptx.cuh"

static_assert(contract::VOCAB_TILE == 64, "contract v1: VOCAB_TILE is 64");
static_assert(contract::K_GROUP == 16, "contract v1: K group is 16 (one wgmma k16 step)");

namespace sm90 {

constexpr int kTile = contract::VOCAB_TILE;
constexpr int kBK = 64;                 // K elements per pipeline stage: 4 ascending k16 groups, 128 B rows
constexpr int kGroupsPerStage = kBK / contract::K_GROUP;
static_assert(kGroupsPerStage * contract::K_GROUP == kBK, "stage holds whole k16 groups");
constexpr int kConsumers = 2;           // consumer warpgroups
constexpr int kThreads = 128 * (kConsumers + 1);
constexpr int kSmemBudget = 200 * 1024;
constexpr int kGroupM = 16;             // grid raster: M tiles per group (L2 reuse)

// ---------------------------------------------------------------------------------------------------------
// PTX helpers: shared-memory addresses, mbarrier, TMA, wgmma sync
// ---------------------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  const uint32_t a = smem_u32(bar);
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
  } while (!done);
}
// 2D tile [box_rows x 64] of a K-major bf16 matrix into 128B-swizzled shared memory.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int k0, int row0) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(k0), "r"(row0)
      : "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
template <int R>
__device__ __forceinline__ void reg_fence(float* d) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Shared-memory matrix descriptor: K-major, 128B swizzle, 8-row core groups 1024 B apart.
__device__ __forceinline__ uint64_t smem_desc(const void* p) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((smem_u32(p) & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>(1) << 16;           // leading byte offset (unused with 128B swizzle)
  d |= static_cast<uint64_t>(1024 >> 4) << 32;   // stride byte offset
  d |= static_cast<uint64_t>(1) << 62;           // 128B swizzle
  return d;
}

template <int WGN>
__device__ __forceinline__ void wgmma_k16(float* d, uint64_t da, uint64_t db) {
  if constexpr (WGN == 256) wgmma_m64n256k16(d, da, db);
  else if constexpr (WGN == 128) wgmma_m64n128k16(d, da, db);
  else wgmma_m64n64k16(d, da, db);
}

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

// ---------------------------------------------------------------------------------------------------------
// Fused GEMM + tile statistics.
//   hidden map [N, D] bf16, weight map [V_rows, D] bf16 (K-major), CTA tile BM x BN, BM = 64*WM rows.
//   Consumer warpgroup c owns rows [64*(c % WM), +64) and columns [WGN*(c / WM), +WGN) of the CTA tile.
//   Outputs: tile_max/tile_sum [N, nt] (nt = ceil(n_real/64)), target_logit [N] (owner rows only),
//   logits [N, n_real] unscaled (optional).
// ---------------------------------------------------------------------------------------------------------
struct FusedParams {
  int n_rows, d, n_real, nt, num_m, num_n;
  long long vocab_start;
  const int64_t* targets;
  const float* temperature;
  const float* bias;  // [n_real..] local columns, or null
  float* tile_max;
  float* tile_sum;
  float* target_logit;
  float* logits;      // [N, n_real] or null
  int skip_epilogue;  // timing hook only (bench): mainloop without statistics
  // Backward mode (DZ kernels, sm90_backward.cu): instead of statistics, the logit gradient of every element
  // dz = (coef * exp(z' - lse) + g_logp [column == target]) / T, rounded to bf16, stored through the kernel's
  // map_o tensor map.
  const float* lse;
  const float* coef;    // g_lse - g_logp
  const float* g_logp;
};

template <int WM, int WGN>
struct Cfg {
  static constexpr int BM = 64 * WM;
  static constexpr int BN = WGN * (kConsumers / WM);
  static constexpr int A_BYTES = BM * kBK * 2;
  static constexpr int B_BYTES = BN * kBK * 2;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int STAGES = (kSmemBudget / STAGE_BYTES) > 8 ? 8 : (kSmemBudget / STAGE_BYTES);
  static constexpr int SMEM = STAGES * STAGE_BYTES + 1024 /*align*/ + 256 /*barriers*/;
  static constexpr int ACC = WGN / 2;
  static_assert(kConsumers % WM == 0, "consumer layout");
  static_assert(WGN % kTile == 0, "a warpgroup covers whole vocabulary tiles");
  static_assert(BN <= 256 && BM <= 256, "TMA box");
  static_assert(kConsumers * ACC * 128 * 4 <= STAGES * STAGE_BYTES, "epilogue staging fits");
};

// Per-row inputs of this thread's two rows (row_base, row_base + 8), loaded once per tile and early: global
// loads inside the epilogue's tile loop would each wait for L2 under the mainloop's traffic.
struct RowInfo {
  float T[2];
  long long tcol[2];   // target column relative to the shard start; -1 for rows beyond N
};

__device__ __forceinline__ RowInfo load_rows(const FusedParams& p, int row_base) {
  RowInfo r;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row_base + 8 * h;
    const bool ok = row < p.n_rows;
    r.T[h] = ok ? p.temperature[row] : 1.0f;
    r.tcol[h] = ok ? static_cast<long long>(p.targets[row]) - p.vocab_start : -1;
  }
  return r;
}

__device__ __forceinline__ int thread_row_base(int row0) {
  const int tid = threadIdx.x % 128;
  return row0 + 16 * (tid / 32) + (tid % 32) / 4;
}

// Backward mode: per-row factors of this thread's two rows (loaded after the mainloop).
//   x = z * a - b = (z / T - lse) log2(e);  p = 2^x;  dz = cs * p (+ gt on the target column)
// Gradient bytes are not contract-bearing: the scaling multiplies by 1/T and the exp is the hardware ex2.approx
// (relative error ~2^-22, far below the bf16 rounding of dz, 2^-9). This is the only approximate function in
// the kernel sources, and it is reached only from the DZ kernels (tests/test_sm90_compile.py checks both).
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
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int col0, int row0) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
               ::"l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(src)), "r"(col0), "r"(row0)
               : "memory");
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
      const float p0 = ex2_approx(__fsub_rn(__fmul_rn(z0, r.a[h]), r.b[h]));
      const float p1 = ex2_approx(__fsub_rn(__fmul_rn(z1, r.a[h]), r.b[h]));
      float d0 = __fmul_rn(r.cs[h], p0), d1 = __fmul_rn(r.cs[h], p1);
      if (t == c) d0 = __fadd_rn(d0, r.gt[h]);
      if (t == c + 1) d1 = __fadd_rn(d1, r.gt[h]);
      *reinterpret_cast<__nv_bfloat162*>(row_base + (j / 8) * 8192 + (((j % 8) ^ sw) * 16)) =
          __floats2bfloat162_rn(d0, d1);
    }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // the writes above, to the TMA (async) proxy
  asm volatile("bar.sync %0, 128;" ::"r"(bar_id) : "memory");
  if (tid == 0 && row0 < p.n_rows) {
#pragma unroll
    for (int k = 0; k < WGN / 64; ++k)
      if (col0 + 64 * k < p.n_real) tma_store_2d(map_o, stage + k * 8192, col0 + 64 * k, row0);
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // shared memory is read before the CTA exits
  }
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
      if (p.logits != nullptr && ok && row_ok) p.logits[static_cast<long long>(row) * p.n_real + col] = zs[2 * j + e];
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

// Epilogue of one warpgroup tile from registers: rows [row0, row0+64), columns [col0, col0+WGN) of the
// (shard-local) logits. Thread layout: warp w, lane l: rows 16w + l/4 (+8), columns 8j + 2(l%4) (+1) of each
// 8-column group; acc[(c/8)*4 + 2*h + e] holds row 16w + l/4 + 8h, column c = 8j + 2(l%4) + e.
template <int WGN>
__device__ __forceinline__ void wg_epilogue(const float (&acc)[WGN / 2], const FusedParams& p, int row0, int col0,
                                            const RowInfo& ri) {
  const int q = threadIdx.x % 4;
  const int row_base = thread_row_base(row0);
#pragma unroll
  for (int vt = 0; vt < WGN / kTile; ++vt) {
    const int tile_col = col0 + vt * kTile;
    if (tile_col >= p.n_real) break;            // whole tile beyond the real columns: no statistic
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float zs[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) zs[i] = acc[(vt * 8 + i / 2) * 4 + 2 * h + (i & 1)];
      tile_unit(zs, p, row_base + 8 * h, tile_col, q, ri.T[h], ri.tcol[h]);
    }
  }
}

// The same from a shared-memory copy st[i * 128] of accumulator i (this thread's column of the copy); a
// run-time loop over groups of VT 64-column tiles (both rows of each) keeps the code small.
template <int WGN, int VT>
__device__ __forceinline__ void wg_epilogue_staged(const float* st, const FusedParams& p, int row0, int col0,
                                                   const RowInfo& ri) {
  static_assert((WGN / kTile) % VT == 0, "tile groups");
  const int q = threadIdx.x % 4;
  const int row_base = thread_row_base(row0);
#pragma unroll 1
  for (int vg = 0; vg < WGN / kTile; vg += VT) {
#pragma unroll
    for (int k = 0; k < VT; ++k) {
      const int vt = vg + k;
      const int tile_col = col0 + vt * kTile;
      if (tile_col < p.n_real) {
        float z0[16], z1[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          z0[i] = st[((vt * 8 + i / 2) * 4 + (i & 1)) * 128];
          z1[i] = st[((vt * 8 + i / 2) * 4 + 2 + (i & 1)) * 128];
        }
        tile_unit(z0, p, row_base, tile_col, q, ri.T[0], ri.tcol[0]);
        tile_unit(z1, p, row_base + 8, tile_col, q, ri.T[1], ri.tcol[1]);
      }
    }
  }
}

// FULL_K: D is a multiple of 64, every stage holds 4 k16 groups (straight-line wgmma issue). DZ: the backward
// epilogue (wg_dz_epilogue) instead of the statistics.
template <int WM, int WGN, bool FULL_K, int EPI_VT, bool DZ>
__global__ void __launch_bounds__(kThreads, 1)
fused_stats_kernel(const __grid_constant__ CUtensorMap map_h, const __grid_constant__ CUtensorMap map_w,
                   const __grid_constant__ CUtensorMap map_o, const FusedParams p) {
  using C = Cfg<WM, WGN>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + C::STAGES * C::STAGE_BYTES);
  uint64_t* empty = full + C::STAGES;

  // Grouped raster over (m tile, n tile).
  const int bid = blockIdx.x;
  const int per_group = kGroupM * p.num_n;
  const int group = bid / per_group;
  const int first_m = group * kGroupM;
  const int gsz = min(p.num_m - first_m, kGroupM);
  const int mt = first_m + (bid % per_group) % gsz;
  const int ntile = (bid % per_group) / gsz;
  const int m0 = mt * C::BM;
  const int n0 = ntile * C::BN;

  const int wg = threadIdx.x / 128;
  const int kblocks = (p.d + kBK - 1) / kBK;
  const int kgroups = p.d / contract::K_GROUP;

  if (threadIdx.x == 0) {
    for (int s = 0; s < C::STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    // Producer warpgroup: one thread issues TMA loads.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      for (int kb = 0; kb < kblocks; ++kb) {
        const int s = kb % C::STAGES;
        mbar_wait(&empty[s], ((kb / C::STAGES) & 1) ^ 1);
        uint8_t* a = smem + s * C::STAGE_BYTES;
        uint8_t* b = a + C::A_BYTES;
        mbar_expect_tx(&full[s], C::STAGE_BYTES);
        tma_load_2d(a, &map_h, &full[s], kb * kBK, m0);
        tma_load_2d(b, &map_w, &full[s], kb * kBK, n0);
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int c = wg - 1;
  const int wm = c % WM, wn = c / WM;
  const RowInfo ri = DZ ? RowInfo{} : load_rows(p, thread_row_base(m0 + wm * 64));
  float acc[C::ACC];
#pragma unroll
  for (int i = 0; i < C::ACC; ++i) acc[i] = 0.0f;

  for (int kb = 0; kb < kblocks; ++kb) {
    const int s = kb % C::STAGES;
    mbar_wait(&full[s], (kb / C::STAGES) & 1);
    const uint8_t* a = smem + s * C::STAGE_BYTES + wm * 64 * (kBK * 2);
    const uint8_t* b = smem + s * C::STAGE_BYTES + C::A_BYTES + wn * WGN * (kBK * 2);
    const uint64_t da = smem_desc(a), db = smem_desc(b);
    const int g_here = min(kGroupsPerStage, kgroups - kb * kGroupsPerStage);
    reg_fence<C::ACC>(acc);
    wgmma_fence();
    // ascending k16 groups; +32 bytes along the swizzled 128-byte row is +2 in descriptor units
    if (FULL_K || g_here == kGroupsPerStage) {
#pragma unroll
      for (int g = 0; g < kGroupsPerStage; ++g) wgmma_k16<WGN>(acc, da + 2 * g, db + 2 * g);
    } else if constexpr (!FULL_K) {
      for (int g = 0; g < g_here; ++g) wgmma_k16<WGN>(acc, da + 2 * g, db + 2 * g);
    }
    wgmma_commit();
    // keep this stage's batch in flight; the previous one is done: release its stage
    wgmma_wait<1>();
    reg_fence<C::ACC>(acc);
    if (kb > 0 && (threadIdx.x % 128) == 0) mbar_arrive(&empty[(kb + C::STAGES - 1) % C::STAGES]);
  }
  wgmma_wait<0>();
  reg_fence<C::ACC>(acc);
  if constexpr (DZ) {
    // stage in the pipeline buffers once both consumer warpgroups are done reading them (named barrier 1)
    static_assert(kConsumers * 64 * WGN * 2 <= C::STAGES * C::STAGE_BYTES, "dz staging fits");
    asm volatile("bar.sync 1, %0;" ::"n"(128 * kConsumers) : "memory");
    // per-row factors loaded here, not before the mainloop: live across it they cost the registers that keep
    // the wgmma pipeline unserialised (ptxas C7515); the rows are hot in L2 (every CTA of the M tile reads them)
    const DzRows dr = load_dz_rows(p, thread_row_base(m0 + wm * 64));
    wg_dz_epilogue<WGN>(acc, p, m0 + wm * 64, n0 + wn * WGN, dr, smem + c * (64 * WGN * 2), &map_o, 2 + c);
    return;
  }
  if (p.skip_epilogue) {  // timing hook: the mainloop alone
    const int row = m0 + wm * 64 + (threadIdx.x % 128) / 4;
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < C::ACC; ++i) s += acc[i];
    if (row < p.n_rows && (threadIdx.x % 4) == 0 && n0 + wn * WGN < p.n_real)
      p.tile_max[static_cast<long long>(row) * p.nt + (n0 + wn * WGN) / kTile] = s;
    return;
  }

  {
    // Copy the accumulators to the (now idle) pipeline buffers and run the epilogue as a small run-time loop
    // (fully unrolled epilogues of 64 x 256 tiles run far slower). Both consumer warpgroups must be done with
    // their wgmma reads of the buffers first (named barrier 1).
    asm volatile("bar.sync 1, %0;" ::"n"(128 * kConsumers) : "memory");
    float* st = reinterpret_cast<float*>(smem) + c * (C::ACC * 128) + (threadIdx.x % 128);
#pragma unroll
    for (int i = 0; i < C::ACC; ++i) st[i * 128] = acc[i];
    wg_epilogue_staged<WGN, EPI_VT>(st, p, m0 + wm * 64, n0 + wn * WGN, ri);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Persistent ping-pong kernel: one CTA per SM walks tiles b, b + G, b + 2G, ... (G = gridDim.x) of 64 x WGN.
// The producer streams every tile's stages through one ring in order; consumer warpgroup c takes the CTA's
// tiles i = c, c + 2, ... Mainloops alternate between the two warpgroups (turn barriers), so one
// warpgroup's epilogue runs while the other's wgmma keep the tensor cores busy.
// ---------------------------------------------------------------------------------------------------------
template <int WGN>
struct PPCfg {
  static constexpr int BM = 64;
  static constexpr int BN = WGN;
  static constexpr int A_BYTES = BM * kBK * 2;
  static constexpr int B_BYTES = BN * kBK * 2;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int ACC = WGN / 2;
  // 64 x 128 tiles: each consumer warpgroup has its own shared-memory copy area for the staged epilogue.
  static constexpr bool STAGED = (WGN == 128);
  static constexpr int EPI_BYTES = STAGED ? kConsumers * ACC * 128 * 4 : 0;
  static constexpr int RING = kSmemBudget - EPI_BYTES;
  static constexpr int STAGES = (RING / STAGE_BYTES) > 8 ? 8 : (RING / STAGE_BYTES);
  static constexpr int SMEM = STAGES * STAGE_BYTES + EPI_BYTES + 1024 + 256;
  static_assert(STAGES >= 3, "pipeline depth");
};

__device__ __forceinline__ void tile_coords(int tile, int num_m, int num_n, int& mt, int& nt) {
  const int per_group = kGroupM * num_n;
  const int group = tile / per_group;
  const int first_m = group * kGroupM;
  const int gsz = min(num_m - first_m, kGroupM);
  mt = first_m + (tile % per_group) % gsz;
  nt = (tile % per_group) / gsz;
}

template <int WGN, bool FULL_K>
__global__ void __launch_bounds__(kThreads, 1)
fused_stats_pingpong_kernel(const __grid_constant__ CUtensorMap map_h, const __grid_constant__ CUtensorMap map_w,
                            const FusedParams p) {
  using C = PPCfg<WGN>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + C::STAGES * C::STAGE_BYTES + C::EPI_BYTES);
  uint64_t* empty = full + C::STAGES;
  uint64_t* turn = empty + C::STAGES;    // turn[c]: the other warpgroup finished a mainloop

  const int wg = threadIdx.x / 128;
  const int kblocks = (p.d + kBK - 1) / kBK;
  const int kgroups = p.d / contract::K_GROUP;
  const int total = p.num_m * p.num_n;

  if (threadIdx.x == 0) {
    for (int s = 0; s < C::STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 1);
    }
    mbar_init(&turn[0], 1);
    mbar_init(&turn[1], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      uint32_t seq = 0;
      for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
        int mt, nt;
        tile_coords(tile, p.num_m, p.num_n, mt, nt);
        for (int kb = 0; kb < kblocks; ++kb, ++seq) {
          const int s = seq % C::STAGES;
          mbar_wait(&empty[s], ((seq / C::STAGES) & 1) ^ 1);
          uint8_t* a = smem + s * C::STAGE_BYTES;
          mbar_expect_tx(&full[s], C::STAGE_BYTES);
          tma_load_2d(a, &map_h, &full[s], kb * kBK, mt * C::BM);
          tma_load_2d(a + C::A_BYTES, &map_w, &full[s], kb * kBK, nt * C::BN);
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int c = wg - 1;
  const bool leader = (threadIdx.x % 128) == 0;
  int j = 0;  // tiles this warpgroup has taken
  for (int i = c, tile = blockIdx.x + c * gridDim.x; tile < total; i += 2, tile += 2 * gridDim.x, ++j) {
    int mt, nt;
    tile_coords(tile, p.num_m, p.num_n, mt, nt);
    // wait for the other warpgroup's previous mainloop (ring order)
    if (c == 0 && j > 0) mbar_wait(&turn[0], (j - 1) & 1);
    if (c == 1) mbar_wait(&turn[1], j & 1);
    const RowInfo ri = load_rows(p, thread_row_base(mt * 64));
    float acc[C::ACC];
#pragma unroll
    for (int r = 0; r < C::ACC; ++r) acc[r] = 0.0f;
    const uint32_t seq0 = static_cast<uint32_t>(i) * kblocks;
    for (int kb = 0; kb < kblocks; ++kb) {
      const uint32_t seq = seq0 + kb;
      const int s = seq % C::STAGES;
      mbar_wait(&full[s], (seq / C::STAGES) & 1);
      const uint8_t* a = smem + s * C::STAGE_BYTES;
      const uint64_t da = smem_desc(a), db = smem_desc(a + C::A_BYTES);
      const int g_here = min(kGroupsPerStage, kgroups - kb * kGroupsPerStage);
      reg_fence<C::ACC>(acc);
      wgmma_fence();
      if (FULL_K || g_here == kGroupsPerStage) {
#pragma unroll
        for (int g = 0; g < kGroupsPerStage; ++g) wgmma_k16<WGN>(acc, da + 2 * g, db + 2 * g);
      } else if constexpr (!FULL_K) {
        for (int g = 0; g < g_here; ++g) wgmma_k16<WGN>(acc, da + 2 * g, db + 2 * g);
      }
      wgmma_commit();
      wgmma_wait<1>();
      reg_fence<C::ACC>(acc);
      if (kb > 0 && leader) mbar_arrive(&empty[(seq - 1) % C::STAGES]);
    }
    if (leader) mbar_arrive(&turn[1 - c]);      // every stage of this tile is issued: the other may start
    wgmma_wait<0>();
    reg_fence<C::ACC>(acc);
    if (leader) mbar_arrive(&empty[(seq0 + kblocks - 1) % C::STAGES]);
    if (p.skip_epilogue) {  // timing hook: the mainloop alone
      const int row = mt * 64 + (threadIdx.x % 128) / 4;
      float sacc = 0.0f;
#pragma unroll
      for (int r = 0; r < C::ACC; ++r) sacc += acc[r];
      if (row < p.n_rows && (threadIdx.x % 4) == 0 && nt * WGN < p.n_real)
        p.tile_max[static_cast<long long>(row) * p.nt + (nt * WGN) / kTile] = sacc;
      continue;
    }
    if constexpr (C::STAGED) {
      float* st = reinterpret_cast<float*>(smem + C::STAGES * C::STAGE_BYTES) + c * (C::ACC * 128) +
                  (threadIdx.x % 128);
#pragma unroll
      for (int r = 0; r < C::ACC; ++r) st[r * 128] = acc[r];
      wg_epilogue_staged<WGN, 1>(st, p, mt * 64, nt * WGN, ri);
    } else {
      wg_epilogue<WGN>(acc, p, mt * 64, nt * WGN, ri);
    }
  }
}
// ---------------------------------------------------------------------------------------------------------
// Persistent kernel with a dedicated epilogue warpgroup. CTA tile 128 x 128; warps 4-11 are two consumer
// warpgroups (rows 64c.., all 128 columns, K walked as in the kernels above), warp 12 issues the TMA loads,
// warps 0-3 run the epilogue of tile k from a shared-memory copy of the accumulators while the consumers
// run the mainloop of tile k + 1.
// ---------------------------------------------------------------------------------------------------------
struct EWCfg {
  static constexpr int BM = 128;
  static constexpr int BN = 128;
  static constexpr int WGN = 128;
  static constexpr int ACC = WGN / 2;
  static constexpr int A_BYTES = BM * kBK * 2;
  static constexpr int B_BYTES = BN * kBK * 2;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int EPI_BYTES = kConsumers * ACC * 128 * 4;
  static constexpr int STAGES = (224 * 1024 - EPI_BYTES) / STAGE_BYTES;
  static constexpr int SMEM = STAGES * STAGE_BYTES + EPI_BYTES + 1024 + 256;
  static constexpr int THREADS = 128 * 3 + 32;
  static_assert(STAGES >= 4, "pipeline depth");
};

template <bool FULL_K>
__global__ void __launch_bounds__(EWCfg::THREADS, 1)
fused_stats_epiwg_kernel(const __grid_constant__ CUtensorMap map_h, const __grid_constant__ CUtensorMap map_w,
                         const FusedParams p) {
  using C = EWCfg;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  float* stage_acc = reinterpret_cast<float*>(smem + C::STAGES * C::STAGE_BYTES);   // [2][ACC][128]
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + C::STAGES * C::STAGE_BYTES + C::EPI_BYTES);
  uint64_t* empty = full + C::STAGES;
  uint64_t* acc_full = empty + C::STAGES;    // [2] consumer c's copy is written (128 arrivals)
  uint64_t* acc_empty = acc_full + 2;        // [2] the epilogue has read it (128 arrivals)

  const int warp = threadIdx.x / 32;
  const int kblocks = (p.d + kBK - 1) / kBK;
  const int kgroups = p.d / contract::K_GROUP;
  const int total = p.num_m * p.num_n;

  if (threadIdx.x == 0) {
    for (int s = 0; s < C::STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumers);
    }
    for (int c = 0; c < 2; ++c) {
      mbar_init(&acc_full[c], 128);
      mbar_init(&acc_empty[c], 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();

  if (warp == 12) {
    if (threadIdx.x % 32 == 0) {
      uint32_t seq = 0;
      for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
        int mt, nt;
        tile_coords(tile, p.num_m, p.num_n, mt, nt);
        for (int kb = 0; kb < kblocks; ++kb, ++seq) {
          const int s = seq % C::STAGES;
          mbar_wait(&empty[s], ((seq / C::STAGES) & 1) ^ 1);
          uint8_t* a = smem + s * C::STAGE_BYTES;
          mbar_expect_tx(&full[s], C::STAGE_BYTES);
          tma_load_2d(a, &map_h, &full[s], kb * kBK, mt * C::BM);
          tma_load_2d(a + C::A_BYTES, &map_w, &full[s], kb * kBK, nt * C::BN);
        }
      }
    }
    return;
  }

  const int tid = threadIdx.x % 128;
  if (warp < 4) {
    // Epilogue warpgroup: thread tid reads the copy written by consumer thread tid (same row/column layout).
    int k = 0;
    for (int tile = blockIdx.x; tile < total; tile += gridDim.x, ++k) {
      int mt, nt;
      tile_coords(tile, p.num_m, p.num_n, mt, nt);
      const RowInfo r0 = load_rows(p, thread_row_base(mt * C::BM));
      const RowInfo r1 = load_rows(p, thread_row_base(mt * C::BM + 64));
#pragma unroll 1
      for (int c = 0; c < kConsumers; ++c) {
        mbar_wait(&acc_full[c], k & 1);
        RowInfo ri;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          ri.T[h] = c == 0 ? r0.T[h] : r1.T[h];
          ri.tcol[h] = c == 0 ? r0.tcol[h] : r1.tcol[h];
        }
        if (!p.skip_epilogue)
          wg_epilogue_staged<C::WGN, 1>(stage_acc + c * (C::ACC * 128) + tid, p, mt * C::BM + 64 * c, nt * C::BN,
                                        ri);
        mbar_arrive(&acc_empty[c]);
      }
    }
    return;
  }

  const int c = warp / 4 - 1;
  const bool leader = tid == 0;
  uint32_t seq = 0;
  int k = 0;
  for (int tile = blockIdx.x; tile < total; tile += gridDim.x, ++k) {
    float acc[C::ACC];
#pragma unroll
    for (int r = 0; r < C::ACC; ++r) acc[r] = 0.0f;
    for (int kb = 0; kb < kblocks; ++kb, ++seq) {
      const int s = seq % C::STAGES;
      mbar_wait(&full[s], (seq / C::STAGES) & 1);
      const uint8_t* a = smem + s * C::STAGE_BYTES + c * 64 * (kBK * 2);
      const uint64_t da = smem_desc(a), db = smem_desc(smem + s * C::STAGE_BYTES + C::A_BYTES);
      const int g_here = min(kGroupsPerStage, kgroups - kb * kGroupsPerStage);
      reg_fence<C::ACC>(acc);
      wgmma_fence();
      if (FULL_K || g_here == kGroupsPerStage) {
#pragma unroll
        for (int g = 0; g < kGroupsPerStage; ++g) wgmma_k16<C::WGN>(acc, da + 2 * g, db + 2 * g);
      } else if constexpr (!FULL_K) {
        for (int g = 0; g < g_here; ++g) wgmma_k16<C::WGN>(acc, da + 2 * g, db + 2 * g);
      }
      wgmma_commit();
      wgmma_wait<1>();
      reg_fence<C::ACC>(acc);
      if (kb > 0 && leader) mbar_arrive(&empty[(seq + C::STAGES - 1) % C::STAGES]);
    }
    wgmma_wait<0>();
    reg_fence<C::ACC>(acc);
    if (leader) mbar_arrive(&empty[(seq + C::STAGES - 1) % C::STAGES]);
    mbar_wait(&acc_empty[c], (k & 1) ^ 1);
    float* st = stage_acc + c * (C::ACC * 128) + tid;
#pragma unroll
    for (int r = 0; r < C::ACC; ++r) st[r * 128] = acc[r];
    mbar_arrive(&acc_full[c]);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Host side: tensor maps and the launch of one CTA shape (instantiated in sm90_fused_*.cu).
// ---------------------------------------------------------------------------------------------------------
inline PFN_cuTensorMapEncodeTiled_v12000 get_encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (fn == nullptr) {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q;
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q);
    TORCH_CHECK(err == cudaSuccess && q == cudaDriverEntryPointSuccess && ptr != nullptr,
                "sm90: cuTensorMapEncodeTiled not available from the driver");
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }
  return fn;
}

inline CUtensorMap make_map(const torch::Tensor& t, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(t.size(1)), static_cast<cuuint64_t>(t.size(0))};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(t.stride(0)) * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kBK), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t estr[2] = {1, 1};
  CUresult r = get_encode_fn()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, t.data_ptr(), dims, strides, box, estr,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "sm90: cuTensorMapEncodeTiled failed with code ", static_cast<int>(r));
  return map;
}

// Host entries (forward statistics in sm90_linear_logp.cu, backward dz in sm90_backward.cu): the checks they
// share and the FusedParams fields they fill. hidden [N, D] and weight [R, D]: contiguous CUDA bfloat16, D a
// positive multiple of 16; n_real (named cols_name in messages) in [1, R]; targets [N] contiguous CUDA int64;
// temperature [N] contiguous CUDA float32; bias contiguous CUDA float32 covering the n_real columns, or none.
inline FusedParams entry_params(const char* who, const char* cols_name, const torch::Tensor& hidden,
                                const torch::Tensor& weight, const torch::Tensor& targets,
                                const torch::Tensor& temperature, const c10::optional<torch::Tensor>& bias,
                                long long vocab_start, long long n_real) {
  TORCH_CHECK(hidden.is_cuda() && weight.is_cuda() && hidden.scalar_type() == torch::kBFloat16 &&
                  weight.scalar_type() == torch::kBFloat16 && hidden.dim() == 2 && weight.dim() == 2 &&
                  hidden.size(1) == weight.size(1) && hidden.is_contiguous() && weight.is_contiguous(),
              who, ": hidden [N, D] and weight [R, D] must be contiguous CUDA bfloat16");
  const long long n = hidden.size(0), d = hidden.size(1);
  TORCH_CHECK(d % contract::K_GROUP == 0 && d > 0, who, ": D must be a positive multiple of 16");
  TORCH_CHECK(n_real >= 1 && n_real <= weight.size(0), who, ": ", cols_name, " must be in [1, ", weight.size(0),
              "], got ", n_real);
  TORCH_CHECK(n < (1LL << 31) && n_real < (1LL << 31), who, ": sizes too large");
  TORCH_CHECK(targets.is_cuda() && targets.scalar_type() == torch::kInt64 && targets.is_contiguous() &&
                  targets.numel() == n, who, ": targets must be contiguous CUDA int64 [N]");
  TORCH_CHECK(temperature.is_cuda() && temperature.scalar_type() == torch::kFloat32 &&
                  temperature.is_contiguous() && temperature.numel() == n,
              who, ": temperature must be contiguous CUDA float32 [N]");
  FusedParams p{};
  p.n_rows = static_cast<int>(n);
  p.d = static_cast<int>(d);
  p.n_real = static_cast<int>(n_real);
  p.vocab_start = vocab_start;
  p.targets = targets.data_ptr<int64_t>();
  p.temperature = temperature.data_ptr<float>();
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_cuda() && bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                    bias->numel() >= n_real, who, ": bias must be contiguous CUDA float32 covering the ", cols_name,
                " columns");
    p.bias = bias->data_ptr<float>();
  }
  return p;
}

template <int WM, int WGN, int EPI_VT>
void launch_fused(const torch::Tensor& hidden, const torch::Tensor& weight, const FusedParams& p,
                  cudaStream_t stream) {
  using C = Cfg<WM, WGN>;
  FusedParams q = p;
  q.num_m = (p.n_rows + C::BM - 1) / C::BM;
  q.num_n = (p.n_real + C::BN - 1) / C::BN;
  const CUtensorMap mh = make_map(hidden, C::BM);
  const CUtensorMap mw = make_map(weight, C::BN);
  auto kern = (p.d % kBK == 0) ? fused_stats_kernel<WM, WGN, true, EPI_VT, false>
                                : fused_stats_kernel<WM, WGN, false, EPI_VT, false>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM));
  const long long blocks = static_cast<long long>(q.num_m) * q.num_n;
  TORCH_CHECK(blocks < (1LL << 31), "sm90: grid too large");
  kern<<<static_cast<unsigned>(blocks), kThreads, C::SMEM, stream>>>(mh, mw, mh /*map_o: DZ kernels only*/, q);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}


inline int sm_count() {
  int dev = 0, n = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

template <int WGN>
void launch_pingpong(const torch::Tensor& hidden, const torch::Tensor& weight, const FusedParams& p,
                     cudaStream_t stream) {
  using C = PPCfg<WGN>;
  FusedParams q = p;
  q.num_m = (p.n_rows + C::BM - 1) / C::BM;
  q.num_n = (p.n_real + C::BN - 1) / C::BN;
  const CUtensorMap mh = make_map(hidden, C::BM);
  const CUtensorMap mw = make_map(weight, C::BN);
  auto kern = (p.d % kBK == 0) ? fused_stats_pingpong_kernel<WGN, true> : fused_stats_pingpong_kernel<WGN, false>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM));
  const long long tiles = static_cast<long long>(q.num_m) * q.num_n;
  TORCH_CHECK(tiles < (1LL << 31), "sm90: too many tiles");
  const int grid = static_cast<int>(std::min<long long>(tiles, sm_count()));
  kern<<<grid, kThreads, C::SMEM, stream>>>(mh, mw, q);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool UNUSED>
void launch_epiwg(const torch::Tensor& hidden, const torch::Tensor& weight, const FusedParams& p,
                  cudaStream_t stream) {
  using C = EWCfg;
  FusedParams q = p;
  q.num_m = (p.n_rows + C::BM - 1) / C::BM;
  q.num_n = (p.n_real + C::BN - 1) / C::BN;
  const CUtensorMap mh = make_map(hidden, C::BM);
  const CUtensorMap mw = make_map(weight, C::BN);
  auto kern = (p.d % kBK == 0) ? fused_stats_epiwg_kernel<true> : fused_stats_epiwg_kernel<false>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM));
  const long long tiles = static_cast<long long>(q.num_m) * q.num_n;
  TORCH_CHECK(tiles < (1LL << 31), "sm90: too many tiles");
  const int grid = static_cast<int>(std::min<long long>(tiles, sm_count()));
  kern<<<grid, C::THREADS, C::SMEM, stream>>>(mh, mw, q);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

extern template void launch_fused<2, 256, 1>(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);
extern template void launch_fused<2, 256, 2>(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);
extern template void launch_fused<1, 128, 1>(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);
extern template void launch_fused<1, 64, 1>(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);
extern template void launch_pingpong<128>(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);
extern template void launch_pingpong<256>(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);
extern template void launch_epiwg<true>(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);

}  // namespace sm90
