// CPU kernel of the capture ops: sort-free selection of the min-p / top-k / top-p support.
//
// Per row: one pass converts and divides by T, finds the max and checks for NaN/+inf. A filtering
// scan then keeps the indices with x >= tau in a small buffer; whenever the buffer fills, radix
// selection on the buffer raises tau (count-based for top-k, mass-based for top-p). That is safe
// for top-k because the k-th largest of a subset of >= k entries never exceeds the row's; for
// top-p only once the buffer's mass reaches p * Z (before that, the buffer's top-p key is just
// its smallest key, not a bound on the row's). The final radix selection runs over the buffer.
// Top-p without top-k needs the survivors' total mass first. Where the CPU has AVX-512 (chosen at
// run time), select_top_p_levels (capture_cpu_top_p.cpp) finds the threshold from exact masses at a
// few levels around a sampled guess. Elsewhere one vectorised pass of exact fixed-point sums also
// fills a histogram of the masses within 16 of the max; the threshold's bin then comes from that
// histogram and only the bin's entries are radix-selected (select_top_p_from_histogram). The
// filtering scan is top-p's fallback there.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "capture_checks.h"
#include "capture_cpu_avx512.h"
#include "capture_cpu_isa.h"
#include "capture_cpu_loops.h"
#include "capture_cpu_row.h"
#include "capture_cpu_select.h"
#include "kernels/det_log.h"
#include "kernels/kernel_math.h"
#include "parallel_grain.h"

namespace mask_replay {
namespace cpu {
namespace {

// Per-thread buffers that live across calls: fresh row-sized allocations would page-fault on every
// call, which costs more than the selection itself. Fetched once per chunk of rows and passed by
// reference (a thread_local named inside a parallel lambda would be the worker's, not the caller's).
Scratch& thread_scratch() {
  static thread_local Scratch s;
  return s;
}

std::vector<IdList>& thread_chunk_pool() {
  static thread_local std::vector<IdList> pool;
  return pool;
}

void gather_keys(const float* x, const std::vector<int32_t>& idx, std::vector<uint32_t>& keys) {
  keys.resize(idx.size());
  for (size_t j = 0; j < idx.size(); ++j) keys[j] = order_key(x[idx[j]]);
}

void gather_masses(const float* x, float m, const std::vector<int32_t>& idx, std::vector<int64_t>& mass,
                   int64_t* total) {
  mass.resize(idx.size());
  int64_t z = 0;
  for (size_t j = 0; j < idx.size(); ++j) z += (mass[j] = mass_q(det_exp(mr_add(x[idx[j]], -m))));
  if (total) *total = z;
}

// Keeps the entries of s.cand whose key is >= threshold (stable, so ids stay ascending).
void keep_at_least(Scratch& s, uint32_t threshold) {
  size_t w = 0;
  for (size_t j = 0; j < s.cand.size(); ++j)
    if (s.keys[j] >= threshold) s.cand[w++] = s.cand[j];
  s.cand.resize(w);
}

// Filtering scan over the row: collects every index with x >= tau, raising tau whenever the
// buffer outgrows its capacity. `raise` maps the current buffer to a new threshold key. Returns
// false (buffer abandoned) once the capacity would pass `limit`: the support is wide, and one
// histogram pass over the row is then cheaper than compacting ever larger buffers.
template <typename Raise>
bool filter_row(const float* x, int64_t v, float tau, size_t cap, size_t limit, Scratch& s, Raise raise) {
  s.cand.clear();
  int64_t i = 0;
  while (i < v) {
    i = scan_at_least(x, i, v, tau, s.cand, cap);
    if (s.cand.size() > cap) {
      gather_keys(x, s.cand, s.keys);
      const uint32_t t = raise(s);
      keep_at_least(s, t);
      tau = std::max(tau, key_value(t));
      if (s.cand.size() * 2 > cap) {  // heavy ties or a wide support: compaction stopped paying
        cap *= 2;
        if (cap > limit) return false;
      }
    }
  }
  return true;
}

// Every index with x >= tau, in order (no capacity limit, no compaction).
void collect_at_least(const float* x, int64_t v, float tau, Scratch& s) {
  s.cand.clear();
  scan_at_least(x, 0, v, tau, s.cand, ~size_t(0) >> 1);
}

// Support by one coarse histogram pass: the k-th largest (k > 0) or the top-p threshold
// (k == 0) over survivors x >= thr. The bin holding the threshold is resolved on its own
// elements; the elements of higher bins are kept without further work.
void select_by_histogram(const float* x, int64_t v, float m, float thr, int64_t k, double p, int64_t total,
                         Scratch& s) {
  s.hist_count.assign(kHistWays * kHistBins, 0);
  s.hist_mass.assign(kHistWays * kHistBins, 0);
  histogram_row(x, v, m, thr, s.hist_count.data(), k > 0 ? nullptr : s.hist_mass.data());
  int64_t survivors = 0;
  for (int b = 0; b < kHistBins; ++b) survivors += s.hist_count[b];
  if (k > 0 && k >= survivors) {
    collect_at_least(x, v, thr, s);
    return;
  }
  int chosen = kHistBins - 1;
  int64_t rest = k, above = 0, cum = 0;
  for (int b = kHistBins - 1; b >= 0; --b) {
    if (s.hist_count[b] == 0) continue;
    if (k > 0) {
      chosen = b;
      if (s.hist_count[b] >= rest) break;
      rest -= s.hist_count[b];
    } else {
      if (!below_top_p(cum, p, total)) break;
      chosen = b;
      above = cum;
      cum += s.hist_mass[b];
    }
  }
  const uint64_t lo = uint64_t(chosen) << (32 - kHistBits), hi = lo + (uint64_t(1) << (32 - kHistBits));
  collect_at_least(x, v, std::max(thr, key_value(static_cast<uint32_t>(lo))), s);
  gather_keys(x, s.cand, s.keys);
  s.bin_idx.clear();
  s.bin_keys.clear();
  for (size_t j = 0; j < s.cand.size(); ++j) {
    if (s.keys[j] < hi) {
      s.bin_idx.push_back(s.cand[j]);
      s.bin_keys.push_back(s.keys[j]);
    }
  }
  uint32_t t;
  if (k > 0) {
    t = kth_largest_key(s.bin_keys.data(), s.bin_keys.size(), rest, s.ka, s.kb);
  } else {
    gather_masses(x, m, s.bin_idx, s.mass, nullptr);
    t = top_p_threshold_key(s.bin_keys.data(), s.mass.data(), s.bin_keys.size(), p, total, s.ka, s.ma, s.kb, s.mb,
                            above);
  }
  keep_at_least(s, t);
}

// Top-p alone, from the histogram that the mass pass filled (masses of the entries with
// x >= hist_low, hist_low >= max - 16 so every binned mass is > 0). The threshold lies in the
// lowest non-empty bin whose top element is kept (select_topp_digit's rule); that bin is complete
// when a non-empty bin lies below it, and then every entry below it has >= p * Z above. Returns
// false when no bin below stops the scan (the threshold may lie under hist_low): the caller falls
// back to the cut-off scan. Otherwise one pass collects that bin's entries, radix selection on
// them gives the exact key, and one compress pass writes the support to `out`.
bool select_top_p_from_histogram(const float* x, int64_t v, float m, double p, int64_t total, Scratch& s, IdList& out) {
  int64_t* h = s.hist_mass.data();
  for (int w = 1; w < kHistWays; ++w)
    for (int b = 0; b < kHistBins; ++b) h[b] += h[w * kHistBins + b];
  int chosen = -1;
  int64_t cum = 0, above = 0;
  bool bounded = false;
  for (int b = kHistBins - 1; b >= 0; --b) {
    if (h[b] == 0) continue;
    if (!below_top_p(cum, p, total)) {
      bounded = true;
      break;
    }
    chosen = b;
    above = cum;
    cum += h[b];
  }
  if (!bounded) return false;
  const uint64_t lo = uint64_t(chosen) << (32 - kHistBits), hi = lo + (uint64_t(1) << (32 - kHistBits));
  const float vlo = key_value(static_cast<uint32_t>(lo));
  const float vhi = hi >> 32 ? -kNegInf : key_value(static_cast<uint32_t>(hi));
  if (s.ids.size() < static_cast<size_t>(v) + 8) s.ids.resize(v + 8);
  int32_t* ids = s.ids.data();
  // Every entry >= vlo has a mass >= vlo's, which bounds how many there are. Few (LLM rows: a
  // handful of candidates): one compress pass collects them all and the bin is read from that
  // list. Many (flat rows): walking the list costs more than a vectorised pass, so one pass
  // collects the bin and a second compresses the support.
  const double fewest_mass = static_cast<double>(mass_q(det_exp(mr_add(vlo, -m))));
  const bool few = static_cast<double>(above + h[chosen]) <= 4096.0 * fewest_mass;
  s.bin_idx.clear();
  int64_t n = 0;
  if (few) {
    n = compress_at_least(x, v, vlo, ids);
    for (int64_t j = 0; j < n; ++j)
      if (x[ids[j]] < vhi) s.bin_idx.push_back(ids[j]);
  } else {
    collect_in_range(x, v, vlo, vhi, s.bin_idx);
  }
  gather_keys(x, s.bin_idx, s.bin_keys);
  gather_masses(x, m, s.bin_idx, s.mass, nullptr);
  const uint32_t t =
      top_p_threshold_key(s.bin_keys.data(), s.mass.data(), s.bin_keys.size(), p, total, s.ka, s.ma, s.kb, s.mb, above);
  const float tv = key_value(t);
  if (few) {
    int64_t w = 0;
    for (int64_t j = 0; j < n; ++j)
      if (x[ids[j]] >= tv) ids[w++] = ids[j];
    n = w;
  } else {
    n = compress_at_least(x, v, tv, ids);
  }
  out.insert(out.end(), ids, ids + n);
  return true;
}

template <typename T>
RowOutcome select_row(const T* z, int64_t v, const RowParams& prm, bool want_logz, bool avx512, bool may_defer,
                      Scratch& s, IdList& out) {
  RowOutcome res;
  (void)avx512;                   // unused where the build has no x86 vector paths
  if (prm.temperature == 0.0f) {  // greedy: the first maximum of the raw logits
    int64_t best = -1;
    float bm = kNegInf;
    for (int64_t i = 0; i < v; ++i) {
      const float zi = static_cast<float>(z[i]);
      if (zi != zi) return RowOutcome{1, i};
      if (zi == -kNegInf) return RowOutcome{2, i};
      if (zi > bm) {
        bm = zi;
        best = i;
      }
    }
    if (best < 0) return RowOutcome{4, -1};
    out.push_back(static_cast<int32_t>(best));
    return res;
  }

  // z / 1 == z exactly: fp32 rows at T == 1 are read in place, sparing the copy.
  const bool in_place = std::is_same_v<T, float> && prm.temperature == 1.0f;
  if (!in_place) s.x.resize(v);
  float* xbuf = in_place ? nullptr : s.x.data();
#if MR_CPU_AVX512
  // Block maxima feed only the AVX-512 top-p estimate.
  const bool levels = avx512 && top_p_active(prm.top_p) && prm.top_k <= 0;
  if (levels) s.block_max.resize(v / kBlock + 1);
  const LoadResult lr = avx512 ? load_row_avx512(z, v, prm.temperature, xbuf, levels ? s.block_max.data() : nullptr)
                               : load_row(z, v, prm.temperature, xbuf);
#else
  const LoadResult lr = load_row(z, v, prm.temperature, xbuf);
#endif
  if (lr.bad_code) return RowOutcome{lr.bad_code, lr.bad_col};
  if (lr.max == kNegInf) return RowOutcome{4, -1};
  const float* x = in_place ? reinterpret_cast<const float*>(z) : s.x.data();
  const float m = lr.max;
  const bool with_min_p = min_p_active(prm.min_p);
  const float thr = with_min_p ? mr_add(m, det_log(prm.min_p)) : kLowestFinite;
  const bool use_top_p = top_p_active(prm.top_p);
  const int64_t k = prm.top_k;

  // Every path starts with the load pass: it reads the V logits (4 or 2 bytes each); bf16/fp16 or
  // T != 1 also write V * 4 bytes of x, which the later passes read from cache (L2 holds rows up to
  // ~256k entries).
  //
  // Top-p alone, AVX-512: 2 more reads of x for most rows, the ids of wide supports written once,
  // straight into the output (traffic per pass in capture_cpu_top_p.cpp).
  //
  // Top-p alone, baseline (V entries, K kept, B in the threshold's bin): mass + histogram (reads x:
  // exp of every entry, binning of the entries within 16 of the max), the threshold bin's entries
  // (reads x, B ids), the support (reads x, writes K * 4 bytes of ids, copied once more into the
  // output tensor). About 4 reads of x. The cut-off scan below is the fallback when the histogram
  // cannot bound the threshold (it needs a second mass pass).
  //
  // Top-k (with or without top-p): one filtering scan (reads x; compares only, the candidates of a
  // small k stay in a buffer of max(1024, 2k) ids), radix selection on that buffer; a k too large
  // for the buffer reads x twice more (histogram, then the threshold bin). The K ids are copied
  // into the output tensor.
  if (use_top_p && k <= 0 && avx512) {
    select_top_p_levels(x, v, m, thr, prm.top_p, with_min_p, want_logz, may_defer, s, out, res);
    return res;
  }
  if (use_top_p && k <= 0) {
    const float hist_low = std::max(thr, mr_add(m, -16.0f));
    s.hist_mass.assign(kHistWays * kHistBins, 0);
    const MassSums fused = mass_sums(x, v, m, &thr, with_min_p ? 1 : 0, s.hist_mass.data(), hist_low);
    if (want_logz)
      res.logz = static_cast<float>(static_cast<double>(m) + std::log(static_cast<double>(fused.all) / kMassScaleD));
    const int64_t total = with_min_p ? fused.above[0] : fused.all;
    if (select_top_p_from_histogram(x, v, m, prm.top_p, total, s, out)) return res;
  }

  // One pass of exact masses when top-p needs the survivors' total (or logz the row's). Cut-offs:
  // [min-p threshold,] then levels below the max (x units; exp(-16) ~ 1e-7 of the max's mass)
  // from which top-p may start its scan.
  const bool top_p_alone = use_top_p && k <= 0;
  float cut[kCuts] = {};
  int ncut = 0;
  if (with_min_p && top_p_alone) cut[ncut++] = thr;
  const int first_level = ncut;
  if (top_p_alone)
    for (float below : {2.0f, 6.0f, 16.0f}) cut[ncut++] = std::max(thr, mr_add(m, -below));
  MassSums sums;
  if (want_logz || top_p_alone) sums = mass_sums(x, v, m, cut, ncut);
  if (want_logz)
    res.logz = static_cast<float>(static_cast<double>(m) + std::log(static_cast<double>(sums.all) / kMassScaleD));

  if (k > 0) {
    const size_t cap = static_cast<size_t>(std::max<int64_t>(1024, 2 * k));
    const bool narrow = filter_row(x, v, thr, cap, std::max<size_t>(8192, 8 * cap), s, [&](Scratch& sc) {
      return kth_largest_key(sc.keys.data(), sc.keys.size(), std::min<int64_t>(k, sc.keys.size()), sc.ka, sc.kb);
    });
    if (narrow) {
      gather_keys(x, s.cand, s.keys);
      if (k < static_cast<int64_t>(s.cand.size()))
        keep_at_least(s, kth_largest_key(s.keys.data(), s.keys.size(), k, s.ka, s.kb));
    } else {
      select_by_histogram(x, v, m, thr, k, 1.0, 0, s);
    }
    if (use_top_p) {
      int64_t total = 0;
      gather_keys(x, s.cand, s.keys);
      gather_masses(x, m, s.cand, s.mass, &total);
      keep_at_least(s, top_p_threshold_key(s.keys.data(), s.mass.data(), s.keys.size(), prm.top_p, total, s.ka, s.ma,
                                           s.kb, s.mb));
    }
  } else if (use_top_p) {
    const int64_t total = with_min_p ? sums.above[0] : sums.all;  // -inf entries have no mass
    // Entries below a cut-off whose upper part already holds p * Z have at least that much mass
    // strictly above them: none of them can be kept, so the scan starts at the highest such cut.
    float start = thr;
    for (int j = first_level; j < ncut; ++j) {
      if (!below_top_p(sums.above[j], prm.top_p, total)) {
        start = cut[j];
        break;
      }
    }
    // The buffer's own top-p key t may only become the scan's threshold once the buffer's mass
    // reaches p * Z: then every x < t has at least p * Z strictly above it in the buffer alone, so
    // it is dropped whatever the rest of the row holds. Below that mass, t is merely the buffer's
    // smallest key, and raising tau to it would drop later columns that the row keeps (the kept
    // set then depended on the column order). The final call sees every x >= tau, so its t is exact.
    auto raise = [&](Scratch& sc) {
      int64_t buffer_mass = 0;
      gather_masses(x, m, sc.cand, sc.mass, &buffer_mass);
      if (below_top_p(buffer_mass, prm.top_p, total)) return order_key(start);
      return top_p_threshold_key(sc.keys.data(), sc.mass.data(), sc.keys.size(), prm.top_p, total, sc.ka, sc.ma, sc.kb,
                                 sc.mb);
    };
    // Every mass is at most the max's (1.0 in these units), so the support holds at least
    // p * total / 2^40 tokens: past the filter's limit, go straight to the histogram.
    const bool wide = prm.top_p * (static_cast<double>(total) / kMassScaleD) > 4096.0;
    if (!wide && filter_row(x, v, start, 1024, 8192, s, raise)) {
      gather_keys(x, s.cand, s.keys);
      keep_at_least(s, raise(s));
    } else {
      select_by_histogram(x, v, m, start, 0, prm.top_p, total, s);
    }
  } else {
    collect_at_least(x, v, thr, s);
  }
  out.insert(out.end(), s.cand.begin(), s.cand.end());
  return res;
}

struct Params {
  const float* temperature;
  const int64_t* top_k;
  const double* top_p;
  const double* min_p;
  RowParams row(int64_t r) const { return RowParams{temperature[r], top_k[r], top_p[r], min_p[r]}; }
};

[[noreturn]] void throw_row_error(int64_t r, const RowOutcome& o) {
  switch (o.error) {
    case 1:
      TORCH_CHECK(false, "capture: row ", r, " contains NaN (column ", o.col, ")");
    case 2:
      TORCH_CHECK(false, "capture: row ", r, " contains +inf (column ", o.col, ")");
    case 3:
      TORCH_CHECK(false, "capture: row ", r, " overflows to +inf after dividing by the temperature (column ", o.col,
                  ")");
    default:
      TORCH_CHECK(false, "capture: row ", r, " has no finite logit");
  }
}

// Runs select_row over all rows in parallel; each chunk of rows appends to its own id buffer.
// Returns per-row counts; ids of chunk c are in chunk_ids[c], but for deferred rows (may_defer),
// whose ids are written by the output pass; `outcomes` gets every row's outcome. The first bad
// row is thrown unless `report_errors` (then it is in `outcomes`).
template <typename T>
std::vector<int64_t> run_rows(const at::Tensor& logits, const Params& prm, bool want_logz, float* logz,
                              std::vector<IdList>& chunk_ids, std::vector<int64_t>& chunk_start, bool may_defer,
                              bool report_errors, std::vector<RowOutcome>& outcomes) {
  const int64_t n = logits.size(0), v = logits.size(1), stride = logits.stride(0);
  const T* base = logits.const_data_ptr<T>();
  // chunks of at least kMinTaskWork logits each: a small input is one chunk, run on this thread
  const int64_t nchunks = std::min<int64_t>(
      {n, std::max<int64_t>(1, at::get_num_threads()) * 8, std::max<int64_t>(1, n * v / kMinTaskWork)});
  if (static_cast<int64_t>(chunk_ids.size()) < nchunks) chunk_ids.resize(nchunks);
  for (auto& c : chunk_ids) c.clear();  // keeps capacity: pooled buffers spare page faults
  chunk_start.resize(nchunks + 1);
  for (int64_t c = 0; c <= nchunks; ++c) chunk_start[c] = n * c / std::max<int64_t>(nchunks, 1);
  std::vector<int64_t> counts(n, 0);
  std::vector<RowOutcome> errs(n);
  const bool avx512 = cpu_has_avx512();
  at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    Scratch& s = thread_scratch();
    for (int64_t c = c0; c < c1; ++c) {
      for (int64_t r = chunk_start[c]; r < chunk_start[c + 1]; ++r) {
        const size_t before = chunk_ids[c].size();
        RowOutcome o = select_row(base + r * stride, v, prm.row(r), want_logz, avx512, may_defer, s, chunk_ids[c]);
        counts[r] = o.deferred ? o.count : static_cast<int64_t>(chunk_ids[c].size() - before);
        if (logz) logz[r] = o.logz;
        errs[r] = o;
      }
    }
  });
  for (int64_t r = 0; r < n && !report_errors; ++r)
    if (errs[r].error != 0) throw_row_error(r, errs[r]);
  outcomes.swap(errs);
  return counts;
}

template <typename F>
void dispatch_dtype(const at::Tensor& logits, F&& f) {
  switch (logits.scalar_type()) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    default:
      TORCH_CHECK(false, "capture: unsupported logits dtype ", logits.scalar_type());
  }
}

at::Tensor row_major(const at::Tensor& logits) { return logits.stride(1) == 1 ? logits : logits.contiguous(); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> capture_cpu(const at::Tensor& logits_in, const at::Tensor& temperature,
                                                           const at::Tensor& top_k, const at::Tensor& top_p,
                                                           const at::Tensor& min_p, bool compute_logz) {
  check_capture_args(logits_in, temperature, top_k, top_p, min_p);
  const auto t = temperature.contiguous(), kk = top_k.contiguous(), p = top_p.contiguous(), mp = min_p.contiguous();
  check_row_params(t, p, mp);
  const at::Tensor logits = row_major(logits_in);
  const int64_t n = logits.size(0);
  at::Tensor logz = at::empty({compute_logz ? n : 0}, logits.options().dtype(at::kFloat));
  const Params prm{t.const_data_ptr<float>(), kk.const_data_ptr<int64_t>(), p.const_data_ptr<double>(),
                   mp.const_data_ptr<double>()};
  std::vector<IdList>& chunk_ids = thread_chunk_pool();
  std::vector<int64_t> chunk_start, counts;
  std::vector<RowOutcome> outcomes;
  at::Tensor offsets = at::empty({n + 1}, logits.options().dtype(at::kLong)), ids;
  dispatch_dtype(logits, [&](auto tag) {
    using T = decltype(tag);
    counts = run_rows<T>(logits, prm, compute_logz, compute_logz ? logz.data_ptr<float>() : nullptr, chunk_ids,
                         chunk_start, true, false, outcomes);
    int64_t* off = offsets.data_ptr<int64_t>();
    off[0] = 0;
    for (int64_t r = 0; r < n; ++r) off[r + 1] = off[r] + counts[r];
    ids = at::empty({off[n]}, logits.options().dtype(at::kInt));
    int32_t* out = ids.data_ptr<int32_t>();
    const T* base = logits.const_data_ptr<T>();
    const int64_t v = logits.size(1), stride = logits.stride(0);
    // The output pass: each chunk's list copied to its rows' places, deferred rows compressed there.
    at::parallel_for(0, static_cast<int64_t>(chunk_start.size()) - 1, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int32_t* src = chunk_ids[c].data();
        for (int64_t r = chunk_start[c]; r < chunk_start[c + 1]; ++r) {
          if (outcomes[r].deferred) {
            write_deferred_row(base + r * stride, v, prm.temperature[r], outcomes[r].threshold, counts[r],
                               out + off[r]);
          } else {
            std::copy(src, src + counts[r], out + off[r]);
            src += counts[r];
          }
        }
      }
    });
  });
  return {ids, offsets, logz};
}

// Fixed-capacity variant: same supports, packed into [N, width]. Bad rows are reported through
// counts = -1 (and overflow) instead of an exception, as on CUDA where raising would need a sync.
std::tuple<at::Tensor, at::Tensor, at::Tensor> capture_fixed_cpu(const at::Tensor& logits_in,
                                                                 const at::Tensor& temperature, const at::Tensor& top_k,
                                                                 const at::Tensor& top_p, const at::Tensor& min_p,
                                                                 int64_t width) {
  check_capture_args(logits_in, temperature, top_k, top_p, min_p);
  TORCH_CHECK(width >= 1, "capture_fixed: width must be >= 1, got ", width);
  const at::Tensor logits = row_major(logits_in);
  const int64_t n = logits.size(0);
  auto t = temperature.contiguous().clone(), kk = top_k.contiguous(), p = top_p.contiguous().clone(),
       mp = min_p.contiguous().clone();
  // Rows with invalid parameters become flagged rows: give them harmless values, mark them below.
  std::vector<bool> bad_param(n, false);
  {
    float* tp = t.data_ptr<float>();
    double* pp = p.data_ptr<double>();
    double* mpp = mp.data_ptr<double>();
    for (int64_t r = 0; r < n; ++r) {
      if (!(tp[r] >= 0.0f && !std::isinf(tp[r])) || !(pp[r] > 0.0 && pp[r] <= 1.0) ||
          !(mpp[r] >= 0.0 && mpp[r] <= 1.0)) {
        bad_param[r] = true;
        tp[r] = 1.0f, pp[r] = 1.0, mpp[r] = 0.0;
      }
    }
  }
  const Params prm{t.const_data_ptr<float>(), kk.const_data_ptr<int64_t>(), p.const_data_ptr<double>(),
                   mp.const_data_ptr<double>()};
  std::vector<IdList>& chunk_ids = thread_chunk_pool();
  std::vector<int64_t> chunk_start, counts;
  std::vector<RowOutcome> outcomes;
  dispatch_dtype(logits, [&](auto tag) {
    using T = decltype(tag);
    counts = run_rows<T>(logits, prm, false, nullptr, chunk_ids, chunk_start, false, true, outcomes);
  });
  at::Tensor ids = at::full({n, width}, -1, logits.options().dtype(at::kInt));
  at::Tensor cnt = at::empty({n}, logits.options().dtype(at::kLong));
  at::Tensor overflow = at::empty({n}, logits.options().dtype(at::kBool));
  int32_t* idp = ids.data_ptr<int32_t>();
  int64_t* cp = cnt.data_ptr<int64_t>();
  bool* op = overflow.data_ptr<bool>();
  for (size_t c = 0; c + 1 < chunk_start.size(); ++c) {
    int64_t pos = 0;
    for (int64_t r = chunk_start[c]; r < chunk_start[c + 1]; ++r) {
      const bool bad = bad_param[r] || (!outcomes.empty() && outcomes[r].error != 0);
      cp[r] = bad ? -1 : counts[r];
      op[r] = bad || counts[r] > width;
      if (!bad) {
        const int64_t keep = std::min<int64_t>(counts[r], width);
        std::copy(chunk_ids[c].begin() + pos, chunk_ids[c].begin() + pos + keep, idp + r * width);
      }
      pos += counts[r];
    }
  }
  return {ids, cnt, overflow};
}

}  // namespace

std::string capture_isa_json() {
#if defined(__AVX2__)
  const std::string build = "avx2";
#else
  const std::string build = "baseline";
#endif
#if MR_CPU_AVX512
  const char* avx512 = !cpu_supports_avx512()     ? "unsupported-cpu"
                       : avx512_disabled_by_env() ? "disabled-by-env"
                                                  : "used";
#else
  const char* avx512 = "not-built";
#endif
  const std::string now = cpu_has_avx512() ? "avx512" : build;
  return "\"cpu_isa\": \"" + now + "\", \"cpu_build_isa\": \"" + build + "\", \"cpu_avx512\": \"" + avx512 + "\"";
}

}  // namespace cpu
}  // namespace mask_replay

TORCH_LIBRARY_IMPL(mask_replay, CPU, m) {
  m.impl("capture", &mask_replay::cpu::capture_cpu);
  m.impl("capture_fixed", &mask_replay::cpu::capture_fixed_cpu);
}
