// CUDA kernels of mask_replay::capture and ::capture_fixed: sort-free radix selection of the
// support threshold, then CSR (or fixed-width) compaction on the device.
//
// Every row's support is {i : x_i finite, order_key(x_i) >= max(K0, K1, K2)} with K0 the min-p
// threshold, K1 the k-th largest key and K2 the top-p key, because each filter keeps an upper set
// of keys. The kernels therefore only have to find three keys per row; all decisions go through
// kernels/ (kernel_math.h, det_log.h, capture_select.h), so they match the CPU kernel bit for bit.
//
// A row is split over B blocks (B > 1 when rows are few, so batch 1 fills the GPU). Each pass is
// one launch over all N * B blocks; the blocks of a row merge their histograms in global memory
// and the last block to finish (counter in the row state) takes the decision for the row. Rows
// that need no more work in a pass return at once, so per-row parameters may differ freely.
//
// Launches: stats (defects, max, greedy argmax, K0); top-k passes 0-3 (pass 0 also sums logz's
// normaliser); top-p passes 0-3; per-block counts; fill. Radix passes read the whole row until the
// chosen bucket fits the candidate buffer; from the pass after next they read only the buffer.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <atomic>
#include <cmath>
#include <limits>
#include <tuple>

#include "capture_checks.h"
#include "kernels/capture_scan.h"
#include "kernels/capture_select.h"
#include "kernels/det_log.h"
#include "kernels/kernel_math.h"

namespace mask_replay {
namespace {

constexpr int kThreads = 512;
constexpr int64_t kMinChunk = 2048;     // below this, splitting a row costs more than it gains
constexpr int64_t kMaxVocab = 1 << 23;  // keeps V * 2^40 (the all-tied row's mass) below 2^63
// Candidate buffer per row: as large as 64 MiB for the batch allows, up to 16384 entries (one
// block histograms that many in a few microseconds); below 256 entries it is not worth a pass.
constexpr int64_t kCandBytes = int64_t{64} << 20;
constexpr int64_t kCandEntryBytes = 12;  // uint32 key + uint64 mass
constexpr int64_t kMinCand = 256, kMaxCand = 16384;

enum Status : int {
  kOk = 0,
  kNaN = 1,
  kPosInf = 2,
  kOverflow = 3,
  kNoFinite = 4,
  kBadParam = 5,
  kInternal = 6,
};
// The first defective column decides the message, as in the CPU kernel's scan: defects are
// packed as ~(column << 8 | status), so an unsigned max over a zeroed slot finds the first one.
__host__ __device__ __forceinline__ unsigned long long pack_defect(int64_t col, int status) {
  return ~((static_cast<unsigned long long>(col) << 8) | static_cast<unsigned long long>(status));
}
__host__ __device__ __forceinline__ unsigned long long max_u64(unsigned long long a, unsigned long long b) {
  return a > b ? a : b;
}

// Per-row state carried between launches. Zeroed before the first launch.
struct alignas(16) RowState {
  unsigned long long argmax;    // greedy rows: pack_argmax over finite values (atomicMax)
  unsigned long long defect;    // pack_defect of the first NaN / +inf / overflow (atomicMax)
  unsigned long long mass_all;  // logz: sum of all masses (atomicAdd, exact)
  long long kneed;              // top-k: rank of the k-th key inside the current bucket
  long long mass_above;         // top-p: mass of the domain above the current bucket
  long long total_mass;         // top-p: Z
  unsigned int any_finite;      // some x is finite (atomicOr)
  unsigned int max_key;         // order_key of the largest finite x (atomicMax)
  unsigned int done;            // blocks of this row done with the current launch
  int status;
  unsigned int k0, k1, k2;  // min-p, top-k, top-p threshold keys (0: no constraint)
  unsigned int prefix_k, prefix_p;
  int greedy, topk_on, topp_on;
  float m;                  // max of finite x
  unsigned int cand_count;  // entries appended to the candidate buffer (atomicAdd)
  // kCand* below, one per filter ([0] top-k, [1] top-p; they share the buffer, top-k first).
  // Separate so that no pass resets the other's: in a buffered pass block 0 decides alone while
  // the row's other blocks may still be reading the state to find out that they have no work.
  int cand_state[2];
};

// Once the current bucket holds at most cand_cap entries, the next pass copies them (key, mass)
// into a per-row buffer while it histograms them, and the passes after it read only the buffer.
enum CandState : int { kCandNone = 0, kCandCollect = 1, kCandReady = 2 };

struct Geometry {
  int64_t n, v, row_stride, chunk;
  int64_t cand_cap;  // 0: no candidate buffer
  int blocks_per_row;
};

template <typename scalar_t>
__device__ __forceinline__ float load_x(const scalar_t* row, int64_t i, float t) {
  return mr_div(static_cast<float>(row[i]), t);
}

// Which row and which slice of it this block owns.
struct Slice {
  int64_t row, begin, end;
  int block;
};
__device__ __forceinline__ Slice my_slice(const Geometry& g) {
  Slice s;
  const int64_t id = blockIdx.x;
  s.row = id / g.blocks_per_row;
  s.block = static_cast<int>(id % g.blocks_per_row);
  s.begin = static_cast<int64_t>(s.block) * g.chunk;
  s.end = s.begin + g.chunk < g.v ? s.begin + g.chunk : g.v;
  return s;
}

// ---------------------------------------------------------------------------------------------
// Pass 1: first defect, row max (or greedy argmax), then threshold K0 and the selection state.
// Four blocks per SM: the row loop fits 32 registers, and the decision's det_log (once per row)
// would otherwise raise the whole kernel to 40; it spills there instead.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads, 4)
    stats_kernel(const scalar_t* __restrict__ logits, Geometry g, const float* __restrict__ temp,
                 const int64_t* __restrict__ top_k, const double* __restrict__ top_p, const double* __restrict__ min_p,
                 RowState* __restrict__ states, int64_t* __restrict__ status_out) {
  const Slice sl = my_slice(g);
  const scalar_t* z = logits + sl.row * g.row_stride;
  RowState* st = states + sl.row;
  const float t = temp[sl.row];
  const bool greedy = t == 0.0f;

  unsigned int finite = 0, mk = 0;
  unsigned long long am = 0, bad = 0;
  for_each_in_slice(z, sl.begin, sl.end, threadIdx.x, blockDim.x, [&](int64_t i, float v) {
    if (isnan(v)) {
      bad = max_u64(bad, pack_defect(i, kNaN));
    } else if (v == -kNegInf) {
      bad = max_u64(bad, pack_defect(i, kPosInf));
    } else if (greedy) {
      if (v != kNegInf) {
        finite = 1;
        am = max_u64(am, pack_argmax(order_key(v), i));
      }
    } else {
      const float x = mr_div(v, t);
      if (x == -kNegInf) {
        bad = max_u64(bad, pack_defect(i, kOverflow));
      } else if (isfinite(x)) {
        finite = 1;
        const unsigned int k = order_key(x);
        mk = k > mk ? k : mk;
      }
    }
  });
  __shared__ unsigned int s_finite, s_max;
  __shared__ unsigned long long s_arg, s_bad;
  if (threadIdx.x == 0) {
    s_finite = 0;
    s_max = 0;
    s_arg = 0;
    s_bad = 0;
  }
  __syncthreads();
  if (finite) atomicOr(&s_finite, 1u);
  if (mk) atomicMax(&s_max, mk);
  if (am) atomicMax(&s_arg, am);
  if (bad) atomicMax(&s_bad, bad);
  __syncthreads();
  if (threadIdx.x == 0) {
    if (s_finite) atomicOr(&st->any_finite, 1u);
    if (s_max) atomicMax(&st->max_key, s_max);
    if (s_arg) atomicMax(&st->argmax, s_arg);
    if (s_bad) atomicMax(&st->defect, s_bad);
  }
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&st->done, 1u) == static_cast<unsigned int>(g.blocks_per_row - 1);
  __syncthreads();
  if (!last || threadIdx.x != 0) return;
  __threadfence();

  const unsigned long long slot = atomicMax(&st->defect, 0ull);
  const bool has_defect = slot != 0;
  const unsigned long long defect = ~slot;
  const double p = top_p[sl.row], mp = min_p[sl.row];
  const int64_t k = top_k[sl.row];
  int status = kOk;
  int64_t report = 0;  // status | column << 8, for the host's message
  if (!(t >= 0.0f) || isinf(t) || !(p > 0.0 && p <= 1.0) || !(mp >= 0.0 && mp <= 1.0)) {
    status = kBadParam;
    report = status;
  } else if (has_defect) {
    status = static_cast<int>(defect & 0xffull);
    report = static_cast<int64_t>(defect);
  } else if (!atomicOr(&st->any_finite, 0u)) {
    status = kNoFinite;
    report = status;
  }
  st->done = 0;
  st->status = status;
  status_out[sl.row] = report;
  st->greedy = greedy ? 1 : 0;
  st->topk_on = 0;
  st->topp_on = 0;
  st->k1 = 0;
  st->k2 = 0;
  st->prefix_k = 0;
  st->prefix_p = 0;
  st->mass_above = 0;
  st->total_mass = 0;
  st->kneed = k;
  st->cand_count = 0;
  st->cand_state[0] = kCandNone;
  st->cand_state[1] = kCandNone;
  if (status != kOk || greedy) return;
  const float m = key_value(atomicMax(&st->max_key, 0u));
  st->m = m;
  if (min_p_active(mp)) {
    st->k0 = order_key(mr_add(m, det_log(mp)));  // the CPU kernel's log, bit for bit
  } else {
    st->k0 = order_key(kLowestFinite);
  }
  st->topk_on = k > 0 ? 1 : 0;
  st->topp_on = top_p_active(p) ? 1 : 0;
}

// Candidate-buffer state after a pass chose a bucket of `in_bucket` entries. Collecting pays only
// when a later pass reads the buffer, so it starts at pass 1 or 2. False if a collection overran.
__device__ bool advance_candidates(RowState* st, int which, int cstate, int pass, unsigned int in_bucket, int64_t cap) {
  if (cstate == kCandCollect) {
    if (atomicAdd(&st->cand_count, 0u) > cap) return false;
    st->cand_state[which] = kCandReady;
  } else if (cstate == kCandNone && pass <= 1 && in_bucket <= cap) {
    st->cand_count = 0;
    st->cand_state[which] = kCandCollect;
  }
  return true;
}

// Lanes of a warp that hit the same bin add once: logits crowd into a few top-digit bins, where
// plain shared-memory atomics would serialise up to 32 ways. Integer sums: any grouping is exact.
template <bool WITH_MASS>
__device__ __forceinline__ void add_to_bin(unsigned int* count, unsigned long long* mass, int d, unsigned long long q) {
  namespace cg = cooperative_groups;
  const cg::coalesced_group peers = cg::labeled_partition(cg::coalesced_threads(), d);
  if (WITH_MASS) {
    const unsigned long long sum = cg::reduce(peers, q, cg::plus<unsigned long long>());
    if (peers.thread_rank() == 0) {
      atomicAdd(&count[d], static_cast<unsigned int>(peers.size()));
      if (sum) atomicAdd(&mass[d], sum);
    }
  } else if (peers.thread_rank() == 0) {
    atomicAdd(&count[d], static_cast<unsigned int>(peers.size()));
  }
}

// ---------------------------------------------------------------------------------------------
// The parts of one radix pass (select_kernel below), in the order it runs them.

// Histogram of the candidate buffer (one block reads it): the entries inside the current bucket.
template <bool TOPP>
__device__ __forceinline__ void histogram_buffer(const RowState* st, const unsigned int* ck,
                                                 const unsigned long long* cm, unsigned int pmask, unsigned int prefix,
                                                 int pass, unsigned int* s_count, unsigned long long* s_mass) {
  const int64_t nc = st->cand_count;
  for (int64_t j = threadIdx.x; j < nc; j += blockDim.x) {
    const unsigned int key = ck[j];
    if ((key & pmask) != prefix) continue;
    add_to_bin<TOPP>(s_count, s_mass, radix_digit(key, pass), TOPP ? cm[j] : 0ull);
  }
}

// Histogram of this block's slice of the row: the finite entries >= lo inside the current bucket
// (copied to the candidate buffer while it collects). Returns this thread's share of logz's
// normaliser when logz_here (exact fixed-point sum, as the CPU kernel takes it).
template <typename scalar_t, bool TOPP>
__device__ __forceinline__ unsigned long long histogram_slice(const scalar_t* z, const Slice& sl, float t, float neg_m,
                                                              bool logz_here, bool on, bool collect, unsigned int lo,
                                                              unsigned int pmask, unsigned int prefix, int pass,
                                                              RowState* st, int64_t cand_cap, unsigned int* ck,
                                                              unsigned long long* cm, unsigned int* s_count,
                                                              unsigned long long* s_mass) {
  unsigned long long local = 0;
  for_each_in_slice(z, sl.begin, sl.end, threadIdx.x, blockDim.x, [&](int64_t, float v) {
    const float x = mr_div(v, t);
    if (!isfinite(x)) return;
    if (logz_here) local += static_cast<unsigned long long>(mass_q(det_exp(mr_add(x, neg_m))));
    if (!on) return;
    const unsigned int key = order_key(x);
    if (key < lo || (key & pmask) != prefix) return;
    const unsigned long long q = TOPP ? static_cast<unsigned long long>(mass_q(det_exp(mr_add(x, neg_m)))) : 0ull;
    add_to_bin<TOPP>(s_count, s_mass, radix_digit(key, pass), q);
    if (collect) {
      const unsigned int pos = atomicAdd(&st->cand_count, 1u);
      if (pos < cand_cap) {  // always, as the previous pass counted this bucket
        ck[pos] = key;
        if (TOPP) cm[pos] = q;
      }
    }
  });
  return local;
}

// Rows split over several blocks: adds this block's histogram (and logz sum) to the row's in
// global memory. Returns true in the last block to finish, which then holds the merged histogram
// in shared memory (and the row's logz sum in block_sum) and leaves zeros behind for the next pass.
template <bool TOPP>
__device__ __forceinline__ bool merge_row_histogram(const Geometry& g, const Slice& sl, RowState* st, bool on,
                                                    bool logz_here, unsigned int* g_count, unsigned long long* g_mass,
                                                    unsigned int* s_count, unsigned long long* s_mass,
                                                    unsigned long long& block_sum, bool& last) {
  unsigned int* gc = g_count + sl.row * kRadixBins;
  unsigned long long* gm = g_mass + sl.row * kRadixBins;
  if (on) {
    for (int d = static_cast<int>(threadIdx.x); d < kRadixBins; d += kThreads) {
      if (s_count[d]) atomicAdd(&gc[d], s_count[d]);
      if (TOPP && s_mass[d]) atomicAdd(&gm[d], s_mass[d]);
    }
  }
  if (logz_here && threadIdx.x == 0 && block_sum) atomicAdd(&st->mass_all, block_sum);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&st->done, 1u) == static_cast<unsigned int>(g.blocks_per_row - 1);
  __syncthreads();
  if (!last) return false;
  __threadfence();
  if (on) {
    for (int d = static_cast<int>(threadIdx.x); d < kRadixBins; d += kThreads) {
      s_count[d] = atomicExch(&gc[d], 0u);
      if (TOPP) s_mass[d] = atomicExch(&gm[d], 0ull);
    }
  }
  __syncthreads();
  if (logz_here && threadIdx.x == 0) block_sum = atomicAdd(&st->mass_all, 0ull);
  return true;
}

// A digit that cannot be chosen (or a candidate buffer that overran) stops the row's selection.
__device__ __forceinline__ void fail_selection(RowState* st, int64_t row, int* on_flag, int64_t* status_out) {
  st->status = kInternal;
  status_out[row] = kInternal;
  *on_flag = 0;
}

// Top-k decision of one pass (thread 0 of the deciding block): the digit holding the k-th key.
// Pass 0 first learns |S0|: k >= |S0| keeps everything.
__device__ __forceinline__ void decide_topk(RowState* st, const unsigned int* s_count, int pass, int cstate,
                                            int64_t cand_cap, int64_t row, int64_t* status_out) {
  if (pass == 0) {
    int64_t total = 0;
    for (int d = 0; d < kRadixBins; ++d) total += s_count[d];
    if (!(st->kneed < total)) {
      st->topk_on = 0;
      return;
    }
  }
  int64_t need = st->kneed;
  const int d = select_topk_digit(s_count, need);
  if (d < 0 || !advance_candidates(st, 0, cstate, pass, s_count[d], cand_cap)) {
    fail_selection(st, row, &st->topk_on, status_out);
    return;
  }
  st->kneed = need;
  const unsigned int pre = st->prefix_k | (static_cast<unsigned int>(d) << (24 - 8 * pass));
  st->prefix_k = pre;
  if (pass == 3) {
    st->k1 = pre;
    // No reset of the candidate state here: in a buffered pass the row's other blocks may be
    // reading topk_on and the state right now, and a stale topk_on next to a reset state sent
    // them into a full-row pass whose histogram and done count no block ever cleared.
    st->topk_on = 0;
  }
}

// Top-p decision of one pass: the digit holding the smallest kept key. Pass 0 learns Z.
__device__ __forceinline__ void decide_topp(RowState* st, const unsigned int* s_count, const unsigned long long* s_mass,
                                            int pass, int cstate, int64_t cand_cap, double p, int64_t row,
                                            int64_t* status_out) {
  if (pass == 0) {
    unsigned long long total = 0;
    for (int d = 0; d < kRadixBins; ++d) total += s_mass[d];
    st->total_mass = static_cast<long long>(total);
  }
  int64_t above = st->mass_above;
  const int d = select_topp_digit(s_count, s_mass, above, p, st->total_mass);
  if (d < 0 || !advance_candidates(st, 1, cstate, pass, s_count[d], cand_cap)) {
    fail_selection(st, row, &st->topp_on, status_out);
    return;
  }
  st->mass_above = above;
  const unsigned int pre = st->prefix_p | (static_cast<unsigned int>(d) << (24 - 8 * pass));
  st->prefix_p = pre;
  if (pass == 3) {
    st->k2 = pre;
    st->topp_on = 0;
  }
}

// One radix pass of the top-k (TOPP = false) or top-p (TOPP = true) selection. Pass 0 of top-k
// also sums the normaliser for logz and learns |S0|, which decides whether top-k is active.
template <typename scalar_t, bool TOPP>
__global__ void __launch_bounds__(kThreads)
    select_kernel(const scalar_t* __restrict__ logits, Geometry g, const float* __restrict__ temp,
                  const double* __restrict__ top_p, RowState* __restrict__ states, int pass, bool want_logz,
                  float* __restrict__ logz_out, unsigned int* __restrict__ g_count,
                  unsigned long long* __restrict__ g_mass, unsigned int* __restrict__ cand_key,
                  unsigned long long* __restrict__ cand_mass, int64_t* __restrict__ status_out) {
  using Reduce = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename Reduce::TempStorage reduce_tmp;
  __shared__ unsigned int s_count[kRadixBins];
  __shared__ unsigned long long s_mass[kRadixBins];
  __shared__ bool last;

  const Slice sl = my_slice(g);
  RowState* st = states + sl.row;
  if (st->status != kOk || st->greedy) return;
  const bool logz_here = !TOPP && pass == 0 && want_logz;
  const bool on = TOPP ? st->topp_on != 0 : st->topk_on != 0;
  if (!on && !logz_here) return;
  const int cstate = on ? st->cand_state[TOPP ? 1 : 0] : kCandNone;
  const bool buffered = cstate == kCandReady;
  if (buffered && sl.block != 0) return;  // the buffer is small: one block reads it and decides

  const scalar_t* z = logits + sl.row * g.row_stride;
  const float t = temp[sl.row];
  const float m = st->m;
  const float neg_m = -m;
  const unsigned int lo = TOPP ? (st->k0 > st->k1 ? st->k0 : st->k1) : st->k0;
  const unsigned int pmask = radix_prefix_mask(pass);
  const unsigned int prefix = TOPP ? st->prefix_p : st->prefix_k;

  for (int d = static_cast<int>(threadIdx.x); d < kRadixBins; d += kThreads) {
    s_count[d] = 0;
    if (TOPP) s_mass[d] = 0;
  }
  __syncthreads();

  unsigned int* ck = cand_key + sl.row * g.cand_cap;
  unsigned long long* cm = cand_mass + sl.row * g.cand_cap;
  unsigned long long local = 0;
  if (buffered) {
    histogram_buffer<TOPP>(st, ck, cm, pmask, prefix, pass, s_count, s_mass);
  } else {
    local = histogram_slice<scalar_t, TOPP>(z, sl, t, neg_m, logz_here, on, cstate == kCandCollect, lo, pmask, prefix,
                                            pass, st, g.cand_cap, ck, cm, s_count, s_mass);
  }
  unsigned long long block_sum = 0;
  if (logz_here) block_sum = Reduce(reduce_tmp).Sum(local);
  __syncthreads();

  if (g.blocks_per_row > 1 && !buffered &&
      !merge_row_histogram<TOPP>(g, sl, st, on, logz_here, g_count, g_mass, s_count, s_mass, block_sum, last))
    return;
  if (threadIdx.x != 0) return;
  st->done = 0;
  if (logz_here) {
    const double all = static_cast<double>(static_cast<int64_t>(block_sum));
    logz_out[sl.row] = static_cast<float>(static_cast<double>(m) + log(all / kMassScaleD));
  }
  if (!on) return;
  if (TOPP) {
    decide_topp(st, s_count, s_mass, pass, cstate, g.cand_cap, top_p[sl.row], sl.row, status_out);
  } else {
    decide_topk(st, s_count, pass, cstate, g.cand_cap, sl.row, status_out);
  }
}

// ---------------------------------------------------------------------------------------------
// Compaction. Both kernels apply the same test to the same slice, so the counts of the first size
// the output of the second exactly; only the fill needs ascending order (block-wide scans).
__device__ __forceinline__ unsigned int final_threshold(const RowState* st) {
  unsigned int k = st->k0 > st->k1 ? st->k0 : st->k1;
  return k > st->k2 ? k : st->k2;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    count_kernel(const scalar_t* __restrict__ logits, Geometry g, const float* __restrict__ temp,
                 const RowState* __restrict__ states, int64_t* __restrict__ block_counts) {
  using Reduce = cub::BlockReduce<int64_t, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const Slice sl = my_slice(g);
  const RowState* st = states + sl.row;
  int64_t* out = block_counts + sl.row * g.blocks_per_row + sl.block;
  if (st->status != kOk) {
    if (threadIdx.x == 0) *out = 0;
    return;
  }
  if (st->greedy) {
    if (threadIdx.x == 0) {
      const int64_t idx = unpack_argmax(st->argmax);
      *out = (idx >= sl.begin && idx < sl.end) ? 1 : 0;
    }
    return;
  }
  const scalar_t* z = logits + sl.row * g.row_stride;
  const float t = temp[sl.row];
  const unsigned int kf = final_threshold(st);
  int64_t c = 0;
  for_each_in_slice(z, sl.begin, sl.end, threadIdx.x, blockDim.x, [&](int64_t, float v) {
    const float x = mr_div(v, t);
    c += (isfinite(x) && order_key(x) >= kf) ? 1 : 0;
  });
  const int64_t total = Reduce(tmp).Sum(c);
  if (threadIdx.x == 0) *out = total;
}

// Writes the ids of the slice at out + row * row_width + block_start[...], ascending, skipping
// positions >= limit (capture_fixed's width; "no limit" for CSR).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    fill_kernel(const scalar_t* __restrict__ logits, Geometry g, const float* __restrict__ temp,
                const RowState* __restrict__ states, const int64_t* __restrict__ block_start, int32_t* __restrict__ out,
                int64_t row_width, int64_t limit) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const Slice sl = my_slice(g);
  const RowState* st = states + sl.row;
  if (st->status != kOk) return;
  int64_t base = block_start[sl.row * g.blocks_per_row + sl.block];
  if (base >= limit) return;
  int32_t* o = out + sl.row * row_width;
  if (st->greedy) {
    const int64_t idx = unpack_argmax(st->argmax);
    if (threadIdx.x == 0 && idx >= sl.begin && idx < sl.end) o[base] = static_cast<int32_t>(idx);
    return;
  }
  const scalar_t* z = logits + sl.row * g.row_stride;
  const float t = temp[sl.row];
  const unsigned int kf = final_threshold(st);
  for (int64_t tile = sl.begin; tile < sl.end; tile += blockDim.x) {
    const int64_t i = tile + threadIdx.x;
    int keep = 0;
    if (i < sl.end) {
      const float x = load_x(z, i, t);
      keep = (isfinite(x) && order_key(x) >= kf) ? 1 : 0;
    }
    int rank = 0, tile_total = 0;
    Scan(tmp).ExclusiveSum(keep, rank, tile_total);
    if (keep && base + rank < limit) o[base + rank] = static_cast<int32_t>(i);
    base += tile_total;
    if (base >= limit) break;  // uniform: every thread holds the same tile_total
    __syncthreads();           // tmp is reused by the next tile's scan
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

// Queried once per device (first call, normally outside any graph capture) and never a sync.
// ATen/cuda/CUDAContext.h would give cached properties but drags in cuSPARSE headers that
// compile-only toolkits lack.
int sm_count(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];
  if (device >= 0 && device < kMaxDevices) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  sms = sms > 0 ? sms : 1;
  if (device >= 0 && device < kMaxDevices) cache[device].store(sms, std::memory_order_relaxed);
  return sms;
}

// Blocks of kThreads that one SM runs at once in every pass, for this dtype: the smallest over the
// kernels (ptxas, sm_90: stats and count fit 4, select and fill 3, fp16 top-k select 2), so that a
// grid sized by it comes in whole waves in every pass. Queried once per device (no sync).
template <typename scalar_t>
int resident_blocks_per_sm(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];
  if (device >= 0 && device < kMaxDevices) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  int fewest = std::numeric_limits<int>::max();
  auto query = [&](auto kernel) {
    int blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, 0));
    fewest = blocks < fewest ? blocks : fewest;
  };
  query(stats_kernel<scalar_t>);
  query(select_kernel<scalar_t, false>);
  query(select_kernel<scalar_t, true>);
  query(count_kernel<scalar_t>);
  query(fill_kernel<scalar_t>);
  fewest = fewest > 1 ? fewest : 1;
  if (device >= 0 && device < kMaxDevices) cache[device].store(fewest, std::memory_order_relaxed);
  return fewest;
}

// Blocks per row when `slots` blocks run at once: b blocks per row take about ceil(n b / slots)
// waves of V / b elements each. The b with the fewest elements per slot wins (ties: the smaller,
// fewer merges), among those up to about two waves: n = 256 rows on 396 slots take b = 3 (1.9
// waves, 2/3 of a row per slot), not 2 (1.3 waves, a tail as long as a wave).
int64_t pick_blocks_per_row(int64_t n, int64_t max_b, int64_t slots) {
  const int64_t limit_b = 2 * ((slots + n - 1) / n);
  int64_t best = 1, best_waves = (n + slots - 1) / slots;
  for (int64_t b = 2; b <= max_b && b <= limit_b; ++b) {
    const int64_t waves = (n * b + slots - 1) / slots;
    if (waves * best < best_waves * b) {  // waves / b < best_waves / best
      best = b;
      best_waves = waves;
    }
  }
  return best;
}

Geometry make_geometry(const at::Tensor& z, int blocks_per_sm) {
  Geometry g;
  g.n = z.size(0);
  g.v = z.size(1);
  g.row_stride = z.stride(0);
  const int64_t slots = static_cast<int64_t>(sm_count(z.get_device())) * blocks_per_sm;
  const int64_t max_b = g.v / kMinChunk > 1 ? g.v / kMinChunk : 1;
  const int64_t b = pick_blocks_per_row(g.n, max_b, slots);
  g.chunk = (g.v + b - 1) / b;
  g.blocks_per_row = static_cast<int>((g.v + g.chunk - 1) / g.chunk);  // no empty slices
  TORCH_CHECK(g.n * g.blocks_per_row <= std::numeric_limits<int32_t>::max(), "capture: too many rows (", g.n, ")");
  const int64_t cap = kCandBytes / (g.n * kCandEntryBytes);
  g.cand_cap = cap < kMinCand ? 0 : (cap < kMaxCand ? cap : kMaxCand);
  return g;
}

struct Workspace {
  at::Tensor states, status, g_count, g_mass, block_counts, cand_key, cand_mass;
};

Workspace make_workspace(const Geometry& g, const at::TensorOptions& dev) {
  Workspace w;
  w.states = at::zeros({g.n * static_cast<int64_t>(sizeof(RowState))}, dev.dtype(at::kByte));
  w.status = at::empty({g.n}, dev.dtype(at::kLong));
  if (g.blocks_per_row > 1) {
    w.g_count = at::zeros({g.n * kRadixBins}, dev.dtype(at::kInt));
    w.g_mass = at::zeros({g.n * kRadixBins}, dev.dtype(at::kLong));
  }
  w.block_counts = at::empty({g.n * g.blocks_per_row}, dev.dtype(at::kLong));
  if (g.cand_cap > 0) {
    w.cand_key = at::empty({g.n * g.cand_cap}, dev.dtype(at::kInt));
    w.cand_mass = at::empty({g.n * g.cand_cap}, dev.dtype(at::kLong));
  }
  return w;
}

template <typename T>
T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<T*>(t.data_ptr()) : nullptr;
}

// Runs every launch up to the per-block counts. Passes for filters no row uses are skipped when
// the host knows it (CSR path); otherwise their rows return at once.
template <typename scalar_t>
void select_support(const at::Tensor& z, const Geometry& g, Workspace& w, const at::Tensor& temperature,
                    const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p, float* logz,
                    bool any_topk, bool any_topp) {
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const scalar_t* zp = reinterpret_cast<const scalar_t*>(z.data_ptr());
  const dim3 grid(static_cast<unsigned int>(g.n * g.blocks_per_row));
  RowState* states = reinterpret_cast<RowState*>(w.states.data_ptr());
  const float* t = temperature.data_ptr<float>();
  const double* p = top_p.data_ptr<double>();
  auto* gc = ptr_or_null<unsigned int>(w.g_count);
  auto* gm = ptr_or_null<unsigned long long>(w.g_mass);
  auto* ck = ptr_or_null<unsigned int>(w.cand_key);
  auto* cm = ptr_or_null<unsigned long long>(w.cand_mass);

  stats_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(zp, g, t, top_k.data_ptr<int64_t>(), p,
                                                        min_p.data_ptr<double>(), states, w.status.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const bool want_logz = logz != nullptr;
  if (any_topk || want_logz) {
    for (int pass = 0; pass < 4 && (pass == 0 || any_topk); ++pass) {
      select_kernel<scalar_t, false><<<grid, kThreads, 0, stream>>>(zp, g, t, p, states, pass, want_logz, logz, gc, gm,
                                                                    ck, cm, w.status.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  if (any_topp) {
    for (int pass = 0; pass < 4; ++pass) {
      select_kernel<scalar_t, true><<<grid, kThreads, 0, stream>>>(zp, g, t, p, states, pass, false, nullptr, gc, gm,
                                                                   ck, cm, w.status.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  count_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(zp, g, t, states, w.block_counts.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
void fill_support(const at::Tensor& z, const Geometry& g, Workspace& w, const at::Tensor& temperature,
                  const at::Tensor& block_start, at::Tensor& out, int64_t row_width, int64_t limit) {
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned int>(g.n * g.blocks_per_row));
  fill_kernel<scalar_t>
      <<<grid, kThreads, 0, stream>>>(reinterpret_cast<const scalar_t*>(z.data_ptr()), g, temperature.data_ptr<float>(),
                                      reinterpret_cast<const RowState*>(w.states.data_ptr()),
                                      block_start.data_ptr<int64_t>(), out.data_ptr<int32_t>(), row_width, limit);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// bf16 / fp16 / fp32 only (check_capture_args rejects the rest): no double instantiation.
template <typename F>
void dispatch_logits(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kFloat:
      f(float{});
      break;
    case at::kHalf:
      f(at::Half{});
      break;
    case at::kBFloat16:
      f(at::BFloat16{});
      break;
    default:
      TORCH_CHECK(false, "capture: unsupported logits dtype ", st);
  }
}

int capture_blocks_per_sm(const at::Tensor& z) {
  int blocks = 1;
  dispatch_logits(z.scalar_type(), [&](auto tag) { blocks = resident_blocks_per_sm<decltype(tag)>(z.get_device()); });
  return blocks;
}

// Logits with unit stride along the vocabulary are read in place; anything else is copied once.
at::Tensor rows_view(const at::Tensor& logits) { return logits.stride(1) == 1 ? logits : logits.contiguous(); }

void check_common(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                  const at::Tensor& top_p, const at::Tensor& min_p) {
  check_capture_args(logits, temperature, top_k, top_p, min_p);
  TORCH_CHECK(logits.is_cuda(), "capture: the CUDA kernel got logits on ", logits.device());
  TORCH_CHECK(logits.size(1) < kMaxVocab, "capture: vocabularies of ", kMaxVocab,
              " or more tokens are not supported (exact mass sums would overflow), got ", logits.size(1));
}

// `report` is the kernel's status | column << 8 (column only for defects in the logits).
[[noreturn]] void throw_row_error(int64_t row, int64_t report) {
  const int status = static_cast<int>(report & 0xff);
  const int64_t col = report >> 8;
  switch (status) {
    case kNaN:
      TORCH_CHECK(false, "capture: row ", row, " contains NaN (column ", col, ")");
    case kPosInf:
      TORCH_CHECK(false, "capture: row ", row, " contains +inf (column ", col, ")");
    case kOverflow:
      TORCH_CHECK(false, "capture: row ", row, " overflows to +inf after dividing by the temperature (column ", col,
                  ")");
    case kNoFinite:
      TORCH_CHECK(false, "capture: row ", row, " has no finite logit");
    case kBadParam:
      TORCH_CHECK(false, "capture: row ", row, " has invalid sampling parameters");
    default:
      TORCH_CHECK(false, "capture: internal error in the CUDA selection at row ", row, " (status ", status, ")");
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> capture_cuda(const at::Tensor& logits, const at::Tensor& temperature,
                                                            const at::Tensor& top_k, const at::Tensor& top_p,
                                                            const at::Tensor& min_p, bool compute_logz) {
  check_common(logits, temperature, top_k, top_p, min_p);
  c10::cuda::CUDAGuard guard(logits.device());
  const auto dev = logits.options();
  const int64_t n = logits.size(0), v = logits.size(1);

  // The parameters are tiny; checking them on the host gives the CPU kernel's messages and tells
  // which passes any row needs. One copy (one sync) brings all four: 8-byte types first keeps
  // every slice aligned for its dtype.
  const at::Tensor tt = temperature.contiguous(), kk = top_k.contiguous(), pp = top_p.contiguous(),
                   mm = min_p.contiguous();
  const at::Tensor packed =
      at::cat({kk.view(at::kByte), pp.view(at::kByte), mm.view(at::kByte), tt.view(at::kByte)}).cpu();
  const at::Tensor k_h = packed.narrow(0, 0, 8 * n).view(at::kLong);
  const at::Tensor p_h = packed.narrow(0, 8 * n, 8 * n).view(at::kDouble);
  const at::Tensor mp_h = packed.narrow(0, 16 * n, 8 * n).view(at::kDouble);
  const at::Tensor t_h = packed.narrow(0, 24 * n, 4 * n).view(at::kFloat);
  check_row_params(t_h, p_h, mp_h);

  at::Tensor logz = at::zeros({compute_logz ? n : 0}, dev.dtype(at::kFloat));
  if (n == 0) return {at::empty({0}, dev.dtype(at::kInt)), at::zeros({1}, dev.dtype(at::kLong)), logz};
  TORCH_CHECK(v > 0, "capture: row 0 has no finite logit");

  bool any_topk = false, any_topp = false;
  {
    const int64_t* k = k_h.data_ptr<int64_t>();
    const double* p = p_h.data_ptr<double>();
    const float* t = t_h.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {
      const bool sampled = t[r] != 0.0f;
      any_topk |= sampled && k[r] > 0;
      any_topp |= sampled && top_p_active(p[r]);
    }
  }

  const at::Tensor z = rows_view(logits);
  const Geometry g = make_geometry(z, capture_blocks_per_sm(z));
  Workspace w = make_workspace(g, dev);
  dispatch_logits(z.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    select_support<scalar_t>(z, g, w, tt, kk, pp, mm, compute_logz ? logz.data_ptr<float>() : nullptr, any_topk,
                             any_topp);
  });

  // Block b of row r writes at the running total of all earlier (row, block) counts.
  const at::Tensor incl = at::cumsum(w.block_counts, 0);
  const at::Tensor starts = incl - w.block_counts;
  const at::Tensor host = at::cat({w.status, incl.narrow(0, incl.size(0) - 1, 1)}).cpu();
  const int64_t* h = host.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    if (h[r] != kOk) throw_row_error(r, h[r]);
  const int64_t nnz = h[n];

  at::Tensor token_ids = at::empty({nnz}, dev.dtype(at::kInt));
  at::Tensor offsets =
      at::cat({at::zeros({1}, dev.dtype(at::kLong)), incl.view({n, g.blocks_per_row}).select(1, g.blocks_per_row - 1)});
  if (nnz > 0) {
    dispatch_logits(z.scalar_type(), [&](auto tag) {
      using scalar_t = decltype(tag);
      fill_support<scalar_t>(z, g, w, tt, starts, token_ids, 0, std::numeric_limits<int64_t>::max());
    });
  }
  return {token_ids, offsets, logz};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> capture_fixed_cuda(const at::Tensor& logits,
                                                                  const at::Tensor& temperature,
                                                                  const at::Tensor& top_k, const at::Tensor& top_p,
                                                                  const at::Tensor& min_p, int64_t width) {
  check_common(logits, temperature, top_k, top_p, min_p);
  TORCH_CHECK(width >= 1, "capture_fixed: width must be >= 1, got ", width);
  c10::cuda::CUDAGuard guard(logits.device());
  const auto dev = logits.options();
  const int64_t n = logits.size(0), v = logits.size(1);

  at::Tensor ids = at::full({n, width}, -1, dev.dtype(at::kInt));
  if (n == 0) return {ids, at::empty({0}, dev.dtype(at::kLong)), at::empty({0}, dev.dtype(at::kBool))};
  if (v == 0) return {ids, at::full({n}, -1, dev.dtype(at::kLong)), at::ones({n}, dev.dtype(at::kBool))};

  const at::Tensor tt = temperature.contiguous(), kk = top_k.contiguous(), pp = top_p.contiguous(),
                   mm = min_p.contiguous();
  const at::Tensor z = rows_view(logits);
  const Geometry g = make_geometry(z, capture_blocks_per_sm(z));
  Workspace w = make_workspace(g, dev);
  // No host look at the parameters here: every pass is launched and idle rows return at once.
  dispatch_logits(z.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    select_support<scalar_t>(z, g, w, tt, kk, pp, mm, nullptr, true, true);
  });

  const at::Tensor per_block = w.block_counts.view({n, g.blocks_per_row});
  const at::Tensor incl = at::cumsum(per_block, 1);
  const at::Tensor starts = (incl - per_block).contiguous();
  dispatch_logits(z.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    fill_support<scalar_t>(z, g, w, tt, starts, ids, width, width);
  });
  const at::Tensor invalid = w.status.ne(0);
  const at::Tensor counts = incl.select(1, g.blocks_per_row - 1).masked_fill(invalid, -1);
  const at::Tensor overflow = invalid.logical_or(counts.gt(width));
  return {ids, counts.contiguous(), overflow};
}

}  // namespace
}  // namespace mask_replay

TORCH_LIBRARY_IMPL(mask_replay, CUDA, m) {
  m.impl("capture", &mask_replay::capture_cuda);
  m.impl("capture_fixed", &mask_replay::capture_fixed_cuda);
}
