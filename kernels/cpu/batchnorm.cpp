// CPU batch normalisation over kernels/bodies/batchnorm.h, plain and fused with the residual
// add and ReLU. Sums are accumulated in double whatever the tensor dtype. The training
// statistics take one pass of shifted sums (bodies/batchnorm.h) over each (n, c) plane in
// parallel, the plane sums then combined per channel in n order, so the result does not depend
// on the thread count. Loops run per (n, c) plane: no index division inside them.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/bodies/batchnorm.h"
#include "kernels/launchers.h"
#include "kernels/cpu/parallel.h"
#include "kernels/bodies/elementwise.h"

namespace unetcu::kernels::cpu {
namespace {

struct Dims {
  int64_t N, C, HW;
};
Dims dims_of(const TensorRef& x) { return {x.dim(0), x.dim(1), x.dim(2) * x.dim(3)}; }

// parallel_for's grain for a loop over the N*C planes: a thread team only when the tensor is
// large enough to pay for it.
int64_t plane_grain(Dims d) { return d.N * d.C * d.HW >= kParallelGrain ? 1 : d.N * d.C + 1; }

// Shifted sums of one plane of HW values. Four accumulator lanes keep the adds pipelined (and
// let the compiler use vector registers); they are combined in a fixed order.
template <class T>
void plane_stats(const T* p, int64_t HW, double shift, double* s1, double* s2) {
  double a[4] = {0, 0, 0, 0}, b[4] = {0, 0, 0, 0};
  int64_t q = 0;
  for (; q + 4 <= HW; q += 4)
    for (int l = 0; l < 4; ++l) bn_stats_accumulate(p[q + l], shift, a[l], b[l]);
  for (; q < HW; ++q) bn_stats_accumulate(p[q], shift, a[0], b[0]);
  *s1 = (a[0] + a[1]) + (a[2] + a[3]);
  *s2 = (b[0] + b[1]) + (b[2] + b[3]);
}

// Training statistics: mean and invstd [C] written, running statistics updated (PyTorch:
// momentum, unbiased variance for running_var).
template <class T>
void stats(const T* x, Dims d, double momentum, double eps, T* mean, T* invstd, T* run_mean,
           T* run_var) {
  std::vector<double> part(size_t(2 * d.N * d.C));  // [N*C][s1, s2]
  parallel_for(d.N * d.C, [&](int64_t nc) {
    const int64_t c = nc % d.C;
    plane_stats(x + nc * d.HW, d.HW, double(x[c * d.HW]), &part[2 * nc], &part[2 * nc + 1]);
  }, plane_grain(d));
  const double M = double(d.N * d.HW);
  for (int64_t c = 0; c < d.C; ++c) {
    double s1 = 0, s2 = 0;
    for (int64_t n = 0; n < d.N; ++n) {
      s1 += part[2 * (n * d.C + c)];
      s2 += part[2 * (n * d.C + c) + 1];
    }
    double mu, var;  // var biased: used to normalise
    bn_stats_finish(s1, s2, M, double(x[c * d.HW]), mu, var);
    mean[c] = T(mu);
    invstd[c] = T(1.0 / std::sqrt(var + eps));
    run_mean[c] = bn_running_update(run_mean[c], T(mu), T(momentum));
    run_var[c] = bn_running_update(run_var[c], T(var * M / (M - 1)), T(momentum));
  }
}

template <class T>
void forward_train(const T* x, const T* gamma, const T* beta, T* y, T* save_mean, T* save_invstd,
                   T* run_mean, T* run_var, double momentum, double eps, Dims d) {
  stats(x, d, momentum, eps, save_mean, save_invstd, run_mean, run_var);
  parallel_for(d.N * d.C, [&](int64_t nc) {
    const int64_t c = nc % d.C;
    const T m = save_mean[c], is = save_invstd[c], gm = gamma[c], bt = beta[c];
    const T* p = x + nc * d.HW;
    T* o = y + nc * d.HW;
    for (int64_t q = 0; q < d.HW; ++q) o[q] = bn_normalize(p[q], m, is, gm, bt);
  }, plane_grain(d));
}

template <class T>
void forward_eval(const T* x, const T* gamma, const T* beta, const T* run_mean, const T* run_var,
                  double eps, T* y, Dims d) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t n = 0; n < d.N; ++n)
    for (int64_t c = 0; c < d.C; ++c) {
      const T is = T(1.0 / std::sqrt(double(run_var[c]) + eps));
      const T* p = x + (n * d.C + c) * d.HW;
      T* o = y + (n * d.C + c) * d.HW;
      for (int64_t q = 0; q < d.HW; ++q) o[q] = bn_normalize(p[q], run_mean[c], is, gamma[c], beta[c]);
    }
}

template <class T>
void backward(const T* gy, const T* x, const T* gamma, const T* mean, const T* invstd,
              bool training, T* gx, T beta_x, T* ggamma, T beta_gamma, T* gbeta, T beta_beta,
              Dims d) {
  const double M = double(d.N * d.HW);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < d.C; ++c) {
    const T m = mean[c], is = invstd[c];
    double sum_dy = 0, sum_dy_xhat = 0;
    for (int64_t n = 0; n < d.N; ++n) {
      const T* g = gy + (n * d.C + c) * d.HW;
      const T* p = x + (n * d.C + c) * d.HW;
      for (int64_t q = 0; q < d.HW; ++q) {
        sum_dy += g[q];
        sum_dy_xhat += double(g[q]) * double((p[q] - m) * is);
      }
    }
    if (ggamma) store(ggamma + c, T(sum_dy_xhat), beta_gamma);
    if (gbeta) store(gbeta + c, T(sum_dy), beta_beta);
    if (!gx) continue;
    const T gi = gamma[c] * is, inv_m = T(1.0 / M), sdy = T(sum_dy), sdx = T(sum_dy_xhat);
    for (int64_t n = 0; n < d.N; ++n) {
      const T* g = gy + (n * d.C + c) * d.HW;
      const T* p = x + (n * d.C + c) * d.HW;
      T* o = gx + (n * d.C + c) * d.HW;
      if (training) {
        for (int64_t q = 0; q < d.HW; ++q)
          store(o + q, bn_backward_train(g[q], (p[q] - m) * is, gi, inv_m, sdy, sdx), beta_x);
      } else {
        for (int64_t q = 0; q < d.HW; ++q) store(o + q, g[q] * gi, beta_x);
      }
    }
  }
}

}  // namespace

void batchnorm_forward_train(const TensorRef& x, const TensorRef& gamma, const TensorRef& beta,
                             const TensorRef& y, const TensorRef& save_mean,
                             const TensorRef& save_invstd, const TensorRef& running_mean,
                             const TensorRef& running_var, double momentum, double eps) {
  UNETCU_DISPATCH_FLOAT(x.dtype(), T,
                        forward_train<T>(x.data<T>(), gamma.data<T>(), beta.data<T>(), y.data<T>(),
                                         save_mean.data<T>(), save_invstd.data<T>(),
                                         running_mean.data<T>(), running_var.data<T>(), momentum,
                                         eps, dims_of(x)));
}

void batchnorm_forward_eval(const TensorRef& x, const TensorRef& gamma, const TensorRef& beta,
                            const TensorRef& running_mean, const TensorRef& running_var, double eps,
                            const TensorRef& y) {
  UNETCU_DISPATCH_FLOAT(x.dtype(), T,
                        forward_eval<T>(x.data<T>(), gamma.data<T>(), beta.data<T>(),
                                        running_mean.data<T>(), running_var.data<T>(), eps,
                                        y.data<T>(), dims_of(x)));
}

void batchnorm_eval_stats(const TensorRef& running_mean, const TensorRef& running_var, double eps,
                          const TensorRef& mean, const TensorRef& invstd) {
  UNETCU_DISPATCH_FLOAT(running_mean.dtype(), T, {
    const T* rm = running_mean.data<T>();
    const T* rv = running_var.data<T>();
    T* m = mean.data<T>();
    T* is = invstd.data<T>();
    for (int64_t c = 0; c < mean.numel(); ++c) {
      m[c] = rm[c];
      is[c] = T(1.0 / std::sqrt(double(rv[c]) + eps));
    }
  });
}

void batchnorm_backward(const TensorRef& grad_y, const TensorRef& x, const TensorRef& gamma,
                        const TensorRef& mean, const TensorRef& invstd, bool training, double,
                        const TensorRef& grad_x, double beta_x, const TensorRef& grad_gamma,
                        double beta_gamma, const TensorRef& grad_beta, double beta_beta) {
  UNETCU_DISPATCH_FLOAT(
      x.dtype(), T,
      backward<T>(grad_y.data<T>(), x.data<T>(), gamma.data<T>(), mean.data<T>(), invstd.data<T>(),
                  training, grad_x.defined() ? grad_x.data<T>() : nullptr, T(beta_x),
                  grad_gamma.defined() ? grad_gamma.data<T>() : nullptr, T(beta_gamma),
                  grad_beta.defined() ? grad_beta.data<T>() : nullptr, T(beta_beta), dims_of(x)));
}

}  // namespace unetcu::kernels::cpu

// ---- synchronized batch norm (sums exchanged between replicas by the caller) ----------

namespace unetcu::kernels::cpu {
namespace {

template <class T>
void channel_sums(const T* x, Dims d, double* s) {
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < d.C; ++c) {
    double a = 0, b = 0;
    for (int64_t n = 0; n < d.N; ++n) {
      const T* p = x + (n * d.C + c) * d.HW;
      for (int64_t q = 0; q < d.HW; ++q) {
        a += p[q];
        b += double(p[q]) * p[q];
      }
    }
    s[c] = a;
    s[d.C + c] = b;
  }
}

template <class T>
void grad_sums(const T* gy, const T* x, const T* mean, const T* invstd, Dims d, double* s) {
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < d.C; ++c) {
    double a = 0, b = 0;
    for (int64_t n = 0; n < d.N; ++n) {
      const T* g = gy + (n * d.C + c) * d.HW;
      const T* p = x + (n * d.C + c) * d.HW;
      for (int64_t q = 0; q < d.HW; ++q) {
        a += g[q];
        b += double(g[q]) * double((p[q] - mean[c]) * invstd[c]);
      }
    }
    s[c] = a;
    s[d.C + c] = b;
  }
}

}  // namespace

void batchnorm_channel_sums(const TensorRef& x, const TensorRef& sums) {
  UNETCU_DISPATCH_FLOAT(x.dtype(), T, channel_sums(x.data<T>(), dims_of(x), sums.data<double>()));
}

void batchnorm_sync_stats(const TensorRef& sums, double count, double momentum, double eps,
                          const TensorRef& mean, const TensorRef& invstd,
                          const TensorRef& running_mean, const TensorRef& running_var) {
  const int64_t C = mean.numel();
  const double* s = sums.data<double>();
  UNETCU_DISPATCH_FLOAT(mean.dtype(), T, {
    T *m = mean.data<T>(), *is = invstd.data<T>();
    T *rm = running_mean.data<T>(), *rv = running_var.data<T>();
    for (int64_t c = 0; c < C; ++c) {
      const double mu = s[c] / count;
      const double var = std::max(0.0, s[C + c] / count - mu * mu);  // biased: normalises
      m[c] = T(mu);
      is[c] = T(1.0 / std::sqrt(var + eps));
      rm[c] = bn_running_update(rm[c], T(mu), T(momentum));
      rv[c] = bn_running_update(rv[c], T(var * count / (count - 1)), T(momentum));
    }
  });
}

void batchnorm_param_grads(const TensorRef& sums, const TensorRef& grad_gamma, double beta_gamma,
                           const TensorRef& grad_beta, double beta_beta) {
  const double* s = sums.data<double>();
  const int64_t C = sums.numel() / 2;
  // dgamma from the second half of the sums, dbeta from the first.
  auto store_sums = [C](const TensorRef& grad, const double* src, double beta) {
    if (!grad.defined()) return;
    UNETCU_DISPATCH_FLOAT(grad.dtype(), T, {
      T* d = grad.data<T>();
      for (int64_t c = 0; c < C; ++c) store(d + c, T(src[c]), T(beta));
    });
  };
  store_sums(grad_gamma, s + C, beta_gamma);
  store_sums(grad_beta, s, beta_beta);
}

void batchnorm_apply(const TensorRef& x, const TensorRef& gamma, const TensorRef& beta,
                     const TensorRef& mean, const TensorRef& invstd, const TensorRef& y) {
  const Dims d = dims_of(x);
  UNETCU_DISPATCH_FLOAT(x.dtype(), T, {
    const T *xp = x.data<T>(), *g = gamma.data<T>(), *b = beta.data<T>();
    const T *m = mean.data<T>(), *is = invstd.data<T>();
    T* yp = y.data<T>();
    parallel_for(d.N * d.C, [&](int64_t nc) {
      const int64_t c = nc % d.C;
      for (int64_t q = 0; q < d.HW; ++q)
        yp[nc * d.HW + q] = bn_normalize(xp[nc * d.HW + q], m[c], is[c], g[c], b[c]);
    }, 1);
  });
}

void batchnorm_grad_sums(const TensorRef& grad_y, const TensorRef& x, const TensorRef& mean,
                         const TensorRef& invstd, const TensorRef& sums) {
  UNETCU_DISPATCH_FLOAT(x.dtype(), T,
                        grad_sums(grad_y.data<T>(), x.data<T>(), mean.data<T>(), invstd.data<T>(),
                                  dims_of(x), sums.data<double>()));
}

void batchnorm_grad_apply(const TensorRef& grad_y, const TensorRef& x, const TensorRef& gamma,
                          const TensorRef& mean, const TensorRef& invstd,
                          const TensorRef& global_sums, double count, const TensorRef& grad_x,
                          double beta_x) {
  const Dims d = dims_of(x);
  const double* s = global_sums.data<double>();
  UNETCU_DISPATCH_FLOAT(x.dtype(), T, {
    const T *gy = grad_y.data<T>(), *xp = x.data<T>(), *g = gamma.data<T>();
    const T *m = mean.data<T>(), *is = invstd.data<T>();
    T* gx = grad_x.data<T>();
    const T inv_m = T(1.0 / count), bx = T(beta_x);
    parallel_for(d.N * d.C, [&](int64_t nc) {
      const int64_t c = nc % d.C;
      const T gi = g[c] * is[c], sdy = T(s[c]), sdx = T(s[d.C + c]);
      for (int64_t q = 0; q < d.HW; ++q) {
        const int64_t i = nc * d.HW + q;
        store(gx + i, bn_backward_train(gy[i], (xp[i] - m[c]) * is[c], gi, inv_m, sdy, sdx), bx);
      }
    }, 1);
  });
}

}  // namespace unetcu::kernels::cpu

// ---- fused batch norm + residual add + ReLU ----------------------------------------------

namespace unetcu::kernels::cpu {
namespace {

template <class T>
void add_relu_forward(const T* x, const T* gamma, const T* beta, const T* mean, const T* invstd,
                      const T* residual, T* y, Dims d) {
  parallel_for(d.N * d.C, [&](int64_t nc) {
    const int64_t c = nc % d.C;
    const T m = mean[c], is = invstd[c], gm = gamma[c], bt = beta[c];
    const T* p = x + nc * d.HW;
    T* o = y + nc * d.HW;
    if (residual) {
      const T* r = residual + nc * d.HW;
      for (int64_t q = 0; q < d.HW; ++q) o[q] = bn_add_relu_forward(p[q], m, is, gm, bt, r[q]);
    } else {
      for (int64_t q = 0; q < d.HW; ++q) o[q] = bn_relu_forward(p[q], m, is, gm, bt);
    }
  }, plane_grain(d));
}

// Sums of g and g * xhat over one plane of HW values. The terms are formed a block at a time
// in a loop of their own, which the compiler vectorises (the ReLU mask a blend: as a branch
// inside the summing loop it is mispredicted half the time), then added in double in eight
// lanes combined in a fixed order.
template <class T>
void plane_grad_sums(const T* gy, const T* y, const T* x, T mean, T invstd, int64_t HW,
                     double* sum_g, double* sum_g_xhat) {
  constexpr int kBlock = 256;
  T g[kBlock], xhat[kBlock];
  double a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t q0 = 0; q0 < HW; q0 += kBlock) {
    const int n = int(std::min<int64_t>(kBlock, HW - q0));
    for (int j = 0; j < n; ++j)
      bn_relu_grad_terms(gy[q0 + j], y[q0 + j], x[q0 + j], mean, invstd, g[j], xhat[j]);
    int j = 0;
    for (; j + 8 <= n; j += 8)
      for (int l = 0; l < 8; ++l) {
        a[l] += double(g[j + l]);
        b[l] += double(g[j + l]) * double(xhat[j + l]);
      }
    for (; j < n; ++j) {
      a[0] += double(g[j]);
      b[0] += double(g[j]) * double(xhat[j]);
    }
  }
  *sum_g = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  *sum_g_xhat = ((b[0] + b[1]) + (b[2] + b[3])) + ((b[4] + b[5]) + (b[6] + b[7]));
}

// Two passes over (dy, y, x): per-plane sums of g and g * xhat (g = dy masked by y > 0),
// combined per channel in n order; then dx and the residual's gradient in one pass.
template <class T>
void add_relu_backward(const T* gy, const T* y, const T* x, const T* gamma, const T* mean,
                       const T* invstd, bool training, T* gx, T beta_x, T* ggamma, T beta_gamma,
                       T* gbeta, T beta_beta, T* gr, T beta_r, Dims d) {
  const bool need_sums = ggamma || gbeta || (gx && training);
  std::vector<double> sums(size_t(2 * d.C), 0.0);  // [C][sum g, sum g * xhat]
  if (need_sums) {
    std::vector<double> part(size_t(2 * d.N * d.C));
    parallel_for(d.N * d.C, [&](int64_t nc) {
      const int64_t c = nc % d.C, o = nc * d.HW;
      plane_grad_sums(gy + o, y + o, x + o, mean[c], invstd[c], d.HW, &part[2 * nc],
                      &part[2 * nc + 1]);
    }, plane_grain(d));
    for (int64_t c = 0; c < d.C; ++c)
      for (int64_t n = 0; n < d.N; ++n) {
        sums[2 * c] += part[2 * (n * d.C + c)];
        sums[2 * c + 1] += part[2 * (n * d.C + c) + 1];
      }
  }
  for (int64_t c = 0; c < d.C; ++c) {
    if (ggamma) store(ggamma + c, T(sums[2 * c + 1]), beta_gamma);
    if (gbeta) store(gbeta + c, T(sums[2 * c]), beta_beta);
  }
  if (!gx && !gr) return;
  const T inv_m = T(1.0 / double(d.N * d.HW));
  parallel_for(d.N * d.C, [&](int64_t nc) {
    const int64_t c = nc % d.C, o = nc * d.HW;
    const T m = mean[c], is = invstd[c], gi = gamma[c] * is;
    const T sg = T(sums[2 * c]), sgx = T(sums[2 * c + 1]);
    if (gx)
      for (int64_t q = 0; q < d.HW; ++q)
        store(gx + o + q,
              bn_relu_backward_dx(gy[o + q], y[o + q], x[o + q], m, is, gi, inv_m, sg, sgx, training),
              beta_x);
    if (gr)
      for (int64_t q = 0; q < d.HW; ++q) store(gr + o + q, kernels::relu_backward(gy[o + q], y[o + q]), beta_r);
  }, plane_grain(d));
}

template <class T> T* data_or_null(const TensorRef& t) { return t.defined() ? t.data<T>() : nullptr; }

}  // namespace

void batchnorm_stats(const TensorRef& x, const TensorRef& mean, const TensorRef& invstd,
                     const TensorRef& running_mean, const TensorRef& running_var, double momentum,
                     double eps) {
  UNETCU_DISPATCH_FLOAT(x.dtype(), T,
                        stats<T>(x.data<T>(), dims_of(x), momentum, eps, mean.data<T>(),
                                 invstd.data<T>(), running_mean.data<T>(),
                                 running_var.data<T>()));
}

void batchnorm_add_relu_forward(const TensorRef& x, const TensorRef& gamma, const TensorRef& beta,
                                const TensorRef& mean, const TensorRef& invstd,
                                const TensorRef& residual, const TensorRef& y) {
  UNETCU_DISPATCH_FLOAT(x.dtype(), T,
                        add_relu_forward<T>(x.data<T>(), gamma.data<T>(), beta.data<T>(),
                                            mean.data<T>(), invstd.data<T>(),
                                            data_or_null<T>(residual), y.data<T>(), dims_of(x)));
}

void batchnorm_add_relu_backward(const TensorRef& grad_y, const TensorRef& y, const TensorRef& x,
                                 const TensorRef& gamma, const TensorRef& mean,
                                 const TensorRef& invstd, bool training, const TensorRef& grad_x,
                                 double beta_x, const TensorRef& grad_gamma, double beta_gamma,
                                 const TensorRef& grad_beta, double beta_beta,
                                 const TensorRef& grad_residual, double beta_residual) {
  UNETCU_DISPATCH_FLOAT(
      x.dtype(), T,
      add_relu_backward<T>(grad_y.data<T>(), y.data<T>(), x.data<T>(), gamma.data<T>(),
                           mean.data<T>(), invstd.data<T>(), training, data_or_null<T>(grad_x),
                           T(beta_x), data_or_null<T>(grad_gamma), T(beta_gamma),
                           data_or_null<T>(grad_beta), T(beta_beta),
                           data_or_null<T>(grad_residual), T(beta_residual), dims_of(x)));
}

}  // namespace unetcu::kernels::cpu
