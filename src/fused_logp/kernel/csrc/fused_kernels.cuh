// The fused GEMM kernels for sm_90a: the contract's logits (section 2 of CONTRACT.md: one FP32 wgmma accumulator,
// K in ascending k16 groups, no split-K) with the statistics epilogue (forward) or the dz epilogue (backward).
//
// Two mainloop schedules, both warp-specialised (one producer warpgroup issuing TMA loads into a ring of
// shared-memory stages, two consumer warpgroups issuing wgmma; setmaxnreg moves registers to the consumers):
//   fused_cta_kernel       one CTA per output tile (BM x BN), the two consumers share each stage and run their
//                          epilogues after the mainloop (nothing overlaps them);
//   fused_pingpong_kernel  persistent, one CTA per SM; the consumers take 64 x 256 tiles in turn, so one
//                          consumer's epilogue runs while the other's mainloop keeps the tensor cores busy
//                          (launch "pingpong-64x256"; not the default: on the H200 the co-running epilogue
//                          issues ~3.5x slower and is not hidden, bench/NOTES-sm90.md).
// Which kernel and tile computes a logit is a free axis: no schedule changes a bit.
#pragma once
#include "dz_epilogue.cuh"
#include "fused_params.cuh"
#include "ptx.cuh"
#include "stats_epilogue.cuh"

namespace sm90 {

constexpr int kSmemBudget = 200 * 1024;   // CTA kernel: pipeline ring

// CTA kernel: BM = 64 WM rows; consumer warpgroup c owns rows [64 (c % WM), +64) and columns [WGN (c / WM), +WGN).
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

// FULL_K: D is a multiple of 64, every stage holds 4 k16 groups (straight-line wgmma issue). DZ: the backward
// epilogue (wg_dz_epilogue) instead of the statistics.
template <int WM, int WGN, bool FULL_K, bool DZ>
__global__ void __launch_bounds__(kThreads, 1)
fused_cta_kernel(const __grid_constant__ CUtensorMap map_h, const __grid_constant__ CUtensorMap map_w,
                   const __grid_constant__ CUtensorMap map_o, const FusedParams p) {
  using C = Cfg<WM, WGN>;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + C::STAGES * C::STAGE_BYTES);
  uint64_t* empty = full + C::STAGES;

  int mt, ntile;
  tile_coords(blockIdx.x, p.num_m, p.num_n, mt, ntile);
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
    mbar_init_fence();
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
    float4* st = reinterpret_cast<float4*>(smem) + c * (C::ACC / 4 * 128) + (threadIdx.x % 128);
    stage_acc<WGN>(st, acc);
    wg_stats_epilogue<WGN>(st, p, m0 + wm * 64, n0 + wn * WGN, ri);
  }
}


// ---------------------------------------------------------------------------------------------------------
// Persistent ping-pong kernel (forward statistics). One CTA per SM walks its tiles i = 0, 1, 2, ... (64 x 256
// each; pp_tile gives the global tile). The producer streams every tile's stages through one ring in that order;
// consumer c takes the tiles i = c, c + 2, ... Their mainloops alternate (turn barriers): a consumer starts its
// mainloop once the other has issued all of its own, then copies its accumulators to the one staging buffer
// (once the other consumer's epilogue has read it: acc_free) and runs the epilogue while the other consumer's
// wgmma keep the tensor cores busy. For N > 64 a CTA takes tiles in pairs, the two 64-row halves of a 128 x 256
// block (one weight tile, read from L2 the second time); for N <= 64 tiles go round-robin, so the weight streams
// through all SMs at once.
// ---------------------------------------------------------------------------------------------------------
struct PPCfg {
  static constexpr int BM = 64;
  static constexpr int WGN = 256;
  static constexpr int BN = WGN;
  static constexpr int ACC = WGN / 2;
  static constexpr int A_BYTES = BM * kBK * 2;          // 8 KB
  static constexpr int B_BYTES = BN * kBK * 2;          // 32 KB
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int STAGES = 4;
  static constexpr int EPI_BYTES = ACC * 128 * 4;       // 64 KB: one staged 64 x 256 FP32 tile
  static constexpr int SMEM = STAGES * STAGE_BYTES + EPI_BYTES + 256 /*barriers*/ + 1024 /*align*/;
  static_assert(SMEM <= 227 * 1024, "shared memory per block");
};

__device__ __forceinline__ int pp_tile(int i, int paired) {
  return paired ? 2 * (static_cast<int>(blockIdx.x) + (i >> 1) * static_cast<int>(gridDim.x)) + (i & 1)
                : static_cast<int>(blockIdx.x) + i * static_cast<int>(gridDim.x);
}

template <bool FULL_K>
__global__ void __launch_bounds__(kThreads, 1)
fused_pingpong_kernel(const __grid_constant__ CUtensorMap map_h, const __grid_constant__ CUtensorMap map_w,
                      const FusedParams p) {
  using C = PPCfg;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  float4* stage = reinterpret_cast<float4*>(smem + C::STAGES * C::STAGE_BYTES);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + C::STAGES * C::STAGE_BYTES + C::EPI_BYTES);
  uint64_t* empty = full + C::STAGES;
  uint64_t* turn = empty + C::STAGES;    // turn[c]: the other consumer has issued its previous mainloop
  uint64_t* acc_free = turn + 2;         // the staging buffer's last reader is done (128 arrivals per use)

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
    mbar_init(acc_free, 128);
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    // Producer warpgroup: one thread issues the TMA loads of every tile of this CTA, in order.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      uint32_t seq = 0;
      for (int i = 0;; ++i) {
        const int tile = pp_tile(i, p.paired);
        if (tile >= total) break;
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
  const int tid = threadIdx.x % 128;
  const bool leader = tid == 0;
  for (int i = c;; i += 2) {
    const int tile = pp_tile(i, p.paired);
    if (tile >= total) break;
    const int k = i >> 1;   // this consumer's k-th tile
    int mt, nt;
    tile_coords(tile, p.num_m, p.num_n, mt, nt);
    // ring order: wait until the other consumer has issued the mainloop of tile i - 1
    if (c == 0 && k > 0) mbar_wait(&turn[0], (k - 1) & 1);
    if (c == 1) mbar_wait(&turn[1], k & 1);
    const RowInfo ri = load_rows(p, thread_row_base(mt * C::BM));
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
      // ascending k16 groups; +32 bytes along the swizzled 128-byte row is +2 in descriptor units
      if (FULL_K || g_here == kGroupsPerStage) {
#pragma unroll
        for (int g = 0; g < kGroupsPerStage; ++g) wgmma_k16<C::WGN>(acc, da + 2 * g, db + 2 * g);
      } else if constexpr (!FULL_K) {
        for (int g = 0; g < g_here; ++g) wgmma_k16<C::WGN>(acc, da + 2 * g, db + 2 * g);
      }
      wgmma_commit();
      // keep this stage's batch in flight; the previous one is done: release its stage
      wgmma_wait<1>();
      reg_fence<C::ACC>(acc);
      if (kb > 0 && leader) mbar_arrive(&empty[(seq - 1) % C::STAGES]);
    }
    if (leader) mbar_arrive(&turn[1 - c]);      // every stage of this tile is issued: the other may start
    wgmma_wait<0>();
    reg_fence<C::ACC>(acc);
    if (leader) mbar_arrive(&empty[(seq0 + kblocks - 1) % C::STAGES]);
    if (p.skip_epilogue) {  // timing hook: the mainloop alone
      const int row = mt * C::BM + tid / 4;
      float sacc = 0.0f;
#pragma unroll
      for (int r = 0; r < C::ACC; ++r) sacc += acc[r];
      if (row < p.n_rows && (threadIdx.x % 4) == 0 && nt * C::BN < p.n_real)
        p.tile_max[static_cast<long long>(row) * p.nt + (nt * C::BN) / kTile] = sacc;
      continue;
    }
    // The staging buffer's uses alternate between the consumers (use i by consumer i % 2): use i waits for the
    // end of use i - 1. The named barrier makes every warp of this consumer past its own previous use first, so
    // the parity wait cannot see an older phase.
    asm volatile("bar.sync %0, 128;" ::"r"(2 + c) : "memory");
    if (i > 0) mbar_wait(acc_free, (i - 1) & 1);
    stage_acc<C::WGN>(stage + tid, acc);
    wg_stats_epilogue<C::WGN>(stage + tid, p, mt * C::BM, nt * C::BN, ri);
    mbar_arrive(acc_free);
  }
}

}  // namespace sm90
