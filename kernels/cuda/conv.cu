// CUDA convolution through cuDNN. For each (device, geometry, TF32 setting) the descriptors
// are built once and each direction's algorithm is chosen once, by cudnnFind*AlgorithmEx
// (measured on the real shapes), then cached. The chosen algorithm's workspace comes from
// the caching device allocator for each call: no fixed per-layer cap.
//
// Gradient rule (cuDNN beta): the weight and bias gradients accumulate when a gradient
// exists (beta = 1) and are written otherwise (beta = 0); the same holds for the input
// gradient, which is written (beta = 0) unless the input already has one (e.g. a residual
// input read by both the block and its downsample conv).
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "runtime/cuda_api.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cudnn_util.cuh"
#include "kernels/launchers.h"

namespace unetcu::kernels::cuda {
namespace {

struct Key {
  int device;
  int64_t N, C, H, W, O, kh, kw, sh, sw, ph, pw;
  bool tf32;
  bool operator<(const Key& o) const {
    return std::tie(device, N, C, H, W, O, kh, kw, sh, sw, ph, pw, tf32) <
           std::tie(o.device, o.N, o.C, o.H, o.W, o.O, o.kh, o.kw, o.sh, o.sw, o.ph, o.pw, o.tf32);
  }
};

struct Plan {
  TensorDesc x, y, bias;
  FilterDesc w;
  ConvDesc conv;
  bool has_fwd = false, has_bwd_data = false, has_bwd_filter = false;
  cudnnConvolutionFwdAlgoPerf_t fwd;
  cudnnConvolutionBwdDataAlgoPerf_t bwd_data;
  cudnnConvolutionBwdFilterAlgoPerf_t bwd_filter;
  explicit Plan(const ConvGeometry& g)
      : x(g.N, g.C, g.H, g.W), y(g.N, g.O, g.OH, g.OW), bias(1, g.O, 1, 1), w(g.O, g.C, g.kh, g.kw),
        conv(g.ph, g.pw, g.sh, g.sw) {}
};

std::mutex g_plans_mutex;
std::map<Key, std::unique_ptr<Plan>>& plans() {
  static auto* m = new std::map<Key, std::unique_ptr<Plan>>();
  return *m;
}

Plan& plan_for(int device, const ConvGeometry& g, bool tf32) {
  const Key k{device, g.N, g.C, g.H, g.W, g.O, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, tf32};
  std::lock_guard<std::mutex> lock(g_plans_mutex);
  auto& slot = plans()[k];
  if (!slot) {
    slot = std::make_unique<Plan>(g);
    CUDNN_CHECK(cudnnSetConvolutionMathType(slot->conv.d, tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH));
  }
  return *slot;
}

// Workspace the algorithm search may use: a quarter of the free memory, at most 1 GiB.
size_t search_workspace_bytes() {
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return std::min<size_t>(free_b / 4, size_t(1) << 30);
}

template <class Perf>
Perf pick(const Perf* results, int count, const char* what) {
  for (int i = 0; i < count; ++i)
    if (results[i].status == CUDNN_STATUS_SUCCESS) return results[i];
  throw Error(str_cat("cuDNN found no usable ", what, " algorithm"));
}

// Algorithms are searched with the handle already locked (h) and on the tensors of the call.
// The search may use a large workspace once per shape: it comes straight from cudaMalloc, so
// it neither stays in the caching allocator nor counts in the training's peak memory.
struct SearchWorkspace {
  void* ptr = nullptr;
  size_t bytes;
  SearchWorkspace() : bytes(search_workspace_bytes()) {
    if (bytes && cudaMalloc(&ptr, bytes) != cudaSuccess) {
      cudaGetLastError();
      ptr = nullptr;
      bytes = 0;  // search among the algorithms that need none
    }
  }
  ~SearchWorkspace() {
    if (ptr) cudaFree(ptr);
  }
  void* get() const { return ptr; }
};

// Each direction is searched under the requested math type (the descriptor keeps the type
// of the last algorithm used).
void reset_math(Plan& p, bool tf32) {
  CUDNN_CHECK(cudnnSetConvolutionMathType(p.conv.d, tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH));
}

void find_forward(Plan& p, cudnnHandle_t h, int device, const TensorRef& x, const TensorRef& w,
                  const TensorRef& y) {
  SearchWorkspace ws;
  const size_t ws_bytes = ws.bytes;
  cudnnConvolutionFwdAlgoPerf_t res[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
  int n = 0;
  CUDNN_CHECK(cudnnFindConvolutionForwardAlgorithmEx(h, p.x.d, x.raw(), p.w.d, w.raw(), p.conv.d,
                                                     p.y.d, y.raw(), CUDNN_CONVOLUTION_FWD_ALGO_COUNT,
                                                     &n, res, ws.get(), ws_bytes));
  p.fwd = pick(res, n, "forward convolution");
  p.has_fwd = true;
}

void find_backward_data(Plan& p, cudnnHandle_t h, int device, const TensorRef& w,
                        const TensorRef& dy, const TensorRef& x) {
  SearchWorkspace ws;
  const size_t ws_bytes = ws.bytes;
  unetcu::cuda::DeviceBuffer scratch_dx(device, x.nbytes());  // the real dx may hold a gradient
  cudnnConvolutionBwdDataAlgoPerf_t res[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT];
  int n = 0;
  CUDNN_CHECK(cudnnFindConvolutionBackwardDataAlgorithmEx(
      h, p.w.d, w.raw(), p.y.d, dy.raw(), p.conv.d, p.x.d, scratch_dx.get(),
      CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &n, res, ws.get(), ws_bytes));
  p.bwd_data = pick(res, n, "backward-data convolution");
  p.has_bwd_data = true;
}

void find_backward_filter(Plan& p, cudnnHandle_t h, int device, const TensorRef& x,
                          const TensorRef& dy, const TensorRef& w) {
  SearchWorkspace ws;
  const size_t ws_bytes = ws.bytes;
  unetcu::cuda::DeviceBuffer scratch_dw(device, w.nbytes());
  cudnnConvolutionBwdFilterAlgoPerf_t res[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT];
  int n = 0;
  CUDNN_CHECK(cudnnFindConvolutionBackwardFilterAlgorithmEx(
      h, p.x.d, x.raw(), p.y.d, dy.raw(), p.conv.d, p.w.d, scratch_dw.get(),
      CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &n, res, ws.get(), ws_bytes));
  p.bwd_filter = pick(res, n, "backward-filter convolution");
  p.has_bwd_filter = true;
}

}  // namespace

void conv2d_forward(const TensorRef& x, const TensorRef& w, const TensorRef& b, const TensorRef& y,
                    const ConvGeometry& g) {
  Launch l(x);
  const int dev = x.device().index;
  const bool tf32 = unetcu::cuda::allow_tf32();
  Plan& p = plan_for(dev, g, tf32);
  const float one = 1, zero = 0;
  unetcu::cuda::CudnnLock h(dev);
  if (!p.has_fwd) {
    reset_math(p, tf32);
    find_forward(p, h.handle(), dev, x, w, y);
  }
  CUDNN_CHECK(cudnnSetConvolutionMathType(p.conv.d, p.fwd.mathType));
  unetcu::cuda::DeviceBuffer ws(dev, p.fwd.memory);
  CUDNN_CHECK(cudnnConvolutionForward(h.handle(), &one, p.x.d, x.raw(), p.w.d, w.raw(), p.conv.d,
                                      p.fwd.algo, ws.get(), p.fwd.memory, &zero, p.y.d, y.raw()));
  if (b.defined())
    CUDNN_CHECK(cudnnAddTensor(h.handle(), &one, p.bias.d, b.raw(), &one, p.y.d, y.raw()));
  CUDA_CHECK_LAUNCH(l.stream, "conv2d_forward");
}

void conv2d_backward(const TensorRef& grad_y, const TensorRef& x, const TensorRef& w,
                     const TensorRef& grad_x, double beta_x, const TensorRef& grad_w, double beta_w,
                     const TensorRef& grad_b, double beta_b, const ConvGeometry& g) {
  Launch l(x);
  const int dev = x.device().index;
  const bool tf32 = unetcu::cuda::allow_tf32();
  Plan& p = plan_for(dev, g, tf32);
  const float one = 1;
  unetcu::cuda::CudnnLock h(dev);
  if (grad_b.defined()) {
    const float bb = float(beta_b);
    CUDNN_CHECK(cudnnConvolutionBackwardBias(h.handle(), &one, p.y.d, grad_y.raw(), &bb, p.bias.d,
                                             grad_b.raw()));
  }
  if (grad_w.defined()) {
    if (!p.has_bwd_filter) {
      reset_math(p, tf32);
      find_backward_filter(p, h.handle(), dev, x, grad_y, w);
    }
    CUDNN_CHECK(cudnnSetConvolutionMathType(p.conv.d, p.bwd_filter.mathType));
    unetcu::cuda::DeviceBuffer ws(dev, p.bwd_filter.memory);
    const float bw = float(beta_w);
    CUDNN_CHECK(cudnnConvolutionBackwardFilter(h.handle(), &one, p.x.d, x.raw(), p.y.d,
                                               grad_y.raw(), p.conv.d, p.bwd_filter.algo, ws.get(),
                                               p.bwd_filter.memory, &bw, p.w.d, grad_w.raw()));
  }
  if (grad_x.defined()) {
    if (!p.has_bwd_data) {
      reset_math(p, tf32);
      find_backward_data(p, h.handle(), dev, w, grad_y, x);
    }
    CUDNN_CHECK(cudnnSetConvolutionMathType(p.conv.d, p.bwd_data.mathType));
    unetcu::cuda::DeviceBuffer ws(dev, p.bwd_data.memory);
    const float bx = float(beta_x);
    CUDNN_CHECK(cudnnConvolutionBackwardData(h.handle(), &one, p.w.d, w.raw(), p.y.d, grad_y.raw(),
                                             p.conv.d, p.bwd_data.algo, ws.get(),
                                             p.bwd_data.memory, &bx, p.x.d, grad_x.raw()));
  }
  CUDA_CHECK_LAUNCH(l.stream, "conv2d_backward");
}

}  // namespace unetcu::kernels::cuda
