// CUDA launcher of convert: dtype and memory-format changes, over the body the CPU runs
// (kernels/bodies/convert.h).
#include "kernels/cuda/common.cuh"
#include "kernels/bodies/convert.h"
#include "kernels/bodies/layout.h"
#include "kernels/launchers.h"

namespace unetcu::kernels::cuda {
namespace {

template <class S, class D>
__global__ void convert_kernel(const S* s, D* d, int64_t n, bool acc) {
  GRID_STRIDE(i, n) convert_one(s + i, d + i, acc);
}

// Walks the destination in memory order; reads the source through its own layout.
template <class S, class D>
__global__ void convert_layout_kernel(const S* s, Dims4 ds, D* d, Dims4 dd, int64_t n, bool acc) {
  GRID_STRIDE(i, n) {
    int64_t nn, c, h, w;
    coords_of(dd, i, &nn, &c, &h, &w);
    convert_one(s + offset_of(ds, nn, c, h, w), d + i, acc);
  }
}

}  // namespace

void convert(const TensorRef& src, const TensorRef& dst, double beta) {
  const int64_t n = src.numel();
  if (n == 0) return;
  Launch l(dst);
  const bool acc = beta != 0;
  UNETCU_DISPATCH_STORAGE(src.dtype(), S, {
    UNETCU_DISPATCH_STORAGE(dst.dtype(), D, {
      if (src.format() == dst.format())
        convert_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(src.data<S>(), dst.data<D>(), n, acc);
      else
        convert_layout_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(
            src.data<S>(), src.dims4(), dst.data<D>(), dst.dims4(), n, acc);
    });
  });
  CUDA_CHECK_LAUNCH(l.stream, "convert");
}

}  // namespace unetcu::kernels::cuda
