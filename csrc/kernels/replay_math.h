// Per-row math of replay, shared by the CPU and CUDA kernels. Templates over the element type T
// (float, double, c10::Half, c10::BFloat16: anything convertible to A) and the compute type A
// (float, or double for float64 input); no torch types are named here.
#pragma once
#include <cmath>
#include <cstdint>

#include "kernels/kernel_math.h"

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

// The mass a support keeps, exp(lse_K - lse_V). K is a subset of V, so it is at most 1; the two
// sums are rounded separately, so a support holding (nearly) all the mass could come out a few
// ulps above 1: the bound is enforced here, the one place both devices take it from.
MR_HD double kept_fraction(double lse_k, double lse_v) {
  const double d = lse_k - lse_v;
  return d >= 0.0 ? 1.0 : ::exp(d);  // NaN fails the test and stays NaN
}

// d logp / d z_j = (1/T)(1[j = y] - q_j), scaled by the incoming gradient g (g_over_t = g / T).
// For |K| = 1 with j = y, q = exp(0) = 1 exactly, so the coefficient is exactly 0.
template <class A>
MR_HD A grad_coef(A g_over_t, A q, bool is_sampled) {
  return g_over_t * ((is_sampled ? static_cast<A>(1) : static_cast<A>(0)) - q);
}

// The per-row inputs of a replay op as plain pointers (no torch types), filled once on the host by
// replay_checks.h and passed by value to the CPU loops and the CUDA kernels alike.
struct RowInputs {
  const int32_t* ids;  // token_ids [nnz]; nullptr for the full-vocabulary ops
  const int64_t* off;  // offsets [n + 1]; nullptr for the full-vocabulary ops
  const int64_t* ys;   // sampled [n]; nullptr for kept_mass
  const float* ts;     // temperature [n]
  int64_t n, vocab, nnz;
};

// The CSR contract of SamplingMask.validate(), checked row by row where the row is read:
// offsets[0] == 0, offsets never decrease, offsets[n] == nnz. The local bounds (lo >= 0,
// hi <= nnz) make every row safe to read even before the other rows have been checked.
MR_HD bool row_offsets_ok(const RowInputs& in, int64_t r) {
  const int64_t lo = in.off[r], hi = in.off[r + 1];
  return lo >= 0 && lo <= hi && hi <= in.nnz && (r > 0 || lo == 0) && (r < in.n - 1 || hi == in.nnz);
}

// Checks row r can be read safely and its parameters make sense; kReplayed when it can. Every
// op calls it for every row it touches, backward ops included: their inputs are as untrusted.
MR_HD int8_t precheck_row(const RowInputs& in, int64_t r) {
  if (in.off && !row_offsets_ok(in, r)) return kErrOffsets;
  const float t = in.ts[r];
  if (!(t > 0.0f && t <= kMaxFinite)) return kErrTemperature;  // NaN fails both
  if (in.ys && (in.ys[r] < 0 || in.ys[r] >= in.vocab)) return kErrSampledRange;
  return kReplayed;
}

// One support entry: in range and strictly after the previous one (prev = -1 for the first).
MR_HD int8_t check_entry(int64_t id, int64_t prev, int64_t vocab) {
  if (id < 0 || id >= vocab) return kErrTokenRange;
  if (id <= prev) return kErrNotAscending;
  return kReplayed;
}

// A whole row's entries, one after another (the sequential loops; CUDA warps check in parallel).
MR_HD int8_t check_entries(const int32_t* ids, int64_t lo, int64_t hi, int64_t vocab) {
  int64_t prev = -1;
  for (int64_t e = lo; e < hi; ++e) {
    const int8_t st = check_entry(ids[e], prev, vocab);
    if (st != kReplayed) return st;
    prev = ids[e];
  }
  return kReplayed;
}

// Entries checked in parallel must report what check_entries reports: the error of the first
// failing entry, not the smallest code (ids [3, 200000, 5] at V = 151936 fail with "outside
// [0, V)" at entry 1 and "not ascending" at entry 2). A failure is packed as (entry << 8) | -code,
// so the minimum over any split of the entries is the first entry's failure.
constexpr int64_t kNoEntryError = INT64_MAX;
MR_HD int64_t pack_entry_error(int64_t entry, int8_t code) {
  return code == kReplayed ? kNoEntryError : (entry << 8) | static_cast<int64_t>(-code);
}
MR_HD int8_t entry_error_code(int64_t packed) {
  return packed == kNoEntryError ? static_cast<int8_t>(kReplayed) : static_cast<int8_t>(-(packed & 0xff));
}
// One of `lanes` checkers of the row's entries [lo, hi): lane l takes entries lo + l, lo + l +
// lanes, ... (each against its predecessor) and returns its first failure, packed. The minimum
// over all lanes, decoded by entry_error_code, equals check_entries.
MR_HD int64_t lane_entry_errors(const int32_t* ids, int64_t lo, int64_t hi, int64_t vocab, int lane, int lanes) {
  for (int64_t e = lo + lane; e < hi; e += lanes) {
    const int8_t st = check_entry(ids[e], e > lo ? static_cast<int64_t>(ids[e - 1]) : -1, vocab);
    if (st != kReplayed) return pack_entry_error(e, st);
  }
  return kNoEntryError;
}

// Logsumexp over a row's support ids[lo, hi), each entry checked before logit(id) reads it (x =
// z_id / T), and x of the sampled token y (-1: none). Sequential: the CPU loops, and the CUDA
// sparse head, where a whole warp computes each logit. Returns kReplayed or the entry's error.
template <class A, class Logit>
MR_HD int8_t support_scan(const int32_t* ids, int64_t lo, int64_t hi, int64_t vocab, int64_t y, const Logit& logit,
                          A& m, double& s, A& xy, bool& found) {
  m = neg_inf<A>();
  s = 0.0;
  found = false;
  int64_t prev = -1;
  for (int64_t e = lo; e < hi; ++e) {
    const int64_t id = ids[e];
    const int8_t st = check_entry(id, prev, vocab);
    if (st != kReplayed) return st;
    prev = id;
    const A x = logit(id);
    lse_push(m, s, x);
    if (id == y) {
      found = true;
      xy = x;
    }
  }
  return kReplayed;
}

// After scanning a valid row: replay it, fall back to the full vocabulary, or fail.
MR_HD int8_t row_decision(int64_t len, bool found_sampled, bool fallback) {
  if (len == 0) return fallback ? kFellBackEmpty : kErrEmpty;
  if (!found_sampled) return fallback ? kFellBackOutside : kErrOutside;
  return kReplayed;
}

}  // namespace mask_replay
