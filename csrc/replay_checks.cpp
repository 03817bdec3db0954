// Argument checks of the replay ops (see replay_checks.h); compiled once, used by both devices.
#include "replay_checks.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

namespace mask_replay {
namespace {

bool replay_float_dtype(at::ScalarType st) {
  return st == at::kFloat || st == at::kBFloat16 || st == at::kHalf || st == at::kDouble;
}

void check_vec(const char* op, const at::Tensor& t, const char* name, int64_t n, at::ScalarType want,
               const at::Device& dev) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is missing");
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, op, ": ", name, " must have shape [", n, "] (one value per row), got ",
              t.sizes());
  TORCH_CHECK(t.scalar_type() == want, op, ": ", name, " must be ", want, ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == dev, op, ": ", name, " is on ", t.device(), " but the logits are on ", dev);
}

void check_logits(const char* op, const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2, op, ": logits must be 2-D [rows, vocab], got ", logits.dim(), "-D");
  TORCH_CHECK(replay_float_dtype(logits.scalar_type()), op,
              ": logits must be float32, bfloat16, float16 or float64, got ", logits.scalar_type());
  TORCH_CHECK(logits.size(1) > 0 || logits.size(0) == 0, op, ": logits has an empty vocabulary");
}

// Shapes of the CSR mask against n rows; the values are checked by the kernels row by row.
void check_mask(const char* op, const at::Tensor& token_ids, const at::Tensor& offsets, int64_t n,
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

RowOperands row_operands(const char* op, int64_t n, int64_t vocab, const at::Device& dev, const at::Tensor& token_ids,
                         const at::Tensor& offsets, const at::Tensor& sampled, const at::Tensor& temperature) {
  RowOperands a;
  a.n = n;
  a.vocab = vocab;
  if (token_ids.defined()) {
    check_mask(op, token_ids, offsets, n, dev);
    a.ids = token_ids.contiguous();
    a.off = offsets.contiguous();
    a.nnz = a.ids.numel();
    // No kernel row sees an empty batch's offsets: its contract is checked here (one value).
    if (n == 0) {
      const int64_t o0 = a.off.cpu().const_data_ptr<int64_t>()[0];
      TORCH_CHECK(o0 == 0 && a.nnz == 0, op, ": offsets are invalid: an empty batch needs offsets = [0] and no ",
                  "token_ids, got offsets[0] = ", o0, " and ", a.nnz, " token_ids");
    }
  }
  if (sampled.defined()) {
    check_vec(op, sampled, "sampled", n, at::kLong, dev);
    a.ys = sampled.contiguous();
  }
  check_vec(op, temperature, "temperature", n, at::kFloat, dev);
  a.ts = temperature.contiguous();
  return a;
}

}  // namespace

at::ScalarType replay_out_dtype(at::ScalarType st) { return st == at::kDouble ? at::kDouble : at::kFloat; }

RowInputs RowOperands::view() const {
  return RowInputs{ids.defined() ? ids.const_data_ptr<int32_t>() : nullptr,
                   off.defined() ? off.const_data_ptr<int64_t>() : nullptr,
                   ys.defined() ? ys.const_data_ptr<int64_t>() : nullptr,
                   ts.const_data_ptr<float>(),
                   n,
                   vocab,
                   nnz};
}

RowOperands replay_operands(const char* op, const at::Tensor& logits, const at::Tensor& token_ids,
                            const at::Tensor& offsets, const at::Tensor& sampled, const at::Tensor& temperature) {
  check_logits(op, logits);
  TORCH_CHECK(token_ids.defined() && offsets.defined(), op, ": token_ids and offsets are required");
  return row_operands(op, logits.size(0), logits.size(1), logits.device(), token_ids, offsets, sampled, temperature);
}

RowOperands full_operands(const char* op, const at::Tensor& logits, const at::Tensor& sampled,
                          const at::Tensor& temperature) {
  check_logits(op, logits);
  TORCH_CHECK(sampled.defined(), op, ": sampled is required");
  return row_operands(op, logits.size(0), logits.size(1), logits.device(), at::Tensor(), at::Tensor(), sampled,
                      temperature);
}

HeadOperands head_operands(const char* op, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                           const at::Tensor& token_ids, const at::Tensor& offsets, const at::Tensor& sampled,
                           const at::Tensor& temperature) {
  TORCH_CHECK(hidden.dim() == 2, op, ": hidden must be 2-D [rows, d], got ", hidden.dim(), "-D");
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be 2-D [vocab, d], got ", weight.dim(), "-D");
  TORCH_CHECK(replay_float_dtype(hidden.scalar_type()), op,
              ": hidden must be float32, bfloat16, float16 or float64, got ", hidden.scalar_type());
  TORCH_CHECK(weight.scalar_type() == hidden.scalar_type(), op, ": weight is ", weight.scalar_type(), " but hidden is ",
              hidden.scalar_type(), "; they must match");
  TORCH_CHECK(weight.size(1) == hidden.size(1), op, ": weight has d = ", weight.size(1),
              " but hidden has d = ", hidden.size(1));
  TORCH_CHECK(weight.size(0) > 0 || hidden.size(0) == 0, op, ": weight has an empty vocabulary");
  TORCH_CHECK(weight.device() == hidden.device(), op, ": weight is on ", weight.device(), " but hidden is on ",
              hidden.device());
  const int64_t vocab = weight.size(0);
  HeadOperands hd;
  // An empty bias means "no bias"; anything else must be one value per token.
  hd.bias = !(bias.dim() == 1 && bias.numel() == 0);
  if (hd.bias) {
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == vocab, op, ": bias must have shape [", vocab, "] or be empty, got ",
                bias.sizes());
    TORCH_CHECK(bias.scalar_type() == hidden.scalar_type(), op, ": bias is ", bias.scalar_type(), " but hidden is ",
                hidden.scalar_type());
    TORCH_CHECK(bias.device() == hidden.device(), op, ": bias is on ", bias.device(), " but hidden is on ",
                hidden.device());
  }
  TORCH_CHECK(token_ids.defined() && offsets.defined() && sampled.defined(), op,
              ": token_ids, offsets and sampled are required");
  hd.rows = row_operands(op, hidden.size(0), vocab, hidden.device(), token_ids, offsets, sampled, temperature);
  hd.h = hidden.contiguous();
  hd.w = weight.stride(1) == 1 ? weight : weight.contiguous();
  hd.b = hd.bias ? bias.contiguous() : bias;
  hd.d = hidden.size(1);
  hd.ws = hd.w.stride(0);
  return hd;
}

SavedOperands saved_operands(const char* op, const at::Tensor& grad, const at::Tensor& lse, const at::Tensor& status,
                             int64_t n, at::ScalarType out, const at::Device& dev) {
  check_vec(op, grad, "grad", n, out, dev);
  check_vec(op, lse, "lse", n, out, dev);
  SavedOperands s{grad.contiguous(), lse.contiguous(), at::Tensor()};
  if (status.defined()) {
    check_vec(op, status, "status", n, at::kChar, dev);
    s.st = status.contiguous();
  }
  return s;
}

ForwardOutputs forward_outputs(const at::Tensor& like, int64_t n) {
  const auto out = like.options().dtype(replay_out_dtype(like.scalar_type()));
  return {at::empty({n}, out), at::empty({n}, out), row_status(like, n)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> finish_forward(const char* op, const ForwardOutputs& f,
                                                              const RowOperands& a) {
  raise_row_error(op, f.status, a);
  return {f.logp, f.lse, f.status};
}

at::Tensor row_status(const at::Tensor& like, int64_t n) { return at::empty({n}, like.options().dtype(at::kChar)); }

void raise_row_error(const char* op, const at::Tensor& status, const RowOperands& a) {
  if (status.numel() == 0) return;
  const at::Tensor st = status.cpu();
  const int8_t* s = st.const_data_ptr<int8_t>();
  int64_t r = 0;
  while (r < st.numel() && s[r] >= 0) ++r;
  if (r == st.numel()) return;
  // The few values a message needs, copied one by one (the inputs may live on the GPU).
  auto off = [&](int64_t i) { return a.off.cpu().const_data_ptr<int64_t>()[i]; };
  auto y = [&]() { return a.ys.cpu().const_data_ptr<int64_t>()[r]; };
  switch (s[r]) {
    case kErrOutside:
      TORCH_CHECK(false, op, ": sampled token ", y(), " is outside the support of row ", r, " (", off(r + 1) - off(r),
                  " tokens); pass fallback=True to use the full vocabulary for such rows");
    case kErrEmpty:
      TORCH_CHECK(false, op, ": row ", r, " has an empty support; pass fallback=True to use the full vocabulary");
    case kErrTemperature:
      TORCH_CHECK(false, op, ": temperature must be finite and > 0, row ", r, " has ",
                  a.ts.cpu().const_data_ptr<float>()[r]);
    case kErrSampledRange:
      TORCH_CHECK(false, op, ": sampled token ", y(), " of row ", r, " is out of range [0, ", a.vocab, ")");
    case kErrTokenRange:
      TORCH_CHECK(false, op, ": token_ids of row ", r, " hold an id outside [0, ", a.vocab, ")");
    case kErrNotAscending:
      TORCH_CHECK(false, op, ": token_ids of row ", r, " are not strictly ascending");
    case kErrOffsets:
      TORCH_CHECK(false, op, ": offsets are invalid at row ", r, " (offsets[", r, "] = ", off(r), ", offsets[", r + 1,
                  "] = ", off(r + 1), ", token_ids has ", a.nnz,
                  " entries); offsets must start at 0, never decrease and end at the number of token_ids");
    default:
      TORCH_CHECK(false, op, ": internal error, row ", r, " has status ", static_cast<int>(s[r]));
  }
}

}  // namespace mask_replay
