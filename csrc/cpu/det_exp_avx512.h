// det_exp (kernels/kernel_math.h) on 16 lanes, for the CPU's AVX-512 loops, and the target attribute
// those loops carry: the extension is built for the build machine's baseline (AVX2 at most) and
// chooses these functions at run time (capture_cpu_avx512.h: cpu_has_avx512). Torch-free, so the
// exhaustive bit check (tests/cpp/det_exp16_check.cpp) compiles it on its own.
#pragma once
#include "kernels/kernel_math.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MR_CPU_AVX512 1
#define MR_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi,bmi2,popcnt")))

#pragma GCC diagnostic push
// The vector types only cross inline functions of the AVX-512 headers: no ABI boundary to warn about.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace mask_replay {
namespace cpu {

// The same bits as det_exp for every d: rounding d * log2(e) to an integer with one roundscale equals
// the add/subtract of 1.5 * 2^23 (up to the sign of a zero n, which changes neither r nor the result),
// and scalef by an integer n is p times the exact power of two, as the bit-built 2^n multiply is; the
// zero-masked scalef is the d <= -87 branch. Five instructions fewer than the literal translation,
// which matters: this exp is most of top-p's cost on flat rows.
MR_AVX512 inline __m512 det_exp16(__m512 d) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(d, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), d));
  __m512 p = _mm512_set1_ps(1.98412698412698413e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.38888888888888889e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.33333333333333333e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.16666666666666667e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.66666666666666667e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-87.0f), _CMP_GT_OQ), p, n);
}

}  // namespace cpu
}  // namespace mask_replay

#pragma GCC diagnostic pop
#endif
