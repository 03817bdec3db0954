// The three full-row loops of the CPU capture kernel, with AVX2 bodies where the build has them.
// Each vector body computes exactly what its scalar tail computes (same operations, same order),
// so results do not depend on alignment or on the ISA the extension was built for.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

#include "kernels/kernel_math.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MR_CPU_AVX2 1
#endif

namespace mask_replay {
namespace cpu {

struct LoadResult {
  float max = kNegInf;
  int64_t bad_col = -1;  // first column with a defect, -1 if none
  int bad_code = 0;      // 1 NaN, 2 +inf in logits, 3 +inf after dividing by the temperature
};

template <typename T>
inline float load_one(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

#if MR_CPU_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// det_exp (kernel_math.h) on 8 lanes: the same operations in the same order, so the same bits.
inline __m256 det_exp8(__m256 d) {
  const __m256 n =
      _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(d, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(12582912.0f)),
                    _mm256_set1_ps(-12582912.0f));
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f),
                                    _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), d));
  __m256 p = _mm256_set1_ps(1.98412698412698413e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.38888888888888889e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.33333333333333333e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.16666666666666667e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.66666666666666667e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_and_ps(e, _mm256_cmp_ps(d, _mm256_set1_ps(-87.0f), _CMP_GT_OQ));
}

// order_key (kernel_math.h) on 8 lanes.
inline __m256i order_key8(__m256 x) {
  const __m256i u = _mm256_castps_si256(_mm256_add_ps(x, _mm256_setzero_ps()));
  const __m256i flip = _mm256_or_si256(_mm256_srai_epi32(u, 31), _mm256_set1_epi32(int(0x80000000u)));
  return _mm256_xor_si256(u, flip);
}
#endif

template <typename T>
inline void find_defect(const T* z, int64_t v, float temp, LoadResult& r) {
  for (int64_t i = 0; i < v; ++i) {
    const float zi = load_one(z, i);
    if (zi != zi) {
      r.bad_code = 1;
      r.bad_col = i;
      return;
    }
    if (zi == -kNegInf) {
      r.bad_code = 2;
      r.bad_col = i;
      return;
    }
    if (mr_div(zi, temp) == -kNegInf) {
      r.bad_code = 3;
      r.bad_col = i;
      return;
    }
  }
}

// x = z / T into `x` (not stored when x is null: fp32 logits at T == 1 are read in place),
// row max, defect flags.
template <typename T>
inline LoadResult load_row(const T* z, int64_t v, float temp, float* x) {
  LoadResult r;
  bool defect = false;
  int64_t i = 0;
  float m = kNegInf;
#if MR_CPU_AVX2
  const __m256 t8 = _mm256_set1_ps(temp), inf8 = _mm256_set1_ps(-kNegInf);
  __m256 vmax = _mm256_set1_ps(kNegInf), flags = _mm256_setzero_ps();
  for (; i + 8 <= v; i += 8) {
    const __m256 z8 = load8(z + i);
    const __m256 x8 = _mm256_div_ps(z8, t8);
    if (x) _mm256_storeu_ps(x + i, x8);
    vmax = _mm256_max_ps(x8, vmax);  // NaN lanes keep vmax; they are reported as defects anyway
    flags = _mm256_or_ps(flags, _mm256_cmp_ps(z8, z8, _CMP_UNORD_Q));
    flags = _mm256_or_ps(flags, _mm256_cmp_ps(x8, inf8, _CMP_EQ_OQ));  // +inf in z gives +inf in x
  }
  defect = _mm256_movemask_ps(flags) != 0;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (float l : lanes) m = l > m ? l : m;
#endif
  for (; i < v; ++i) {
    const float zi = load_one(z, i);
    const float xi = mr_div(zi, temp);
    if (x) x[i] = xi;
    m = xi > m ? xi : m;
    defect |= (zi != zi) || (xi == -kNegInf);
  }
  if (defect) find_defect(z, v, temp, r);
  r.max = m;
  return r;
}

// buf[i] = det_exp(buf[i] - m) in place (the full-row logsumexp of the replay ops).
inline void exp_shifted_inplace(float* buf, int64_t n, float m) {
  int64_t i = 0;
#if MR_CPU_AVX2
  const __m256 m8 = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(buf + i, det_exp8(_mm256_sub_ps(_mm256_loadu_ps(buf + i), m8)));
#endif
  for (; i < n; ++i) buf[i] = det_exp(mr_add(buf[i], -m));
}

// sum over i of det_exp(x[i] - m), accumulated in double (the full-row logsumexp of replay).
inline double sum_exp_shifted(const float* x, int64_t n, float m) {
  double total = 0.0;
  int64_t i = 0;
#if MR_CPU_AVX2
  const __m256 m8 = _mm256_set1_ps(m);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = det_exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m8));
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double t[4];
  _mm256_store_pd(t, _mm256_add_pd(lo, hi));
  total = (t[0] + t[1]) + (t[2] + t[3]);
#endif
  for (; i < n; ++i) total += static_cast<double>(det_exp(mr_add(x[i], -m)));
  return total;
}

// Histogram bins: the top kHistBits of order_key (sign, exponent, two mantissa bits).
constexpr int kHistBits = 11;
constexpr int kHistBins = 1 << kHistBits;
// Neighbouring lanes often hit the same bin; separate copies break the store-to-load chains.
constexpr int kHistWays = 4;

// Exact fixed-point masses (kernel_math.h) of all entries and of the entries with x >= cut[j],
// for up to kCuts cut-offs (the survivors' threshold, and levels below the max from which top-p
// may start its scan). The all-entries sum is vectorised; entries at or above the lowest cut-off
// are rare in LLM rows (a few tokens within 16 nats of the max), so they are added lane by lane.
// With `hist` (kHistWays * kHistBins zeroed entries), the masses of the entries with
// x >= hist_low are also added to their histogram bin (way = lane & 3), in the same pass.
constexpr int kCuts = 4;
struct MassSums {
  int64_t all = 0;
  int64_t above[kCuts] = {0, 0, 0, 0};
};

inline MassSums mass_sums(const float* x, int64_t v, float m, const float* cut, int ncut, int64_t* hist = nullptr,
                          float hist_low = -kNegInf) {
  MassSums s;
  float low = hist ? hist_low : -kNegInf;
  for (int j = 0; j < ncut; ++j) low = std::min(low, cut[j]);
  auto add_levels = [&](float xi, int64_t q, int way) {
    for (int j = 0; j < ncut; ++j)
      if (xi >= cut[j]) s.above[j] += q;
    if (hist && xi >= hist_low) hist[(order_key(xi) >> (32 - kHistBits)) + way * kHistBins] += q;
  };
  int64_t i = 0;
#if MR_CPU_AVX2
  const __m256 m8 = _mm256_set1_ps(m), low8 = _mm256_set1_ps(low);
  const __m256 scale = _mm256_set1_ps(kMassScale);
  // Lane sums of integers below 2^40 stay exact in double for 4096 steps; flush before that.
  constexpr int64_t kFlush = 4096;
  alignas(32) double t[4];
  alignas(32) float qs[8];
  alignas(32) uint32_t bins[8];
  const __m256 hist_low8 = _mm256_set1_ps(hist_low);
  const __m256i way8 = _mm256_setr_epi32(0, kHistBins, 2 * kHistBins, 3 * kHistBins, 0, kHistBins, 2 * kHistBins,
                                         3 * kHistBins);  // way = lane & 3, as in add_levels
  static_assert(kHistWays == 4, "way8 spells out four ways");
  while (i + 8 <= v) {
    __m256d all_lo = _mm256_setzero_pd(), all_hi = _mm256_setzero_pd();
    const int64_t stop = std::min<int64_t>(v - 7, i + 8 * kFlush);
    const int mode = _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC;
    auto step = [&](int64_t at, __m256d& lo, __m256d& hi) {
      const __m256 x8 = _mm256_loadu_ps(x + at);
      const __m256 q = _mm256_mul_ps(det_exp8(_mm256_sub_ps(x8, m8)), scale);
      lo = _mm256_add_pd(lo, _mm256_round_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(q)), mode));
      hi = _mm256_add_pd(hi, _mm256_round_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(q, 1)), mode));
      unsigned bits = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(x8, low8, _CMP_GE_OQ)));
      if (!bits) return;
      _mm256_store_ps(qs, q);  // below, truncation to int64 = the floor above
      if (hist) {
        // Bins computed 8 at a time; flat rows bin every lane, so that case skips the bit loop.
        unsigned hb = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(x8, hist_low8, _CMP_GE_OQ)));
        _mm256_store_si256(reinterpret_cast<__m256i*>(bins),
                           _mm256_add_epi32(_mm256_srli_epi32(order_key8(x8), 32 - kHistBits), way8));
        if (hb == 0xffu) {
          for (int j = 0; j < 8; ++j) hist[bins[j]] += static_cast<int64_t>(qs[j]);
        } else {
          while (hb) {
            const int j = __builtin_ctz(hb);
            hb &= hb - 1;
            hist[bins[j]] += static_cast<int64_t>(qs[j]);
          }
        }
      }
      if (ncut == 0) return;
      while (bits) {
        const int j = __builtin_ctz(bits);
        bits &= bits - 1;
        for (int c = 0; c < ncut; ++c)
          if (x[at + j] >= cut[c]) s.above[c] += static_cast<int64_t>(qs[j]);
      }
    };
    // Two independent exp chains per iteration: the polynomial is latency bound.
    __m256d lo2 = _mm256_setzero_pd(), hi2 = _mm256_setzero_pd();
    for (; i + 8 < stop; i += 16) {
      step(i, all_lo, all_hi);
      step(i + 8, lo2, hi2);
    }
    for (; i < stop; i += 8) step(i, all_lo, all_hi);
    all_lo = _mm256_add_pd(all_lo, lo2);  // exact: integers below 2^53
    all_hi = _mm256_add_pd(all_hi, hi2);
    _mm256_store_pd(t, all_lo);
    for (double d : t) s.all += static_cast<int64_t>(d);
    _mm256_store_pd(t, all_hi);
    for (double d : t) s.all += static_cast<int64_t>(d);
  }
#endif
  for (; i < v; ++i) {
    const int64_t q = mass_q(det_exp(mr_add(x[i], -m)));
    s.all += q;
    add_levels(x[i], q, 0);
  }
  return s;
}

// Appends to `cand` every index i in [begin, v) with x[i] >= tau. Returns the index where it
// stopped: v, or earlier once the candidate count passed `cap` (the caller compacts and resumes).
inline int64_t scan_at_least(const float* x, int64_t begin, int64_t v, float tau, std::vector<int32_t>& cand,
                             size_t cap) {
  int64_t i = begin;
#if MR_CPU_AVX2
  const __m256 tau8 = _mm256_set1_ps(tau);
  for (; i + 8 <= v; i += 8) {
    unsigned bits = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), tau8, _CMP_GE_OQ)));
    if (!bits) continue;
    while (bits) {
      cand.push_back(static_cast<int32_t>(i + __builtin_ctz(bits)));
      bits &= bits - 1;
    }
    if (cand.size() > cap) return i + 8;
  }
#endif
  for (; i < v; ++i) {
    if (x[i] >= tau) {
      cand.push_back(static_cast<int32_t>(i));
      if (cand.size() > cap) return i + 1;
    }
  }
  return v;
}

// Appends to `out` every index i with lo <= x[i] < hi (the elements of one histogram bin).
inline void collect_in_range(const float* x, int64_t v, float lo, float hi, std::vector<int32_t>& out) {
  int64_t i = 0;
#if MR_CPU_AVX2
  const __m256 lo8 = _mm256_set1_ps(lo), hi8 = _mm256_set1_ps(hi);
  for (; i + 8 <= v; i += 8) {
    const __m256 x8 = _mm256_loadu_ps(x + i);
    unsigned bits = static_cast<unsigned>(
        _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(x8, lo8, _CMP_GE_OQ), _mm256_cmp_ps(x8, hi8, _CMP_LT_OQ))));
    while (bits) {
      out.push_back(static_cast<int32_t>(i + __builtin_ctz(bits)));
      bits &= bits - 1;
    }
  }
#endif
  for (; i < v; ++i)
    if (x[i] >= lo && x[i] < hi) out.push_back(static_cast<int32_t>(i));
}

#if MR_CPU_AVX2
// For each 8-bit lane mask, the positions of its set bits packed to the front (compress table).
struct CompressTable {
  alignas(32) int32_t pos[256][8];
  CompressTable() {
    for (int mask = 0; mask < 256; ++mask) {
      int w = 0;
      for (int j = 0; j < 8; ++j)
        if (mask >> j & 1) pos[mask][w++] = j;
      while (w < 8) pos[mask][w++] = 0;
    }
  }
};
#endif

// Writes every index i with x[i] >= tau to dst, ascending; returns how many. dst must have room
// for v + 8 entries (the vector body stores whole lanes past the count).
inline int64_t compress_at_least(const float* x, int64_t v, float tau, int32_t* dst) {
  int64_t i = 0, n = 0;
#if MR_CPU_AVX2
  static const CompressTable table;
  const __m256 tau8 = _mm256_set1_ps(tau);
  for (; i + 8 <= v; i += 8) {
    const unsigned bits =
        static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), tau8, _CMP_GE_OQ)));
    const __m256i pos = _mm256_load_si256(reinterpret_cast<const __m256i*>(table.pos[bits]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + n),
                        _mm256_add_epi32(pos, _mm256_set1_epi32(static_cast<int32_t>(i))));
    n += __builtin_popcount(bits);
  }
#endif
  for (; i < v; ++i)
    if (x[i] >= tau) dst[n++] = static_cast<int32_t>(i);
  return n;
}

// Coarse histogram over the top kHistBits of the survivors' keys (x >= thr), with counts and,
// when `mass` is given, exact fixed-point masses. Used when the support is too wide for the
// filtering scan to stay small (flat distributions, large k).

// count and mass hold kHistWays * kHistBins zeroed entries; the result is in the first kHistBins.
inline void histogram_row(const float* x, int64_t v, float m, float thr, int64_t* count, int64_t* mass) {
  int64_t i = 0;
#if MR_CPU_AVX2
  const __m256 m8 = _mm256_set1_ps(m), thr8 = _mm256_set1_ps(thr);
  alignas(32) uint32_t keys[8];
  alignas(32) float q[8];
  for (; i + 8 <= v; i += 8) {
    const __m256 x8 = _mm256_loadu_ps(x + i);
    unsigned live = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(x8, thr8, _CMP_GE_OQ)));
    if (!live) continue;
    _mm256_store_si256(reinterpret_cast<__m256i*>(keys), order_key8(x8));
    if (mass) {
      const __m256 e = det_exp8(_mm256_sub_ps(x8, m8));
      _mm256_store_ps(q, _mm256_mul_ps(e, _mm256_set1_ps(kMassScale)));
    }
    while (live) {
      const int j = __builtin_ctz(live);
      live &= live - 1;
      const uint32_t b = (keys[j] >> (32 - kHistBits)) + (j & (kHistWays - 1)) * kHistBins;
      ++count[b];
      if (mass) mass[b] += static_cast<int64_t>(q[j]);
    }
  }
#endif
  for (; i < v; ++i) {
    if (!(x[i] >= thr)) continue;
    const uint32_t b = order_key(x[i]) >> (32 - kHistBits);
    ++count[b];
    if (mass) mass[b] += mass_q(det_exp(mr_add(x[i], -m)));
  }
  for (int w = 1; w < kHistWays; ++w) {
    for (int b = 0; b < kHistBins; ++b) {
      count[b] += count[w * kHistBins + b];
      if (mass) mass[b] += mass[w * kHistBins + b];
    }
  }
}

}  // namespace cpu
}  // namespace mask_replay
