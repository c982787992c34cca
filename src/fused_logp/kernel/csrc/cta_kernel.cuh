// The CTA kernel for sm_90a (fused_cta_kernel): the contract's logits (section 2 of CONTRACT.md: one FP32 wgmma
// accumulator, K in ascending k16 groups, no split-K) with the statistics epilogue (forward) or the dz epilogue
// (backward).
//
// fused_cta_kernel: one CTA per output tile (BM x BN), warp-specialised (one producer warpgroup issuing TMA loads
// into a ring of shared-memory stages, two consumer warpgroups issuing wgmma on each stage). The statistics epilogue
// runs after the mainloop from each consumer's accumulator registers; the logits, where asked for, are stored by the
// producer warpgroup from a copy of the accumulators staged in the idle ring (stats_epilogue.cuh). Schedules that
// lost on the H200 and were deleted (docs/design/sm90-kernel.md): a persistent ping-pong kernel with 64-row consumer
// tiles whose epilogue ran beside the other consumer's mainloop, the producer warpgroup sharing the epilogue, 2-CTA
// clusters with weight multicast, this kernel made persistent, and a persistent kernel with the epilogue on warps of
// its own beside the next tile's mainloop. The ping-pong kernel with 128-row consumer tiles is pingpong_kernel.cuh.
// Which tile computes a logit is a free axis.
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
// epilogue (wg_dz_epilogue) instead of the statistics. LOGITS: the consumers also stage their accumulators, which
// the producer warpgroup stores as the logits (producer_logits; p.logits is set exactly when it is true).
template <int WM, int WGN, bool FULL_K, bool DZ, bool LOGITS = false>
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

  init_ring<C::STAGES>(full, empty, kConsumers);
  __syncthreads();

  if (wg == 0) {
    // Producer warpgroup: one thread issues TMA loads.
    setmaxnreg_dec<40>();
    if (threadIdx.x == 0)
      load_tile<C::STAGES, C::STAGE_BYTES, C::A_BYTES, kBK>(smem, full, empty, kblocks, &map_h, m0, &map_w, n0);
    if constexpr (LOGITS && !DZ) {
      __syncwarp();
      if (!p.skip_epilogue) {
        // the consumers' two staging barriers (below): the producer and consumer warps reach them at different places
        named_bar_sync_split<1, kThreads>();
        named_bar_sync_split<kStagedBar, kThreads>();
        producer_logits<WM, WGN, 4>(smem_u32(smem), p, m0, n0, threadIdx.x / 32);
      }
    }
    return;
  }

  setmaxnreg_inc<232>();
  const int c = wg - 1;
  const int wm = c % WM, wn = c / WM;
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
    named_bar_sync<1, 128 * kConsumers>();
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

  if constexpr (LOGITS) {
    // Stage the accumulators in the (now idle) pipeline buffers once both consumer warpgroups are done with their
    // wgmma reads of them (named barrier 1); the producer warps store the logits from there once all staging is
    // written (kStagedBar), while the consumers compute the statistics. The producer warps wait in both: with
    // barrier 1 of the consumers alone, racecheck reports the producer's reads of the staging after kStagedBar
    // (tools/racecheck_probe.cu reproduces that with correct values; docs/design/sm90-kernel.md).
    named_bar_sync_split<1, kThreads>();
    stage_acc_swz<WGN>(smem_u32(smem) + 16u * (c * (C::ACC / 4 * 128)), acc);
    named_bar_sync_split<kStagedBar, kThreads>();
  }
  wg_reg_stats<WGN>(acc, p, m0 + wm * 64, n0 + wn * WGN);
}

}  // namespace sm90
