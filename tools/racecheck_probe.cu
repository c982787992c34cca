// racecheck_probe: does compute-sanitizer's racecheck see a named barrier of the whole CTA order a producer
// warpgroup's shared-memory reads after two consumer warpgroups' writes? The shape of fused_cta_kernel's staged
// logits handoff (fused_kernels.cuh, kStagedBar), stripped of everything else: 384 threads; warpgroup 0 reads what
// warpgroups 1 and 2 wrote, after `bar.sync 4, 384`; the consumers also read each other's part. Variants (argv[1]):
// bit 0 the warpgroups' setmaxnreg (producer down to 40 registers, consumers up to 232), bit 1 producer thread 0
// alone in a spin loop before the barrier (as it issues the TMA loads). Each run checks the values it read.
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -lineinfo tools/racecheck_probe.cu -o build/racecheck_probe
//   compute-sanitizer --tool racecheck build/racecheck_probe 0   (and 1, 2, 3)
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

constexpr int kVec = 8;   // float4 a consumer thread writes

template <bool SETMAXNREG, bool DIVERGE>
__global__ void __launch_bounds__(384, 1) probe(float* out) {
  extern __shared__ float4 buf[];   // [kVec][256]
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    if constexpr (SETMAXNREG) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if constexpr (DIVERGE) {
      if (threadIdx.x == 0) {
        const long long t0 = clock64();
        while (clock64() - t0 < 20000) {
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
  for (int j = 0; j < kVec; ++j) buf[j * 256 + t] = make_float4(t, j, 1.0f, 2.0f);
  asm volatile("bar.sync 4, 384;" ::: "memory");
  out[threadIdx.x] = buf[(t + 128) % 256].x;
}

int main(int argc, char** argv) {
  const int variant = argc > 1 ? atoi(argv[1]) : 0;
  float* out = nullptr;
  cudaMalloc(&out, 384 * sizeof(float));
  const int smem = kVec * 256 * sizeof(float4);
  void (*k)(float*) = variant == 0 ? probe<false, false> : variant == 1 ? probe<true, false>
                      : variant == 2 ? probe<false, true> : probe<true, true>;
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
  printf("variant %d (setmaxnreg %d, thread 0 apart %d): %s, %d wrong values\n", variant, variant & 1,
         (variant >> 1) & 1, cudaGetErrorString(e), bad);
  return (e != cudaSuccess || bad) ? 1 : 0;
}
