// The element step of convert (dtype and memory-format changes): the value is read in its
// compute type, summed there with the destination when accumulating, and rounded once.
#pragma once
#include "bodies/bf16.h"

namespace unetcu::kernels {

// float64 when either side is float64, float32 otherwise (bfloat16 computes in float32).
template <class S, class D> struct ConvertAcc { using type = float; };
template <class S> struct ConvertAcc<S, double> { using type = double; };
template <class D> struct ConvertAcc<double, D> { using type = double; };
template <> struct ConvertAcc<double, double> { using type = double; };

template <class S, class D> HD void convert_one(const S* src, D* dst, bool accumulate) {
  using A = typename ConvertAcc<S, D>::type;
  const A v = A(acc_t<S>(*src));
  *dst = to_storage<D>(accumulate ? A(acc_t<D>(*dst)) + v : v);
}

}  // namespace unetcu::kernels
