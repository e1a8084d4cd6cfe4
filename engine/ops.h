// The op API. Every op checks its inputs once here (shape, dtype, device), computes on the
// backend of its inputs' device, and records a tape node when a tape is active and an input
// requires a gradient. Gradient rule of every backward: parameter and input gradients are
// *accumulated* into a leaf's existing gradient (beta = 1) and *written* into a fresh buffer
// otherwise (beta = 0); see engine/tape.h.
#pragma once
#include <vector>

#include "engine/named.h"
#include "engine/tensor.h"

namespace unetcu {

struct Conv2dOptions {
  int stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;
  static Conv2dOptions square(int stride, int pad) { return {stride, stride, pad, pad}; }
};

// x [N, C, H, W], w [O, C, kh, kw], b [O] or undefined -> [N, O, OH, OW].
Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& b, const Conv2dOptions& opt);
inline Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& b, int stride = 1,
                     int padding = 0) {
  return conv2d(x, w, b, Conv2dOptions::square(stride, padding));
}

// x [N, C, H, W]; gamma, beta, running_mean, running_var [C].
// training: normalise with the batch statistics (biased variance) and update the running
// statistics in place, running = (1 - momentum) * running + momentum * batch (unbiased
// variance), as PyTorch. Eval: normalise with the running statistics.
Tensor batch_norm2d(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                    Tensor& running_mean, Tensor& running_var, bool training,
                    double momentum = 0.1, double eps = 1e-5);

// Batch norm fused with what follows it in ResNet and the U-Net decoder, each one op:
//   batch_norm_relu(x, ...)               = relu(batch_norm2d(x, ...))
//   batch_norm_add_relu(x, ..., residual) = relu(batch_norm2d(x, ...) + residual)
// (residual of x's shape), with batch_norm2d's arguments and running-statistics semantics. One
// pass over the data forward (after the statistics) and one elementwise pass backward (after
// one reduction pass), instead of a pass per op each way.
Tensor batch_norm_relu(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                       Tensor& running_mean, Tensor& running_var, bool training,
                       double momentum = 0.1, double eps = 1e-5);
Tensor batch_norm_add_relu(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                           const Tensor& residual, Tensor& running_mean, Tensor& running_var,
                           bool training, double momentum = 0.1, double eps = 1e-5);

// Synchronized batch norm: while a BatchNormSyncScope is active on a thread, training-mode
// batch_norm2d sums its per-channel statistics (forward) and gradient sums (backward) over all
// replicas through `all_reduce_sum`, so N replicas with b samples each normalise as one batch
// of N·b. (Data parallelism installs it for --sync-bn.)
class BatchNormSync {
 public:
  virtual ~BatchNormSync() = default;
  virtual void all_reduce_sum(Tensor& t) = 0;  // float64, in place, every replica in step
  virtual int world_size() const = 0;            // replicas; each holds an equal shard
};
class BatchNormSyncScope {
 public:
  explicit BatchNormSyncScope(BatchNormSync* sync);
  ~BatchNormSyncScope();
  static BatchNormSync* current();

 private:
  BatchNormSync* previous_;
};

Tensor relu(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor add(const Tensor& a, const Tensor& b);  // same shape
Tensor scale(const Tensor& x, double alpha);   // alpha * x

struct Pool2dOptions {
  int kernel_h, kernel_w, stride_h, stride_w, pad_h = 0, pad_w = 0;
  static Pool2dOptions square(int kernel, int stride, int pad) {
    return {kernel, kernel, stride, stride, pad, pad};
  }
};
Tensor max_pool2d(const Tensor& x, const Pool2dOptions& opt);

Tensor upsample_nearest2x(const Tensor& x);             // [N, C, H, W] -> [N, C, 2H, 2W]
Tensor concat_channels(const std::vector<Tensor>& xs);  // along dimension 1
// concat_channels({upsample_nearest2x(x), skip}) in one pass, no intermediate: x [N, Cx, H, W],
// skip [N, Cs, 2H, 2W] -> [N, Cx + Cs, 2H, 2W] (SMP's decoder: upsample, then cat([x, skip], 1)).
Tensor upsample_nearest2x_concat(const Tensor& x, const Tensor& skip);

// Losses return a 0-dimensional tensor. A negative target marks an ignored pixel: it counts
// in no sum and no mean, and gets no gradient (with none ignored, the means are over all).
// One channel (binary): target has the logits' shape, values in [0, 1].
Tensor bce_with_logits(const Tensor& logits, const Tensor& target);  // mean over elements
// Soft Dice over the whole batch: 1 - (2 sum(p t) + smooth) / (sum p + sum t + smooth),
// p = sigmoid(logits).
Tensor dice_loss(const Tensor& logits, const Tensor& target, double smooth = 1.0);
// (0/0 with nothing predicted, nothing to find and smooth 0 counts as a perfect match: 0.)
// C >= 2 channels: target [N, 1, H, W] holds class indices 0..C-1 (as floats).
// nn.CrossEntropyLoss(ignore_index=...): the mean over counted pixels of -log softmax(x)_t.
Tensor cross_entropy(const Tensor& logits, const Tensor& target);
// segmentation_models_pytorch's DiceLoss(mode='multiclass', smooth=0, eps=1e-7, ignore_index):
// the mean over the C classes of 1 - 2 I_c / (P_c + T_c), 0 for a class absent from the
// batch's target (bodies/loss.h).
Tensor multiclass_dice_loss(const Tensor& logits, const Tensor& target, double smooth = 0.0);

// The loss a run trains with. One channel: BCE-with-logits and/or the soft Dice; C >= 2:
// softmax cross-entropy and/or the multiclass Dice. "ce" and "bce" name the same kind.
enum class LossKind { BCE, Dice, BCEDice };
inline constexpr NamedValue<LossKind> kLossNames[] = {
    {"bce", LossKind::BCE}, {"dice", LossKind::Dice}, {"bce+dice", LossKind::BCEDice},
    {"ce", LossKind::BCE}, {"ce+dice", LossKind::BCEDice}};
inline const char* loss_kind_name(LossKind k) { return name_of(kLossNames, k); }
// The name as a run with `classes` output channels says it: bce, dice, bce+dice for one
// channel; ce, dice, ce+dice for more.
inline const char* loss_kind_name(LossKind k, int classes) {
  if (classes < 2 || k == LossKind::Dice) return loss_kind_name(k);
  return k == LossKind::BCE ? "ce" : "ce+dice";
}
Tensor segmentation_loss(LossKind kind, const Tensor& logits, const Tensor& target);

}  // namespace unetcu

namespace unetcu {
// Moves x to another device (CPU <-> GPU, GPU <-> GPU). Its backward moves the gradient back
// to x's device, so a model can span devices with explicit transfers.
Tensor to_device(const Tensor& x, Device device);
// The same values in another dtype and/or memory format (x itself when both already match); the
// gradient is converted back and, for a float32 parameter read as bfloat16, summed in float32.
Tensor convert(const Tensor& x, DType dtype, MemoryFormat format);
}  // namespace unetcu
