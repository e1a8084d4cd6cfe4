// Tensor: up to 4 dimensions, contiguous, float32, float64 or bfloat16, on a device. Shapes are
// [N, C, H, W] for images; a 4-dimensional tensor lies in memory as NCHW or NHWC (its format).
// Element access (at, set, to_vector, from_vector) uses the logical NCHW order in both.
// Storage is shared: copies of a Tensor handle and views (reshape, detach) alias the same
// memory. Autograd state (requires_grad, the gradient of a leaf, which tape produced it) lives
// in the TensorImpl; the graph itself lives in engine/tape.h.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/named.h"
#include "runtime/device.h"
#include "runtime/dtype.h"
#include "runtime/cuda_api.h"
#include "runtime/tensor_ref.h"

namespace unetcu {

inline constexpr NamedValue<DType> kDTypeNames[] = {{"float32", DType::F32}, {"float64", DType::F64}};

std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

// A block of memory on one device. Freed when the last tensor using it goes away.
struct Storage {
  void* ptr = nullptr;
  size_t bytes = 0;
  size_t capacity = 0;  // size of the allocator block holding it
  Device device;
  bool pinned = false;   // page-locked host memory (CPU device), for asynchronous uploads
  int account = 0;       // CPU: the device whose memory it counts in (-1: host data)
  Storage(size_t bytes, Device device, bool pinned = false);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  size_t offset = 0;                // bytes from the start of the storage (views into a buffer)
  Shape shape;
  DType dtype = DType::F32;
  Device device;
  MemoryFormat format = MemoryFormat::NCHW;
  bool requires_grad = false;
  uint64_t id = 0;                  // unique per TensorImpl; the tape keys gradients by it
  uint64_t producer = 0;            // serial of the tape recording that made it; 0 for a leaf
  std::shared_ptr<TensorImpl> grad; // accumulated gradient of a leaf (parameters, inputs)
};

struct Arrival;

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // Uninitialised memory.
  static Tensor empty(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu(),
                      MemoryFormat format = MemoryFormat::NCHW);
  // Host tensor in page-locked memory (needs the CUDA backend): its upload to a GPU with
  // to(Device) does not wait for the copy.
  static Tensor empty_pinned(const Shape& shape, DType dtype = DType::F32);
  static Tensor zeros(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu(),
                      MemoryFormat format = MemoryFormat::NCHW);
  static Tensor full(const Shape& shape, double value, DType dtype = DType::F32,
                     Device device = Device::cpu());
  static Tensor from_vector(const Shape& shape, const std::vector<double>& values,
                            DType dtype = DType::F32, Device device = Device::cpu());

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl().shape; }
  int ndim() const { return static_cast<int>(impl().shape.size()); }
  int64_t dim(int i) const;
  int64_t numel() const { return shape_numel(impl().shape); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype()); }
  DType dtype() const { return impl().dtype; }
  Device device() const { return impl().device; }
  MemoryFormat format() const { return impl().format; }

  void* raw() const { return static_cast<char*>(impl().storage->ptr) + impl().offset; }
  // The view the launchers take (kernels/launchers.h); absent for an undefined tensor.
  operator TensorRef() const {
    return defined() ? TensorRef(raw(), dtype(), device(), shape(), format()) : TensorRef();
  }
  // Typed pointer to the elements, for host code: a tensor on another device is refused (its
  // memory is the device's, which a GPU faults on and the CUDA emulator would let the host read;
  // copy it with to(Device::cpu()) first). Launchers take raw() through TensorRef.
  template <class T> T* data() const {
    UNETCU_CHECK(dtype_of<T>() == dtype(), "tensor holds ", dtype_name(dtype()),
                 " but was read as ", dtype_name(dtype_of<T>()));
    UNETCU_CHECK(device().is_cpu(), "host access to the elements of a tensor on ", device().str(),
                 ": copy it to the CPU first");
    return static_cast<T*>(raw());
  }

  // Autograd.
  bool requires_grad() const { return defined() && impl().requires_grad; }
  Tensor& set_requires_grad(bool r);
  bool is_leaf() const { return impl().producer == 0; }
  Tensor grad() const { return Tensor(impl().grad); }  // undefined until a backward writes it
  void zero_grad() { impl().grad.reset(); }
  uint64_t id() const { return impl().id; }

  // Same storage, new shape (same element count). No gradient flows through a view. An NHWC
  // tensor keeps its format under the same shape; another shape is allowed only where the
  // memory order is that of NCHW (C == 1 or H == W == 1), and the view is NCHW.
  Tensor view(const Shape& shape) const;
  // Rows [lo, hi) of dimension 0: same storage (no copy, no autograd), e.g. a replica's shard
  // of a batch or a micro-batch.
  Tensor rows(int64_t lo, int64_t hi) const;
  // `shape` elements of this tensor's storage starting `element_offset` elements into it: a
  // view into a flat buffer (data parallelism keeps gradients in its all-reduce buckets).
  Tensor view_at(int64_t element_offset, const Shape& shape) const;
  // Same storage, no autograd history, requires_grad false.
  Tensor detach() const;
  Tensor clone() const;
  Tensor to(DType dtype) const;  // same format, on the same device
  // The same values in another memory format (same dtype and device); this tensor itself when
  // it already has that format.
  Tensor to(MemoryFormat format) const;
  // A copy on another device (no autograd; the op to_device in engine/ops.h records one).
  Tensor to(Device device) const;
  // GPU to GPU (or between streams of one GPU): the copy waits for `src_ready`, an event the
  // producer of this tensor recorded on its own stream; otherwise as to(device).
  Tensor to_after(Device device, const cuda::Event& src_ready) const;
  // A host tensor (an input batch) on `device` for the work the calling thread queues next on
  // its current stream there: on a GPU copied on the device's upload stream (cuda_api.h), so
  // the copy overlaps with the work already queued, which the consumer's work then follows;
  // otherwise as to(device). Call it after queuing the work it should overlap with.
  Tensor upload_to(Device device) const;
  // The same copy with its wait left to the consumer (Arrival::wait), who may queue other work
  // in between that must not wait for it (a pipeline places batch s+1 before its step s). From
  // another GPU: copied on the calling thread's current streams, the arrival an event after it.
  Arrival upload_ahead(Device device) const;
  bool is_pinned() const { return impl().storage->pinned; }

  // Element access works on every device; on CUDA each call copies through the host and waits.
  void fill_(double value);
  void copy_(const Tensor& src);  // same shape, any devices, dtypes and formats
  double item() const;            // one-element tensor -> double
  double at(int64_t flat_index) const;
  void set(int64_t flat_index, double value);
  std::vector<double> to_vector() const;

  bool same_storage(const Tensor& o) const { return impl().storage == o.impl().storage; }
  TensorImpl& impl() const {
    UNETCU_CHECK(impl_ != nullptr, "use of an undefined tensor");
    return *impl_;
  }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

// Copies `bytes` between any two devices (memcpy between CPU devices, the CUDA runtime
// otherwise).
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);

// Shape/dtype/device agreement checks used at every op's public entry point.
void check_same_dtype_device(const char* op, const Tensor& a, const Tensor& b);
void check_same_format(const char* op, const Tensor& a, const Tensor& b);
void check_same_shape(const char* op, const Tensor& a, const Tensor& b);
void check_ndim(const char* op, const Tensor& t, int ndim, const char* what);

// An upload in flight (Tensor::upload_ahead): nothing may read `tensor` on a stream before
// that stream has waited for it with wait().
struct Arrival {
  Tensor tensor;
  cuda::Event copied;  // none where nothing is in flight (the CPU; a tensor there already)
  // The calling thread's current stream on the tensor's device waits for the copy and becomes
  // a user of its block (cuda::use_after). Once per consuming stream; again is harmless.
  void wait() const;
};

}  // namespace unetcu
