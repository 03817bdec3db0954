// Host emulation of the CUDA replay kernels' full-row traversal (csrc/kernels/row_groups.h): for
// several element sizes, row lengths, thread counts and layouts (aligned, misaligned, strided),
// every element is visited exactly once with its value, and each thread visits the same elements
// in the same order whatever the layout (so a row's sum has the same bits for every layout).
// Prints "<failures>/<cases>"; exit status 0 iff no failure.
#include <cstdint>
#include <cstdio>
#include <utility>
#include <vector>

#include "kernels/row_groups.h"

using namespace mask_replay;

// Visits of all threads: visits[tid] = the (j, value) pairs thread tid saw, in order.
template <typename T>
std::vector<std::vector<std::pair<int64_t, T>>> traverse(const T* row, int64_t s1, int64_t vocab, int nthreads) {
  std::vector<std::vector<std::pair<int64_t, T>>> visits(nthreads);
  for (int tid = 0; tid < nthreads; ++tid)
    for_each_row_group(row, s1, vocab, tid, nthreads, [&](int64_t j, T v) { visits[tid].emplace_back(j, v); });
  return visits;
}

template <typename T>
int64_t check(int64_t vocab, int nthreads, int64_t& cases) {
  int64_t failures = 0;
  // One backing store, 16-byte aligned, with room for an offset start and a stride of 3.
  std::vector<Vec16<T>> store((3 * vocab + 64) * sizeof(T) / 16 + 2);
  T* base = reinterpret_cast<T*>(store.data());
  struct Layout {
    int64_t offset, stride;
  };
  std::vector<std::vector<std::pair<int64_t, T>>> reference;
  for (Layout layout : {Layout{0, 1}, Layout{1, 1}, Layout{Vec16<T>::kSize, 1}, Layout{0, 3}, Layout{2, 3}}) {
    ++cases;
    T* row = base + layout.offset;
    for (int64_t j = 0; j < vocab; ++j) row[j * layout.stride] = static_cast<T>(j % 1000 + 1);
    const auto visits = traverse(row, layout.stride, vocab, nthreads);
    std::vector<int> seen(vocab, 0);
    bool ok = true;
    for (const auto& thread : visits)
      for (const auto& [j, v] : thread) {
        ok &= j >= 0 && j < vocab && v == static_cast<T>(j % 1000 + 1);
        if (j >= 0 && j < vocab) ++seen[j];
      }
    for (int s : seen) ok &= s == 1;
    if (reference.empty()) {
      reference = visits;
    } else {
      for (int tid = 0; tid < nthreads; ++tid) {
        ok &= visits[tid].size() == reference[tid].size();
        for (size_t i = 0; ok && i < visits[tid].size(); ++i) ok &= visits[tid][i].first == reference[tid][i].first;
      }
    }
    if (!ok) {
      ++failures;
      std::printf("element size %zu, vocab %lld, %d threads, offset %lld, stride %lld: wrong traversal\n", sizeof(T),
                  static_cast<long long>(vocab), nthreads, static_cast<long long>(layout.offset),
                  static_cast<long long>(layout.stride));
    }
  }
  return failures;
}

int main() {
  int64_t failures = 0, cases = 0;
  for (int64_t vocab : {0, 1, 2, 7, 8, 9, 31, 100, 1023, 4099, 20011})
    for (int nthreads : {1, 3, 32, 512}) {
      failures += check<float>(vocab, nthreads, cases);
      failures += check<double>(vocab, nthreads, cases);
      failures += check<uint16_t>(vocab, nthreads, cases);  // the size of bfloat16 / float16
    }
  std::printf("%lld/%lld\n", static_cast<long long>(failures), static_cast<long long>(cases));
  return failures == 0 ? 0 : 1;
}
