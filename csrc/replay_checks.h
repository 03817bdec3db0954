// Validation of the replay ops, shared by the CPU and CUDA registrations. Shapes, dtypes and
// devices are checked once here; per-row defects are found by the kernels (as negative status
// codes, see replay_math.h) and turned into messages naming the row by raise_row_error.
#pragma once
#include <torch/types.h>

#include "replay_math.h"

namespace mask_replay {

inline bool replay_float_dtype(at::ScalarType st) {
  return st == at::kFloat || st == at::kBFloat16 || st == at::kHalf || st == at::kDouble;
}

// float64 input (gradcheck) is computed and returned in double; everything else in float32.
inline at::ScalarType replay_out_dtype(at::ScalarType st) { return st == at::kDouble ? at::kDouble : at::kFloat; }

inline void check_vec(const char* op, const at::Tensor& t, const char* name, int64_t n, at::ScalarType want,
                      const at::Device& dev) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, op, ": ", name, " must have shape [", n, "] (one value per row), got ",
              t.sizes());
  TORCH_CHECK(t.scalar_type() == want, op, ": ", name, " must be ", want, ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == dev, op, ": ", name, " is on ", t.device(), " but the logits are on ", dev);
}

// The CSR mask against n rows. sampled may be undefined (kept_mass).
inline void check_mask(const char* op, const at::Tensor& token_ids, const at::Tensor& offsets, int64_t n,
                       const at::Device& dev) {
  TORCH_CHECK(token_ids.dim() == 1 && token_ids.scalar_type() == at::kInt, op,
              ": token_ids must be a 1-D int32 tensor, got ", token_ids.scalar_type(), " ", token_ids.sizes());
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kLong, op,
              ": offsets must be a 1-D int64 tensor, got ", offsets.scalar_type(), " ", offsets.sizes());
  TORCH_CHECK(offsets.size(0) == n + 1, op, ": the mask has ", offsets.size(0) - 1, " rows (offsets has ",
              offsets.size(0), " entries) but there are ", n, " rows of logits; offsets must have N + 1 = ", n + 1,
              " entries");
  TORCH_CHECK(token_ids.device() == dev, op, ": token_ids is on ", token_ids.device(), " but the logits are on ", dev);
  TORCH_CHECK(offsets.device() == dev, op, ": offsets is on ", offsets.device(), " but the logits are on ", dev);
}

inline void check_logits(const char* op, const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2, op, ": logits must be 2-D [rows, vocab], got ", logits.dim(), "-D");
  TORCH_CHECK(replay_float_dtype(logits.scalar_type()), op,
              ": logits must be float32, bfloat16, float16 or float64, got ", logits.scalar_type());
  TORCH_CHECK(logits.size(1) > 0 || logits.size(0) == 0, op, ": logits has an empty vocabulary");
}

inline void check_replay_args(const char* op, const at::Tensor& logits, const at::Tensor& token_ids,
                              const at::Tensor& offsets, const at::Tensor& sampled, const at::Tensor& temperature) {
  check_logits(op, logits);
  const int64_t n = logits.size(0);
  check_mask(op, token_ids, offsets, n, logits.device());
  if (sampled.defined()) check_vec(op, sampled, "sampled", n, at::kLong, logits.device());
  check_vec(op, temperature, "temperature", n, at::kFloat, logits.device());
}

// The saved forward state handed to a backward op.
inline void check_saved(const char* op, const at::Tensor& grad, const at::Tensor& lse, const at::Tensor* status,
                        int64_t n, at::ScalarType out, const at::Device& dev) {
  check_vec(op, grad, "grad", n, out, dev);
  check_vec(op, lse, "lse", n, out, dev);
  if (status) check_vec(op, *status, "status", n, at::kChar, dev);
}

inline void check_hidden_args(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                              const at::Tensor& bias) {
  TORCH_CHECK(hidden.dim() == 2, op, ": hidden must be 2-D [rows, d], got ", hidden.dim(), "-D");
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be 2-D [vocab, d], got ", weight.dim(), "-D");
  TORCH_CHECK(replay_float_dtype(hidden.scalar_type()), op,
              ": hidden must be float32, bfloat16, float16 or float64, got ", hidden.scalar_type());
  TORCH_CHECK(weight.scalar_type() == hidden.scalar_type(), op, ": weight is ", weight.scalar_type(),
              " but hidden is ", hidden.scalar_type(), "; they must match");
  TORCH_CHECK(weight.size(1) == hidden.size(1), op, ": weight has d = ", weight.size(1), " but hidden has d = ",
              hidden.size(1));
  TORCH_CHECK(weight.size(0) > 0 || hidden.size(0) == 0, op, ": weight has an empty vocabulary");
  TORCH_CHECK(weight.device() == hidden.device(), op, ": weight is on ", weight.device(), " but hidden is on ",
              hidden.device());
  if (bias.numel() > 0 || bias.dim() != 1) {
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == weight.size(0), op, ": bias must have shape [", weight.size(0),
                "] or be empty, got ", bias.sizes());
    TORCH_CHECK(bias.scalar_type() == hidden.scalar_type(), op, ": bias is ", bias.scalar_type(),
                " but hidden is ", hidden.scalar_type());
    TORCH_CHECK(bias.device() == hidden.device(), op, ": bias is on ", bias.device(), " but hidden is on ",
                hidden.device());
  }
}

inline bool has_bias(const at::Tensor& bias, int64_t vocab) { return bias.dim() == 1 && bias.size(0) == vocab && vocab > 0; }

// Raises for the first row whose status is an error. status may live on any device (one copy,
// which is the only host synchronisation of a CUDA forward). sampled may be undefined.
inline void raise_row_error(const char* op, const at::Tensor& status, const at::Tensor& offsets, int64_t nnz,
                            const at::Tensor& sampled, const at::Tensor& temperature, int64_t vocab) {
  if (status.numel() == 0) return;
  const at::Tensor st = status.cpu();
  const int8_t* s = st.data_ptr<int8_t>();
  int64_t r = 0;
  while (r < st.numel() && s[r] >= 0) ++r;
  if (r == st.numel()) return;
  auto off = [&](int64_t i) { return offsets[i].item<int64_t>(); };
  auto y = [&]() { return sampled[r].item<int64_t>(); };
  switch (s[r]) {
    case kErrOutside:
      TORCH_CHECK(false, op, ": sampled token ", y(), " is outside the support of row ", r, " (", off(r + 1) - off(r),
                  " tokens); pass fallback=True to use the full vocabulary for such rows");
    case kErrEmpty:
      TORCH_CHECK(false, op, ": row ", r, " has an empty support; pass fallback=True to use the full vocabulary");
    case kErrTemperature:
      TORCH_CHECK(false, op, ": temperature must be finite and > 0, row ", r, " has ", temperature[r].item<float>());
    case kErrSampledRange:
      TORCH_CHECK(false, op, ": sampled token ", y(), " of row ", r, " is out of range [0, ", vocab, ")");
    case kErrTokenRange:
      TORCH_CHECK(false, op, ": token_ids of row ", r, " hold an id outside [0, ", vocab, ")");
    case kErrNotAscending:
      TORCH_CHECK(false, op, ": token_ids of row ", r, " are not strictly ascending");
    case kErrOffsets:
      TORCH_CHECK(false, op, ": offsets are invalid at row ", r, " (offsets[", r, "] = ", off(r), ", offsets[", r + 1,
                  "] = ", off(r + 1), ", token_ids has ", nnz, " entries)");
    default:
      TORCH_CHECK(false, op, ": internal error, row ", r, " has status ", static_cast<int>(s[r]));
  }
}

}  // namespace mask_replay
