// TensorRef: what a launcher sees of a tensor — a pointer to its elements, their dtype, the
// device they live on and up to 4 dimensions — without ownership, autograd or the tensor
// layer above (engine/tensor.h converts a Tensor to one). Like a span, a const TensorRef may
// still write its elements: const says the view is not re-pointed, not that data is read-only.
// Dims are logical ([N, C, H, W] for images) whatever the memory format (NCHW or NHWC).
// Default-constructed it is absent (defined() is false): an optional input or output.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "runtime/common.h"
#include "runtime/device.h"
#include "runtime/dtype.h"
#include "bodies/layout.h"

namespace unetcu {

using Shape = std::vector<int64_t>;

class TensorRef {
 public:
  static constexpr int kMaxDims = 4;

  TensorRef() = default;
  TensorRef(void* data, DType dtype, Device device, const Shape& shape,
            MemoryFormat format = MemoryFormat::NCHW)
      : data_(data), dtype_(dtype), device_(device), format_(format),
        ndim_(static_cast<int>(shape.size())) {
    UNETCU_CHECK(shape.size() <= kMaxDims, "tensors have at most ", kMaxDims, " dimensions, got ",
                 shape.size());
    UNETCU_CHECK(format == MemoryFormat::NCHW || shape.size() == 4,
                 "channels-last needs a 4-dimensional tensor, got ", shape.size(), " dimensions");
    for (int i = 0; i < ndim_; ++i) {
      dims_[i] = shape[i];
      numel_ *= shape[i];
    }
  }

  bool defined() const { return ndim_ >= 0; }
  int ndim() const { return ndim_; }
  // Negative i counts from the end, as Tensor::dim.
  int64_t dim(int i) const {
    if (i < 0) i += ndim_;
    UNETCU_CHECK(i >= 0 && i < ndim_, "dimension ", i, " out of range for a ", ndim_,
                 "-dimensional tensor");
    return dims_[i];
  }
  Shape shape() const { return defined() ? Shape(dims_, dims_ + ndim_) : Shape(); }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  // Memory order of a 4-dimensional tensor (dims are always [N, C, H, W]).
  MemoryFormat format() const { return format_; }
  bool nhwc() const { return format_ == MemoryFormat::NHWC; }
  // Dims and memory order of a 4-dimensional tensor, for the layout-aware bodies.
  kernels::Dims4 dims4() const {
    UNETCU_CHECK(ndim_ == 4, "a 4-dimensional tensor was expected, got ", ndim_, " dimensions");
    return {dims_[0], dims_[1], dims_[2], dims_[3], nhwc()};
  }

  void* raw() const { return data_; }
  // Typed pointer to the elements (device memory for a CUDA tensor).
  template <class T> T* data() const {
    UNETCU_CHECK(defined(), "use of an absent tensor");
    UNETCU_CHECK(dtype_of<T>() == dtype_, "tensor holds ", dtype_name(dtype_), " but was read as ",
                 dtype_name(dtype_of<T>()));
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::F32;
  Device device_;
  MemoryFormat format_ = MemoryFormat::NCHW;
  int ndim_ = -1;  // -1: absent
  int64_t dims_[kMaxDims] = {};
  int64_t numel_ = 1;
};

}  // namespace unetcu
