// Shared by the CUDA suite's graph cases (test_cuda_graphs.cpp, test_cuda_dp.cpp): two runs
// hold the same bits.
#pragma once
#include <doctest/doctest.h>

#include <cstring>

#include "engine/module.h"
#include "engine/tensor.h"

namespace unetcu::testing {

// Same shape, dtype and bytes (read back to the host).
inline bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(Device::cpu()), y = b.to(Device::cpu());
  return x.shape() == y.shape() && x.dtype() == y.dtype() && std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
}

// Parameters, batch-norm running statistics and their batch counts: the same bits.
inline void check_same_state(Module& eager, Module& graph) {
  const auto se = eager.state(), sg = graph.state();
  REQUIRE(se.size() == sg.size());
  for (size_t i = 0; i < se.size(); ++i) {
    CAPTURE(se[i].name);
    if (se[i].counter) CHECK(*se[i].counter == *sg[i].counter);
    if (se[i].tensor.defined()) CHECK(same_bits(se[i].tensor, sg[i].tensor));
  }
}

}  // namespace unetcu::testing
