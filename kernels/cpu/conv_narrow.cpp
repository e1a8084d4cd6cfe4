// Direct convolution for few output channels (conv_narrow.h). Work items are output rows
// (sample, row) shared out statically among the OpenMP threads. Input rows are copied into a
// zero-padded buffer in the compute type, so every tap is one unit-stride vector loop without
// bounds tests: NCHW rows are W + 2*pw values of one channel; NHWC rows are (W + 2*pw) * C
// values, where the kw taps of one kernel row read kw*C consecutive values.
#include "kernels/cpu/conv_narrow.h"

#include <omp.h>

#include <atomic>
#include <vector>

#include "bodies/bf16.h"
#include "bodies/layout.h"

namespace unetcu::kernels::cpu {
namespace {

std::atomic<bool> g_allowed{true};

// The weights in the compute type, ordered [o][c][i][j] as the loops walk them; the tensor
// itself may be OIHW or OHWI.
template <class S>
std::vector<acc_t<S>> load_weights(const TensorRef& w, const ConvGeometry& g) {
  const Dims4 d = w.dims4();
  const S* p = w.data<S>();
  std::vector<acc_t<S>> out(size_t(g.O * g.C * g.kh * g.kw));
  size_t k = 0;
  for (int64_t o = 0; o < g.O; ++o)
    for (int64_t c = 0; c < g.C; ++c)
      for (int64_t i = 0; i < g.kh; ++i)
        for (int64_t j = 0; j < g.kw; ++j) out[k++] = acc_t<S>(p[offset_of(d, o, c, i, j)]);
  return out;
}

// The weight gradient, summed in double in the order [o][c][i][j], stored into the tensor's
// own layout: written, or added in the compute type and rounded once.
template <class S>
void store_weight_grad(const std::vector<double>& sum, const TensorRef& gw, double beta,
                       const ConvGeometry& g) {
  using A = acc_t<S>;
  const Dims4 d = gw.dims4();
  S* p = gw.data<S>();
  size_t k = 0;
  for (int64_t o = 0; o < g.O; ++o)
    for (int64_t c = 0; c < g.C; ++c)
      for (int64_t i = 0; i < g.kh; ++i)
        for (int64_t j = 0; j < g.kw; ++j) {
          S& dst = p[offset_of(d, o, c, i, j)];
          const A v = A(sum[k++]);
          dst = to_storage<S>(beta != 0 ? A(acc_t<S>(dst)) + v : v);
        }
}

// dst[0, pad) = 0, dst[pad + k] = src[k] for k < n, dst[pad + n, len) = 0.
template <class S>
inline void load_padded(acc_t<S>* dst, const S* src, int64_t n, int64_t pad, int64_t len) {
  for (int64_t k = 0; k < pad; ++k) dst[k] = 0;
  for (int64_t k = 0; k < n; ++k) dst[pad + k] = acc_t<S>(src[k]);
  for (int64_t k = pad + n; k < len; ++k) dst[k] = 0;
}

// An NHWC row of W pixels and C channels, as load_padded per channel: dst[c * len + pad + k] =
// src[k * C + c], zeros around.
template <class S>
inline void load_transposed(acc_t<S>* dst, const S* src, int64_t W, int64_t C, int64_t pad,
                            int64_t len) {
  for (int64_t c = 0; c < C; ++c) {
    acc_t<S>* d = dst + c * len;
    for (int64_t k = 0; k < pad; ++k) d[k] = 0;
    for (int64_t k = pad + W; k < len; ++k) d[k] = 0;
  }
  for (int64_t k = 0; k < W; ++k)
    for (int64_t c = 0; c < C; ++c) dst[c * len + pad + k] = acc_t<S>(src[k * C + c]);
}

// dst[k] = v[k] for k < n, written or (beta != 0) added to what dst holds and rounded once.
template <class S>
inline void store_row(S* dst, const acc_t<S>* v, int64_t n, double beta) {
  using A = acc_t<S>;
  if (beta != 0) {
    for (int64_t k = 0; k < n; ++k) dst[k] = to_storage<S>(A(acc_t<S>(dst[k])) + v[k]);
  } else {
    for (int64_t k = 0; k < n; ++k) dst[k] = to_storage<S>(v[k]);
  }
}

// Input rows in the compute type, every channel of one row together (rows[c][iw + pw], an
// NHWC row transposed as it is read), padded with zeros; row ih of image n is kept in slot
// ih % kh while a thread's next output rows read it again.
template <class S>
class RowCache {
 public:
  RowCache(const S* x, const ConvGeometry& g, bool hwc)
      : x_(x), g_(g), hwc_(hwc), row_len_(g.W + 2 * g.pw), slot_len_(g.C * row_len_),
        rows_(static_cast<size_t>(g.kh * slot_len_)), held_(static_cast<size_t>(g.kh), -1) {}
  int64_t row_len() const { return row_len_; }
  // Row ih of image n: channel c at [c * row_len()].
  const acc_t<S>* get(int64_t n, int64_t ih) {
    const int64_t slot = ih % g_.kh, key = n * g_.H + ih;
    acc_t<S>* r = rows_.data() + slot * slot_len_;
    if (held_[size_t(slot)] != key) {
      const int64_t C = g_.C, H = g_.H, W = g_.W;
      if (!hwc_) {
        for (int64_t c = 0; c < C; ++c)
          load_padded<S>(r + c * row_len_, x_ + ((n * C + c) * H + ih) * W, W, g_.pw, row_len_);
      } else {
        load_transposed<S>(r, x_ + (n * H + ih) * W * C, W, C, g_.pw, row_len_);
      }
      held_[size_t(slot)] = key;
    }
    return r;
  }

 private:
  const S* x_;
  const ConvGeometry& g_;
  bool hwc_;
  int64_t row_len_, slot_len_;
  std::vector<acc_t<S>> rows_;
  std::vector<int64_t> held_;  // n * H + ih of each slot
};

// ---- forward --------------------------------------------------------------------------

template <class S>
void forward(const TensorRef& x, const TensorRef& w, const TensorRef& b, const TensorRef& y,
             const ConvGeometry& g) {
  using A = acc_t<S>;
  const bool hwc = x.nhwc();
  const std::vector<A> wt = load_weights<S>(w, g);
  std::vector<A> bias(size_t(g.O), A(0));
  if (b.defined())
    for (int64_t o = 0; o < g.O; ++o) bias[size_t(o)] = acc_t<S>(b.data<S>()[o]);
  const S* xp = x.data<S>();
  S* yp = y.data<S>();
  const int64_t C = g.C, H = g.H, W = g.W, O = g.O, OH = g.OH, OW = g.OW;
  const int64_t kh = g.kh, kw = g.kw, ph = g.ph, pw = g.pw;
  const int64_t row_len = W + 2 * pw;  // = OW + kw - 1
  const int64_t items = g.N * OH;
#pragma omp parallel
  {
    RowCache<S> rows(xp, g, hwc);
    std::vector<A> acc(static_cast<size_t>(O * OW));  // acc[o][ow]: the output row
#pragma omp for schedule(static)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t n = it / OH, oh = it % OH;
      A* a = acc.data();
      for (int64_t o = 0; o < O; ++o)
        for (int64_t q = 0; q < OW; ++q) a[o * OW + q] = bias[size_t(o)];
      for (int64_t i = 0; i < kh; ++i) {
        const int64_t ih = oh - ph + i;
        if (ih < 0 || ih >= H) continue;
        const A* r = rows.get(n, ih);
        for (int64_t c = 0; c < C; ++c) {
          const A* rc = r + c * row_len;
          for (int64_t o = 0; o < O; ++o) {
            A* ao = a + o * OW;
            const A* wk = wt.data() + ((o * C + c) * kh + i) * kw;
            for (int64_t j = 0; j < kw; ++j) {
              const A wv = wk[j];
              const A* xs = rc + j;
#pragma omp simd
              for (int64_t q = 0; q < OW; ++q) ao[q] += wv * xs[q];
            }
          }
        }
      }
      if (!hwc) {
        for (int64_t o = 0; o < O; ++o)
          store_row<S>(yp + ((n * O + o) * OH + oh) * OW, a + o * OW, OW, 0);
      } else {
        S* yr = yp + (n * OH + oh) * OW * O;
        for (int64_t q = 0; q < OW; ++q)
          for (int64_t o = 0; o < O; ++o) yr[q * O + o] = to_storage<S>(a[o * OW + q]);
      }
    }
  }
}

// ---- backward ---------------------------------------------------------------------------

// Output row oh of grad_y as gr[o][ow], from either layout.
template <class S>
inline void load_grad_rows(acc_t<S>* gr, const S* gy, bool hwc, int64_t n, int64_t oh,
                           const ConvGeometry& g) {
  const int64_t O = g.O, OH = g.OH, OW = g.OW;
  if (!hwc) {
    for (int64_t o = 0; o < O; ++o)
      load_padded<S>(gr + o * OW, gy + ((n * O + o) * OH + oh) * OW, OW, 0, OW);
  } else {
    load_transposed<S>(gr, gy + (n * OH + oh) * OW * O, OW, O, 0, OW);
  }
}

// Weight and bias gradients. Item (n, oh): grad_w[o][c][i][j] += grad_y row oh of o . input
// row oh - ph + i of c shifted by j; grad_b[o] += the sum of grad_y row oh of o.
template <class S>
void backward_weights(const TensorRef& grad_y, const TensorRef& x, const TensorRef& grad_w,
                      double beta_w, const TensorRef& grad_b, double beta_b,
                      const ConvGeometry& g) {
  using A = acc_t<S>;
  const bool hwc = x.nhwc();
  const bool want_w = grad_w.defined(), want_b = grad_b.defined();
  const S* xp = x.data<S>();
  const S* gyp = grad_y.data<S>();
  const int64_t C = g.C, H = g.H, W = g.W, O = g.O, OH = g.OH, OW = g.OW;
  const int64_t kh = g.kh, kw = g.kw, ph = g.ph, pw = g.pw;
  const int64_t row_len = W + 2 * pw;
  const int64_t nw = O * C * kh * kw, items = g.N * OH;
  const int threads = omp_get_max_threads();
  const int64_t stride = nw + O;  // a thread's partials: the weights, then the bias
  std::vector<double> partial(size_t(threads) * size_t(stride), 0.0);
#pragma omp parallel num_threads(threads)
  {
    double* part = partial.data() + size_t(omp_get_thread_num()) * size_t(stride);
    RowCache<S> rows(xp, g, hwc);  // input rows, as in forward
    std::vector<A> gy_rows(static_cast<size_t>(O * OW));
#pragma omp for schedule(static)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t n = it / OH, oh = it % OH;
      A* gr = gy_rows.data();
      load_grad_rows<S>(gr, gyp, hwc, n, oh, g);
      if (want_b) {
        for (int64_t o = 0; o < O; ++o) {
          A s = 0;
          for (int64_t q = 0; q < OW; ++q) s += gr[o * OW + q];
          part[nw + o] += double(s);
        }
      }
      if (!want_w) continue;
      for (int64_t i = 0; i < kh; ++i) {
        const int64_t ih = oh - ph + i;
        if (ih < 0 || ih >= H) continue;
        const A* r = rows.get(n, ih);
        for (int64_t c = 0; c < C; ++c) {
          const A* rc = r + c * row_len;
          for (int64_t o = 0; o < O; ++o) {
            const A* go = gr + o * OW;
            double* pk = part + ((o * C + c) * kh + i) * kw;
            for (int64_t j = 0; j < kw; ++j) {
              const A* xs = rc + j;
              A s = 0;
#pragma omp simd reduction(+ : s)
              for (int64_t q = 0; q < OW; ++q) s += go[q] * xs[q];
              pk[j] += double(s);
            }
          }
        }
      }
    }
  }
  std::vector<double> sum(size_t(stride), 0.0);
  for (int t = 0; t < threads; ++t)
    for (int64_t k = 0; k < stride; ++k)
      sum[size_t(k)] += partial[size_t(t) * size_t(stride) + size_t(k)];
  if (want_w) store_weight_grad<S>(sum, grad_w, beta_w, g);
  if (want_b) {
    S* gb = grad_b.data<S>();
    for (int64_t o = 0; o < O; ++o) {
      const A v = A(sum[size_t(nw + o)]);
      gb[o] = to_storage<S>(beta_b != 0 ? A(acc_t<S>(gb[o])) + v : v);
    }
  }
}

// Data gradient. Item (n, ih) gathers output rows oh = ih + ph - i; along a row each output
// column is scattered to the kw input columns it read: acc[c][iw + pw] += w[o][c][i][j] *
// grad_y[o][oh][ow] with iw + pw = ow + j. The padded row's interior is then stored.
template <class S>
void backward_data(const TensorRef& grad_y, const TensorRef& w, const TensorRef& grad_x,
                   double beta_x, const ConvGeometry& g) {
  using A = acc_t<S>;
  const bool hwc = grad_x.nhwc();
  const std::vector<A> wt = load_weights<S>(w, g);
  const S* gyp = grad_y.data<S>();
  S* gxp = grad_x.data<S>();
  const int64_t C = g.C, H = g.H, W = g.W, O = g.O, OH = g.OH, OW = g.OW;
  const int64_t kh = g.kh, kw = g.kw, ph = g.ph, pw = g.pw;
  const int64_t row_len = W + 2 * pw;  // = OW + kw - 1
  const int64_t items = g.N * H;
#pragma omp parallel
  {
    std::vector<A> acc(static_cast<size_t>(C * row_len)), gr(static_cast<size_t>(O * OW));
#pragma omp for schedule(static)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t n = it / H, ih = it % H;
      A* a = acc.data();
      for (int64_t k = 0; k < C * row_len; ++k) a[k] = 0;
      for (int64_t i = 0; i < kh; ++i) {
        const int64_t oh = ih + ph - i;
        if (oh < 0 || oh >= OH) continue;
        load_grad_rows<S>(gr.data(), gyp, hwc, n, oh, g);
        for (int64_t c = 0; c < C; ++c) {
          A* ac = a + c * row_len;
          for (int64_t o = 0; o < O; ++o) {
            const A* go = gr.data() + o * OW;
            const A* wk = wt.data() + ((o * C + c) * kh + i) * kw;
            for (int64_t j = 0; j < kw; ++j) {
              const A wv = wk[j];
              A* dst = ac + j;
#pragma omp simd
              for (int64_t q = 0; q < OW; ++q) dst[q] += wv * go[q];
            }
          }
        }
      }
      if (!hwc) {
        for (int64_t c = 0; c < C; ++c)
          store_row<S>(gxp + ((n * C + c) * H + ih) * W, a + c * row_len + pw, W, beta_x);
      } else {
        S* dst = gxp + (n * H + ih) * W * C;
        for (int64_t k = 0; k < W; ++k) {
          for (int64_t c = 0; c < C; ++c) {
            const A v = a[c * row_len + pw + k];
            S& d = dst[k * C + c];
            d = to_storage<S>(beta_x != 0 ? A(acc_t<S>(d)) + v : v);
          }
        }
      }
    }
  }
}

}  // namespace

bool narrow_conv_takes(const ConvGeometry& g) {
  return g_allowed && g.O <= kNarrowConvMaxOutputs && g.sh == 1 && g.sw == 1;
}

void set_narrow_conv_allowed(bool allowed) { g_allowed = allowed; }

void narrow_conv2d_forward(const TensorRef& x, const TensorRef& w, const TensorRef& b,
                           const TensorRef& y, const ConvGeometry& g) {
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, forward<S>(x, w, b, y, g));
}

void narrow_conv2d_backward(const TensorRef& grad_y, const TensorRef& x, const TensorRef& w,
                            const TensorRef& grad_x, double beta_x, const TensorRef& grad_w,
                            double beta_w, const TensorRef& grad_b, double beta_b,
                            const ConvGeometry& g) {
  UNETCU_DISPATCH_STORAGE(x.dtype(), S, {
    if (grad_w.defined() || grad_b.defined())
      backward_weights<S>(grad_y, x, grad_w, beta_w, grad_b, beta_b, g);
    if (grad_x.defined()) backward_data<S>(grad_y, w, grad_x, beta_x, g);
  });
}

}  // namespace unetcu::kernels::cpu
