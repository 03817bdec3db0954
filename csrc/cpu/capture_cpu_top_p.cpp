// Top-p on the CPU's 16-lane path: the threshold from exact masses at a few levels instead of a
// histogram of every entry (whose scalar bin adds made flat rows 2-10x softmax).
//
// Memory traffic per row (V entries, K kept; x = z / T in fp32 after the load pass, 4 bytes an
// entry; a row of up to 256k entries stays in L2 between the passes):
//   1. estimate_top_p_cut reads 8 blocks of x whole and 1/64 of the rest, and guesses where
//      the threshold lies, with its sampling error, and whether the row is peaked (most of the
//      mass in the blocks it counted whole);
//   2. peaked rows (LLM rows: a few strong candidates): one read of x, one exp an entry, gives the
//      total mass Z and writes the ids of the entries at or above a cut 2 nats under the guess
//      (4 bytes each, a handful). When they hold p * Z, radix selection on them gives the exact
//      threshold and they are filtered in place: done, 1 read of x;
//   3. other rows, or when step 2 fails: level passes (level_masses_avx512) read x, one exp an
//      entry: Z and the exact mass and count at or above two levels around the guess, and they
//      write the values between the two (the window, ~1-3% of a flat row). The threshold lies
//      between two neighbouring levels: entries below the lower one have at least p * Z above
//      them, entries at or above the upper one have less. When the guess missed (a few % of flat
//      rows), a second pass places six levels beyond the crossed one, and a third if needed; then
//      one more read of x collects the bracket's values. Wide brackets are narrowed by level
//      passes over their own values, then radix selection gives the exact threshold key;
//   4. the ids: few (K < V / 4) are compressed into the chunk's list at once (reads x, writes 4 K
//      bytes); many are deferred: the output pass compresses them from the logits straight into
//      the output (reads the V logits once more, writes 4 K bytes), sparing the list and its copy.
// So, besides the load pass: 1 read of x for peaked rows, 2 for most flat rows (3-4 for a missed
// guess) and, for wide supports, one read of the logits in the output pass. The guess only places
// the cut and the levels: a poor guess costs passes, never a different support.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>

#include "capture_cpu_avx512.h"
#include "capture_cpu_row.h"
#include "capture_cpu_select.h"
#include "kernels/kernel_math.h"

namespace mask_replay {
namespace cpu {

#if MR_CPU_AVX512
namespace {

// Distances (in the estimate's 1/32 nat bins) from a crossed level to the next pass's levels.
constexpr float kBeyond[6] = {1.0f, 3.0f, 8.0f, 24.0f, 64.0f, 192.0f};
constexpr int kLevelPasses = 3;
// A bracket this small is collected by one cheap pass; a candidate list this small is searched.
constexpr int64_t kSmallBracket = 4096;
constexpr int64_t kNarrowBracket = 2048;

// What is known of the threshold: every entry below lo is dropped, every entry at or above hi
// kept. `above` is the mass at or above hi, kept_above how many entries that is, at_lo how many
// are at or above lo (v until a level bounds it).
struct Bracket {
  float lo, hi = -kNegInf;
  int64_t above = 0, kept_above = 0, at_lo;
};

// Moves the bracket's bounds to the levels (descending) that bound the threshold. `lm` covers the
// whole row (of_bracket false) or only the bracket's values (true: the entries at or above hi add
// b.above and b.kept_above to every level).
MR_AVX512 void tighten(Bracket& b, const LevelMasses& lm, const float* level, int nlev, double p, int64_t total,
                       bool of_bracket) {
  const int64_t base_above = of_bracket ? b.above : 0, base_count = of_bracket ? b.kept_above : 0;
  int low = 0;
  while (low < nlev && level[low] >= b.hi) ++low;  // not inside: no information
  int j = low;
  while (j < nlev && level[j] > b.lo && below_top_p(base_above + lm.above[j], p, total)) ++j;
  if (j > low) {
    b.hi = level[j - 1];
    b.above = base_above + lm.above[j - 1];
    b.kept_above = base_count + lm.count[j - 1];
  }
  if (j < nlev && level[j] > b.lo) {
    b.lo = level[j];
    b.at_lo = base_count + lm.count[j];
  }
}

// level_masses_avx512 for a run-time number of levels (1 to kMaxLevels).
using LevelMassesFn = LevelMasses (*)(const float*, int64_t, float, const float*, float, float, float*);
constexpr LevelMassesFn kLevelMasses[kMaxLevels] = {
    &level_masses_avx512<1>, &level_masses_avx512<2>, &level_masses_avx512<3>, &level_masses_avx512<4>,
    &level_masses_avx512<5>, &level_masses_avx512<6>, &level_masses_avx512<7>};

MR_AVX512 LevelMasses level_masses_any(int nlev, const float* x, int64_t v, float m, const float* level, float win_lo,
                                       float win_hi, float* window) {
  return kLevelMasses[std::min(std::max(nlev, 1), kMaxLevels) - 1](x, v, m, level, win_lo, win_hi, window);
}

// The levels of one pass over the row, descending, and its window [win_lo, win_hi): the guess's
// two levels first; later, six levels beyond the bound the threshold crossed (or below the max
// when there is no guess). Returns how many levels, 0 when none fits strictly inside the bracket.
MR_AVX512 int place_levels(int pass, const CutEstimate& guess, float m, float floor, const Bracket& b, float* level,
                           float& win_lo, float& win_hi) {
  int nlev = 0;
  if (pass == 0 && guess.cut == guess.cut) {
    // Peaked rows also get a level 2 nats beyond each side: their threshold sits on one of a few
    // large entries, and a guess that misses it (a large entry outside the hot blocks) then still
    // leaves a bracket of a few entries instead of another pass over the row.
    // The window's lower edge is no level of the pass: the window's own masses give it
    // (with_window_level), one compare and two masked adds an entry fewer.
    const float hw = guess.half_width, outer = guess.peaked ? 2.0f : 0.0f;
    if (outer > 0.0f) level[nlev++] = std::min(m, mr_add(guess.cut, hw + outer));
    level[nlev++] = win_hi = std::min(m, mr_add(guess.cut, hw));
    win_lo = std::max(floor, mr_add(guess.cut, -hw));
    if (outer > 0.0f) level[nlev++] = std::max(floor, mr_add(guess.cut, -hw - outer));
    return nlev;
  }
  const bool upward = pass > 0 && b.hi == -kNegInf;  // the threshold lies above every level so far
  const float from = pass == 0 ? m : (upward ? b.lo : b.hi);
  for (float d : kBeyond) {
    const float l = mr_add(from, (upward ? d : -d) / kEstimatePerNat);
    if (l > b.lo && l < b.hi && l <= m) level[nlev++] = l;
  }
  for (int i = 1; i < nlev; ++i)  // descending; at most six
    for (int j = i; j > 0 && level[j] > level[j - 1]; --j) std::swap(level[j], level[j - 1]);
  if (nlev == 0) return 0;
  // The window: the bracket next to the crossed bound, where a near miss puts the threshold.
  win_lo = upward ? b.lo : level[0];
  win_hi = upward ? level[nlev - 1] : b.hi;
  return nlev;
}

// Adds the window's lower edge as a level to lm, from the level at its upper edge and the window's
// values (mass and count): every entry at or above win_lo is at or above win_hi or in the window.
MR_AVX512 int with_window_level(float* level, int nlev, LevelMasses& lm, float win_lo, float win_hi, const float* val,
                                float m) {
  int hi_at = 0;
  while (hi_at < nlev && level[hi_at] != win_hi) ++hi_at;
  if (hi_at == nlev || nlev == kMaxLevels) return nlev;  // no level at the upper edge: nothing derived
  const int64_t window_mass = mass_sum_avx512(val, lm.window, m);
  for (int j = nlev; j > hi_at + 1; --j) {  // make room below the upper edge
    level[j] = level[j - 1];
    lm.above[j] = lm.above[j - 1];
    lm.count[j] = lm.count[j - 1];
  }
  level[hi_at + 1] = win_lo;
  lm.above[hi_at + 1] = lm.above[hi_at] + window_mass;
  lm.count[hi_at + 1] = lm.count[hi_at] + lm.window;
  return nlev + 1;
}

// Level passes over the row until the bracket is small, or holds the window's values (then
// returned in s.bracket, with their count; -1 otherwise). Sets total (Z) and logz on the first pass.
MR_AVX512 int64_t search_bracket(const float* x, int64_t v, float m, float floor, double p, bool with_min_p,
                                 bool want_logz, const CutEstimate& guess, Scratch& s, Bracket& b, int64_t& total,
                                 RowOutcome& res) {
  for (int pass = 0; pass < kLevelPasses; ++pass) {
    float level[kMaxLevels], win_lo = 0.0f, win_hi = 0.0f;
    int nlev = place_levels(pass, guess, m, floor, b, level, win_lo, win_hi);
    if (nlev == 0) break;
    if (pass == 0 && with_min_p) level[nlev++] = floor;  // Z is the mass at or above it
    LevelMasses lm = level_masses_any(nlev, x, v, m, level, win_lo, win_hi, s.bracket.data());
    if (pass == 0) {
      total = with_min_p ? lm.above[nlev - 1] : lm.all;
      nlev = with_window_level(level, nlev, lm, win_lo, win_hi, s.bracket.data(), m);
      if (want_logz)
        res.logz = static_cast<float>(static_cast<double>(m) + std::log(static_cast<double>(lm.all) / kMassScaleD));
    }
    tighten(b, lm, level, nlev, p, total, false);
    if (b.lo == win_lo && b.hi == win_hi) return lm.window;
    if (b.at_lo - b.kept_above <= kSmallBracket) break;
  }
  return -1;
}

// Narrows a wide bracket of nb values (in place) by level passes over them, levels evenly spaced.
MR_AVX512 int64_t narrow_bracket(float* val, int64_t nb, float m, double p, int64_t total, Bracket& b) {
  for (int round = 0; round < 2 && nb > kNarrowBracket && b.hi != -kNegInf; ++round) {
    float level[6], unused[16];
    for (int j = 0; j < 6; ++j) level[j] = b.lo + (b.hi - b.lo) * static_cast<float>(6 - j) / 7.0f;
    const LevelMasses lm = level_masses_avx512<6>(val, nb, m, level, -kNegInf, -kNegInf, unused);
    tighten(b, lm, level, 6, p, total, true);
    const int64_t before = nb;
    nb = values_in_range_avx512(val, nb, b.lo, b.hi, val);  // in place: each write lands at or before its read
    if (nb == before) break;                                // ties: levels cannot split them
  }
  return nb;
}

// The exact threshold value: radix selection over the bracket's values, `above` the mass over them.
MR_AVX512 float threshold_in(const float* val, int64_t nb, float m, double p, int64_t total, int64_t above,
                             Scratch& s) {
  s.bin_keys.resize(nb);
  s.mass.resize(nb);
  keys_and_masses_avx512(val, nb, m, s.bin_keys.data(), s.mass.data());
  return key_value(top_p_threshold_key(s.bin_keys.data(), s.mass.data(), nb, p, total, s.ka, s.ma, s.kb, s.mb, above));
}

// Peaked rows (the estimate counted most of the mass exactly): one exp pass gives Z and lists the
// entries at or above a cut 2 nats under the guess's window; when they hold p * Z, the threshold is
// among them (radix selection on the list), and no level is needed. Returns false, the list
// dropped, when the cut was too high or the list too long for that.
MR_AVX512 bool top_p_peaked(const float* x, int64_t v, float m, float floor, double p, bool with_min_p, bool want_logz,
                            const CutEstimate& guess, Scratch& s, IdList& out, RowOutcome& res) {
  const float cut = std::max(floor, mr_add(guess.cut, -(guess.half_width + 2.0f)));
  const size_t base = out.size();
  out.resize(base + v + 16);
  int32_t* ids = out.data() + base;
  const MassesAndCandidates mc = with_min_p ? masses_and_candidates_avx512<true>(x, v, m, floor, cut, ids)
                                            : masses_and_candidates_avx512<false>(x, v, m, floor, cut, ids);
  if (mc.n <= kSmallBracket) {
    float* val = s.bracket.data();
    for (int64_t j = 0; j < mc.n; ++j) val[j] = x[ids[j]];
    const int64_t at_cut = mass_sum_avx512(val, mc.n, m);
    if (!below_top_p(at_cut, p, mc.survivors)) {
      if (want_logz)
        res.logz = static_cast<float>(static_cast<double>(m) + std::log(static_cast<double>(mc.all) / kMassScaleD));
      const float t = threshold_in(val, mc.n, m, p, mc.survivors, 0, s);
      int64_t w = 0;
      for (int64_t j = 0; j < mc.n; ++j)
        if (val[j] >= t) ids[w++] = ids[j];
      out.resize(base + w);
      return true;
    }
  }
  out.resize(base);
  return false;
}

MR_AVX512 void top_p_levels_avx512(const float* x, int64_t v, float m, float floor, double p, bool with_min_p,
                                   bool want_logz, bool may_defer, Scratch& s, IdList& out, RowOutcome& res) {
  const CutEstimate guess = estimate_top_p_cut(x, v, m, floor, p, s.block_max.data(), s.block_order);
  if (s.bracket.size() < static_cast<size_t>(v) + 16) s.bracket.resize(v + 16);
  if (guess.peaked && guess.cut == guess.cut &&
      top_p_peaked(x, v, m, floor, p, with_min_p, want_logz, guess, s, out, res))
    return;
  Bracket b{floor};
  b.at_lo = v;
  int64_t total = 0;
  int64_t nb = search_bracket(x, v, m, floor, p, with_min_p, want_logz, guess, s, b, total, res);
  float* val = s.bracket.data();
  const size_t base = out.size();
  if (nb < 0) nb = values_in_range_avx512(x, v, b.lo, b.hi, val);
  nb = narrow_bracket(val, nb, m, p, total, b);
  const float t = threshold_in(val, nb, m, p, total, b.above, s);
  int64_t count = b.kept_above;
  for (int64_t j = 0; j < nb; ++j) count += val[j] >= t;
  if (may_defer && 4 * count >= v) {
    res.deferred = true;
    res.threshold = t;
    res.count = count;
    return;
  }
  out.resize(base + v + 16);
  const int64_t n = compress_at_least_avx512(x, v, t, out.data() + base);
  TORCH_INTERNAL_ASSERT(n == count, "capture: support count ", n, " != ", count);
  out.resize(base + n);
}

// kDivide false at T == 1: z / 1 == z exactly, and a division per entry would cost more than the
// rest of this pass.
template <bool kDivide, typename T>
MR_AVX512 void deferred_row_avx512(const T* z, int64_t v, float temp, float threshold, int64_t count, int32_t* dst) {
  const __m512 t16 = _mm512_set1_ps(temp), tau16 = _mm512_set1_ps(threshold);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) int32_t last[16];
  int64_t i = 0, n = 0;
  for (; i + 16 <= v; i += 16) {
    const __m512 x16 = kDivide ? _mm512_div_ps(load16(z + i), t16) : load16(z + i);
    const __mmask16 k = _mm512_cmp_ps_mask(x16, tau16, _CMP_GE_OQ);
    const __m512i idx = _mm512_maskz_compress_epi32(k, _mm512_add_epi32(lane, _mm512_set1_epi32(int32_t(i))));
    const int c = __builtin_popcount(k);
    if (count - n >= 16) {
      _mm512_storeu_si512(dst + n, idx);  // whole lanes, all inside this row's part of the output
    } else {
      _mm512_store_si512(last, idx);
      TORCH_INTERNAL_ASSERT(n + c <= count, "capture: deferred row overflows its count");
      std::copy(last, last + c, dst + n);
    }
    n += c;
  }
  for (; i < v; ++i) {
    if (mr_div(load_one(z, i), temp) >= threshold) {
      TORCH_INTERNAL_ASSERT(n < count, "capture: deferred row overflows its count");
      dst[n++] = static_cast<int32_t>(i);
    }
  }
  TORCH_INTERNAL_ASSERT(n == count, "capture: deferred row wrote ", n, " ids, counted ", count);
}

}  // namespace

// The entry points carry no target attribute (a differently targeted redeclaration would make GCC
// treat them as function versions); they call the AVX-512 bodies above.
void select_top_p_levels(const float* x, int64_t v, float m, float floor, double p, bool with_min_p, bool want_logz,
                         bool may_defer, Scratch& s, IdList& out, RowOutcome& res) {
  top_p_levels_avx512(x, v, m, floor, p, with_min_p, want_logz, may_defer, s, out, res);
}

template <typename T>
void write_deferred_row(const T* z, int64_t v, float temp, float threshold, int64_t count, int32_t* dst) {
  if (temp == 1.0f)
    deferred_row_avx512<false>(z, v, temp, threshold, count, dst);
  else
    deferred_row_avx512<true>(z, v, temp, threshold, count, dst);
}

#else  // no x86 vector path: capture_cpu.cpp never calls these

void select_top_p_levels(const float*, int64_t, float, float, double, bool, bool, bool, Scratch&, IdList&,
                         RowOutcome&) {
  TORCH_INTERNAL_ASSERT(false, "capture: the AVX-512 top-p path is not built here");
}

template <typename T>
void write_deferred_row(const T*, int64_t, float, float, int64_t, int32_t*) {
  TORCH_INTERNAL_ASSERT(false, "capture: the AVX-512 top-p path is not built here");
}

#endif

template void write_deferred_row<float>(const float*, int64_t, float, float, int64_t, int32_t*);
template void write_deferred_row<c10::BFloat16>(const c10::BFloat16*, int64_t, float, float, int64_t, int32_t*);
template void write_deferred_row<c10::Half>(const c10::Half*, int64_t, float, float, int64_t, int32_t*);

}  // namespace cpu
}  // namespace mask_replay
