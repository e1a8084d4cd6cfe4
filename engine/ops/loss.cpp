// Losses: autograd glue. The loss is a 0-dimensional tensor on the logits' device, of the
// logits' dtype, or float32 for bfloat16 logits (autocast runs these losses in float32); on
// CUDA nothing here waits for the device (sums stay in device memory). Logits may be bfloat16
// and NHWC; the target is float32 or the logits' dtype, in either memory format. The gradient
// of the logits has their dtype and format.
#include "engine/ops.h"
#include "engine/ops/op_util.h"
#include "kernels/launchers.h"

namespace unetcu {

static void check_loss_inputs(const char* op, const Tensor& logits, const Tensor& target) {
  ops_detail::check_backend(op, logits, {true, true});
  UNETCU_CHECK(target.defined(), op, ": undefined target tensor");
  UNETCU_CHECK(target.dtype() == logits.dtype() || target.dtype() == DType::F32, op,
               ": the target must be float32 or the logits' dtype (", dtype_name(logits.dtype()),
               "), got ", dtype_name(target.dtype()));
  UNETCU_CHECK(target.device() == logits.device(), op, ": device mismatch (",
               logits.device().str(), " vs ", target.device().str(), ")");
  if (logits.ndim() == 4 && logits.dim(1) >= 2) {  // class indices, one per pixel
    UNETCU_CHECK(target.ndim() == 4 && target.dim(0) == logits.dim(0) && target.dim(1) == 1 &&
                     target.dim(2) == logits.dim(2) && target.dim(3) == logits.dim(3),
                 op, ": the target of logits ", shape_str(logits.shape()),
                 " must be [N, 1, H, W] class indices, got ", shape_str(target.shape()));
  } else {
    check_same_shape(op, logits, target);
  }
  UNETCU_CHECK(logits.numel() > 0, op, ": empty input");
  UNETCU_CHECK(!target.requires_grad(), op, ": the target must not require a gradient");
}

// float32 for bfloat16 logits, else the logits' dtype.
static DType loss_dtype(const Tensor& logits) {
  return logits.dtype() == DType::BF16 ? DType::F32 : logits.dtype();
}

static void check_binary(const char* op, const Tensor& logits) {
  UNETCU_CHECK(logits.ndim() != 4 || logits.dim(1) == 1, op, ": logits ", shape_str(logits.shape()),
               " have ", logits.dim(1), " channels; this loss is for one (binary)");
}
static void check_classes(const char* op, const Tensor& logits) {
  UNETCU_CHECK(logits.ndim() == 4 && logits.dim(1) >= 2, op, ": logits ", shape_str(logits.shape()),
               " must be [N, C, H, W] with C >= 2 classes");
}

// The glue every loss here shares: `forward(sums, loss)` writes float64 sums of `sums_shape`
// on the logits' device and the 0-dim loss; the tape's backward calls
// `backward(sums, grad_loss, grad_x, beta)`. Costs are per logit element.
template <class Forward, class Backward>
static Tensor loss_from_sums(const char* op, const Tensor& logits, const Tensor& target, const Shape& sums_shape,
                             double forward_flops, double backward_flops, Forward forward, Backward backward) {
  Tensor sums = Tensor::empty(sums_shape, DType::F64, logits.device());
  Tensor loss = Tensor::empty({}, loss_dtype(logits), logits.device());
  const double n = double(logits.numel()), bytes = ops_detail::bytes_of({&logits, &target});
  {
    ProfileRange range(op, "op", forward_flops * n, bytes);
    forward(sums, loss);
  }
  if (Tape::should_record({&logits})) {
    Tape::record(op, {logits}, {loss}, [sums, backward](BackwardContext& ctx) {
      double beta;
      Tensor gx = ctx.grad_input(0, &beta);
      backward(sums, ctx.grad_output(0), gx, beta);
    }, OpCost{backward_flops * n, 1.5 * bytes});
  }
  return loss;
}

Tensor bce_with_logits(const Tensor& logits, const Tensor& target) {
  check_binary("bce_with_logits", logits);
  check_loss_inputs("bce_with_logits", logits, target);
  return loss_from_sums(
      "bce_with_logits", logits, target, {2}, 6, 5,
      [&](const Tensor& sums, const Tensor& loss) {
        UNETCU_LAUNCH(logits.device(), bce_with_logits_forward, logits, target, sums, loss);
      },
      [logits, target](const Tensor& sums, const Tensor& grad_loss, const Tensor& gx, double beta) {
        UNETCU_LAUNCH(logits.device(), bce_with_logits_backward, logits, target, sums, grad_loss, gx, beta);
      });
}

Tensor cross_entropy(const Tensor& logits, const Tensor& target) {
  check_classes("cross_entropy", logits);
  check_loss_inputs("cross_entropy", logits, target);
  return loss_from_sums(
      "cross_entropy", logits, target, {2}, 5, 8,
      [&](const Tensor& sums, const Tensor& loss) {
        UNETCU_LAUNCH(logits.device(), softmax_ce_forward, logits, target, sums, loss);
      },
      [logits, target](const Tensor& sums, const Tensor& grad_loss, const Tensor& gx, double beta) {
        UNETCU_LAUNCH(logits.device(), softmax_ce_backward, logits, target, sums, grad_loss, gx, beta);
      });
}

Tensor multiclass_dice_loss(const Tensor& logits, const Tensor& target, double smooth) {
  check_classes("multiclass_dice_loss", logits);
  check_loss_inputs("multiclass_dice_loss", logits, target);
  UNETCU_CHECK(smooth >= 0, "multiclass_dice_loss: smooth must be >= 0");
  return loss_from_sums(
      "multiclass_dice_loss", logits, target, {3, logits.dim(1)}, 7, 14,
      [&](const Tensor& sums, const Tensor& loss) {
        UNETCU_LAUNCH(logits.device(), multiclass_dice_sums, logits, target, sums);
        UNETCU_LAUNCH(logits.device(), multiclass_dice_loss_from_sums, sums, smooth, loss);
      },
      [logits, target, smooth](const Tensor& sums, const Tensor& grad_loss, const Tensor& gx, double beta) {
        UNETCU_LAUNCH(logits.device(), multiclass_dice_backward, logits, target, sums, smooth, grad_loss, gx, beta);
      });
}

Tensor dice_loss(const Tensor& logits, const Tensor& target, double smooth) {
  check_binary("dice_loss", logits);
  check_loss_inputs("dice_loss", logits, target);
  UNETCU_CHECK(smooth >= 0, "dice_loss: smooth must be >= 0");
  return loss_from_sums(
      "dice_loss", logits, target, {3}, 7, 10,
      [&](const Tensor& sums, const Tensor& loss) {
        UNETCU_LAUNCH(logits.device(), dice_sums, logits, target, sums);
        UNETCU_LAUNCH(logits.device(), dice_loss_from_sums, sums, smooth, loss);
      },
      [logits, target, smooth](const Tensor& sums, const Tensor& grad_loss, const Tensor& gx, double beta) {
        UNETCU_LAUNCH(logits.device(), dice_backward, logits, target, sums, smooth, grad_loss, gx, beta);
      });
}

Tensor segmentation_loss(LossKind kind, const Tensor& logits, const Tensor& target) {
  if (logits.ndim() == 4 && logits.dim(1) >= 2) {
    switch (kind) {
      case LossKind::BCE: return cross_entropy(logits, target);
      case LossKind::Dice: return multiclass_dice_loss(logits, target);
      case LossKind::BCEDice:
        return add(cross_entropy(logits, target), multiclass_dice_loss(logits, target));
    }
  }
  switch (kind) {
    case LossKind::BCE: return bce_with_logits(logits, target);
    case LossKind::Dice: return dice_loss(logits, target);
    case LossKind::BCEDice: return add(bce_with_logits(logits, target), dice_loss(logits, target));
  }
  throw Error("segmentation_loss: bad loss kind");
}

}  // namespace unetcu
