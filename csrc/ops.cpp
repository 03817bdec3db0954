// Operator schemas of the mask_replay namespace and the Python module that carries them.
// Kernels register per device in their own files (TORCH_LIBRARY_IMPL); fake kernels and autograd
// are registered from Python (mask_replay/_register.py).
//
// The module itself is a bare CPython module: importing it runs the static registrations below.
// It needs no pybind11 (torch/extension.h costs more compile time than all the kernels together);
// build_info is an operator returning JSON.
#include <Python.h>  // first: Python.h must precede the standard headers

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>

#include "cpu/capture_cpu_isa.h"

TORCH_LIBRARY(mask_replay, m) {
  // Support of the truncated sampling distribution as CSR. Parameters are per-row tensors
  // (temperature f32, top_k i64, top_p f64, min_p f64). logz is the selection's own normaliser
  // (f32), the log of the fixed-point masses' sum (masses below 2^-40 of the max count as 0),
  // computed only when compute_logz, else an empty tensor. The kept mass of a mask is not taken
  // from it but from kept_mass, whose logZ is full_fwd's.
  m.def(
      "capture(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, "
      "bool compute_logz) -> (Tensor token_ids, Tensor offsets, Tensor logz)");
  // Same support into a fixed [N, width] buffer padded with -1, per-row counts (the true support
  // size, which may exceed width) and an overflow flag per row. Never syncs with the host.
  m.def(
      "capture_fixed(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, "
      "Tensor min_p, int width) -> (Tensor token_ids, Tensor counts, Tensor overflow)");

  // Replay: log-prob of `sampled` over the CSR support. status per row (int8): 0 replayed,
  // 1 fell back to the full vocabulary (sampled outside K), 2 fell back (empty row).
  m.def(
      "replay_fwd(Tensor logits, Tensor token_ids, Tensor offsets, Tensor sampled, "
      "Tensor temperature, bool fallback) -> (Tensor logp, Tensor lse, Tensor status)");
  m.def(
      "replay_bwd(Tensor grad, Tensor logits, Tensor token_ids, Tensor offsets, Tensor sampled, "
      "Tensor temperature, Tensor lse, Tensor status) -> Tensor");
  m.def("full_fwd(Tensor logits, Tensor sampled, Tensor temperature) -> (Tensor logp, Tensor lse)");
  m.def("full_bwd(Tensor grad, Tensor logits, Tensor sampled, Tensor temperature, Tensor lse) -> Tensor");
  m.def("kept_mass(Tensor logits, Tensor token_ids, Tensor offsets, Tensor temperature) -> Tensor");
  // Sparse LM head: logits only for (row, token in K). bias may be an empty tensor (no bias).
  m.def(
      "hidden_fwd(Tensor hidden, Tensor weight, Tensor bias, Tensor token_ids, Tensor offsets, "
      "Tensor sampled, Tensor temperature, bool fallback) -> (Tensor logp, Tensor lse, Tensor status)");
  m.def(
      "hidden_bwd(Tensor grad, Tensor hidden, Tensor weight, Tensor bias, Tensor token_ids, "
      "Tensor offsets, Tensor sampled, Tensor temperature, Tensor lse, Tensor status) "
      "-> (Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)");
}

namespace {

std::string build_info() {
  std::string j = "{\"cpu\": true";
#if defined(MASK_REPLAY_WITH_CUDA)
  j += ", \"cuda\": true, \"cuda_arch_list\": \"" MASK_REPLAY_CUDA_ARCH_LIST "\"";
#else
  j += ", \"cuda\": false, \"cuda_arch_list\": \"\"";
#endif
  j += ", " + mask_replay::cpu::capture_isa_json();
  j += ", \"threads\": " + std::to_string(at::get_num_threads()) + "}";
  return j;
}

}  // namespace

// Which kernels this build contains, as a JSON object (read by mask_replay.build_info()).
TORCH_LIBRARY_FRAGMENT(mask_replay, m) { m.def("build_info() -> str", &build_info); }

namespace {
PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "mask_replay's compiled operators (torch.ops.mask_replay).", -1,
                          nullptr};
}  // namespace

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&module_def); }
