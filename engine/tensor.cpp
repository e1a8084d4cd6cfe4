#include "engine/tensor.h"

#include "runtime/allocator.h"
#include "runtime/cuda_api.h"
#include "kernels/launchers.h"

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
  // Checked: a shape computed from input must not wrap around to a small or negative count.
  constexpr int64_t kMax = int64_t(1) << 48;
  int64_t n = 1;
  for (int64_t d : s) {
    UNETCU_CHECK(d >= 0, "negative dimension in shape ", shape_str(s));
    UNETCU_CHECK(d == 0 || n <= kMax / d, "shape ", shape_str(s), " has too many elements");
    n *= d;
  }
  return n;
}

Storage::Storage(size_t nbytes, Device dev, bool pin) : bytes(nbytes), device(dev), pinned(pin) {
  if (dev.is_cuda()) {
    ptr = cuda::device_alloc(dev.index, nbytes, &capacity);
  } else if (pin) {
    ptr = cuda::pinned_alloc(nbytes);
    capacity = nbytes;
  } else {
    account = HostDataScope::active() ? -1 : dev.index;
    ptr = HostAllocator::allocate(nbytes, &capacity, account);
  }
}

Storage::~Storage() {
  if (device.is_cuda())
    cuda::device_free(device.index, ptr, capacity);
  else if (pinned)
    cuda::pinned_free(ptr);
  else
    HostAllocator::free(ptr, capacity, account);
}

static uint64_t next_tensor_id() {
  static std::atomic<uint64_t> counter{1};
  return counter.fetch_add(1, std::memory_order_relaxed);
}

static Tensor make_tensor(const Shape& shape, DType dtype, Device device, bool pinned,
                          MemoryFormat format = MemoryFormat::NCHW) {
  UNETCU_CHECK(shape.size() <= 4, "tensors have at most 4 dimensions, got ", shape_str(shape));
  UNETCU_CHECK(format == MemoryFormat::NCHW || shape.size() == 4,
               "channels-last needs a 4-dimensional shape, got ", shape_str(shape));
  for (int64_t d : shape) UNETCU_CHECK(d >= 0, "negative dimension in shape ", shape_str(shape));
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(shape_numel(shape) * dtype_size(dtype), device, pinned);
  impl->shape = shape;
  impl->dtype = dtype;
  impl->device = device;
  impl->format = format;
  impl->id = next_tensor_id();
  return Tensor(std::move(impl));
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device, MemoryFormat format) {
  return make_tensor(shape, dtype, device, false, format);
}

Tensor Tensor::empty_pinned(const Shape& shape, DType dtype) {
  return make_tensor(shape, dtype, Device::cpu(), true);
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device, MemoryFormat format) {
  Tensor t = empty(shape, dtype, device, format);
  if (device.is_cuda())
    cuda::memset_zero(t.raw(), device.index, t.nbytes());
  else
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
  Tensor t = empty(shape, dtype);
  UNETCU_DISPATCH_STORAGE(dtype, T, {
    T* p = t.data<T>();
    for (size_t i = 0; i < values.size(); ++i) p[i] = static_cast<T>(values[i]);
  });
  return device.is_cpu() ? t : t.to(device);
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
  MemoryFormat fmt = format();
  if (fmt == MemoryFormat::NHWC && shape != this->shape()) {
    const Shape& s = this->shape();
    UNETCU_CHECK(s[1] == 1 || s[2] * s[3] == 1, "view: an NHWC tensor of shape ",
                 shape_str(s), " has no NCHW order to view as ", shape_str(shape));
    fmt = MemoryFormat::NCHW;  // C == 1 or H == W == 1: the two orders are the same
  }
  auto v = std::make_shared<TensorImpl>();
  v->storage = impl().storage;
  v->offset = impl().offset;
  v->shape = shape;
  v->dtype = dtype();
  v->device = device();
  v->format = fmt;
  v->id = next_tensor_id();
  return Tensor(std::move(v));
}

Tensor Tensor::detach() const { return view(shape()); }

Tensor Tensor::view_at(int64_t element_offset, const Shape& shape) const {
  UNETCU_CHECK(element_offset >= 0 && element_offset + shape_numel(shape) <= numel(),
               "view_at: ", shape_str(shape), " at element ", element_offset,
               " does not fit in ", shape_str(this->shape()));
  UNETCU_CHECK(shape.size() <= 4, "tensors have at most 4 dimensions, got ", shape_str(shape));
  UNETCU_CHECK(format() == MemoryFormat::NCHW ||
                   (shape.size() == 4 && Shape(shape.begin() + 1, shape.end()) ==
                                             Shape(this->shape().begin() + 1, this->shape().end())),
               "view_at: ", shape_str(shape), " of an NHWC tensor of shape ", shape_str(this->shape()),
               " (only whole images)");
  Tensor v = view(this->shape());
  v.impl().offset += size_t(element_offset) * dtype_size(dtype());
  v.impl().shape = shape;
  return v;
}

Tensor Tensor::rows(int64_t lo, int64_t hi) const {
  UNETCU_CHECK(ndim() >= 1 && 0 <= lo && lo <= hi && hi <= dim(0), "rows [", lo, ", ", hi,
               ") of a tensor of shape ", shape_str(shape()));
  Shape s = shape();
  const int64_t row = s[0] ? numel() / s[0] : 0;
  s[0] = hi - lo;
  return view_at(lo * row, s);
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape(), dtype(), device(), format());
  t.copy_(*this);
  return t;
}

Tensor Tensor::to(DType d) const {
  Tensor t = empty(shape(), d, device(), format());
  t.copy_(*this);
  return t;
}

Tensor Tensor::to(MemoryFormat f) const {
  if (f == format()) return *this;
  Tensor t = empty(shape(), dtype(), device(), f);
  t.copy_(*this);
  return t;
}

Tensor Tensor::to(Device d) const {
  Tensor t = empty(shape(), dtype(), d, format());
  t.copy_(*this);
  return t;
}

Tensor Tensor::to_after(Device d, const cuda::Event& src_ready) const {
  if (!device().is_cuda() || !d.is_cuda() || !src_ready.valid()) return to(d);
  Tensor t = empty(shape(), dtype(), d, format());
  cuda::copy_after(t.raw(), d.index, raw(), device().index, nbytes(), src_ready);
  return t;
}

Tensor Tensor::upload_to(Device d) const {
  const Arrival a = upload_ahead(d);
  a.wait();
  return a.tensor;
}

Arrival Tensor::upload_ahead(Device d) const {
  if (!d.is_cuda()) return {to(d), cuda::Event()};
  if (!device().is_cpu()) {  // from another GPU: copied on the calling thread's stream there
    Tensor t = to(d);
    return {t, cuda::Event::record(d.index)};
  }
  Arrival a;
  cuda::StreamScope on_upload(cuda::upload_stream(d.index));
  a.tensor = to(d);  // allocated for the upload stream too
  a.copied = cuda::Event::record(d.index);
  return a;
}

void Arrival::wait() const {
  if (copied.valid()) cuda::use_after(copied, tensor.raw(), tensor.device().index);
}

void Tensor::fill_(double value) {
  UNETCU_LAUNCH(device(), fill, *this, value);
}

void Tensor::copy_(const Tensor& src) {
  check_same_shape("copy_", *this, src);
  if (dtype() == src.dtype() && format() == src.format()) {
    if (raw() == src.raw()) return;
    if (device().is_cpu() && src.device().is_cpu())
      std::memcpy(raw(), src.raw(), nbytes());
    else
      cuda::copy(raw(), device(), src.raw(), src.device(), nbytes(), src.is_pinned());
    return;
  }
  if (device() == src.device()) {  // the convert kernel of that device
    UNETCU_LAUNCH(device(), convert, src, *this, 0.0);
    return;
  }
  // Across devices: convert on the device that holds the source, then copy the bytes.
  Tensor same = Tensor::empty(shape(), dtype(), src.device(), format());
  UNETCU_LAUNCH(src.device(), convert, src, same, 0.0);
  copy_(same);
}

// Memory index of the element at logical (NCHW-order) index i.
static int64_t memory_index(const Tensor& t, int64_t i) {
  if (t.format() == MemoryFormat::NCHW) return i;
  const kernels::Dims4 logical{t.dim(0), t.dim(1), t.dim(2), t.dim(3), false};
  int64_t n, c, h, w;
  kernels::coords_of(logical, i, &n, &c, &h, &w);
  return kernels::offset_of(TensorRef(t).dims4(), n, c, h, w);
}

double Tensor::at(int64_t i) const {
  UNETCU_CHECK(i >= 0 && i < numel(), "index ", i, " out of range for ", shape_str(shape()));
  i = memory_index(*this, i);
  if (device().is_cuda()) {
    double v = 0;
    UNETCU_DISPATCH_STORAGE(dtype(), T, {
      T host;
      cuda::copy(&host, Device::cpu(), static_cast<const T*>(raw()) + i, device(), sizeof(T));
      v = double(host);
    });
    return v;
  }
  double v = 0;
  UNETCU_DISPATCH_STORAGE(dtype(), T, v = double(data<T>()[i]));
  return v;
}

void Tensor::set(int64_t i, double value) {
  UNETCU_CHECK(i >= 0 && i < numel(), "index ", i, " out of range for ", shape_str(shape()));
  i = memory_index(*this, i);
  if (device().is_cuda()) {
    UNETCU_DISPATCH_STORAGE(dtype(), T, {
      const T host = static_cast<T>(value);
      cuda::copy(static_cast<T*>(raw()) + i, device(), &host, Device::cpu(), sizeof(T));
      cuda::synchronize(device().index);  // `host` dies with this scope
    });
    return;
  }
  UNETCU_DISPATCH_STORAGE(dtype(), T, data<T>()[i] = static_cast<T>(value));
}

double Tensor::item() const {
  UNETCU_CHECK(numel() == 1, "item() needs a one-element tensor, got ", shape_str(shape()));
  return at(0);
}

std::vector<double> Tensor::to_vector() const {
  if (device().is_cuda()) return to(Device::cpu()).to_vector();
  if (format() != MemoryFormat::NCHW) return to(MemoryFormat::NCHW).to_vector();
  std::vector<double> v(static_cast<size_t>(numel()));
  UNETCU_DISPATCH_STORAGE(dtype(), T, {
    const T* p = data<T>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = double(p[i]);
  });
  return v;
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (dst_device.is_cpu() && src_device.is_cpu())
    std::memcpy(dst, src, bytes);
  else
    cuda::copy(dst, dst_device, src, src_device, bytes);
}

void check_same_format(const char* op, const Tensor& a, const Tensor& b) {
  UNETCU_CHECK(a.format() == b.format(), op, ": memory format mismatch (",
               format_name(a.format()), " vs ", format_name(b.format()), ")");
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
