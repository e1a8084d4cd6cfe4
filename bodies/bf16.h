// bfloat16: the upper 16 bits of an IEEE float32 (8-bit exponent, 8-bit mantissa with the
// implicit bit). Storage only: every body computes in float32 and rounds once when it stores
// (acc_t<bf16> is float). Layout-compatible with CUDA's __nv_bfloat16 and oneDNN's bf16, so
// device pointers and library buffers are passed as they are.
#pragma once
#include <cstdint>
#include <cstring>

#include "bodies/common.h"

namespace unetcu::kernels {

HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// Round to nearest, ties to even (as PyTorch, CUDA's __float2bfloat16_rn and oneDNN). A NaN
// stays a (quiet) NaN; a finite value past the largest bf16 becomes infinity.
HD uint16_t bf16_bits_rne(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// A double rounded once to bfloat16: first to float rounding to odd (toward zero, then the
// last bit set when inexact), which keeps the information a second rounding needs, then to
// nearest even. Rounding double -> float -> bf16 to nearest twice would be off by one unit at
// values just past a bf16 tie.
HD float float_round_to_odd(double d) {
  float f = float(d);
  if (double(f) == d || d != d) return f;
  uint32_t u = float_bits(f);
  if ((f < 0 ? -double(f) : double(f)) > (d < 0 ? -d : d)) u -= 1;  // one step toward zero
  return bits_float(u | 1u);
}

struct bf16 {
  uint16_t bits;
  bf16() = default;
  HD explicit bf16(float f) : bits(bf16_bits_rne(f)) {}
  HD explicit bf16(double d) : bits(bf16_bits_rne(float_round_to_odd(d))) {}
  HD operator float() const { return bits_float(uint32_t(bits) << 16); }
};
static_assert(sizeof(bf16) == 2, "bf16 is two bytes");

// The type a body computes in for a storage type: float for bf16, the type itself otherwise.
template <class S> struct AccOf { using type = S; };
template <> struct AccOf<bf16> { using type = float; };
template <class S> using acc_t = typename AccOf<S>::type;

// Rounds a computed value to storage type S.
template <class S, class A> HD S to_storage(A v) { return S(v); }
template <> HD bf16 to_storage<bf16, float>(float v) { return bf16(v); }
template <> HD bf16 to_storage<bf16, double>(double v) { return bf16(v); }

// The largest value of A that to_storage<S> rounds to zero: a value v of A is stored as a
// positive S exactly when v > stored_zero_bound<S, A>() (NaN: never). Zero for float and
// double; for bfloat16 the float of bits 0x8000 (2^-134, half the smallest bf16 subnormal, a
// tie that rounds to the even zero): a positive float of bits u rounds to bits
// (u + 0x7fff + lsb) >> 16, which is 0 exactly when u <= 0x8000.
template <class S, class A> HD A stored_zero_bound() { return A(0); }
template <> HD float stored_zero_bound<bf16, float>() { return bits_float(0x8000u); }

}  // namespace unetcu::kernels
