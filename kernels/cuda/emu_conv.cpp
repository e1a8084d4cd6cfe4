// Convolutions in the CUDA emulator build (-DUNETCU_CUDA=EMU, runtime/cuda/emu/README.md): the
// emulator has no cuDNN, and its device memory is host memory, so the CPU backend's
// convolution runs on the CUDA tensors' storage, queued on the current stream like a kernel
// (and captured into a graph like one). conv.cu (cuDNN's descriptors, the algorithm search, the
// bias kernels) is left out of that build; everything around a convolution (its inputs'
// layouts, the tape, the caching allocator, the streams) is the CUDA path's own.
#include "kernels/launchers.h"
#include "runtime/cuda/runtime.cuh"

namespace unetcu::kernels::cuda {

namespace {

// What a failed cuDNN call does in the real build: the launcher throws. The thread's last CUDA
// error stays set, as it may after cuDNN's own launches failed: whoever goes on on this thread
// must clear it.
void queue(int dev, std::function<void()> work) {
  const cudaError_t e = ::unetcu_emu::enqueue(unetcu::cuda::current_stream(dev), std::move(work));
  if (e != cudaSuccess)
    throw Error(str_cat("convolution on cuda:", dev, " (emulated cuDNN): ", cudaGetErrorString(e)));
}

}  // namespace

void conv2d_forward(const TensorRef& x, const TensorRef& w, const TensorRef& b, const TensorRef& y,
                    const ConvGeometry& g) {
  const int dev = x.device().index;
  unetcu::cuda::DeviceGuard guard(dev);
  queue(dev, [=] { cpu::conv2d_forward(x, w, b, y, g); });
}

void conv2d_backward(const TensorRef& grad_y, const TensorRef& x, const TensorRef& w,
                     const TensorRef& grad_x, double beta_x, const TensorRef& grad_w, double beta_w,
                     const TensorRef& grad_b, double beta_b, const ConvGeometry& g) {
  const int dev = x.device().index;
  unetcu::cuda::DeviceGuard guard(dev);
  queue(dev, [=] { cpu::conv2d_backward(grad_y, x, w, grad_x, beta_x, grad_w, beta_w, grad_b, beta_b, g); });
}

}  // namespace unetcu::kernels::cuda
