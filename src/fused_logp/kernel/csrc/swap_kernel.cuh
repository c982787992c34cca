// The swapped-operand forward kernel for sm_90a (configuration swapab-128): the contract's logits (section 2 of
// CONTRACT.md: one FP32 wgmma accumulator, K in ascending k16 groups, no split-K) with the statistics epilogue, for
// small batches. The wgmma's A operand is the weight (64 vocabulary rows a consumer warpgroup) and its B operand the
// batch (NR rows, NR = the batch rounded up to a multiple of 32, at most 256), so that a call computes the rows it
// has rounded to 32 instead of to whole 64- or 128-row tiles. A product is the same product with its factors
// exchanged and the group's terms are added exactly (section 2), so each logit has the bytes of every other
// configuration.
//
// One CTA per (row tile, 128-row weight tile), the row tiles of a weight tile adjacent in the grid. Warpgroup 0: one
// thread streams the K blocks (the weight tile's 128 rows and the row tile's NR rows) through a ring of stages;
// its warp 1 reads the CTA's per-row inputs into shared memory (swap_cta_init) while the mainloop runs. Consumer c
// multiplies the weight rows [64 c, 64 c + 64) of every stage, one contract tile, against the NR batch rows, then
// computes the tile's statistics for every batch row (swap_epilogue).
//
// Accumulator layout (wgmma m64nNRk16, A = weight): thread (warp w, lane l; g = l / 4, q = l % 4) holds vocabulary
// lane 16 w + 8 h + g of the tile (h = 0, 1) and batch rows 8 j + 2 q + e (j < NR / 8, e = 0, 1) at acc[4 j + 2 h + e].
// The tile's 64 lanes of one batch row lie in one column of every warp: the contract's tree (section 4) maps onto it
// as level 1 = g's bit 0 (lane xor 4), level 2 = g's bit 1 (xor 8), level 3 = g's bit 2 (xor 16), level 4 = h (in
// the thread), levels 5 and 6 = w's bits (across the warps, through shared memory). Levels 1-3 are reduce-scatter
// steps over the thread's columns, so that a thread ends with whole level-3 nodes of NR / 32 columns.
//
// The launch refuses what this kernel does not take, as the ping-pong kernel's does: D not a multiple of 64 and
// n_real not a multiple of 64 (a contract tile is all real or all beyond n_real).
#pragma once
#include "fused_params.cuh"
#include "ptx.cuh"
#include "stats_epilogue.cuh"

namespace sm90 {

constexpr int kSwapBV = 128;                 // weight rows a CTA: one contract tile a consumer warpgroup
constexpr int kSwapMaxRows = 256;            // the largest row tile (wgmma N)
constexpr int kSwapInitBar = 1;              // warp 1 of warpgroup 0 has written the CTA's row inputs
constexpr int kSwapEpiBar = 2;               // + c: consumer c's epilogue steps (128 threads)

// The row tile of a call of n_rows rows (the launch, and the SIMT harness that mirrors it): the batch in the fewest
// tiles of at most kSwapMaxRows rows, rounded up to a multiple of 32.
inline int swap_row_tile(long long n_rows) {
  const long long tiles = (n_rows + kSwapMaxRows - 1) / kSwapMaxRows;
  const long long per = (n_rows + tiles - 1) / tiles;
  return static_cast<int>((per + 31) / 32 * 32);
}

// The CTA's per-row inputs (swap_cta_init): the temperature and the row scale div(LOG2E, T) of each of its NR rows
// (1 and LOG2E beyond n_rows), and the rows whose target lies in its 128 weight rows (hit_n: row in the tile,
// hit_v: the target's weight row in the CTA, in row order).
struct SwapRows {
  float T[kSwapMaxRows];
  float c[kSwapMaxRows];
  int hit_n[kSwapMaxRows];
  int hit_v[kSwapMaxRows];
  int nhit;
};

// A consumer warpgroup's epilogue scratch: the per-warp partial max or sum of each row (red[w NR + n]), the tile
// maximum of each row (mfin) and whether a warp saw a non-finite logit.
template <int NR>
struct SwapScratch {
  float red[4 * NR];
  float mfin[NR];
  int bad[4];
};

template <int NR>
struct SwapCfg {
  static_assert(NR % 32 == 0 && NR >= 32 && NR <= kSwapMaxRows, "row tiles of 32 to 256 rows, multiples of 32");
  static constexpr int A_BYTES = kSwapBV * kBK * 2;      // the weight rows of a stage
  static constexpr int B_BYTES = NR * kBK * 2;           // the batch rows of a stage
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int ACC = NR / 2;
  static constexpr int EXTRA = 256 /*barriers*/ + ((sizeof(SwapRows) + 15) / 16) * 16 +
                               kConsumers * ((sizeof(SwapScratch<NR>) + 15) / 16) * 16;
  static constexpr int RING = 227 * 1024 - 1024 /*align*/ - EXTRA;
  static constexpr int STAGES = RING / STAGE_BYTES > 8 ? 8 : RING / STAGE_BYTES;
  static constexpr int SMEM = STAGES * STAGE_BYTES + 1024 + EXTRA;
  static_assert(STAGES >= 3, "a ring of at least three stages");
};

// The CTA's row inputs, by one warp: rows n0 + [0, NR), weight rows vbase + [0, kSwapBV) (local columns).
template <int NR>
__device__ __forceinline__ void swap_cta_init(const FusedParams& p, int n0, int vbase, SwapRows* sh) {
  const int lane = threadIdx.x % 32;
  int count = 0;
#pragma unroll 1
  for (int base = 0; base < NR; base += 32) {
    const int nl = base + lane, n = n0 + nl;
    const bool real = n < p.n_rows;
    const float T = real ? p.temperature[n] : 1.0f;
    sh->T[nl] = T;
    sh->c[nl] = __fdiv_rn(contract::bits(contract::EXP_LOG2E), T);
    const long long t = real ? static_cast<long long>(p.targets[n]) - p.vocab_start - vbase : -1;
    const bool hit = t >= 0 && t < kSwapBV && vbase + t < p.n_real;
    const unsigned m = __ballot_sync(0xffffffffu, hit);
    if (hit) {
      const int idx = count + __popc(m & ((1u << lane) - 1u));
      sh->hit_n[idx] = nl;
      sh->hit_v[idx] = static_cast<int>(t);
    }
    count += __popc(m);
  }
  if (lane == 0) sh->nhit = count;
}

// One reduce-scatter level over the thread's nodes x (split bit 0 of the node index): the thread keeps the nodes
// whose bit 0 is `mine`, receives its partner's (lane xor XM) value of each and combines; y[k] = node 2 k + mine.
// MAX: the NaN-propagating max (order-free), else add (commutative, so a node has the tree's bits whichever thread
// adds it).
template <int XM, int N, bool MAX>
__device__ __forceinline__ void swap_scatter(const float (&x)[N], float (&y)[N / 2], int mine) {
#pragma unroll
  for (int k = 0; k < N / 2; ++k) {
    const float send = mine ? x[2 * k] : x[2 * k + 1];
    const float keep = mine ? x[2 * k + 1] : x[2 * k];
    const float got = __shfl_xor_sync(0xffffffffu, send, XM);
    y[k] = MAX ? max_nan(keep, got) : __fadd_rn(keep, got);
  }
}

// The statistics (and, LOGITS, the logits) of contract tile v0 / 64 (local columns v0 + [0, 64), all real) for the
// batch rows n0 + [0, NR), by one consumer warpgroup from its accumulators (the layout above). sh: the CTA's row
// inputs, vlo: the tile's first weight row in the CTA (64 c); sc: this warpgroup's scratch; bar: its named barrier.
//
// Section 4 for each row n: M = the NaN-propagating max of the 64 lanes, except that a row with a NaN or +-inf lane
// gets M = NaN (a warp that holds a non-finite value, a vote, maps such a lane's pair to NaN before the max), so that
// m_t = div(M, T) and s_t (every term NaN) are NaN as the section says; c = div(LOG2E, T) from sh; the terms
// ex2(mul(sub(z, M), c)); s_t by the tree. Rows beyond n_rows are computed on the zero-filled rows and not stored.
template <int NR, bool LOGITS>
__device__ __forceinline__ void swap_epilogue(float (&acc)[NR / 2], const FusedParams& p, const SwapRows& sh,
                                              int v0, int vlo, int n0, SwapScratch<NR>& sc, int bar) {
  constexpr int NS = NR / 4;      // column slots of a thread: cs = 2 j + e, batch row 8 j + 2 q + e
  constexpr int NK = NR / 32;     // column slots a thread keeps after levels 1-3: cs = 8 k + 4 g2 + 2 g1 + g0
  const int tid = threadIdx.x % 128, w = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
  const int g0 = g & 1, g1 = (g >> 1) & 1, g2 = g >> 2;
  const int vrow = v0 + 16 * w + g;            // this thread's vocabulary rows vrow and vrow + 8 (h = 1)

  if (p.bias != nullptr) {
    const float b0 = p.bias[vrow], b1 = p.bias[vrow + 8];
#pragma unroll
    for (int j = 0; j < NR / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        acc[4 * j + e] = __fadd_rn(acc[4 * j + e], b0);
        acc[4 * j + 2 + e] = __fadd_rn(acc[4 * j + 2 + e], b1);
      }
  }
  if constexpr (LOGITS) {
    // for one (j, e, h) the warp writes 8 consecutive floats of 4 rows: whole 32-byte sectors
#pragma unroll
    for (int j = 0; j < NR / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int n = n0 + 8 * j + 2 * q + e;
        if (n < p.n_rows) {
          float* z = p.logits + static_cast<long long>(n) * p.n_real + vrow;
          __stcs(z, acc[4 * j + e]);
          __stcs(z + 8, acc[4 * j + 2 + e]);
        }
      }
  }
  // the targets in this tile (a CTA seldom holds one: the list is usually empty)
#pragma unroll 1
  for (int k = 0; k < sh.nhit; ++k) {
    const int vl = sh.hit_v[k] - vlo, nl = sh.hit_n[k];
    if (vl < 0 || vl >= kTile) continue;
    if (w == vl / 16 && g == vl % 8 && q == (nl % 8) / 2) {
      const float z = pick<NR / 2>(acc, 4 * (nl / 8) + 2 * ((vl / 8) % 2) + nl % 2);
      p.target_logit[n0 + nl] = __fdiv_rn(z, sh.T[nl]);
    }
  }

  // the max: in the thread over h, then levels 1-3 (reduce-scatter), the warps' partials through shared memory
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < NR / 2; ++i) amax = max_nan(amax, fabsf(acc[i]));
  const bool warp_bad = __any_sync(0xffffffffu, !(amax < __int_as_float(0x7F800000)));
  float mx[NS];
  if (!warp_bad) {                             // (warp-uniform)
#pragma unroll
    for (int j = 0; j < NR / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) mx[2 * j + e] = max_nan(acc[4 * j + e], acc[4 * j + 2 + e]);
  } else {
#pragma unroll
    for (int j = 0; j < NR / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float a = acc[4 * j + e], b = acc[4 * j + 2 + e];
        const bool finite = fabsf(a) < __int_as_float(0x7F800000) && fabsf(b) < __int_as_float(0x7F800000);
        mx[2 * j + e] = finite ? max_nan(a, b) : __int_as_float(0x7FFFFFFF);
      }
  }
  {
    float m1[NS / 2], m2[NS / 4], m3[NK];
    swap_scatter<4, NS, true>(mx, m1, g0);
    swap_scatter<8, NS / 2, true>(m1, m2, g1);
    swap_scatter<16, NS / 4, true>(m2, m3, g2);
#pragma unroll
    for (int k = 0; k < NK; ++k) sc.red[w * NR + 32 * k + 16 * g2 + 8 * g1 + 2 * q + g0] = m3[k];
  }
  named_bar_sync<128>(bar);
#pragma unroll
  for (int n = tid; n < NR; n += 128)
    sc.mfin[n] = max_nan(max_nan(sc.red[n], sc.red[NR + n]), max_nan(sc.red[2 * NR + n], sc.red[3 * NR + n]));
  named_bar_sync<128>(bar);

  // the terms (nodes f = h NS + cs), levels 1-3 (reduce-scatter), level 4 (h) in the thread
  {
    float x[NR / 2];
#pragma unroll
    for (int j = 0; j < NR / 8; ++j) {
      const int nl = 8 * j + 2 * q;
      const float M0 = sc.mfin[nl], M1 = sc.mfin[nl + 1], c0 = sh.c[nl], c1 = sh.c[nl + 1];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        x[h * NS + 2 * j] = contract::contract_ex2(__fmul_rn(__fsub_rn(acc[4 * j + 2 * h], M0), c0));
        x[h * NS + 2 * j + 1] = contract::contract_ex2(__fmul_rn(__fsub_rn(acc[4 * j + 2 * h + 1], M1), c1));
      }
    }
    float u1[NR / 4], u2[NR / 8], u3[NR / 16];
    swap_scatter<4, NR / 2, false>(x, u1, g0);
    swap_scatter<8, NR / 4, false>(u1, u2, g1);
    swap_scatter<16, NR / 8, false>(u2, u3, g2);
#pragma unroll
    for (int k = 0; k < NK; ++k)                      // level 4: h = 0 and h = 1 of the same slot
      sc.red[w * NR + 32 * k + 16 * g2 + 8 * g1 + 2 * q + g0] = __fadd_rn(u3[k], u3[NK + k]);
  }
  named_bar_sync<128>(bar);
  // levels 5 (warps 0 + 1, 2 + 3) and 6, and the stores
#pragma unroll
  for (int n = tid; n < NR; n += 128) {
    if (n0 + n >= p.n_rows) continue;
    const float s = __fadd_rn(__fadd_rn(sc.red[n], sc.red[NR + n]), __fadd_rn(sc.red[2 * NR + n], sc.red[3 * NR + n]));
    const float M = sc.mfin[n];
    const long long off = static_cast<long long>(n0 + n) * p.nt + v0 / kTile;
    p.tile_max[off] = __fdiv_rn(M, sh.T[n]);
    p.tile_sum[off] = (M != M) ? M : s;
  }
}

template <int NR, bool LOGITS>
__global__ void __launch_bounds__(kThreads, 1)
swap_kernel(const __grid_constant__ CUtensorMap map_h, const __grid_constant__ CUtensorMap map_w,
            const FusedParams p) {
  using C = SwapCfg<NR>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // aligned by an offset from smem_raw (not through an integer), so that the epilogue's accesses of the row inputs
  // and the scratch compile to shared-memory instructions, not generic ones
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + C::STAGES * C::STAGE_BYTES);
  uint64_t* empty = full + C::STAGES;
  SwapRows* rows = reinterpret_cast<SwapRows*>(smem + C::STAGES * C::STAGE_BYTES + 256);
  uint8_t* scratch0 = reinterpret_cast<uint8_t*>(rows) + ((sizeof(SwapRows) + 15) / 16) * 16;

  // the row tiles of one weight tile are adjacent in the grid (they read its rows from L2)
  const int rt = static_cast<int>(blockIdx.x) % p.num_m, vt = static_cast<int>(blockIdx.x) / p.num_m;
  const int n0 = rt * NR, vbase = vt * kSwapBV;
  const int wg = threadIdx.x / 128;

  init_ring<C::STAGES>(full, empty, kConsumers);
  __syncthreads();

  if (wg == 0) {
    setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      load_tile<C::STAGES, C::STAGE_BYTES, C::A_BYTES, kBK>(smem, full, empty, p.d / kBK, &map_w, vbase, &map_h, n0);
    } else if (threadIdx.x / 32 == 1) {
      swap_cta_init<NR>(p, n0, vbase, rows);
      named_bar_arrive<128 * kConsumers + 32>(kSwapInitBar);
    }
    return;
  }

  setmaxnreg_inc<232>();
  const int c = wg - 1;
  float acc[C::ACC];
#pragma unroll
  for (int i = 0; i < C::ACC; ++i) acc[i] = 0.0f;
  const int kblocks = p.d / kBK;
  for (int kb = 0; kb < kblocks; ++kb) {
    const int s = kb % C::STAGES;
    mbar_wait(&full[s], (kb / C::STAGES) & 1);
    const uint8_t* a = smem + s * C::STAGE_BYTES;
    const uint64_t da = smem_desc(a + c * 64 * (kBK * 2)), db = smem_desc(a + C::A_BYTES);
    reg_fence<C::ACC>(acc);
    wgmma_fence();
    // ascending k16 groups; +32 bytes along the swizzled 128-byte row is +2 in descriptor units
#pragma unroll
    for (int g = 0; g < kGroupsPerStage; ++g) wgmma_m64nk16<NR>(acc, da + 2 * g, db + 2 * g);
    wgmma_commit();
    // keep this stage's batch in flight; the previous one is done: release its stage
    wgmma_wait<1>();
    reg_fence<C::ACC>(acc);
    if (kb > 0 && (threadIdx.x % 128) == 0) mbar_arrive(&empty[(kb - 1) % C::STAGES]);
  }
  wgmma_wait<0>();
  reg_fence<C::ACC>(acc);
  // (the last stage is not released: nothing refills it; releasing it here serialised the wgmma at NR <= 96, C7515)

  named_bar_sync<128 * kConsumers + 32>(kSwapInitBar);      // the row inputs are written
  const int v0 = vbase + 64 * c;
  if (v0 >= p.n_real) return;
  if (p.skip_epilogue) {   // timing hook: the mainloop alone
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < C::ACC; ++i) s += acc[i];
    const int n = n0 + (threadIdx.x % 128);
    if (n < p.n_rows && n < n0 + NR) p.tile_max[static_cast<long long>(n) * p.nt + v0 / kTile] = s;
    return;
  }
  SwapScratch<NR>& sc =
      *reinterpret_cast<SwapScratch<NR>*>(scratch0 + c * ((sizeof(SwapScratch<NR>) + 15) / 16) * 16);
  swap_epilogue<NR, LOGITS>(acc, p, *rows, v0, 64 * c, n0, sc, kSwapEpiBar + c);
}

}  // namespace sm90
