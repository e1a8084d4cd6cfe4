// OpenMP loops usable inside the dtype-dispatch macro (a #pragma cannot appear in a macro
// argument). The loop body is a lambda the compiler inlines.
#pragma once
#include <cstdint>

namespace unetcu::kernels::cpu {

// Elementwise loops stay serial below this many iterations: a thread team costs more.
constexpr int64_t kParallelGrain = 32768;

template <class F>
void parallel_for(int64_t n, F&& body, int64_t grain = kParallelGrain) {
#pragma omp parallel for schedule(static) if (n >= grain)
  for (int64_t i = 0; i < n; ++i) body(i);
}

// Sum of body(i) over [0, n) in double.
template <class F>
double parallel_sum(int64_t n, F&& body) {
  double sum = 0;
#pragma omp parallel for schedule(static) reduction(+ : sum) if (n >= kParallelGrain)
  for (int64_t i = 0; i < n; ++i) sum += body(i);
  return sum;
}

}  // namespace unetcu::kernels::cpu
