// Math shared by the CPU and CUDA kernels. Everything that decides which tokens enter a support
// lives here (and the min-p log in det_log.h), written with explicitly rounded operations, so both
// devices take the same decision bit for bit (the host build uses -ffp-contract=off, the device
// build --fmad=false).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MR_HD __host__ __device__ __forceinline__
#else
#define MR_HD inline
#endif

namespace mask_replay {

// Masses are fixed point: q = floor(p * 2^40) with p = exp(x - max) in (0, 1]. Integer sums are
// exact, so the top-p decision depends neither on summation order nor on thread count.
constexpr float kMassScale = 1099511627776.0f;  // 2^40
constexpr double kMassScaleD = 1099511627776.0;
constexpr float kNegInf = -__builtin_huge_valf();
constexpr float kLowestFinite = -3.402823466e+38f;

MR_HD float mr_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MR_HD float mr_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
MR_HD float mr_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// Fused multiply-add is correctly rounded by IEEE 754 on every device (one rounding), so it
// keeps host and device bit-identical while shortening the dependency chains.
MR_HD float mr_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

MR_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}
MR_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// Monotone map float -> uint32 (larger value, larger key). -0.0 is folded onto +0.0 first so
// that equal values are equal keys (ties are decided on values, not on bit patterns).
MR_HD uint32_t order_key(float f) {
  uint32_t u = float_bits(mr_add(f, 0.0f));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
MR_HD float key_value(uint32_t k) { return bits_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }

// exp(d) for d <= 0 with Cody-Waite reduction and a degree-7 polynomial, built only from
// correctly rounded adds, multiplies and fused multiply-adds so host and device agree exactly.
// About 1 ulp.
MR_HD float det_exp(float d) {
  if (!(d > -87.0f)) return 0.0f;  // also -inf; results below 2^-125 do not matter to any mass
  const float kLog2e = 1.44269504088896341f;
  const float kLn2Hi = 0.693145751953125f;  // 12 significant bits: n * kLn2Hi is exact
  const float kLn2Lo = 1.42860682030941723212e-6f;
  const float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = mr_add(mr_add(mr_mul(d, kLog2e), kRound), -kRound);
  const float r = mr_fma(-n, kLn2Lo, mr_fma(-n, kLn2Hi, d));
  float p = 1.98412698412698413e-4f;  // 1/5040
  p = mr_fma(p, r, 1.38888888888888889e-3f);
  p = mr_fma(p, r, 8.33333333333333333e-3f);
  p = mr_fma(p, r, 4.16666666666666667e-2f);
  p = mr_fma(p, r, 1.66666666666666667e-1f);
  p = mr_fma(p, r, 0.5f);
  p = mr_fma(p, r, 1.0f);
  p = mr_fma(p, r, 1.0f);
  const int ni = static_cast<int>(n);  // in [-126, 0]
  return mr_mul(p, bits_float(static_cast<uint32_t>(ni + 127) << 23));
}

// Fixed-point mass of a probability relative to the row max (truncation = floor for p >= 0).
MR_HD int64_t mass_q(float p) { return static_cast<int64_t>(mr_mul(p, kMassScale)); }

// Top-p keeps token i iff the mass strictly above it is < p * Z. Both sides in double; the
// integers are < 2^58 and the rounding is the same on every device.
MR_HD bool below_top_p(int64_t mass_above, double p, int64_t total) {
  return static_cast<double>(mass_above) < p * static_cast<double>(total);
}

// Per-row parameters after the Python layer expanded scalars. "off" values: top_k <= 0,
// top_p == 1, min_p == 0.
struct RowParams {
  float temperature;
  int64_t top_k;
  double top_p;
  double min_p;
};

MR_HD bool top_p_active(double p) { return p < 1.0; }
MR_HD bool min_p_active(double m) { return m > 0.0; }

// Radix selection over 32-bit keys, 8 bits a pass, most significant first.
constexpr int kRadixBits = 8;
constexpr int kRadixBins = 1 << kRadixBits;
MR_HD int radix_digit(uint32_t key, int pass) { return (key >> (24 - 8 * pass)) & 0xff; }
MR_HD uint32_t radix_prefix_mask(int pass) {  // bits fixed after `pass` passes
  return pass <= 0 ? 0u : (pass >= 4 ? 0xffffffffu : ~(0xffffffffu >> (8 * pass)));
}

}  // namespace mask_replay
