// PTX wrappers for sm_90a: shared-memory addresses and accesses, named barriers (sync and arrive), setmaxnreg,
// mbarriers, the async-proxy fence, TMA (bulk tensor) loads and stores, wgmma. The kernels' other inline PTX: the
// contract's NaN-propagating max (stats_epilogue.cuh) and the backward's ex2.approx (dz_epilogue.cuh).
// wgmma A and B come from shared memory through 128B-swizzled K-major descriptors; scale-d is 1: the accumulator
// is an input of every k16 step (it starts at +0.0).
#pragma once
#include <cuda.h>
#include <cstdint>

#include "wgmma.cuh"   // the wgmma wrappers, one per accumulator width (generated: kernel/wgmma_header.py)

namespace sm90 {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- shared memory, accesses by shared-window address ---------------------------------------------------
__device__ __forceinline__ void st_shared_v4(uint32_t addr, float4 v) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}
__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
#ifdef FUSED_LOGP_SIMT   // the device code run on the CPU (tests/sm90/simt): the harness's shared window
  simt::st_shared_b32(addr, v);
#else
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
#endif
}
__device__ __forceinline__ float4 ld_shared_v4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr)
               : "memory");
  return v;
}

// ---- named barriers ---------------------------------------------------------------------------------------
// COUNT threads (whole warps) meet at barrier ID. named_bar_sync: every participant executes this same instruction
// (`bar.sync`, PTX's `barrier.sync.aligned`). named_bar_sync_split: the participants reach the barrier at different
// instructions (e.g. the producer's and the consumers' paths), for which PTX requires the non-aligned `barrier.sync`.
template <int ID, int COUNT>
__device__ __forceinline__ void named_bar_sync() {
  asm volatile("bar.sync %0, %1;" ::"n"(ID), "n"(COUNT) : "memory");
}
template <int ID, int COUNT>
__device__ __forceinline__ void named_bar_sync_split() {
  asm volatile("barrier.sync %0, %1;" ::"n"(ID), "n"(COUNT) : "memory");
}
// named_bar_sync with the barrier ID known at run time
template <int COUNT>
__device__ __forceinline__ void named_bar_sync(int id) {
#ifdef FUSED_LOGP_SIMT   // the device code run on the CPU (tests/sm90/simt): the harness runs the COUNT threads as a block
  (void)id;
  __syncthreads();
#else
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(COUNT) : "memory");
#endif
}

// The signal half of a barrier that one warpgroup waits at with named_bar_sync<COUNT>(id): COUNT threads in all, the
// signalling warps arrive (without waiting), the waiting warps sync.
template <int COUNT>
__device__ __forceinline__ void named_bar_arrive(int id) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(COUNT) : "memory");
}

// ---- warpgroup register reallocation (every warp of the warpgroup executes it) ----------------------------
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
}

// ---- mbarrier --------------------------------------------------------------------------------------------
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
// ---- thread block clusters -------------------------------------------------------------------------------
// This CTA's rank in its cluster.
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Every thread of every CTA of the cluster meets here (release, then acquire, at cluster scope). Not `.aligned`: the
// threads of a warp may reach it from different branches.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
// One arrival on the mbarrier at `bar`'s offset in the shared memory of the cluster's CTA `cta` (this CTA's own
// included). Default semantics (release at CTA scope), no fence at cluster scope: the kernels use it to release a
// stage whose reads (wgmma, the async proxy) have completed, and the peer's producer then writes the stage by TMA.
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(bar)), "r"(cta));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

// This thread's shared-memory writes so far, ordered before later accesses by the async proxy (TMA, wgmma).
__device__ __forceinline__ void fence_proxy_async_shared() {
#ifndef FUSED_LOGP_SIMT   // (tests/sm90/simt: one memory, no proxies)
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
// After mbar_init by one thread, before the barriers are used by other threads or the copy engine.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  fence_proxy_async_shared();
}

// ---- TMA -------------------------------------------------------------------------------------------------
// 2D box of a K-major bf16 matrix into 128B-swizzled shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int k0, int row0) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(k0), "r"(row0)
      : "memory");
}
// The same box, written at dst's offset into the shared memory of every CTA of the cluster in cta_mask, each copy
// completing on the mbarrier at bar's offset in that CTA.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, int k0,
                                                      int row0, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(k0), "r"(row0),
        "h"(cta_mask)
      : "memory");
}
// ---- a ring of shared-memory stages, each a full and an empty mbarrier ------------------------------------
// The barriers' initialisation, by thread 0 (the caller then synchronises the CTA or the cluster): full[s] awaits one
// arrival (the producer's, with the stage's bytes), empty[s] `readers` releases.
template <int STAGES>
__device__ __forceinline__ void init_ring(uint64_t* full, uint64_t* empty, int readers) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], readers);
    }
    mbar_init_fence();
  }
}
// One tile's kblocks K blocks of BK elements through the ring, by one producer thread: stage kb % STAGES holds the box
// of map_a at row_a (its first A_BYTES) and the box of map_b at row_b, once the stage's previous fill is released.
template <int STAGES, int STAGE_BYTES, int A_BYTES, int BK>
__device__ __forceinline__ void load_tile(uint8_t* smem, uint64_t* full, uint64_t* empty, int kblocks,
                                          const CUtensorMap* map_a, int row_a, const CUtensorMap* map_b, int row_b) {
  for (int kb = 0; kb < kblocks; ++kb) {
    const int s = kb % STAGES;
    mbar_wait(&empty[s], ((kb / STAGES) & 1) ^ 1);
    uint8_t* a = smem + s * STAGE_BYTES;
    mbar_expect_tx(&full[s], STAGE_BYTES);
    tma_load_2d(a, map_a, &full[s], kb * BK, row_a);
    tma_load_2d(a + A_BYTES, map_b, &full[s], kb * BK, row_b);
  }
}

// The box at shared-window address src to the tensor at (col0, row0).
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, uint32_t src, int col0, int row0) {
#ifdef FUSED_LOGP_SIMT   // (tests/sm90/simt: the dz epilogues' 64 x 64 bf16 boxes, copied at once)
  simt::tma_store_box_bf16(map, simt::shared_base + src, col0, row0);
#else
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
               ::"l"(reinterpret_cast<uint64_t>(map)), "r"(src), "r"(col0), "r"(row0)
               : "memory");
#endif
}
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int col0, int row0) {
  tma_store_2d(map, smem_u32(src), col0, row0);
}
// The bulk stores issued so far by this thread as one group; then wait until every group has read its shared memory.
#ifdef FUSED_LOGP_SIMT   // (tests/sm90/simt: the emulated store is complete when it returns)
__device__ __forceinline__ void bulk_commit_group() {}
__device__ __forceinline__ void bulk_wait_group_read_all() {}
#else
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_group_read_all() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
#endif

// ---- wgmma -----------------------------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
// Keeps the compiler from moving accumulator reads/writes across the asynchronous wgmma.
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

}  // namespace sm90
