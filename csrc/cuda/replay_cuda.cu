// CUDA kernels of the replay ops. One warp per row: a row of K reads |K| (mean ~8) gathered logits,
// so a block per row would leave most threads idle; full-vocabulary rows (fallback, full_fwd,
// kept_mass) stride the row across the warp's lanes with coalesced loads. Per-row defects are
// written as negative status codes and raised on the host after one copy of the status (the
// forward's only synchronisation).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "replay_checks.h"
#include "replay_hidden.h"
#include "kernels/replay_math.h"

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
__device__ __forceinline__ int64_t warp_min(int64_t v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const int64_t w = __shfl_xor_sync(kFull, static_cast<long long>(v), o);
    v = w < v ? w : v;
  }
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

// Checks the row's entries [lo, hi) across the warp: the first failing entry's error, as the
// CPU's sequential check reports it (uniform across the lanes).
__device__ __forceinline__ int warp_check_entries(const int32_t* ids, int64_t lo, int64_t hi, int64_t vocab) {
  return entry_error_code(warp_min(lane_entry_errors(ids, lo, hi, vocab, lane_id(), kWarp)));
}

// Logsumexp over the row's support and the sampled token's x. Returns the row status (uniform).
template <class T, class A>
__device__ int warp_support_lse(const T* row, int64_t s1, int64_t vocab, const int32_t* ids, int64_t lo, int64_t hi,
                                int64_t y, A t, A& m, double& s, A& xy, bool& found) {
  m = neg_inf<A>();
  s = 0.0;
  xy = 0;
  found = false;
  const int bad = warp_check_entries(ids, lo, hi, vocab);  // the ids again below: from L1
  if (bad != kReplayed) return bad;
  int hit = 0;
  for (int64_t e = lo + lane_id(); e < hi; e += kWarp) {
    const int64_t id = ids[e];
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
  return kReplayed;
}

// Row r of a backward op: d logp / d z_j = (g / T)(1[j = y] - p_j), written into the gradient row.
template <class T, class A>
struct GradRow {
  const T* row;
  T* o;
  A t, gt;
  double l;
  int64_t y;
  __device__ GradRow(const A* g, const T* z, int64_t s0, const RowInputs& in, const A* lse, T* out, int64_t r)
      : row(z + r * s0), o(out + r * in.vocab), t(static_cast<A>(in.ts[r])), gt(g[r] / t),
        l(static_cast<double>(lse[r])), y(in.ys[r]) {}
  __device__ void write(int64_t s1, int64_t j) const {
    o[j] = static_cast<T>(grad_coef(gt, prob_of(logit_at(row, s1, j, t), l), j == y));
  }
  __device__ void write_all(int64_t s1, int64_t vocab) const {  // the whole row, strided across the warp
    for (int64_t j = lane_id(); j < vocab; j += kWarp) write(s1, j);
  }
};

template <class T, class A>
__global__ void replay_fwd_kernel(const T* __restrict__ z, int64_t s0, int64_t s1, const RowInputs in, bool fallback,
                                  A* __restrict__ logp, A* __restrict__ lse, int8_t* __restrict__ status) {
  const int64_t r = warp_item();
  if (r >= in.n) return;
  int st = precheck_row(in, r);
  const T* row = z + r * s0;
  const A t = static_cast<A>(in.ts[r]);
  double l = 0.0;
  A xy = 0;
  if (st == kReplayed) {
    const int64_t lo = in.off[r], hi = in.off[r + 1];
    A m;
    double s;
    bool found;
    st = warp_support_lse(row, s1, in.vocab, in.ids, lo, hi, in.ys[r], t, m, s, xy, found);
    if (st == kReplayed) st = row_decision(hi - lo, found, fallback);
    if (st == kReplayed) l = lse_value(m, s);
  }
  if (st > 0) {
    l = warp_full_lse(row, s1, in.vocab, t);
    xy = logit_at(row, s1, in.ys[r], t);
  }
  if (lane_id() == 0) {
    status[r] = static_cast<int8_t>(st);
    lse[r] = static_cast<A>(st >= 0 ? l : 0.0);
    logp[r] = static_cast<A>(st >= 0 ? static_cast<double>(xy) - l : 0.0);
  }
}

// out is zero-filled beforehand; replayed rows scatter their |K| entries, fallback rows write all.
// The saved tensors are inputs like any other: each row is checked again (errors to err).
template <class T, class A>
__global__ void replay_bwd_kernel(const A* __restrict__ g, const T* __restrict__ z, int64_t s0, int64_t s1,
                                  const RowInputs in, const A* __restrict__ lse, const int8_t* __restrict__ status,
                                  T* __restrict__ out, int8_t* __restrict__ err) {
  const int64_t r = warp_item();
  if (r >= in.n) return;
  int e = precheck_row(in, r);
  if (e == kReplayed) e = warp_check_entries(in.ids, in.off[r], in.off[r + 1], in.vocab);
  if (lane_id() == 0) err[r] = static_cast<int8_t>(e);
  const int8_t st = status[r];
  if (e != kReplayed || st < 0) return;
  const GradRow<T, A> gr(g, z, s0, in, lse, out, r);
  if (st > 0) {
    gr.write_all(s1, in.vocab);
    return;
  }
  for (int64_t q = in.off[r] + lane_id(); q < in.off[r + 1]; q += kWarp) gr.write(s1, in.ids[q]);
}

template <class T, class A>
__global__ void full_fwd_kernel(const T* __restrict__ z, int64_t s0, int64_t s1, const RowInputs in,
                                A* __restrict__ logp, A* __restrict__ lse, int8_t* __restrict__ status) {
  const int64_t r = warp_item();
  if (r >= in.n) return;
  const int st = precheck_row(in, r);
  double l = 0.0, lp = 0.0;
  if (st == kReplayed) {
    const T* row = z + r * s0;
    const A t = static_cast<A>(in.ts[r]);
    l = warp_full_lse(row, s1, in.vocab, t);
    lp = static_cast<double>(logit_at(row, s1, in.ys[r], t)) - l;
  }
  if (lane_id() == 0) {
    status[r] = static_cast<int8_t>(st);
    lse[r] = static_cast<A>(l);
    logp[r] = static_cast<A>(lp);
  }
}

template <class T, class A>
__global__ void full_bwd_kernel(const A* __restrict__ g, const T* __restrict__ z, int64_t s0, int64_t s1,
                                const RowInputs in, const A* __restrict__ lse, T* __restrict__ out,
                                int8_t* __restrict__ err) {
  const int64_t r = warp_item();
  if (r >= in.n) return;
  const int e = precheck_row(in, r);
  if (lane_id() == 0) err[r] = static_cast<int8_t>(e);
  if (e != kReplayed) return;
  GradRow<T, A>(g, z, s0, in, lse, out, r).write_all(s1, in.vocab);
}

template <class T, class A>
__global__ void kept_mass_kernel(const T* __restrict__ z, int64_t s0, int64_t s1, const RowInputs in,
                                 A* __restrict__ kept, int8_t* __restrict__ status) {
  const int64_t r = warp_item();
  if (r >= in.n) return;
  int st = precheck_row(in, r);
  double k = 0.0;
  if (st == kReplayed) {
    const T* row = z + r * s0;
    const A t = static_cast<A>(in.ts[r]);
    A m, xy;
    double s;
    bool found;
    st = warp_support_lse(row, s1, in.vocab, in.ids, in.off[r], in.off[r + 1], int64_t(-1), t, m, s, xy, found);
    if (st == kReplayed) k = kept_fraction(lse_value(m, s), warp_full_lse(row, s1, in.vocab, t));
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

// x = (h . w_id + b_id) / T for support_scan. A warp computes each logit together, so this only
// exists on the device; nvcc's host pass of the shared template sees a stub that is never called.
template <class T, class A>
struct WarpHeadLogit {
  const T* hr;
  const T* w;
  int64_t ws;
  const T* b;
  int64_t d;
  A t;
  __host__ __device__ A operator()(int64_t id) const {
#if defined(__CUDA_ARCH__)
    return warp_head_logit<T, A>(hr, w, ws, b, id, d) / t;
#else
    return A(0);
#endif
  }
};

template <class T, class A>
__global__ void hidden_fwd_kernel(const T* __restrict__ h, const T* __restrict__ w, int64_t ws, const T* __restrict__ b,
                                  int64_t d, const RowInputs in, bool fallback, A* __restrict__ logp,
                                  A* __restrict__ lse, int8_t* __restrict__ status) {
  const int64_t r = warp_item();
  if (r >= in.n) return;
  int st = precheck_row(in, r);
  const A t = static_cast<A>(in.ts[r]);
  A m = neg_inf<A>(), xy = 0;
  double s = 0.0;
  if (st == kReplayed) {
    const int64_t lo = in.off[r], hi = in.off[r + 1];
    bool found;
    // Entries one after another, each logit across the warp: st, m, s stay warp-uniform.
    st = support_scan(in.ids, lo, hi, in.vocab, in.ys[r], WarpHeadLogit<T, A>{h + r * d, w, ws, b, d, t}, m, s, xy,
                      found);
    if (st == kReplayed) st = row_decision(hi - lo, found, fallback);
  }
  if (lane_id() == 0) {
    status[r] = static_cast<int8_t>(st);
    const double l = st == kReplayed ? lse_value(m, s) : 0.0;  // fallback rows are filled by the host
    lse[r] = static_cast<A>(l);
    logp[r] = static_cast<A>(st == kReplayed ? static_cast<double>(xy) - l : 0.0);
  }
}

// Per row: the coefficient of every entry (to coef), its row (to row_of), and
// grad_hidden[r] = sum_K c_j w_j. Fallback rows get zeros here and are finished on the host.
// Every row is checked (errors to err): the weight kernel reads the ids of all rows.
template <class T, class A>
__global__ void hidden_bwd_rows_kernel(const A* __restrict__ g, const T* __restrict__ h, const T* __restrict__ w,
                                       int64_t ws, const T* __restrict__ b, int64_t d, const RowInputs in,
                                       const A* __restrict__ lse, const int8_t* __restrict__ status, A* coef,
                                       int64_t* __restrict__ row_of, T* __restrict__ gh, int8_t* __restrict__ err) {
  const int64_t r = warp_item();
  if (r >= in.n) return;
  int bad = precheck_row(in, r);
  if (bad == kReplayed) bad = warp_check_entries(in.ids, in.off[r], in.off[r + 1], in.vocab);
  if (lane_id() == 0) err[r] = static_cast<int8_t>(bad);
  if (bad != kReplayed) return;  // coef and row_of stay zero there: in bounds for the weight kernel
  const int64_t lo = in.off[r], hi = in.off[r + 1];
  for (int64_t e = lo + lane_id(); e < hi; e += kWarp) row_of[e] = r;
  const bool live = status[r] == kReplayed;
  const T* hr = h + r * d;
  if (live) {
    const A t = static_cast<A>(in.ts[r]);
    const A gt = g[r] / t;
    const double l = static_cast<double>(lse[r]);
    for (int64_t e = lo; e < hi; ++e) {
      const int64_t id = in.ids[e];
      const A c = grad_coef(gt, prob_of(warp_head_logit<T, A>(hr, w, ws, b, id, d) / t, l), id == in.ys[r]);
      if (lane_id() == 0) coef[e] = c;
    }
  } else {
    for (int64_t e = lo + lane_id(); e < hi; e += kWarp) coef[e] = 0;
  }
  __syncwarp();  // coef written by lane 0 is read by every lane below
  for (int64_t k = lane_id(); k < d; k += kWarp) {
    A acc = 0;
    for (int64_t e = lo; live && e < hi; ++e) acc += coef[e] * static_cast<A>(w[in.ids[e] * ws + k]);
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

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> replay_fwd_cuda(const at::Tensor& logits, const at::Tensor& token_ids,
                                                               const at::Tensor& offsets, const at::Tensor& sampled,
                                                               const at::Tensor& temperature, bool fallback) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const RowOperands a = replay_operands("replay", logits, token_ids, offsets, sampled, temperature);
  ForwardOutputs f = forward_outputs(logits, a.n);
  if (a.n > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "replay_fwd_cuda", [&] {
      using A = at::opmath_type<scalar_t>;
      replay_fwd_kernel<scalar_t, A><<<blocks_for(a.n), kThreads, 0, stream()>>>(
          logits.const_data_ptr<scalar_t>(), logits.stride(0), logits.stride(1), a.view(), fallback,
          f.logp.data_ptr<A>(), f.lse.data_ptr<A>(), f.status.data_ptr<int8_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return finish_forward("replay", f, a);
}

at::Tensor replay_bwd_cuda(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& token_ids,
                           const at::Tensor& offsets, const at::Tensor& sampled, const at::Tensor& temperature,
                           const at::Tensor& lse, const at::Tensor& status) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const RowOperands a = replay_operands("replay_bwd", logits, token_ids, offsets, sampled, temperature);
  const SavedOperands sv =
      saved_operands("replay_bwd", grad, lse, status, a.n, replay_out_dtype(logits.scalar_type()), logits.device());
  at::Tensor out = at::zeros({a.n, a.vocab}, logits.options());  // a memset, then the scatter of K
  at::Tensor err = row_status(logits, a.n);
  if (a.n > 0 && a.vocab > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "replay_bwd_cuda", [&] {
      using A = at::opmath_type<scalar_t>;
      replay_bwd_kernel<scalar_t, A><<<blocks_for(a.n), kThreads, 0, stream()>>>(
          sv.g.const_data_ptr<A>(), logits.const_data_ptr<scalar_t>(), logits.stride(0), logits.stride(1), a.view(),
          sv.ls.const_data_ptr<A>(), sv.st.const_data_ptr<int8_t>(), out.data_ptr<scalar_t>(),
          err.data_ptr<int8_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  raise_row_error("replay_bwd", err, a);  // the error flags: one copy after the kernel
  return out;
}

std::tuple<at::Tensor, at::Tensor> full_fwd_cuda(const at::Tensor& logits, const at::Tensor& sampled,
                                                 const at::Tensor& temperature) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const RowOperands a = full_operands("full_logprobs", logits, sampled, temperature);
  ForwardOutputs f = forward_outputs(logits, a.n);
  if (a.n > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "full_fwd_cuda", [&] {
      using A = at::opmath_type<scalar_t>;
      full_fwd_kernel<scalar_t, A><<<blocks_for(a.n), kThreads, 0, stream()>>>(
          logits.const_data_ptr<scalar_t>(), logits.stride(0), logits.stride(1), a.view(), f.logp.data_ptr<A>(),
          f.lse.data_ptr<A>(), f.status.data_ptr<int8_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  raise_row_error("full_logprobs", f.status, a);  // full_fwd returns no status
  return {f.logp, f.lse};
}

at::Tensor full_bwd_cuda(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& sampled,
                         const at::Tensor& temperature, const at::Tensor& lse) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const RowOperands a = full_operands("full_logprobs_bwd", logits, sampled, temperature);
  const SavedOperands sv = saved_operands("full_logprobs_bwd", grad, lse, at::Tensor(), a.n,
                                          replay_out_dtype(logits.scalar_type()), logits.device());
  at::Tensor out = at::empty({a.n, a.vocab}, logits.options());  // every element of a valid row is written
  at::Tensor err = row_status(logits, a.n);
  if (a.n > 0 && a.vocab > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "full_bwd_cuda", [&] {
      using A = at::opmath_type<scalar_t>;
      full_bwd_kernel<scalar_t, A><<<blocks_for(a.n), kThreads, 0, stream()>>>(
          sv.g.const_data_ptr<A>(), logits.const_data_ptr<scalar_t>(), logits.stride(0), logits.stride(1), a.view(),
          sv.ls.const_data_ptr<A>(), out.data_ptr<scalar_t>(), err.data_ptr<int8_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  raise_row_error("full_logprobs_bwd", err, a);
  return out;
}

at::Tensor kept_mass_cuda(const at::Tensor& logits, const at::Tensor& token_ids, const at::Tensor& offsets,
                          const at::Tensor& temperature) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const RowOperands a = replay_operands("kept_mass", logits, token_ids, offsets, at::Tensor(), temperature);
  at::Tensor kept = at::empty({a.n}, logits.options().dtype(replay_out_dtype(logits.scalar_type())));
  at::Tensor status = row_status(logits, a.n);
  if (a.n > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "kept_mass_cuda", [&] {
      using A = at::opmath_type<scalar_t>;
      kept_mass_kernel<scalar_t, A><<<blocks_for(a.n), kThreads, 0, stream()>>>(
          logits.const_data_ptr<scalar_t>(), logits.stride(0), logits.stride(1), a.view(), kept.data_ptr<A>(),
          status.data_ptr<int8_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  raise_row_error("kept_mass", status, a);
  return kept;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hidden_fwd_cuda(const at::Tensor& hidden, const at::Tensor& weight,
                                                               const at::Tensor& bias, const at::Tensor& token_ids,
                                                               const at::Tensor& offsets, const at::Tensor& sampled,
                                                               const at::Tensor& temperature, bool fallback) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  const HeadOperands hd =
      head_operands("replay_from_hidden", hidden, weight, bias, token_ids, offsets, sampled, temperature);
  ForwardOutputs f = forward_outputs(hidden, hd.rows.n);
  if (hd.rows.n > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, hidden.scalar_type(), "hidden_fwd_cuda", [&] {
      using A = at::opmath_type<scalar_t>;
      hidden_fwd_kernel<scalar_t, A><<<blocks_for(hd.rows.n), kThreads, 0, stream()>>>(
          hd.h.const_data_ptr<scalar_t>(), hd.w.const_data_ptr<scalar_t>(), hd.ws,
          hd.bias ? hd.b.const_data_ptr<scalar_t>() : nullptr, hd.d, hd.rows.view(), fallback, f.logp.data_ptr<A>(),
          f.lse.data_ptr<A>(), f.status.data_ptr<int8_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return finish_hidden_fwd(hd, f, fallback);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hidden_bwd_cuda(
    const at::Tensor& grad, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
    const at::Tensor& token_ids, const at::Tensor& offsets, const at::Tensor& sampled, const at::Tensor& temperature,
    const at::Tensor& lse, const at::Tensor& status) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  const char* op = "replay_from_hidden_bwd";
  const HeadOperands hd = head_operands(op, hidden, weight, bias, token_ids, offsets, sampled, temperature);
  const int64_t n = hd.rows.n, d = hd.d, vocab = hd.rows.vocab, nnz = hd.rows.nnz;
  const SavedOperands sv = saved_operands(op, grad, lse, status, n, replay_out_dtype(hidden.scalar_type()),
                                          hidden.device());
  at::Tensor gh = at::empty({n, d}, hd.h.options());
  at::Tensor gw = at::zeros({vocab, d}, hd.w.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor gb = hd.bias ? at::zeros({vocab}, hd.b.options()) : at::empty({0}, hd.h.options());
  // Zeroed so entries of a row that failed its checks contribute c = 0 at row 0, in bounds.
  at::Tensor coef = at::zeros({nnz}, hd.h.options().dtype(replay_out_dtype(hd.h.scalar_type())));
  at::Tensor row_of = at::zeros({nnz}, hd.h.options().dtype(at::kLong));
  at::Tensor err = row_status(hidden, n);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, hd.h.scalar_type(), "hidden_bwd_cuda", [&] {
    using A = at::opmath_type<scalar_t>;
    if (n > 0) {
      hidden_bwd_rows_kernel<scalar_t, A><<<blocks_for(n), kThreads, 0, stream()>>>(
          sv.g.const_data_ptr<A>(), hd.h.const_data_ptr<scalar_t>(), hd.w.const_data_ptr<scalar_t>(), hd.ws,
          hd.bias ? hd.b.const_data_ptr<scalar_t>() : nullptr, d, hd.rows.view(), sv.ls.const_data_ptr<A>(),
          sv.st.const_data_ptr<int8_t>(), coef.data_ptr<A>(), row_of.data_ptr<int64_t>(), gh.data_ptr<scalar_t>(),
          err.data_ptr<int8_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (n > 0 && nnz > 0 && d > 0) {
      auto sorted = at::sort(hd.rows.ids, /*stable=*/true, /*dim=*/0, /*descending=*/false);
      const at::Tensor sids = std::get<0>(sorted).contiguous(), order = std::get<1>(sorted).contiguous();
      hidden_bwd_weight_kernel<scalar_t, A><<<blocks_for(nnz), kThreads, 0, stream()>>>(
          sids.const_data_ptr<int32_t>(), order.const_data_ptr<int64_t>(), coef.const_data_ptr<A>(),
          row_of.const_data_ptr<int64_t>(), hd.h.const_data_ptr<scalar_t>(), nnz, d, vocab, gw.data_ptr<scalar_t>(),
          hd.bias ? gb.data_ptr<scalar_t>() : nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return finish_hidden_bwd(hd, sv, err, gh, gw, gb);
}

}  // namespace

TORCH_LIBRARY_IMPL(mask_replay, CUDA, m) {
  impl_ops(m, kLogitsOps, &replay_fwd_cuda, &replay_bwd_cuda, &full_fwd_cuda, &full_bwd_cuda, &kept_mass_cuda);
  impl_ops(m, kHeadOps, &hidden_fwd_cuda, &hidden_bwd_cuda);
}

}  // namespace mask_replay
