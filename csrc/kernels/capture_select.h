// Radix-selection decisions of the capture kernels, as pure host/device functions over one
// 256-bin digit histogram. They only choose a bucket; every value they compare comes from
// kernel_math.h, so the threshold they converge to is the one the semantics define.
#pragma once
#include "kernels/kernel_math.h"

namespace mask_replay {

// Top-k: the bucket holding the `need`-th largest key (1-based) of the histogrammed set.
// `need` becomes the rank inside that bucket. Returns -1 when the set holds fewer than `need`.
MR_HD int select_topk_digit(const unsigned int* count, int64_t& need) {
  int64_t above = 0;
  for (int d = kRadixBins - 1; d >= 0; --d) {
    const int64_t c = count[d];
    if (above + c >= need) {
      need -= above;
      return d;
    }
    above += c;
  }
  return -1;
}

// Top-p: kept keys form an upper set, so the smallest kept key lies in the lowest non-empty
// bucket whose largest key is kept, and that key has exactly the mass of the higher buckets above
// it. `mass_above` enters as the mass above the whole histogrammed bucket and leaves as the mass
// above the chosen one. Returns -1 if no bucket qualifies (impossible while total > 0).
MR_HD int select_topp_digit(const unsigned int* count, const unsigned long long* mass, int64_t& mass_above, double p,
                            int64_t total) {
  int chosen = -1;
  int64_t above = mass_above, chosen_above = 0;
  for (int d = kRadixBins - 1; d >= 0; --d) {
    if (count[d] == 0) continue;
    if (!below_top_p(above, p, total)) break;  // masses above only grow further down
    chosen = d;
    chosen_above = above;
    above += static_cast<int64_t>(mass[d]);
  }
  if (chosen >= 0) mass_above = chosen_above;
  return chosen;
}

// Greedy rows keep the first index of the largest value: pack so that an unsigned max picks it.
MR_HD unsigned long long pack_argmax(uint32_t key, int64_t index) {
  return (static_cast<unsigned long long>(key) << 32) |
         static_cast<unsigned long long>(0xffffffffu - static_cast<uint32_t>(index));
}
MR_HD int64_t unpack_argmax(unsigned long long packed) {
  return static_cast<int64_t>(0xffffffffu - static_cast<uint32_t>(packed & 0xffffffffull));
}

}  // namespace mask_replay
