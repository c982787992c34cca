// The persistent ping-pong forward kernel for sm_90a: the contract's logits (section 2 of CONTRACT.md: one FP32
// wgmma accumulator, K in ascending k16 groups, no split-K) with the statistics epilogue, scheduled so that one
// consumer warpgroup's statistics (and logits stores) run while the other's mainloop runs.
//
// One CTA an SM (grid = min(SMs, tiles)); tiles are numbered in the grouped raster of tile_coords. The static schedule:
// the CTA takes tiles blockIdx.x, + gridDim.x, ... The dynamic schedule (p.tile_counter): the CTA takes tile blockIdx.x
// first, then each next tile as gridDim.x + the counter's value, which its producer increments one tile ahead, so that
// the tiles in flight stay a window of the raster however the CTAs' speeds differ (the static stride lets them drift
// apart, and the weight tiles that they share then leave L2 between uses). The producer posts each tile's number, and
// past the last tile an end mark for each consumer, in a ring of kTileSlots slots with an mbarrier each (tile_slots).
// Its producer warpgroup (one thread) streams every tile's K blocks, in that order, through one ring of STAGES shared-
// memory stages. Consumer warpgroup c owns the CTA's tiles i with i % 2 == c, each a whole 128 x 192 tile: two
// m64n192k16 halves (rows [0, 64) and [64, 128)) that share the stage's B. The two consumers' mainloops run in tile
// order, one at a time (named barriers kOrderBar + c: consumer c waits at its own before each mainloop but its first,
// and signals the other's once it has issued the last wgmma of each mainloop that has a successor tile, so that every
// signal has exactly one wait and the tensor cores run the two consumers' wgmmas back to back);
// after its mainloop a consumer computes its tile's statistics from its registers while the other consumer's mainloop
// runs. The order also keeps every mbarrier parity wait within one phase: a consumer waits on a stage's fill k only
// once the wait for fill k - STAGES has passed.
//
// The statistics run one 64-column slice at a time (half_epilogue): the accumulators of columns [64 k, 64 k + 64) of
// a 64-row half are acc[32 k .. 32 k + 32) and have the register layout of a 64 x 64 warpgroup tile, so
// wg_reg_stats<64, false> computes them with the same tree and the same bytes as every other configuration; LOGITS:
// the consumer then stores the slice's logits from the same registers (store_slice_logits). The launch refuses what
// this kernel does not take: D not a multiple of 64 (every stage holds 4 k16 groups) and n_real not a multiple of 64
// (a slice is all real or all beyond n_real: no lane-by-lane check, whose registers the 192 accumulators leave no
// room for).
//
// CLUSTER = 2 (configuration pingpong-128x192-mc2, static schedule): the CTAs run in clusters of two along M, which
// take the pairs of m tiles (2 mp, 2 mp + 1) of one vocabulary tile together (a unit), in the same grouped raster over
// (m tile pairs, n tiles): CTA rank r computes m tile 2 mp + r. Each CTA's producer loads its own hidden rows and one
// half (96 rows) of the weight tile, multicast into the same stage of both CTAs, so that the weight is read from L2
// once for two m tiles. A stage's full barrier expects the whole stage (its hidden rows, both halves); its empty
// barrier counts one release from each CTA (the consumer of that stage in both CTAs arrives on both CTAs' barriers),
// so that neither producer refills a stage that either CTA still reads. The two CTAs meet (cluster barrier) after the
// barriers' initialisation and before any thread exits. Where num_m is odd, the last pair's second tile lies beyond
// the rows: that CTA loads the last real hidden tile again (its stages feed its peer) and its consumer waits for and
// releases each stage without computing.
#pragma once
#include "fused_params.cuh"
#include "ptx.cuh"
#include "stats_epilogue.cuh"

namespace sm90 {

// The tile and ring of a kernel whose consumer warpgroups hold 64-row halves of BN columns in their registers: a
// stage holds BM hidden rows and BN weight rows of one K block.
template <int BM_, int BN_, int STAGES_>
struct RegisterTileCfg {
  static constexpr int BM = BM_, BN = BN_;
  static constexpr int HALF_ACC = BN / 2;              // accumulators of a 64-row half, a thread
  static constexpr int A_BYTES = BM * kBK * 2;
  static constexpr int B_BYTES = BN * kBK * 2;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int STAGES = STAGES_;
  static constexpr int SMEM = STAGES * STAGE_BYTES + 1024 /*align*/ + 256 /*barriers*/;
  static_assert(SMEM <= 227 * 1024, "the ring fits in an SM's shared memory");
  static_assert(BN % kTile == 0 && BN <= 256 && BM % 64 == 0 && BM <= 256, "whole vocabulary tiles; TMA box");
};
using PingPongCfg = RegisterTileCfg<128, 192, 5>;

// Registers a thread: setmaxnreg.inc draws on the CTA's pool, which holds what the launch allocated (one CTA an SM:
// 65536 / 384 threads, rounded down to a multiple of 8, = 168 a thread). The 2 x 96 accumulators and the statistics
// of a slice need 240 (ptxas spills at 232); the producer's one thread runs in 24.
constexpr int kPingPongProducerRegs = 24, kPingPongConsumerRegs = 240;
static_assert(128 * kPingPongProducerRegs + 128 * kConsumers * kPingPongConsumerRegs <= 168 * kThreads,
              "setmaxnreg.inc would wait forever for registers the pool does not hold");

// Named barriers of the ping-pong kernel: kOrderBar + c, consumer c may begin its next mainloop. (0: the block's.)
constexpr int kOrderBar = 5;

// The dynamic schedule's ring of tile numbers, after the stage barriers: slot i % kTileSlots holds the CTA's i-th
// tile (or unit_count, the end), posted on its mbarrier. The producer writes slot i once it has waited for the release
// of tile i - 1's last stage; by then every tile up to i - 1 - STAGES has begun its mainloop, so its consumer has
// read its slot: kTileSlots >= STAGES + 2 keeps both end marks (i and i + 1) off unread slots.
constexpr int kTileSlots = 8;
struct TileSlots {
  uint64_t* posted;   // [kTileSlots] mbarriers, count 1
  int* tile;          // [kTileSlots]
};
template <int STAGES>
__device__ __forceinline__ TileSlots tile_slots(uint64_t* full) {
  static_assert(kTileSlots >= STAGES + 2, "an end mark never lands on an unread slot");
  static_assert((2 * STAGES + kTileSlots) * 8 + kTileSlots * 4 <= 256, "the barriers fit the kernels' 256 bytes");
  uint64_t* posted = full + 2 * STAGES;   // after full[STAGES] and empty[STAGES]
  return {posted, reinterpret_cast<int*>(posted + kTileSlots)};
}

// The loop bounds, read from the parameters where they are used: locals held across the epilogue would take the
// register that the logits stores need. A unit is the work of one cluster: CLUSTER m tiles of one vocabulary tile
// (one tile where CLUSTER = 1).
template <int CLUSTER>
__device__ __forceinline__ int m_units(const FusedParams& p) { return (p.num_m + CLUSTER - 1) / CLUSTER; }
template <int CLUSTER>
__device__ __forceinline__ int unit_count(const FusedParams& p) { return m_units<CLUSTER>(p) * p.num_n; }
// The units of this CTA's cluster: first_unit + i unit_stride; its m tile of a unit's CLUSTER: cluster_rank.
template <int CLUSTER>
__device__ __forceinline__ unsigned first_unit() { return blockIdx.x / CLUSTER; }
template <int CLUSTER>
__device__ __forceinline__ unsigned unit_stride() { return gridDim.x / CLUSTER; }
template <int CLUSTER>
__device__ __forceinline__ int cluster_rank() { return CLUSTER > 1 ? static_cast<int>(cluster_ctarank()) : 0; }
__device__ __forceinline__ int k_blocks(const FusedParams& p) { return p.d / kBK; }

// The logits of a 64 x 64 slice from its accumulators, after the statistics (which added the bias in place): the
// thread's rows row0 + 16 w + g + 8 h (g = lane / 4) that are real, columns col0 + 8 jj + 2 q + {0, 1}
// (q = lane % 4), 8-byte streaming stores (each store instruction of a warp writes whole 32-byte sectors).
__device__ __forceinline__ void store_slice_logits(const float (&a)[kTile / 2], const FusedParams& p, int row0,
                                                   int col0) {
  const int lane = threadIdx.x % 32;
  const int row = row0 + 16 * ((threadIdx.x % 128) / 32) + lane / 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (row + 8 * h >= p.n_rows) continue;
    float* z = p.logits + static_cast<long long>(row + 8 * h) * p.n_real + col0 + 2 * (lane % 4);
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
      __stcs(reinterpret_cast<float2*>(z + 8 * jj), make_float2(a[4 * jj + 2 * h], a[4 * jj + 2 * h + 1]));
  }
}

// The statistics (and, LOGITS, the logits) of a 64-row half, rows row0 + [0, 64), columns n0 + [0, 192), a 64-column
// slice at a time. n_real is a multiple of 64: a slice is all real or all beyond it (then skipped), never checked
// lane by lane.
template <bool LOGITS>
__device__ __forceinline__ void half_epilogue(float (&acc)[PingPongCfg::HALF_ACC], const FusedParams& p, int row0,
                                              int n0) {
#pragma unroll
  for (int k = 0; k < PingPongCfg::BN / kTile; ++k) {
    float(&a)[kTile / 2] = *reinterpret_cast<float(*)[kTile / 2]>(acc + (kTile / 2) * k);
    if (wg_reg_stats<kTile, false>(a, p, row0, n0 + kTile * k) && LOGITS)
      store_slice_logits(a, p, row0, n0 + kTile * k);
  }
}

// The timing hook's stores (the mainloop alone; the outputs are then meaningless): each 64-row half's accumulator
// sum, rows row0 + [0, 64) and, `second`, row0 + 64 + [0, 64), into tile_max at the first vocabulary tile of n0.
__device__ __forceinline__ void store_mainloop_sums(const float (&acc0)[PingPongCfg::HALF_ACC],
                                                    const float (&acc1)[PingPongCfg::HALF_ACC], const FusedParams& p,
                                                    int row0, int n0, bool second) {
  float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
  for (int k = 0; k < PingPongCfg::HALF_ACC; ++k) {
    s0 += acc0[k];
    s1 += acc1[k];
  }
  const int row = row0 + (threadIdx.x % 128) / 4;
  if ((threadIdx.x % 4) == 0 && n0 < p.n_real) {
    if (row < p.n_rows) p.tile_max[static_cast<long long>(row) * p.nt + n0 / kTile] = s0;
    if (second && row + 64 < p.n_rows) p.tile_max[static_cast<long long>(row + 64) * p.nt + n0 / kTile] = s1;
  }
}

// A consumer's release of a stage it has read: one arrival on its empty barrier, in every CTA of the cluster (each
// CTA's producer writes into both CTAs' stages).
template <int CLUSTER>
__device__ __forceinline__ void release_stage(uint64_t* empty_s) {
  if constexpr (CLUSTER > 1) {
#pragma unroll
    for (int r = 0; r < CLUSTER; ++r) mbar_arrive_cluster(empty_s, r);
  } else {
    mbar_arrive(empty_s);
  }
}

// The ping-pong schedule of one CTA (the comment at the top): the ring of C::STAGES stages at smem with its barriers
// full and empty, the producer's loads of every tile of the CTA, and each consumer's mainloops in tile order. After
// the mainloop of each of its tiles, a consumer warpgroup calls epi(acc0, acc1, m0, n0) with its accumulators of rows
// m0 + [0, 64) and m0 + 64 + [0, 64), columns n0 + [0, 192), while the other consumer's mainloop runs.
template <int CLUSTER, class Epilogue>
__device__ __forceinline__ void pingpong_schedule(uint8_t* smem, uint64_t* full, uint64_t* empty,
                                                  const CUtensorMap* map_h, const CUtensorMap* map_w,
                                                  const FusedParams& p, Epilogue&& epi) {
  using C = PingPongCfg;
  static_assert(CLUSTER == 1 || CLUSTER == 2, "clusters of one or two CTAs");
  const int wg = threadIdx.x / 128;

  // the dynamic schedule (CLUSTER = 1 only)
  const bool dynamic = CLUSTER == 1 && p.tile_counter != nullptr;
  const TileSlots slots = tile_slots<C::STAGES>(full);
  if (threadIdx.x == 0)
    for (int k = 0; k < kTileSlots; ++k) mbar_init(&slots.posted[k], 1);
  init_ring<C::STAGES>(full, empty, CLUSTER);     // each stage is read by one consumer warpgroup of each CTA
  if constexpr (CLUSTER > 1)
    cluster_sync();                      // the peer's barriers are initialised before any multicast reaches them
  else
    __syncthreads();

  if (wg == 0) {
    // Producer warpgroup: one thread issues the TMA loads of every unit of this CTA, K blocks in order.
    setmaxnreg_dec<kPingPongProducerRegs>();
    if (threadIdx.x == 0) {
      int seq = 0, i = 0;
      for (int u = first_unit<CLUSTER>(); u < unit_count<CLUSTER>(p); ++i) {
        int next;
        if (dynamic) {
          next = static_cast<int>(gridDim.x + atomicAdd(p.tile_counter, 1u));   // waited for after the loads
          slots.tile[i % kTileSlots] = u;
          mbar_arrive(&slots.posted[i % kTileSlots]);   // release: the slot's write before the post
        } else {
          next = u + unit_stride<CLUSTER>();
        }
        int mu, ntile;
        tile_coords(u, m_units<CLUSTER>(p), p.num_n, mu, ntile);
        // a tile beyond the rows (odd num_m) loads the last real hidden tile: its bytes fill the stage, unused
        const int mt = CLUSTER > 1 ? min(CLUSTER * mu + cluster_rank<CLUSTER>(), p.num_m - 1) : mu;
        for (int kb = 0; kb < k_blocks(p); ++kb, ++seq) {
          const int s = seq % C::STAGES;
          mbar_wait(&empty[s], ((seq / C::STAGES) & 1) ^ 1);
          uint8_t* a = smem + s * C::STAGE_BYTES;
          mbar_expect_tx(&full[s], C::STAGE_BYTES);
          tma_load_2d(a, map_h, &full[s], kb * kBK, mt * C::BM);
          if constexpr (CLUSTER > 1)
            tma_load_2d_multicast(a + C::A_BYTES + cluster_rank<CLUSTER>() * (C::B_BYTES / CLUSTER), map_w,
                                  &full[s], kb * kBK, ntile * C::BN + cluster_rank<CLUSTER>() * (C::BN / CLUSTER),
                                  (1u << CLUSTER) - 1);
          else
            tma_load_2d(a + C::A_BYTES, map_w, &full[s], kb * kBK, ntile * C::BN);
        }
        u = next;
      }
      if (dynamic)   // the end, for the consumer of slot i and for the other
        for (int e = i; e < i + 2; ++e) {
          slots.tile[e % kTileSlots] = unit_count<CLUSTER>(p);
          mbar_arrive(&slots.posted[e % kTileSlots]);
        }
    }
    if constexpr (CLUSTER > 1) cluster_sync();   // no CTA exits while its peer may still write into it
    return;
  }

  setmaxnreg_inc<kPingPongConsumerRegs>();
  const int c = wg - 1;
  const bool leader = threadIdx.x % 128 == 0;
  // The CTA's i-th unit: first_unit + i unit_stride, or the dynamic schedule's slot (waited for; a phase's parity is
  // unambiguous because the producer is never a whole ring of slots ahead of the reader).
  const auto unit_at = [&](int i) -> int {
    if (!dynamic) return static_cast<int>(first_unit<CLUSTER>() + i * unit_stride<CLUSTER>());
    mbar_wait(&slots.posted[i % kTileSlots], (i / kTileSlots) & 1);
    return slots.tile[i % kTileSlots];
  };
  // The next unit's mainloop may begin once this one has issued its last wgmma, not once they are done, so that the
  // tensor cores run the two consumers' wgmmas back to back (p.late_order_signal, a timing hook: once they are done).
  // Every full wait of this unit has passed, so the other consumer's full waits stay within one phase.
  const auto signal_next = [&](int i) {
    if (unit_at(i + 1) < unit_count<CLUSTER>(p)) named_bar_arrive<256>(kOrderBar + (1 - c));
  };
  // the CTA's units i = c, c + 2, ...: their K blocks from seq = i k_blocks(p) of the ring's sequence
  for (int i = c;; i += 2) {
    const int u = unit_at(i);
    if (u >= unit_count<CLUSTER>(p)) break;
    const int seq = i * k_blocks(p);
    int mu, ntile;
    tile_coords(u, m_units<CLUSTER>(p), p.num_n, mu, ntile);
    const int m0 = (CLUSTER * mu + cluster_rank<CLUSTER>()) * C::BM, n0 = ntile * C::BN;
    float acc0[C::HALF_ACC], acc1[C::HALF_ACC];
#pragma unroll
    for (int k = 0; k < C::HALF_ACC; ++k) acc0[k] = acc1[k] = 0.0f;
    // the other consumer has issued every wgmma of unit i - 1 (they may still run: these queue behind them)
    if (i > 0) named_bar_sync<256>(kOrderBar + c);
    if constexpr (CLUSTER > 1) {
      if (m0 >= p.n_rows) {
        // a tile beyond the rows (odd num_m): each stage is waited for (its bytes keep the barrier's count) and
        // released, nothing is computed
        for (int kb = 0; kb < k_blocks(p); ++kb) {
          const int q = seq + kb, s = q % C::STAGES;
          mbar_wait(&full[s], (q / C::STAGES) & 1);
          if (leader) release_stage<CLUSTER>(&empty[s]);
        }
        signal_next(i);
        continue;
      }
    }
    for (int kb = 0; kb < k_blocks(p); ++kb) {
      const int q = seq + kb, s = q % C::STAGES;
      mbar_wait(&full[s], (q / C::STAGES) & 1);
      const uint8_t* a = smem + s * C::STAGE_BYTES;
      const uint64_t da0 = smem_desc(a), da1 = smem_desc(a + 64 * (kBK * 2)), db = smem_desc(a + C::A_BYTES);
      reg_fence<C::HALF_ACC>(acc0);
      reg_fence<C::HALF_ACC>(acc1);
      wgmma_fence();
      // ascending k16 groups; +32 bytes along the swizzled 128-byte row is +2 in descriptor units
#pragma unroll
      for (int g = 0; g < kGroupsPerStage; ++g) {
        wgmma_m64n192k16(acc0, da0 + 2 * g, db + 2 * g);
        wgmma_m64n192k16(acc1, da1 + 2 * g, db + 2 * g);
      }
      wgmma_commit();
      // keep this stage's batch in flight; the previous one is done: release its stage
      wgmma_wait<1>();
      reg_fence<C::HALF_ACC>(acc0);
      reg_fence<C::HALF_ACC>(acc1);
      if (kb > 0 && leader) release_stage<CLUSTER>(&empty[(q - 1) % C::STAGES]);
    }
    if (!p.late_order_signal) signal_next(i);
    wgmma_wait<0>();
    reg_fence<C::HALF_ACC>(acc0);
    reg_fence<C::HALF_ACC>(acc1);
    if (leader) release_stage<CLUSTER>(&empty[(seq + k_blocks(p) - 1) % C::STAGES]);
    if (p.late_order_signal) signal_next(i);

    epi(acc0, acc1, m0, n0);
  }
  if constexpr (CLUSTER > 1) cluster_sync();
}

// The forward: statistics (and, LOGITS, the logits) of each tile, a 64-row half at a time.
template <bool LOGITS, int CLUSTER = 1>
__global__ void __launch_bounds__(kThreads, 1)
pingpong_kernel(const __grid_constant__ CUtensorMap map_h, const __grid_constant__ CUtensorMap map_w,
                const FusedParams p) {
  using C = PingPongCfg;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + C::STAGES * C::STAGE_BYTES);
  pingpong_schedule<CLUSTER>(smem, full, full + C::STAGES, &map_h, &map_w, p,
                             [&](float(&acc0)[C::HALF_ACC], float(&acc1)[C::HALF_ACC], int m0, int n0) {
                               if (p.skip_epilogue) {   // timing hook: the mainloop alone
                                 store_mainloop_sums(acc0, acc1, p, m0, n0, true);
                                 return;
                               }
                               // (a half whose rows are all beyond n_rows computes nothing: wg_reg_stats returns
                               // at once)
                               half_epilogue<LOGITS>(acc0, p, m0, n0);
                               half_epilogue<LOGITS>(acc1, p, m0 + 64, n0);
                             });
}

}  // namespace sm90
