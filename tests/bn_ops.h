// The batch-norm ops as the CPU layout tests (tests/test_bn_layout.cpp) and the CUDA suite
// (tests/cuda/test_cuda_bn_layout.cpp) both run them: batch_norm2d, batch_norm_relu,
// batch_norm_add_relu and the synchronized batch_norm2d (one replica), which between them run
// every batch-norm launcher; each forward, then backward of sum(y * R), twice on clones of the
// inputs (the second pass accumulates into the leaves' gradients, beta = 1; a training
// forward moves the running statistics twice).
#pragma once
#include "engine/ops.h"
#include "engine/tape.h"
#include "parallel/communicator.h"

namespace unetcu::testing_bn {

enum class Op { BatchNorm, BatchNormRelu, BatchNormAddRelu, BatchNormSync };
inline const char* op_name(Op op) {
  switch (op) {
    case Op::BatchNorm: return "batch_norm2d";
    case Op::BatchNormRelu: return "batch_norm_relu";
    case Op::BatchNormAddRelu: return "batch_norm_add_relu";
    case Op::BatchNormSync: return "batch_norm2d synced";
  }
  return "";
}

// One replica: the all-reduce is the identity, so the synchronized path computes the local
// batch's statistics through its own launchers.
struct OneReplica : BatchNormSync {
  void all_reduce_sum(Tensor&) override {}
  int world_size() const override { return 1; }
};

struct Inputs {
  Tensor x, gamma, beta, residual, rm, rv, R;
};

struct Result {
  Tensor y, rm, rv, gx, ggamma, gbeta, gres;
  Tensor gx1, ggamma1, gbeta1, gres1;  // the gradients after the first pass
};

inline Result run(Op op, const Inputs& in, bool training, bool with_residual) {
  Tensor x = in.x.clone().set_requires_grad(true);
  Tensor gamma = in.gamma.clone().set_requires_grad(true);
  Tensor beta = in.beta.clone().set_requires_grad(true);
  Tensor res = in.residual.clone().set_requires_grad(true);
  Result r;
  r.rm = in.rm.clone();
  r.rv = in.rv.clone();
  OneReplica one;
  for (int pass = 0; pass < 2; ++pass) {
    Tape tape;
    {
      TapeScope scope(tape);
      switch (op) {
        case Op::BatchNorm:
          r.y = batch_norm2d(x, gamma, beta, r.rm, r.rv, training, 0.1, 1e-5);
          break;
        case Op::BatchNormSync: {
          BatchNormSyncScope sync(&one);
          r.y = batch_norm2d(x, gamma, beta, r.rm, r.rv, training, 0.1, 1e-5);
          break;
        }
        case Op::BatchNormRelu:
          r.y = batch_norm_relu(x, gamma, beta, r.rm, r.rv, training, 0.1, 1e-5);
          break;
        case Op::BatchNormAddRelu:
          r.y = with_residual ? batch_norm_add_relu(x, gamma, beta, res, r.rm, r.rv, training, 0.1, 1e-5)
                              : batch_norm_relu(x, gamma, beta, r.rm, r.rv, training, 0.1, 1e-5);
          break;
      }
    }
    tape.backward({r.y}, {in.R});
    if (pass == 0) {
      r.gx1 = x.grad().clone();
      r.ggamma1 = gamma.grad().clone();
      r.gbeta1 = beta.grad().clone();
      if (with_residual) r.gres1 = res.grad().clone();
    }
  }
  r.gx = x.grad();
  r.ggamma = gamma.grad();
  r.gbeta = beta.grad();
  if (with_residual) r.gres = res.grad();
  return r;
}

}  // namespace unetcu::testing_bn
