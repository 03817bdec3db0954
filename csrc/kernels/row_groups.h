// Full-row traversal of the CUDA replay kernels (a block per full-vocabulary row), host-compilable
// so that its index arithmetic is tested without a GPU (tests/cpp/row_groups_emulation.cpp).
//
// The row is cut into groups of 16 bytes' worth of consecutive elements, and thread tid of
// nthreads takes groups tid, tid + nthreads, ... in that order. A contiguous row that starts on a
// 16-byte boundary is read one 16-byte load per group, any other (odd row length, padding, a
// column stride) element by element; both give every thread the same elements in the same order,
// so a sum over the row has the same bits for every layout. Each thread has kUnroll groups' loads
// in flight before it uses the first.
#pragma once
#include <cstdint>

#include "kernels/capture_scan.h"  // Vec16

namespace mask_replay {

// Calls f(j, row[j * s1]) for every j in [0, vocab) this thread owns, in its fixed order.
template <typename T, typename F>
MR_HD void for_each_row_group(const T* row, int64_t s1, int64_t vocab, int64_t tid, int64_t nthreads, F&& f) {
  using V = Vec16<T>;
  constexpr int kVec = V::kSize;
  constexpr int kUnroll = 4;
  const int64_t groups = (vocab + kVec - 1) / kVec;
  const bool vector_loads = s1 == 1 && reinterpret_cast<uintptr_t>(row) % sizeof(V) == 0;
  for (int64_t g0 = tid; g0 < groups; g0 += kUnroll * nthreads) {
    T v[kUnroll][kVec];
    int len[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t g = g0 + u * nthreads;
      const int64_t j0 = g * kVec;
      len[u] = g >= groups ? 0 : (vocab - j0 < kVec ? static_cast<int>(vocab - j0) : kVec);
      if (vector_loads && len[u] == kVec) {
        const V w = reinterpret_cast<const V*>(row)[g];
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[u][e] = w.e[e];
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          if (e < len[u]) v[u][e] = row[(j0 + e) * s1];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j0 = (g0 + u * nthreads) * kVec;
#pragma unroll
      for (int e = 0; e < kVec; ++e)
        if (e < len[u]) f(j0 + e, v[u][e]);
    }
  }
}

}  // namespace mask_replay
