// CUDA kernels of the replay ops. One warp per row: a row of K reads |K| (mean ~8) gathered logits,
// so a block per row would leave most threads idle. Full-vocabulary rows (full_fwd/bwd, kept_mass,
// the fallback rows of replay_fwd/bwd) get a block each, reading the row 16 bytes per load
// (kernels/row_groups.h); replay's fallback rows are left by the warp kernel to a second launch.
// Per-row defects are written as negative status codes and raised on the host after one copy of
// the status (the forward's only synchronisation).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>

#include "kernels/replay_math.h"
#include "kernels/row_groups.h"
#include "replay_checks.h"
#include "replay_hidden.h"

namespace mask_replay {
namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 8;
constexpr int kThreads = kWarp * kRowsPerBlock;
constexpr unsigned kFull = 0xffffffffu;

// Full-vocabulary rows: a block each. 16 warps with 4 loads of 16 bytes in flight per thread keep
// enough bytes moving even when the rows are few (N = 256 fills two blocks per SM).
constexpr int kRowThreads = 512;
constexpr int kRowWarps = kRowThreads / kWarp;

unsigned blocks_for(int64_t rows) { return static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock); }
unsigned row_blocks(int64_t rows) {
  TORCH_CHECK(rows <= std::numeric_limits<int32_t>::max(), "replay: too many rows (", rows, ")");
  return static_cast<unsigned>(rows);
}

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

// Logsumexp of a whole row of x = z / t across the block; every thread gets it. Which elements a
// thread sums, and in which order, depends only on the vocabulary size, and the merge is a fixed
// tree (warps, then the warps' results): the same bits on every run and for every layout.
template <class T, class A>
__device__ double block_full_lse(const T* row, int64_t s1, int64_t vocab, A t) {
  __shared__ A s_m[kRowWarps];
  __shared__ double s_s[kRowWarps];
  A m = neg_inf<A>();
  double s = 0.0;
  for_each_row_group(row, s1, vocab, threadIdx.x, kRowThreads,
                     [&](int64_t, T z) { lse_push(m, s, static_cast<A>(z) / t); });
  warp_lse(m, s);
  const int warp = threadIdx.x / kWarp;
  if (lane_id() == 0) {
    s_m[warp] = m;
    s_s[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane_id() < kRowWarps ? s_m[lane_id()] : neg_inf<A>();
    s = lane_id() < kRowWarps ? s_s[lane_id()] : 0.0;
    warp_lse(m, s);
    if (lane_id() == 0) {
      s_m[0] = m;
      s_s[0] = s;
    }
  }
  __syncthreads();
  const double l = lse_value(s_m[0], s_s[0]);
  __syncthreads();  // the next call writes s_m / s_s again
  return l;
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
      : row(z + r * s0),
        o(out + r * in.vocab),
        t(static_cast<A>(in.ts[r])),
        gt(g[r] / t),
        l(static_cast<double>(lse[r])),
        y(in.ys[r]) {}
  __device__ T value(int64_t j, T z) const {
    return static_cast<T>(grad_coef(gt, prob_of(static_cast<A>(z) / t, l), j == y));
  }
  __device__ void write(int64_t s1, int64_t j) const { o[j] = value(j, row[j * s1]); }
  __device__ void write_all(int64_t s1, int64_t vocab) const {  // the whole row across the block
    for_each_row_group(row, s1, vocab, threadIdx.x, kRowThreads, [&](int64_t j, T z) { o[j] = value(j, z); });
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
  if (lane_id() == 0) {
    status[r] = static_cast<int8_t>(st);
    if (st > 0) return;  // fallback rows: fallback_fwd_kernel
    lse[r] = static_cast<A>(st == kReplayed ? l : 0.0);
    logp[r] = static_cast<A>(st == kReplayed ? static_cast<double>(xy) - l : 0.0);
  }
}

// The fallback rows of replay_fwd (status > 0), a block each: log-probs over the full vocabulary.
template <class T, class A>
__global__ void __launch_bounds__(kRowThreads)
    fallback_fwd_kernel(const T* __restrict__ z, int64_t s0, int64_t s1, const RowInputs in, A* __restrict__ logp,
                        A* __restrict__ lse, const int8_t* __restrict__ status) {
  const int64_t r = blockIdx.x;
  if (status[r] <= 0) return;
  const T* row = z + r * s0;
  const A t = static_cast<A>(in.ts[r]);
  const double l = block_full_lse(row, s1, in.vocab, t);
  if (threadIdx.x == 0) {
    lse[r] = static_cast<A>(l);
    logp[r] = static_cast<A>(static_cast<double>(logit_at(row, s1, in.ys[r], t)) - l);
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
  if (e != kReplayed || status[r] != kReplayed) return;  // fallback rows: fallback_bwd_kernel
  const GradRow<T, A> gr(g, z, s0, in, lse, out, r);
  for (int64_t q = in.off[r] + lane_id(); q < in.off[r + 1]; q += kWarp) gr.write(s1, in.ids[q]);
}

// The fallback rows of replay_bwd (valid, status > 0), a block each: the full-vocabulary gradient.
// err was written by replay_bwd_kernel, launched before on the same stream.
template <class T, class A>
__global__ void __launch_bounds__(kRowThreads)
    fallback_bwd_kernel(const A* __restrict__ g, const T* __restrict__ z, int64_t s0, int64_t s1, const RowInputs in,
                        const A* __restrict__ lse, const int8_t* __restrict__ status, const int8_t* __restrict__ err,
                        T* __restrict__ out) {
  const int64_t r = blockIdx.x;
  if (err[r] != kReplayed || status[r] <= 0) return;
  GradRow<T, A>(g, z, s0, in, lse, out, r).write_all(s1, in.vocab);
}

// A block per row, as every full-vocabulary kernel below.
template <class T, class A>
__global__ void __launch_bounds__(kRowThreads)
    full_fwd_kernel(const T* __restrict__ z, int64_t s0, int64_t s1, const RowInputs in, A* __restrict__ logp,
                    A* __restrict__ lse, int8_t* __restrict__ status) {
  const int64_t r = blockIdx.x;
  const int st = precheck_row(in, r);  // uniform across the block
  double l = 0.0, lp = 0.0;
  if (st == kReplayed) {
    const T* row = z + r * s0;
    const A t = static_cast<A>(in.ts[r]);
    l = block_full_lse(row, s1, in.vocab, t);
    lp = static_cast<double>(logit_at(row, s1, in.ys[r], t)) - l;
  }
  if (threadIdx.x == 0) {
    status[r] = static_cast<int8_t>(st);
    lse[r] = static_cast<A>(l);
    logp[r] = static_cast<A>(lp);
  }
}

template <class T, class A>
__global__ void __launch_bounds__(kRowThreads)
    full_bwd_kernel(const A* __restrict__ g, const T* __restrict__ z, int64_t s0, int64_t s1, const RowInputs in,
                    const A* __restrict__ lse, T* __restrict__ out, int8_t* __restrict__ err) {
  const int64_t r = blockIdx.x;
  const int e = precheck_row(in, r);
  if (threadIdx.x == 0) err[r] = static_cast<int8_t>(e);
  if (e != kReplayed) return;
  GradRow<T, A>(g, z, s0, in, lse, out, r).write_all(s1, in.vocab);
}

// The support's logsumexp by the first warp, then the full row's by the whole block.
template <class T, class A>
__global__ void __launch_bounds__(kRowThreads)
    kept_mass_kernel(const T* __restrict__ z, int64_t s0, int64_t s1, const RowInputs in, A* __restrict__ kept,
                     int8_t* __restrict__ status) {
  __shared__ int s_status;
  __shared__ double s_lse_k;
  const int64_t r = blockIdx.x;
  const T* row = z + r * s0;
  const A t = static_cast<A>(in.ts[r]);
  if (threadIdx.x < kWarp) {
    int st = precheck_row(in, r);
    double lse_k = 0.0;
    if (st == kReplayed) {
      A m, xy;
      double s;
      bool found;
      st = warp_support_lse(row, s1, in.vocab, in.ids, in.off[r], in.off[r + 1], int64_t(-1), t, m, s, xy, found);
      lse_k = lse_value(m, s);
    }
    if (threadIdx.x == 0) {
      s_status = st;
      s_lse_k = lse_k;
    }
  }
  __syncthreads();
  const int st = s_status;
  double k = 0.0;
  if (st == kReplayed) k = kept_fraction(s_lse_k, block_full_lse(row, s1, in.vocab, t));
  if (threadIdx.x == 0) {
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

// The weight gradient, grad_weight[j] = sum over the entries e of token j of c_e h[row_e], over the
// entries sorted by token (stable). The sorted entries are cut into fixed chunks of kWeightChunk,
// and d into tiles of kWeightTile columns; block (chunk, tile) sums each token's piece of the chunk
// in registers (kWeightCols columns per thread). A run that lies inside one chunk is written
// directly; a run that crosses chunks (a token in many rows) leaves its pieces' partial sums, and
// weight_combine_kernel adds them in chunk order. Every sum has a fixed order (entries in sorted
// order within a piece, pieces in chunk order): deterministic, no atomics; bf16 weights are
// accumulated in float and rounded once. One token in all N rows costs N / kWeightChunk blocks per
// tile, not one warp walking N entries for every column.
constexpr int kWeightChunk = 128;
constexpr int kWeightThreads = 128;
constexpr int kWeightCols = 4;
constexpr int kWeightTile = kWeightThreads * kWeightCols;

// Partial sums of crossing runs: slot 0 of a chunk holds its first piece when that piece's run
// began in an earlier chunk, slot 1 its last piece when that piece's run began in this chunk and
// goes on into the next. part is [chunks, 2, d], part_bias [chunks, 2].
template <class T, class A>
__global__ void __launch_bounds__(kWeightThreads)
    hidden_bwd_weight_kernel(const int32_t* __restrict__ sids, const int64_t* __restrict__ order,
                             const A* __restrict__ coef, const int64_t* __restrict__ row_of, const T* __restrict__ h,
                             int64_t nnz, int64_t d, int64_t vocab, T* __restrict__ gw, T* __restrict__ gb,
                             A* __restrict__ part, double* __restrict__ part_bias) {
  __shared__ int32_t s_id[kWeightChunk];
  __shared__ A s_coef[kWeightChunk];
  __shared__ int64_t s_row[kWeightChunk];
  const int64_t chunk = blockIdx.x;
  const int64_t p0 = chunk * kWeightChunk;
  const int len = static_cast<int>(nnz - p0 < kWeightChunk ? nnz - p0 : kWeightChunk);
  for (int i = threadIdx.x; i < len; i += kWeightThreads) {  // one gather per entry, not per column
    const int64_t e = order[p0 + i];
    s_id[i] = sids[p0 + i];
    s_coef[i] = coef[e];
    s_row[i] = row_of[e];
  }
  __syncthreads();
  const bool continues = p0 > 0 && sids[p0 - 1] == s_id[0];                // the first piece's run began before
  const bool goes_on = p0 + len < nnz && sids[p0 + len] == s_id[len - 1];  // the last piece's run goes on
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kWeightTile + threadIdx.x;
  const bool bias_here = blockIdx.y == 0 && threadIdx.x == 0;
  int a = 0;
  while (a < len) {  // the same pieces in every thread
    const int32_t j = s_id[a];
    int b = a + 1;
    while (b < len && s_id[b] == j) ++b;
    A acc[kWeightCols];
#pragma unroll
    for (int u = 0; u < kWeightCols; ++u) acc[u] = A(0);
    double bias_sum = 0.0;
#pragma unroll 2
    for (int i = a; i < b; ++i) {
      const A c = s_coef[i];
      const T* hr = h + s_row[i] * d;
#pragma unroll
      for (int u = 0; u < kWeightCols; ++u) {
        const int64_t k = col0 + u * kWeightThreads;
        if (k < d) acc[u] += c * static_cast<A>(hr[k]);
      }
      if (bias_here) bias_sum += static_cast<double>(c);
    }
    const bool first = a == 0 && continues, last = b == len && goes_on;
    if (j >= 0 && j < vocab) {  // entries of rows that failed their checks: raised on the host
      if (!first && !last) {
#pragma unroll
        for (int u = 0; u < kWeightCols; ++u) {
          const int64_t k = col0 + u * kWeightThreads;
          if (k < d) gw[j * d + k] = static_cast<T>(acc[u]);
        }
        if (gb && bias_here) gb[j] = static_cast<T>(bias_sum);
      } else {
        const int64_t slot = chunk * 2 + (first ? 0 : 1);
#pragma unroll
        for (int u = 0; u < kWeightCols; ++u) {
          const int64_t k = col0 + u * kWeightThreads;
          if (k < d) part[slot * d + k] = acc[u];
        }
        if (bias_here) part_bias[slot] = bias_sum;
      }
    }
    a = b;
  }
}

// Block (chunk, tile) finishes the run that begins in `chunk` and goes on past it, if there is
// one: its slot 1, then slot 0 of each following chunk until the run ends, in that order.
template <class T, class A>
__global__ void __launch_bounds__(kWeightThreads)
    weight_combine_kernel(const int32_t* __restrict__ sids, int64_t nnz, int64_t d, int64_t vocab,
                          const A* __restrict__ part, const double* __restrict__ part_bias, T* __restrict__ gw,
                          T* __restrict__ gb) {
  const int64_t chunk = blockIdx.x;
  const int64_t p0 = chunk * kWeightChunk;
  const int64_t end = p0 + kWeightChunk < nnz ? p0 + kWeightChunk : nnz;
  const int32_t j = sids[end - 1];
  if (end >= nnz || sids[end] != j) return;  // the last run ends in this chunk
  if (p0 > 0 && sids[p0 - 1] == j) return;   // it began in an earlier chunk, whose block owns it
  if (j < 0 || j >= vocab) return;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kWeightTile + threadIdx.x;
  const bool bias_here = gb && blockIdx.y == 0 && threadIdx.x == 0;
  A acc[kWeightCols];
#pragma unroll
  for (int u = 0; u < kWeightCols; ++u) {
    const int64_t k = col0 + u * kWeightThreads;
    acc[u] = k < d ? part[(chunk * 2 + 1) * d + k] : A(0);
  }
  double bias_sum = bias_here ? part_bias[chunk * 2 + 1] : 0.0;
  for (int64_t c = chunk + 1;; ++c) {
#pragma unroll
    for (int u = 0; u < kWeightCols; ++u) {
      const int64_t k = col0 + u * kWeightThreads;
      if (k < d) acc[u] += part[(c * 2) * d + k];
    }
    if (bias_here) bias_sum += part_bias[c * 2];
    const int64_t c_end = (c + 1) * kWeightChunk;
    if (c_end >= nnz || sids[c_end] != j) break;
  }
#pragma unroll
  for (int u = 0; u < kWeightCols; ++u) {
    const int64_t k = col0 + u * kWeightThreads;
    if (k < d) gw[j * d + k] = static_cast<T>(acc[u]);
  }
  if (bias_here) gb[j] = static_cast<T>(bias_sum);
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
      if (fallback && a.vocab > 0) {  // only then can a row have fallen back
        fallback_fwd_kernel<scalar_t, A><<<row_blocks(a.n), kRowThreads, 0, stream()>>>(
            logits.const_data_ptr<scalar_t>(), logits.stride(0), logits.stride(1), a.view(), f.logp.data_ptr<A>(),
            f.lse.data_ptr<A>(), f.status.data_ptr<int8_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
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
          sv.ls.const_data_ptr<A>(), sv.st.const_data_ptr<int8_t>(), out.data_ptr<scalar_t>(), err.data_ptr<int8_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      fallback_bwd_kernel<scalar_t, A><<<row_blocks(a.n), kRowThreads, 0, stream()>>>(
          sv.g.const_data_ptr<A>(), logits.const_data_ptr<scalar_t>(), logits.stride(0), logits.stride(1), a.view(),
          sv.ls.const_data_ptr<A>(), sv.st.const_data_ptr<int8_t>(), err.data_ptr<int8_t>(), out.data_ptr<scalar_t>());
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
      full_fwd_kernel<scalar_t, A><<<row_blocks(a.n), kRowThreads, 0, stream()>>>(
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
      full_bwd_kernel<scalar_t, A><<<row_blocks(a.n), kRowThreads, 0, stream()>>>(
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
      kept_mass_kernel<scalar_t, A><<<row_blocks(a.n), kRowThreads, 0, stream()>>>(
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> hidden_bwd_cuda(const at::Tensor& grad, const at::Tensor& hidden,
                                                               const at::Tensor& weight, const at::Tensor& bias,
                                                               const at::Tensor& token_ids, const at::Tensor& offsets,
                                                               const at::Tensor& sampled, const at::Tensor& temperature,
                                                               const at::Tensor& lse, const at::Tensor& status) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  const char* op = "replay_from_hidden_bwd";
  const HeadOperands hd = head_operands(op, hidden, weight, bias, token_ids, offsets, sampled, temperature);
  const int64_t n = hd.rows.n, d = hd.d, vocab = hd.rows.vocab, nnz = hd.rows.nnz;
  const SavedOperands sv =
      saved_operands(op, grad, lse, status, n, replay_out_dtype(hidden.scalar_type()), hidden.device());
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
    if (n > 0 && nnz > 0) {
      auto sorted = at::sort(hd.rows.ids, /*stable=*/true, /*dim=*/0, /*descending=*/false);
      const at::Tensor sids = std::get<0>(sorted).contiguous(), order = std::get<1>(sorted).contiguous();
      // d = 0 still takes one tile: the bias gradient is summed there.
      const int64_t chunks = (nnz + kWeightChunk - 1) / kWeightChunk,
                    tiles = d > 0 ? (d + kWeightTile - 1) / kWeightTile : 1;
      TORCH_CHECK(chunks <= std::numeric_limits<int32_t>::max() && tiles <= 65535, op, ": too many entries (", nnz,
                  ") or columns (", d, ")");
      const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(tiles));
      const at::Tensor part = at::empty({chunks * 2, d}, coef.options());
      const at::Tensor part_bias = at::empty({chunks * 2}, coef.options().dtype(at::kDouble));
      scalar_t* const gbp = hd.bias ? gb.data_ptr<scalar_t>() : nullptr;
      hidden_bwd_weight_kernel<scalar_t, A><<<grid, kWeightThreads, 0, stream()>>>(
          sids.const_data_ptr<int32_t>(), order.const_data_ptr<int64_t>(), coef.const_data_ptr<A>(),
          row_of.const_data_ptr<int64_t>(), hd.h.const_data_ptr<scalar_t>(), nnz, d, vocab, gw.data_ptr<scalar_t>(),
          gbp, part.data_ptr<A>(), part_bias.data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      weight_combine_kernel<scalar_t, A><<<grid, kWeightThreads, 0, stream()>>>(
          sids.const_data_ptr<int32_t>(), nnz, d, vocab, part.const_data_ptr<A>(), part_bias.const_data_ptr<double>(),
          gw.data_ptr<scalar_t>(), gbp);
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
