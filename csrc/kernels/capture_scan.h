// Slice traversal of the CUDA capture kernels, host-compilable so its index arithmetic is tested
// without a GPU (tests/cpp/cuda_select_emulation.cpp). Order-insensitive passes use it: the
// aligned middle of a slice is read 16 bytes per load, which a scalar loop with atomics in its
// body does not achieve on its own.
#pragma once
#include <cstdint>

#include "kernels/kernel_math.h"

namespace mask_replay {

template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kSize = 16 / static_cast<int>(sizeof(T));
  T e[kSize];
};

// Calls f(i, float(row[i])) exactly once for every i in [begin, end), split over `nthreads`
// threads (this one is `tid`), in no particular order. `row` must be aligned to sizeof(T).
template <typename T, typename F>
MR_HD void for_each_in_slice(const T* row, int64_t begin, int64_t end, int64_t tid, int64_t nthreads, F&& f) {
  using V = Vec16<T>;
  constexpr int64_t kVec = V::kSize;
  const int64_t misalign = static_cast<int64_t>((reinterpret_cast<uintptr_t>(row + begin) / sizeof(T)) % kVec);
  int64_t head_end = misalign ? begin + (kVec - misalign) : begin;
  head_end = head_end < end ? head_end : end;
  for (int64_t i = begin + tid; i < head_end; i += nthreads) f(i, static_cast<float>(row[i]));
  const int64_t nvec = (end - head_end) / kVec;
  const V* vp = reinterpret_cast<const V*>(row + head_end);
  for (int64_t j = tid; j < nvec; j += nthreads) {
    const V v = vp[j];
#pragma unroll
    for (int e = 0; e < kVec; ++e) f(head_end + j * kVec + e, static_cast<float>(v.e[e]));
  }
  for (int64_t i = head_end + nvec * kVec + tid; i < end; i += nthreads) f(i, static_cast<float>(row[i]));
}

}  // namespace mask_replay
