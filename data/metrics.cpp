#include "data/metrics.h"

#include "kernels/launchers.h"

namespace unetcu {

SegmentationCounts::SegmentationCounts(int classes) : classes_(classes), k_(std::max(2, classes)) {
  UNETCU_CHECK(classes >= 1, "SegmentationCounts: classes must be >= 1");
}

void SegmentationCounts::add(const Tensor& logits, const Tensor& masks) {
  const char* op = "SegmentationCounts::add";
  UNETCU_CHECK(logits.ndim() == 4 && logits.dim(1) == classes_, op, ": logits ", shape_str(logits.shape()),
               " for ", classes_, " classes");
  UNETCU_CHECK(masks.ndim() == 4 && masks.dim(0) == logits.dim(0) && masks.dim(1) == 1 &&
                   masks.dim(2) == logits.dim(2) && masks.dim(3) == logits.dim(3),
               op, ": masks ", shape_str(masks.shape()), " for logits ", shape_str(logits.shape()));
  UNETCU_CHECK(masks.dtype() == logits.dtype() || masks.dtype() == DType::F32, op, ": logits are ",
               dtype_name(logits.dtype()), ", masks ", dtype_name(masks.dtype()));
  UNETCU_CHECK(masks.device() == logits.device(), op, ": logits on ", logits.device().str(), ", masks on ",
               masks.device().str());
  if (!counts_.defined()) counts_ = Tensor::zeros({k_, k_}, DType::F64, logits.device());
  UNETCU_CHECK(counts_.device() == logits.device(), op, ": logits on ", logits.device().str(),
               ", earlier ones on ", counts_.device().str());
  UNETCU_LAUNCH(logits.device(), confusion_update, logits, masks, counts_);
  stale_ = true;
}

const std::vector<double>& SegmentationCounts::matrix() const {
  if (stale_) {
    host_.assign(size_t(k_) * k_, 0.0);
    if (counts_.defined()) host_ = counts_.to(Device::cpu()).to_vector();
    stale_ = false;
  }
  return host_;
}

SegmentationCounts::ClassTotals SegmentationCounts::totals(int c) const {
  const std::vector<double>& m = matrix();
  ClassTotals t{m[size_t(c * k_ + c)], 0, 0};
  for (int j = 0; j < k_; ++j) t.truth += m[size_t(c * k_ + j)], t.predicted += m[size_t(j * k_ + c)];
  return t;
}

bool SegmentationCounts::class_seen(int c) const {
  const ClassTotals t = totals(c);
  return t.truth + t.predicted > 0;
}

double SegmentationCounts::class_iou(int c) const {
  const ClassTotals t = totals(c);
  const double uni = t.truth + t.predicted - t.tp;
  return uni == 0 ? 1.0 : t.tp / uni;
}

double SegmentationCounts::class_dice(int c) const {
  const ClassTotals t = totals(c);
  return t.truth + t.predicted == 0 ? 1.0 : 2 * t.tp / (t.truth + t.predicted);
}

// The mean of per_class(c) over the classes seen, 1 when none is.
template <class F> static double mean_over_seen(const SegmentationCounts& m, int k, F per_class) {
  double sum = 0;
  int seen = 0;
  for (int c = 0; c < k; ++c)
    if (m.class_seen(c)) sum += per_class(c), ++seen;
  return seen ? sum / seen : 1.0;
}

double SegmentationCounts::miou() const {
  return mean_over_seen(*this, k_, [&](int c) { return class_iou(c); });
}

double SegmentationCounts::mean_dice() const {
  return mean_over_seen(*this, k_, [&](int c) { return class_dice(c); });
}

double SegmentationCounts::accuracy() const {
  const std::vector<double>& m = matrix();
  double right = 0, all = 0;
  for (int i = 0; i < k_; ++i)
    for (int j = 0; j < k_; ++j) all += m[size_t(i * k_ + j)], right += i == j ? m[size_t(i * k_ + j)] : 0;
  return all == 0 ? 1.0 : right / all;
}

}  // namespace unetcu
