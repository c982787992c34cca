// Backward of linear_logp: the recompute GEMM of one vocabulary chunk with the logit gradient in its epilogue.
//
// Gradient bytes are not part of the contract, but they are deterministic (no atomics, no reductions here), and
// each element depends only on its own row: z is the contract's FP32 accumulator (the 128x256 fused kernel's
// mainloop, the same z the forward used), so a row's dz is the same alone and inside any batch. For a chunk of
// weight rows W_c [C, D] whose row 0 is vocabulary id col_offset:
//   z   = <h[n], W_c[c]> (+ b[c])
//   dz  = (coef * exp(z / T - lse) + g_logp [col_offset + c == target]) / T      coef = g_lse - g_logp
// rounded once to bf16 into out [N, C] (the operand of dh = dz W_c and dW_c = dz^T h, FP32 accumulation) through
// shared memory and TMA stores; the FP32 logits chunk is never written. The scaling and exp are the fast forms (dz_epilogue.cuh, DzRows).
// Two launches compute it (free axes: schedule and tile; the same accumulators and the same element-wise
// arithmetic, so the same bytes): cta-128x256 (fused_cta_kernel, one CTA a tile, the dz after its mainloop) and
// pingpong-128x192 (pingpong_dz_kernel.cuh: persistent, one consumer warpgroup's dz beside the other's mainloop; D a
// multiple of 64).
#include "launch.cuh"
#include "pingpong_dz_kernel.cuh"

namespace sm90 {

namespace {
// The dz kernels' output map: [N, n_cols rounded up to 8] bf16 (whole 16-byte units per row), 64 x 64 boxes, 128-byte
// swizzle.
CUtensorMap dz_out_map(const torch::Tensor& out) {
  return make_map(out.as_strided({out.size(0), (out.size(1) + 7) / 8 * 8}, {out.stride(0), 1}), 64);
}

// The 128x256 CTA (two consumer warpgroups of 64 rows x 256 columns) with the DZ epilogue; out is stored by TMA.
void launch_dz(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& out,
               const FusedParams& p, cudaStream_t stream) {
  using C = Cfg<2, 256>;
  FusedParams q = p;
  q.num_m = (p.n_rows + C::BM - 1) / C::BM;
  q.num_n = (p.n_real + C::BN - 1) / C::BN;
  const CUtensorMap mh = make_map(hidden, C::BM);
  const CUtensorMap mw = make_map(weight, C::BN);
  const CUtensorMap mo = dz_out_map(out);
  auto kern = (p.d % kBK == 0) ? fused_cta_kernel<2, 256, true, true> : fused_cta_kernel<2, 256, false, true>;
  launch_kernel(kern, static_cast<long long>(q.num_m) * q.num_n, C::SMEM, stream, mh, mw, mo, q);
}

// The persistent ping-pong kernel, 128x192 consumer tiles, with the dz epilogue (pingpong_dz_kernel.cuh): D a multiple
// of 64 (every stage holds 4 k16 groups); any n_cols (the TMA store clips the columns beyond it, the bias is read
// lane by lane). dynamic: on the dynamic schedule (launch pingpong-128x192-dyn; pingpong_kernel.cuh).
void launch_dz_pingpong(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& out,
                        const FusedParams& p, cudaStream_t stream, bool dynamic) {
  using C = PingPongCfg;
  const char* name = dynamic ? "pingpong-128x192-dyn" : "pingpong-128x192";
  TORCH_CHECK(p.d % kBK == 0, "sm90 backward: launch ", name, " takes D a multiple of 64, got D = ", num(p.d));
  FusedParams q = p;
  const torch::Tensor counter = set_tile_counter(q, hidden, dynamic);
  q.num_m = (p.n_rows + C::BM - 1) / C::BM;
  q.num_n = (p.n_real + C::BN - 1) / C::BN;
  const long long tiles = static_cast<long long>(q.num_m) * q.num_n;
  const CUtensorMap mh = make_map(hidden, C::BM);
  const CUtensorMap mw = make_map(weight, C::BN);
  const CUtensorMap mo = dz_out_map(out);
  launch_kernel(pingpong_dz_kernel, std::min<long long>(tiles, sm_count()), kPingPongDzSmem, stream, mh, mw, mo, q);
}

void check_vec(const torch::Tensor& t, const char* name, long long n) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.numel() == n,
              "sm90 backward: ", name, " must be a contiguous CUDA float32 [", num(n), "] tensor");
}
}  // namespace

// hidden [N, D] bf16 and weight [R, D] bf16 (contiguous; rows >= n_cols are not read into the output);
// bias [>= n_cols] FP32 for this chunk or none; temperature, lse, coef, g_logp [N] FP32; targets [N] int64
// (vocabulary ids); col_offset = vocabulary id of weight row 0; out [N, n_cols] bf16 with unit column stride and
// a row stride that is a multiple of 8 elements and a 16-byte aligned start (the TMA store's requirements).
// Columns [n_cols, n_cols rounded up to 8) of each row are scratch: they are overwritten (the store covers whole
// 16-byte units); nothing at or beyond that is written. launch: one of dz_launch_names().
std::vector<std::string> dz_launch_names() { return {"cta-128x256", "pingpong-128x192", "pingpong-128x192-dyn"}; }

void backward_dz(torch::Tensor hidden, torch::Tensor weight, c10::optional<torch::Tensor> bias,
                 torch::Tensor temperature, torch::Tensor lse, torch::Tensor coef, torch::Tensor g_logp,
                 torch::Tensor targets, int64_t col_offset, int64_t n_cols, torch::Tensor out,
                 const std::string& launch) {
  TORCH_CHECK(launch == "cta-128x256" || launch == "pingpong-128x192" || launch == "pingpong-128x192-dyn",
              "sm90 backward: launch must be one of cta-128x256, pingpong-128x192, pingpong-128x192-dyn; got '",
              launch, "'");
  FusedParams p = entry_params("sm90 backward", "n_cols", hidden, weight, targets, temperature, bias, col_offset,
                               n_cols);
  const long long n = hidden.size(0);
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == torch::kBFloat16 && out.dim() == 2 && out.size(0) == n &&
                  out.size(1) == n_cols && out.stride(1) == 1 && out.stride(0) % 8 == 0 && out.stride(0) >= n_cols &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
              "sm90 backward: out must be CUDA bfloat16 [N, n_cols] with unit column stride, a 16-byte aligned start "
              "and a row stride that is a multiple of 8 elements");
  check_vec(lse, "lse", n);
  check_vec(coef, "coef", n);
  check_vec(g_logp, "g_logp", n);
  p.lse = lse.data_ptr<float>();
  p.coef = coef.data_ptr<float>();
  p.g_logp = g_logp.data_ptr<float>();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(hidden.device());
  if (launch != "cta-128x256")
    launch_dz_pingpong(hidden, weight, out, p, c10::cuda::getCurrentCUDAStream(), launch == "pingpong-128x192-dyn");
  else
    launch_dz(hidden, weight, out, p, c10::cuda::getCurrentCUDAStream());
}

}  // namespace sm90
