// Radix selection over small candidate sets (CPU). The candidates come from a filtering scan,
// so these loops run over at most a few thousand entries in the common case.
#pragma once
#include <cstdint>
#include <vector>

#include "kernels/kernel_math.h"

namespace mask_replay {
namespace cpu {

// Key of the k-th largest entry (1 <= k <= n) of keys[0, n). Narrows the candidates each pass.
inline uint32_t kth_largest_key(const uint32_t* keys, int64_t n, int64_t k, std::vector<uint32_t>& a,
                                std::vector<uint32_t>& b) {
  a.assign(keys, keys + n);
  int64_t count[kRadixBins];
  uint32_t prefix = 0;
  for (int pass = 0; pass < 4; ++pass) {
    for (int d = 0; d < kRadixBins; ++d) count[d] = 0;
    for (uint32_t key : a) ++count[radix_digit(key, pass)];
    int chosen = 0;
    for (int d = kRadixBins - 1; d >= 0; --d) {
      if (count[d] >= k) {
        chosen = d;
        break;
      }
      k -= count[d];
    }
    prefix |= static_cast<uint32_t>(chosen) << (24 - 8 * pass);
    if (count[chosen] == static_cast<int64_t>(a.size())) continue;  // nothing to narrow
    b.clear();
    for (uint32_t key : a)
      if (radix_digit(key, pass) == chosen) b.push_back(key);
    a.swap(b);
  }
  return prefix;
}

// Top-p threshold: the smallest key whose strictly-greater mass A satisfies below_top_p(A, p, Z).
// `above` is the mass of elements greater than every key given (when the keys are one bucket).
// Every pass picks the lowest non-empty bin whose top element still qualifies (the mass above
// a bin's top element is the mass of the bins above it); the threshold lies in that bin.
inline uint32_t top_p_threshold_key(const uint32_t* keys, const int64_t* mass, int64_t n, double p, int64_t total,
                                    std::vector<uint32_t>& ka, std::vector<int64_t>& ma, std::vector<uint32_t>& kb,
                                    std::vector<int64_t>& mb, int64_t above = 0) {
  // Leading digits that every key shares decide nothing (a bracket of nearby values shares its
  // sign and exponent): they go straight into the prefix and the passes start below them.
  uint32_t differ = 0;
  for (int64_t i = 1; i < n; ++i) differ |= keys[i] ^ keys[0];
  const int first_pass = differ == 0 ? 4 : __builtin_clz(differ) / kRadixBits;
  uint32_t prefix = n > 0 ? keys[0] & radix_prefix_mask(first_pass) : 0;
  if (first_pass == 4) return prefix;
  ka.assign(keys, keys + n);
  ma.assign(mass, mass + n);
  int64_t bin_mass[kRadixBins];
  int64_t bin_count[kRadixBins];
  for (int pass = first_pass; pass < 4; ++pass) {
    for (int d = 0; d < kRadixBins; ++d) bin_mass[d] = bin_count[d] = 0;
    for (size_t i = 0; i < ka.size(); ++i) {
      const int d = radix_digit(ka[i], pass);
      bin_mass[d] += ma[i];
      ++bin_count[d];
    }
    int chosen = -1;
    int64_t cum = above, chosen_above = above;
    for (int d = kRadixBins - 1; d >= 0; --d) {
      if (bin_count[d] == 0) continue;
      if (!below_top_p(cum, p, total)) break;
      chosen = d;
      chosen_above = cum;
      cum += bin_mass[d];
    }
    // The bucket's top element always qualifies (invariant), so a bin was chosen.
    above = chosen_above;
    prefix |= static_cast<uint32_t>(chosen) << (24 - 8 * pass);
    if (bin_count[chosen] == static_cast<int64_t>(ka.size())) continue;
    kb.clear();
    mb.clear();
    for (size_t i = 0; i < ka.size(); ++i) {
      if (radix_digit(ka[i], pass) == chosen) {
        kb.push_back(ka[i]);
        mb.push_back(ma[i]);
      }
    }
    ka.swap(kb);
    ma.swap(mb);
  }
  return prefix;
}

}  // namespace cpu
}  // namespace mask_replay
