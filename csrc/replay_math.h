// Per-row math of replay, shared by the CPU and CUDA kernels. Templates over the element type T
// (float, double, c10::Half, c10::BFloat16: anything convertible to A) and the compute type A
// (float, or double for float64 input); no torch types are named here.
#pragma once
#include <cmath>
#include <cstdint>

#include "kernel_math.h"

namespace mask_replay {

// Row status. Values >= 0 are returned to the caller; negative ones are errors that the host
// turns into a message naming the row (kernels cannot throw, so both devices report this way).
enum ReplayStatus : int8_t {
  kReplayed = 0,
  kFellBackOutside = 1,  // sampled token outside K: full-vocabulary log-prob
  kFellBackEmpty = 2,    // empty K: full-vocabulary log-prob
  kErrOutside = -1,
  kErrEmpty = -2,
  kErrTemperature = -3,
  kErrSampledRange = -4,
  kErrTokenRange = -5,
  kErrNotAscending = -6,
  kErrOffsets = -7,
};

constexpr float kMaxFinite = 3.402823466e+38f;

template <class A>
MR_HD A neg_inf() {
  return static_cast<A>(-__builtin_huge_val());
}

// exp of a non-positive argument (all our exps are of x - max or x - lse). float uses det_exp,
// built from correctly rounded operations: it vectorises on the host and gives the same bits on
// the device; double (gradcheck) uses the library exp.
MR_HD float exp_nonpos(float d) { return det_exp(d); }
MR_HD double exp_nonpos(double d) { return ::exp(d); }

// Online logsumexp: running max m (compute type) and sum s = sum exp(x - m) in double, so the
// result does not depend on how many values a thread saw before merging.
template <class A>
MR_HD void lse_push(A& m, double& s, A x) {
  if (x > m) {
    s = s * static_cast<double>(exp_nonpos(static_cast<A>(m - x))) + 1.0;
    m = x;
  } else if (x != x) {
    // NaN poisons s, as it should. Said explicitly: det_exp maps NaN to 0, so for float it would
    // otherwise vanish, and the CUDA full-row lse would then disagree with the CPU's (NaN).
    s = static_cast<double>(x);
  } else if (!(x == neg_inf<A>())) {
    s += static_cast<double>(exp_nonpos(static_cast<A>(x - m)));
  }
}

// Merges (m2, s2) into (m, s). Symmetric up to commutativity of one add, so a xor-butterfly
// over a warp leaves the same value in every lane.
template <class A>
MR_HD void lse_merge(A& m, double& s, A m2, double s2) {
  if (m2 > m) {
    s = s * static_cast<double>(exp_nonpos(static_cast<A>(m - m2))) + s2;
    m = m2;
  } else if (!(m2 == neg_inf<A>()) || s2 != s2) {  // a part that saw only -inf and NaN is NaN
    s += s2 * static_cast<double>(exp_nonpos(static_cast<A>(m2 - m)));
  }
}

template <class A>
MR_HD double lse_value(A m, double s) {
  return static_cast<double>(m) + ::log(s);
}

// Probability of a token of logit x (already divided by T) under a row of logsumexp lse. The
// difference is taken in double: lse can be large and x - lse is small relative to it.
template <class A>
MR_HD A prob_of(A x, double lse) {
  return exp_nonpos(static_cast<A>(static_cast<double>(x) - lse));
}

// d logp / d z_j = (1/T)(1[j = y] - q_j), scaled by the incoming gradient g (g_over_t = g / T).
// For |K| = 1 with j = y, q = exp(0) = 1 exactly, so the coefficient is exactly 0.
template <class A>
MR_HD A grad_coef(A g_over_t, A q, bool is_sampled) {
  return g_over_t * ((is_sampled ? static_cast<A>(1) : static_cast<A>(0)) - q);
}

// Checks a row can be read safely and its parameters make sense; kReplayed when it can.
MR_HD int8_t precheck_row(int64_t lo, int64_t hi, int64_t nnz, float t, int64_t y, int64_t vocab,
                          bool has_sampled) {
  if (lo < 0 || hi < lo || hi > nnz) return kErrOffsets;
  if (!(t > 0.0f && t <= kMaxFinite)) return kErrTemperature;  // NaN fails both
  if (has_sampled && (y < 0 || y >= vocab)) return kErrSampledRange;
  return kReplayed;
}

// One support entry: in range and strictly after the previous one (prev = -1 for the first).
MR_HD int8_t check_entry(int64_t id, int64_t prev, int64_t vocab) {
  if (id < 0 || id >= vocab) return kErrTokenRange;
  if (id <= prev) return kErrNotAscending;
  return kReplayed;
}

// After scanning a valid row: replay it, fall back to the full vocabulary, or fail.
MR_HD int8_t row_decision(int64_t len, bool found_sampled, bool fallback) {
  if (len == 0) return fallback ? kFellBackEmpty : kErrEmpty;
  if (!found_sampled) return fallback ? kFellBackOutside : kErrOutside;
  return kReplayed;
}

}  // namespace mask_replay
