// CPU kernels of replay from logits: replay_fwd/bwd, full_fwd/bwd, kept_mass. Rows run in
// parallel; a replayed row reads only its |K| gathered logits, so the sparse paths cost O(nnz)
// plus the one unavoidable write of the dense [N, V] gradient.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "capture_cpu_loops.h"
#include "replay_checks.h"
#include "replay_math.h"

namespace mask_replay {
namespace {

constexpr int64_t kChunk = 256;        // values staged per step of a full-row pass (fits in L1)
constexpr int64_t kSparseGrain = 64;   // rows per task when rows read a few logits each

template <class T, class A>
A logit(const T* row, int64_t s1, int64_t j, A t) {
  return static_cast<A>(row[j * s1]) / t;
}

// Logsumexp of a whole row of x = z / t in one pass over memory: each chunk is staged once, its
// max taken, then its exps summed; exp_nonpos is branch free, so that loop vectorises.
template <class T, class A>
double full_row_lse(const T* row, int64_t s1, int64_t vocab, A t) {
  if constexpr (std::is_same_v<A, float> && !std::is_same_v<T, double>) {
    if (s1 == 1) {
      // Fast path (contiguous fp32/bf16/fp16 rows): the capture kernel's vectorised load and
      // exp. Rows with NaN/+inf take the general loop below, which decides what they return.
      static thread_local std::vector<float> x;
      x.resize(vocab);
      const cpu::LoadResult lr = cpu::load_row(row, vocab, t, x.data());
      if (lr.bad_code == 0) {
        if (lr.max == neg_inf<float>()) return -std::numeric_limits<double>::infinity();
        return lse_value(lr.max, cpu::sum_exp_shifted(x.data(), vocab, lr.max));
      }
    }
  }
  A m = neg_inf<A>();
  double s = 0.0;
  bool nan = false, pinf = false;
  A buf[kChunk];
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const int64_t n = std::min(kChunk, vocab - c0);
    const T* src = row + c0 * s1;
    if (s1 == 1) {
      for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<A>(src[i]) / t;
    } else {
      for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<A>(src[i * s1]) / t;
    }
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
    const T* src = row + c0 * s1;
    if (s1 == 1) {
      for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<A>(src[i]) / t;
    } else {
      for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<A>(src[i * s1]) / t;
    }
    for (int64_t i = 0; i < n; ++i) out[c0 + i] = static_cast<T>(grad_coef(g_over_t, prob_of(buf[i], lse), false));
  }
  out[y] = static_cast<T>(grad_coef(g_over_t, prob_of(logit(row, s1, y, t), lse), true));
}

struct RowOut {
  double logp = 0.0;
  double lse = 0.0;
  int8_t status = kReplayed;
};

template <class T, class A>
RowOut replay_row(const T* row, int64_t s1, int64_t vocab, const int32_t* ids, int64_t lo, int64_t hi, int64_t nnz,
                  float tf, int64_t y, bool fallback) {
  RowOut o;
  o.status = precheck_row(lo, hi, nnz, tf, y, vocab, true);
  if (o.status != kReplayed) return o;
  const A t = static_cast<A>(tf);
  A m = neg_inf<A>(), xy = 0;
  double s = 0.0;
  bool found = false;
  int64_t prev = -1;
  for (int64_t e = lo; e < hi; ++e) {
    const int64_t id = ids[e];
    o.status = check_entry(id, prev, vocab);
    if (o.status != kReplayed) return o;
    prev = id;
    const A x = logit(row, s1, id, t);
    lse_push(m, s, x);
    if (id == y) {
      found = true;
      xy = x;
    }
  }
  o.status = row_decision(hi - lo, found, fallback);
  if (o.status < 0) return o;
  if (o.status == kReplayed) {
    o.lse = lse_value(m, s);
  } else {
    o.lse = full_row_lse(row, s1, vocab, t);
    xy = logit(row, s1, y, t);
  }
  o.logp = static_cast<double>(xy) - o.lse;
  return o;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> replay_fwd_cpu(const at::Tensor& logits, const at::Tensor& token_ids,
                                                              const at::Tensor& offsets, const at::Tensor& sampled,
                                                              const at::Tensor& temperature, bool fallback) {
  check_replay_args("replay", logits, token_ids, offsets, sampled, temperature);
  const at::Tensor ids = token_ids.contiguous(), off = offsets.contiguous(), ys = sampled.contiguous(),
                   ts = temperature.contiguous();
  const int64_t n = logits.size(0), vocab = logits.size(1), nnz = ids.numel();
  const auto out = logits.options().dtype(replay_out_dtype(logits.scalar_type()));
  at::Tensor logp = at::empty({n}, out), lse = at::empty({n}, out);
  at::Tensor status = at::empty({n}, logits.options().dtype(at::kChar));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "replay_fwd_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* z = logits.const_data_ptr<scalar_t>();
    const int64_t s0 = logits.stride(0), s1 = logits.stride(1);
    const int32_t* idp = ids.const_data_ptr<int32_t>();
    const int64_t* op = off.const_data_ptr<int64_t>();
    const int64_t* yp = ys.const_data_ptr<int64_t>();
    const float* tp = ts.const_data_ptr<float>();
    A* lp = logp.data_ptr<A>();
    A* lsp = lse.data_ptr<A>();
    int8_t* sp = status.data_ptr<int8_t>();
    at::parallel_for(0, n, kSparseGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const RowOut o = replay_row<scalar_t, A>(z + r * s0, s1, vocab, idp, op[r], op[r + 1], nnz, tp[r], yp[r],
                                                 fallback);
        lp[r] = static_cast<A>(o.logp);
        lsp[r] = static_cast<A>(o.lse);
        sp[r] = o.status;
      }
    });
  });
  raise_row_error("replay", status, off, nnz, ys, ts, vocab);
  return {logp, lse, status};
}

at::Tensor replay_bwd_cpu(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& token_ids,
                          const at::Tensor& offsets, const at::Tensor& sampled, const at::Tensor& temperature,
                          const at::Tensor& lse, const at::Tensor& status) {
  check_replay_args("replay_bwd", logits, token_ids, offsets, sampled, temperature);
  const int64_t n = logits.size(0), vocab = logits.size(1);
  check_saved("replay_bwd", grad, lse, &status, n, replay_out_dtype(logits.scalar_type()), logits.device());
  const at::Tensor ids = token_ids.contiguous(), off = offsets.contiguous(), ys = sampled.contiguous(),
                   ts = temperature.contiguous(), g = grad.contiguous(), ls = lse.contiguous(),
                   st = status.contiguous();
  const int64_t nnz = ids.numel();
  // The only [N, V] allocation: the gradient itself, zeroed row by row in the same parallel pass
  // that scatters K, so each row is touched once and by the thread that fills it.
  at::Tensor out = at::empty({n, vocab}, logits.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "replay_bwd_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* z = logits.const_data_ptr<scalar_t>();
    const int64_t s0 = logits.stride(0), s1 = logits.stride(1);
    const int32_t* idp = ids.const_data_ptr<int32_t>();
    const int64_t* op = off.const_data_ptr<int64_t>();
    const int64_t* yp = ys.const_data_ptr<int64_t>();
    const float* tp = ts.const_data_ptr<float>();
    const A* gp = g.const_data_ptr<A>();
    const A* lsp = ls.const_data_ptr<A>();
    const int8_t* sp = st.const_data_ptr<int8_t>();
    scalar_t* outp = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, kSparseGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        scalar_t* o = outp + r * vocab;
        const scalar_t* row = z + r * s0;
        const A t = static_cast<A>(tp[r]);
        const A gt = gp[r] / t;
        const double l = static_cast<double>(lsp[r]);
        if (sp[r] > 0) {
          full_row_grad<scalar_t, A>(row, s1, vocab, t, l, gt, yp[r], o);
          continue;
        }
        std::memset(static_cast<void*>(o), 0, sizeof(scalar_t) * vocab);  // zero is all-bits-zero in every dtype
        if (sp[r] < 0) continue;
        // The forward validated these; the bounds only keep a direct misuse of the op memory safe.
        const int64_t lo = std::max<int64_t>(op[r], 0), hi = std::min(op[r + 1], nnz);
        for (int64_t e = lo; e < hi; ++e) {
          const int64_t id = idp[e];
          if (id < 0 || id >= vocab) continue;
          const A q = prob_of(logit(row, s1, id, t), l);
          o[id] = static_cast<scalar_t>(grad_coef(gt, q, id == yp[r]));
        }
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> full_fwd_cpu(const at::Tensor& logits, const at::Tensor& sampled,
                                                const at::Tensor& temperature) {
  check_logits("full_logprobs", logits);
  const int64_t n = logits.size(0), vocab = logits.size(1);
  check_vec("full_logprobs", sampled, "sampled", n, at::kLong, logits.device());
  check_vec("full_logprobs", temperature, "temperature", n, at::kFloat, logits.device());
  const at::Tensor ys = sampled.contiguous(), ts = temperature.contiguous();
  const auto out = logits.options().dtype(replay_out_dtype(logits.scalar_type()));
  at::Tensor logp = at::empty({n}, out), lse = at::empty({n}, out);
  at::Tensor status = at::empty({n}, logits.options().dtype(at::kChar));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "full_fwd_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* z = logits.const_data_ptr<scalar_t>();
    const int64_t s0 = logits.stride(0), s1 = logits.stride(1);
    const int64_t* yp = ys.const_data_ptr<int64_t>();
    const float* tp = ts.const_data_ptr<float>();
    A* lp = logp.data_ptr<A>();
    A* lsp = lse.data_ptr<A>();
    int8_t* sp = status.data_ptr<int8_t>();
    at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        sp[r] = precheck_row(0, 0, 0, tp[r], yp[r], vocab, true);
        if (sp[r] != kReplayed) continue;
        const A t = static_cast<A>(tp[r]);
        const scalar_t* row = z + r * s0;
        const double l = full_row_lse(row, s1, vocab, t);
        lsp[r] = static_cast<A>(l);
        lp[r] = static_cast<A>(static_cast<double>(logit(row, s1, yp[r], t)) - l);
      }
    });
  });
  raise_row_error("full_logprobs", status, at::zeros({n + 1}, at::kLong), 0, ys, ts, vocab);
  return {logp, lse};
}

at::Tensor full_bwd_cpu(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& sampled,
                        const at::Tensor& temperature, const at::Tensor& lse) {
  check_logits("full_logprobs_bwd", logits);
  const int64_t n = logits.size(0), vocab = logits.size(1);
  check_vec("full_logprobs_bwd", sampled, "sampled", n, at::kLong, logits.device());
  check_vec("full_logprobs_bwd", temperature, "temperature", n, at::kFloat, logits.device());
  check_saved("full_logprobs_bwd", grad, lse, nullptr, n, replay_out_dtype(logits.scalar_type()), logits.device());
  const at::Tensor ys = sampled.contiguous(), ts = temperature.contiguous(), g = grad.contiguous(),
                   ls = lse.contiguous();
  at::Tensor out = at::empty({n, vocab}, logits.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "full_bwd_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* z = logits.const_data_ptr<scalar_t>();
    const int64_t s0 = logits.stride(0), s1 = logits.stride(1);
    const int64_t* yp = ys.const_data_ptr<int64_t>();
    const float* tp = ts.const_data_ptr<float>();
    const A* gp = g.const_data_ptr<A>();
    const A* lsp = ls.const_data_ptr<A>();
    scalar_t* outp = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const A t = static_cast<A>(tp[r]);
        const int64_t y = std::clamp<int64_t>(yp[r], 0, vocab - 1);  // validated by the forward
        full_row_grad<scalar_t, A>(z + r * s0, s1, vocab, t, static_cast<double>(lsp[r]), gp[r] / t, y,
                                   outp + r * vocab);
      }
    });
  });
  return out;
}

at::Tensor kept_mass_cpu(const at::Tensor& logits, const at::Tensor& token_ids, const at::Tensor& offsets,
                         const at::Tensor& temperature) {
  check_replay_args("kept_mass", logits, token_ids, offsets, at::Tensor(), temperature);
  const at::Tensor ids = token_ids.contiguous(), off = offsets.contiguous(), ts = temperature.contiguous();
  const int64_t n = logits.size(0), vocab = logits.size(1), nnz = ids.numel();
  at::Tensor kept = at::empty({n}, logits.options().dtype(replay_out_dtype(logits.scalar_type())));
  at::Tensor status = at::empty({n}, logits.options().dtype(at::kChar));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "kept_mass_cpu", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* z = logits.const_data_ptr<scalar_t>();
    const int64_t s0 = logits.stride(0), s1 = logits.stride(1);
    const int32_t* idp = ids.const_data_ptr<int32_t>();
    const int64_t* op = off.const_data_ptr<int64_t>();
    const float* tp = ts.const_data_ptr<float>();
    A* kp = kept.data_ptr<A>();
    int8_t* sp = status.data_ptr<int8_t>();
    at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t lo = op[r], hi = op[r + 1];
        int8_t st = precheck_row(lo, hi, nnz, tp[r], 0, vocab, false);
        const A t = static_cast<A>(tp[r]);
        const scalar_t* row = z + r * s0;
        A m = neg_inf<A>();
        double s = 0.0;
        int64_t prev = -1;
        for (int64_t e = lo; st == kReplayed && e < hi; ++e) {
          st = check_entry(idp[e], prev, vocab);
          prev = idp[e];
          if (st == kReplayed) lse_push(m, s, logit(row, s1, prev, t));
        }
        sp[r] = st;
        if (st != kReplayed) continue;
        // An empty support keeps no mass: lse_K = -inf gives exp(-inf) = 0.
        kp[r] = static_cast<A>(::exp(lse_value(m, s) - full_row_lse(row, s1, vocab, t)));
      }
    });
  });
  raise_row_error("kept_mass", status, off, nnz, at::Tensor(), ts, vocab);
  return kept;
}

}  // namespace

TORCH_LIBRARY_IMPL(mask_replay, CPU, m) {
  m.impl("replay_fwd", &replay_fwd_cpu);
  m.impl("replay_bwd", &replay_bwd_cpu);
  m.impl("full_fwd", &full_fwd_cpu);
  m.impl("full_bwd", &full_bwd_cpu);
  m.impl("kept_mass", &kept_mass_cpu);
}

}  // namespace mask_replay
