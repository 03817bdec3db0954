// Checks det_exp16 (csrc/cpu/det_exp_avx512.h) against det_exp (csrc/kernels/kernel_math.h) on every
// float d in [-88, -0], 16 at a time, plus the edges (+0, -inf, NaN, the -87 cut-off): the capture
// kernel's AVX-512 path decides supports with it, so it must give the scalar function's bits.
// Prints "checked N mismatches M"; prints "skip" where the CPU or the build has no AVX-512.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "cpu/det_exp_avx512.h"

#if MR_CPU_AVX512
namespace {

MR_AVX512 uint64_t check(const float* in, uint64_t n, uint64_t& checked) {
  alignas(64) float out[16];
  uint64_t bad = 0;
  for (uint64_t i = 0; i < n; i += 16) {
    _mm512_store_ps(out, mask_replay::cpu::det_exp16(_mm512_loadu_ps(in + i)));
    for (int j = 0; j < 16; ++j) {
      const float want = mask_replay::det_exp(in[i + j]);
      if (std::memcmp(&want, &out[j], sizeof(float)) != 0) {
        if (bad < 5) std::printf("d %a: det_exp %a, det_exp16 %a\n", in[i + j], want, out[j]);
        ++bad;
      }
    }
    checked += 16;
  }
  return bad;
}

}  // namespace
#endif

int main() {
#if MR_CPU_AVX512
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512dq")) {
    std::printf("skip\n");
    return 0;
  }
  uint64_t bad = 0, checked = 0;
  alignas(64) float block[1 << 16];
  const uint64_t first = 0x80000000u, last = 0xC2B00000u;  // -0 .. -88, every bit pattern between
  for (uint64_t u = first; u <= last; u += 1 << 16) {
    for (uint64_t j = 0; j < (1u << 16); ++j) {
      const uint32_t b = static_cast<uint32_t>(std::min<uint64_t>(u + j, last));
      std::memcpy(&block[j], &b, sizeof(float));
    }
    bad += check(block, 1 << 16, checked);
  }
  const float edges[16] = {
      0.0f,    -0.0f, -__builtin_inff(), __builtin_nanf(""), -87.0f,      -86.99999f, -87.00001f, -1e-45f,
      -1e-38f, -0.5f, -0.34657359f,      -0.3465736f,        -1.0397208f, -700.0f,    -1e30f,     -0.25f};
  bad += check(edges, 16, checked);
  std::printf("checked %llu mismatches %llu\n", static_cast<unsigned long long>(checked),
              static_cast<unsigned long long>(bad));
  return bad != 0;
#else
  std::printf("skip\n");
  return 0;
#endif
}
