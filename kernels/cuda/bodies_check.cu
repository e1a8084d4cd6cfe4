// Compiles every shared math body of bodies/*.h for the device, so a body that nvcc cannot
// take (a host-only call, a missing HD) fails the build here rather than in the CUDA backend.
// The kernel is never launched.
#include "bodies/batchnorm.h"
#include "bodies/conv.h"
#include "bodies/elementwise.h"
#include "bodies/loss.h"
#include "bodies/optim.h"
#include "bodies/pool.h"
#include "bodies/resample.h"

namespace unetcu::kernels {

template <class T>
__global__ void bodies_check(T* out, const T* in, AdamCoeffs<T> adam, SgdStep sgd,
                             PoolGeometry pool) {
  const T x = in[threadIdx.x];
  T acc = relu_forward(x) + relu_backward(x, x) + sigmoid_forward(x) + sigmoid_backward(x, x);
  acc += bce_with_logits(x, T(1)) + bce_with_logits_grad(x, T(0));
  acc += dice_grad_logit(x, T(1), T(2), T(3), T(1));
  acc += bn_normalize(x, T(0), T(1), T(1), T(0)) + bn_backward_train(x, x, T(1), T(1), T(0), T(0));
  acc += bn_running_update(x, x, T(0.1));
  acc += bn_relu_grad<ReluMask::from_x, T>(x, x, x, T(0), T(1), T(1), T(0)) +
         bn_relu_grad<ReluMask::stored_y, T>(x, x, x, T(0), T(1), T(1), T(0));
  acc += T(maxpool_argmax(in, pool, 0, 0)) + T(upsample2x_source(1, 1, 4));
  acc += T(window_out_size(8, 3, 2, 1, 1));
  T p = x, m = 0, v = 0, buf = 0;
  adam_update(&p, x, &m, &v, adam);
  sgd_update(&p, x, &buf, sgd);
  store(out + threadIdx.x, acc + p, T(0));
}

template __global__ void bodies_check<float>(float*, const float*, AdamCoeffs<float>, SgdStep,
                                             PoolGeometry);
template __global__ void bodies_check<double>(double*, const double*, AdamCoeffs<double>,
                                              SgdStep, PoolGeometry);

}  // namespace unetcu::kernels
