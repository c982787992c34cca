// The SM90 kernels' device code run on the CPU, for tests: a single-threaded SIMT emulation of one thread block
// (ucontext fibers, one per CUDA thread, switched only at warp and block synchronisation points) and the CUDA
// intrinsics those device functions use, each as the IEEE binary32 operation it is (built with
// -ffp-contract=off, no fast-math). Two PTX instructions have no C++ spelling: with FUSED_LOGP_SIMT defined,
// contract_math.cuh, stats_epilogue.cuh and dz_epilogue.cuh call simt::ex2_model (the instruction's exact model,
// CONTRACT.md section 6, from the shipped table) and simt::max_nan (max.NaN.f32) instead of their inline PTX; the
// dz epilogue's shared-window stores and TMA stores (ptx.cuh) run as simt::st_shared_b32 and
// simt::tma_store_box_bf16, its proxy fence and bulk-group waits as nothing (the emulated store is complete when it
// returns).
//
// What it runs: __device__ functions (the statistics epilogues, the dz epilogues, the row merge), never a kernel that
// uses wgmma, TMA loads or mbarriers (a named barrier runs as the block's barrier); the harness places each thread's accumulators in the wgmma register layout
// itself. Warp-wide operations require all 32 lanes (full mask, as every caller passes); a lane that would wait
// forever (a barrier some thread never reaches) aborts the run with a message instead of hanging.
#pragma once
#ifndef FUSED_LOGP_SIMT
#error "define FUSED_LOGP_SIMT before including simt.h"
#endif

#include <ucontext.h>

#include "cuda.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

struct float2 {
  float x, y;
};
struct float4 {
  float x, y, z, w;
};
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline int __float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, 4);
  return i;
}
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
using std::isfinite;
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
// The shared-memory window: smem_u32 (cvta to the shared window) gives the offset of a pointer from
// simt::shared_base, which the harness points at its staging buffer; the shared-window accesses (ptx.cuh under
// FUSED_LOGP_SIMT) add it back.
namespace simt {
inline uint8_t* shared_base = nullptr;
}
inline size_t __cvta_generic_to_shared(const void* p) {
  return static_cast<size_t>(reinterpret_cast<const uint8_t*>(p) - simt::shared_base);
}
template <typename T>
inline void __stcs(T* p, T v) { *p = v; }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  const unsigned long long old = *p;
  *p = old + v;
  return old;
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old + v;
  return old;
}
inline void __threadfence() {}
inline void __threadfence_system() {}

namespace simt {

struct Dim {
  unsigned x = 1, y = 1, z = 1;
};

// The table of CONTRACT.md section 6, T[j] = ex2.approx.ftz.f32(-j 2^-23), j = 0 .. 2^23: set by the harness.
inline const uint32_t* ex2_table = nullptr;

// ex2.approx.ftz.f32 for x <= 0 (and +-0, x < 2^-23): k = floor(-x), j = floor(frac(-x) 2^23), T[j] 2^-k, flushed
// to +0 below 2^-126; -inf gives +0, NaN stays NaN. The device code never forms a larger argument.
inline float ex2_model(float x) {
  if (x != x) return x;
  const float a = x > 0.0f ? 0.0f : -x;
  if (!(a < 160.0f)) return 0.0f;
  const float k = std::floor(a);
  const uint32_t entry = ex2_table[static_cast<int>((a - k) * 8388608.0f)];
  const int field = static_cast<int>(entry >> 23);
  return field > static_cast<int>(k) ? __int_as_float(static_cast<int>(entry - (static_cast<uint32_t>(k) << 23)))
                                     : 0.0f;
}

// st.shared.b32 at a shared-window address.
inline void st_shared_b32(uint32_t addr, uint32_t v) { std::memcpy(shared_base + addr, &v, 4); }

// A TMA store (cp.async.bulk.tensor.2d.global.shared) of one 64 x 64 bf16 box in the 128-byte swizzle (the 16-byte
// chunk q of the box's row r lies at chunk q ^ (r % 8) of that row's 128 bytes in shared memory, src 1024-byte
// aligned), clipped to the tensor. The harness's tensor map holds {data, row stride in elements, rows, columns} in
// its first four words.
inline void tma_store_box_bf16(const CUtensorMap* map, const void* src, int col0, int row0) {
  uint8_t* data = reinterpret_cast<uint8_t*>(map->opaque[0]);
  const long long ld = static_cast<long long>(map->opaque[1]), rows = static_cast<long long>(map->opaque[2]),
                  cols = static_cast<long long>(map->opaque[3]);
  const uint8_t* s = static_cast<const uint8_t*>(src);
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < 64; ++c) {
      const long long row = row0 + r, col = col0 + c;
      if (row < rows && col < cols)
        std::memcpy(data + 2 * (row * ld + col), s + 128 * r + 16 * (((2 * c) / 16) ^ (r % 8)) + (2 * c) % 16, 2);
    }
}

// max.NaN.f32: a NaN operand gives the canonical NaN 0x7FFFFFFF; max(-0, +0) = +0.
inline float max_nan(float a, float b) {
  if (a != a || b != b) return __int_as_float(0x7FFFFFFF);
  if (a == 0.0f && b == 0.0f) return std::signbit(a) ? b : a;
  return a > b ? a : b;
}

// One thread block: a fiber per thread, run one at a time; a fiber gives way only where it waits for others.
class Block {
 public:
  explicit Block(unsigned threads) : fibers_(threads), warps_((threads + 31) / 32) {
    if (threads % 32 != 0) fail("a block of whole warps");
  }

  // Runs body(thread index) in every thread of the block, to completion.
  void run(const std::function<void(unsigned)>& body) {
    body_ = &body;
    live_ = static_cast<unsigned>(fibers_.size());
    for (auto& w : warps_) w = Warp{};
    for (unsigned t = 0; t < fibers_.size(); ++t) {
      Fiber& f = fibers_[t];
      f.done = false;
      if (f.stack.size() != kStack) f.stack.resize(kStack);
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack.data();
      f.ctx.uc_stack.ss_size = f.stack.size();
      f.ctx.uc_link = &sched_;
      makecontext(&f.ctx, reinterpret_cast<void (*)()>(&Block::entry), 2, static_cast<unsigned>(t),
                  static_cast<unsigned>(0));
    }
    Block* outer = current_;
    current_ = this;
    unsigned stalled = 0;
    while (live_ > 0) {
      const unsigned long long before = events_;
      for (unsigned t = 0; t < fibers_.size(); ++t) {
        if (fibers_[t].done) continue;
        cur_ = t;
        swapcontext(&sched_, &fibers_[t].ctx);
      }
      stalled = events_ == before ? stalled + 1 : 0;
      if (stalled > 2) fail("every live thread waits at a barrier that some thread never reaches");
    }
    current_ = outer;
  }

  unsigned thread() const { return cur_; }
  static Block& current() {
    if (current_ == nullptr) fail("device code called outside Block::run");
    return *current_;
  }

  // The block's barrier over its live threads (__syncthreads); pred_or: __syncthreads_or.
  int sync(int pred) {
    or_acc_ |= pred != 0;
    ++arrived_;
    ++events_;
    const unsigned long long gen = gen_;
    if (arrived_ == live_) {
      release_block();
    } else {
      while (gen_ == gen) yield();
    }
    return or_result_;
  }

  // Every lane of the calling thread's warp gives `mine` and gets the values of all 32 lanes.
  const uint32_t* exchange(uint32_t mine) {
    Warp& w = warps_[cur_ / 32];
    if (w.live != 32) fail("a warp-wide operation with a lane that has exited (full mask)");
    w.in[cur_ % 32] = mine;
    ++w.arrived;
    ++events_;
    const unsigned long long gen = w.gen;
    if (w.arrived == 32) {
      std::memcpy(w.out, w.in, sizeof(w.in));
      w.arrived = 0;
      ++w.gen;
    } else {
      while (w.gen == gen) yield();
    }
    return w.out;  // valid until this lane's next exchange: no lane can start one before all have left this one
  }

  [[noreturn]] static void fail(const char* what) {
    std::fprintf(stderr, "simt: %s\n", what);
    std::abort();
  }

 private:
  static constexpr size_t kStack = 256 * 1024;
  struct Fiber {
    ucontext_t ctx;
    std::vector<char> stack;
    bool done = true;
  };
  struct Warp {
    uint32_t in[32] = {}, out[32] = {};
    unsigned arrived = 0, live = 32;
    unsigned long long gen = 0;
  };

  static void entry(unsigned t, unsigned) {
    Block& b = *current_;
    (*b.body_)(t);
    b.fibers_[t].done = true;
    --b.warps_[t / 32].live;
    --b.live_;
    ++b.events_;
    if (b.live_ > 0 && b.arrived_ == b.live_) b.release_block();   // exited threads count as arrived
  }
  void release_block() {
    or_result_ = or_acc_;
    or_acc_ = 0;
    arrived_ = 0;
    ++gen_;
  }
  void yield() { swapcontext(&fibers_[cur_].ctx, &sched_); }

  std::vector<Fiber> fibers_;
  std::vector<Warp> warps_;
  const std::function<void(unsigned)>* body_ = nullptr;
  ucontext_t sched_;
  unsigned cur_ = 0, live_ = 0, arrived_ = 0;
  int or_acc_ = 0, or_result_ = 0;
  unsigned long long gen_ = 0, events_ = 0;
  static inline Block* current_ = nullptr;
};

// blockIdx, gridDim and blockDim: set by the harness for the block it runs.
inline Dim block_idx, grid_dim, block_dim;

}  // namespace simt

// threadIdx.x reads the running fiber's index.
struct SimtThreadIdx {
  struct X {
    operator unsigned() const { return simt::Block::current().thread(); }
  } x;
};
inline SimtThreadIdx threadIdx;
#define blockIdx (simt::block_idx)
#define gridDim (simt::grid_dim)
#define blockDim (simt::block_dim)

// Shuffles of any 4-byte value (float, int, unsigned), bit for bit.
template <typename T>
inline T __shfl_sync(unsigned, T v, int src) {
  static_assert(sizeof(T) == 4, "4-byte shuffles");
  uint32_t mine;
  std::memcpy(&mine, &v, 4);
  const uint32_t* all = simt::Block::current().exchange(mine);
  T r;
  std::memcpy(&r, &all[src % 32], 4);
  return r;
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  return __shfl_sync(mask, v, static_cast<int>((threadIdx.x % 32) ^ lane_mask));
}
inline unsigned __ballot_sync(unsigned, int pred) {
  const uint32_t* all = simt::Block::current().exchange(pred != 0);
  unsigned r = 0;
  for (int l = 0; l < 32; ++l) r |= (all[l] ? 1u : 0u) << l;
  return r;
}
inline bool __any_sync(unsigned m, int pred) { return __ballot_sync(m, pred) != 0; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline bool __all_sync(unsigned m, int pred) { return __ballot_sync(m, pred) == 0xFFFFFFFFu; }
inline void __syncwarp(unsigned = 0xFFFFFFFFu) { simt::Block::current().exchange(0); }
inline void __syncthreads() { simt::Block::current().sync(0); }
inline int __syncthreads_or(int pred) { return simt::Block::current().sync(pred); }
