// The 192-row CTA forward kernel for sm_90a (configuration cta-192x192): the contract's logits (section 2 of
// CONTRACT.md: one FP32 wgmma accumulator, K in ascending k16 groups, no split-K) with the statistics epilogue, one
// CTA per 192 x 192 tile, for batches of 129-192 rows: where the 128-row tiles compute a second, part-empty tile
// whole (the call costs by tiles), this tile holds the batch at once and reads each weight tile once.
//
// One producer warpgroup (one thread) streams the tile's K blocks through a ring of STAGES stages, each holding the
// stage's 192 hidden rows and 192 weight rows; both consumer warpgroups read every stage: consumer 0 the rows
// [0, 128) as two m64n192k16 halves (as a ping-pong consumer does), consumer 1 the rows [128, 192) as one. After the
// mainloop each consumer computes its halves' statistics (and, LOGITS, stores their logits) from its registers with
// the ping-pong kernel's half_epilogue: the same tree and the same bytes as every configuration. A half whose rows
// are all beyond n_rows issues no wgmma and no statistics. The launch refuses what this kernel does not take, as the
// ping-pong kernel's does: D not a multiple of 64 and n_real not a multiple of 64.
#pragma once
#include "fused_params.cuh"
#include "pingpong_kernel.cuh"
#include "ptx.cuh"

namespace sm90 {

using TallCfg = RegisterTileCfg<192, 192, 4>;
static_assert(TallCfg::HALF_ACC == PingPongCfg::HALF_ACC, "the ping-pong kernel's half_epilogue takes these halves");

// A consumer's mainloop over the tile's K blocks: HALVES 64-row halves (2: consumer 0's acc0 and acc1; 1: acc0
// alone, consumer 0 with rows [64, 128) beyond n_rows, or consumer 1), their A rows from byte offset a_off of each
// stage. A stage is released (one arrival of the two consumers') once the next stage's batch is in flight, the last
// once its batch is done.
template <int HALVES>
__device__ __forceinline__ void tall_mainloop(float (&acc0)[TallCfg::HALF_ACC], float (&acc1)[TallCfg::HALF_ACC],
                                              const uint8_t* smem, uint64_t* full, uint64_t* empty,
                                              const FusedParams& p, int a_off, bool leader) {
  using C = TallCfg;
#pragma unroll
  for (int k = 0; k < C::HALF_ACC; ++k) acc0[k] = acc1[k] = 0.0f;
  const int kblocks = p.d / kBK;
  for (int kb = 0; kb < kblocks; ++kb) {
    const int s = kb % C::STAGES;
    mbar_wait(&full[s], (kb / C::STAGES) & 1);
    const uint8_t* a = smem + s * C::STAGE_BYTES + a_off;
    const uint64_t da0 = smem_desc(a), da1 = smem_desc(a + 64 * (kBK * 2));
    const uint64_t db = smem_desc(smem + s * C::STAGE_BYTES + C::A_BYTES);
    reg_fence<C::HALF_ACC>(acc0);
    if (HALVES == 2) reg_fence<C::HALF_ACC>(acc1);
    wgmma_fence();
    // ascending k16 groups; +32 bytes along the swizzled 128-byte row is +2 in descriptor units
#pragma unroll
    for (int g = 0; g < kGroupsPerStage; ++g) {
      wgmma_m64n192k16(acc0, da0 + 2 * g, db + 2 * g);
      if (HALVES == 2) wgmma_m64n192k16(acc1, da1 + 2 * g, db + 2 * g);
    }
    wgmma_commit();
    wgmma_wait<1>();
    reg_fence<C::HALF_ACC>(acc0);
    if (HALVES == 2) reg_fence<C::HALF_ACC>(acc1);
    if (kb > 0 && leader) mbar_arrive(&empty[(kb - 1) % C::STAGES]);
  }
  wgmma_wait<0>();
  reg_fence<C::HALF_ACC>(acc0);
  if (HALVES == 2) reg_fence<C::HALF_ACC>(acc1);
  if (leader) mbar_arrive(&empty[(kblocks - 1) % C::STAGES]);
}

template <bool LOGITS>
__global__ void __launch_bounds__(kThreads, 1)
tall_kernel(const __grid_constant__ CUtensorMap map_h, const __grid_constant__ CUtensorMap map_w,
            const FusedParams p) {
  using C = TallCfg;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + C::STAGES * C::STAGE_BYTES);
  uint64_t* empty = full + C::STAGES;

  int mt, ntile;
  tile_coords(blockIdx.x, p.num_m, p.num_n, mt, ntile);
  const int m0 = mt * C::BM, n0 = ntile * C::BN;
  const int wg = threadIdx.x / 128;

  init_ring<C::STAGES>(full, empty, kConsumers);     // each stage is read by both consumer warpgroups
  __syncthreads();

  if (wg == 0) {
    // Producer warpgroup: one thread issues the TMA loads of the tile's K blocks.
    setmaxnreg_dec<kPingPongProducerRegs>();
    if (threadIdx.x == 0)
      load_tile<C::STAGES, C::STAGE_BYTES, C::A_BYTES, kBK>(smem, full, empty, p.d / kBK, &map_h, m0, &map_w, n0);
    return;
  }

  setmaxnreg_inc<kPingPongConsumerRegs>();
  const int c = wg - 1;
  const bool leader = threadIdx.x % 128 == 0;
  const int row0 = m0 + 128 * c;                       // consumer 0: rows [0, 128); consumer 1: [128, 192)
  float acc0[C::HALF_ACC], acc1[C::HALF_ACC];
  // the branch is taken once, around the whole pipeline, so each pipeline is straight-line; a consumer whose rows
  // are all beyond n_rows still consumes (and releases) every stage
  if (c == 0 && m0 + 64 < p.n_rows)
    tall_mainloop<2>(acc0, acc1, smem, full, empty, p, 0, leader);
  else
    tall_mainloop<1>(acc0, acc1, smem, full, empty, p, c * 128 * (kBK * 2), leader);

  if (p.skip_epilogue) {   // timing hook: the mainloop alone
    store_mainloop_sums(acc0, acc1, p, row0, n0, c == 0);
    return;
  }
  if (row0 < p.n_rows) half_epilogue<LOGITS>(acc0, p, row0, n0);
  if (c == 0 && row0 + 64 < p.n_rows) half_epilogue<LOGITS>(acc1, p, row0 + 64, n0);
}

}  // namespace sm90
