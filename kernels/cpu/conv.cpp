// CPU convolution: im2col + GEMM (OpenBLAS). Samples are processed in groups so that deep
// layers with tiny planes still give the GEMM enough columns; the column buffer is bounded.
//   forward:  Y_g[O, g*HW]  = W[O, K] · col_g[K, g*HW]
//   backward: dW[O, K]     += dY_g · col_gᵀ      (accumulates over groups; beta_w for the first)
//             dcol[K, g*HW] = Wᵀ · dY_g,  col2im → dX
//             db[O]        += Σ dY
// The column matrix is rebuilt from x in backward instead of being saved.
#include <algorithm>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/launchers.h"
#include "kernels/elementwise.h"

namespace unetcu::kernels::cpu {
namespace {

constexpr int64_t kMinGemmColumns = 4096;
constexpr int64_t kMaxColumnElements = int64_t(1) << 24;  // 64 MB of float32

int64_t group_size(const ConvGeometry& g) {
  const int64_t K = g.C * g.kh * g.kw, HW = g.OH * g.OW;
  int64_t group = std::clamp<int64_t>((kMinGemmColumns + HW - 1) / HW, 1, g.N);
  while (group > 1 && group * K * HW > kMaxColumnElements) --group;
  return group;
}

bool is_pointwise(const ConvGeometry& g) {
  return g.kh == 1 && g.kw == 1 && g.sh == 1 && g.sw == 1 && g.ph == 0 && g.pw == 0;
}

// col[K, gs*HW] from samples [n0, n0+gs) of x.
template <class T>
void im2col(const T* x, int64_t n0, int64_t gs, const ConvGeometry& g, T* col) {
  const int64_t K = g.C * g.kh * g.kw, HW = g.OH * g.OW, cols = gs * HW;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < K; ++row) {
    const int64_t j = row % g.kw, i = (row / g.kw) % g.kh, c = row / (g.kw * g.kh);
    T* out = col + row * cols;
    for (int64_t s = 0; s < gs; ++s) {
      const T* plane = x + ((n0 + s) * g.C + c) * g.H * g.W;
      for (int64_t oh = 0; oh < g.OH; ++oh) {
        T* o = out + s * HW + oh * g.OW;
        const int64_t ih = oh * g.sh - g.ph + i;
        if (ih < 0 || ih >= g.H) {
          std::fill(o, o + g.OW, T(0));
          continue;
        }
        const T* src = plane + ih * g.W;
        for (int64_t ow = 0; ow < g.OW; ++ow) {
          const int64_t iw = ow * g.sw - g.pw + j;
          o[ow] = (iw >= 0 && iw < g.W) ? src[iw] : T(0);
        }
      }
    }
  }
}

// dx[samples n0..n0+gs) += col2im(dcol). Each thread owns whole input channels: no races.
template <class T>
void col2im_add(const T* dcol, int64_t n0, int64_t gs, const ConvGeometry& g, T* dx) {
  const int64_t HW = g.OH * g.OW, cols = gs * HW;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < g.C; ++c) {
    for (int64_t i = 0; i < g.kh; ++i)
      for (int64_t j = 0; j < g.kw; ++j) {
        const T* in = dcol + ((c * g.kh + i) * g.kw + j) * cols;
        for (int64_t s = 0; s < gs; ++s) {
          T* plane = dx + ((n0 + s) * g.C + c) * g.H * g.W;
          for (int64_t oh = 0; oh < g.OH; ++oh) {
            const int64_t ih = oh * g.sh - g.ph + i;
            if (ih < 0 || ih >= g.H) continue;
            const T* src = in + s * HW + oh * g.OW;
            T* dst = plane + ih * g.W;
            for (int64_t ow = 0; ow < g.OW; ++ow) {
              const int64_t iw = ow * g.sw - g.pw + j;
              if (iw >= 0 && iw < g.W) dst[iw] += src[ow];
            }
          }
        }
      }
  }
}

// tmp[O, gs*HW] <-> y[n0+s][O][HW]
template <class T>
void scatter_group(const T* tmp, int64_t n0, int64_t gs, int64_t O, int64_t HW, T* y) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t s = 0; s < gs; ++s)
    for (int64_t o = 0; o < O; ++o)
      std::copy(tmp + o * gs * HW + s * HW, tmp + o * gs * HW + (s + 1) * HW,
                y + ((n0 + s) * O + o) * HW);
}
template <class T>
void gather_group(const T* y, int64_t n0, int64_t gs, int64_t O, int64_t HW, T* tmp) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t s = 0; s < gs; ++s)
    for (int64_t o = 0; o < O; ++o)
      std::copy(y + ((n0 + s) * O + o) * HW, y + ((n0 + s) * O + o + 1) * HW,
                tmp + o * gs * HW + s * HW);
}

template <class T>
void forward_impl(const T* x, const T* w, const T* b, T* y, const ConvGeometry& g) {
  const int64_t K = g.C * g.kh * g.kw, HW = g.OH * g.OW;
  const int64_t group = group_size(g);
  // A 1×1/stride 1 conv over single samples needs no column matrix: x_n is already [C, HW].
  const bool direct = is_pointwise(g) && group == 1;
  std::vector<T> col, tmp;
  if (!direct) col.resize(K * group * HW);
  if (group > 1) tmp.resize(g.O * group * HW);
  for (int64_t n0 = 0; n0 < g.N; n0 += group) {
    const int64_t gs = std::min(group, g.N - n0), cols = gs * HW;
    const T* colp = col.data();
    if (direct)
      colp = x + n0 * g.C * g.H * g.W;
    else
      im2col(x, n0, gs, g, col.data());
    T* out = gs == 1 ? y + n0 * g.O * HW : tmp.data();
    gemm(false, false, int(g.O), int(cols), int(K), T(1), w, int(K), colp, int(cols), T(0), out,
         int(cols));
    if (gs > 1) scatter_group(tmp.data(), n0, gs, g.O, HW, y);
  }
  if (b) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t n = 0; n < g.N; ++n)
      for (int64_t o = 0; o < g.O; ++o) {
        T* p = y + (n * g.O + o) * HW;
        for (int64_t q = 0; q < HW; ++q) p[q] += b[o];
      }
  }
}

template <class T>
void backward_impl(const T* gy, const T* x, const T* w, T* gx, T beta_x, T* gw, T beta_w, T* gb,
                   T beta_b, const ConvGeometry& g) {
  const int64_t K = g.C * g.kh * g.kw, HW = g.OH * g.OW;
  if (gb) {
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < g.O; ++o) {
      double acc = 0;
      for (int64_t n = 0; n < g.N; ++n) {
        const T* p = gy + (n * g.O + o) * HW;
        for (int64_t q = 0; q < HW; ++q) acc += p[q];
      }
      store(gb + o, T(acc), beta_b);
    }
  }
  if (!gx && !gw) return;
  const int64_t group = group_size(g);
  const bool direct = is_pointwise(g) && group == 1;
  if (gx && beta_x == T(0) && !direct) std::fill(gx, gx + g.N * g.C * g.H * g.W, T(0));
  std::vector<T> col, tmp;
  if (!direct) col.resize(K * group * HW);
  if (group > 1) tmp.resize(g.O * group * HW);
  bool first_w = true;
  for (int64_t n0 = 0; n0 < g.N; n0 += group) {
    const int64_t gs = std::min(group, g.N - n0), cols = gs * HW;
    const T* dyg = gy + n0 * g.O * HW;
    if (gs > 1) {
      gather_group(gy, n0, gs, g.O, HW, tmp.data());
      dyg = tmp.data();
    }
    if (gw) {
      const T* colp = col.data();
      if (direct)
        colp = x + n0 * g.C * g.H * g.W;
      else
        im2col(x, n0, gs, g, col.data());
      gemm(false, true, int(g.O), int(K), int(cols), T(1), dyg, int(cols), colp, int(cols),
           first_w ? beta_w : T(1), gw, int(K));
      first_w = false;
    }
    if (gx) {
      if (direct) {
        // dX_n[C, HW] = Wᵀ · dY_n, written (or accumulated) straight into dx.
        gemm(true, false, int(K), int(cols), int(g.O), T(1), w, int(K), dyg, int(cols), beta_x,
             gx + n0 * g.C * HW, int(cols));
      } else {
        gemm(true, false, int(K), int(cols), int(g.O), T(1), w, int(K), dyg, int(cols), T(0),
             col.data(), int(cols));
        col2im_add(col.data(), n0, gs, g, gx);
      }
    }
  }
}

}  // namespace

void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y,
                    const ConvGeometry& g) {
  UNETCU_DISPATCH_FLOAT(x.dtype(), T, forward_impl<T>(x.data<T>(), w.data<T>(),
                                                      b.defined() ? b.data<T>() : nullptr,
                                                      y.data<T>(), g));
}

void conv2d_backward(const Tensor& grad_y, const Tensor& x, const Tensor& w, Tensor* grad_x,
                     double beta_x, Tensor* grad_w, double beta_w, Tensor* grad_b, double beta_b,
                     const ConvGeometry& g) {
  UNETCU_DISPATCH_FLOAT(x.dtype(), T,
                        backward_impl<T>(grad_y.data<T>(), x.data<T>(), w.data<T>(),
                                         grad_x ? grad_x->data<T>() : nullptr, T(beta_x),
                                         grad_w ? grad_w->data<T>() : nullptr, T(beta_w),
                                         grad_b ? grad_b->data<T>() : nullptr, T(beta_b), g));
}

}  // namespace unetcu::kernels::cpu
