// kernels::cuda for builds without the CUDA backend, generated from kernels/launcher_list.h.
// No CUDA tensor can be made in such a build (its allocation throws first), so these are never
// reached; they keep the op layer's single dispatch point (UNETCU_LAUNCH) linkable.
#include "kernels/launchers.h"

namespace unetcu::kernels::cuda {

[[noreturn]] static void no_cuda() { throw Error("this build has no CUDA backend"); }

#define UNETCU_DEFINE_STUB(name, params) \
  void name params { no_cuda(); }
UNETCU_LAUNCHERS(UNETCU_DEFINE_STUB)
#undef UNETCU_DEFINE_STUB

}  // namespace unetcu::kernels::cuda
