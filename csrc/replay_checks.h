// Validation of the replay ops, shared by the CPU and CUDA registrations: every op wrapper calls
// one *_operands function, which checks shapes, dtypes and devices once and returns the inputs
// contiguous, with the plain-pointer view (RowInputs) that the kernels of both devices read.
// Per-row defects (bad offsets, ids, sampled tokens, temperatures) are found by the kernels in the
// pass that reads them, as negative status codes (replay_math.h), and raise_row_error turns the
// first one into a message naming the argument and the row.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <array>
#include <tuple>

#include "kernels/replay_math.h"

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
// The end of replay_fwd on both devices: raise the first row error, else return the outputs.
std::tuple<at::Tensor, at::Tensor, at::Tensor> finish_forward(const char* op, const ForwardOutputs& f,
                                                              const RowOperands& a);
// A per-row int8 status of an op that returns none (backward ops, kept_mass): errors only.
at::Tensor row_status(const at::Tensor& like, int64_t n);

// Typed views the kernels of both devices index through (plain pointers, passed by value).
template <class T>
struct LogitsView {
  const T* z;
  int64_t s0, s1;
  MR_HD const T* row(int64_t r) const { return z + r * s0; }  // column j at row(r)[j * s1]
};
template <class T>
LogitsView<T> logits_view(const at::Tensor& logits) {
  return {logits.const_data_ptr<T>(), logits.stride(0), logits.stride(1)};
}

template <class A>
struct ForwardPtrs {
  A* logp;
  A* lse;
  int8_t* status;
};
template <class A>
ForwardPtrs<A> forward_ptrs(ForwardOutputs& f) {
  return {f.logp.data_ptr<A>(), f.lse.data_ptr<A>(), f.status.data_ptr<int8_t>()};
}

template <class A>
struct SavedPtrs {
  const A* g;
  const A* lse;
  const int8_t* status;  // nullptr for full_bwd
};
template <class A>
SavedPtrs<A> saved_ptrs(const SavedOperands& s) {
  return {s.g.const_data_ptr<A>(), s.ls.const_data_ptr<A>(), s.st.defined() ? s.st.const_data_ptr<int8_t>() : nullptr};
}

// The ops each device registers, in the order their kernels are passed to impl_ops.
constexpr std::array<const char*, 5> kLogitsOps = {"replay_fwd", "replay_bwd", "full_fwd", "full_bwd", "kept_mass"};
constexpr std::array<const char*, 2> kHeadOps = {"hidden_fwd", "hidden_bwd"};

template <size_t N, class... Kernels>
void impl_ops(torch::Library& m, const std::array<const char*, N>& names, Kernels... kernels) {
  static_assert(N == sizeof...(Kernels), "one kernel per op name");
  size_t i = 0;
  (m.impl(names[i++], kernels), ...);
}

// Raises for the first row whose status is an error. status may live on any device (one copy,
// which is the only host synchronisation of a CUDA op).
void raise_row_error(const char* op, const at::Tensor& status, const RowOperands& a);

}  // namespace mask_replay
