// How the CPU kernels split work over ATen's thread pool: a task gets at least kMinTaskWork element
// operations, so an input smaller than that runs on the calling thread (waking the pool costs far
// more than such an input: 7 ms against 18 us per call on a busy 2-core machine).
#pragma once

#include <algorithm>
#include <cstdint>

namespace mask_replay {

// the least work worth a task of its own: ATen's own at::internal::GRAIN_SIZE
constexpr int64_t kMinTaskWork = 32768;

// at::parallel_for's grain for rows costing `row_work` operations each (a range of rows no longer
// than the grain runs on the calling thread)
inline int64_t rows_per_task(int64_t row_work) {
  return std::max<int64_t>(1, kMinTaskWork / std::max<int64_t>(1, row_work));
}

// the same for CSR rows of `nnz` entries in all, each entry costing `entry_work` operations
inline int64_t rows_per_task(int64_t nnz, int64_t rows, int64_t entry_work) {
  return rows_per_task(std::max<int64_t>(1, nnz / std::max<int64_t>(1, rows)) * entry_work);
}

}  // namespace mask_replay
