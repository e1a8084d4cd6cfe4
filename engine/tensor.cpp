#include "engine/tensor.h"

#include "engine/allocator.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>

namespace unetcu {

std::string shape_str(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Storage::Storage(size_t nbytes, Device dev) : bytes(nbytes), device(dev) {
  UNETCU_CHECK(dev.is_cpu(), "device ", dev.str(), " has no memory allocator in this build");
  ptr = HostAllocator::allocate(nbytes, &capacity);
}

Storage::~Storage() { HostAllocator::free(ptr, capacity); }

static uint64_t next_tensor_id() {
  static std::atomic<uint64_t> counter{1};
  return counter.fetch_add(1, std::memory_order_relaxed);
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  UNETCU_CHECK(shape.size() <= 4, "tensors have at most 4 dimensions, got ", shape_str(shape));
  for (int64_t d : shape) UNETCU_CHECK(d >= 0, "negative dimension in shape ", shape_str(shape));
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(shape_numel(shape) * dtype_size(dtype), device);
  impl->shape = shape;
  impl->dtype = dtype;
  impl->device = device;
  impl->id = next_tensor_id();
  return Tensor(std::move(impl));
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  std::memset(t.raw(), 0, t.nbytes());
  return t;
}

Tensor Tensor::full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_(value);
  return t;
}

Tensor Tensor::from_vector(const Shape& shape, const std::vector<double>& values, DType dtype,
                           Device device) {
  UNETCU_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape), "from_vector: ",
               values.size(), " values for shape ", shape_str(shape));
  Tensor t = empty(shape, dtype, device);
  UNETCU_DISPATCH_FLOAT(dtype, T, {
    T* p = t.data<T>();
    for (size_t i = 0; i < values.size(); ++i) p[i] = static_cast<T>(values[i]);
  });
  return t;
}

int64_t Tensor::dim(int i) const {
  int n = ndim();
  if (i < 0) i += n;
  UNETCU_CHECK(i >= 0 && i < n, "dimension ", i, " out of range for shape ", shape_str(shape()));
  return shape()[i];
}

Tensor& Tensor::set_requires_grad(bool r) {
  impl().requires_grad = r;
  return *this;
}

Tensor Tensor::view(const Shape& shape) const {
  UNETCU_CHECK(shape_numel(shape) == numel(), "view: cannot view ", shape_str(this->shape()),
               " as ", shape_str(shape));
  UNETCU_CHECK(shape.size() <= 4, "tensors have at most 4 dimensions, got ", shape_str(shape));
  auto v = std::make_shared<TensorImpl>();
  v->storage = impl().storage;
  v->shape = shape;
  v->dtype = dtype();
  v->device = device();
  v->format = format();
  v->id = next_tensor_id();
  return Tensor(std::move(v));
}

Tensor Tensor::detach() const { return view(shape()); }

Tensor Tensor::clone() const {
  Tensor t = empty(shape(), dtype(), device());
  std::memcpy(t.raw(), raw(), nbytes());
  return t;
}

Tensor Tensor::to(DType d) const {
  Tensor t = empty(shape(), d, device());
  t.copy_(*this);
  return t;
}

void Tensor::fill_(double value) {
  UNETCU_DISPATCH_FLOAT(dtype(), T, {
    T* p = data<T>();
    const int64_t n = numel();
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(value);
  });
}

void Tensor::copy_(const Tensor& src) {
  check_same_shape("copy_", *this, src);
  if (dtype() == src.dtype()) {
    if (raw() != src.raw()) std::memcpy(raw(), src.raw(), nbytes());
    return;
  }
  const int64_t n = numel();
  UNETCU_DISPATCH_FLOAT(dtype(), D, {
    D* d = data<D>();
    UNETCU_DISPATCH_FLOAT(src.dtype(), S, {
      const S* s = src.data<S>();
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<D>(s[i]);
    });
  });
}

double Tensor::at(int64_t i) const {
  UNETCU_CHECK(i >= 0 && i < numel(), "index ", i, " out of range for ", shape_str(shape()));
  double v = 0;
  UNETCU_DISPATCH_FLOAT(dtype(), T, v = data<T>()[i]);
  return v;
}

void Tensor::set(int64_t i, double value) {
  UNETCU_CHECK(i >= 0 && i < numel(), "index ", i, " out of range for ", shape_str(shape()));
  UNETCU_DISPATCH_FLOAT(dtype(), T, data<T>()[i] = static_cast<T>(value));
}

double Tensor::item() const {
  UNETCU_CHECK(numel() == 1, "item() needs a one-element tensor, got ", shape_str(shape()));
  return at(0);
}

std::vector<double> Tensor::to_vector() const {
  std::vector<double> v(static_cast<size_t>(numel()));
  UNETCU_DISPATCH_FLOAT(dtype(), T, {
    const T* p = data<T>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = p[i];
  });
  return v;
}

void check_same_dtype_device(const char* op, const Tensor& a, const Tensor& b) {
  UNETCU_CHECK(a.dtype() == b.dtype(), op, ": dtype mismatch (", dtype_name(a.dtype()), " vs ",
               dtype_name(b.dtype()), ")");
  UNETCU_CHECK(a.device() == b.device(), op, ": device mismatch (", a.device().str(), " vs ",
               b.device().str(), ")");
}

void check_same_shape(const char* op, const Tensor& a, const Tensor& b) {
  UNETCU_CHECK(a.shape() == b.shape(), op, ": shape mismatch (", shape_str(a.shape()), " vs ",
               shape_str(b.shape()), ")");
}

void check_ndim(const char* op, const Tensor& t, int ndim, const char* what) {
  UNETCU_CHECK(t.ndim() == ndim, op, ": ", what, " must have ", ndim, " dimensions, got ",
               shape_str(t.shape()));
}

}  // namespace unetcu
