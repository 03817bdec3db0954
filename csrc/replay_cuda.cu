// CUDA kernels of the replay ops. One warp per row: a row of K reads |K| (mean ~8) gathered logits,
// so a block per row would leave most threads idle; full-vocabulary rows (fallback, full_fwd,
// kept_mass) stride the row across the warp's lanes with coalesced loads. Per-row defects are
// written as negative status codes and raised on the host after one copy of the status (the
// forward's only synchronisation).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "replay_checks.h"
#include "replay_hidden.h"
#include "replay_math.h"

namespace mask_replay {
namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 8;
constexpr int kThreads = kWarp * kRowsPerBlock;
constexpr unsigned kFull = 0xffffffffu;

unsigned blocks_for(int64_t rows) { return static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock); }

// The row (or item) of this warp; uniform across its lanes, so whole warps exit together and
// the full-mask shuffles below are always legal.
__device__ __forceinline__ int64_t warp_item() {
  return static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
}
__device__ __forceinline__ int lane_id() { return threadIdx.x % kWarp; }

// Butterfly reductions leave the same value in every lane (each step adds the same two values).
template <class A>
__device__ __forceinline__ A warp_sum(A v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
__device__ __forceinline__ int warp_min(int v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(kFull, v, o));
  return v;
}
template <class A>
__device__ __forceinline__ void warp_lse(A& m, double& s) {
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const A m2 = __shfl_xor_sync(kFull, m, o);
    const double s2 = __shfl_xor_sync(kFull, s, o);
    lse_merge(m, s, m2, s2);
  }
}

template <class T, class A>
__device__ __forceinline__ A logit_at(const T* row, int64_t s1, int64_t j, A t) {
  return static_cast<A>(row[j * s1]) / t;
}

template <class T, class A>
__device__ double warp_full_lse(const T* row, int64_t s1, int64_t vocab, A t) {
  A m = neg_inf<A>();
  double s = 0.0;
  for (int64_t j = lane_id(); j < vocab; j += kWarp) lse_push(m, s, logit_at(row, s1, j, t));
  warp_lse(m, s);
  return lse_value(m, s);
}

// Logsumexp over the row's support and the sampled token's x. Returns the row status (uniform).
template <class T, class A>
__device__ int warp_support_lse(const T* row, int64_t s1, int64_t vocab, const int32_t* ids, int64_t lo, int64_t hi,
                                int64_t y, A t, A& m, double& s, A& xy, bool& found) {
  int bad = kReplayed, hit = 0;
  m = neg_inf<A>();
  s = 0.0;
  xy = 0;
  for (int64_t e = lo + lane_id(); e < hi; e += kWarp) {
    const int64_t id = ids[e];
    const int es = check_entry(id, e > lo ? static_cast<int64_t>(ids[e - 1]) : -1, vocab);
    if (es != kReplayed) {
      bad = min(bad, es);
      continue;
    }
    const A x = logit_at(row, s1, id, t);
    lse_push(m, s, x);
    if (id == y) {
      hit = 1;
      xy = x;
    }
  }
  warp_lse(m, s);
  const unsigned who = __ballot_sync(kFull, hit);
  if (who) xy = __shfl_sync(kFull, xy, __ffs(who) - 1);
  found = who != 0;
  return warp_min(bad);
}

template <class T, class A>
__global__ void replay_fwd_kernel(const T* __restrict__ z, int64_t s0, int64_t s1, int64_t n, int64_t vocab,
                                  const int32_t* __restrict__ ids, const int64_t* __restrict__ off, int64_t nnz,
                                  const int64_t* __restrict__ ys, const float* __restrict__ ts, bool fallback,
                                  A* __restrict__ logp, A* __restrict__ lse, int8_t* __restrict__ status) {
  const int64_t r = warp_item();
  if (r >= n) return;
  const int64_t lo = off[r], hi = off[r + 1], y = ys[r];
  int st = precheck_row(lo, hi, nnz, ts[r], y, vocab, true);
  const T* row = z + r * s0;
  const A t = static_cast<A>(ts[r]);
  double l = 0.0;
  A xy = 0;
  if (st == kReplayed) {
    A m;
    double s;
    bool found;
    st = warp_support_lse(row, s1, vocab, ids, lo, hi, y, t, m, s, xy, found);
    if (st == kReplayed) st = row_decision(hi - lo, found, fallback);
    if (st == kReplayed) l = lse_value(m, s);
  }
  if (st > 0) {
    l = warp_full_lse(row, s1, vocab, t);
    xy = logit_at(row, s1, y, t);
  }
  if (lane_id() == 0) {
    status[r] = static_cast<int8_t>(st);
    lse[r] = static_cast<A>(st >= 0 ? l : 0.0);
    logp[r] = static_cast<A>(st >= 0 ? static_cast<double>(xy) - l : 0.0);
  }
}

// out is zero-filled beforehand; replayed rows scatter their |K| entries, fallback rows write all.
template <class T, class A>
__global__ void replay_bwd_kernel(const A* __restrict__ g, const T* __restrict__ z, int64_t s0, int64_t s1, int64_t n,
                                  int64_t vocab, const int32_t* __restrict__ ids, const int64_t* __restrict__ off,
                                  int64_t nnz, const int64_t* __restrict__ ys, const float* __restrict__ ts,
                                  const A* __restrict__ lse, const int8_t* __restrict__ status, T* __restrict__ out) {
  const int64_t r = warp_item();
  if (r >= n) return;
  const int8_t st = status[r];
  if (st < 0) return;
  const T* row = z + r * s0;
  T* o = out + r * vocab;
  const A t = static_cast<A>(ts[r]);
  const A gt = g[r] / t;
  const double l = static_cast<double>(lse[r]);
  const int64_t y = ys[r];
  if (st > 0) {
    for (int64_t j = lane_id(); j < vocab; j += kWarp)
      o[j] = static_cast<T>(grad_coef(gt, prob_of(logit_at(row, s1, j, t), l), j == y));
    return;
  }
  // The forward validated the row; the bounds only keep a direct misuse of the op memory safe.
  const int64_t lo = max(off[r], int64_t(0)), hi = min(off[r + 1], nnz);
  for (int64_t e = lo + lane_id(); e < hi; e += kWarp) {
    const int64_t id = ids[e];
    if (id < 0 || id >= vocab) continue;
    o[id] = static_cast<T>(grad_coef(gt, prob_of(logit_at(row, s1, id, t), l), id == y));
  }
}

template <class T, class A>
__global__ void full_fwd_kernel(const T* __restrict__ z, int64_t s0, int64_t s1, int64_t n, int64_t vocab,
                                const int64_t* __restrict__ ys, const float* __restrict__ ts, A* __restrict__ logp,
                                A* __restrict__ lse, int8_t* __restrict__ status) {
  const int64_t r = warp_item();
  if (r >= n) return;
  const int st = precheck_row(0, 0, 0, ts[r], ys[r], vocab, true);
  double l = 0.0, lp = 0.0;
  if (st == kReplayed) {
    const T* row = z + r * s0;
    const A t = static_cast<A>(ts[r]);
    l = warp_full_lse(row, s1, vocab, t);
    lp = static_cast<double>(logit_at(row, s1, ys[r], t)) - l;
  }
  if (lane_id() == 0) {
    status[r] = static_cast<int8_t>(st);
    lse[r] = static_cast<A>(l);
    logp[r] = static_cast<A>(lp);
  }
}

template <class T, class A>
__global__ void full_bwd_kernel(const A* __restrict__ g, const T* __restrict__ z, int64_t s0, int64_t s1, int64_t n,
                                int64_t vocab, const int64_t* __restrict__ ys, const float* __restrict__ ts,
                                const A* __restrict__ lse, T* __restrict__ out) {
  const int64_t r = warp_item();
  if (r >= n) return;
  const T* row = z + r * s0;
  T* o = out + r * vocab;
  const A t = static_cast<A>(ts[r]);
  const A gt = g[r] / t;
  const double l = static_cast<double>(lse[r]);
  const int64_t y = ys[r];
  for (int64_t j = lane_id(); j < vocab; j += kWarp)
    o[j] = static_cast<T>(grad_coef(gt, prob_of(logit_at(row, s1, j, t), l), j == y));
}

template <class T, class A>
__global__ void kept_mass_kernel(const T* __restrict__ z, int64_t s0, int64_t s1, int64_t n, int64_t vocab,
                                 const int32_t* __restrict__ ids, const int64_t* __restrict__ off, int64_t nnz,
                                 const float* __restrict__ ts, A* __restrict__ kept, int8_t* __restrict__ status) {
  const int64_t r = warp_item();
  if (r >= n) return;
  const int64_t lo = off[r], hi = off[r + 1];
  int st = precheck_row(lo, hi, nnz, ts[r], 0, vocab, false);
  double k = 0.0;
  if (st == kReplayed) {
    const T* row = z + r * s0;
    const A t = static_cast<A>(ts[r]);
    A m, xy;
    double s;
    bool found;
    st = warp_support_lse(row, s1, vocab, ids, lo, hi, int64_t(-1), t, m, s, xy, found);
    if (st == kReplayed) k = ::exp(lse_value(m, s) - warp_full_lse(row, s1, vocab, t));
  }
  if (lane_id() == 0) {
    status[r] = static_cast<int8_t>(st);
    kept[r] = static_cast<A>(k);
  }
}

// ---- sparse LM head ----------------------------------------------------------------------------

// z = h . w_id + b_id, summed across the warp (every lane gets it).
template <class T, class A>
__device__ __forceinline__ A warp_head_logit(const T* hr, const T* w, int64_t ws, const T* b, int64_t id, int64_t d) {
  const T* wr = w + id * ws;
  A part = 0;
  for (int64_t k = lane_id(); k < d; k += kWarp) part += static_cast<A>(hr[k]) * static_cast<A>(wr[k]);
  A zz = warp_sum(part);
  if (b) zz += static_cast<A>(b[id]);
  return zz;
}

template <class T, class A>
__global__ void hidden_fwd_kernel(const T* __restrict__ h, const T* __restrict__ w, int64_t ws, const T* __restrict__ b,
                                  int64_t n, int64_t d, int64_t vocab, const int32_t* __restrict__ ids,
                                  const int64_t* __restrict__ off, int64_t nnz, const int64_t* __restrict__ ys,
                                  const float* __restrict__ ts, bool fallback, A* __restrict__ logp,
                                  A* __restrict__ lse, int8_t* __restrict__ status) {
  const int64_t r = warp_item();
  if (r >= n) return;
  const int64_t lo = off[r], hi = off[r + 1], y = ys[r];
  int st = precheck_row(lo, hi, nnz, ts[r], y, vocab, true);
  const A t = static_cast<A>(ts[r]);
  const T* hr = h + r * d;
  A m = neg_inf<A>(), xy = 0;
  double s = 0.0;
  bool found = false;
  int64_t prev = -1;
  // Entries one after another, each dot product across the warp: st, m, s stay warp-uniform.
  for (int64_t e = lo; st == kReplayed && e < hi; ++e) {
    const int64_t id = ids[e];
    st = check_entry(id, prev, vocab);
    if (st != kReplayed) break;
    prev = id;
    const A x = warp_head_logit<T, A>(hr, w, ws, b, id, d) / t;
    lse_push(m, s, x);
    if (id == y) {
      found = true;
      xy = x;
    }
  }
  if (st == kReplayed) st = row_decision(hi - lo, found, fallback);
  if (lane_id() == 0) {
    status[r] = static_cast<int8_t>(st);
    const double l = st == kReplayed ? lse_value(m, s) : 0.0;  // fallback rows are filled by the host
    lse[r] = static_cast<A>(l);
    logp[r] = static_cast<A>(st == kReplayed ? static_cast<double>(xy) - l : 0.0);
  }
}

// Per row: the coefficient of every entry (to coef), its row (to row_of), and
// grad_hidden[r] = sum_K c_j w_j. Fallback rows get zeros here and are finished on the host.
template <class T, class A>
__global__ void hidden_bwd_rows_kernel(const A* __restrict__ g, const T* __restrict__ h, const T* __restrict__ w,
                                       int64_t ws, const T* __restrict__ b, int64_t n, int64_t d, int64_t vocab,
                                       const int32_t* __restrict__ ids, const int64_t* __restrict__ off, int64_t nnz,
                                       const int64_t* __restrict__ ys, const float* __restrict__ ts,
                                       const A* __restrict__ lse, const int8_t* __restrict__ status, A* coef,
                                       int64_t* __restrict__ row_of, T* __restrict__ gh) {
  const int64_t r = warp_item();
  if (r >= n) return;
  const int64_t lo = max(off[r], int64_t(0)), hi = min(off[r + 1], nnz);
  for (int64_t e = lo + lane_id(); e < hi; e += kWarp) row_of[e] = r;
  const bool live = status[r] == kReplayed;
  const T* hr = h + r * d;
  if (live) {
    const A t = static_cast<A>(ts[r]);
    const A gt = g[r] / t;
    const double l = static_cast<double>(lse[r]);
    for (int64_t e = lo; e < hi; ++e) {
      const int64_t id = ids[e];
      A c = 0;
      if (id >= 0 && id < vocab)
        c = grad_coef(gt, prob_of(warp_head_logit<T, A>(hr, w, ws, b, id, d) / t, l), id == ys[r]);
      if (lane_id() == 0) coef[e] = c;
    }
  } else {
    for (int64_t e = lo + lane_id(); e < hi; e += kWarp) coef[e] = 0;
  }
  __syncwarp();  // coef written by lane 0 is read by every lane below
  for (int64_t k = lane_id(); k < d; k += kWarp) {
    A acc = 0;
    for (int64_t e = lo; live && e < hi; ++e) {
      const int64_t id = ids[e];
      if (id >= 0 && id < vocab) acc += coef[e] * static_cast<A>(w[id * ws + k]);
    }
    gh[r * d + k] = static_cast<T>(acc);
  }
}

// One warp per position of the entries sorted by token; the warp at the head of a token's run
// sums the whole run: grad_weight[j] = sum c_e h[row_e]. Every weight row is written by one warp in
// a fixed order, so the result is deterministic and needs no atomics, and bf16 weights are
// accumulated in float and rounded once.
template <class T, class A>
__global__ void hidden_bwd_weight_kernel(const int32_t* __restrict__ sids, const int64_t* __restrict__ order,
                                         const A* __restrict__ coef, const int64_t* __restrict__ row_of,
                                         const T* __restrict__ h, int64_t nnz, int64_t d, int64_t vocab,
                                         T* __restrict__ gw, T* __restrict__ gb) {
  const int64_t p = warp_item();
  if (p >= nnz) return;
  const int64_t j = sids[p];
  if ((p > 0 && sids[p - 1] == j) || j < 0 || j >= vocab) return;
  int64_t end = p + 1;
  while (end < nnz && sids[end] == j) ++end;
  for (int64_t k = lane_id(); k < d; k += kWarp) {
    A acc = 0;
    for (int64_t q = p; q < end; ++q) {
      const int64_t e = order[q];
      acc += coef[e] * static_cast<A>(h[row_of[e] * d + k]);
    }
    gw[j * d + k] = static_cast<T>(acc);
  }
  if (gb && lane_id() == 0) {
    double bs = 0.0;
    for (int64_t q = p; q < end; ++q) bs += static_cast<double>(coef[order[q]]);
    gb[j] = static_cast<T>(bs);
  }
}

// ---- host wrappers -----------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor> replay_fwd_cuda(const at::Tensor& logits, const at::Tensor& token_ids,
                                                               const at::Tensor& offsets, const at::Tensor& sampled,
                                                               const at::Tensor& temperature, bool fallback) {
  check_replay_args("replay", logits, token_ids, offsets, sampled, temperature);
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor ids = token_ids.contiguous(), off = offsets.contiguous(), ys = sampled.contiguous(),
                   ts = temperature.contiguous();
  const int64_t n = logits.size(0), vocab = logits.size(1), nnz = ids.numel();
  const auto out = logits.options().dtype(replay_out_dtype(logits.scalar_type()));
  at::Tensor logp = at::empty({n}, out), lse = at::empty({n}, out);
  at::Tensor status = at::empty({n}, logits.options().dtype(at::kChar));
  if (n > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "replay_fwd_cuda", [&] {
      using A = at::opmath_type<scalar_t>;
      replay_fwd_kernel<scalar_t, A><<<blocks_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          logits.const_data_ptr<scalar_t>(), logits.stride(0), logits.stride(1), n, vocab,
          ids.const_data_ptr<int32_t>(), off.const_data_ptr<int64_t>(), nnz, ys.const_data_ptr<int64_t>(),
          ts.const_data_ptr<float>(), fallback, logp.data_ptr<A>(), lse.data_ptr<A>(), status.data_ptr<int8_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  raise_row_error("replay", status, off, nnz, ys, ts, vocab);
  return {logp, lse, status};
}

at::Tensor replay_bwd_cuda(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& token_ids,
                           const at::Tensor& offsets, const at::Tensor& sampled, const at::Tensor& temperature,
                           const at::Tensor& lse, const at::Tensor& status) {
  check_replay_args("replay_bwd", logits, token_ids, offsets, sampled, temperature);
  const int64_t n = logits.size(0), vocab = logits.size(1);
  check_saved("replay_bwd", grad, lse, &status, n, replay_out_dtype(logits.scalar_type()), logits.device());
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor ids = token_ids.contiguous(), off = offsets.contiguous(), ys = sampled.contiguous(),
                   ts = temperature.contiguous(), g = grad.contiguous(), ls = lse.contiguous(),
                   st = status.contiguous();
  at::Tensor out = at::zeros({n, vocab}, logits.options());  // a memset, then the scatter of K
  if (n > 0 && vocab > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "replay_bwd_cuda", [&] {
      using A = at::opmath_type<scalar_t>;
      replay_bwd_kernel<scalar_t, A><<<blocks_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          g.const_data_ptr<A>(), logits.const_data_ptr<scalar_t>(), logits.stride(0), logits.stride(1), n, vocab,
          ids.const_data_ptr<int32_t>(), off.const_data_ptr<int64_t>(), ids.numel(), ys.const_data_ptr<int64_t>(),
          ts.const_data_ptr<float>(), ls.const_data_ptr<A>(), st.const_data_ptr<int8_t>(), out.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> full_fwd_cuda(const at::Tensor& logits, const at::Tensor& sampled,
                                                 const at::Tensor& temperature) {
  check_logits("full_logprobs", logits);
  const int64_t n = logits.size(0), vocab = logits.size(1);
  check_vec("full_logprobs", sampled, "sampled", n, at::kLong, logits.device());
  check_vec("full_logprobs", temperature, "temperature", n, at::kFloat, logits.device());
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor ys = sampled.contiguous(), ts = temperature.contiguous();
  const auto out = logits.options().dtype(replay_out_dtype(logits.scalar_type()));
  at::Tensor logp = at::empty({n}, out), lse = at::empty({n}, out);
  at::Tensor status = at::empty({n}, logits.options().dtype(at::kChar));
  if (n > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "full_fwd_cuda", [&] {
      using A = at::opmath_type<scalar_t>;
      full_fwd_kernel<scalar_t, A><<<blocks_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          logits.const_data_ptr<scalar_t>(), logits.stride(0), logits.stride(1), n, vocab,
          ys.const_data_ptr<int64_t>(), ts.const_data_ptr<float>(), logp.data_ptr<A>(), lse.data_ptr<A>(),
          status.data_ptr<int8_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  raise_row_error("full_logprobs", status, at::zeros({n + 1}, at::kLong), 0, ys, ts, vocab);
  return {logp, lse};
}

at::Tensor full_bwd_cuda(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& sampled,
                         const at::Tensor& temperature, const at::Tensor& lse) {
  check_logits("full_logprobs_bwd", logits);
  const int64_t n = logits.size(0), vocab = logits.size(1);
  check_vec("full_logprobs_bwd", sampled, "sampled", n, at::kLong, logits.device());
  check_vec("full_logprobs_bwd", temperature, "temperature", n, at::kFloat, logits.device());
  check_saved("full_logprobs_bwd", grad, lse, nullptr, n, replay_out_dtype(logits.scalar_type()), logits.device());
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor ys = sampled.contiguous(), ts = temperature.contiguous(), g = grad.contiguous(),
                   ls = lse.contiguous();
  at::Tensor out = at::empty({n, vocab}, logits.options());  // every element is written
  if (n > 0 && vocab > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "full_bwd_cuda", [&] {
      using A = at::opmath_type<scalar_t>;
      full_bwd_kernel<scalar_t, A><<<blocks_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          g.const_data_ptr<A>(), logits.const_data_ptr<scalar_t>(), logits.stride(0), logits.stride(1), n, vocab,
          ys.const_data_ptr<int64_t>(), ts.const_data_ptr<float>(), ls.const_data_ptr<A>(), out.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return out;
}

at::Tensor kept_mass_cuda(const at::Tensor& logits, const at::Tensor& token_ids, const at::Tensor& offsets,
                          const at::Tensor& temperature) {
  check_replay_args("kept_mass", logits, token_ids, offsets, at::Tensor(), temperature);
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor ids = token_ids.contiguous(), off = offsets.contiguous(), ts = temperature.contiguous();
  const int64_t n = logits.size(0), vocab = logits.size(1), nnz = ids.numel();
  at::Tensor kept = at::empty({n}, logits.options().dtype(replay_out_dtype(logits.scalar_type())));
  at::Tensor status = at::empty({n}, logits.options().dtype(at::kChar));
  if (n > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "kept_mass_cuda", [&] {
      using A = at::opmath_type<scalar_t>;
      kept_mass_kernel<scalar_t, A><<<blocks_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          logits.const_data_ptr<scalar_t>(), logits.stride(0), logits.stride(1), n, vocab,
          ids.const_data_ptr<int32_t>(), off.const_data_ptr<int64_t>(), nnz, ts.const_data_ptr<float>(),
          kept.data_ptr<A>(), status.data_ptr<int8_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  raise_row_error("kept_mass", status, off, nnz, at::Tensor(), ts, vocab);
  return kept;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hidden_fwd_cuda(const at::Tensor& hidden, const at::Tensor& weight,
                                                               const at::Tensor& bias, const at::Tensor& token_ids,
                                                               const at::Tensor& offsets, const at::Tensor& sampled,
                                                               const at::Tensor& temperature, bool fallback) {
  check_hidden_op("replay_from_hidden", hidden, weight, bias, token_ids, offsets, sampled, temperature);
  const c10::cuda::CUDAGuard guard(hidden.device());
  const at::Tensor h = hidden.contiguous(), w = weight.stride(1) == 1 ? weight : weight.contiguous();
  const bool hb = has_bias(bias, weight.size(0));
  const at::Tensor b = hb ? bias.contiguous() : bias;
  const at::Tensor ids = token_ids.contiguous(), off = offsets.contiguous(), ys = sampled.contiguous(),
                   ts = temperature.contiguous();
  const int64_t n = h.size(0), d = h.size(1), vocab = w.size(0), nnz = ids.numel();
  const auto out = h.options().dtype(replay_out_dtype(h.scalar_type()));
  at::Tensor logp = at::empty({n}, out), lse = at::empty({n}, out);
  at::Tensor status = at::empty({n}, h.options().dtype(at::kChar));
  if (n > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, h.scalar_type(), "hidden_fwd_cuda", [&] {
      using A = at::opmath_type<scalar_t>;
      hidden_fwd_kernel<scalar_t, A><<<blocks_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          h.const_data_ptr<scalar_t>(), w.const_data_ptr<scalar_t>(), w.stride(0),
          hb ? b.const_data_ptr<scalar_t>() : nullptr, n, d, vocab, ids.const_data_ptr<int32_t>(),
          off.const_data_ptr<int64_t>(), nnz, ys.const_data_ptr<int64_t>(), ts.const_data_ptr<float>(), fallback,
          logp.data_ptr<A>(), lse.data_ptr<A>(), status.data_ptr<int8_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  raise_row_error("replay_from_hidden", status, off, nnz, ys, ts, vocab);
  if (fallback) hidden_fallback_fwd(h, w, b, ys, ts, status, logp, lse);
  return {logp, lse, status};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hidden_bwd_cuda(
    const at::Tensor& grad, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
    const at::Tensor& token_ids, const at::Tensor& offsets, const at::Tensor& sampled, const at::Tensor& temperature,
    const at::Tensor& lse, const at::Tensor& status) {
  check_hidden_op("replay_from_hidden_bwd", hidden, weight, bias, token_ids, offsets, sampled, temperature);
  const int64_t n = hidden.size(0), d = hidden.size(1), vocab = weight.size(0);
  check_saved("replay_from_hidden_bwd", grad, lse, &status, n, replay_out_dtype(hidden.scalar_type()),
              hidden.device());
  const c10::cuda::CUDAGuard guard(hidden.device());
  const at::Tensor h = hidden.contiguous(), w = weight.stride(1) == 1 ? weight : weight.contiguous();
  const bool hb = has_bias(bias, vocab);
  const at::Tensor b = hb ? bias.contiguous() : bias;
  const at::Tensor ids = token_ids.contiguous(), off = offsets.contiguous(), ys = sampled.contiguous(),
                   ts = temperature.contiguous(), g = grad.contiguous(), ls = lse.contiguous(),
                   st = status.contiguous();
  const int64_t nnz = ids.numel();
  at::Tensor gh = at::empty({n, d}, h.options());
  at::Tensor gw = at::zeros({vocab, d}, w.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor gb = hb ? at::zeros({vocab}, b.options()) : at::empty({0}, h.options());
  // Zeroed so entries no row covers (offsets[N] < nnz) contribute c = 0 at row 0, in bounds.
  at::Tensor coef = at::zeros({nnz}, h.options().dtype(replay_out_dtype(h.scalar_type())));
  at::Tensor row_of = at::zeros({nnz}, h.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, h.scalar_type(), "hidden_bwd_cuda", [&] {
    using A = at::opmath_type<scalar_t>;
    const auto stream = c10::cuda::getCurrentCUDAStream();
    if (n > 0) {
      hidden_bwd_rows_kernel<scalar_t, A><<<blocks_for(n), kThreads, 0, stream>>>(
          g.const_data_ptr<A>(), h.const_data_ptr<scalar_t>(), w.const_data_ptr<scalar_t>(), w.stride(0),
          hb ? b.const_data_ptr<scalar_t>() : nullptr, n, d, vocab, ids.const_data_ptr<int32_t>(),
          off.const_data_ptr<int64_t>(), nnz, ys.const_data_ptr<int64_t>(), ts.const_data_ptr<float>(),
          ls.const_data_ptr<A>(), st.const_data_ptr<int8_t>(), coef.data_ptr<A>(), row_of.data_ptr<int64_t>(),
          gh.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (n > 0 && nnz > 0 && d > 0) {
      auto sorted = at::sort(ids, /*stable=*/true, /*dim=*/0, /*descending=*/false);
      const at::Tensor sids = std::get<0>(sorted).contiguous(), order = std::get<1>(sorted).contiguous();
      hidden_bwd_weight_kernel<scalar_t, A><<<blocks_for(nnz), kThreads, 0, stream>>>(
          sids.const_data_ptr<int32_t>(), order.const_data_ptr<int64_t>(), coef.const_data_ptr<A>(),
          row_of.const_data_ptr<int64_t>(), h.const_data_ptr<scalar_t>(), nnz, d, vocab, gw.data_ptr<scalar_t>(),
          hb ? gb.data_ptr<scalar_t>() : nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  hidden_fallback_bwd(g, h, w, b, ys, ts, ls, st, gh, gw, gb);
  return {gh, gw, gb};
}

}  // namespace

TORCH_LIBRARY_IMPL(mask_replay, CUDA, m) {
  m.impl("replay_fwd", &replay_fwd_cuda);
  m.impl("replay_bwd", &replay_bwd_cuda);
  m.impl("full_fwd", &full_fwd_cuda);
  m.impl("full_bwd", &full_bwd_cuda);
  m.impl("kept_mass", &kept_mass_cuda);
  m.impl("hidden_fwd", &hidden_fwd_cuda);
  m.impl("hidden_bwd", &hidden_bwd_cuda);
}

}  // namespace mask_replay
