// The forward entries: fused lm_head projection + the contract's tile statistics (launch selection), the row merge,
// statistics from FP32 logits, the exp2 self-test and the compiled contract constants.
//
// The contract (CONTRACT.md; constants from shared_contract/constants.py via contract_constants.h):
//   z[n, v]  = <h[n], W[v]> (+ b[v]): one FP32 wgmma accumulator, K in ascending k16 groups, no split-K.
//   c[n]     = __fdiv_rn(LOG2E, T[n]).
//   tile t   = vocabulary ids [64t, 64t+64); M_t = max z over real ids (NaN if any real z is non-finite);
//   s_t      = adjacent-pairwise tree over the 64 lanes of ex2((z - M_t) * c) (0.0 for non-real lanes);
//   m_t      = __fdiv_rn(M_t, T).
//   merge    : m = max_t m_t; S = s_0*e_0, S = S + s_t*e_t ascending (e_t = ex2((m_t - m) * LOG2E));
//              lse = m + log(S); logp = min(__fdiv_rn(z_target, T) - lse, 0).
// Launch shapes (CTA tile, stages, grid order) are free: they never change a bit.
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <vector>

#include "contract_math.cuh"
#include "launch.cuh"
#include "logits_stats.cuh"
#include "row_merge.cuh"

#include <string>

namespace sm90 {
namespace {
// The row merge (row_merge.cuh), one block of THREADS threads a row: 256 where the rows are few (each row's
// latency is the call's), 64 where an SM holds many rows (more rows merged at once); the same bytes.
constexpr int kMergeThreads = 256, kMergeThreadsMany = 64;

inline int merge_threads(long long n_rows) { return n_rows > 8LL * sm_count() ? kMergeThreadsMany : kMergeThreads; }

template <int THREADS>
__global__ void __launch_bounds__(THREADS)
merge_kernel(const float* __restrict__ tile_max, const float* __restrict__ tile_sum,
             const float* __restrict__ target_logit, float* __restrict__ logp, float* __restrict__ lse,
             int n_tiles, long long ld) {
  __shared__ float buf[RowMerge<THREADS>::kBufFloats];
  __shared__ float red[THREADS / 32];
  const long long row = blockIdx.x;
  const float l = block_row_lse<THREADS>(tile_max + row * ld, tile_sum + row * ld, n_tiles, buf, red);
  if (threadIdx.x == 0) {
    lse[row] = l;
    logp[row] = contract::clamp_nonpos(__fsub_rn(target_logit[row], l));
  }
}

// The merge of a T = 1 serving call's statistics with the logp of `cols` ids per row read from its logits
// (z'_id = z[id] at T = 1): one block per row. A row with an id outside [0, vocab_size) is invalid: its logp
// and lse are NaN and it adds 1 to bad_rows[0] (CONTRACT.md section 0.1); no id outside the row is ever read.
// The last block to finish (bad_rows[1] counts finished blocks and is reset by it) stores the running total
// bad_rows[0] into *mirror, host memory the host reads without synchronising.
template <typename Id>
__global__ void __launch_bounds__(kMergeThreads)
merge_ids_kernel(const float* __restrict__ tile_max, const float* __restrict__ tile_sum, int n_tiles, long long ld,
                 const float* __restrict__ logits, long long ld_z, const Id* __restrict__ ids, long long ld_ids,
                 int cols, long long vocab_size, float* __restrict__ logp, float* __restrict__ lse,
                 int64_t* __restrict__ bad_rows, int64_t* __restrict__ mirror) {
  __shared__ float buf[RowMerge<kMergeThreads>::kBufFloats];
  __shared__ float red[kMergeThreads / 32];
  __shared__ float row_lse;
  const long long row = blockIdx.x;
  int bad = 0;
  for (int c = threadIdx.x; c < cols; c += kMergeThreads) {
    const long long id = static_cast<long long>(ids[row * ld_ids + c]);
    bad |= (id < 0 || id >= vocab_size);
  }
  bad = __syncthreads_or(bad);
  const float l = block_row_lse<kMergeThreads>(tile_max + row * ld, tile_sum + row * ld, n_tiles, buf, red);
  const float qnan = __int_as_float(0x7FC00000);
  if (threadIdx.x == 0) {
    row_lse = l;
    lse[row] = bad ? qnan : l;
    if (bad) atomicAdd(reinterpret_cast<unsigned long long*>(bad_rows), 1ull);
  }
  __syncthreads();
  for (int c = threadIdx.x; c < cols; c += kMergeThreads) {
    const float* zr = logits + row * ld_z;
    logp[row * cols + c] = bad ? qnan
        : contract::clamp_nonpos(__fsub_rn(zr[static_cast<long long>(ids[row * ld_ids + c])], row_lse));
  }
  if (threadIdx.x == 0) {
    __threadfence();
    auto* ticket = reinterpret_cast<unsigned long long*>(bad_rows + 1);
    if (atomicAdd(ticket, 1ull) == static_cast<unsigned long long>(gridDim.x) - 1) {   // the launch's last block
      *ticket = 0;
      const unsigned long long total = atomicAdd(reinterpret_cast<unsigned long long*>(bad_rows), 0ull);
      *reinterpret_cast<volatile long long*>(mirror) = static_cast<long long>(total);
      __threadfence_system();
    }
  }
}

constexpr int kLogitsWarps = 8;

// Statistics from FP32 logits (logits_stats.cuh), one warp per (row, tile).
__global__ void __launch_bounds__(32 * kLogitsWarps)
logits_stats_kernel(const float* __restrict__ logits, long long ld, const int64_t* __restrict__ targets,
                    const float* __restrict__ temperature, int n_rows, int vocab_size, int nt,
                    float* __restrict__ tile_max, float* __restrict__ tile_sum, float* __restrict__ target_logit) {
  const long long item = static_cast<long long>(blockIdx.x) * kLogitsWarps + threadIdx.x / 32;
  warp_logits_tile_stats(logits, ld, targets, temperature, n_rows, vocab_size, nt, tile_max, tile_sum, target_logit,
                         item);
}

}  // namespace

static void check_f32_2d(const torch::Tensor& t, const char* name, long long rows, long long cols) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.dim() == 2 &&
                  t.size(0) == rows && t.size(1) == cols,
              "sm90: ", name, " must be a contiguous CUDA float32 [", num(rows), ", ", num(cols), "] tensor");
}

// A float32 output on like's device; filled with the int32 pattern `poison` where given (tests: an output the
// kernel leaves unwritten shows).
static torch::Tensor output_f32(c10::IntArrayRef shape, const torch::Tensor& like, c10::optional<int64_t> poison) {
  torch::Tensor out = torch::empty(shape, like.options().dtype(torch::kFloat32));
  if (poison.has_value()) out.view(torch::kInt32).fill_(*poison);
  return out;
}

// The launch configurations of the fused kernel, by name (kernel/sm90.py LAUNCHES, where "auto" is resolved by row
// count): "cta-RxC", the CTA kernel with an R x C tile (rows x vocabulary columns), in which the logits are stored by
// its producer warpgroup (producer_logits in stats_epilogue.cuh); "pingpong-RxC", the persistent ping-pong kernel with
// R x C consumer tiles, whose consumer warps store the logits (pingpong_kernel.cuh), with "-dyn" on the dynamic
// schedule (each CTA claims its next tile from a counter) and with "-mc2" in clusters of two CTAs that share each
// weight tile by multicast; "swapab-128", the swapped-operand kernel (the weight as the wgmma's A operand, 128 rows a
// CTA; swap_kernel.cuh), whose consumer warps store the logits. None changes a bit. One table gives the names for
// Python (launch_names), the dispatch and the refusal.
using Launcher = void (*)(const torch::Tensor&, const torch::Tensor&, const FusedParams&, cudaStream_t);
struct NamedLaunch {
  const char* name;
  Launcher run;
};
static const NamedLaunch kLaunches[] = {
    {"cta-128x256", [](const torch::Tensor& h, const torch::Tensor& w, const FusedParams& p, cudaStream_t s) {
       launch_cta<2, 256>(h, w, p, s);
     }},
    {"cta-64x256", [](const torch::Tensor& h, const torch::Tensor& w, const FusedParams& p, cudaStream_t s) {
       launch_cta<1, 128>(h, w, p, s);
     }},
    {"cta-64x128", [](const torch::Tensor& h, const torch::Tensor& w, const FusedParams& p, cudaStream_t s) {
       launch_cta<1, 64>(h, w, p, s);
     }},
    {"pingpong-128x192", [](const torch::Tensor& h, const torch::Tensor& w, const FusedParams& p, cudaStream_t s) {
       launch_pingpong(h, w, p, s);
     }},
    {"swapab-128", [](const torch::Tensor& h, const torch::Tensor& w, const FusedParams& p, cudaStream_t s) {
       launch_swap(h, w, p, s);
     }},
    {"pingpong-128x192-dyn", [](const torch::Tensor& h, const torch::Tensor& w, const FusedParams& p,
                                cudaStream_t s) { launch_pingpong(h, w, p, s, true); }},
    {"pingpong-128x192-mc2", [](const torch::Tensor& h, const torch::Tensor& w, const FusedParams& p,
                                cudaStream_t s) { launch_pingpong_mc2(h, w, p, s); }},
};

std::vector<std::string> launch_names() {
  std::vector<std::string> names;
  for (const NamedLaunch& l : kLaunches) names.emplace_back(l.name);
  return names;
}

static void launch_named(const std::string& launch, const torch::Tensor& hidden, const torch::Tensor& weight,
                         const FusedParams& p, cudaStream_t stream) {
  for (const NamedLaunch& l : kLaunches)
    if (launch == l.name) return l.run(hidden, weight, p, stream);
  std::string names;
  for (const NamedLaunch& l : kLaunches) names += (names.empty() ? "" : ", ") + std::string(l.name);
  TORCH_CHECK(false, "sm90: launch must be one of ", names, "; got '", launch, "'");
}

// Tile statistics of a weight (shard) whose row 0 is vocabulary id vocab_start; n_real real columns, with the launch
// configuration named `launch`. hooks, timing hooks of the benchmarks (0 otherwise): bit 0, the mainloop alone
// (statistics not computed); bit 1, the ping-pong kernels' order signal once their wgmmas complete.
void fused_stats(torch::Tensor hidden, torch::Tensor weight, torch::Tensor targets, torch::Tensor temperature,
                 c10::optional<torch::Tensor> bias, int64_t vocab_start, int64_t n_real, torch::Tensor tile_max,
                 torch::Tensor tile_sum, torch::Tensor target_logit, c10::optional<torch::Tensor> logits,
                 const std::string& launch, int64_t hooks) {
  FusedParams p = entry_params("sm90", "n_real", hidden, weight, targets, temperature, bias, vocab_start, n_real);
  TORCH_CHECK(vocab_start % kTile == 0, "sm90: vocab_start must be a multiple of 64");
  const long long n = hidden.size(0);
  const long long nt = (n_real + kTile - 1) / kTile;
  check_f32_2d(tile_max, "tile_max", n, nt);
  check_f32_2d(tile_sum, "tile_sum", n, nt);
  TORCH_CHECK(target_logit.is_cuda() && target_logit.scalar_type() == torch::kFloat32 && target_logit.numel() == n,
              "sm90: target_logit must be float32 [N]");
  p.nt = static_cast<int>(nt);
  p.tile_max = tile_max.data_ptr<float>();
  p.tile_sum = tile_sum.data_ptr<float>();
  p.target_logit = target_logit.data_ptr<float>();
  p.logits = nullptr;
  TORCH_CHECK(hooks >= 0 && hooks <= 3, "sm90: hooks must be in [0, 3]; got ", num(hooks));
  p.skip_epilogue = hooks & 1;
  p.late_order_signal = (hooks >> 1) & 1;
  if (logits.has_value()) {
    check_f32_2d(*logits, "logits", n, n_real);
    p.logits = logits->data_ptr<float>();
  }
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(hidden.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  launch_named(launch, hidden, weight, p, stream);
}

// A serving head: the fused kernel at T = 1 over vocabulary ids [0, n_real) with its FP32 logits, outputs allocated
// here. zeros [N] int64 are the target ids and ones [N] float32 the temperatures (constant buffers); the target
// slots go to a scratch row. -> {tile_max [N, nt], tile_sum [N, nt], logits [N, n_real], scratch [N]}.
std::vector<torch::Tensor> logits_and_stats(torch::Tensor hidden, torch::Tensor weight, torch::Tensor zeros,
                                            torch::Tensor ones, c10::optional<torch::Tensor> bias, int64_t n_real,
                                            const std::string& launch, c10::optional<int64_t> poison) {
  const int64_t n = hidden.size(0);
  const int64_t nt = (n_real + kTile - 1) / kTile;
  const c10::cuda::CUDAGuard guard(hidden.device());
  torch::Tensor tile_max = output_f32(std::vector<int64_t>{n, nt}, hidden, poison);
  torch::Tensor tile_sum = output_f32(std::vector<int64_t>{n, nt}, hidden, poison);
  torch::Tensor logits = output_f32(std::vector<int64_t>{n, n_real}, hidden, poison);
  torch::Tensor scratch = output_f32(std::vector<int64_t>{n}, hidden, poison);
  fused_stats(hidden, weight, zeros, ones, bias, 0, n_real, tile_max, tile_sum, scratch, logits, launch, 0);
  return {tile_max, tile_sum, logits, scratch};
}

void merge_stats(torch::Tensor tile_max, torch::Tensor tile_sum, torch::Tensor target_logit, torch::Tensor logp,
                 torch::Tensor lse) {
  TORCH_CHECK(tile_max.dim() == 2 && tile_max.sizes() == tile_sum.sizes(), "sm90: statistics shapes differ");
  const long long n = tile_max.size(0), t = tile_max.size(1);
  check_f32_2d(tile_max, "tile_max", n, t);
  check_f32_2d(tile_sum, "tile_sum", n, t);
  TORCH_CHECK(t >= 1, "sm90: no tiles to merge");
  TORCH_CHECK(target_logit.is_cuda() && target_logit.scalar_type() == torch::kFloat32 && target_logit.numel() == n &&
                  target_logit.is_contiguous(), "sm90: target_logit must be contiguous float32 [N]");
  TORCH_CHECK(logp.numel() == n && lse.numel() == n && logp.scalar_type() == torch::kFloat32 &&
                  lse.scalar_type() == torch::kFloat32 && logp.is_contiguous() && lse.is_contiguous(),
              "sm90: logp/lse must be contiguous float32 [N]");
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(tile_max.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  TORCH_CHECK(n < (1LL << 31) && t < (1LL << 31), "sm90: too many rows or tiles to merge");
  const int threads = merge_threads(n);
  auto merge = threads == kMergeThreadsMany ? merge_kernel<kMergeThreadsMany> : merge_kernel<kMergeThreads>;
  merge<<<static_cast<unsigned>(n), threads, 0, stream>>>(
      tile_max.data_ptr<float>(), tile_sum.data_ptr<float>(), target_logit.data_ptr<float>(),
      logp.data_ptr<float>(), lse.data_ptr<float>(), static_cast<int>(t), t);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// logp of ids [N] or [N, C] (int32 or int64, unit column stride) from a T = 1 call's statistics and logits over the
// whole real vocabulary. bad_rows: CUDA int64 [2] (the running count of invalid rows, then a block ticket kept at
// 0 between launches); mirror: pinned host int64 [1] that receives the running count at the end of each launch.
std::vector<torch::Tensor> merge_ids(torch::Tensor tile_max, torch::Tensor tile_sum, torch::Tensor logits,
                                     torch::Tensor ids, int64_t vocab_size, torch::Tensor bad_rows,
                                     torch::Tensor mirror, c10::optional<int64_t> poison) {
  const long long n = tile_max.size(0), t = tile_max.size(1);
  check_f32_2d(tile_max, "tile_max", n, t);
  check_f32_2d(tile_sum, "tile_sum", n, t);
  TORCH_CHECK(t == (vocab_size + kTile - 1) / kTile && t >= 1, "sm90: the statistics must cover vocab_size");
  TORCH_CHECK(logits.is_cuda() && logits.scalar_type() == torch::kFloat32 && logits.dim() == 2 &&
                  logits.size(0) == n && logits.size(1) >= vocab_size && logits.stride(1) == 1,
              "sm90: logits must be CUDA float32 [N, >= vocab_size] with unit column stride");
  TORCH_CHECK(ids.is_cuda() && (ids.scalar_type() == torch::kInt64 || ids.scalar_type() == torch::kInt32) &&
                  (ids.dim() == 1 || ids.dim() == 2) && ids.size(0) == n && (ids.dim() == 1 || ids.stride(1) == 1),
              "sm90: ids must be CUDA int32/int64 [N] or [N, C] with unit column stride");
  const long long cols = ids.dim() == 2 ? ids.size(1) : 1;
  const long long ld_ids = ids.stride(0);
  TORCH_CHECK(cols >= 1, "sm90: ids must have at least one column");
  TORCH_CHECK(bad_rows.is_cuda() && bad_rows.scalar_type() == torch::kInt64 && bad_rows.numel() == 2 &&
                  bad_rows.is_contiguous(), "sm90: bad_rows must be a contiguous CUDA int64 [2] counter");
  TORCH_CHECK(!mirror.is_cuda() && mirror.is_pinned() && mirror.scalar_type() == torch::kInt64 && mirror.numel() == 1,
              "sm90: mirror must be a pinned host int64 [1] tensor");
  void* mirror_dev = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&mirror_dev, mirror.data_ptr(), 0));
  const c10::cuda::CUDAGuard guard(tile_max.device());
  const int64_t rows = n, width = cols;
  torch::Tensor logp = output_f32(ids.dim() == 2 ? std::vector<int64_t>{rows, width} : std::vector<int64_t>{rows},
                                  tile_max, poison);
  torch::Tensor lse = output_f32(std::vector<int64_t>{rows}, tile_max, poison);
  if (n == 0) return {logp, lse};
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (ids.scalar_type() == torch::kInt64) {
    merge_ids_kernel<int64_t><<<static_cast<unsigned>(n), kMergeThreads, 0, stream>>>(
        tile_max.data_ptr<float>(), tile_sum.data_ptr<float>(), static_cast<int>(t), t, logits.data_ptr<float>(),
        logits.stride(0), ids.data_ptr<int64_t>(), ld_ids, static_cast<int>(cols), vocab_size,
        logp.data_ptr<float>(), lse.data_ptr<float>(), bad_rows.data_ptr<int64_t>(),
        static_cast<int64_t*>(mirror_dev));
  } else {
    merge_ids_kernel<int32_t><<<static_cast<unsigned>(n), kMergeThreads, 0, stream>>>(
        tile_max.data_ptr<float>(), tile_sum.data_ptr<float>(), static_cast<int>(t), t, logits.data_ptr<float>(),
        logits.stride(0), ids.data_ptr<int32_t>(), ld_ids, static_cast<int>(cols), vocab_size,
        logp.data_ptr<float>(), lse.data_ptr<float>(), bad_rows.data_ptr<int64_t>(),
        static_cast<int64_t*>(mirror_dev));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {logp, lse};
}

void logits_stats(torch::Tensor logits, torch::Tensor targets, torch::Tensor temperature, int64_t vocab_size,
                  torch::Tensor tile_max, torch::Tensor tile_sum, torch::Tensor target_logit) {
  TORCH_CHECK(logits.is_cuda() && logits.scalar_type() == torch::kFloat32 && logits.dim() == 2 &&
                  logits.stride(1) == 1, "sm90: logits must be CUDA float32 [N, V] with unit column stride");
  const long long n = logits.size(0);
  TORCH_CHECK(vocab_size >= 1 && vocab_size <= logits.size(1), "sm90: vocab_size out of range");
  const long long nt = (vocab_size + kTile - 1) / kTile;
  check_f32_2d(tile_max, "tile_max", n, nt);
  check_f32_2d(tile_sum, "tile_sum", n, nt);
  TORCH_CHECK(targets.is_cuda() && targets.scalar_type() == torch::kInt64 && targets.numel() == n &&
                  targets.is_contiguous(), "sm90: targets must be contiguous int64 [N]");
  TORCH_CHECK(temperature.is_cuda() && temperature.scalar_type() == torch::kFloat32 && temperature.numel() == n &&
                  temperature.is_contiguous(), "sm90: temperature must be contiguous float32 [N]");
  TORCH_CHECK(target_logit.numel() == n && target_logit.scalar_type() == torch::kFloat32, "sm90: target_logit");
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const long long items = n * nt;
  const unsigned blocks = static_cast<unsigned>((items + kLogitsWarps - 1) / kLogitsWarps);
  logits_stats_kernel<<<blocks, 32 * kLogitsWarps, 0, stream>>>(
      logits.data_ptr<float>(), logits.stride(0), targets.data_ptr<int64_t>(), temperature.data_ptr<float>(),
      static_cast<int>(n), static_cast<int>(vocab_size), static_cast<int>(nt), tile_max.data_ptr<float>(),
      tile_sum.data_ptr<float>(), target_logit.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Contract constants compiled into this build, for the launch-time check against shared_contract/constants.py.
std::vector<int64_t> contract_constants() { return {FL_CONTRACT_CONSTANTS_LIST}; }

// Test hooks: the device exp2 and log over a float32 tensor.
static __global__ void ex2log_kernel(const float* x, float* e, float* l, long long n) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    e[i] = contract::contract_ex2(x[i]);
    l[i] = contract::contract_log(x[i]);
  }
}

std::vector<torch::Tensor> ex2log(torch::Tensor x) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "sm90: ex2log input");
  auto e = torch::empty_like(x), l = torch::empty_like(x);
  const long long n = x.numel();
  if (n > 0) {
    const c10::cuda::CUDAGuard guard(x.device());
    ex2log_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), e.data_ptr<float>(), l.data_ptr<float>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {e, l};
}

// The exp2 self-test (CONTRACT.md section 6): this device's ex2.approx.ftz.f32 against the model over every binary32
// x <= 0 (all 2^31 patterns with the sign bit set) and every x in [+0, 2^-23): k = floor(-x), j = floor(|x + k| 2^23),
// T[j] 2^-k by exponent arithmetic, +0 below 2^-126; NaN for NaN. counts[0] = values checked, counts[1] = values that
// differ, counts[2..3] = the first differing input's bits and the device's result.
static __global__ void ex2_selftest_kernel(const uint32_t* __restrict__ table, unsigned long long* counts) {
  constexpr unsigned long long kNeg = 1ull << 31, kPos = 0x34000000ull;
  unsigned long long checked = 0;
  for (unsigned long long i = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < kNeg + kPos; i += static_cast<unsigned long long>(gridDim.x) * blockDim.x) {
    const uint32_t xb = i < kNeg ? static_cast<uint32_t>(0x80000000ull | i) : static_cast<uint32_t>(i - kNeg);
    const float x = __uint_as_float(xb);
    const uint32_t hw = __float_as_uint(contract::contract_ex2(x));
    uint32_t want;
    bool ok;
    if (x != x) {
      ok = (hw & 0x7FFFFFFFu) > 0x7F800000u;
    } else {
      const float a = x > 0.0f ? 0.0f : -x;
      if (!(a < 160.0f)) {
        want = 0u;
      } else {
        const float k = floorf(a);
        const int j = static_cast<int>(__fmul_rn(__fsub_rn(a, k), 8388608.0f));
        const uint32_t e = table[j];
        const int ki = static_cast<int>(k);
        want = static_cast<int>(e >> 23) > ki ? e - (static_cast<uint32_t>(ki) << 23) : 0u;
      }
      ok = hw == want;
    }
    ++checked;
    if (!ok) {
      if (atomicAdd(counts + 1, 1ull) == 0ull) {
        counts[2] = xb;
        counts[3] = hw;
      }
    }
  }
  atomicAdd(counts, checked);
}

torch::Tensor ex2_selftest(torch::Tensor table) {
  TORCH_CHECK(table.is_cuda() && table.scalar_type() == torch::kInt32 && table.is_contiguous() &&
                  table.numel() == (1ll << FL_EX2_FRAC_BITS) + 1,
              "sm90: ex2_selftest takes the exp2 table as a contiguous CUDA int32 tensor of 2^23 + 1 entries");
  const c10::cuda::CUDAGuard guard(table.device());
  auto counts = torch::zeros({4}, table.options().dtype(torch::kInt64));
  ex2_selftest_kernel<<<1024, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint32_t*>(table.data_ptr<int32_t>()),
      reinterpret_cast<unsigned long long*>(counts.data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return counts;
}

}  // namespace sm90
