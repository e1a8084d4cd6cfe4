#include "data/metrics.h"

namespace unetcu {

void SegmentationCounts::add(const Tensor& logits_in, const Tensor& masks_in) {
  check_same_shape("SegmentationCounts::add", logits_in, masks_in);
  UNETCU_CHECK(logits_in.dtype() == masks_in.dtype(), "SegmentationCounts::add: logits are ",
               dtype_name(logits_in.dtype()), ", masks ", dtype_name(masks_in.dtype()));
  // Counted on the host: a GPU's logits come back once per evaluation batch (the masks may be
  // given as the host copy they were uploaded from).
  const Tensor logits = logits_in.device().is_cpu() ? logits_in : logits_in.to(Device::cpu());
  const Tensor masks = masks_in.device().is_cpu() ? masks_in : masks_in.to(Device::cpu());
  const int64_t n = logits.numel();
  int64_t tp_ = 0, fp_ = 0, fn_ = 0, tn_ = 0;
  UNETCU_DISPATCH_FLOAT(logits.dtype(), T, {
    const T* x = logits.data<T>();
    const T* m = masks.data<T>();
    for (int64_t i = 0; i < n; ++i) {
      const bool pred = x[i] > T(0), truth = m[i] > T(0.5);
      tp_ += pred && truth;
      fp_ += pred && !truth;
      fn_ += !pred && truth;
      tn_ += !pred && !truth;
    }
  });
  tp += tp_, fp += fp_, fn += fn_, tn += tn_;
}

double SegmentationCounts::iou() const {
  const int64_t d = tp + fp + fn;
  return d == 0 ? 1.0 : double(tp) / double(d);
}

double SegmentationCounts::dice() const {
  const int64_t d = 2 * tp + fp + fn;
  return d == 0 ? 1.0 : 2.0 * double(tp) / double(d);
}

double SegmentationCounts::accuracy() const {
  const int64_t d = tp + fp + fn + tn;
  return d == 0 ? 1.0 : double(tp + tn) / double(d);
}

}  // namespace unetcu
