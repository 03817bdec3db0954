// det_log: float32(ln(x)) correctly rounded, the min-p threshold's log on every device.
//
// The support keeps x_i >= m + log(min_p), so one ulp of that log moves a token lying on the
// threshold. Library logs are not correctly rounded and differ between devices (glibc's std::log
// on the host, CUDA's log on the device), and even a correctly rounded double log rounded again to
// float is wrong where the double lands on a float32 rounding boundary. This one evaluates ln(x) in
// double-double arithmetic (about 100 bits, far more than any float32 rounding decision needs in
// practice) from IEEE double adds, multiplies, divisions and fused multiply-adds only, each
// correctly rounded on every device, then rounds once to float32: host and device get the same bits.
#pragma once
#include <cstdint>
#include <cstring>

#include "kernels/kernel_math.h"

namespace mask_replay {

// Correctly rounded double operations, spelled out so no compiler contracts or reorders them (the
// host build also has -ffp-contract=off, the device build --fmad=false).
MR_HD double md_add(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
MR_HD double md_mul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
MR_HD double md_div(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
MR_HD double md_fma(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
MR_HD uint64_t double_bits(double d) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(d));
#else
  uint64_t u;
  std::memcpy(&u, &d, sizeof(u));
  return u;
#endif
}
MR_HD double bits_double(uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(u));
#else
  double d;
  std::memcpy(&d, &u, sizeof(d));
  return d;
#endif
}

// A double-double value hi + lo, normalised: |lo| <= ulp(hi) / 2.
struct DoubleDouble {
  double hi, lo;
};

// a + b exactly, for |a| >= |b| (or a == 0).
MR_HD DoubleDouble dd_quick_two_sum(double a, double b) {
  const double s = md_add(a, b);
  return {s, md_add(b, -md_add(s, -a))};
}
// a + b exactly, any magnitudes.
MR_HD DoubleDouble dd_two_sum(double a, double b) {
  const double s = md_add(a, b);
  const double bb = md_add(s, -a);
  return {s, md_add(md_add(a, -md_add(s, -bb)), md_add(b, -bb))};
}
// a * b exactly: the fused multiply-add returns the product's rounding error.
MR_HD DoubleDouble dd_two_prod(double a, double b) {
  const double p = md_mul(a, b);
  return {p, md_fma(a, b, -p)};
}
MR_HD DoubleDouble dd_add(DoubleDouble a, DoubleDouble b) {
  DoubleDouble s = dd_two_sum(a.hi, b.hi);
  const DoubleDouble t = dd_two_sum(a.lo, b.lo);
  s = dd_quick_two_sum(s.hi, md_add(s.lo, t.hi));
  return dd_quick_two_sum(s.hi, md_add(s.lo, t.lo));
}
MR_HD DoubleDouble dd_mul(DoubleDouble a, DoubleDouble b) {
  const DoubleDouble p = dd_two_prod(a.hi, b.hi);
  return dd_quick_two_sum(p.hi, md_add(p.lo, md_add(md_mul(a.hi, b.lo), md_mul(a.lo, b.hi))));
}
// a / b for a double a: the remainder a - q*b.hi of a correctly rounded quotient q is exact.
MR_HD DoubleDouble dd_div(double a, DoubleDouble b) {
  const double q1 = md_div(a, b.hi);
  const double r = md_add(md_fma(-q1, b.hi, a), -md_mul(q1, b.lo));
  return dd_quick_two_sum(q1, md_div(r, b.hi));
}

// The float32 nearest to hi + lo (ties to even). Rounding hi alone is right unless hi is exactly
// halfway between two floats (float32 midpoints are doubles; hi + lo is within half a double ulp
// of hi, so it cannot cross any other); then lo's sign decides.
MR_HD float dd_to_float(DoubleDouble v) {
  const float r = static_cast<float>(v.hi);  // round to nearest even on every device
  const double rd = static_cast<double>(r);
  if (rd == v.hi || v.lo == 0.0 || !(v.hi == v.hi)) return r;
  // The float on the other side of hi: one step of the bit pattern (sign-magnitude).
  const bool up = v.hi > rd;
  const uint32_t b = float_bits(r);
  const float other =
      r == 0.0f ? bits_float((up ? 0u : 0x80000000u) | 1u) : bits_float((r > 0.0f) == up ? b + 1u : b - 1u);
  const double od = static_cast<double>(other);
  if (md_add(v.hi, -rd) != md_add(od, -v.hi)) return r;  // not a midpoint (both differences exact)
  return (v.lo > 0.0) == (od > v.hi) ? other : r;
}

// float32(ln(x)) correctly rounded, for any double x (0 -> -inf, < 0 or NaN -> NaN, inf -> inf).
// x = 2^e * m with m in [sqrt(1/2), sqrt(2)]; ln(m) = 2 atanh(s) = 2s (1 + s^2/3 + s^4/5 + ...)
// with s = (m - 1) / (m + 1), |s| <= 0.1716; twenty terms leave less than 2^-105 of the sum.
MR_HD float det_log(double x) {
  if (!(x > 0.0)) return x == 0.0 ? kNegInf : bits_float(0x7fc00000u);
  if (x == -static_cast<double>(kNegInf)) return -kNegInf;
  int e = 0;
  if (x < 2.2250738585072014e-308) {     // subnormal: scale into the normal range (exact)
    x = md_mul(x, 18014398509481984.0);  // 2^54
    e = -54;
  }
  const uint64_t bits = double_bits(x);
  e += static_cast<int>((bits >> 52) & 0x7ff) - 1023;
  double m = bits_double((bits & 0x000fffffffffffffull) | (uint64_t{1023} << 52));  // [1, 2)
  if (m > 1.4142135623730951) {
    m = md_mul(m, 0.5);
    e += 1;
  }
  const double f = md_add(m, -1.0);  // exact (Sterbenz: m in [1/2, 2])
  const DoubleDouble s = dd_div(f, dd_two_sum(2.0, f));
  const DoubleDouble t = dd_mul(s, s);
  constexpr int kTerms = 20;
  DoubleDouble series{0.0, 0.0};
  for (int k = kTerms; k >= 0; --k) {  // Horner: series = sum_k t^k / (2k + 1)
    const double odd = static_cast<double>(2 * k + 1);
    const double c_hi = md_div(1.0, odd);
    const DoubleDouble c{c_hi, md_div(md_fma(-c_hi, odd, 1.0), odd)};  // 1/odd in double-double
    series = dd_add(dd_mul(series, t), c);
  }
  DoubleDouble ln = dd_mul(DoubleDouble{md_mul(2.0, s.hi), md_mul(2.0, s.lo)}, series);
  if (e != 0) {
    const DoubleDouble kLn2{0.6931471805599452862, 2.3190468138462995584e-17};
    const double de = static_cast<double>(e);
    const DoubleDouble p = dd_two_prod(de, kLn2.hi);
    ln = dd_add(dd_quick_two_sum(p.hi, md_add(p.lo, md_mul(de, kLn2.lo))), ln);
  }
  return dd_to_float(ln);
}

}  // namespace mask_replay
