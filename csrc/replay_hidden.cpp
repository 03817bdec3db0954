// Device-agnostic parts of the sparse LM head (see replay_hidden.h).
#include "replay_hidden.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/ones_like.h>

namespace mask_replay {
namespace {

// x = (h W^T + b) / T for the given rows, [F, V] in the output dtype (float32 or float64).
at::Tensor fallback_logits(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                           const at::Tensor& temperature, const at::Tensor& rows, at::ScalarType out) {
  at::Tensor z = at::matmul(hidden.index_select(0, rows), weight.t()).to(out);
  if (bias.numel() > 0) z = z + bias.to(out);
  return z / temperature.index_select(0, rows).to(out).unsqueeze(1);
}

}  // namespace

void hidden_fallback_fwd(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                         const at::Tensor& sampled, const at::Tensor& temperature, const at::Tensor& status,
                         at::Tensor& logp, at::Tensor& lse) {
  const at::Tensor rows = at::nonzero(status > 0).squeeze(1);
  if (rows.numel() == 0) return;
  const at::Tensor x = fallback_logits(hidden, weight, bias, temperature, rows, logp.scalar_type());
  const at::Tensor l = at::logsumexp(x.to(at::kDouble), {1});
  const at::Tensor xy = x.gather(1, sampled.index_select(0, rows).unsqueeze(1)).squeeze(1).to(at::kDouble);
  logp.index_copy_(0, rows, (xy - l).to(logp.scalar_type()));
  lse.index_copy_(0, rows, l.to(lse.scalar_type()));
}

void hidden_fallback_bwd(const at::Tensor& grad, const at::Tensor& hidden, const at::Tensor& weight,
                         const at::Tensor& bias, const at::Tensor& sampled, const at::Tensor& temperature,
                         const at::Tensor& lse, const at::Tensor& status, at::Tensor& grad_hidden,
                         at::Tensor& grad_weight, at::Tensor& grad_bias) {
  const at::Tensor rows = at::nonzero(status > 0).squeeze(1);
  if (rows.numel() == 0) return;
  const auto out = lse.scalar_type();
  const at::Tensor x = fallback_logits(hidden, weight, bias, temperature, rows, out);
  const at::Tensor p = at::exp(x.to(at::kDouble) - lse.index_select(0, rows).to(at::kDouble).unsqueeze(1)).to(out);
  const at::Tensor ys = sampled.index_select(0, rows).unsqueeze(1);
  // coef = (g / T) (onehot(y) - p), the gradient w.r.t. the fallback rows' logits
  at::Tensor coef = p.neg();
  coef.scatter_add_(1, ys, at::ones_like(ys, coef.options()));
  coef.mul_((grad.index_select(0, rows) / temperature.index_select(0, rows).to(out)).unsqueeze(1));
  const at::Tensor cw = coef.to(weight.scalar_type());
  grad_hidden.index_copy_(0, rows, at::matmul(cw, weight).to(grad_hidden.scalar_type()));
  grad_weight.addmm_(cw.t(), hidden.index_select(0, rows));
  if (grad_bias.numel() > 0) grad_bias.add_(coef.sum(0).to(grad_bias.scalar_type()));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> finish_hidden_fwd(const HeadOperands& hd, ForwardOutputs& f,
                                                                 bool fallback) {
  raise_row_error("replay_from_hidden", f.status, hd.rows);
  if (fallback) hidden_fallback_fwd(hd.h, hd.w, hd.b, hd.rows.ys, hd.rows.ts, f.status, f.logp, f.lse);
  return {f.logp, f.lse, f.status};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> finish_hidden_bwd(const HeadOperands& hd, const SavedOperands& sv,
                                                                 const at::Tensor& err, at::Tensor& gh, at::Tensor& gw,
                                                                 at::Tensor& gb) {
  raise_row_error("replay_from_hidden_bwd", err, hd.rows);
  hidden_fallback_bwd(sv.g, hd.h, hd.w, hd.b, hd.rows.ys, hd.rows.ts, sv.ls, sv.st, gh, gw, gb);
  return {gh, gw, gb};
}

}  // namespace mask_replay
