// racecheck_probe: does compute-sanitizer's racecheck see a named barrier of the whole CTA order a producer
// warpgroup's shared-memory reads after two consumer warpgroups' writes? The shape of fused_cta_kernel's staged
// logits handoff (cta_kernel.cuh, kStagedBar), stripped of everything else: 384 threads; warpgroup 0 reads what
// warpgroups 1 and 2 wrote, after `bar.sync 4, 384`; the consumers also read each other's part. Variants (argv[1],
// 0-127), one feature of the kernel a bit: bit 0 the warpgroups' setmaxnreg (producer down to 40 registers,
// consumers up to 232); bit 1 producer thread 0 alone in a spin loop before the barrier (as it issues the TMA
// loads); bit 2 the consumers' own `bar.sync 1, 256` before their stores; bit 3 the mainloop's mbarrier handshake
// (producer thread 0 waits on `empty` and arrives on `full`, one thread of each consumer warpgroup the reverse, 8
// rounds over a 4-slot ring); bit 4 that ring also fills each slot of the same shared bytes with a bulk copy from
// global memory (as the TMA loads do; implies bit 3), which the consumers read before their stores (as wgmma does).
// Bit 5: the handoff barrier is PTX's non-aligned `barrier.sync 4, 384` (the producer and the consumers reach it at
// different instructions, which `bar.sync`, i.e. `barrier.sync.aligned`, does not allow). Bit 6: barrier 1 is the
// whole CTA's instead (`barrier.sync 1, 384`: the producer warpgroup joins the consumers' barrier before their
// stores). Each run checks the values it read.
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -lineinfo tools/racecheck_probe.cu -o build/racecheck_probe
//   compute-sanitizer --tool racecheck build/racecheck_probe 0   (and 1 ... 127)
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#include <utility>

constexpr int kVec = 8;   // float4 a consumer thread writes
constexpr int kSlots = 4, kRounds = 8;
constexpr int kSlotVec = kVec * 256 / kSlots;   // float4 a slot

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  unsigned done = 0;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
  } while (!done);
}

// the handoff barrier of the whole CTA, reached by the producer and the consumers at different instructions
template <bool SPLIT>
__device__ __forceinline__ void handoff() {
  if constexpr (SPLIT) {
    asm volatile("barrier.sync 4, 384;" ::: "memory");
  } else {
    asm volatile("bar.sync 4, 384;" ::: "memory");
  }
}

template <int V>
__global__ void __launch_bounds__(384, 1) probe(float* out, const float4* src) {
  constexpr bool SETMAXNREG = V & 1, DIVERGE = V & 2, CONSUMER_BAR = V & 4, MBAR = V & 24, BULK = V & 16;
  constexpr bool SPLIT = V & 32, WHOLE_BAR1 = V & 64;
  extern __shared__ float4 buf[];   // [kVec][256]
  __shared__ unsigned long long full[kSlots], empty[kSlots];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kSlots; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&full[s])) : "memory");
      // without the bulk copies one thread of each consumer warpgroup releases a slot (as the kernel does after its
      // wgmma wait); with them every consumer thread releases it after its own reads
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(&empty[s])), "n"(BULK ? 256 : 2)
                   : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    if constexpr (SETMAXNREG) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if constexpr (DIVERGE || MBAR) {
      if (threadIdx.x == 0) {
        if constexpr (MBAR) {
          for (int r = 0; r < kRounds; ++r) {
            mbar_wait(&empty[r % kSlots], ((r / kSlots) & 1) ^ 1);
            if constexpr (BULK) {
              constexpr unsigned bytes = kSlotVec * sizeof(float4);
              const unsigned bar = smem_addr(&full[r % kSlots]);
              asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "n"(bytes) : "memory");
              asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                           ::"r"(smem_addr(buf + (r % kSlots) * kSlotVec)), "l"(src + (r % kSlots) * kSlotVec),
                           "n"(bytes), "r"(bar) : "memory");
            } else {
              mbar_arrive(&full[r % kSlots]);
            }
          }
        }
        if constexpr (DIVERGE) {
          const long long t0 = clock64();
          while (clock64() - t0 < 20000) {
          }
        }
      }
      __syncwarp();
    }
    if constexpr (WHOLE_BAR1) asm volatile("barrier.sync 1, 384;" ::: "memory");
    handoff<SPLIT>();
    float s = 0.0f;
    for (int i = threadIdx.x; i < kVec * 256; i += 128) {
      const float4 v = buf[i];
      s += v.x + v.y + v.z + v.w;
    }
    out[threadIdx.x] = s;
    return;
  }
  if constexpr (SETMAXNREG) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int t = threadIdx.x - 128;
  float seen = 0.0f;   // the bulk-copied bytes read (src is zeros)
  if constexpr (MBAR) {
    for (int r = 0; r < kRounds; ++r) {
      mbar_wait(&full[r % kSlots], (r / kSlots) & 1);
      if constexpr (BULK) {
        seen += buf[(r % kSlots) * kSlotVec + t].x + buf[(r % kSlots) * kSlotVec + 256 + t].y;
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // the reads before the next bulk copy
        mbar_arrive(&empty[r % kSlots]);
      } else if (threadIdx.x % 128 == 0) {
        mbar_arrive(&empty[r % kSlots]);
      }
    }
  }
  if constexpr (WHOLE_BAR1) {
    asm volatile("barrier.sync 1, 384;" ::: "memory");
  } else if constexpr (CONSUMER_BAR) {
    asm volatile("bar.sync 1, 256;" ::: "memory");
  }
  for (int j = 0; j < kVec; ++j) buf[j * 256 + t] = make_float4(t, j, 1.0f, 2.0f);
  handoff<SPLIT>();
  out[threadIdx.x] = buf[(t + 128) % 256].x + seen;
}

constexpr int kVariants = 128;
using Kernel = void (*)(float*, const float4*);
template <int... I>
constexpr std::array<Kernel, sizeof...(I)> kernel_table(std::integer_sequence<int, I...>) {
  return {probe<I>...};
}

int main(int argc, char** argv) {
  const int variant = argc > 1 ? atoi(argv[1]) : 0;
  float* out = nullptr;
  float4* src = nullptr;
  cudaMalloc(&out, 384 * sizeof(float));
  cudaMalloc(&src, kVec * 256 * sizeof(float4));
  cudaMemset(src, 0, kVec * 256 * sizeof(float4));
  const int smem = kVec * 256 * sizeof(float4);
  constexpr auto kernels = kernel_table(std::make_integer_sequence<int, kVariants>{});
  if (variant < 0 || variant >= kVariants) {
    fprintf(stderr, "racecheck_probe: variant must be in 0..%d, got %d\n", kVariants - 1, variant);
    return 2;
  }
  const Kernel k = kernels[variant];
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  k<<<4, 384, smem>>>(out, src);
  float h[384];
  cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost);
  const cudaError_t e = cudaGetLastError();
  int bad = 0;
  for (int i = 0; i < 128; ++i) {   // producer thread i summed float4 i, i + 128, ... of kVec * 256
    float want = 0.0f;
    for (int q = i; q < kVec * 256; q += 128) want += (q % 256) + (q / 256) + 3.0f;
    bad += h[i] != want;
  }
  for (int t = 0; t < 256; ++t) bad += h[128 + t] != static_cast<float>((t + 128) % 256);
  printf("variant %d (setmaxnreg %d, thread 0 apart %d, consumers' bar.sync 1 %d, mbarrier ring %d, bulk copies %d, "
         "barrier.sync %d, barrier 1 whole CTA %d): %s, %d wrong values\n", variant, variant & 1, (variant >> 1) & 1,
         (variant >> 2) & 1, (variant & 24) != 0, (variant >> 4) & 1, (variant >> 5) & 1, (variant >> 6) & 1,
         cudaGetErrorString(e), bad);
  return (e != cudaSuccess || bad) ? 1 : 0;
}
