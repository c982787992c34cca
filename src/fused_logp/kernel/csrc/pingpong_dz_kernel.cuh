// The backward's dz kernel on the persistent ping-pong schedule (pingpong_kernel.cuh pingpong_schedule): backward_dz's
// launch pingpong-128x192 (sm90_backward.cu).
#pragma once
#include "dz_epilogue.cuh"
#include "pingpong_kernel.cuh"

namespace sm90 {

// Each consumer warpgroup stores its tile's dz (half_dz_epilogue, dz_epilogue.cuh) one 64 x 64 slice at a time
// through an 8 KB buffer of its own after the ring (named barrier kDzBar + c), by TMA through map_o, while the other
// consumer's mainloop runs; its first thread waits for its last store's read before it exits. The same accumulators and the same element-wise arithmetic (dz_pair) as the CTA kernel's
// dz: the same bytes.
constexpr int kDzBar = 2;               // kDzBar + c: consumer c's slice buffer (ids 2 and 3; kOrderBar is 5 and 6)
constexpr int kDzSliceBytes = kTile * kTile * 2;
constexpr int kPingPongDzSmem = PingPongCfg::STAGES * PingPongCfg::STAGE_BYTES + kConsumers * kDzSliceBytes +
                                1024 /*align*/ + 256 /*barriers*/;
static_assert(kPingPongDzSmem <= 227 * 1024, "the ring and the slice buffers fit in an SM's shared memory");
static_assert(kDzBar + kConsumers <= kOrderBar, "named barriers");

__global__ void __launch_bounds__(kThreads, 1)
pingpong_dz_kernel(const __grid_constant__ CUtensorMap map_h, const __grid_constant__ CUtensorMap map_w,
                   const __grid_constant__ CUtensorMap map_o, const FusedParams p) {
  using C = PingPongCfg;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* slices = smem + C::STAGES * C::STAGE_BYTES;      // 1024-byte aligned (the 128-byte swizzle's period)
  uint64_t* full = reinterpret_cast<uint64_t*>(slices + kConsumers * kDzSliceBytes);
  pingpong_schedule<1>(smem, full, full + C::STAGES, &map_h, &map_w, p,
                       [&](float(&acc0)[C::HALF_ACC], float(&acc1)[C::HALF_ACC], int m0, int n0) {
                         const int c = threadIdx.x / 128 - 1;
                         const uint32_t stage = smem_u32(slices) + c * kDzSliceBytes;
                         half_dz_epilogue<C::BN>(acc0, p, m0, n0, stage, &map_o, kDzBar + c);
                         half_dz_epilogue<C::BN>(acc1, p, m0 + 64, n0, stage, &map_o, kDzBar + c);
                       });
  bulk_wait_group_read_all();   // the last slice's store has read its buffer (a thread without stores: no wait)
}

}  // namespace sm90
