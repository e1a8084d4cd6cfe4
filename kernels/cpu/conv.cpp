// CPU convolution. A few output channels at stride 1 (the segmentation head) run directly
// (conv_narrow.h), in NHWC only where oneDNN does not take them. Otherwise float32 and bfloat16 run on oneDNN where the build has it
// (conv_dnnl.h, either memory format); float64, and whatever oneDNN does not take, runs here on im2col +
// GEMM (OpenBLAS) in NCHW, other dtypes and formats converted to it and back (the end of this
// file).
//
// im2col + GEMM, two strategies.
//
// Banded (large output planes): the work items are (sample, band of output rows). Each OpenMP
// thread builds the column matrix of its band in its own workspace, sized to stay in cache,
// and runs a single-threaded GEMM on it (OpenBLAS runs single-threaded inside a parallel
// region):
//   forward:  Y_n[:, band] = W[O, K] · col_band[K, cols]                (ldc = OH*OW)
//   backward: dW_thread  += dY_n[:, band] · col_bandᵀ, summed over threads at the end
//             dcol_band   = Wᵀ · dY_n[:, band], col2im → dX_n
// Neighbouring bands read overlapping input rows, so dX is accumulated in two phases (even
// bands, then odd bands); bands of the same parity never overlap because every band but the
// last has at least ceil(kh / stride) rows.
//
// Grouped (small planes, deep layers): samples are grouped so the GEMM has >= 4096 columns
// (column buffer <= 64 MB) and OpenBLAS threads the GEMM itself:
//   Y_g[O, g*HW] = W · col_g,  dW += dY_g · col_gᵀ,  dcol_g = Wᵀ · dY_g.
//
// Gradient rule: grad_x / grad_w / grad_b are written when their beta is 0 and accumulated
// when it is 1. The column matrix is rebuilt from x in backward instead of being saved.
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/cpu/conv_dnnl.h"
#include "kernels/cpu/conv_narrow.h"
#include "kernels/cpu/gemm.h"
#include "kernels/launchers.h"
#include "kernels/cpu/workspace.h"
#include "bodies/bf16.h"
#include "bodies/elementwise.h"
#include "bodies/layout.h"

namespace unetcu::kernels::cpu {
namespace {

constexpr int64_t kMinGemmColumns = 4096;
constexpr int64_t kMaxColumnElements = int64_t(1) << 24;  // grouped strategy: 64 MB of float32
constexpr int64_t kBandBytes = int64_t(1) << 21;  // banded strategy: column matrix per band
constexpr int64_t kMinBandColumns = 256;

bool is_pointwise(const ConvGeometry& g) {
  return g.kh == 1 && g.kw == 1 && g.sh == 1 && g.sw == 1 && g.ph == 0 && g.pw == 0;
}

// out[ow] = src[ow * stride] and dst[ow * stride] += in[ow] for ow in [lo, hi); the stride-1
// cases are split out so they vectorise.
template <class T>
inline void copy_row(T* out, const T* src, int64_t lo, int64_t hi, int64_t stride) {
  if (stride == 1) {
    std::memcpy(out + lo, src + lo, size_t(hi - lo) * sizeof(T));
  } else {
    for (int64_t ow = lo; ow < hi; ++ow) out[ow] = src[ow * stride];
  }
}
template <class T>
inline void add_row(T* __restrict dst, const T* __restrict in, int64_t lo, int64_t hi,
                    int64_t stride) {
  if (stride == 1) {
    for (int64_t ow = lo; ow < hi; ++ow) dst[ow] += in[ow];
  } else {
    for (int64_t ow = lo; ow < hi; ++ow) dst[ow * stride] += in[ow];
  }
}

// Rows [r0, r1) of the output plane of one sample.
struct Band {
  int64_t n, r0, r1, parity;
};

// The banded plan, or empty when the planes are too small for it to pay off.
template <class T>
std::vector<Band> plan_bands(const ConvGeometry& g) {
  const int64_t K = g.C * g.kh * g.kw;
  const int threads = omp_get_max_threads();
  const int64_t cols = std::max<int64_t>(kMinBandColumns, kBandBytes / int64_t(sizeof(T)) / K);
  const int64_t min_rows = (g.kh + g.sh - 1) / g.sh;
  const int64_t rows = std::max<int64_t>({min_rows, (cols + g.OW - 1) / g.OW, 1});
  const int64_t bands = (g.OH + rows - 1) / rows;
  // Worth it only with enough items to share out and columns enough per GEMM.
  if (threads < 2 || g.N * bands < 2 * threads || rows * g.OW < kMinBandColumns) return {};
  std::vector<Band> plan;
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t b = 0; b < bands; ++b)
      plan.push_back({n, b * rows, std::min(g.OH, (b + 1) * rows), b & 1});
  return plan;
}

int64_t max_band_columns(const std::vector<Band>& plan, const ConvGeometry& g) {
  int64_t m = 0;
  for (const Band& b : plan) m = std::max(m, (b.r1 - b.r0) * g.OW);
  return m;
}

// One row of the column matrix: row = (c*kh + i)*kw + j, output rows [r0, r1) of one sample
// x_n [C, H, W], written to out[(oh - r0)*OW + ow].
template <class T>
void im2col_row(const T* x_n, int64_t row, int64_t r0, int64_t r1, const ConvGeometry& g, T* out) {
  const int64_t j = row % g.kw, i = (row / g.kw) % g.kh, c = row / (g.kw * g.kh);
  const T* plane = x_n + c * g.H * g.W;
  // Valid output columns: 0 <= ow*sw - pw + j < W.
  const int64_t lo = std::clamp<int64_t>((g.pw - j + g.sw - 1) / g.sw, 0, g.OW);
  const int64_t hi = std::clamp<int64_t>((g.W + g.pw - j + g.sw - 1) / g.sw, lo, g.OW);
  for (int64_t oh = r0; oh < r1; ++oh, out += g.OW) {
    const int64_t ih = oh * g.sh - g.ph + i;
    if (ih < 0 || ih >= g.H) {
      std::fill(out, out + g.OW, T(0));
      continue;
    }
    const T* src = plane + ih * g.W - g.pw + j;
    std::fill(out, out + lo, T(0));
    copy_row(out, src, lo, hi, g.sw);
    std::fill(out + hi, out + g.OW, T(0));
  }
}

// dx_n += the contribution of one column-matrix row (the inverse of im2col_row).
template <class T>
void col2im_row_add(const T* in, int64_t row, int64_t r0, int64_t r1, const ConvGeometry& g, T* dx_n) {
  const int64_t j = row % g.kw, i = (row / g.kw) % g.kh, c = row / (g.kw * g.kh);
  T* plane = dx_n + c * g.H * g.W;
  const int64_t lo = std::clamp<int64_t>((g.pw - j + g.sw - 1) / g.sw, 0, g.OW);
  const int64_t hi = std::clamp<int64_t>((g.W + g.pw - j + g.sw - 1) / g.sw, lo, g.OW);
  for (int64_t oh = r0; oh < r1; ++oh, in += g.OW) {
    const int64_t ih = oh * g.sh - g.ph + i;
    if (ih < 0 || ih >= g.H) continue;
    add_row(plane + ih * g.W - g.pw + j, in, lo, hi, g.sw);
  }
}

// col[K, (r1-r0)*OW] for output rows [r0, r1) of one sample.
template <class T>
void im2col_band(const T* x_n, int64_t r0, int64_t r1, const ConvGeometry& g, T* col) {
  const int64_t K = g.C * g.kh * g.kw, cols = (r1 - r0) * g.OW;
  for (int64_t row = 0; row < K; ++row) im2col_row(x_n, row, r0, r1, g, col + row * cols);
}

// dx_n += col2im(dcol) for output rows [r0, r1).
template <class T>
void col2im_band_add(const T* dcol, int64_t r0, int64_t r1, const ConvGeometry& g, T* dx_n) {
  const int64_t K = g.C * g.kh * g.kw, cols = (r1 - r0) * g.OW;
  for (int64_t row = 0; row < K; ++row) col2im_row_add(dcol + row * cols, row, r0, r1, g, dx_n);
}

// ---- banded strategy -----------------------------------------------------------------

template <class T>
void forward_banded(const T* x, const T* w, const T* b, T* y, const ConvGeometry& g,
                    const std::vector<Band>& plan) {
  const int64_t K = g.C * g.kh * g.kw, HW = g.OH * g.OW, CHW = g.C * g.H * g.W;
  const bool direct = is_pointwise(g);
  // Column buffers for every thread, taken before the parallel region (an allocation failure
  // must throw here, not inside it).
  const int threads = omp_get_max_threads();
  const int64_t band_elems = K * max_band_columns(plan, g);
  T* cols_all = direct ? nullptr : workspace<T>(WorkspaceSlot::Columns, size_t(threads * band_elems));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (size_t it = 0; it < plan.size(); ++it) {
    const Band& band = plan[it];
    const int64_t cols = (band.r1 - band.r0) * g.OW;
    const T* xn = x + band.n * CHW;
    const T* colp;
    int64_t ldb;
    if (direct) {  // x_n[:, band] is already the column matrix
      colp = xn + band.r0 * g.OW;
      ldb = HW;
    } else {
      T* col = cols_all + omp_get_thread_num() * band_elems;
      im2col_band(xn, band.r0, band.r1, g, col);
      colp = col;
      ldb = cols;
    }
    T* out = y + band.n * g.O * HW + band.r0 * g.OW;
    gemm(false, false, int(g.O), int(cols), int(K), T(1), w, int(K), colp, int(ldb), T(0), out,
         int(HW));
    if (b)
      for (int64_t o = 0; o < g.O; ++o)
        for (int64_t q = 0; q < cols; ++q) out[o * HW + q] += b[o];
  }
}

template <class T>
void backward_banded(const T* gy, const T* x, const T* w, T* gx, T beta_x, T* gw, T beta_w,
                     const ConvGeometry& g, const std::vector<Band>& plan) {
  const int64_t K = g.C * g.kh * g.kw, HW = g.OH * g.OW, CHW = g.C * g.H * g.W;
  const bool direct = is_pointwise(g);
  const int threads = omp_get_max_threads();
  // Per-thread weight-gradient partials, summed in a fixed order; with the static schedule each
  // thread always gets the same bands, so the result is the same from run to run.
  std::vector<T> partial(gw ? size_t(threads) * g.O * K : 0);
  const int64_t band_elems = K * max_band_columns(plan, g);
  T* cols_all = direct ? nullptr : workspace<T>(WorkspaceSlot::Columns, size_t(threads * band_elems));
  if (gx && beta_x == T(0) && !direct) std::memset(gx, 0, size_t(g.N * CHW) * sizeof(T));
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num();
    T* my_gw = gw ? partial.data() + size_t(tid) * g.O * K : nullptr;
    if (my_gw) std::fill(my_gw, my_gw + g.O * K, T(0));
    for (int parity = 0; parity < 2; ++parity) {
#pragma omp for schedule(static)
      for (size_t it = 0; it < plan.size(); ++it) {
        const Band& band = plan[it];
        if (band.parity != parity) continue;
        const int64_t cols = (band.r1 - band.r0) * g.OW;
        const T* xn = x + band.n * CHW;
        const T* dyb = gy + band.n * g.O * HW + band.r0 * g.OW;  // [O, cols], ld HW
        if (direct) {
          if (my_gw)
            gemm(false, true, int(g.O), int(K), int(cols), T(1), dyb, int(HW),
                 xn + band.r0 * g.OW, int(HW), T(1), my_gw, int(K));
          if (gx)  // 1×1, stride 1: bands never overlap, write straight into dx
            gemm(true, false, int(K), int(cols), int(g.O), T(1), w, int(K), dyb, int(HW), beta_x,
                 gx + band.n * CHW + band.r0 * g.OW, int(HW));
          continue;
        }
        T* col = cols_all + tid * band_elems;
        if (my_gw) {
          im2col_band(xn, band.r0, band.r1, g, col);
          gemm(false, true, int(g.O), int(K), int(cols), T(1), dyb, int(HW), col, int(cols), T(1),
               my_gw, int(K));
        }
        if (gx) {
          gemm(true, false, int(K), int(cols), int(g.O), T(1), w, int(K), dyb, int(HW), T(0), col,
               int(cols));
          col2im_band_add(col, band.r0, band.r1, g, gx + band.n * CHW);
        }
      }  // implicit barrier: all even bands are done before any odd band starts
    }
  }
  if (gw) {
    const int64_t n = g.O * K;
    for (int64_t q = 0; q < n; ++q) {
      T s = partial[q];
      for (int t = 1; t < threads; ++t) s += partial[size_t(t) * n + q];
      store(gw + q, s, beta_w);
    }
  }
}

// ---- grouped strategy ----------------------------------------------------------------

int64_t group_size(const ConvGeometry& g) {
  const int64_t K = g.C * g.kh * g.kw, HW = g.OH * g.OW;
  int64_t group = std::clamp<int64_t>((kMinGemmColumns + HW - 1) / HW, 1, std::max<int64_t>(g.N, 1));
  while (group > 1 && group * K * HW > kMaxColumnElements) --group;
  return group;
}

// col[K, gs*HW] from samples [n0, n0+gs), one output plane after another.
template <class T>
void im2col_group(const T* x, int64_t n0, int64_t gs, const ConvGeometry& g, T* col) {
  const int64_t K = g.C * g.kh * g.kw, HW = g.OH * g.OW, CHW = g.C * g.H * g.W;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < K; ++row)
    for (int64_t s = 0; s < gs; ++s)
      im2col_row(x + (n0 + s) * CHW, row, 0, g.OH, g, col + row * gs * HW + s * HW);
}

// dx[samples n0..) += col2im(dcol). Each thread owns whole input channels (the kh*kw rows of
// channel c write only channel c): no races.
template <class T>
void col2im_group_add(const T* dcol, int64_t n0, int64_t gs, const ConvGeometry& g, T* dx) {
  const int64_t HW = g.OH * g.OW, CHW = g.C * g.H * g.W, per_channel = g.kh * g.kw;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < g.C; ++c)
    for (int64_t row = c * per_channel; row < (c + 1) * per_channel; ++row)
      for (int64_t s = 0; s < gs; ++s)
        col2im_row_add(dcol + row * gs * HW + s * HW, row, 0, g.OH, g, dx + (n0 + s) * CHW);
}

// tmp[O, gs*HW] <-> y[n0+s][O][HW]
template <class T>
void scatter_group(const T* tmp, int64_t n0, int64_t gs, int64_t O, int64_t HW, T* y) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t s = 0; s < gs; ++s)
    for (int64_t o = 0; o < O; ++o)
      std::memcpy(y + ((n0 + s) * O + o) * HW, tmp + o * gs * HW + s * HW, size_t(HW) * sizeof(T));
}
template <class T>
void gather_group(const T* y, int64_t n0, int64_t gs, int64_t O, int64_t HW, T* tmp) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t s = 0; s < gs; ++s)
    for (int64_t o = 0; o < O; ++o)
      std::memcpy(tmp + o * gs * HW + s * HW, y + ((n0 + s) * O + o) * HW, size_t(HW) * sizeof(T));
}

template <class T>
void forward_grouped(const T* x, const T* w, const T* b, T* y, const ConvGeometry& g) {
  const int64_t K = g.C * g.kh * g.kw, HW = g.OH * g.OW;
  const int64_t group = group_size(g);
  // A 1×1/stride 1 conv over single samples needs no column matrix: x_n is already [C, HW].
  const bool direct = is_pointwise(g) && group == 1;
  T* col = direct ? nullptr : workspace<T>(WorkspaceSlot::Columns, size_t(K * group * HW));
  T* tmp = group > 1 ? workspace<T>(WorkspaceSlot::Scratch, size_t(g.O * group * HW)) : nullptr;
  for (int64_t n0 = 0; n0 < g.N; n0 += group) {
    const int64_t gs = std::min(group, g.N - n0), cols = gs * HW;
    const T* colp = col;
    if (direct)
      colp = x + n0 * g.C * g.H * g.W;
    else
      im2col_group(x, n0, gs, g, col);
    T* out = gs == 1 ? y + n0 * g.O * HW : tmp;
    gemm(false, false, int(g.O), int(cols), int(K), T(1), w, int(K), colp, int(cols), T(0), out,
         int(cols));
    if (gs > 1) scatter_group(tmp, n0, gs, g.O, HW, y);
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
void backward_grouped(const T* gy, const T* x, const T* w, T* gx, T beta_x, T* gw, T beta_w,
                      const ConvGeometry& g) {
  const int64_t K = g.C * g.kh * g.kw, HW = g.OH * g.OW;
  const int64_t group = group_size(g);
  const bool direct = is_pointwise(g) && group == 1;
  if (gx && beta_x == T(0) && !direct) std::memset(gx, 0, size_t(g.N * g.C * g.H * g.W) * sizeof(T));
  T* col = direct ? nullptr : workspace<T>(WorkspaceSlot::Columns, size_t(K * group * HW));
  T* tmp = group > 1 ? workspace<T>(WorkspaceSlot::Scratch, size_t(g.O * group * HW)) : nullptr;
  bool first_w = true;
  for (int64_t n0 = 0; n0 < g.N; n0 += group) {
    const int64_t gs = std::min(group, g.N - n0), cols = gs * HW;
    const T* dyg = gy + n0 * g.O * HW;
    if (gs > 1) {
      gather_group(gy, n0, gs, g.O, HW, tmp);
      dyg = tmp;
    }
    if (gw) {
      const T* colp = col;
      if (direct)
        colp = x + n0 * g.C * g.H * g.W;
      else
        im2col_group(x, n0, gs, g, col);
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
        gemm(true, false, int(K), int(cols), int(g.O), T(1), w, int(K), dyg, int(cols), T(0), col,
             int(cols));
        col2im_group_add(col, n0, gs, g, gx);
      }
    }
  }
}

template <class T>
void forward_impl(const T* x, const T* w, const T* b, T* y, const ConvGeometry& g) {
  const std::vector<Band> plan = plan_bands<T>(g);
  if (!plan.empty())
    forward_banded(x, w, b, y, g, plan);
  else
    forward_grouped(x, w, b, y, g);
}

template <class T>
void backward_impl(const T* gy, const T* x, const T* w, T* gx, T beta_x, T* gw, T beta_w, T* gb,
                   T beta_b, const ConvGeometry& g) {
  const int64_t HW = g.OH * g.OW;
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
  const std::vector<Band> plan = plan_bands<T>(g);
  if (!plan.empty())
    backward_banded(gy, x, w, gx, beta_x, gw, beta_w, g, plan);
  else
    backward_grouped(gy, x, w, gx, beta_x, gw, beta_w, g);
}

// ---- bfloat16 and NHWC on the paths above ---------------------------------------------
//
// The im2col path reads float32 or float64 NCHW/OIHW. Other tensors (bfloat16, NHWC, OHWI)
// are converted to float32 NCHW (float64 for float64 tensors) in per-thread staging buffers,
// run on the float32/float64 path (oneDNN or im2col, whichever is on), and the results
// converted back: bfloat16 results are rounded once, and an accumulated gradient is added to
// its tensor in float32 (float64) and rounded once, by the convert launcher. Slower than a
// kernel that reads them, but the same arithmetic on every CPU.

enum class Staged { X, W, B, Y, GradX, GradW, Count };

void* staged_bytes(Staged slot, size_t bytes) {
  struct Buffer {
    void* ptr = nullptr;
    size_t bytes = 0;
    ~Buffer() { std::free(ptr); }
  };
  static thread_local Buffer buffers[int(Staged::Count)];
  Buffer& b = buffers[int(slot)];
  if (b.bytes < bytes) {
    std::free(b.ptr);
    b.bytes = 0;
    b.ptr = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!b.ptr) throw Error(str_cat("out of host memory for a ", bytes, "-byte conv staging buffer"));
    b.bytes = bytes;
  }
  return b.ptr;
}

// A staging tensor of t's shape in `type`, NCHW (uninitialised), and one holding t's values.
TensorRef staged_like(Staged slot, const TensorRef& t, DType type) {
  void* p = staged_bytes(slot, size_t(t.numel()) * dtype_size(type));
  return TensorRef(p, type, t.device(), t.shape(), MemoryFormat::NCHW);
}
TensorRef staged_copy(Staged slot, const TensorRef& t, DType type) {
  TensorRef r = staged_like(slot, t, type);
  convert(t, r, 0);
  return r;
}

DType compute_type(const TensorRef& x) { return x.dtype() == DType::F64 ? DType::F64 : DType::F32; }

// float32/float64 NCHW x and OIHW w: what im2col reads.
bool plain(const TensorRef& x, const TensorRef& w) {
  return x.dtype() != DType::BF16 && !x.nhwc() && !w.nhwc();
}

// oneDNN is tried first for float32, and for bfloat16 where it has bfloat16 kernels.
bool onednn_takes(const TensorRef& x) {
  if (cpu_conv_impl() != CpuConvImpl::OneDnn) return false;
  return x.dtype() == DType::F32 || (x.dtype() == DType::BF16 && onednn_bf16_usable());
}

// The direct path for few output channels (conv_narrow.h): in NCHW 3-4x faster than oneDNN
// and im2col on the segmentation head; in NHWC only where oneDNN does not take the tensor
// (there it is as fast in float32 and faster in bfloat16, bench_layers --layer conv).
bool direct(const TensorRef& x, const ConvGeometry& g) {
  return narrow_conv_takes(g) && (!x.nhwc() || !onednn_takes(x));
}

// gb[c] = sum of gy over n, h, w (in float64), written or accumulated (in gb's compute type,
// rounded once) by beta; for gy in either format.
template <class S>
void bias_grad(const S* gy, const Dims4& d, S* gb, double beta) {
  const int64_t C = d.C, HW = d.H * d.W;
  std::vector<double> sums(size_t(C), 0.0);
  if (!d.nhwc) {
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < C; ++c) {
      double acc = 0;
      for (int64_t n = 0; n < d.N; ++n) {
        const S* p = gy + (n * C + c) * HW;
        for (int64_t q = 0; q < HW; ++q) acc += double(acc_t<S>(p[q]));
      }
      sums[size_t(c)] = acc;
    }
  } else {
    // Pixels are shared out among the threads, each summing into its own row of partials;
    // the rows are added in thread order, so a given thread count gives the same bits.
    const int threads = omp_get_max_threads();
    const int64_t pixels = d.N * HW;
    std::vector<double> partial(size_t(threads) * size_t(C), 0.0);
#pragma omp parallel num_threads(threads)
    {
      double* mine = partial.data() + size_t(omp_get_thread_num()) * size_t(C);
#pragma omp for schedule(static)
      for (int64_t p = 0; p < pixels; ++p) {
        const S* row = gy + p * C;
        for (int64_t c = 0; c < C; ++c) mine[c] += double(acc_t<S>(row[c]));
      }
    }
    for (int t = 0; t < threads; ++t)
      for (int64_t c = 0; c < C; ++c) sums[size_t(c)] += partial[size_t(t) * size_t(C) + size_t(c)];
  }
  using A = acc_t<S>;
  for (int64_t c = 0; c < C; ++c) {
    const A v = A(sums[size_t(c)]);
    gb[c] = to_storage<S>(beta != 0 ? A(acc_t<S>(gb[c])) + v : v);
  }
}

void bias_grad(const TensorRef& grad_y, const TensorRef& grad_b, double beta, const ConvGeometry& g) {
  if (plain(grad_y, grad_y)) {  // float32/float64 NCHW: the sum of backward_impl
    UNETCU_DISPATCH_FLOAT(grad_y.dtype(), T,
                          backward_impl<T>(grad_y.data<T>(), nullptr, nullptr, nullptr, T(0),
                                           nullptr, T(0), grad_b.data<T>(), T(beta), g));
    return;
  }
  UNETCU_DISPATCH_STORAGE(grad_y.dtype(), S,
                          bias_grad(grad_y.data<S>(), grad_y.dims4(), grad_b.data<S>(), beta));
}

}  // namespace

bool conv2d_uses_bands(const ConvGeometry& g, DType dtype) {
  return dtype == DType::F32 ? !plan_bands<float>(g).empty() : !plan_bands<double>(g).empty();
}

void conv2d_forward(const TensorRef& x, const TensorRef& w, const TensorRef& b, const TensorRef& y,
                    const ConvGeometry& g) {
  if (direct(x, g)) return narrow_conv2d_forward(x, w, b, y, g);
  if (onednn_takes(x) && onednn_conv2d_forward(x, w, b, y, g)) return;
  if (plain(x, w)) {
    UNETCU_DISPATCH_FLOAT(x.dtype(), T, forward_impl<T>(x.data<T>(), w.data<T>(),
                                                        b.defined() ? b.data<T>() : nullptr,
                                                        y.data<T>(), g));
    return;
  }
  const DType ct = compute_type(x);
  const TensorRef xs = staged_copy(Staged::X, x, ct), ws = staged_copy(Staged::W, w, ct);
  const TensorRef bs = b.defined() ? staged_copy(Staged::B, b, ct) : TensorRef();
  const TensorRef ys = staged_like(Staged::Y, y, ct);
  conv2d_forward(xs, ws, bs, ys, g);  // plain: oneDNN float32 or im2col
  convert(ys, y, 0);
}

void conv2d_backward(const TensorRef& grad_y, const TensorRef& x, const TensorRef& w,
                     const TensorRef& grad_x, double beta_x, const TensorRef& grad_w, double beta_w,
                     const TensorRef& grad_b, double beta_b, const ConvGeometry& g) {
  if (direct(x, g))
    return narrow_conv2d_backward(grad_y, x, w, grad_x, beta_x, grad_w, beta_w, grad_b, beta_b, g);
  const bool data_or_weights = grad_x.defined() || grad_w.defined();
  if (data_or_weights && onednn_takes(x) &&
      onednn_conv2d_backward(grad_y, x, w, grad_x, beta_x, grad_w, beta_w, g)) {
    // The bias gradient is a plain sum over dY here; oneDNN did the data and weight gradients.
    if (grad_b.defined()) bias_grad(grad_y, grad_b, beta_b, g);
    return;
  }
  if (plain(x, w)) {
    UNETCU_DISPATCH_FLOAT(
        x.dtype(), T,
        backward_impl<T>(grad_y.data<T>(), x.data<T>(), w.data<T>(),
                         grad_x.defined() ? grad_x.data<T>() : nullptr, T(beta_x),
                         grad_w.defined() ? grad_w.data<T>() : nullptr, T(beta_w),
                         grad_b.defined() ? grad_b.data<T>() : nullptr, T(beta_b), g));
    return;
  }
  if (grad_b.defined()) bias_grad(grad_y, grad_b, beta_b, g);
  if (!data_or_weights) return;
  const DType ct = compute_type(x);
  const TensorRef gys = staged_copy(Staged::Y, grad_y, ct);
  const TensorRef xs = staged_copy(Staged::X, x, ct), ws = staged_copy(Staged::W, w, ct);
  const TensorRef gxs = grad_x.defined() ? staged_like(Staged::GradX, grad_x, ct) : TensorRef();
  const TensorRef gws = grad_w.defined() ? staged_like(Staged::GradW, grad_w, ct) : TensorRef();
  conv2d_backward(gys, xs, ws, gxs, 0, gws, 0, TensorRef(), 0, g);  // plain, written
  if (grad_x.defined()) convert(gxs, grad_x, beta_x);
  if (grad_w.defined()) convert(gws, grad_w, beta_w);
}

}  // namespace unetcu::kernels::cpu
