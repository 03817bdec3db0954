// Pieces of the sparse LM head shared by the CPU and CUDA registrations, written with ATen ops so
// they run on either device.
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

#include "replay_checks.h"

namespace mask_replay {

// Rows that fell back to the full vocabulary (status > 0) need the whole projection h @ W^T.
// They are rare, so they go through ATen's matmul as a dense [F, V] block; F = 0 costs one
// nonzero (a host synchronisation on CUDA). bias is empty when there is none; sampled was
// checked in range by the caller.
void hidden_fallback_fwd(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                         const at::Tensor& sampled, const at::Tensor& temperature, const at::Tensor& status,
                         at::Tensor& logp, at::Tensor& lse);

void hidden_fallback_bwd(const at::Tensor& grad, const at::Tensor& hidden, const at::Tensor& weight,
                         const at::Tensor& bias, const at::Tensor& sampled, const at::Tensor& temperature,
                         const at::Tensor& lse, const at::Tensor& status, at::Tensor& grad_hidden,
                         at::Tensor& grad_weight, at::Tensor& grad_bias);

// The common end of hidden_fwd on both devices: raise the first row error, fill the fallback rows.
std::tuple<at::Tensor, at::Tensor, at::Tensor> finish_hidden_fwd(const HeadOperands& hd, ForwardOutputs& f,
                                                                 bool fallback);

// The common end of hidden_bwd: raise the first row error (before the fallback rows gather their
// sampled tokens), add the fallback rows' dense gradients.
std::tuple<at::Tensor, at::Tensor, at::Tensor> finish_hidden_bwd(const HeadOperands& hd, const SavedOperands& sv,
                                                                 const at::Tensor& err, at::Tensor& gh, at::Tensor& gw,
                                                                 at::Tensor& gb);

}  // namespace mask_replay
