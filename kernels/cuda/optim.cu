// CUDA optimizer updates over kernels/bodies/optim.h (the bodies the CPU backend runs).
#include "kernels/cuda/common.cuh"
#include "kernels/launchers.h"
#include "kernels/bodies/optim.h"

namespace unetcu::kernels::cuda {
namespace {

__global__ void adam_kernel(float* p, const float* g, float* m, float* v, AdamCoeffs<float> c,
                            int64_t n) {
  GRID_STRIDE(i, n) adam_update(p + i, g[i], m + i, v + i, c);
}

__global__ void sgd_kernel(float* p, const float* g, float* buf, SgdStep s, int64_t n) {
  GRID_STRIDE(i, n) sgd_update(p + i, g[i], buf + i, s);
}

}  // namespace

void adam_update(const TensorRef& p, const TensorRef& g, const TensorRef& m, const TensorRef& v,
                 const AdamStep& s) {
  const int64_t n = p.numel();
  Launch l(p);
  adam_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(fdata(p), fdata(g), fdata(m), fdata(v),
                                                        AdamCoeffs<float>(s), n);
  CUDA_CHECK_LAUNCH(l.stream, "adam_update");
}

void sgd_update(const TensorRef& p, const TensorRef& g, const TensorRef& buf, const SgdStep& s) {
  const int64_t n = p.numel();
  Launch l(p);
  sgd_kernel<<<blocks_for(n), kThreads, 0, l.stream>>>(fdata(p), fdata(g), fdata(buf), s, n);
  CUDA_CHECK_LAUNCH(l.stream, "sgd_update");
}

}  // namespace unetcu::kernels::cuda
