// CPU kernels of replay from logits: replay_fwd/bwd, full_fwd/bwd, kept_mass. Rows run in
// parallel; a replayed row reads only its |K| gathered logits, so the sparse paths cost O(nnz)
// plus the one unavoidable write of the dense [N, V] gradient.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "capture_cpu_loops.h"
#include "kernels/replay_math.h"
#include "parallel_grain.h"
#include "replay_checks.h"

namespace mask_replay {
namespace {

constexpr int64_t kChunk = 256;  // values staged per step of a full-row pass (fits in L1)

template <class T, class A>
A logit(const T* row, int64_t s1, int64_t j, A t) {
  return static_cast<A>(row[j * s1]) / t;
}

// buf[i] = x = z / t for the n columns from c0 (the chunked full-row loops; the unit-stride loop
// is kept apart so it vectorises).
template <class T, class A>
void stage_chunk(const T* row, int64_t s1, int64_t c0, int64_t n, A t, A* buf) {
  const T* src = row + c0 * s1;
  if (s1 == 1) {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<A>(src[i]) / t;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<A>(src[i * s1]) / t;
  }
}

// Logsumexp of a whole row of x = z / t: the one definition of logZ that full_logprobs,
// kept_mass and capture's kept mass share. float rows (any layout) take the vectorised pass: x
// staged once with its max, then the sum of det_exp(x - max) in double; rows with NaN/+inf, and
// float64 rows, take the chunked loop below, which decides what they return.
template <class T, class A>
double full_row_lse(const T* row, int64_t s1, int64_t vocab, A t) {
  if constexpr (std::is_same_v<A, float> && !std::is_same_v<T, double>) {
    // A strided row is gathered first, so its result is bit-identical to the contiguous row's.
    static thread_local std::vector<T> gathered;
    const T* src = row;
    if (s1 != 1) {
      gathered.resize(vocab);
      for (int64_t i = 0; i < vocab; ++i) gathered[i] = row[i * s1];
      src = gathered.data();
    }
    static thread_local std::vector<float> x;
    x.resize(vocab);
    const cpu::LoadResult lr = cpu::load_row(src, vocab, t, x.data());
    if (lr.bad_code == 0) {
      if (lr.max == neg_inf<float>()) return -std::numeric_limits<double>::infinity();
      return lse_value(lr.max, cpu::sum_exp_shifted(x.data(), vocab, lr.max));
    }
  }
  A m = neg_inf<A>();
  double s = 0.0;
  bool nan = false, pinf = false;
  A buf[kChunk];
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const int64_t n = std::min(kChunk, vocab - c0);
    stage_chunk(row, s1, c0, n, t, buf);
    A cm = neg_inf<A>();
    for (int64_t i = 0; i < n; ++i) cm = buf[i] > cm ? buf[i] : cm;
    for (int64_t i = 0; i < n; ++i) nan |= buf[i] != buf[i];
    if (cm == neg_inf<A>()) continue;
    if (cm > static_cast<A>(kMaxFinite)) pinf = true;
    if constexpr (std::is_same_v<A, float>) {
      cpu::exp_shifted_inplace(buf, n, cm);  // AVX2 det_exp: the same bits as exp_nonpos
    } else {
      for (int64_t i = 0; i < n; ++i) buf[i] = exp_nonpos(static_cast<A>(buf[i] - cm));
    }
    double acc[4] = {0.0, 0.0, 0.0, 0.0};  // fixed order: the result does not depend on threads
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
      for (int u = 0; u < 4; ++u) acc[u] += static_cast<double>(buf[i + u]);
    for (; i < n; ++i) acc[0] += static_cast<double>(buf[i]);
    lse_merge(m, s, cm, (acc[0] + acc[1]) + (acc[2] + acc[3]));
  }
  if (nan) return std::numeric_limits<double>::quiet_NaN();
  if (pinf) return std::numeric_limits<double>::infinity();
  return lse_value(m, s);
}

// Gradient of g * log softmax(z / t)[y] over a whole row into out (contiguous).
template <class T, class A>
void full_row_grad(const T* row, int64_t s1, int64_t vocab, A t, double lse, A g_over_t, int64_t y, T* out) {
  A buf[kChunk];
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const int64_t n = std::min(kChunk, vocab - c0);
    stage_chunk(row, s1, c0, n, t, buf);
    for (int64_t i = 0; i < n; ++i) out[c0 + i] = static_cast<T>(grad_coef(g_over_t, prob_of(buf[i], lse), false));
  }
  out[y] = static_cast<T>(grad_coef(g_over_t, prob_of(logit(row, s1, y, t), lse), true));
}

struct RowOut {
  double logp = 0.0;
  double lse = 0.0;
  int8_t status = kReplayed;
};

// Logsumexp over row r's support (entries checked as read) and the sampled token's x (y = -1: none).
template <class T, class A>
int8_t support_lse(const T* row, int64_t s1, const RowInputs& in, int64_t r, A t, int64_t y, A& m, double& s, A& xy,
                   bool& found) {
  return support_scan(
      in.ids, in.off[r], in.off[r + 1], in.vocab, y, [&](int64_t id) { return logit(row, s1, id, t); }, m, s, xy,
      found);
}

template <class T, class A>
RowOut replay_row(const T* row, int64_t s1, const RowInputs& in, int64_t r, bool fallback) {
  RowOut o;
  o.status = precheck_row(in, r);
  if (o.status != kReplayed) return o;
  const A t = static_cast<A>(in.ts[r]);
  const int64_t y = in.ys[r];
  A m, xy = 0;
  double s;
  bool found;
  o.status = support_lse(row, s1, in, r, t, y, m, s, xy, found);
  if (o.status != kReplayed) return o;
  o.status = row_decision(in.off[r + 1] - in.off[r], found, fallback);
  if (o.status < 0) return o;
  if (o.status == kReplayed) {
    o.lse = lse_value(m, s);
  } else {
    o.lse = full_row_lse(row, s1, in.vocab, t);
    xy = logit(row, s1, y, t);
  }
  o.logp = static_cast<double>(xy) - o.lse;
  return o;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> replay_fwd_cpu(const at::Tensor& logits, const at::Tensor& token_ids,
                                                              const at::Tensor& offsets, const at::Tensor& sampled,
                                                              const at::Tensor& temperature, bool fallback) {
  const RowOperands a = replay_operands("replay", logits, token_ids, offsets, sampled, temperature);
  const RowInputs in = a.view();
  ForwardOutputs f = forward_outputs(logits, a.n);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "replay_fwd_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    const auto x = logits_view<scalar_t>(logits);
    const auto out = forward_ptrs<A>(f);
    at::parallel_for(0, a.n, rows_per_task(in.nnz, a.n, 1), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const RowOut o = replay_row<scalar_t, A>(x.row(r), x.s1, in, r, fallback);
        out.logp[r] = static_cast<A>(o.logp);
        out.lse[r] = static_cast<A>(o.lse);
        out.status[r] = o.status;
      }
    });
  });
  return finish_forward("replay", f, a);
}

at::Tensor replay_bwd_cpu(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& token_ids,
                          const at::Tensor& offsets, const at::Tensor& sampled, const at::Tensor& temperature,
                          const at::Tensor& lse, const at::Tensor& status) {
  const RowOperands a = replay_operands("replay_bwd", logits, token_ids, offsets, sampled, temperature);
  const SavedOperands sv =
      saved_operands("replay_bwd", grad, lse, status, a.n, replay_out_dtype(logits.scalar_type()), logits.device());
  const RowInputs in = a.view();
  const int64_t vocab = a.vocab;
  // The only [N, V] allocation: the gradient itself, zeroed row by row in the same parallel pass
  // that scatters K, so each row is touched once and by the thread that fills it.
  at::Tensor out = at::empty({a.n, vocab}, logits.options());
  at::Tensor err = row_status(logits, a.n);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "replay_bwd_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    const auto x = logits_view<scalar_t>(logits);
    const auto saved = saved_ptrs<A>(sv);
    int8_t* ep = err.data_ptr<int8_t>();
    scalar_t* outp = out.data_ptr<scalar_t>();
    at::parallel_for(0, a.n, rows_per_task(a.vocab), [&](int64_t r0, int64_t r1) {  // a dense row written
      for (int64_t r = r0; r < r1; ++r) {
        scalar_t* o = outp + r * vocab;
        // The saved tensors are inputs like any other: this row's offsets, ids, sampled token
        // and temperature are checked again before anything is dereferenced.
        int8_t e = precheck_row(in, r);
        if (e == kReplayed) e = check_entries(in.ids, in.off[r], in.off[r + 1], vocab);
        ep[r] = e;
        if (e != kReplayed) continue;  // raised below
        const A t = static_cast<A>(in.ts[r]);
        const A gt = saved.g[r] / t;
        const double l = static_cast<double>(saved.lse[r]);
        if (saved.status[r] > 0) {
          full_row_grad<scalar_t, A>(x.row(r), x.s1, vocab, t, l, gt, in.ys[r], o);
          continue;
        }
        std::memset(static_cast<void*>(o), 0, sizeof(scalar_t) * vocab);  // zero is all-bits-zero in every dtype
        if (saved.status[r] < 0) continue;
        for (int64_t q = in.off[r]; q < in.off[r + 1]; ++q) {
          const int64_t id = in.ids[q];
          const A p = prob_of(logit(x.row(r), x.s1, id, t), l);
          o[id] = static_cast<scalar_t>(grad_coef(gt, p, id == in.ys[r]));
        }
      }
    });
  });
  raise_row_error("replay_bwd", err, a);
  return out;
}

std::tuple<at::Tensor, at::Tensor> full_fwd_cpu(const at::Tensor& logits, const at::Tensor& sampled,
                                                const at::Tensor& temperature) {
  const RowOperands a = full_operands("full_logprobs", logits, sampled, temperature);
  const RowInputs in = a.view();
  ForwardOutputs f = forward_outputs(logits, a.n);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "full_fwd_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    const auto x = logits_view<scalar_t>(logits);
    const auto out = forward_ptrs<A>(f);
    at::parallel_for(0, a.n, rows_per_task(a.vocab), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        out.status[r] = precheck_row(in, r);
        if (out.status[r] != kReplayed) continue;
        const A t = static_cast<A>(in.ts[r]);
        const double l = full_row_lse(x.row(r), x.s1, a.vocab, t);
        out.lse[r] = static_cast<A>(l);
        out.logp[r] = static_cast<A>(static_cast<double>(logit(x.row(r), x.s1, in.ys[r], t)) - l);
      }
    });
  });
  raise_row_error("full_logprobs", f.status, a);  // full_fwd returns no status
  return {f.logp, f.lse};
}

at::Tensor full_bwd_cpu(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& sampled,
                        const at::Tensor& temperature, const at::Tensor& lse) {
  const RowOperands a = full_operands("full_logprobs_bwd", logits, sampled, temperature);
  const SavedOperands sv = saved_operands("full_logprobs_bwd", grad, lse, at::Tensor(), a.n,
                                          replay_out_dtype(logits.scalar_type()), logits.device());
  const RowInputs in = a.view();
  at::Tensor out = at::empty({a.n, a.vocab}, logits.options());
  at::Tensor err = row_status(logits, a.n);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "full_bwd_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    const auto x = logits_view<scalar_t>(logits);
    const auto saved = saved_ptrs<A>(sv);
    int8_t* ep = err.data_ptr<int8_t>();
    scalar_t* outp = out.data_ptr<scalar_t>();
    at::parallel_for(0, a.n, rows_per_task(a.vocab), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        ep[r] = precheck_row(in, r);
        if (ep[r] != kReplayed) continue;  // raised below
        const A t = static_cast<A>(in.ts[r]);
        full_row_grad<scalar_t, A>(x.row(r), x.s1, a.vocab, t, static_cast<double>(saved.lse[r]), saved.g[r] / t,
                                   in.ys[r], outp + r * a.vocab);
      }
    });
  });
  raise_row_error("full_logprobs_bwd", err, a);
  return out;
}

at::Tensor kept_mass_cpu(const at::Tensor& logits, const at::Tensor& token_ids, const at::Tensor& offsets,
                         const at::Tensor& temperature) {
  const RowOperands a = replay_operands("kept_mass", logits, token_ids, offsets, at::Tensor(), temperature);
  const RowInputs in = a.view();
  at::Tensor kept = at::empty({a.n}, logits.options().dtype(replay_out_dtype(logits.scalar_type())));
  at::Tensor status = row_status(logits, a.n);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "kept_mass_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    const auto x = logits_view<scalar_t>(logits);
    A* kp = kept.data_ptr<A>();
    int8_t* sp = status.data_ptr<int8_t>();
    at::parallel_for(0, a.n, rows_per_task(a.vocab), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        sp[r] = precheck_row(in, r);
        if (sp[r] != kReplayed) continue;
        const A t = static_cast<A>(in.ts[r]);
        const scalar_t* row = x.row(r);
        A m, xy = 0;
        double s;
        bool found;
        sp[r] = support_lse(row, x.s1, in, r, t, int64_t(-1), m, s, xy, found);
        if (sp[r] != kReplayed) continue;
        // An empty support keeps no mass: lse_K = -inf gives exp(-inf) = 0.
        kp[r] = static_cast<A>(kept_fraction(lse_value(m, s), full_row_lse(row, x.s1, a.vocab, t)));
      }
    });
  });
  raise_row_error("kept_mass", status, a);
  return kept;
}

}  // namespace

TORCH_LIBRARY_IMPL(mask_replay, CPU, m) {
  impl_ops(m, kLogitsOps, &replay_fwd_cpu, &replay_bwd_cpu, &full_fwd_cpu, &full_bwd_cpu, &kept_mass_cpu);
}

}  // namespace mask_replay
