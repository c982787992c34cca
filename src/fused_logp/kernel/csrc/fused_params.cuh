// The parameters of the fused GEMM kernels (forward statistics and backward dz) and the constants they share.
#pragma once
#include <cstdint>
#include "contract_math.cuh"

static_assert(contract::VOCAB_TILE == 64, "contract: VOCAB_TILE is 64");
static_assert(contract::K_GROUP == 16, "contract: K group is 16 (one wgmma k16 step)");

namespace sm90 {

constexpr int kTile = contract::VOCAB_TILE;
constexpr int kBK = 64;                 // K elements per pipeline stage: 4 ascending k16 groups, 128 B rows
constexpr int kGroupsPerStage = kBK / contract::K_GROUP;
static_assert(kGroupsPerStage * contract::K_GROUP == kBK, "stage holds whole k16 groups");
constexpr int kConsumers = 2;           // consumer warpgroups
constexpr int kThreads = 128 * (kConsumers + 1);   // + the producer warpgroup
// Named barriers (bar.sync ids) of the CTA kernel: 0 the block's, 1 staging may begin (the consumer warpgroups' in
// the backward, the whole CTA's in the forward), 2 and 3 each consumer's dz store (dz_epilogue.cuh), kStagedBar the
// whole CTA's (the staged accumulators are written).
constexpr int kStagedBar = 4;
constexpr int kGroupM = 16;             // grid raster: M tiles per group (L2 reuse of the weight tiles)

// hidden [N, D] and weight [V_rows, D] bf16 reach the kernels as TMA maps. Outputs of the forward: tile_max,
// tile_sum [N, nt] (nt = ceil(n_real / 64)), target_logit [N] (rows whose target lies in this shard only),
// logits [N, n_real] unscaled (optional).
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
  int logits_vec4;    // logits may be written as 16-byte quads (n_real % 4 == 0, 16-byte aligned start)
  int skip_epilogue;  // timing hook only (bench): mainloop without statistics
  int late_order_signal;  // timing hook only (bench): the ping-pong kernels' order signal after the wgmmas complete
  // The persistent ping-pong kernels' tile claims (pingpong_kernel.cuh): null, the static schedule; else a counter
  // that is 0 at the launch, from which each CTA claims its tiles after its first (the dynamic schedule).
  unsigned* tile_counter;
  // Backward (dz_epilogue.cuh): instead of statistics, the logit gradient of every element
  // dz = (coef * exp(z' - lse) + g_logp [column == target]) / T, rounded to bf16, stored through a TMA map.
  const float* lse;
  const float* coef;    // g_lse - g_logp
  const float* g_logp;
};

// Grouped raster over (m tile, n tile): kGroupM consecutive m tiles share each n tile.
__device__ __forceinline__ void tile_coords(int tile, int num_m, int num_n, int& mt, int& nt) {
  const int per_group = kGroupM * num_n;
  const int group = tile / per_group;
  const int first_m = group * kGroupM;
  const int gsz = min(num_m - first_m, kGroupM);
  mt = first_m + (tile % per_group) % gsz;
  nt = (tile % per_group) / gsz;
}

// wgmma accumulator layout of a 64-row warpgroup tile: warp w, lane l holds rows 16w + l/4 and 16w + l/4 + 8,
// columns 8j + 2(l % 4) + e of each 8-column group j; acc[4j + 2h + e] is row 16w + l/4 + 8h.
__device__ __forceinline__ int thread_row_base(int row0) {
  const int tid = threadIdx.x % 128;
  return row0 + 16 * (tid / 32) + (tid % 32) / 4;
}

}  // namespace sm90
