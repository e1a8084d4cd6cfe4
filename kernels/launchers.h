// The launchers of both backends, declared from the one list in kernels/launcher_list.h so
// their signatures cannot drift apart: kernels::cpu (OpenMP loops and OpenBLAS, kernels/cpu/)
// and kernels::cuda (CUDA kernels over the same bodies, cuDNN, kernels/cuda/). The op layer
// (engine/ops) validates inputs and picks the namespace from the inputs' device (UNETCU_LAUNCH).
#pragma once
#include <cstdint>

#include "runtime/tensor_ref.h"
#include "bodies/conv.h"
#include "bodies/optim.h"
#include "bodies/pool.h"
#include <vector>

namespace unetcu::kernels {
// One parameter of a multi-tensor Adam step (adam_update_many): its tensors and its scalars.
struct AdamTensor {
  TensorRef p, g, m, v;
  AdamStep s;
};
}  // namespace unetcu::kernels

#include "kernels/launcher_list.h"

#define UNETCU_DECLARE_LAUNCHER(name, params) void name params;

namespace unetcu::kernels::cpu {
UNETCU_LAUNCHERS(UNETCU_DECLARE_LAUNCHER)
// True when conv2d on this geometry takes the banded strategy (kernels/cpu/conv.cpp) with the
// calling thread's thread budget; for tests that must cover both strategies.
bool conv2d_uses_bands(const ConvGeometry& g, DType dtype);
}  // namespace unetcu::kernels::cpu

namespace unetcu::kernels::cuda {
UNETCU_LAUNCHERS(UNETCU_DECLARE_LAUNCHER)
}  // namespace unetcu::kernels::cuda

#undef UNETCU_DECLARE_LAUNCHER

// Calls kernels::cuda::fn or kernels::cpu::fn by the device: the one place ops branch on it.
#define UNETCU_LAUNCH(device, fn, ...)                                         \
  ((device).is_cuda() ? ::unetcu::kernels::cuda::fn(__VA_ARGS__)               \
                      : ::unetcu::kernels::cpu::fn(__VA_ARGS__))
