// CPU batch normalisation over bodies/batchnorm.h, plain and fused with the residual
// add and ReLU, for activations stored as float32, float64 or bfloat16 (S) in NCHW or NHWC;
// the per-channel tensors and all arithmetic are in T = acc_t<S> (float for bf16), and the sums
// of a channel are double whatever S is.
//
// Per-channel reductions (the training statistics, the backward's sums) are split into chunks
// summed in parallel and then combined per channel in chunk order: NCHW chunks are the (n, c)
// planes of H*W values, combined in n order; NHWC chunks are runs of whole pixels (all C
// channels of each), one partial per (chunk, channel), combined in chunk order. The chunks
// depend on the shape only, so the result does not depend on the thread count. Elementwise
// passes run per plane (NCHW: the channel fixed, its constants in registers) or per pixel
// (NHWC: the channel innermost, its constants loaded as vectors). No index division in an inner
// loop.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "bodies/batchnorm.h"
#include "kernels/launchers.h"
#include "kernels/cpu/parallel.h"
#include "bodies/elementwise.h"

namespace unetcu::kernels::cpu {
namespace {

using Geo = BnGeometry;  // bodies/batchnorm.h
Geo geo_of(const TensorRef& x) { return {x.dim(0), x.dim(1), x.dim(2) * x.dim(3), x.nhwc()}; }

// parallel_for's grain for a loop of `iterations` over the whole tensor: a thread team only
// when the tensor is large enough to pay for it.
int64_t grain_for(const Geo& d, int64_t iterations) {
  return d.numel() >= kParallelGrain ? 1 : iterations + 1;
}

// Values per NHWC reduction chunk (whole pixels): big enough that the partials are few
// (numel / 4096 of them), small enough for many chunks per thread.
constexpr int64_t kChunkValues = 4096;

template <class T> T* data_or_null(const TensorRef& t) { return t.defined() ? t.data<T>() : nullptr; }

template <class T> struct NormConsts {
  T mean, invstd, gamma, beta;
};

// ---- drivers -----------------------------------------------------------------------------

// Per-channel sums of two terms: out[c] and out[C + c] ([2, C], the layout of the synchronized
// sums). plane(base, c, &s1, &s2) sums the HW values of one NCHW plane starting at memory
// index base; row(base, a, b) adds the terms of the C values of one NHWC pixel starting at
// base into a[0..C) and b[0..C).
template <class PlaneFn, class RowFn>
void channel_sums2(const Geo& d, PlaneFn&& plane, RowFn&& row, double* out) {
  const int64_t C = d.C;
  std::fill(out, out + 2 * C, 0.0);
  if (!d.nhwc) {
    std::vector<double> part(size_t(2 * d.N * C));  // [N*C][s1, s2]
    parallel_for(d.N * C, [&](int64_t nc) {
      plane(nc * d.HW, nc % C, &part[2 * nc], &part[2 * nc + 1]);
    }, grain_for(d, d.N * C));
    for (int64_t n = 0; n < d.N; ++n)
      for (int64_t c = 0; c < C; ++c) {
        out[c] += part[2 * (n * C + c)];
        out[C + c] += part[2 * (n * C + c) + 1];
      }
    return;
  }
  const int64_t P = d.pixels();
  const int64_t chunk = std::max<int64_t>(1, kChunkValues / C);
  const int64_t K = (P + chunk - 1) / chunk;
  std::vector<double> part(size_t(2 * K * C));  // [K][2][C]
  parallel_for(K, [&](int64_t k) {
    double* a = &part[size_t(2 * k * C)];
    double* b = a + C;
    std::fill(a, a + 2 * C, 0.0);
    const int64_t p1 = std::min(P, (k + 1) * chunk);
    for (int64_t p = k * chunk; p < p1; ++p) row(p * C, a, b);
  }, grain_for(d, K));
  for (int64_t k = 0; k < K; ++k) {
    const double* a = &part[size_t(2 * k * C)];
    for (int64_t c = 0; c < 2 * C; ++c) out[c] += a[c];
  }
}

// Calls elem(chan(c), i) for every element i (memory index) of channel c. NCHW: per plane,
// chan(c) once; NHWC: per pixel, the channel innermost.
template <class ChanFn, class ElemFn>
void for_each_element(const Geo& d, ChanFn&& chan, ElemFn&& elem) {
  if (!d.nhwc) {
    parallel_for(d.N * d.C, [&](int64_t nc) {
      const auto k = chan(nc % d.C);
      const int64_t base = nc * d.HW;
      for (int64_t q = 0; q < d.HW; ++q) elem(k, base + q);
    }, grain_for(d, d.N * d.C));
  } else {
    parallel_for(d.pixels(), [&](int64_t p) {
      const int64_t base = p * d.C;
      for (int64_t c = 0; c < d.C; ++c) elem(chan(c), base + c);
    }, grain_for(d, d.pixels()));
  }
}

// ---- reductions --------------------------------------------------------------------------

// Shifted sums of one NCHW plane of HW values. Four accumulator lanes keep the adds pipelined
// (and let the compiler use vector registers); they are combined in a fixed order.
template <class S>
void plane_stats(const S* p, int64_t HW, double shift, double* s1, double* s2) {
  using T = acc_t<S>;
  double a[4] = {0, 0, 0, 0}, b[4] = {0, 0, 0, 0};
  int64_t q = 0;
  for (; q + 4 <= HW; q += 4)
    for (int l = 0; l < 4; ++l) bn_stats_accumulate(T(p[q + l]), shift, a[l], b[l]);
  for (; q < HW; ++q) bn_stats_accumulate(T(p[q]), shift, a[0], b[0]);
  *s1 = (a[0] + a[1]) + (a[2] + a[3]);
  *s2 = (b[0] + b[1]) + (b[2] + b[3]);
}

// Per channel sum(x - shift[c]) and sum((x - shift[c])²), [2, C].
template <class S>
void shifted_sums(const S* x, const Geo& d, const double* shift, double* out) {
  using T = acc_t<S>;
  channel_sums2(
      d,
      [&](int64_t base, int64_t c, double* s1, double* s2) {
        plane_stats(x + base, d.HW, shift[c], s1, s2);
      },
      [&](int64_t base, double* __restrict a, double* __restrict b) {
        const S* r = x + base;
        for (int64_t c = 0; c < d.C; ++c) bn_stats_accumulate(T(r[c]), shift[c], a[c], b[c]);
      },
      out);
}

// Sums of g and g * xhat over one NCHW plane of HW values, g = bn_relu_grad<M>(dy, ...): dy,
// or dy where the fused op's output is positive (from y or recomputed from x). The terms are
// formed a block at a time in a loop of their own, which the compiler vectorises (the ReLU mask
// a blend: as a branch inside the summing loop it is mispredicted half the time), then added
// in double in eight lanes combined in a fixed order. y is read only with stored_y.
template <ReluMask M, class S>
void plane_grad_sums(const S* gy, const S* y, const S* x, NormConsts<acc_t<S>> k, int64_t HW,
                     double* sum_g, double* sum_g_xhat) {
  using T = acc_t<S>;
  constexpr int kBlock = 256;
  T g[kBlock], xhat[kBlock];
  double a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t q0 = 0; q0 < HW; q0 += kBlock) {
    const int n = int(std::min<int64_t>(kBlock, HW - q0));
    for (int j = 0; j < n; ++j) {
      const T xv = T(x[q0 + j]);
      const T yv = M == ReluMask::stored_y ? T(y[q0 + j]) : T(0);
      g[j] = bn_relu_grad<M, S>(T(gy[q0 + j]), yv, xv, k.mean, k.invstd, k.gamma, k.beta);
      xhat[j] = (xv - k.mean) * k.invstd;
    }
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

// Per channel sum(g) and sum(g * xhat), [2, C]; g = bn_relu_grad<M>(dy, ...). gamma and beta
// are read only with from_x (absent otherwise), y only with stored_y.
template <ReluMask M, class S>
void grad_sums(const S* gy, const S* y, const S* x, const acc_t<S>* mean, const acc_t<S>* invstd,
               const acc_t<S>* gamma, const acc_t<S>* beta, const Geo& d, double* out) {
  using T = acc_t<S>;
  constexpr bool kAffine = M == ReluMask::from_x;
  channel_sums2(
      d,
      [&](int64_t base, int64_t c, double* s1, double* s2) {
        const NormConsts<T> k{mean[c], invstd[c], kAffine ? gamma[c] : T(0),
                              kAffine ? beta[c] : T(0)};
        plane_grad_sums<M>(gy + base, M == ReluMask::stored_y ? y + base : nullptr, x + base, k,
                           d.HW, s1, s2);
      },
      [&](int64_t base, double* __restrict a, double* __restrict b) {
        // As plane_grad_sums: the terms of a block of channels first (vectorised, the mask a
        // blend), then added in double.
        constexpr int64_t kBlock = 256;
        T g[kBlock], xhat[kBlock];
        const S *g_row = gy + base, *x_row = x + base;
        const S* y_row = M == ReluMask::stored_y ? y + base : nullptr;
        for (int64_t c0 = 0; c0 < d.C; c0 += kBlock) {
          const int64_t n = std::min(kBlock, d.C - c0);
          for (int64_t j = 0; j < n; ++j) {
            const int64_t c = c0 + j;
            const T xv = T(x_row[c]);
            const T yv = M == ReluMask::stored_y ? T(y_row[c]) : T(0);
            g[j] = bn_relu_grad<M, S>(T(g_row[c]), yv, xv, mean[c], invstd[c],
                                      kAffine ? gamma[c] : T(0), kAffine ? beta[c] : T(0));
            xhat[j] = (xv - mean[c]) * invstd[c];
          }
          for (int64_t j = 0; j < n; ++j) {
            a[c0 + j] += double(g[j]);
            b[c0 + j] += double(g[j]) * double(xhat[j]);
          }
        }
      },
      out);
}

// ---- training statistics -----------------------------------------------------------------

// mean and invstd [C] written, running statistics updated (PyTorch: momentum, unbiased
// variance for running_var). Shifted sums (bodies/batchnorm.h), the shift the channel's first
// element.
template <class S>
void stats(const S* x, const Geo& d, double momentum, double eps, acc_t<S>* mean,
           acc_t<S>* invstd, acc_t<S>* run_mean, acc_t<S>* run_var) {
  using T = acc_t<S>;
  std::vector<double> shift(size_t(d.C)), sums(size_t(2 * d.C));
  for (int64_t c = 0; c < d.C; ++c) shift[c] = double(T(x[d.first_of(c)]));
  shifted_sums(x, d, shift.data(), sums.data());
  const double M = double(d.pixels());
  for (int64_t c = 0; c < d.C; ++c) {
    double mu, var;  // var biased: used to normalise
    bn_stats_finish(sums[c], sums[d.C + c], M, shift[c], mu, var);
    mean[c] = T(mu);
    invstd[c] = T(1.0 / std::sqrt(var + eps));
    run_mean[c] = bn_running_update(run_mean[c], T(mu), T(momentum));
    run_var[c] = bn_running_update(run_var[c], T(var * M / (M - 1)), T(momentum));
  }
}

// ---- elementwise passes ------------------------------------------------------------------

// y = bn_normalize(x) with the given per-channel mean and invstd (batch or running).
template <class S>
void normalize(const S* x, const acc_t<S>* gamma, const acc_t<S>* beta, const acc_t<S>* mean,
               const acc_t<S>* invstd, S* y, const Geo& d) {
  using T = acc_t<S>;
  for_each_element(
      d, [&](int64_t c) { return NormConsts<T>{mean[c], invstd[c], gamma[c], beta[c]}; },
      [&](const NormConsts<T>& k, int64_t i) {
        y[i] = to_storage<S>(bn_normalize(T(x[i]), k.mean, k.invstd, k.gamma, k.beta));
      });
}

template <class S>
void forward_eval(const S* x, const acc_t<S>* gamma, const acc_t<S>* beta,
                  const acc_t<S>* run_mean, const acc_t<S>* run_var, double eps, S* y,
                  const Geo& d) {
  using T = acc_t<S>;
  std::vector<T> invstd(size_t(d.C));
  for (int64_t c = 0; c < d.C; ++c) invstd[c] = T(1.0 / std::sqrt(double(run_var[c]) + eps));
  normalize(x, gamma, beta, run_mean, invstd.data(), y, d);
}

// Values of a block of the backward's elementwise pass: formed into an array by a loop free
// of branches (which the compiler vectorises), then stored, written or accumulated.
constexpr int64_t kApplyBlock = 256;

// dst[k] = v[k] for k < n, written (beta 0) or added in the compute type and rounded once: as
// store() element by element, the beta test once per block.
template <class S>
void store_block(S* dst, const acc_t<S>* v, int64_t n, acc_t<S> beta) {
  using T = acc_t<S>;
  if (beta == T(0)) {
    for (int64_t k = 0; k < n; ++k) dst[k] = to_storage<S>(v[k]);
  } else {
    for (int64_t k = 0; k < n; ++k) dst[k] = to_storage<S>(T(dst[k]) + v[k]);
  }
}

template <ReluMask M, bool kTraining, class S>
void grad_apply_blocks(const S* gy, const S* y, const S* x, const acc_t<S>* mean,
                       const acc_t<S>* invstd, const acc_t<S>* gamma, const acc_t<S>* beta,
                       const acc_t<S>* gi, const acc_t<S>* sg, const acc_t<S>* sgx,
                       acc_t<S> inv_m, S* gx, acc_t<S> beta_x, S* gr, acc_t<S> beta_r,
                       const Geo& d) {
  using T = acc_t<S>;
  constexpr bool kAffine = M == ReluMask::from_x, kReadX = kTraining || kAffine;
  // The values of the n elements from memory index i0 on, channel chan(j) for the j-th.
  const auto block = [&](int64_t i0, int64_t n, auto chan) {
    T dx[kApplyBlock], dr[kApplyBlock];
    for (int64_t j = 0; j < n; ++j) {
      const int64_t c = chan(j), i = i0 + j;
      const T xv = kReadX ? T(x[i]) : T(0);
      const T yv = M == ReluMask::stored_y ? T(y[i]) : T(0);
      const T g = bn_relu_grad<M, S>(T(gy[i]), yv, xv, mean[c], invstd[c],
                                     kAffine ? gamma[c] : T(0), kAffine ? beta[c] : T(0));
      if constexpr (kTraining)
        dx[j] = bn_backward_train(g, (xv - mean[c]) * invstd[c], gi[c], inv_m, sg[c], sgx[c]);
      else
        dx[j] = g * gi[c];
      dr[j] = g;
    }
    if (gx) store_block(gx + i0, dx, n, beta_x);
    if (M != ReluMask::none && gr) store_block(gr + i0, dr, n, beta_r);
  };
  if (!d.nhwc) {  // per plane, the channel fixed
    parallel_for(d.N * d.C, [&](int64_t nc) {
      const int64_t c = nc % d.C;
      for (int64_t q0 = 0; q0 < d.HW; q0 += kApplyBlock)
        block(nc * d.HW + q0, std::min(kApplyBlock, d.HW - q0), [c](int64_t) { return c; });
    }, grain_for(d, d.N * d.C));
  } else {  // per pixel, the channel innermost
    parallel_for(d.pixels(), [&](int64_t p) {
      for (int64_t c0 = 0; c0 < d.C; c0 += kApplyBlock)
        block(p * d.C + c0, std::min(kApplyBlock, d.C - c0), [c0](int64_t j) { return c0 + j; });
    }, grain_for(d, d.pixels()));
  }
}

// dx (and, fused, the residual's gradient) from the channel sums [2, C] (absent where not
// needed). g = bn_relu_grad<M>(dy, ...), and gr = g.
template <ReluMask M, class S>
void grad_apply(const S* gy, const S* y, const S* x, const acc_t<S>* gamma, const acc_t<S>* beta,
                const acc_t<S>* mean, const acc_t<S>* invstd, const double* sums, double count,
                bool training, S* gx, acc_t<S> beta_x, S* gr, acc_t<S> beta_r, const Geo& d) {
  using T = acc_t<S>;
  const T inv_m = T(1.0 / count);
  // The per-channel constants once, in arrays (the NHWC loop loads them as vectors).
  std::vector<T> gi(size_t(d.C)), sg(size_t(d.C), T(0)), sgx(size_t(d.C), T(0));
  for (int64_t c = 0; c < d.C; ++c) {
    gi[c] = gamma[c] * invstd[c];
    if (sums) {
      sg[c] = T(sums[c]);
      sgx[c] = T(sums[d.C + c]);
    }
  }
  if (training)
    grad_apply_blocks<M, true>(gy, y, x, mean, invstd, gamma, beta, gi.data(), sg.data(),
                               sgx.data(), inv_m, gx, beta_x, gr, beta_r, d);
  else
    grad_apply_blocks<M, false>(gy, y, x, mean, invstd, gamma, beta, gi.data(), sg.data(),
                                sgx.data(), inv_m, gx, beta_x, gr, beta_r, d);
}

// dgamma = sum(g * xhat), dbeta = sum(g) from the sums [2, C]; each absent or written or
// accumulated by its beta.
template <class T>
void store_param_grads(const double* sums, int64_t C, T* ggamma, T beta_gamma, T* gbeta,
                       T beta_beta) {
  for (int64_t c = 0; c < C; ++c) {
    if (ggamma) store(ggamma + c, T(sums[C + c]), beta_gamma);
    if (gbeta) store(gbeta + c, T(sums[c]), beta_beta);
  }
}

// Backward of batch_norm2d (M none: y absent, g = dy) and of the fused op (g = dy where its
// output is positive, from y or from x, gamma and beta): one reduction pass for the sums when
// any gradient needs them, then one elementwise pass for dx (and the residual's gradient).
template <ReluMask M, class S>
void backward(const S* gy, const S* y, const S* x, const acc_t<S>* gamma, const acc_t<S>* beta,
              const acc_t<S>* mean, const acc_t<S>* invstd, bool training, S* gx,
              acc_t<S> beta_x, acc_t<S>* ggamma, acc_t<S> beta_gamma, acc_t<S>* gbeta,
              acc_t<S> beta_beta, S* gr, acc_t<S> beta_r, const Geo& d) {
  const bool need_sums = ggamma || gbeta || (gx && training);
  std::vector<double> sums;
  if (need_sums) {
    sums.resize(size_t(2 * d.C));
    grad_sums<M>(gy, y, x, mean, invstd, gamma, beta, d, sums.data());
    store_param_grads(sums.data(), d.C, ggamma, beta_gamma, gbeta, beta_beta);
  }
  if (!gx && !gr) return;
  grad_apply<M>(gy, y, x, gamma, beta, mean, invstd, need_sums ? sums.data() : nullptr,
                double(d.pixels()), training, gx, beta_x, gr, beta_r, d);
}

}  // namespace

void batchnorm_forward_train(const TensorRef& x, const TensorRef& gamma, const TensorRef& beta,
                             const TensorRef& y, const TensorRef& save_mean,
                             const TensorRef& save_invstd, const TensorRef& running_mean,
                             const TensorRef& running_var, double momentum, double eps) {
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    using T = acc_t<S>;
    const Geo d = geo_of(x);
    stats<S>(x.data<S>(), d, momentum, eps, save_mean.data<T>(), save_invstd.data<T>(),
             running_mean.data<T>(), running_var.data<T>());
    normalize<S>(x.data<S>(), gamma.data<T>(), beta.data<T>(), save_mean.data<T>(),
                 save_invstd.data<T>(), y.data<S>(), d);
  });
}

void batchnorm_forward_eval(const TensorRef& x, const TensorRef& gamma, const TensorRef& beta,
                            const TensorRef& running_mean, const TensorRef& running_var, double eps,
                            const TensorRef& y) {
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    using T = acc_t<S>;
    forward_eval<S>(x.data<S>(), gamma.data<T>(), beta.data<T>(), running_mean.data<T>(),
                    running_var.data<T>(), eps, y.data<S>(), geo_of(x));
  });
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
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    using T = acc_t<S>;
    backward<ReluMask::none, S>(grad_y.data<S>(), nullptr, x.data<S>(), gamma.data<T>(),
                                nullptr, mean.data<T>(), invstd.data<T>(), training,
                                data_or_null<S>(grad_x), T(beta_x), data_or_null<T>(grad_gamma),
                                T(beta_gamma), data_or_null<T>(grad_beta), T(beta_beta), nullptr,
                                T(0), geo_of(x));
  });
}

// ---- fused batch norm + (residual add) + ReLU --------------------------------------------

void batchnorm_stats(const TensorRef& x, const TensorRef& mean, const TensorRef& invstd,
                     const TensorRef& running_mean, const TensorRef& running_var, double momentum,
                     double eps) {
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    using T = acc_t<S>;
    stats<S>(x.data<S>(), geo_of(x), momentum, eps, mean.data<T>(), invstd.data<T>(),
             running_mean.data<T>(), running_var.data<T>());
  });
}

void batchnorm_add_relu_forward(const TensorRef& x, const TensorRef& gamma, const TensorRef& beta,
                                const TensorRef& mean, const TensorRef& invstd,
                                const TensorRef& residual, const TensorRef& y) {
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    using T = acc_t<S>;
    const S* xp = x.data<S>();
    const S* r = data_or_null<S>(residual);
    S* yp = y.data<S>();
    const T *g = gamma.data<T>(), *b = beta.data<T>(), *m = mean.data<T>(), *is = invstd.data<T>();
    const auto chan = [&](int64_t c) { return NormConsts<T>{m[c], is[c], g[c], b[c]}; };
    if (r)
      for_each_element(geo_of(x), chan, [&](const NormConsts<T>& k, int64_t i) {
        yp[i] = to_storage<S>(
            bn_add_relu_forward(T(xp[i]), k.mean, k.invstd, k.gamma, k.beta, T(r[i])));
      });
    else
      for_each_element(geo_of(x), chan, [&](const NormConsts<T>& k, int64_t i) {
        yp[i] = to_storage<S>(bn_relu_forward(T(xp[i]), k.mean, k.invstd, k.gamma, k.beta));
      });
  });
}

void batchnorm_add_relu_backward(const TensorRef& grad_y, const TensorRef& y, const TensorRef& x,
                                 const TensorRef& gamma, const TensorRef& beta,
                                 const TensorRef& mean, const TensorRef& invstd, bool training,
                                 const TensorRef& grad_x, double beta_x,
                                 const TensorRef& grad_gamma, double beta_gamma,
                                 const TensorRef& grad_beta, double beta_beta,
                                 const TensorRef& grad_residual, double beta_residual) {
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    using T = acc_t<S>;
    const auto run = [&](auto mask) {
      backward<decltype(mask)::value, S>(
          grad_y.data<S>(), data_or_null<S>(y), x.data<S>(), gamma.data<T>(), beta.data<T>(),
          mean.data<T>(), invstd.data<T>(), training, data_or_null<S>(grad_x), T(beta_x),
          data_or_null<T>(grad_gamma), T(beta_gamma), data_or_null<T>(grad_beta), T(beta_beta),
          data_or_null<S>(grad_residual), T(beta_residual), geo_of(x));
    };
    if (y.defined())
      run(std::integral_constant<ReluMask, ReluMask::stored_y>{});
    else
      run(std::integral_constant<ReluMask, ReluMask::from_x>{});
  });
}

// ---- synchronized batch norm (sums exchanged between replicas by the caller) ----------
//
// The sums are plain (sum x, sum x²: replicas would need one common shift), in double.

void batchnorm_channel_sums(const TensorRef& x, const TensorRef& sums) {
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    const std::vector<double> zero(size_t(x.dim(1)), 0.0);
    shifted_sums(x.data<S>(), geo_of(x), zero.data(), sums.data<double>());
  });
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
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    using T = acc_t<S>;
    normalize<S>(x.data<S>(), gamma.data<T>(), beta.data<T>(), mean.data<T>(), invstd.data<T>(),
                 y.data<S>(), geo_of(x));
  });
}

void batchnorm_grad_sums(const TensorRef& grad_y, const TensorRef& x, const TensorRef& mean,
                         const TensorRef& invstd, const TensorRef& sums) {
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    using T = acc_t<S>;
    grad_sums<ReluMask::none, S>(grad_y.data<S>(), nullptr, x.data<S>(), mean.data<T>(),
                                 invstd.data<T>(), nullptr, nullptr, geo_of(x),
                                 sums.data<double>());
  });
}

void batchnorm_grad_apply(const TensorRef& grad_y, const TensorRef& x, const TensorRef& gamma,
                          const TensorRef& mean, const TensorRef& invstd,
                          const TensorRef& global_sums, double count, const TensorRef& grad_x,
                          double beta_x) {
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    using T = acc_t<S>;
    grad_apply<ReluMask::none, S>(grad_y.data<S>(), nullptr, x.data<S>(), gamma.data<T>(),
                                  nullptr, mean.data<T>(), invstd.data<T>(),
                                  global_sums.data<double>(), count, true, grad_x.data<S>(),
                                  T(beta_x), nullptr, T(0), geo_of(x));
  });
}

}  // namespace unetcu::kernels::cpu
