// CPU batch normalisation over kernels/bodies/batchnorm.h. One OpenMP task per channel; sums are
// accumulated in double whatever the tensor dtype, two passes (mean, then variance).
#include <algorithm>
#include <cmath>

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

template <class T>
void forward_train(const T* x, const T* gamma, const T* beta, T* y, T* save_mean, T* save_invstd,
                   T* run_mean, T* run_var, double momentum, double eps, Dims d) {
  const double M = double(d.N * d.HW);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < d.C; ++c) {
    double sum = 0;
    for (int64_t n = 0; n < d.N; ++n) {
      const T* p = x + (n * d.C + c) * d.HW;
      for (int64_t q = 0; q < d.HW; ++q) sum += p[q];
    }
    const double mean = sum / M;
    double sq = 0;
    for (int64_t n = 0; n < d.N; ++n) {
      const T* p = x + (n * d.C + c) * d.HW;
      for (int64_t q = 0; q < d.HW; ++q) {
        const double t = p[q] - mean;
        sq += t * t;
      }
    }
    const double var = sq / M;  // biased: used to normalise
    const double invstd = 1.0 / std::sqrt(var + eps);
    save_mean[c] = T(mean);
    save_invstd[c] = T(invstd);
    run_mean[c] = bn_running_update(run_mean[c], T(mean), T(momentum));
    run_var[c] = bn_running_update(run_var[c], T(var * M / (M - 1)), T(momentum));
    const T m = T(mean), is = T(invstd), gm = gamma[c], bt = beta[c];
    for (int64_t n = 0; n < d.N; ++n) {
      const T* p = x + (n * d.C + c) * d.HW;
      T* o = y + (n * d.C + c) * d.HW;
      for (int64_t q = 0; q < d.HW; ++q) o[q] = bn_normalize(p[q], m, is, gm, bt);
    }
  }
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
