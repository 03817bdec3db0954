// Input validation of the capture ops, shared by the CPU and CUDA registrations. Messages name the
// argument (and the row for per-row values) so a user can find the defect in their batch.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace mask_replay {

inline void check_capture_args(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                               const at::Tensor& top_p, const at::Tensor& min_p) {
  TORCH_CHECK(logits.dim() == 2, "capture: logits must be 2-D [rows, vocab], got ", logits.dim(), "-D");
  const auto st = logits.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
              "capture: logits must be float32, bfloat16 or float16, got ", st);
  // Masses are 2^40 fixed point; V * 2^40 (an all-tied row) must stay below 2^63.
  TORCH_CHECK(logits.size(1) < (int64_t(1) << 23),
              "capture: vocabularies of 2^23 tokens or more are not supported, got ", logits.size(1));
  const int64_t n = logits.size(0);
  auto check = [&](const at::Tensor& t, const char* name, at::ScalarType want) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == n, "capture: ", name, " must have shape [", n,
                "] (one value per row), got ", t.sizes());
    TORCH_CHECK(t.scalar_type() == want, "capture: ", name, " must be ", want, ", got ", t.scalar_type());
    TORCH_CHECK(t.device() == logits.device(), "capture: ", name, " is on ", t.device(), " but logits are on ",
                logits.device());
  };
  check(temperature, "temperature", at::kFloat);
  check(top_k, "top_k", at::kLong);
  check(top_p, "top_p", at::kDouble);
  check(min_p, "min_p", at::kDouble);
}

// Per-row parameter values; takes CPU tensors. Rows with bad values are named.
inline void check_row_params(const at::Tensor& temperature, const at::Tensor& top_p, const at::Tensor& min_p) {
  const float* t = temperature.data_ptr<float>();
  const double* p = top_p.data_ptr<double>();
  const double* mp = min_p.data_ptr<double>();
  for (int64_t r = 0; r < temperature.size(0); ++r) {
    TORCH_CHECK(t[r] >= 0.0f && !std::isinf(t[r]), "capture: temperature must be finite and >= 0, row ", r, " has ",
                t[r]);
    TORCH_CHECK(p[r] > 0.0 && p[r] <= 1.0, "capture: top_p must be in (0, 1], row ", r, " has ", p[r]);
    TORCH_CHECK(mp[r] >= 0.0 && mp[r] <= 1.0, "capture: min_p must be in [0, 1], row ", r, " has ", mp[r]);
  }
}

}  // namespace mask_replay
