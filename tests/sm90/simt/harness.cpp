// Entry points (C ABI, for ctypes) that run the SM90 kernels' device functions under the SIMT emulation of simt.h:
// the forward statistics epilogue of every configuration and the backward's dz epilogue of both dz configurations
// from accumulators placed in the wgmma register layout, and the row merge. tests/sm90/test_simt_device_code.py builds this file with g++ and checks the bytes against
// the numpy oracle.
#define FUSED_LOGP_SIMT 1
#include "simt.h"

#include "dz_epilogue.cuh"
#include "logits_stats.cuh"
#include "pingpong_kernel.cuh"
#include "row_merge.cuh"
#include "stats_epilogue.cuh"
#include "swap_kernel.cuh"

namespace {

using sm90::FusedParams;

// The accumulators of thread t of a warpgroup (warp w = (t % 128) / 32, lane l = t % 32) for a 64-row tile's columns
// col0 + [0, n): acc[4 j + 2 h + e] = z[row][col] with row = row0 + 16 w + l / 4 + 8 h and
// col = col0 + 8 j + 2 (l % 4) + e; +0 beyond the rows and columns of z (what the zero-filled TMA tiles give the wgmma).
// mislaid (a negative control for the tests): the two rows of a thread exchanged, h -> 1 - h.
int g_mislaid = 0;

void place(float* acc, int n, unsigned t, const float* z, int n_rows, int n_real, int row0, int col0) {
  const int w = static_cast<int>(t % 128) / 32, l = static_cast<int>(t % 32);
  for (int j = 0; j < n / 8; ++j)
    for (int h = 0; h < 2; ++h)
      for (int e = 0; e < 2; ++e) {
        const int row = row0 + 16 * w + l / 4 + 8 * h, col = col0 + 8 * j + 2 * (l % 4) + e;
        acc[4 * j + 2 * (g_mislaid ? 1 - h : h) + e] =
            (row < n_rows && col < n_real) ? z[static_cast<long long>(row) * n_real + col] : 0.0f;
      }
}

FusedParams params(int n_rows, int n_real, long long vocab_start, const int64_t* targets, const float* temperature,
                   const float* bias, float* tile_max, float* tile_sum, float* target_logit, float* logits) {
  FusedParams p{};
  p.n_rows = n_rows;
  p.n_real = n_real;
  p.nt = (n_real + sm90::kTile - 1) / sm90::kTile;
  p.vocab_start = vocab_start;
  p.targets = targets;
  p.temperature = temperature;
  p.bias = bias;
  p.tile_max = tile_max;
  p.tile_sum = tile_sum;
  p.target_logit = target_logit;
  p.logits = logits;
  return p;
}

template <int WGN>
void cta_tiles(const float* z, const FusedParams& p) {
  simt::Block block(128);
  for (int row0 = 0; row0 < p.n_rows; row0 += 64)
    for (int col0 = 0; col0 < p.n_real; col0 += WGN)
      block.run([&](unsigned t) {
        float acc[WGN / 2];
        place(acc, WGN, t, z, p.n_rows, p.n_real, row0, col0);
        sm90::wg_reg_stats<WGN>(acc, p, row0, col0);
      });
}

// Every 128 x 192 tile of the ping-pong kernel, one warpgroup: its two 64-row halves' accumulators placed, then
// half(acc, row0, n0) for each half, as the kernel's epilogue calls them.
template <class Half>
void pingpong_halves(const float* z, const FusedParams& p, Half&& half) {
  using C = sm90::PingPongCfg;
  simt::Block block(128);
  for (int m0 = 0; m0 < p.n_rows; m0 += C::BM)
    for (int n0 = 0; n0 < p.n_real; n0 += C::BN)
      block.run([&](unsigned t) {
        float acc0[C::HALF_ACC], acc1[C::HALF_ACC];
        place(acc0, C::BN, t, z, p.n_rows, p.n_real, m0, n0);
        place(acc1, C::BN, t, z, p.n_rows, p.n_real, m0 + 64, n0);
        half(acc0, m0, n0);
        half(acc1, m0 + 64, n0);
      });
}

template <bool LOGITS>
void pingpong_tiles(const float* z, const FusedParams& p) {
  pingpong_halves(z, p, [&](float(&acc)[sm90::PingPongCfg::HALF_ACC], int row0, int n0) {
    sm90::half_epilogue<LOGITS>(acc, p, row0, n0);
  });
}

// swapab-128 (swap_kernel.cuh): per CTA (row tile n0 of NR rows, weight rows vbase + [0, 128)), warp 1's row inputs
// (swap_cta_init, one warp), then each consumer warpgroup's epilogue on its accumulators in the swapped layout
// acc[4 j + 2 h + e] = z[n0 + 8 j + 2 q + e][v0 + 16 w + 8 h + g], +0 beyond the rows and columns of z. mislaid: the
// thread's two batch rows exchanged, e -> 1 - e (its two vocabulary lanes h exchanged would leave every statistic
// equal: they meet at one addition of the tree).
template <int NR, bool LOGITS>
void swap_tiles(const float* z, const FusedParams& p) {
  simt::Block warp(32), block(128);
  static sm90::SwapRows rows;
  static sm90::SwapScratch<NR> sc;
  for (int vbase = 0; vbase < p.n_real; vbase += sm90::kSwapBV)
    for (int n0 = 0; n0 < p.n_rows; n0 += NR) {
      warp.run([&](unsigned) { sm90::swap_cta_init<NR>(p, n0, vbase, &rows); });
      for (int c = 0; c < 2; ++c) {
        const int v0 = vbase + 64 * c;
        if (v0 >= p.n_real) continue;
        block.run([&](unsigned t) {
          const int w = static_cast<int>(t % 128) / 32, l = static_cast<int>(t % 32);
          float acc[NR / 2];
          for (int j = 0; j < NR / 8; ++j)
            for (int h = 0; h < 2; ++h)
              for (int e = 0; e < 2; ++e) {
                const int row = n0 + 8 * j + 2 * (l % 4) + e, col = v0 + 16 * w + 8 * h + l / 4;
                acc[4 * j + 2 * h + (g_mislaid ? 1 - e : e)] =
                    (row < p.n_rows && col < p.n_real) ? z[static_cast<long long>(row) * p.n_real + col] : 0.0f;
              }
          sm90::swap_epilogue<NR, LOGITS>(acc, p, rows, v0, 64 * c, n0, sc, sm90::kSwapEpiBar + c);
        });
      }
    }
}

// swapab-128 with the row tile its launch takes (swap_row_tile, as sm90_swapab_128.cu launch_swap).
template <bool LOGITS>
void swap_launch(const float* z, const FusedParams& p) {
  switch (sm90::swap_row_tile(p.n_rows) / 32) {
    case 1: return swap_tiles<32, LOGITS>(z, p);
    case 2: return swap_tiles<64, LOGITS>(z, p);
    case 3: return swap_tiles<96, LOGITS>(z, p);
    case 4: return swap_tiles<128, LOGITS>(z, p);
    case 5: return swap_tiles<160, LOGITS>(z, p);
    case 6: return swap_tiles<192, LOGITS>(z, p);
    case 7: return swap_tiles<224, LOGITS>(z, p);
    default: return swap_tiles<256, LOGITS>(z, p);
  }
}

// The backward's dz (dz_epilogue.cuh) of z [n_rows, n_real] into out through a tensor map of `width` columns (the
// TMA store's clip), from accumulators in the wgmma layout (+0 beyond z, as the zero-filled TMA tiles give): the CTA
// kernel's (cta-128x256: wg_dz_epilogue<256> per 64 x 256 warpgroup tile, its rows' factors loaded first) or the
// ping-pong kernel's (pingpong-128x192: half_dz_epilogue<192> for each 64-row half of a 128 x 192 tile, one 8 KB
// buffer reused slice by slice). The staging buffer is the shared window.
alignas(1024) uint8_t g_stage[4 * 8192];

void dz_tiles(int config, const float* z, const FusedParams& p, const CUtensorMap* map) {
  simt::shared_base = g_stage;
  if (config == 0) {
    simt::Block block(128);
    for (int row0 = 0; row0 < p.n_rows; row0 += 64)
      for (int col0 = 0; col0 < p.n_real; col0 += 256)
        block.run([&](unsigned t) {
          float acc[128];
          place(acc, 256, t, z, p.n_rows, p.n_real, row0, col0);
          const sm90::DzRows r = sm90::load_dz_rows(p, sm90::thread_row_base(row0));
          sm90::wg_dz_epilogue<256>(acc, p, row0, col0, r, g_stage, map, 2);
        });
    return;
  }
  pingpong_halves(z, p, [&](float(&acc)[sm90::PingPongCfg::HALF_ACC], int row0, int n0) {
    sm90::half_dz_epilogue<sm90::PingPongCfg::BN>(acc, p, row0, n0, sm90::smem_u32(g_stage), map, 2);
  });
}

template <int THREADS>
int row_lse(const float* tile_max, const float* tile_sum, int n_rows, int n_tiles, float* lse) {
  simt::Block block(THREADS);
  float buf[sm90::RowMerge<THREADS>::kBufFloats], red[THREADS / 32];
  for (int r = 0; r < n_rows; ++r) {
    simt::block_idx.x = r;
    const long long off = static_cast<long long>(r) * n_tiles;
    block.run([&](unsigned t) {
      const float l = sm90::block_row_lse<THREADS>(tile_max + off, tile_sum + off, n_tiles, buf, red);
      if (t == 0) lse[r] = l;
    });
  }
  return 0;
}

}  // namespace

extern "C" {

// Statistics from FP32 logits [n_rows, ld] (warp_logits_tile_stats), one warp per (row, tile) item.
void simt_logits_stats(const float* logits, long long ld, const int64_t* targets, const float* temperature,
                       int n_rows, int vocab_size, float* tile_max, float* tile_sum, float* target_logit) {
  const int nt = (vocab_size + sm90::kTile - 1) / sm90::kTile;
  simt::Block warp(32);
  for (long long item = 0; item < static_cast<long long>(n_rows) * nt; ++item)
    warp.run([&](unsigned) {
      sm90::warp_logits_tile_stats(logits, ld, targets, temperature, n_rows, vocab_size, nt, tile_max, tile_sum,
                                   target_logit, item);
    });
}

void simt_set_ex2_table(const uint32_t* table) { simt::ex2_table = table; }

// 1: place the accumulators with each thread's two rows exchanged (a layout error), 0: as the wgmma does.
void simt_set_mislaid(int on) { g_mislaid = on; }

float simt_ex2(float x) { return simt::ex2_model(x); }

// The forward statistics of z [n_rows, n_real] (fp32 GEMM logits without the bias), every tile of the launch
// configuration `config`: 0 cta-128x256 (consumer tiles 64 x 256), 1 cta-64x256 (64 x 128), 2 cta-64x128 (64 x 64),
// 3 pingpong-128x192, 5 swapab-128 (for these two, logits is null or [n_rows, n_real]). -> 0, or -1 for an unknown
// configuration (4 was the 192-row CTA kernel, deleted).
int simt_forward_stats(int config, const float* z, int n_rows, int n_real, long long vocab_start,
                       const int64_t* targets, const float* temperature, const float* bias, float* tile_max,
                       float* tile_sum, float* target_logit, float* logits) {
  const FusedParams p = params(n_rows, n_real, vocab_start, targets, temperature, bias, tile_max, tile_sum,
                               target_logit, config >= 3 ? logits : nullptr);
  switch (config) {
    case 0: cta_tiles<256>(z, p); return 0;
    case 1: cta_tiles<128>(z, p); return 0;
    case 2: cta_tiles<64>(z, p); return 0;
    case 3:
      if (logits != nullptr) pingpong_tiles<true>(z, p);
      else pingpong_tiles<false>(z, p);
      return 0;
    case 5:
      if (logits != nullptr) swap_launch<true>(z, p);
      else swap_launch<false>(z, p);
      return 0;
    default: return -1;
  }
}

// The backward's dz of z [n_rows, n_real] (fp32 GEMM logits without the bias; weight row 0 is vocabulary id
// col_offset) into out (bf16 bits, row stride ld elements) through a tensor map `width` columns wide, by dz
// configuration `config`: 0 cta-128x256, 1 pingpong-128x192. -> 0, or -1 for an unknown configuration.
int simt_backward_dz(int config, const float* z, int n_rows, int n_real, long long col_offset, const int64_t* targets,
                     const float* temperature, const float* bias, const float* lse, const float* coef,
                     const float* g_logp, uint16_t* out, long long ld, long long width) {
  if (config != 0 && config != 1) return -1;
  FusedParams p = params(n_rows, n_real, col_offset, targets, temperature, bias, nullptr, nullptr, nullptr, nullptr);
  p.lse = lse;
  p.coef = coef;
  p.g_logp = g_logp;
  CUtensorMap map{};
  map.opaque[0] = reinterpret_cast<unsigned long long>(out);
  map.opaque[1] = static_cast<unsigned long long>(ld);
  map.opaque[2] = static_cast<unsigned long long>(n_rows);
  map.opaque[3] = static_cast<unsigned long long>(width);
  dz_tiles(config, z, p, &map);
  return 0;
}

// lse [n_rows] of the statistics tile_max, tile_sum [n_rows, n_tiles] (row stride n_tiles) by block_row_lse, one
// block of `threads` (64 or 256) a row. -> 0, or -1 for another block size.
int simt_row_lse(int threads, const float* tile_max, const float* tile_sum, int n_rows, int n_tiles, float* lse) {
  if (threads == 64) return row_lse<64>(tile_max, tile_sum, n_rows, n_tiles, lse);
  if (threads == 256) return row_lse<256>(tile_max, tile_sum, n_rows, n_tiles, lse);
  return -1;
}

}  // extern "C"
