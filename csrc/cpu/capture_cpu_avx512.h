// AVX-512 bodies of the CPU capture loops, chosen at run time (cpu_has_avx512): the extension is
// built for the build machine's baseline (AVX2 at most), and these functions carry their own target
// attribute, so one build runs everywhere and uses 16 lanes where the CPU has them. As in
// capture_cpu_loops.h, every vector body computes exactly what the scalar tail computes (same
// operations, same order): the supports do not depend on the ISA. MASK_REPLAY_NO_AVX512=1 turns
// these paths off at run time (differential tests, or a CPU that down-clocks under AVX-512).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "capture_cpu_loops.h"
#include "det_exp_avx512.h"
#include "kernels/kernel_math.h"

#if MR_CPU_AVX512
#pragma GCC diagnostic push  // popped at the end of this header
#pragma GCC diagnostic ignored "-Wpsabi"
// GCC 12's AVX-512 intrinsics build "undefined" vectors from themselves (`__m512 __Y = __Y;`), which
// -Wall reports once inlined here; nothing of ours is uninitialised.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace mask_replay {
namespace cpu {

// Whether this CPU has the AVX-512 subsets the loops use (false where the build has no x86 vector paths).
inline bool cpu_supports_avx512() {
#if MR_CPU_AVX512
  static const bool supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return supported;
#else
  return false;
#endif
}

// MASK_REPLAY_NO_AVX512 set to anything but "" or "0".
inline bool avx512_disabled_by_env() {
  const char* off = std::getenv("MASK_REPLAY_NO_AVX512");
  return off && *off && std::strcmp(off, "0") != 0;
}

// Read on every call (getenv is cheap next to a row), so a test can compare both paths in one process.
inline bool cpu_has_avx512() { return cpu_supports_avx512() && !avx512_disabled_by_env(); }

#if MR_CPU_AVX512
MR_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
MR_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
MR_AVX512 inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// load_row (capture_cpu_loops.h) on 16 lanes, two accumulators: x = z / T, row max, defect flags,
// and with `block_max` the max of every block of kBlock entries (the last one may be partial),
// which tells the top-p estimate where a peaked row's few large entries are. kDivide false at T == 1:
// z / 1 == z exactly, and a division per entry is a good part of this pass.
constexpr int64_t kBlock = 256;
template <bool kDivide, typename T>
MR_AVX512 LoadResult load_row_avx512(const T* z, int64_t v, float temp, float* x, float* block_max) {
  LoadResult r;
  const __m512 t16 = _mm512_set1_ps(temp), inf16 = _mm512_set1_ps(-kNegInf);
  __mmask16 bad = 0;
  float m = kNegInf;
  int64_t i = 0;
  // Blocks of two chains of 16, written out: a lambda would not inherit this function's target.
  for (int64_t b = 0; i + kBlock <= v; ++b) {
    __m512 max_a = _mm512_set1_ps(kNegInf), max_b = max_a;
    for (const int64_t stop = i + kBlock; i < stop; i += 32) {
      const __m512 za = load16(z + i), zb = load16(z + i + 16);
      const __m512 xa = kDivide ? _mm512_div_ps(za, t16) : za, xb = kDivide ? _mm512_div_ps(zb, t16) : zb;
      if (x) {
        _mm512_storeu_ps(x + i, xa);
        _mm512_storeu_ps(x + i + 16, xb);
      }
      max_a = _mm512_max_ps(xa, max_a);  // NaN lanes keep the max; they are reported as defects anyway
      max_b = _mm512_max_ps(xb, max_b);
      bad |= _mm512_cmp_ps_mask(za, za, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(xa, inf16, _CMP_EQ_OQ) |
             _mm512_cmp_ps_mask(zb, zb, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(xb, inf16, _CMP_EQ_OQ);
    }
    const float bm = _mm512_reduce_max_ps(_mm512_max_ps(max_a, max_b));
    if (block_max) block_max[b] = bm;
    m = bm > m ? bm : m;
  }
  float tail = kNegInf;
  bool defect = bad != 0;
  for (; i < v; ++i) {
    const float zi = load_one(z, i);
    const float xi = mr_div(zi, temp);
    if (x) x[i] = xi;
    tail = xi > tail ? xi : tail;
    defect |= (zi != zi) || (xi == -kNegInf);
  }
  if (block_max && v % kBlock) block_max[v / kBlock] = tail;
  m = tail > m ? tail : m;
  if (defect) find_defect(z, v, temp, r);
  r.max = m;
  return r;
}

template <typename T>
MR_AVX512 LoadResult load_row_avx512(const T* z, int64_t v, float temp, float* x, float* block_max) {
  return temp == 1.0f ? load_row_avx512<false>(z, v, temp, x, block_max)
                      : load_row_avx512<true>(z, v, temp, x, block_max);
}

// mass_q (kernel_math.h) of 16 values as two 8-lane int64 halves: det_exp of x - m scaled by 2^40,
// truncated (= mass_q's floor, the values being >= 0).
struct Masses16 {
  __m512i lo, hi;
};
MR_AVX512 inline Masses16 masses16(__m512 x16, __m512 m16) {
  const __m512 q = _mm512_mul_ps(det_exp16(_mm512_sub_ps(x16, m16)), _mm512_set1_ps(kMassScale));
  return {_mm512_cvttps_epi64(_mm512_castps512_ps256(q)), _mm512_cvttps_epi64(_mm512_extractf32x8_ps(q, 1))};
}

// Exact fixed-point masses (kernel_math.h's mass_q) of all entries and of the entries with
// x >= level[j], and their counts, for L levels at once: per 16 entries one exp, then a compare,
// two masked 64-bit adds and a masked count a level. Integer sums, so the order of the lanes does
// not matter. The same pass writes the values in [win_lo, win_hi) to `window` (room for v + 16):
// when the threshold lies there, no other pass reads the row for it.
constexpr int kMaxLevels = 7;
struct LevelMasses {
  int64_t all = 0;
  int64_t above[kMaxLevels] = {};
  int64_t count[kMaxLevels] = {};
  int64_t window = 0;  // values written to the window buffer
};

template <int L>
MR_AVX512 LevelMasses level_masses_avx512(const float* x, int64_t v, float m, const float* level, float win_lo,
                                          float win_hi, float* window) {
  static_assert(L <= kMaxLevels, "LevelMasses holds kMaxLevels levels");
  LevelMasses out;
  const __m512 m16 = _mm512_set1_ps(m);
  const __m512 wlo = _mm512_set1_ps(win_lo), whi = _mm512_set1_ps(win_hi);
  __m512 lv[L];
  __m512i lo[L], hi[L];
  int64_t cnt[L] = {};  // counted with scalar popcounts: the vector ports are the busy ones
  for (int j = 0; j < L; ++j) {
    lv[j] = _mm512_set1_ps(level[j]);
    lo[j] = hi[j] = _mm512_setzero_si512();
  }
  __m512i all_lo = _mm512_setzero_si512(), all_hi = all_lo;
  int64_t i = 0, nw = 0;
  for (; i + 16 <= v; i += 16) {
    const __m512 x16 = _mm512_loadu_ps(x + i);
    const Masses16 q = masses16(x16, m16);
    all_lo = _mm512_add_epi64(all_lo, q.lo);
    all_hi = _mm512_add_epi64(all_hi, q.hi);
#pragma GCC unroll 8
    for (int j = 0; j < L; ++j) {
      const __mmask16 k = _mm512_cmp_ps_mask(x16, lv[j], _CMP_GE_OQ);
      lo[j] = _mm512_mask_add_epi64(lo[j], static_cast<__mmask8>(k), lo[j], q.lo);
      hi[j] = _mm512_mask_add_epi64(hi[j], static_cast<__mmask8>(k >> 8), hi[j], q.hi);
      cnt[j] += __builtin_popcount(k);
    }
    const __mmask16 in_window = _mm512_cmp_ps_mask(x16, wlo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(x16, whi, _CMP_LT_OQ);
    _mm512_storeu_ps(window + nw, _mm512_maskz_compress_ps(in_window, x16));
    nw += __builtin_popcount(in_window);
  }
  out.all = _mm512_reduce_add_epi64(_mm512_add_epi64(all_lo, all_hi));
  for (int j = 0; j < L; ++j) {
    out.above[j] = _mm512_reduce_add_epi64(_mm512_add_epi64(lo[j], hi[j]));
    out.count[j] = cnt[j];
  }
  for (; i < v; ++i) {
    const int64_t q = mass_q(det_exp(mr_add(x[i], -m)));
    out.all += q;
    for (int j = 0; j < L; ++j) {
      if (x[i] >= level[j]) {
        out.above[j] += q;
        ++out.count[j];
      }
    }
    if (x[i] >= win_lo && x[i] < win_hi) window[nw++] = x[i];
  }
  out.window = nw;
  return out;
}

// Where top-p's threshold probably lies, from a weighted sample binned by nats below the max (1/32
// nat bins, 24 nats deep; lower entries carry < 1e-10 of the max's mass): every entry of the
// kHotBlocks blocks with the largest maxima (a peaked row's few large entries, which a sparse
// sample would miss), and the first 16 entries of every 4th remaining block, counted 64 times.
// Only a guess: it places the exact mass levels, never the support.
constexpr int kHotBlocks = 8;
constexpr int kEstimatePerNat = 32, kEstimateBins = 24 * kEstimatePerNat;
struct CutEstimate {
  float cut = __builtin_nanf("");  // NaN: nothing sampled
  float half_width = 0.0f;         // nats either side of `cut` that likely hold the threshold
  bool peaked = false;             // most of the mass was counted exactly (the hot blocks)
};

struct EstimateSums {
  double hist[kEstimateBins] = {};
  double total = 0.0, exact = 0.0;
  double sampled_sq[kEstimateBins] = {};  // squared weighted masses of the sampled (not exact) entries
};

// Adds the masses of the `live` lanes of x[0, 16) to the estimate's histogram: counted exactly
// (kSampled false: weight 1) or as a sample standing for kSampleWeight entries each.
constexpr int64_t kSampleEvery = 4;  // blocks: 16 entries of every 4th block, 1/64 of the row
constexpr float kSampleWeight = static_cast<float>(kSampleEvery * kBlock / 16);

template <bool kSampled>
MR_AVX512 inline void estimate_add16(const float* x, uint32_t live, float m, float floor, EstimateSums& e) {
  alignas(64) float w[16];
  alignas(64) int32_t bin[16];
  const __m512 m16 = _mm512_set1_ps(m);
  const __m512 x16 = _mm512_maskz_loadu_ps(static_cast<__mmask16>(live), x);
  const __m512 below = _mm512_sub_ps(m16, x16);
  live &= _mm512_cmp_ps_mask(x16, _mm512_set1_ps(floor), _CMP_GE_OQ) &
          _mm512_cmp_ps_mask(below, _mm512_set1_ps(24.0f), _CMP_LT_OQ);
  if (!live) return;
  __m512 q = _mm512_maskz_mov_ps(static_cast<__mmask16>(live), det_exp16(_mm512_sub_ps(x16, m16)));
  if (kSampled) q = _mm512_mul_ps(q, _mm512_set1_ps(kSampleWeight));
  _mm512_store_ps(w, q);
  const double sum = _mm512_reduce_add_ps(q);
  e.total += sum;
  if (!kSampled) e.exact += sum;
  // 0 <= bin (m is the row's max); the last bin takes everything deeper
  const __m512i b = _mm512_cvttps_epi32(_mm512_mul_ps(below, _mm512_set1_ps(float(kEstimatePerNat))));
  _mm512_store_si512(
      bin, _mm512_min_epi32(_mm512_max_epi32(b, _mm512_setzero_si512()), _mm512_set1_epi32(kEstimateBins - 1)));
  while (live) {
    const int j = __builtin_ctz(live);
    live &= live - 1;
    e.hist[bin[j]] += w[j];
    if (kSampled) e.sampled_sq[bin[j]] += static_cast<double>(w[j]) * w[j];
  }
}

MR_AVX512 inline CutEstimate estimate_top_p_cut(const float* x, int64_t v, float m, float floor, double p,
                                                const float* block_max, std::vector<int32_t>& order) {
  EstimateSums e;
  const int64_t nblocks = (v + kBlock - 1) / kBlock;
  order.resize(nblocks);
  for (int64_t b = 0; b < nblocks; ++b) order[b] = static_cast<int32_t>(b);
  const int64_t nhot = std::min<int64_t>(kHotBlocks, nblocks);
  std::nth_element(order.begin(), order.begin() + (nhot - 1), order.end(),
                   [&](int32_t a, int32_t b) { return block_max[a] > block_max[b]; });
  std::sort(order.begin(), order.begin() + nhot);
  for (int64_t h = 0; h < nhot; ++h) {
    const int64_t begin = order[h] * kBlock, end = std::min(v, begin + kBlock);
    for (int64_t i = begin; i < end; i += 16)
      estimate_add16<false>(x + i, end - i >= 16 ? 0xffffu : (1u << (end - i)) - 1, m, floor, e);
  }
  int64_t h = 0;
  for (int64_t b = 0; b < nblocks; b += kSampleEvery) {
    while (h < nhot && order[h] < b) ++h;
    if ((h < nhot && order[h] == b) || b * kBlock + 16 > v) continue;
    estimate_add16<true>(x + b * kBlock, 0xffffu, m, floor, e);
  }
  CutEstimate out;
  if (!(e.total > 0.0)) return out;
  double cum = 0.0;
  int b = 0;
  for (; b < kEstimateBins - 1; ++b) {
    cum += e.hist[b];
    if (cum >= p * e.total) break;
  }
  out.cut = m - (static_cast<float>(b) + 0.5f) / kEstimatePerNat;
  // Sampling error of the fraction of the mass above the cut (a ratio estimate: each sampled entry
  // counts with its distance from p), turned into nats by the mass per nat around the cut (5 bins):
  // 3 standard errors, at least one bin, at most one nat.
  double local = 0.0, var = 0.0;
  for (int d = -2; d <= 2; ++d)
    if (b + d >= 0 && b + d < kEstimateBins) local += e.hist[b + d];
  for (int k = 0; k < kEstimateBins; ++k) var += e.sampled_sq[k] * (k <= b ? (1.0 - p) * (1.0 - p) : p * p);
  const double per_nat = local / e.total * kEstimatePerNat / 5.0;
  const double err = std::sqrt(var) / e.total;
  const double half = per_nat > 0.0 ? 3.0 * err / per_nat : 1.0;
  out.half_width = static_cast<float>(std::min(1.0, std::max(1.0 / kEstimatePerNat, half)));
  out.peaked = e.exact > 0.5 * e.total;
  return out;
}

// One exp pass for peaked rows: the total mass, with kMinP the survivors' mass (at or above
// `floor`), and the ids of the entries at or above `cut`, ascending, in ids (room for v + 16).
struct MassesAndCandidates {
  int64_t all = 0, survivors = 0, n = 0;
};

template <bool kMinP>
MR_AVX512 MassesAndCandidates masses_and_candidates_avx512(const float* x, int64_t v, float m, float floor, float cut,
                                                           int32_t* ids) {
  MassesAndCandidates out;
  const __m512 m16 = _mm512_set1_ps(m);
  const __m512 floor16 = _mm512_set1_ps(floor), cut16 = _mm512_set1_ps(cut);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i all_lo = _mm512_setzero_si512(), all_hi = all_lo, sur_lo = all_lo, sur_hi = all_lo;
  int64_t i = 0, n = 0;
  for (; i + 16 <= v; i += 16) {
    const __m512 x16 = _mm512_loadu_ps(x + i);
    const Masses16 q = masses16(x16, m16);
    all_lo = _mm512_add_epi64(all_lo, q.lo);
    all_hi = _mm512_add_epi64(all_hi, q.hi);
    if (kMinP) {
      const __mmask16 k = _mm512_cmp_ps_mask(x16, floor16, _CMP_GE_OQ);
      sur_lo = _mm512_mask_add_epi64(sur_lo, static_cast<__mmask8>(k), sur_lo, q.lo);
      sur_hi = _mm512_mask_add_epi64(sur_hi, static_cast<__mmask8>(k >> 8), sur_hi, q.hi);
    }
    const __mmask16 c = _mm512_cmp_ps_mask(x16, cut16, _CMP_GE_OQ);
    const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(i)));
    _mm512_storeu_si512(ids + n, _mm512_maskz_compress_epi32(c, idx));
    n += __builtin_popcount(c);
  }
  out.all = _mm512_reduce_add_epi64(_mm512_add_epi64(all_lo, all_hi));
  out.survivors = kMinP ? _mm512_reduce_add_epi64(_mm512_add_epi64(sur_lo, sur_hi)) : out.all;
  for (; i < v; ++i) {
    const int64_t q = mass_q(det_exp(mr_add(x[i], -m)));
    out.all += q;
    if (!kMinP || x[i] >= floor) out.survivors += q;
    if (x[i] >= cut) ids[n++] = static_cast<int32_t>(i);
  }
  out.n = n;
  return out;
}

// compress_at_least (capture_cpu_loops.h) on 16 lanes: every index with x[i] >= tau, ascending.
// dst must have room for v + 16 entries. Compress in a register, then a plain store: a masked
// compress-store to memory is several times slower on AMD's cores.
MR_AVX512 inline int64_t compress_at_least_avx512(const float* x, int64_t v, float tau, int32_t* dst) {
  const __m512 tau16 = _mm512_set1_ps(tau);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t i = 0, n = 0;
  for (; i + 16 <= v; i += 16) {
    const __mmask16 k = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), tau16, _CMP_GE_OQ);
    const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(i)));
    _mm512_storeu_si512(dst + n, _mm512_maskz_compress_epi32(k, idx));
    n += __builtin_popcount(k);
  }
  for (; i < v; ++i)
    if (x[i] >= tau) dst[n++] = static_cast<int32_t>(i);
  return n;
}

// The values x[i] with lo <= x[i] < hi, in order; dst must have room for v + 16 entries.
MR_AVX512 inline int64_t values_in_range_avx512(const float* x, int64_t v, float lo, float hi, float* dst) {
  const __m512 lo16 = _mm512_set1_ps(lo), hi16 = _mm512_set1_ps(hi);
  int64_t i = 0, n = 0;
  for (; i + 16 <= v; i += 16) {
    const __m512 x16 = _mm512_loadu_ps(x + i);
    const __mmask16 k = _mm512_cmp_ps_mask(x16, lo16, _CMP_GE_OQ) & _mm512_cmp_ps_mask(x16, hi16, _CMP_LT_OQ);
    _mm512_storeu_ps(dst + n, _mm512_maskz_compress_ps(k, x16));
    n += __builtin_popcount(k);
  }
  for (; i < v; ++i)
    if (x[i] >= lo && x[i] < hi) dst[n++] = x[i];
  return n;
}

// The sum of mass_q over n values.
MR_AVX512 inline int64_t mass_sum_avx512(const float* val, int64_t n, float m) {
  const __m512 m16 = _mm512_set1_ps(m);
  __m512i lo = _mm512_setzero_si512(), hi = lo;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const Masses16 q = masses16(_mm512_loadu_ps(val + i), m16);
    lo = _mm512_add_epi64(lo, q.lo);
    hi = _mm512_add_epi64(hi, q.hi);
  }
  int64_t sum = _mm512_reduce_add_epi64(_mm512_add_epi64(lo, hi));
  for (; i < n; ++i) sum += mass_q(det_exp(mr_add(val[i], -m)));
  return sum;
}

// order_key and mass_q of n values (the entries of one bracket), 16 at a time.
MR_AVX512 inline void keys_and_masses_avx512(const float* val, int64_t n, float m, uint32_t* key, int64_t* mass) {
  const __m512 m16 = _mm512_set1_ps(m);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x16 = _mm512_loadu_ps(val + i);
    const __m512i u = _mm512_castps_si512(_mm512_add_ps(x16, _mm512_setzero_ps()));
    const __m512i flip = _mm512_or_si512(_mm512_srai_epi32(u, 31), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
    _mm512_storeu_si512(key + i, _mm512_xor_si512(u, flip));  // order_key
    const Masses16 q = masses16(x16, m16);
    _mm512_storeu_si512(mass + i, q.lo);
    _mm512_storeu_si512(mass + i + 8, q.hi);
  }
  for (; i < n; ++i) {
    key[i] = order_key(val[i]);
    mass[i] = mass_q(det_exp(mr_add(val[i], -m)));
  }
}
#endif

}  // namespace cpu
}  // namespace mask_replay

#if MR_CPU_AVX512
#pragma GCC diagnostic pop
#endif
