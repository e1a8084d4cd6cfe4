// Reference batch statistics for the batch-norm tests (tests/test_fused.cpp,
// tests/test_bn_layout.cpp): the two-pass statistics in double, and the error of the one-pass
// formula E[x²] - E[x]² that a kernel must not use, so that a test shows its input is hard.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "engine/tensor.h"

namespace unetcu::testing {

// Batch mean and biased variance per channel in double of NCHW values v: the mean corrected by
// a second pass (m += mean(x - m), exact to a few ulps however large the mean), then the
// variance about it.
template <class T>
void two_pass_stats_of(const T* v, int64_t N, int64_t C, int64_t HW, std::vector<double>* mean,
                       std::vector<double>* var) {
  mean->assign(C, 0.0);
  var->assign(C, 0.0);
  const double M = double(N * HW);
  for (int64_t c = 0; c < C; ++c) {
    auto sum_of = [&](auto f) {
      double s = 0;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t q = 0; q < HW; ++q) s += f(double(v[(n * C + c) * HW + q]));
      return s;
    };
    double m = sum_of([](double a) { return a; }) / M;
    m += sum_of([m](double a) { return a - m; }) / M;
    (*mean)[c] = m;
    (*var)[c] = sum_of([m](double a) { return (a - m) * (a - m); }) / M;
  }
}

// The same of the values of x, any dtype or format (float32 and float64 NCHW read in place:
// a channel of 32 M values needs no copy).
inline void two_pass_stats(const Tensor& x, std::vector<double>* mean, std::vector<double>* var) {
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3);
  if (x.format() == MemoryFormat::NCHW && x.dtype() == DType::F32) {
    two_pass_stats_of(x.data<float>(), N, C, HW, mean, var);
  } else if (x.format() == MemoryFormat::NCHW && x.dtype() == DType::F64) {
    two_pass_stats_of(x.data<double>(), N, C, HW, mean, var);
  } else {
    const std::vector<double> v = x.to_vector();  // logical NCHW order
    two_pass_stats_of(v.data(), N, C, HW, mean, var);
  }
}

// The largest relative error over x's channels of the one-pass variance E[x²] - E[x]² with sums
// in T (what a one-pass kernel in T computes) against the reference variances `var`.
template <class T>
double naive_variance_error(const Tensor& x, const std::vector<double>& var) {
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3);
  const std::vector<double> xv = x.to_vector();
  double err = 0;
  for (int64_t c = 0; c < C; ++c) {
    T sum = 0, sumsq = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t q = 0; q < HW; ++q) {
        const T xi = T(xv[(n * C + c) * HW + q]);
        sum += xi;
        sumsq += xi * xi;
      }
    const T mu = sum / T(N * HW), naive_var = sumsq / T(N * HW) - mu * mu;
    err = std::max(err, std::fabs(naive_var - var[c]) / var[c]);
  }
  return err;
}

}  // namespace unetcu::testing
