// CUDA launcher of convert: dtype and memory-format changes, over the body the CPU runs
// (bodies/convert.h).
#include "kernels/cuda/common.cuh"
#include "bodies/convert.h"
#include "bodies/layout.h"
#include "kernels/launchers.h"

namespace unetcu::kernels::cuda {
namespace {

template <class S, class D>
__global__ void convert_kernel(const S* s, D* d, int64_t n, bool acc) {
  GRID_STRIDE(i, n) convert_one(s + i, d + i, acc);
}

// Walks the destination in memory order; reads the source through its own layout.
// Index type I: 32-bit with dividers where the tensor allows (bodies/divide.h).
template <class S, class D, class I>
__global__ void convert_layout_kernel(const S* s, Dims4Div<I> ds, D* d, Dims4Div<I> dd, I n, bool acc) {
  GRID_STRIDE_I(I, i, n) {
    I nn, c, h, w;
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
        with_index_type(n, [&](auto index) {
          using I = decltype(index);
          convert_layout_kernel<S, D, I><<<blocks_for(n), kThreads, 0, l.stream>>>(
              src.data<S>(), Dims4Div<I>(src.dims4()), dst.data<D>(), Dims4Div<I>(dst.dims4()), I(n), acc);
        });
    });
  });
  CUDA_CHECK_LAUNCH(l.stream, "convert");
}

}  // namespace unetcu::kernels::cuda
