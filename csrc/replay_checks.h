// Validation of the replay ops, shared by the CPU and CUDA registrations: every op wrapper calls
// one *_operands function, which checks shapes, dtypes and devices once and returns the inputs
// contiguous, with the plain-pointer view (RowInputs) that the kernels of both devices read.
// Per-row defects (bad offsets, ids, sampled tokens, temperatures) are found by the kernels in the
// pass that reads them, as negative status codes (replay_math.h), and raise_row_error turns the
// first one into a message naming the argument and the row.
#pragma once
#include <ATen/core/Tensor.h>

#include "replay_math.h"

namespace mask_replay {

// float64 input (gradcheck) is computed and returned in double; everything else in float32.
at::ScalarType replay_out_dtype(at::ScalarType st);

// Validated inputs of one op. token_ids/offsets are undefined for the full-vocabulary ops,
// sampled for kept_mass.
struct RowOperands {
  at::Tensor ids, off, ys, ts;
  int64_t n = 0, vocab = 0, nnz = 0;
  RowInputs view() const;
};

// Ops over logits [N, V] with a mask (replay_fwd/bwd, kept_mass: pass an undefined sampled).
RowOperands replay_operands(const char* op, const at::Tensor& logits, const at::Tensor& token_ids,
                            const at::Tensor& offsets, const at::Tensor& sampled, const at::Tensor& temperature);
// Ops over the whole vocabulary (full_fwd/bwd).
RowOperands full_operands(const char* op, const at::Tensor& logits, const at::Tensor& sampled,
                          const at::Tensor& temperature);

// The sparse LM head: hidden [N, d] and bias contiguous, weight rows of unit stride at any row
// stride (a slice of a padded LM head is used without a copy).
struct HeadOperands {
  at::Tensor h, w, b;
  int64_t d = 0, ws = 0;
  bool bias = false;
  RowOperands rows;
};
HeadOperands head_operands(const char* op, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                           const at::Tensor& token_ids, const at::Tensor& offsets, const at::Tensor& sampled,
                           const at::Tensor& temperature);

// The forward state handed to a backward op (status undefined for full_bwd), contiguous.
struct SavedOperands {
  at::Tensor g, ls, st;
};
SavedOperands saved_operands(const char* op, const at::Tensor& grad, const at::Tensor& lse, const at::Tensor& status,
                             int64_t n, at::ScalarType out, const at::Device& dev);

// Outputs of a forward op: logp and lse [N] in the output dtype, status [N] int8.
struct ForwardOutputs {
  at::Tensor logp, lse, status;
};
ForwardOutputs forward_outputs(const at::Tensor& like, int64_t n);
// A per-row int8 status of an op that returns none (backward ops, kept_mass): errors only.
at::Tensor row_status(const at::Tensor& like, int64_t n);

// Raises for the first row whose status is an error. status may live on any device (one copy,
// which is the only host synchronisation of a CUDA op).
void raise_row_error(const char* op, const at::Tensor& status, const RowOperands& a);

}  // namespace mask_replay
