// Pieces of the sparse LM head shared by the CPU and CUDA registrations, written with ATen ops so
// they run on either device.
#pragma once
#include <ATen/core/Tensor.h>

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

}  // namespace mask_replay
