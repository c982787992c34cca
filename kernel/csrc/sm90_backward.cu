// Backward of linear_logp: the elementwise step between the recompute GEMM and the two gradient GEMMs.
//
// Gradient bytes are not part of the contract, but they are deterministic (no atomics, no reductions here).
// For one vocabulary chunk of recomputed FP32 logits z [N, C] (unscaled, row n's chunk column c is vocabulary
// id col_offset + c):
//   z'  = __fdiv_rn(z + b, T)               the forward's scaling
//   p   = contract_exp(z' - lse)            the forward's exp
//   dz' = coef * p (+ g_logp where id == target)          coef = g_lse - g_logp
//   dz  = dz' / T, rounded once to bf16: the operand of dh = dz W and dW = dz^T h (FP32 accumulation).
// One pass over the chunk: read 4 bytes, write 2 bytes per element.
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "contract_math.cuh"

namespace sm90 {
namespace {

constexpr int kDzThreads = 256;
constexpr int kDzVec = 8;   // columns per thread: two 16-byte loads, one 16-byte store

// T == 1 skips both divisions (exact: x / 1 == x); the branch is uniform over a row.
__device__ __forceinline__ float dz_value(float z, float b, float T, float lse, float coef, float gl, bool is_target) {
  float zs = __fadd_rn(z, b);
  if (T != 1.0f) zs = __fdiv_rn(zs, T);
  const float p = contract::contract_exp(__fsub_rn(zs, lse));
  float d = __fmul_rn(coef, p);
  if (is_target) d = __fadd_rn(d, gl);
  return (T != 1.0f) ? __fdiv_rn(d, T) : d;
}

// grid.x = rows, grid.y = column blocks of kDzThreads * kDzVec
__global__ void __launch_bounds__(kDzThreads)
dz_kernel(const float* __restrict__ z, long long ldz, int n_cols, const float* __restrict__ bias,
          const float* __restrict__ temperature, const float* __restrict__ lse, const float* __restrict__ coef,
          const float* __restrict__ g_logp, const int64_t* __restrict__ targets, long long col_offset,
          __nv_bfloat16* __restrict__ out, long long ldo, int vec) {
  const long long row = blockIdx.x;
  const int c0 = (blockIdx.y * kDzThreads + threadIdx.x) * kDzVec;
  if (c0 >= n_cols) return;
  const float T = temperature[row], l = lse[row], cf = coef[row], gl = g_logp[row];
  const long long tcol = targets[row] - col_offset;   // chunk column of the target (any value if elsewhere)
  const float* zr = z + row * ldz;
  __nv_bfloat16* o = out + row * ldo;
  if (vec && c0 + kDzVec <= n_cols) {
    const float4 a = *reinterpret_cast<const float4*>(zr + c0);
    const float4 b = *reinterpret_cast<const float4*>(zr + c0 + 4);
    const float v[kDzVec] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    __nv_bfloat162 r[kDzVec / 2];
#pragma unroll
    for (int k = 0; k < kDzVec; k += 2) {
      const float bb0 = bias != nullptr ? bias[c0 + k] : 0.0f;
      const float bb1 = bias != nullptr ? bias[c0 + k + 1] : 0.0f;
      const float d0 = dz_value(v[k], bb0, T, l, cf, gl, tcol == c0 + k);
      const float d1 = dz_value(v[k + 1], bb1, T, l, cf, gl, tcol == c0 + k + 1);
      r[k / 2] = __floats2bfloat162_rn(d0, d1);
    }
    *reinterpret_cast<uint4*>(o + c0) = *reinterpret_cast<const uint4*>(r);
  } else {
    for (int k = 0; k < kDzVec && c0 + k < n_cols; ++k) {
      const float bb = bias != nullptr ? bias[c0 + k] : 0.0f;
      o[c0 + k] = __float2bfloat16_rn(dz_value(zr[c0 + k], bb, T, l, cf, gl, tcol == c0 + k));
    }
  }
}

void check_vec(const torch::Tensor& t, const char* name, long long n) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.numel() == n,
              "sm90 backward: ", name, " must be a contiguous CUDA float32 [", n, "] tensor");
}

}  // namespace

// z [N, C] FP32 (unit column stride), out [N, C] bf16 (unit column stride); bias [>= C] FP32 for this chunk or
// none; temperature, lse, coef, g_logp [N] FP32; targets [N] int64 (vocabulary ids); col_offset = vocabulary id
// of chunk column 0.
void backward_dz(torch::Tensor z, c10::optional<torch::Tensor> bias, torch::Tensor temperature, torch::Tensor lse,
                 torch::Tensor coef, torch::Tensor g_logp, torch::Tensor targets, int64_t col_offset,
                 torch::Tensor out) {
  TORCH_CHECK(z.is_cuda() && z.scalar_type() == torch::kFloat32 && z.dim() == 2 && z.stride(1) == 1,
              "sm90 backward: z must be CUDA float32 [N, C] with unit column stride");
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == torch::kBFloat16 && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == z.size(0) && out.size(1) == z.size(1),
              "sm90 backward: out must be CUDA bfloat16 shaped like z with unit column stride");
  const long long n = z.size(0), c = z.size(1);
  TORCH_CHECK(c < (1LL << 30), "sm90 backward: chunk too wide");
  check_vec(temperature, "temperature", n);
  check_vec(lse, "lse", n);
  check_vec(coef, "coef", n);
  check_vec(g_logp, "g_logp", n);
  TORCH_CHECK(targets.is_cuda() && targets.scalar_type() == torch::kInt64 && targets.is_contiguous() &&
                  targets.numel() == n, "sm90 backward: targets must be contiguous CUDA int64 [N]");
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_cuda() && bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                    bias->numel() >= c, "sm90 backward: bias must be contiguous CUDA float32 covering the chunk");
    bias_ptr = bias->data_ptr<float>();
  }
  if (n == 0 || c == 0) return;
  const bool vec = (z.stride(0) % 4 == 0) && (out.stride(0) % 8 == 0) &&
                   (reinterpret_cast<uintptr_t>(z.data_ptr()) % 16 == 0) &&
                   (reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0);
  const c10::cuda::CUDAGuard guard(z.device());
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>((c + kDzThreads * kDzVec - 1) / (kDzThreads * kDzVec)));
  dz_kernel<<<grid, kDzThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      z.data_ptr<float>(), z.stride(0), static_cast<int>(c), bias_ptr, temperature.data_ptr<float>(),
      lse.data_ptr<float>(), coef.data_ptr<float>(), g_logp.data_ptr<float>(), targets.data_ptr<int64_t>(),
      col_offset, reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), out.stride(0), vec ? 1 : 0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace sm90
