// Host emulation of the CUDA replay kernels' parallel entry check (csrc/kernels/replay_math.h:
// lane_entry_errors, min-reduced over the lanes as warp_min does, decoded by entry_error_code)
// against the CPU's sequential check_entries, on random rows with random defects.
// Prints "<mismatches>/<rows checked>"; exit status 0 iff no mismatch.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "kernels/replay_math.h"

using namespace mask_replay;

int8_t parallel_check(const std::vector<int32_t>& ids, int64_t lo, int64_t hi, int64_t vocab, int lanes) {
  int64_t first = kNoEntryError;
  for (int lane = 0; lane < lanes; ++lane)
    first = std::min(first, lane_entry_errors(ids.data(), lo, hi, vocab, lane, lanes));
  return entry_error_code(first);
}

int main() {
  int64_t bad = 0, total = 0;
  auto compare = [&](const std::vector<int32_t>& ids, int64_t lo, int64_t hi, int64_t vocab) {
    const int8_t want = check_entries(ids.data(), lo, hi, vocab);
    for (int lanes : {1, 2, 3, 32}) {
      ++total;
      const int8_t got = parallel_check(ids, lo, hi, vocab, lanes);
      if (got != want) {
        if (++bad <= 10)
          std::printf("row [%lld, %lld) lanes %d: %d, sequential %d\n", static_cast<long long>(lo),
                      static_cast<long long>(hi), lanes, got, want);
      }
    }
  };
  // The review's example: an id outside [0, V) at entry 1 comes before the descent at entry 2.
  compare({3, 200000, 5}, 0, 3, 151936);
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 20000; ++trial) {
    const int64_t vocab = 1 + rng() % 300;
    const int64_t len = rng() % 100;
    std::vector<int32_t> ids(len + 5);
    // An ascending row, then a few defects of each kind at random entries.
    int64_t next = 0;
    for (auto& id : ids) {
      next += 1 + static_cast<int64_t>(rng() % 4);
      id = static_cast<int32_t>(next % (vocab + 2));
    }
    const int defects = static_cast<int>(rng() % 4);
    for (int d = 0; d < defects && len > 0; ++d) {
      const int64_t e = 5 + static_cast<int64_t>(rng() % len);
      switch (rng() % 4) {
        case 0:
          ids[e] = -1 - static_cast<int32_t>(rng() % 5);
          break;
        case 1:
          ids[e] = static_cast<int32_t>(vocab + rng() % 5);
          break;
        case 2:
          ids[e] = ids[e - 1];
          break;
        default:
          ids[e] = ids[e - 1] - 1 - static_cast<int32_t>(rng() % 3);
          break;
      }
    }
    compare(ids, 5, 5 + len, vocab);  // entries before lo belong to another row: never read as prev
  }
  std::printf("%lld/%lld\n", (long long)bad, (long long)total);
  return bad == 0 ? 0 : 1;
}
