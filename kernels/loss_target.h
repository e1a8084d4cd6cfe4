// Host-side set-up both backends' loss launchers share: where a target element lies for a
// logits element (LossTargetIndex, bodies/loss.h) and the dispatch over the logits'
// and the target's storage types.
#pragma once
#include "bodies/loss.h"
#include "runtime/tensor_ref.h"

namespace unetcu::kernels {

// Indices are remapped only when the formats differ and the two orders really differ
// (C > 1 and more than one pixel): for one channel NCHW and NHWC are the same bytes.
inline LossTargetIndex target_index(const TensorRef& logits, const TensorRef& target) {
  LossTargetIndex ti{false, {}, {}};
  if (logits.format() != target.format()) {
    ti.logits = logits.dims4(), ti.target = target.dims4();
    ti.remap = ti.logits.C > 1 && ti.logits.H * ti.logits.W > 1;
  }
  return ti;
}

}  // namespace unetcu::kernels

// Runs the statement with X bound to the logits' storage type and Tt to the target's.
#define UNETCU_DISPATCH_LOSS(logits, target, ...)   \
  UNETCU_DISPATCH_STORAGE((logits).dtype(), X, {    \
    UNETCU_DISPATCH_STORAGE((target).dtype(), Tt, { \
      __VA_ARGS__;                                  \
    });                                             \
  })
