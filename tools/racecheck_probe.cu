// racecheck_probe: does compute-sanitizer's racecheck see a named barrier of the whole CTA order a producer
// warpgroup's shared-memory reads after two consumer warpgroups' writes? The shape of fused_cta_kernel's staged
// logits handoff (fused_kernels.cuh, kStagedBar), stripped of everything else: 384 threads; warpgroup 0 reads what
// warpgroups 1 and 2 wrote, after `bar.sync 4, 384`; the consumers also read each other's part. Variants (argv[1],
// 0-15), one feature of the kernel a bit: bit 0 the warpgroups' setmaxnreg (producer down to 40 registers,
// consumers up to 232); bit 1 producer thread 0 alone in a spin loop before the barrier (as it issues the TMA
// loads); bit 2 the consumers' own `bar.sync 1, 256` before their stores; bit 3 the mainloop's mbarrier handshake
// (producer thread 0 waits on `empty` and arrives on `full`, one thread of each consumer warpgroup the reverse, 8
// rounds over a 4-slot ring). Each run checks the values it read.
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -lineinfo tools/racecheck_probe.cu -o build/racecheck_probe
//   compute-sanitizer --tool racecheck build/racecheck_probe 0   (and 1 ... 15)
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

constexpr int kVec = 8;   // float4 a consumer thread writes
constexpr int kSlots = 4, kRounds = 8;

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

template <int V>
__global__ void __launch_bounds__(384, 1) probe(float* out) {
  constexpr bool SETMAXNREG = V & 1, DIVERGE = V & 2, CONSUMER_BAR = V & 4, MBAR = V & 8;
  extern __shared__ float4 buf[];   // [kVec][256]
  __shared__ unsigned long long full[kSlots], empty[kSlots];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kSlots; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&full[s])) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 2;" ::"r"(smem_addr(&empty[s])) : "memory");
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
            mbar_arrive(&full[r % kSlots]);
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
    asm volatile("bar.sync 4, 384;" ::: "memory");
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
  if constexpr (MBAR) {
    for (int r = 0; r < kRounds; ++r) {
      mbar_wait(&full[r % kSlots], (r / kSlots) & 1);
      if (threadIdx.x % 128 == 0) mbar_arrive(&empty[r % kSlots]);
    }
  }
  if constexpr (CONSUMER_BAR) asm volatile("bar.sync 1, 256;" ::: "memory");
  for (int j = 0; j < kVec; ++j) buf[j * 256 + t] = make_float4(t, j, 1.0f, 2.0f);
  asm volatile("bar.sync 4, 384;" ::: "memory");
  out[threadIdx.x] = buf[(t + 128) % 256].x;
}

int main(int argc, char** argv) {
  const int variant = argc > 1 ? atoi(argv[1]) : 0;
  float* out = nullptr;
  cudaMalloc(&out, 384 * sizeof(float));
  const int smem = kVec * 256 * sizeof(float4);
  void (*const kernels[16])(float*) = {probe<0>, probe<1>, probe<2>,  probe<3>,  probe<4>,  probe<5>,
                                       probe<6>, probe<7>, probe<8>,  probe<9>,  probe<10>, probe<11>,
                                       probe<12>, probe<13>, probe<14>, probe<15>};
  if (variant < 0 || variant > 15) {
    fprintf(stderr, "racecheck_probe: variant must be in 0..15, got %d\n", variant);
    return 2;
  }
  void (*k)(float*) = kernels[variant];
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  k<<<4, 384, smem>>>(out);
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
  printf("variant %d (setmaxnreg %d, thread 0 apart %d, consumers' bar.sync 1 %d, mbarrier ring %d): %s, %d wrong "
         "values\n", variant, variant & 1, (variant >> 1) & 1, (variant >> 2) & 1, (variant >> 3) & 1,
         cudaGetErrorString(e), bad);
  return (e != cudaSuccess || bad) ? 1 : 0;
}
