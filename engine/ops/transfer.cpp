// to_device: the explicit move between devices; the gradient travels back the same way.
#include "engine/ops.h"
#include "engine/ops/op_util.h"
#include "kernels/launchers.h"

namespace unetcu {

Tensor to_device(const Tensor& x, Device device) {
  UNETCU_CHECK(x.defined(), "to_device: undefined tensor");
  Tensor y;
  {
    ProfileRange range("to_device", "op", 0, double(x.nbytes()));
    y = x.to(device);
  }
  if (Tape::should_record({&x})) {
    const Device from = x.device();
    Tape::record("to_device", {x}, {y}, [from](BackwardContext& ctx) {
      double beta;
      Tensor gx = ctx.grad_input(0, &beta);
      if (beta == 0) {
        gx.copy_(ctx.grad_output(0));
      } else {
        Tensor moved = ctx.grad_output(0).to(from);
        UNETCU_LAUNCH(from, axpby, gx, 1.0, moved, 1.0);
      }
    }, OpCost{0, double(x.nbytes())});
  }
  return y;
}

}  // namespace unetcu
