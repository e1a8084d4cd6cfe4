// Division by a divisor fixed before a loop, without a divide instruction. A GPU has no integer
// divider: a 64-bit `/` or `%` is a software routine of dozens of instructions, and an
// elementwise kernel that walks a tensor in memory order (channels-last above all: c = i % C,
// pixel = i / C, ...) spends more on its index math than on moving its bytes. Div32 divides an
// unsigned 32-bit numerator by a divisor chosen on the host with one multiply-high, an add and
// a shift (Granlund and Montgomery 1994, "Division by invariant integers using
// multiplication", figure 4.1): with s = ceil(log2 d) and m = floor(2^32 (2^s - d) / d) + 1,
// n / d = (mulhi(n, m) + n) >> s for every n < 2^32, the sum taken in 33 bits.
//
// Divider<I> is the divider of index type I: Div32 for uint32_t, plain division for int64_t.
// A launcher picks I = uint32_t when every index of the launch is below 2^31 (so a grid-stride
// step cannot wrap either; index_fits_32) and int64_t otherwise, one kernel body for both.
#pragma once
#include <cstdint>

#include "bodies/common.h"

namespace unetcu::kernels {

HD uint32_t mulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return uint32_t((uint64_t(a) * b) >> 32);
#endif
}

struct Div32 {
  uint32_t d = 1, m = 1, s = 0;
  Div32() = default;
  // 1 <= divisor <= 2^31 (a divisor of 0 stands for 1: a launch over no elements divides nothing).
  HD explicit Div32(uint32_t divisor) : d(divisor < 1 ? 1 : divisor) {
    while ((uint64_t(1) << s) < d) ++s;
    m = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << s) - d)) / d + 1);
  }
  HD uint32_t div(uint32_t n) const { return uint32_t((uint64_t(mulhi32(n, m)) + n) >> s); }
  HD uint32_t mod(uint32_t n) const { return n - div(n) * d; }
};

template <class I> struct Divider;
template <> struct Divider<uint32_t> : Div32 {
  Divider() = default;
  HD explicit Divider(int64_t divisor) : Div32(uint32_t(divisor)) {}
};
template <> struct Divider<int64_t> {
  int64_t d = 1;
  Divider() = default;
  HD explicit Divider(int64_t divisor) : d(divisor < 1 ? 1 : divisor) {}
  HD int64_t div(int64_t n) const { return n / d; }
  HD int64_t mod(int64_t n) const { return n % d; }
};

// Whether a launch whose indices (and index products) stay below `largest` elements may use
// 32-bit indices: below 2^31, so a grid-stride step (at most 2^31 more) never wraps 2^32.
inline bool index_fits_32(int64_t largest) { return largest <= int64_t(0x7fffffff); }

}  // namespace unetcu::kernels
