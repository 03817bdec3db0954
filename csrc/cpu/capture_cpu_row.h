// What the CPU capture kernel's row selections share: per-thread scratch buffers, the id lists rows
// append to, and a row's outcome. capture_cpu.cpp runs the rows; capture_cpu_top_p.cpp holds the
// AVX-512 top-p selection.
#pragma once
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace mask_replay {
namespace cpu {

// A vector that grows without zero-filling: rows compress their ids straight into the chunk's
// list after growing it by V, and zeroing V entries first would cost as much as the compress.
template <typename T>
struct UninitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = UninitAllocator<U>;
  };
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
using IdList = std::vector<int32_t, UninitAllocator<int32_t>>;

struct Scratch {
  std::vector<float> x;                                // z / T of one row (bf16/fp16 logits or T != 1)
  std::vector<float, UninitAllocator<float>> bracket;  // values of the top-p bracket (AVX-512 path)
  std::vector<float> block_max;                        // per kBlock entries, from the AVX-512 load
  std::vector<int32_t> block_order;
  std::vector<int32_t> cand, bin_idx;
  std::vector<uint32_t> keys, ka, kb, bin_keys;
  std::vector<int64_t> mass, ma, mb, hist_count, hist_mass;
  std::vector<int32_t> ids;  // compressed output of one row; sized v + 8, never shrunk
};

struct RowOutcome {
  int error = 0;  // 1 NaN, 2 +inf, 3 overflow after temperature, 4 no finite entry
  int64_t col = -1;
  float logz = 0.0f;
  // A wide support left for the output pass (write_deferred_row): its ids are x >= threshold, `count`
  // of them. Written straight into the output, they skip the chunk list and its copy.
  bool deferred = false;
  float threshold = 0.0f;
  int64_t count = 0;
};

// Top-p alone (min-p allowed) over x = z / T with max m, on the AVX-512 path (cpu_has_avx512):
// appends the support's ids to `out`, or defers them (may_defer, wide supports) through `res`.
// `floor` is min-p's threshold (the lowest finite float without min-p).
void select_top_p_levels(const float* x, int64_t v, float m, float floor, double p, bool with_min_p, bool want_logz,
                         bool may_defer, Scratch& s, IdList& out, RowOutcome& res);

// The ids of a deferred row (z / T >= threshold) written to dst, which holds exactly `count`.
template <typename T>
void write_deferred_row(const T* z, int64_t v, float temp, float threshold, int64_t count, int32_t* dst);

}  // namespace cpu
}  // namespace mask_replay
