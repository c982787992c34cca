// Python bindings of the SM90 extension (kernel/sm90.py builds it with torch.utils.cpp_extension).
#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <vector>

namespace sm90 {
// sm90_forward.cu
void fused_stats(torch::Tensor hidden, torch::Tensor weight, torch::Tensor targets, torch::Tensor temperature,
                 c10::optional<torch::Tensor> bias, int64_t vocab_start, int64_t n_real, torch::Tensor tile_max,
                 torch::Tensor tile_sum, torch::Tensor target_logit, c10::optional<torch::Tensor> logits,
                 const std::string& launch, int64_t hooks);
std::vector<std::string> launch_names();
void merge_stats(torch::Tensor tile_max, torch::Tensor tile_sum, torch::Tensor target_logit, torch::Tensor logp,
                 torch::Tensor lse);
void logits_stats(torch::Tensor logits, torch::Tensor targets, torch::Tensor temperature, int64_t vocab_size,
                  torch::Tensor tile_max, torch::Tensor tile_sum, torch::Tensor target_logit);
std::vector<torch::Tensor> logits_and_stats(torch::Tensor hidden, torch::Tensor weight, torch::Tensor zeros,
                                            torch::Tensor ones, c10::optional<torch::Tensor> bias, int64_t n_real,
                                            const std::string& launch, c10::optional<int64_t> poison);
std::vector<torch::Tensor> merge_ids(torch::Tensor tile_max, torch::Tensor tile_sum, torch::Tensor logits,
                                     torch::Tensor ids, int64_t vocab_size, torch::Tensor bad_rows,
                                     torch::Tensor mirror, c10::optional<int64_t> poison);
std::vector<int64_t> contract_constants();
std::vector<torch::Tensor> ex2log(torch::Tensor x);
torch::Tensor ex2_selftest(torch::Tensor table);
// sm90_backward.cu
void backward_dz(torch::Tensor hidden, torch::Tensor weight, c10::optional<torch::Tensor> bias,
                 torch::Tensor temperature, torch::Tensor lse, torch::Tensor coef, torch::Tensor g_logp,
                 torch::Tensor targets, int64_t col_offset, int64_t n_cols, torch::Tensor out,
                 const std::string& launch);
std::vector<std::string> dz_launch_names();
// sm90_transforms.cu
torch::Tensor topp_crossing(torch::Tensor q, double p);
// sm90_fingerprint.cu
torch::Tensor fingerprint_rows(torch::Tensor words, torch::Tensor mult, int64_t first_row, int64_t g0, int64_t g1);
}  // namespace sm90

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_stats", &sm90::fused_stats, "GEMM + contract tile statistics (sm_90a), launch configuration by name");
  m.def("launch_names", &sm90::launch_names, "the fused kernel's launch configurations");
  m.def("merge_stats", &sm90::merge_stats, "contract row merge");
  m.def("logits_and_stats", &sm90::logits_and_stats,
        "serving head: fused_stats at T = 1 with FP32 logits, outputs allocated by the extension");
  m.def("merge_ids", &sm90::merge_ids, "contract row merge of a T = 1 call with the logp of ids read from its logits");
  m.def("logits_stats", &sm90::logits_stats, "contract tile statistics from FP32 logits");
  m.def("contract_constants", &sm90::contract_constants, "compiled contract constants");
  m.def("ex2log", &sm90::ex2log, "the contract's exp2/log on the device (test hook)");
  m.def("ex2_selftest", &sm90::ex2_selftest, "this device's ex2.approx.ftz.f32 against the model over its domain");
  m.def("backward_dz", &sm90::backward_dz, "backward: recompute GEMM of one vocabulary chunk with the bf16 logit gradient as its epilogue, launch configuration by name");
  m.def("dz_launch_names", &sm90::dz_launch_names, "backward_dz's launch configurations");
  m.def("fingerprint_rows", &sm90::fingerprint_rows, "lm_head fingerprint: [V, 2] row hashes");
  m.def("topp_crossing", &sm90::topp_crossing, "top-p: first sequential binary32 prefix sum >= p per row");
}
