// The CUDA emulator's cuDNN (include/cudnn.h): the legacy convolution API on the CPU, so that
// kernels/cuda/conv.cu (descriptors, the algorithm search and choice, workspaces, the bias
// paths) runs without a GPU. See README.md ("The emulated cuDNN").
//
// Calls check what cuDNN checks and return its statuses: descriptors set and consistent
// (channels, batch, the output size the convolution gives), one supported data-type
// configuration (float or bfloat16 data with float compute, double with double), an algorithm
// that supports the shape, format and type, a workspace as large as the algorithm needs, and
// alpha and beta in host memory. A data pointer that is not the handle's device memory, or
// whose tensor runs past its allocation, stops the run (on a GPU: an illegal address or silent
// corruption). The work is queued on the handle's stream like cuDNN's kernels, and captured
// into a graph like them; a search synchronises that stream, as cuDNN's does.
//
// Arithmetic: a direct sum in the compute type, the same for every algorithm, with three
// departures that make the rules of conv.cu's choice matter:
//  - tensor cores (an algorithm that has them, run with any math type but CUDNN_FMA_MATH)
//    round float inputs to TF32 (10-bit mantissa) first; bfloat16 products are exact in float;
//  - the algorithms cuDNN marks non-deterministic (atomics) add their terms in an order that
//    changes from call to call, so two runs differ in their last bits;
//  - beta = 0 never reads the output (it may hold NaN), as cuDNN's doesn't.
// A search reports modelled times (fastest: the atomics, FFT and Winograd algorithms and the
// tensor-core variants), not measured ones, and leaves NaN in the output it was given.
#include <cudnn.h>
#include <emu_device.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

struct cudnnContext {
  int device = 0;
  cudaStream_t stream = nullptr;
};
struct cudnnTensorStruct {
  bool set = false;
  cudnnTensorFormat_t format = CUDNN_TENSOR_NCHW;
  cudnnDataType_t type = CUDNN_DATA_FLOAT;
  int n = 0, c = 0, h = 0, w = 0;
};
struct cudnnFilterStruct {
  bool set = false;
  cudnnDataType_t type = CUDNN_DATA_FLOAT;
  cudnnTensorFormat_t format = CUDNN_TENSOR_NCHW;
  int k = 0, c = 0, h = 0, w = 0;
};
struct cudnnConvolutionStruct {
  bool set = false;
  int ph = 0, pw = 0, sh = 1, sw = 1, dh = 1, dw = 1;
  cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  cudnnDataType_t compute = CUDNN_DATA_FLOAT;
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;  // cuDNN's default
};

namespace unetcu_emu {
namespace {

// ---- elements ----------------------------------------------------------------------------

size_t element_bytes(cudnnDataType_t t) {
  return t == CUDNN_DATA_DOUBLE ? 8 : (t == CUDNN_DATA_FLOAT ? 4 : 2);
}

float from_bf16(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
float to_tf32(float f) {  // 10 mantissa bits, round to nearest even
  if (!std::isfinite(f)) return f;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0xfffu + ((u >> 13) & 1u);
  u &= ~0x1fffu;
  std::memcpy(&f, &u, 4);
  return f;
}

template <class A>
A load(const void* p, cudnnDataType_t t, int64_t i) {
  switch (t) {
    case CUDNN_DATA_DOUBLE: return A(static_cast<const double*>(p)[i]);
    case CUDNN_DATA_FLOAT: return A(static_cast<const float*>(p)[i]);
    default: return A(from_bf16(static_cast<const uint16_t*>(p)[i]));
  }
}
template <class A>
void store(void* p, cudnnDataType_t t, int64_t i, A v) {
  switch (t) {
    case CUDNN_DATA_DOUBLE: static_cast<double*>(p)[i] = double(v); break;
    case CUDNN_DATA_FLOAT: static_cast<float*>(p)[i] = float(v); break;
    default: static_cast<uint16_t*>(p)[i] = to_bf16(float(v)); break;
  }
}

// A 4-d tensor (or filter: n = K output channels) in memory: NCHW, or NHWC (a filter KRSC).
struct Layout {
  cudnnDataType_t type = CUDNN_DATA_FLOAT;
  bool nhwc = false;
  int64_t n = 0, c = 0, h = 0, w = 0;
  int64_t count() const { return n * c * h * w; }
  size_t bytes() const { return size_t(count()) * element_bytes(type); }
  int64_t at(int64_t i, int64_t ci, int64_t y, int64_t x) const {
    return nhwc ? ((i * h + y) * w + x) * c + ci : ((i * c + ci) * h + y) * w + x;
  }
};
Layout layout(const cudnnTensorStruct& d) {
  return {d.type, d.format == CUDNN_TENSOR_NHWC, d.n, d.c, d.h, d.w};
}
Layout layout(const cudnnFilterStruct& d) {
  return {d.type, d.format == CUDNN_TENSOR_NHWC, d.k, d.c, d.h, d.w};
}

// The tensor's values in the compute type, dense NCHW; float rounded to TF32 when `tf32`.
template <class A>
std::vector<A> dense(const Layout& l, const void* p, bool tf32) {
  std::vector<A> v(size_t(l.count()));
  size_t k = 0;
  for (int64_t i = 0; i < l.n; ++i)
    for (int64_t c = 0; c < l.c; ++c)
      for (int64_t y = 0; y < l.h; ++y)
        for (int64_t x = 0; x < l.w; ++x) {
          A a = load<A>(p, l.type, l.at(i, c, y, x));
          if constexpr (std::is_same_v<A, float>)
            if (tf32) a = to_tf32(a);
          v[k++] = a;
        }
  return v;
}

// v rounded to the type t stores.
template <class A>
A rounded(A v, cudnnDataType_t t) {
  if (t == CUDNN_DATA_BFLOAT16) return A(from_bf16(to_bf16(float(v))));
  if (t == CUDNN_DATA_FLOAT) return A(float(v));
  return v;
}

// UNETCU_EMU_CUDNN_ROUND_BEFORE_BLEND=1: a cuDNN that rounds its result to the output's type
// before it blends it with beta * out (two roundings), where this one blends in the compute
// type and rounds once. The real cuDNN's rule is not documented; the code must not depend on it.
bool round_before_blend() {
  const char* v = std::getenv("UNETCU_EMU_CUDNN_ROUND_BEFORE_BLEND");
  return v && std::strcmp(v, "1") == 0;
}

// out = alpha * v + beta * out, rounded once to out's type (or twice, above); with beta = 0 out
// is not read.
template <class A>
void blend(const Layout& l, void* out, const std::vector<A>& v, A alpha, A beta, bool round_first) {
  const bool twice = beta != A(0) && round_first;
  size_t k = 0;
  for (int64_t i = 0; i < l.n; ++i)
    for (int64_t c = 0; c < l.c; ++c)
      for (int64_t y = 0; y < l.h; ++y)
        for (int64_t x = 0; x < l.w; ++x) {
          const int64_t at = l.at(i, c, y, x);
          A r = alpha * v[k++];
          if (twice) r = rounded(r, l.type);
          if (beta != A(0)) r += beta * load<A>(out, l.type, at);
          store<A>(out, l.type, at, r);
        }
}

// ---- the convolution's geometry and checks --------------------------------------------

struct Geo {
  int64_t N, C, H, W, K, R, S, OH, OW, ph, pw, sh, sw;
  cudnnDataType_t type;
  bool nhwc;
  double flops() const { return 2.0 * double(N * K * OH * OW) * double(C * R * S); }
};

// x [N, C, H, W], w [K, C, R, S], y [N, K, OH, OW], as cuDNN checks them.
cudnnStatus_t geometry(const cudnnTensorStruct* x, const cudnnFilterStruct* w,
                       const cudnnConvolutionStruct* conv, const cudnnTensorStruct* y, Geo* g) {
  if (!x || !w || !conv || !y) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  if (!x->set || !w->set || !conv->set || !y->set) return CUDNN_STATUS_BAD_PARAM;
  if (x->type != w->type || x->type != y->type) return CUDNN_STATUS_BAD_PARAM;
  if (x->c != w->c || y->n != x->n || y->c != w->k) return CUDNN_STATUS_BAD_PARAM;
  // The configurations cuDNN lists: FLOAT and PSEUDO_BFLOAT16 (float compute), DOUBLE.
  const bool ok_type =
      ((x->type == CUDNN_DATA_FLOAT || x->type == CUDNN_DATA_BFLOAT16) &&
       conv->compute == CUDNN_DATA_FLOAT) ||
      (x->type == CUDNN_DATA_DOUBLE && conv->compute == CUDNN_DATA_DOUBLE);
  if (!ok_type) return CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE;
  // The emulator's algorithms: cross-correlation without dilation, x, y and the filter in one
  // format (what the engine gives; cuDNN also takes some mixes).
  if (conv->mode != CUDNN_CROSS_CORRELATION || conv->dh != 1 || conv->dw != 1)
    return CUDNN_STATUS_NOT_SUPPORTED;
  if (x->format != y->format || x->format != w->format) return CUDNN_STATUS_NOT_SUPPORTED_LAYOUT;
  if (w->h > x->h + 2 * conv->ph || w->w > x->w + 2 * conv->pw) return CUDNN_STATUS_BAD_PARAM;
  const int oh = (x->h + 2 * conv->ph - w->h) / conv->sh + 1;
  const int ow = (x->w + 2 * conv->pw - w->w) / conv->sw + 1;
  if (y->h != oh || y->w != ow) return CUDNN_STATUS_NOT_SUPPORTED_SHAPE;
  *g = Geo{x->n, x->c, x->h, x->w, w->k, w->h, w->w, oh, ow, conv->ph, conv->pw, conv->sh,
           conv->sw, x->type, x->format == CUDNN_TENSOR_NHWC};
  return CUDNN_STATUS_SUCCESS;
}

// ---- the algorithms ----------------------------------------------------------------------

enum Dir { kFwd, kBwdData, kBwdFilter };

struct Algo {
  int id;
  bool implemented;
  bool tensor_cores;  // has a tensor-core variant
  bool atomics;       // cuDNN reports it non-deterministic
  bool general;       // any format and type (else float NCHW, stride 1 only)
  int kernels;        // 0: any filter size; 3: 3x3 only; 35: 3x3 or 5x5
  double rate;        // modelled GFLOP/s without tensor cores
};

// Each direction's algorithms, in cuDNN's numbering.
const Algo kFwdAlgos[] = {
    {CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, true, false, false, true, 0, 1000},
    {CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, true, true, false, true, 0, 1500},
    {CUDNN_CONVOLUTION_FWD_ALGO_GEMM, true, false, false, false, 0, 1200},
    {CUDNN_CONVOLUTION_FWD_ALGO_DIRECT, false, false, false, false, 0, 0},
    {CUDNN_CONVOLUTION_FWD_ALGO_FFT, true, false, false, false, 0, 1800},
    {CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING, true, false, false, false, 0, 1700},
    {CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD, true, false, false, false, 3, 2000},
    {CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED, true, false, false, false, 35, 2200},
};
const Algo kBwdDataAlgos[] = {
    {CUDNN_CONVOLUTION_BWD_DATA_ALGO_0, true, false, true, true, 0, 2000},
    {CUDNN_CONVOLUTION_BWD_DATA_ALGO_1, true, true, false, true, 0, 1500},
    {CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT, true, false, false, false, 0, 1800},
    {CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING, true, false, false, false, 0, 1700},
    {CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD, true, false, false, false, 3, 1900},
    {CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED, true, false, false, false, 35, 2100},
};
const Algo kBwdFilterAlgos[] = {
    {CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0, true, false, true, true, 0, 2000},
    {CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1, true, true, false, true, 0, 1500},
    {CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT, true, false, false, false, 0, 1800},
    {CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3, true, false, true, false, 0, 2300},
    {CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD, false, false, false, false, 3, 0},
    {CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED, true, false, false, false, 35, 2100},
    {CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING, true, false, false, false, 0, 1700},
};

const Algo* algos(Dir d, int* count) {
  switch (d) {
    case kFwd: *count = int(std::size(kFwdAlgos)); return kFwdAlgos;
    case kBwdData: *count = int(std::size(kBwdDataAlgos)); return kBwdDataAlgos;
    default: *count = int(std::size(kBwdFilterAlgos)); return kBwdFilterAlgos;
  }
}
const Algo* algo(Dir d, int id) {
  int n = 0;
  const Algo* a = algos(d, &n);
  return id >= 0 && id < n ? &a[id] : nullptr;
}

cudnnStatus_t supports(const Algo& a, const Geo& g) {
  if (!a.implemented) return CUDNN_STATUS_NOT_SUPPORTED;
  if (!a.general) {
    if (g.nhwc) return CUDNN_STATUS_NOT_SUPPORTED_LAYOUT;
    if (g.type != CUDNN_DATA_FLOAT) return CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE;
    if (g.sh != 1 || g.sw != 1) return CUDNN_STATUS_NOT_SUPPORTED_SHAPE;
  }
  const bool k3 = g.R == 3 && g.S == 3, k5 = g.R == 5 && g.S == 5;
  if ((a.kernels == 3 && !k3) || (a.kernels == 35 && !k3 && !k5))
    return CUDNN_STATUS_NOT_SUPPORTED_SHAPE;
  return CUDNN_STATUS_SUCCESS;
}

// UNETCU_EMU_CUDNN_ALIGN8=nhwc (or all): in NHWC (or any) layout, a cuDNN whose tensor-core
// kernels want input and output channel counts that are multiples of 8, and that has no other
// kernels for bfloat16 there. A variant (an algorithm with or without tensor cores) outside
// that is NOT_SUPPORTED: a bfloat16 layer of 3 input channels then has no algorithm at all, and
// the engine's fallback runs (kernels/cuda/conv.cu).
cudnnStatus_t variant_supported(const Geo& g, bool tc) {
  const char* v = std::getenv("UNETCU_EMU_CUDNN_ALIGN8");
  if (!v) return CUDNN_STATUS_SUCCESS;
  const bool applies = std::strcmp(v, "all") == 0 || (std::strcmp(v, "nhwc") == 0 && g.nhwc);
  if (!applies) return CUDNN_STATUS_SUCCESS;
  if (tc && (g.C % 8 != 0 || g.K % 8 != 0)) return CUDNN_STATUS_NOT_SUPPORTED;
  if (!tc && g.type == CUDNN_DATA_BFLOAT16) return CUDNN_STATUS_NOT_SUPPORTED;
  return CUDNN_STATUS_SUCCESS;
}

// Tensor cores run: an algorithm that has them, a math type that allows them, float or
// bfloat16 data.
bool tensor_cores(const Algo& a, const Geo& g, cudnnMathType_t math) {
  return a.tensor_cores && math != CUDNN_FMA_MATH && g.type != CUDNN_DATA_DOUBLE;
}

// The workspace an algorithm needs (a model of cuDNN's, whatever the math type): none for
// forward 0, backward 0 and the fused Winograd, a small table for forward 1 and backward-data
// 1, an im2col, partial-sum or transform buffer for the others.
size_t workspace_need(Dir d, const Algo& a, const Geo& g) {
  const size_t e = g.type == CUDNN_DATA_DOUBLE ? 8 : 4;
  const size_t crs = size_t(g.C * g.R * g.S), pix = size_t(g.OH * g.OW);
  const size_t padded = size_t((g.H + 2 * g.ph) * (g.W + 2 * g.pw));
  const size_t tiles = size_t(((g.OH + 1) / 2) * ((g.OW + 1) / 2));
  const size_t planes = size_t(g.N * (g.C + g.K));
  switch (d) {
    case kFwd:
      switch (a.id) {
        case CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM: return e * crs + 1024;
        case CUDNN_CONVOLUTION_FWD_ALGO_GEMM: return e * crs * pix;
        case CUDNN_CONVOLUTION_FWD_ALGO_FFT: return 2 * e * (planes + size_t(g.K * g.C)) * padded;
        case CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING: return 2 * e * (planes + size_t(g.K * g.C)) * 1024;
        case CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED:
          return 16 * e * (size_t(g.K * g.C) + planes * tiles);
        default: return 0;
      }
    case kBwdData:
      switch (a.id) {
        case CUDNN_CONVOLUTION_BWD_DATA_ALGO_1: return e * crs + 1024;
        case CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT: return 2 * e * (planes + size_t(g.K * g.C)) * padded;
        case CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING: return 2 * e * (planes + size_t(g.K * g.C)) * 1024;
        case CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED:
          return 16 * e * (size_t(g.K * g.C) + planes * tiles);
        default: return 0;
      }
    default:
      switch (a.id) {
        case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1: return e * crs * pix;
        case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT: return 2 * e * (planes + size_t(g.K * g.C)) * padded;
        case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3: return e * size_t(g.K) * crs;
        case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED:
          return 16 * e * (size_t(g.K * g.C) + planes * tiles);
        case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING: return 2 * e * (planes + size_t(g.K * g.C)) * 1024;
        default: return 0;
      }
  }
}

float modelled_ms(const Algo& a, const Geo& g, bool tc) {
  const double rate = a.rate * (tc ? (g.type == CUDNN_DATA_BFLOAT16 ? 8 : 4) : 1);
  return float(g.flops() / (rate * 1e6));
}

// ---- the sums ----------------------------------------------------------------------------

std::atomic<unsigned> g_atomics_order{0};

// [lo, hi): the output columns whose input column ow * sw - pw + s lies in [0, W).
void columns(const Geo& g, int64_t s, int64_t* lo, int64_t* hi) {
  const int64_t first = g.pw - s;  // ow * sw >= first
  *lo = first > 0 ? (first + g.sw - 1) / g.sw : 0;
  const int64_t last = g.W - 1 + g.pw - s;  // ow * sw <= last
  *hi = last < 0 ? 0 : std::min<int64_t>(g.OW, last / g.sw + 1);
}

template <class A>
std::vector<A> forward(const Geo& g, const std::vector<A>& x, const std::vector<A>& w) {
  std::vector<A> y(size_t(g.N * g.K * g.OH * g.OW), A(0));
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t k = 0; k < g.K; ++k) {
      A* out = &y[size_t((n * g.K + k) * g.OH * g.OW)];
      for (int64_t c = 0; c < g.C; ++c)
        for (int64_t r = 0; r < g.R; ++r)
          for (int64_t s = 0; s < g.S; ++s) {
            const A wv = w[size_t(((k * g.C + c) * g.R + r) * g.S + s)];
            int64_t lo, hi;
            columns(g, s, &lo, &hi);
            for (int64_t oh = 0; oh < g.OH; ++oh) {
              const int64_t ih = oh * g.sh - g.ph + r;
              if (ih < 0 || ih >= g.H) continue;
              const A* row = &x[size_t(((n * g.C + c) * g.H + ih) * g.W)];
              A* o = out + oh * g.OW;
              for (int64_t ow = lo; ow < hi; ++ow) o[ow] += wv * row[ow * g.sw - g.pw + s];
            }
          }
    }
  return y;
}

// dx; `start` rotates the order of the output channels (atomics: another order each call).
template <class A>
std::vector<A> backward_data(const Geo& g, const std::vector<A>& w, const std::vector<A>& dy,
                             unsigned start) {
  std::vector<A> dx(size_t(g.N * g.C * g.H * g.W), A(0));
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t kk = 0; kk < g.K; ++kk) {
      const int64_t k = (kk + start) % g.K;
      const A* grad = &dy[size_t((n * g.K + k) * g.OH * g.OW)];
      for (int64_t c = 0; c < g.C; ++c)
        for (int64_t r = 0; r < g.R; ++r)
          for (int64_t s = 0; s < g.S; ++s) {
            const A wv = w[size_t(((k * g.C + c) * g.R + r) * g.S + s)];
            int64_t lo, hi;
            columns(g, s, &lo, &hi);
            for (int64_t oh = 0; oh < g.OH; ++oh) {
              const int64_t ih = oh * g.sh - g.ph + r;
              if (ih < 0 || ih >= g.H) continue;
              A* row = &dx[size_t(((n * g.C + c) * g.H + ih) * g.W)];
              const A* gr = grad + oh * g.OW;
              for (int64_t ow = lo; ow < hi; ++ow) row[ow * g.sw - g.pw + s] += wv * gr[ow];
            }
          }
    }
  return dx;
}

// dw: each image's sum, then the images' partial sums added, from image `start` on.
template <class A>
std::vector<A> backward_filter(const Geo& g, const std::vector<A>& x, const std::vector<A>& dy,
                               unsigned start) {
  std::vector<A> dw(size_t(g.K * g.C * g.R * g.S), A(0));
  for (int64_t k = 0; k < g.K; ++k)
    for (int64_t c = 0; c < g.C; ++c)
      for (int64_t r = 0; r < g.R; ++r)
        for (int64_t s = 0; s < g.S; ++s) {
          int64_t lo, hi;
          columns(g, s, &lo, &hi);
          A total = 0;
          for (int64_t nn = 0; nn < g.N; ++nn) {
            const int64_t n = (nn + start) % g.N;
            A part = 0;
            for (int64_t oh = 0; oh < g.OH; ++oh) {
              const int64_t ih = oh * g.sh - g.ph + r;
              if (ih < 0 || ih >= g.H) continue;
              const A* row = &x[size_t(((n * g.C + c) * g.H + ih) * g.W)];
              const A* gr = &dy[size_t(((n * g.K + k) * g.OH + oh) * g.OW)];
              for (int64_t ow = lo; ow < hi; ++ow) part += gr[ow] * row[ow * g.sw - g.pw + s];
            }
            total += part;
          }
          dw[size_t(((k * g.C + c) * g.R + r) * g.S + s)] = total;
        }
  return dw;
}

// ---- pointers, scalars, the stream ------------------------------------------------------

// A data pointer the call reads or writes: the handle's device memory, `bytes` long.
void device_data(const cudnnHandle_t h, const void* p, size_t bytes, const char* call,
                 const char* what) {
  const std::string name = std::string("cuDNN ") + call + ": " + what;
  const int d = memory_device(p, bytes, name.c_str());
  if (d != h->device)
    stop(name + " is not cuda:" + std::to_string(h->device) + "'s memory (" +
         (d >= 0 ? "cuda:" + std::to_string(d) + "'s" : d == -1 ? "pinned host memory" : "host memory") +
         ")");
}

// alpha and beta: host memory, float for float and bfloat16 data, double for double.
bool scalars(const void* alpha, const void* beta, bool f64, double* a, double* b) {
  if (!alpha || !beta) return false;
  if (memory_device(alpha, f64 ? 8 : 4, "cuDNN alpha") >= 0 ||
      memory_device(beta, f64 ? 8 : 4, "cuDNN beta") >= 0)
    return false;  // device memory: not what the legacy API takes
  *a = f64 ? *static_cast<const double*>(alpha) : *static_cast<const float*>(alpha);
  *b = f64 ? *static_cast<const double*>(beta) : *static_cast<const float*>(beta);
  return true;
}

cudnnStatus_t queue(cudnnHandle_t h, std::function<void()> work) {
  return enqueue(h->stream, std::move(work)) == cudaSuccess ? CUDNN_STATUS_SUCCESS
                                                             : CUDNN_STATUS_EXECUTION_FAILED_CUDART;
}

// The workspace an algorithm is run with: at least what it needs, device memory of the
// handle's device; the part it uses is overwritten, as cuDNN's kernels do.
cudnnStatus_t workspace_ok(cudnnHandle_t h, void* ws, size_t bytes, size_t need, const char* call) {
  if (bytes < need) return CUDNN_STATUS_BAD_PARAM_SIZE_INSUFFICIENT;
  if (bytes && !ws) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  if (bytes) device_data(h, ws, bytes, call, "workspace");
  return CUDNN_STATUS_SUCCESS;
}

// ---- one direction: the run, the workspace query, the search --------------------------

// The tensors of one direction, in its roles: in1 and in2 read, out written.
struct Roles {
  Layout in1, in2, out;
};
Roles roles(Dir d, const cudnnTensorStruct* x, const cudnnFilterStruct* w,
            const cudnnTensorStruct* y) {
  const Layout lx = layout(*x), lw = layout(*w), ly = layout(*y);
  switch (d) {
    case kFwd: return {lx, lw, ly};
    case kBwdData: return {lw, ly, lx};
    default: return {lx, ly, lw};
  }
}

// The direction's three tensors: each the handle's device memory, as long as its layout.
void roles_data(Dir d, cudnnHandle_t h, const Roles& r, const void* in1, const void* in2,
                const void* out, const char* call) {
  device_data(h, in1, r.in1.bytes(), call, d == kBwdData ? "w" : "x");
  device_data(h, in2, r.in2.bytes(), call, d == kFwd ? "w" : "dy");
  device_data(h, out, r.out.bytes(), call, d == kFwd ? "y" : d == kBwdData ? "dx" : "dw");
}

template <class A>
void compute(Dir d, const Geo& g, const Roles& r, const void* in1, const void* in2, void* out,
             bool tc, bool atomics, A alpha, A beta, bool round_first) {
  const bool tf32 = tc && g.type == CUDNN_DATA_FLOAT;
  const std::vector<A> a = dense<A>(r.in1, in1, tf32), b = dense<A>(r.in2, in2, tf32);
  const unsigned start = atomics ? g_atomics_order.fetch_add(1) : 0;
  std::vector<A> v = d == kFwd       ? forward(g, a, b)
                     : d == kBwdData ? backward_data(g, a, b, start)
                                     : backward_filter(g, a, b, start);
  blend<A>(r.out, out, v, alpha, beta, round_first);
}

cudnnStatus_t run(Dir d, const char* call, cudnnHandle_t h, const void* alpha,
                  const cudnnTensorStruct* x, const cudnnFilterStruct* w,
                  const cudnnConvolutionStruct* conv, const cudnnTensorStruct* y, int algo_id,
                  const void* in1, const void* in2, void* out, void* ws, size_t ws_bytes,
                  const void* beta) {
  if (!h) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  Geo g;
  if (const cudnnStatus_t st = geometry(x, w, conv, y, &g)) return st;
  const Algo* a = algo(d, algo_id);
  if (!a) return CUDNN_STATUS_BAD_PARAM;
  if (const cudnnStatus_t st = supports(*a, g)) return st;
  if (const cudnnStatus_t st = variant_supported(g, tensor_cores(*a, g, conv->math))) return st;
  if (!in1 || !in2 || !out) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  double al = 0, be = 0;
  const bool f64 = g.type == CUDNN_DATA_DOUBLE;
  if (!scalars(alpha, beta, f64, &al, &be)) return CUDNN_STATUS_BAD_PARAM;
  const size_t need = workspace_need(d, *a, g);
  if (const cudnnStatus_t st = workspace_ok(h, ws, ws_bytes, need, call)) return st;
  const Roles r = roles(d, x, w, y);
  roles_data(d, h, r, in1, in2, out, call);
  const bool tc = tensor_cores(*a, g, conv->math), atomics = a->atomics;
  const bool round_first = round_before_blend();  // read here, not on the stream's thread
  return queue(h, [=] {
    if (need) std::memset(ws, 0xA5, need);
    if (f64)
      compute<double>(d, g, r, in1, in2, out, tc, atomics, al, be, round_first);
    else
      compute<float>(d, g, r, in1, in2, out, tc, atomics, float(al), float(be), round_first);
  });
}

cudnnStatus_t workspace_size(Dir d, cudnnHandle_t h, const cudnnTensorStruct* x,
                             const cudnnFilterStruct* w, const cudnnConvolutionStruct* conv,
                             const cudnnTensorStruct* y, int algo_id, size_t* bytes) {
  if (!h || !bytes) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  Geo g;
  if (const cudnnStatus_t st = geometry(x, w, conv, y, &g)) return st;
  const Algo* a = algo(d, algo_id);
  if (!a) return CUDNN_STATUS_BAD_PARAM;
  if (const cudnnStatus_t st = supports(*a, g)) return st;
  if (const cudnnStatus_t st = variant_supported(g, tensor_cores(*a, g, conv->math))) return st;
  *bytes = workspace_need(d, *a, g);
  return CUDNN_STATUS_SUCCESS;
}

template <class Perf>
cudnnStatus_t search(Dir d, const char* call, cudnnHandle_t h, const cudnnTensorStruct* x,
                     const cudnnFilterStruct* w, const cudnnConvolutionStruct* conv,
                     const cudnnTensorStruct* y, const void* in1, const void* in2, void* out,
                     int requested, int* returned, Perf* results, void* ws, size_t ws_bytes) {
  if (!h || !returned || !results) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  if (requested <= 0) return CUDNN_STATUS_BAD_PARAM;
  Geo g;
  if (const cudnnStatus_t st = geometry(x, w, conv, y, &g)) return st;
  if (!in1 || !in2 || !out) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  if (ws_bytes && !ws) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  const Roles r = roles(d, x, w, y);
  roles_data(d, h, r, in1, in2, out, call);
  if (ws_bytes) device_data(h, ws, ws_bytes, call, "workspace");
  // The search times its runs with a synchronisation of the stream: not inside a capture.
  if (cudaStreamSynchronize(h->stream) != cudaSuccess) return CUDNN_STATUS_EXECUTION_FAILED_CUDART;
  // The output holds what the runs left: NaN here, so nothing may rely on it.
  const Layout lo = r.out;
  if (const cudnnStatus_t st = queue(h, [=] {
        for (int64_t i = 0; i < lo.count(); ++i)
          store<double>(out, lo.type, i, std::numeric_limits<double>::quiet_NaN());
      }))
    return st;
  if (cudaStreamSynchronize(h->stream) != cudaSuccess) return CUDNN_STATUS_EXECUTION_FAILED_CUDART;
  std::vector<Perf> ok, failed;
  int n = 0;
  const Algo* all = algos(d, &n);
  for (int i = 0; i < n; ++i) {
    const Algo& a = all[i];
    const cudnnStatus_t st = supports(a, g);
    for (bool tc : {true, false}) {
      if (tc && !tensor_cores(a, g, conv->math)) continue;
      Perf p{};
      p.algo = decltype(p.algo)(a.id);
      p.status = st;
      p.mathType = tc ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH;
      p.determinism = a.atomics ? CUDNN_NON_DETERMINISTIC : CUDNN_DETERMINISTIC;
      p.time = -1;
      if (st == CUDNN_STATUS_SUCCESS) p.status = variant_supported(g, tc);
      if (p.status == CUDNN_STATUS_SUCCESS) {
        p.memory = workspace_need(d, a, g);
        if (p.memory > ws_bytes) {
          p.status = CUDNN_STATUS_BAD_PARAM_SIZE_INSUFFICIENT;
        } else {
          p.time = modelled_ms(a, g, tc);
        }
      }
      (p.status == CUDNN_STATUS_SUCCESS ? ok : failed).push_back(p);
      if (st != CUDNN_STATUS_SUCCESS) break;  // one entry for an algorithm that cannot run
    }
  }
  std::stable_sort(ok.begin(), ok.end(), [](const Perf& a, const Perf& b) { return a.time < b.time; });
  ok.insert(ok.end(), failed.begin(), failed.end());
  *returned = std::min(requested, int(ok.size()));
  std::copy(ok.begin(), ok.begin() + *returned, results);
  return CUDNN_STATUS_SUCCESS;
}

}  // namespace
}  // namespace unetcu_emu

using namespace unetcu_emu;

// ---- the library, handles ----------------------------------------------------------------

size_t cudnnGetVersion(void) { return CUDNN_VERSION; }

const char* cudnnGetErrorString(cudnnStatus_t status) {
  switch (status) {
    case CUDNN_STATUS_SUCCESS: return "CUDNN_STATUS_SUCCESS";
    case CUDNN_STATUS_NOT_INITIALIZED: return "CUDNN_STATUS_NOT_INITIALIZED";
    case CUDNN_STATUS_BAD_PARAM: return "CUDNN_STATUS_BAD_PARAM";
    case CUDNN_STATUS_BAD_PARAM_NULL_POINTER: return "CUDNN_STATUS_BAD_PARAM_NULL_POINTER";
    case CUDNN_STATUS_BAD_PARAM_SIZE_INSUFFICIENT: return "CUDNN_STATUS_BAD_PARAM_SIZE_INSUFFICIENT";
    case CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH: return "CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH";
    case CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH: return "CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH";
    case CUDNN_STATUS_NOT_SUPPORTED: return "CUDNN_STATUS_NOT_SUPPORTED";
    case CUDNN_STATUS_NOT_SUPPORTED_SHAPE: return "CUDNN_STATUS_NOT_SUPPORTED_SHAPE";
    case CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE: return "CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE";
    case CUDNN_STATUS_NOT_SUPPORTED_LAYOUT: return "CUDNN_STATUS_NOT_SUPPORTED_LAYOUT";
    case CUDNN_STATUS_INTERNAL_ERROR: return "CUDNN_STATUS_INTERNAL_ERROR";
    case CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED: return "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED";
    case CUDNN_STATUS_EXECUTION_FAILED: return "CUDNN_STATUS_EXECUTION_FAILED";
    case CUDNN_STATUS_EXECUTION_FAILED_CUDART: return "CUDNN_STATUS_EXECUTION_FAILED_CUDART";
  }
  return "CUDNN_STATUS_UNKNOWN (emulated cuDNN)";
}

// A handle belongs to the device current at its creation; its stream starts as that device's
// default stream.
cudnnStatus_t cudnnCreate(cudnnHandle_t* handle) {
  if (!handle) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return CUDNN_STATUS_NOT_INITIALIZED;
  *handle = new cudnnContext{device, nullptr};
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnDestroy(cudnnHandle_t handle) {
  delete handle;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetStream(cudnnHandle_t handle, cudaStream_t stream) {
  if (!handle) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  if (stream && stream_device(stream) != handle->device) return CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH;
  handle->stream = stream;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnGetStream(cudnnHandle_t handle, cudaStream_t* stream) {
  if (!handle || !stream) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  *stream = handle->stream;
  return CUDNN_STATUS_SUCCESS;
}

// ---- descriptors -------------------------------------------------------------------------

namespace {
bool known_type(cudnnDataType_t t) {
  return t == CUDNN_DATA_FLOAT || t == CUDNN_DATA_DOUBLE || t == CUDNN_DATA_HALF ||
         t == CUDNN_DATA_BFLOAT16;
}
bool known_format(cudnnTensorFormat_t f) { return f == CUDNN_TENSOR_NCHW || f == CUDNN_TENSOR_NHWC; }
// A 4-d descriptor's fields as cuDNN checks them; its strides are 32-bit.
cudnnStatus_t check_4d(cudnnTensorFormat_t format, cudnnDataType_t type, int n, int c, int h, int w) {
  if (!known_format(format) || !known_type(type) || n <= 0 || c <= 0 || h <= 0 || w <= 0)
    return CUDNN_STATUS_BAD_PARAM;
  if (int64_t(n) * c * h * w > std::numeric_limits<int>::max()) return CUDNN_STATUS_NOT_SUPPORTED;
  return CUDNN_STATUS_SUCCESS;
}
template <class T>
cudnnStatus_t create(T** desc) {
  if (!desc) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  *desc = new T();
  return CUDNN_STATUS_SUCCESS;
}
template <class T>
cudnnStatus_t destroy(T* desc) {
  delete desc;
  return CUDNN_STATUS_SUCCESS;
}
}  // namespace

cudnnStatus_t cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t* desc) { return create(desc); }
cudnnStatus_t cudnnSetTensor4dDescriptor(cudnnTensorDescriptor_t desc, cudnnTensorFormat_t format,
                                         cudnnDataType_t type, int n, int c, int h, int w) {
  if (!desc) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  if (const cudnnStatus_t st = check_4d(format, type, n, c, h, w)) return st;
  *desc = cudnnTensorStruct{true, format, type, n, c, h, w};
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnDestroyTensorDescriptor(cudnnTensorDescriptor_t desc) { return destroy(desc); }

cudnnStatus_t cudnnCreateFilterDescriptor(cudnnFilterDescriptor_t* desc) { return create(desc); }
cudnnStatus_t cudnnSetFilter4dDescriptor(cudnnFilterDescriptor_t desc, cudnnDataType_t type,
                                         cudnnTensorFormat_t format, int k, int c, int h, int w) {
  if (!desc) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  if (const cudnnStatus_t st = check_4d(format, type, k, c, h, w)) return st;
  *desc = cudnnFilterStruct{true, type, format, k, c, h, w};
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnDestroyFilterDescriptor(cudnnFilterDescriptor_t desc) { return destroy(desc); }

cudnnStatus_t cudnnCreateConvolutionDescriptor(cudnnConvolutionDescriptor_t* desc) {
  return create(desc);
}
cudnnStatus_t cudnnSetConvolution2dDescriptor(cudnnConvolutionDescriptor_t desc, int pad_h,
                                              int pad_w, int u, int v, int dilation_h,
                                              int dilation_w, cudnnConvolutionMode_t mode,
                                              cudnnDataType_t compute_type) {
  if (!desc) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  if (pad_h < 0 || pad_w < 0 || u <= 0 || v <= 0 || dilation_h <= 0 || dilation_w <= 0 ||
      (mode != CUDNN_CONVOLUTION && mode != CUDNN_CROSS_CORRELATION) || !known_type(compute_type))
    return CUDNN_STATUS_BAD_PARAM;
  const cudnnMathType_t math = desc->math;  // kept, as cuDNN keeps it
  *desc = cudnnConvolutionStruct{true, pad_h, pad_w, u, v, dilation_h, dilation_w, mode,
                                 compute_type, math};
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetConvolutionMathType(cudnnConvolutionDescriptor_t desc, cudnnMathType_t math) {
  if (!desc) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  if (math < CUDNN_DEFAULT_MATH || math > CUDNN_FMA_MATH) return CUDNN_STATUS_BAD_PARAM;
  desc->math = math;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnDestroyConvolutionDescriptor(cudnnConvolutionDescriptor_t desc) {
  return destroy(desc);
}

// ---- tensors: add, bias gradient -----------------------------------------------------------

cudnnStatus_t cudnnAddTensor(cudnnHandle_t handle, const void* alpha,
                             const cudnnTensorDescriptor_t a_desc, const void* a,
                             const void* beta, const cudnnTensorDescriptor_t c_desc, void* c) {
  if (!handle || !a_desc || !c_desc || !a || !c) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  if (!a_desc->set || !c_desc->set) return CUDNN_STATUS_BAD_PARAM;
  if (a_desc->type != c_desc->type) return CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE;
  const cudnnTensorStruct& ad = *a_desc;
  const cudnnTensorStruct& cd = *c_desc;
  const auto dim_ok = [](int ad_, int cd_) { return ad_ == cd_ || ad_ == 1; };
  if (!dim_ok(ad.n, cd.n) || !dim_ok(ad.c, cd.c) || !dim_ok(ad.h, cd.h) || !dim_ok(ad.w, cd.w))
    return CUDNN_STATUS_BAD_PARAM;
  const bool f64 = ad.type == CUDNN_DATA_DOUBLE;
  double al = 0, be = 0;
  if (!scalars(alpha, beta, f64, &al, &be)) return CUDNN_STATUS_BAD_PARAM;
  const Layout la = layout(ad), lc = layout(cd);
  device_data(handle, a, la.bytes(), "cudnnAddTensor", "A");
  device_data(handle, c, lc.bytes(), "cudnnAddTensor", "C");
  return queue(handle, [=] {
    for (int64_t n = 0; n < lc.n; ++n)
      for (int64_t ch = 0; ch < lc.c; ++ch)
        for (int64_t y = 0; y < lc.h; ++y)
          for (int64_t x = 0; x < lc.w; ++x) {
            const int64_t ia = la.at(la.n == 1 ? 0 : n, la.c == 1 ? 0 : ch, la.h == 1 ? 0 : y,
                                     la.w == 1 ? 0 : x);
            const int64_t ic = lc.at(n, ch, y, x);
            if (f64) {
              double r = al * load<double>(a, la.type, ia);
              if (be != 0) r += be * load<double>(c, lc.type, ic);
              store<double>(c, lc.type, ic, r);
            } else {
              float r = float(al) * load<float>(a, la.type, ia);
              if (be != 0) r += float(be) * load<float>(c, lc.type, ic);
              store<float>(c, lc.type, ic, r);
            }
          }
  });
}

cudnnStatus_t cudnnConvolutionBackwardBias(cudnnHandle_t handle, const void* alpha,
                                           const cudnnTensorDescriptor_t dy_desc, const void* dy,
                                           const void* beta, const cudnnTensorDescriptor_t db_desc,
                                           void* db) {
  if (!handle || !dy_desc || !db_desc || !dy || !db) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  if (!dy_desc->set || !db_desc->set) return CUDNN_STATUS_BAD_PARAM;
  if (dy_desc->type != db_desc->type) return CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE;
  if (db_desc->n != 1 || db_desc->c != dy_desc->c || db_desc->h != 1 || db_desc->w != 1)
    return CUDNN_STATUS_BAD_PARAM;
  const bool f64 = dy_desc->type == CUDNN_DATA_DOUBLE;
  double al = 0, be = 0;
  if (!scalars(alpha, beta, f64, &al, &be)) return CUDNN_STATUS_BAD_PARAM;
  const Layout ly = layout(*dy_desc), lb = layout(*db_desc);
  device_data(handle, dy, ly.bytes(), "cudnnConvolutionBackwardBias", "dy");
  device_data(handle, db, lb.bytes(), "cudnnConvolutionBackwardBias", "db");
  const bool round_first = round_before_blend();
  return queue(handle, [=] {
    const auto sums = [&](auto zero) {
      using A = decltype(zero);
      std::vector<A> v(size_t(ly.c), A(0));
      for (int64_t c = 0; c < ly.c; ++c) {
        A total = 0;
        for (int64_t n = 0; n < ly.n; ++n) {  // each image's sum, then the images'
          A part = 0;
          for (int64_t y = 0; y < ly.h; ++y)
            for (int64_t x = 0; x < ly.w; ++x) part += load<A>(dy, ly.type, ly.at(n, c, y, x));
          total += part;
        }
        v[size_t(c)] = total;
      }
      blend<A>(lb, db, v, A(al), A(be), round_first);
    };
    if (f64)
      sums(0.0);
    else
      sums(0.0f);
  });
}

// ---- convolutions ----------------------------------------------------------------------

cudnnStatus_t cudnnGetConvolutionForwardAlgorithmMaxCount(cudnnHandle_t handle, int* count) {
  if (!handle || !count) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  *count = 2 * CUDNN_CONVOLUTION_FWD_ALGO_COUNT;  // an algorithm once per math type
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithmMaxCount(cudnnHandle_t handle, int* count) {
  if (!handle || !count) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  *count = 2 * CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(cudnnHandle_t handle, int* count) {
  if (!handle || !count) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  *count = 2 * CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnFindConvolutionForwardAlgorithmEx(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t x_desc, const void* x,
    const cudnnFilterDescriptor_t w_desc, const void* w,
    const cudnnConvolutionDescriptor_t conv_desc, const cudnnTensorDescriptor_t y_desc, void* y,
    int requested, int* returned, cudnnConvolutionFwdAlgoPerf_t* results, void* workspace,
    size_t workspace_bytes) {
  return search(kFwd, "cudnnFindConvolutionForwardAlgorithmEx", handle, x_desc, w_desc, conv_desc,
                y_desc, x, w, y, requested, returned, results, workspace, workspace_bytes);
}
cudnnStatus_t cudnnFindConvolutionBackwardDataAlgorithmEx(
    cudnnHandle_t handle, const cudnnFilterDescriptor_t w_desc, const void* w,
    const cudnnTensorDescriptor_t dy_desc, const void* dy,
    const cudnnConvolutionDescriptor_t conv_desc, const cudnnTensorDescriptor_t dx_desc, void* dx,
    int requested, int* returned, cudnnConvolutionBwdDataAlgoPerf_t* results, void* workspace,
    size_t workspace_bytes) {
  return search(kBwdData, "cudnnFindConvolutionBackwardDataAlgorithmEx", handle, dx_desc, w_desc,
                conv_desc, dy_desc, w, dy, dx, requested, returned, results, workspace,
                workspace_bytes);
}
cudnnStatus_t cudnnFindConvolutionBackwardFilterAlgorithmEx(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t x_desc, const void* x,
    const cudnnTensorDescriptor_t dy_desc, const void* dy,
    const cudnnConvolutionDescriptor_t conv_desc, const cudnnFilterDescriptor_t dw_desc, void* dw,
    int requested, int* returned, cudnnConvolutionBwdFilterAlgoPerf_t* results, void* workspace,
    size_t workspace_bytes) {
  return search(kBwdFilter, "cudnnFindConvolutionBackwardFilterAlgorithmEx", handle, x_desc,
                dw_desc, conv_desc, dy_desc, x, dy, dw, requested, returned, results, workspace,
                workspace_bytes);
}

cudnnStatus_t cudnnGetConvolutionForwardWorkspaceSize(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t x_desc,
    const cudnnFilterDescriptor_t w_desc, const cudnnConvolutionDescriptor_t conv_desc,
    const cudnnTensorDescriptor_t y_desc, cudnnConvolutionFwdAlgo_t algo, size_t* bytes) {
  return workspace_size(kFwd, handle, x_desc, w_desc, conv_desc, y_desc, algo, bytes);
}
cudnnStatus_t cudnnGetConvolutionBackwardDataWorkspaceSize(
    cudnnHandle_t handle, const cudnnFilterDescriptor_t w_desc,
    const cudnnTensorDescriptor_t dy_desc, const cudnnConvolutionDescriptor_t conv_desc,
    const cudnnTensorDescriptor_t dx_desc, cudnnConvolutionBwdDataAlgo_t algo, size_t* bytes) {
  return workspace_size(kBwdData, handle, dx_desc, w_desc, conv_desc, dy_desc, algo, bytes);
}
cudnnStatus_t cudnnGetConvolutionBackwardFilterWorkspaceSize(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t x_desc,
    const cudnnTensorDescriptor_t dy_desc, const cudnnConvolutionDescriptor_t conv_desc,
    const cudnnFilterDescriptor_t dw_desc, cudnnConvolutionBwdFilterAlgo_t algo, size_t* bytes) {
  return workspace_size(kBwdFilter, handle, x_desc, dw_desc, conv_desc, dy_desc, algo, bytes);
}

cudnnStatus_t cudnnConvolutionForward(cudnnHandle_t handle, const void* alpha,
                                      const cudnnTensorDescriptor_t x_desc, const void* x,
                                      const cudnnFilterDescriptor_t w_desc, const void* w,
                                      const cudnnConvolutionDescriptor_t conv_desc,
                                      cudnnConvolutionFwdAlgo_t algo, void* workspace,
                                      size_t workspace_bytes, const void* beta,
                                      const cudnnTensorDescriptor_t y_desc, void* y) {
  return run(kFwd, "cudnnConvolutionForward", handle, alpha, x_desc, w_desc, conv_desc, y_desc,
             algo, x, w, y, workspace, workspace_bytes, beta);
}
cudnnStatus_t cudnnConvolutionBackwardData(cudnnHandle_t handle, const void* alpha,
                                           const cudnnFilterDescriptor_t w_desc, const void* w,
                                           const cudnnTensorDescriptor_t dy_desc, const void* dy,
                                           const cudnnConvolutionDescriptor_t conv_desc,
                                           cudnnConvolutionBwdDataAlgo_t algo, void* workspace,
                                           size_t workspace_bytes, const void* beta,
                                           const cudnnTensorDescriptor_t dx_desc, void* dx) {
  return run(kBwdData, "cudnnConvolutionBackwardData", handle, alpha, dx_desc, w_desc, conv_desc,
             dy_desc, algo, w, dy, dx, workspace, workspace_bytes, beta);
}
cudnnStatus_t cudnnConvolutionBackwardFilter(cudnnHandle_t handle, const void* alpha,
                                             const cudnnTensorDescriptor_t x_desc, const void* x,
                                             const cudnnTensorDescriptor_t dy_desc, const void* dy,
                                             const cudnnConvolutionDescriptor_t conv_desc,
                                             cudnnConvolutionBwdFilterAlgo_t algo, void* workspace,
                                             size_t workspace_bytes, const void* beta,
                                             const cudnnFilterDescriptor_t dw_desc, void* dw) {
  return run(kBwdFilter, "cudnnConvolutionBackwardFilter", handle, alpha, x_desc, dw_desc,
             conv_desc, dy_desc, algo, x, dy, dw, workspace, workspace_bytes, beta);
}
