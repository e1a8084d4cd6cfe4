// CUDA batch normalisation, plain, synchronized and fused with the residual add and ReLU, over
// the bodies the CPU runs (bodies/batchnorm.h), with the CPU's arithmetic: activations
// stored as float32 or bfloat16 (S) in NCHW or NHWC, the per-channel tensors and all
// arithmetic in float32 (acc_t<S>), the sums of a channel in double. Training statistics are
// shifted sums (well conditioned however large the mean); the running statistics follow
// PyTorch (momentum, unbiased variance).
//
// Per-channel reductions (statistics, the backward's sums) run over many blocks per channel:
// a grid of (chunk, channel) blocks each writes its partial sums to scratch from the caching
// allocator, then one block per channel adds its partials in a fixed order and finishes
// (statistics, dgamma/dbeta). Deterministic, no atomics, and a channel of any size fills the
// GPU.
//   NCHW: a chunk is part of one (n, c) plane (up to kReducePerBlock values): grid
//     (N * parts, C), threads striding along the plane.
//   NHWC: the channel is innermost, so a block is (channels, pixel rows): threadIdx.x over up
//     to 32 consecutive channels (a warp reads consecutive addresses), threadIdx.y over
//     pixels; grid (pixel chunks, channel groups). The rows' sums are added in shared memory
//     in a fixed tree.
// Elementwise passes: NCHW over (plane, part) blocks, NHWC over the same (channels, pixel rows)
// blocks; each thread keeps its channels' constants in registers. No index division per
// element (one per block).
// Packs: where the packed dimension (C in NHWC, a plane in NCHW) holds whole 16-byte packs
// and every pointer is aligned (packed()), each thread access moves one pack (V = 8 bf16 or 4
// floats: in NHWC V consecutive channels, each with its own constants and sums; in NCHW V
// values of one plane), else one value (V = 1). The per-element arithmetic is the same; a
// reduction's partial sums group by pack (V sums a thread, added in order before the block's
// tree in NCHW), so the two paths may differ in the last bits, each the same run to run.
//
// Gradient rule: each gradient is written (beta 0) or accumulated (beta 1) by its own beta,
// in the compute type, rounded once to the storage type.
#include "kernels/cuda/common.cuh"
#include "bodies/batchnorm.h"
#include "bodies/elementwise.h"
#include "kernels/launchers.h"

namespace unetcu::kernels::cuda {
namespace {

using Geo = BnGeometry;  // bodies/batchnorm.h
Geo geo_of(const TensorRef& x) { return {x.dim(0), x.dim(1), x.dim(2) * x.dim(3), x.nhwc()}; }

// Runs f(S{}) with S the storage type of the activations: float32 or bf16 (the CUDA backend
// computes in float32; the op layer refuses float64).
template <class F> void dispatch_storage(DType dtype, F&& f) {
  if (dtype == DType::BF16)
    f(bf16{});
  else if (dtype == DType::F32)
    f(float{});
  else
    UNETCU_CHECK(false, "CUDA batch norm: no ", dtype_name(dtype), " kernel");
}

template <class T> T* data_or_null(const TensorRef& t) { return t.defined() ? t.data<T>() : nullptr; }

// ---- geometry ----------------------------------------------------------------------------

constexpr int64_t kReducePerBlock = 8 * kThreads;  // NCHW: values a reduction block sums
constexpr int64_t kPixelsPerThread = 16;           // NHWC: pixels a reduction thread sums

// NHWC blocks: cb channels (a power of two up to 32) by kThreads / cb pixel rows.
struct NhwcBlock {
  int cb, rows;
  unsigned groups;  // channel groups: ceil(C / cb)
};
NhwcBlock nhwc_block(int64_t C) {
  int cb = 1;
  while (cb < 32 && cb < C) cb *= 2;
  const int64_t groups = (C + cb - 1) / cb;
  UNETCU_CHECK(groups <= 65535, "batch norm: too many channels for one launch");
  return {cb, kThreads / cb, unsigned(groups)};
}

// ---- reductions --------------------------------------------------------------------------
//
// A Term gives, per channel, its constants (channel(c, first): first is the memory index of
// the channel's first element) and adds one element's two terms (add(k, i, a, b)). Partials
// are laid out [2][C][k]: k partials of each channel, first sums then second.

// Shifted sums (x - shift, (x - shift)²) with the channel's first element as the shift, or
// plain sums (shift 0) for the synchronized statistics.
template <class S> struct StatsTerm {
  using Consts = double;
  const S* x;
  bool shifted;
  bool packs(size_t bytes) const { return aligned_to(bytes, x); }
  __device__ double channel(int64_t, int64_t first) const {
    return shifted ? double(acc_t<S>(x[first])) : 0.0;
  }
  template <int V>
  __device__ void add(const double (&shift)[V], int64_t i, double (&a)[V], double (&b)[V]) const {
    acc_t<S> v[V];
    load_pack<V>(x + i, v);
    for (int j = 0; j < V; ++j) bn_stats_accumulate(v[j], shift[j], a[j], b[j]);
  }
};

// (g, g * xhat): g = bn_relu_grad<M>(dy, ...): dy (the plain batch norm), or dy where the
// fused op's output is positive, read from y (stored_y) or recomputed from x, gamma and beta
// (from_x; y absent and not read).
template <class S, ReluMask M> struct GradTerm {
  using T = acc_t<S>;
  static constexpr bool kAffine = M == ReluMask::from_x;
  struct Consts {
    T mean, invstd, gamma, beta;
  };
  const S *dy, *y, *x;
  const T *mean, *invstd, *gamma, *beta;  // gamma and beta: from_x only
  bool packs(size_t bytes) const { return aligned_to(bytes, dy, y, x); }
  __device__ Consts channel(int64_t c, int64_t) const {
    return {mean[c], invstd[c], kAffine ? gamma[c] : T(0), kAffine ? beta[c] : T(0)};
  }
  template <int V>
  __device__ void add(const Consts (&k)[V], int64_t i, double (&a)[V], double (&b)[V]) const {
    T dyv[V], xv[V], yv[V] = {};
    load_pack<V>(dy + i, dyv);
    load_pack<V>(x + i, xv);
    if constexpr (M == ReluMask::stored_y) load_pack<V>(y + i, yv);
    for (int j = 0; j < V; ++j) {
      const T g = bn_relu_grad<M, S>(dyv[j], yv[j], xv[j], k[j].mean, k[j].invstd, k[j].gamma,
                                     k[j].beta);
      const T xhat = (xv[j] - k[j].mean) * k[j].invstd;
      a[j] += double(g);
      b[j] += double(g) * double(xhat);
    }
  }
};

// NCHW: block (n, part) of channel blockIdx.y sums values [lo, hi) of plane (n, c), V values
// (a pack) at a time: HW and chunk multiples of V.
template <int V, class Term>
__global__ void nchw_partials_kernel(Term term, int64_t C, int64_t HW, int parts, int64_t chunk,
                                     double* partials) {
  const int64_t c = blockIdx.y;
  const int n = int(blockIdx.x) / parts, part = int(blockIdx.x) - n * parts;
  const int64_t base = (int64_t(n) * C + c) * HW;
  typename Term::Consts k[V];
  k[0] = term.channel(c, c * HW);
  for (int j = 1; j < V; ++j) k[j] = k[0];
  const int64_t lo = part * chunk, hi = min(HW, lo + chunk);
  double av[V] = {}, bv[V] = {};
  for (int64_t q = lo + int64_t(threadIdx.x) * V; q < hi; q += int64_t(blockDim.x) * V)
    term.template add<V>(k, base + q, av, bv);
  double a = 0, b = 0;
  for (int j = 0; j < V; ++j) {
    a += av[j];
    b += bv[j];
  }
  a = block_sum(a);
  b = block_sum(b);
  if (threadIdx.x == 0) {
    const int64_t nk = gridDim.x;
    partials[c * nk + blockIdx.x] = a;
    partials[(C + c) * nk + blockIdx.x] = b;
  }
}

// NHWC: block (chunk, group): channels c0 = (group * blockDim.x + threadIdx.x) * V and the
// V - 1 after it (a pack; C a multiple of V), pixels [chunk * chunk_pixels, +chunk_pixels)
// strided by blockDim.y rows; the rows' sums added in shared memory (blockDim.y a power of
// two) in a fixed tree.
template <int V, class Term>
__global__ void nhwc_partials_kernel(Term term, int64_t C, int64_t P, int64_t chunk_pixels,
                                     double* partials) {
  __shared__ double sa[kThreads * V], sb[kThreads * V];
  const int cx = threadIdx.x, ry = threadIdx.y, cb = blockDim.x;
  const int64_t c0 = (int64_t(blockIdx.y) * cb + cx) * V;
  double a[V] = {}, b[V] = {};
  if (c0 < C) {
    typename Term::Consts k[V];
    for (int j = 0; j < V; ++j) k[j] = term.channel(c0 + j, c0 + j);
    const int64_t p0 = int64_t(blockIdx.x) * chunk_pixels + ry;
    const int64_t p1 = min(P, int64_t(blockIdx.x + 1) * chunk_pixels);
    const int64_t step = int64_t(blockDim.y) * C;
    int64_t i = p0 * C + c0;
    for (int64_t p = p0; p < p1; p += blockDim.y, i += step) term.template add<V>(k, i, a, b);
  }
  const int slot = (ry * cb + cx) * V;
  for (int j = 0; j < V; ++j) {
    sa[slot + j] = a[j];
    sb[slot + j] = b[j];
  }
  __syncthreads();
  for (int s = int(blockDim.y) / 2; s > 0; s /= 2) {
    if (ry < s) {
      const int other = slot + s * cb * V;
      for (int j = 0; j < V; ++j) {
        sa[slot + j] += sa[other + j];
        sb[slot + j] += sb[other + j];
      }
    }
    __syncthreads();
  }
  if (ry == 0 && c0 < C) {
    const int64_t nk = gridDim.x;
    for (int j = 0; j < V; ++j) {
      partials[(c0 + j) * nk + blockIdx.x] = sa[slot + j];
      partials[(C + c0 + j) * nk + blockIdx.x] = sb[slot + j];
    }
  }
}

// One block per channel: its k partials added in a fixed order (thread-strided, then the block
// tree), then finish(c, s1, s2) in thread 0. k = 0 (no values) gives zero sums.
template <class Finish>
__global__ void finish_kernel(const double* partials, int64_t k, int64_t C, Finish finish) {
  const int64_t c = blockIdx.x;
  double a = 0, b = 0;
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
    a += partials[c * k + j];
    b += partials[(C + c) * k + j];
  }
  a = block_sum(a);
  b = block_sum(b);
  if (threadIdx.x == 0) finish(c, a, b);
}

// Mean, invstd and the running statistics of channel c from its shifted sums.
template <class S> struct StatsFinish {
  using T = acc_t<S>;
  const S* x;  // for the shift: the channel's first element
  int64_t HW;
  bool nhwc;
  double count, momentum, eps;
  T *mean, *invstd, *rm, *rv;
  __device__ void operator()(int64_t c, double s1, double s2) const {
    const double shift = double(T(x[nhwc ? c : c * HW]));
    double mu, var;  // var biased: used to normalise
    bn_stats_finish(s1, s2, count, shift, mu, var);
    mean[c] = T(mu);
    invstd[c] = T(1.0 / sqrt(var + eps));
    rm[c] = bn_running_update(rm[c], T(mu), T(momentum));
    rv[c] = bn_running_update(rv[c], T(var * count / (count - 1)), T(momentum));
  }
};

// sums [2, C] written; dgamma = second sum, dbeta = first, each absent or stored by its beta.
struct SumsFinish {
  double* sums;
  int64_t C;
  float *dgamma, beta_gamma, *dbeta, beta_beta;
  __device__ void operator()(int64_t c, double a, double b) const {
    sums[c] = a;
    sums[C + c] = b;
    if (dgamma) store(dgamma + c, float(b), beta_gamma);
    if (dbeta) store(dbeta + c, float(a), beta_beta);
  }
};

// Whether a pass over the geometry can move packs of S: the packed dimension (C in NHWC, a
// plane in NCHW) a multiple of a pack, and every pointer of the term or op aligned to one.
template <class S, class TermOrOp> bool geo_packs(const Geo& d, const TermOrOp& t) {
  return packs_fit<S>({d.nhwc ? d.C : d.HW}) && t.packs(sizeof(S) * kPack<S>);
}

// The partials of term over the geometry, V values (a pack) a thread access, then finish per
// channel; the partials in scratch from the caching allocator on the stream.
template <int V, class Term, class Finish>
void reduce_packed(const Geo& d, const Term& term, const Finish& finish, int device,
                   cudaStream_t stream, const char* what) {
  if (d.C == 0) return;
  const int64_t P = d.pixels();
  int64_t k = 0, parts = 0, chunk = 0;  // k: partials per channel
  NhwcBlock nb{};
  if (P > 0) {
    if (d.nhwc) {
      nb = nhwc_block(d.C / V);
      chunk = int64_t(nb.rows) * kPixelsPerThread;  // pixels
      k = (P + chunk - 1) / chunk;
    } else {
      UNETCU_CHECK(d.C <= 65535, "batch norm: more than 65535 channels");
      parts = (d.HW + kReducePerBlock - 1) / kReducePerBlock;
      chunk = (d.HW + parts - 1) / parts;  // values of a plane, a multiple of V
      chunk = (chunk + V - 1) / V * V;
      k = d.N * parts;
    }
    UNETCU_CHECK(k < (int64_t(1) << 31), "batch norm: input too large for one launch");
  }
  UNETCU_CHECK(d.C < (int64_t(1) << 31), "batch norm: too many channels for one launch");
  unetcu::cuda::DeviceBuffer partials(device, size_t(2 * d.C * k) * sizeof(double));
  double* pp = static_cast<double*>(partials.get());
  if (k > 0) {
    if (d.nhwc)
      nhwc_partials_kernel<V><<<dim3(unsigned(k), nb.groups),
                                dim3(unsigned(nb.cb), unsigned(nb.rows)), 0, stream>>>(
          term, d.C, P, chunk, pp);
    else
      nchw_partials_kernel<V><<<dim3(unsigned(k), unsigned(d.C)), kThreads, 0, stream>>>(
          term, d.C, d.HW, int(parts), chunk, pp);
    CUDA_CHECK_LAUNCH(stream, what);
  }
  finish_kernel<<<unsigned(d.C), kThreads, 0, stream>>>(pp, k, d.C, finish);
  CUDA_CHECK_LAUNCH(stream, what);
}

// reduce_packed in packs of 16 bytes where the geometry and pointers allow, else one value at
// a time. S: the storage type the term reads.
template <class S, class Term, class Finish>
void reduce(const Geo& d, const Term& term, const Finish& finish, int device, cudaStream_t stream,
            const char* what) {
  with_pack<S>(geo_packs<S>(d, term), [&](auto pack) {
    reduce_packed<decltype(pack)::value>(d, term, finish, device, stream, what);
  });
}

// ---- elementwise passes ------------------------------------------------------------------
//
// An Op gives, per channel, its constants (channel(c)) and handles one element (op(k, i)).

// NCHW: block (plane nc, part): the plane's channel once per block; V values (a pack) a
// thread access (HW a multiple of V).
template <int V, class Op>
__global__ void nchw_elementwise_kernel(Op op, int64_t C, int64_t HW) {
  const int64_t nc = blockIdx.x, base = nc * HW;
  typename Op::Consts k[V];
  k[0] = op.channel(nc % C);
  for (int j = 1; j < V; ++j) k[j] = k[0];
  for (int64_t q = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * V; q < HW;
       q += int64_t(gridDim.y) * blockDim.x * V)
    op.template apply<V>(k, base + q);
}

// NHWC: block (pixel block, channel group): thread (cx, ry) keeps channels
// c0 = (group * blockDim.x + cx) * V and the V - 1 after it (a pack; C a multiple of V) and
// strides over pixels.
template <int V, class Op>
__global__ void nhwc_elementwise_kernel(Op op, int64_t C, int64_t P) {
  const int64_t c0 = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * V;
  if (c0 >= C) return;
  typename Op::Consts k[V];
  for (int j = 0; j < V; ++j) k[j] = op.channel(c0 + j);
  const int64_t p0 = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t stride = int64_t(gridDim.x) * blockDim.y;
  for (int64_t p = p0, i = p0 * C + c0; p < P; p += stride, i += stride * C)
    op.template apply<V>(k, i);
}

template <int V, class Op>
void elementwise_packed(const Geo& d, const Op& op, cudaStream_t stream, const char* what) {
  if (d.nhwc) {
    const NhwcBlock nb = nhwc_block(d.C / V);
    // Each thread takes a few pixels; at most 65535 pixel blocks (the grid strides).
    const int64_t per_block = int64_t(nb.rows) * 4;
    const int64_t blocks = std::clamp<int64_t>((d.pixels() + per_block - 1) / per_block, 1, 65535);
    nhwc_elementwise_kernel<V><<<dim3(unsigned(blocks), nb.groups),
                                 dim3(unsigned(nb.cb), unsigned(nb.rows)), 0, stream>>>(
        op, d.C, d.pixels());
  } else {
    const int64_t planes = d.N * d.C;
    UNETCU_CHECK(planes < (int64_t(1) << 31), "batch norm: too many planes for one launch");
    const int64_t per_block = 4 * kThreads * V;
    const int64_t parts = std::clamp<int64_t>((d.HW + per_block - 1) / per_block, 1, 65535);
    nchw_elementwise_kernel<V><<<dim3(unsigned(planes), unsigned(parts)), kThreads, 0, stream>>>(
        op, d.C, d.HW);
  }
  CUDA_CHECK_LAUNCH(stream, what);
}

// op over every element, in packs of 16 bytes where the geometry and pointers allow, else one
// value at a time. S: the storage type the op reads and writes.
template <class S, class Op>
void elementwise(const Geo& d, const Op& op, cudaStream_t stream, const char* what) {
  if (d.pixels() == 0 || d.C == 0) return;
  with_pack<S>(geo_packs<S>(d, op), [&](auto pack) {
    elementwise_packed<decltype(pack)::value>(d, op, stream, what);
  });
}

template <class T> struct NormConsts {
  T mean, invstd, gamma, beta;
};

// y = bn_normalize(x) (+ residual, relu: kFused) with per-channel mean and invstd; eval mode
// passes the running variance instead (invstd computed per channel as the CPU does).
template <class S, bool kFused> struct NormalizeOp {
  using T = acc_t<S>;
  using Consts = NormConsts<T>;
  const S* x;
  const S* residual;  // kFused only; may be absent
  S* y;
  const T *gamma, *beta, *mean, *invstd;
  const T* running_var;  // instead of invstd when set
  double eps;
  bool packs(size_t bytes) const { return aligned_to(bytes, x, residual, y); }
  __device__ Consts channel(int64_t c) const {
    const T is = running_var ? T(1.0 / sqrt(double(running_var[c]) + eps)) : invstd[c];
    return {mean[c], is, gamma[c], beta[c]};
  }
  // Elements [i, i + V), element j with the constants k[j].
  template <int V> __device__ void apply(const Consts (&k)[V], int64_t i) const {
    T xv[V], rv[V] = {}, out[V];
    load_pack<V>(x + i, xv);
    if (kFused && residual) load_pack<V>(residual + i, rv);
    for (int j = 0; j < V; ++j) {
      if constexpr (kFused) {
        out[j] = residual ? bn_add_relu_forward(xv[j], k[j].mean, k[j].invstd, k[j].gamma,
                                                k[j].beta, rv[j])
                          : bn_relu_forward(xv[j], k[j].mean, k[j].invstd, k[j].gamma, k[j].beta);
      } else {
        out[j] = bn_normalize(xv[j], k[j].mean, k[j].invstd, k[j].gamma, k[j].beta);
      }
    }
    store_pack<V>(y + i, out);
  }
};

template <class T> struct GradConsts {
  T mean, invstd, gamma_invstd, sum_g, sum_g_xhat, gamma, beta;
};

// dx (and, fused, the residual's gradient g) from the channel sums [2, C] (absent where not
// needed), g = bn_relu_grad<M>(dy, ...) as in GradTerm.
template <class S, ReluMask M> struct GradApplyOp {
  using T = acc_t<S>;
  using Consts = GradConsts<T>;
  static constexpr bool kAffine = M == ReluMask::from_x;
  const S *dy, *y, *x;
  const T *gamma, *beta, *mean, *invstd;  // beta: from_x only
  const double* sums;
  int64_t C;
  T inv_m;
  bool training;
  S* dx;
  T beta_x;
  S* dr;  // fused only
  T beta_r;
  bool packs(size_t bytes) const { return aligned_to(bytes, dy, y, x, dx, dr); }
  __device__ Consts channel(int64_t c) const {
    const T is = invstd[c];
    return {mean[c],
            is,
            gamma[c] * is,
            sums ? T(sums[c]) : T(0),
            sums ? T(sums[C + c]) : T(0),
            kAffine ? gamma[c] : T(0),
            kAffine ? beta[c] : T(0)};
  }
  // Elements [i, i + V), element j with the constants k[j].
  template <int V> __device__ void apply(const Consts (&k)[V], int64_t i) const {
    T g[V], xv[V] = {}, yv[V] = {}, out[V];
    load_pack<V>(dy + i, g);
    if constexpr (M == ReluMask::stored_y) load_pack<V>(y + i, yv);
    if (kAffine || (dx && training)) load_pack<V>(x + i, xv);
    for (int j = 0; j < V; ++j)
      g[j] = bn_relu_grad<M, S>(g[j], yv[j], xv[j], k[j].mean, k[j].invstd, k[j].gamma,
                                k[j].beta);
    if (dx) {
      for (int j = 0; j < V; ++j)
        out[j] = training ? bn_backward_train(g[j], (xv[j] - k[j].mean) * k[j].invstd,
                                              k[j].gamma_invstd, inv_m, k[j].sum_g,
                                              k[j].sum_g_xhat)
                          : g[j] * k[j].gamma_invstd;
      store_pack<V>(dx + i, out, beta_x);
    }
    if (M != ReluMask::none && dr) store_pack<V>(dr + i, g, beta_r);
  }
};

__global__ void eval_stats_kernel(const float* rm, const float* rv, double eps, float* mean,
                                  float* invstd, int64_t C) {
  GRID_STRIDE(c, C) {
    mean[c] = rm[c];
    invstd[c] = float(1.0 / sqrt(double(rv[c]) + eps));
  }
}

__global__ void sync_stats_kernel(const double* s, double count, double momentum, double eps,
                                  float* mean, float* invstd, float* rm, float* rv, int64_t C) {
  GRID_STRIDE(c, C) {
    const double mu = s[c] / count;
    const double var = fmax(0.0, s[C + c] / count - mu * mu);
    mean[c] = float(mu);
    invstd[c] = float(1.0 / sqrt(var + eps));
    rm[c] = bn_running_update(rm[c], float(mu), float(momentum));
    rv[c] = bn_running_update(rv[c], float(var * count / (count - 1)), float(momentum));
  }
}

__global__ void param_grads_kernel(const double* s, float* dg, float beta_g, float* db,
                                   float beta_b, int64_t C) {
  GRID_STRIDE(c, C) {
    if (dg) store(dg + c, float(s[C + c]), beta_g);
    if (db) store(db + c, float(s[c]), beta_b);
  }
}

// Training statistics of x into mean/invstd, running statistics updated.
template <class S>
void launch_stats(const TensorRef& x, const TensorRef& mean, const TensorRef& invstd,
                  const TensorRef& running_mean, const TensorRef& running_var, double momentum,
                  double eps, cudaStream_t stream, const char* what) {
  const Geo d = geo_of(x);
  const StatsTerm<S> term{x.data<S>(), true};
  const StatsFinish<S> finish{x.data<S>(), d.HW, d.nhwc, double(d.pixels()), momentum, eps,
                              mean.data<float>(), invstd.data<float>(),
                              running_mean.data<float>(), running_var.data<float>()};
  reduce<S>(d, term, finish, x.device().index, stream, what);
}

// Backward of batch_norm2d (M none: y absent, g = dy) and of the fused op (g = dy where its
// output is positive, from y or from x, gamma and beta): the sums when any gradient needs them
// (dgamma and dbeta stored by the finish), then dx (and the residual's gradient) in one
// elementwise pass.
template <class S, ReluMask M>
void launch_backward(const TensorRef& grad_y, const TensorRef& y, const TensorRef& x,
                     const TensorRef& gamma, const TensorRef& beta, const TensorRef& mean,
                     const TensorRef& invstd, bool training, const TensorRef& grad_x,
                     double beta_x, const TensorRef& grad_gamma, double beta_gamma,
                     const TensorRef& grad_beta, double beta_beta, const TensorRef& grad_residual,
                     double beta_residual, cudaStream_t stream, const char* what) {
  const Geo d = geo_of(x);
  const int dev = x.device().index;
  const bool need_sums =
      grad_gamma.defined() || grad_beta.defined() || (grad_x.defined() && training);
  unetcu::cuda::DeviceBuffer sums(dev, need_sums ? size_t(2 * d.C) * sizeof(double) : 0);
  double* sp = need_sums ? static_cast<double*>(sums.get()) : nullptr;
  const S* yp = M == ReluMask::stored_y ? y.data<S>() : nullptr;
  const float* bp = M == ReluMask::from_x ? beta.data<float>() : nullptr;
  if (need_sums) {
    const GradTerm<S, M> term{grad_y.data<S>(), yp, x.data<S>(), mean.data<float>(),
                              invstd.data<float>(), gamma.data<float>(), bp};
    const SumsFinish finish{sp, d.C, data_or_null<float>(grad_gamma), float(beta_gamma),
                            data_or_null<float>(grad_beta), float(beta_beta)};
    reduce<S>(d, term, finish, dev, stream, what);
  }
  if (!grad_x.defined() && !grad_residual.defined()) return;
  const GradApplyOp<S, M> op{grad_y.data<S>(), yp, x.data<S>(), gamma.data<float>(), bp,
                             mean.data<float>(), invstd.data<float>(), sp, d.C,
                             float(1.0 / double(d.pixels())), training,
                             data_or_null<S>(grad_x), float(beta_x),
                             data_or_null<S>(grad_residual), float(beta_residual)};
  elementwise<S>(d, op, stream, what);
}

}  // namespace

void batchnorm_forward_train(const TensorRef& x, const TensorRef& gamma, const TensorRef& beta,
                             const TensorRef& y, const TensorRef& save_mean,
                             const TensorRef& save_invstd, const TensorRef& running_mean,
                             const TensorRef& running_var, double momentum, double eps) {
  if (x.numel() == 0) return;  // training refuses an empty batch (op layer): nothing to launch
  Launch l(x);
  dispatch_storage(x.dtype(), [&](auto tag) {
    using S = decltype(tag);
    launch_stats<S>(x, save_mean, save_invstd, running_mean, running_var, momentum, eps,
                    l.stream, "batchnorm_forward_train (statistics)");
    const NormalizeOp<S, false> op{x.data<S>(), nullptr, y.data<S>(), gamma.data<float>(),
                                   beta.data<float>(), save_mean.data<float>(),
                                   save_invstd.data<float>(), nullptr, 0.0};
    elementwise<S>(geo_of(x), op, l.stream, "batchnorm_forward_train");
  });
}

void batchnorm_forward_eval(const TensorRef& x, const TensorRef& gamma, const TensorRef& beta,
                            const TensorRef& running_mean, const TensorRef& running_var, double eps,
                            const TensorRef& y) {
  if (x.numel() == 0) return;
  Launch l(x);
  dispatch_storage(x.dtype(), [&](auto tag) {
    using S = decltype(tag);
    const NormalizeOp<S, false> op{x.data<S>(), nullptr, y.data<S>(), gamma.data<float>(),
                                   beta.data<float>(), running_mean.data<float>(), nullptr,
                                   running_var.data<float>(), eps};
    elementwise<S>(geo_of(x), op, l.stream, "batchnorm_forward_eval");
  });
}

void batchnorm_eval_stats(const TensorRef& running_mean, const TensorRef& running_var, double eps,
                          const TensorRef& mean, const TensorRef& invstd) {
  const int64_t C = mean.numel();
  if (C == 0) return;
  Launch l(mean);
  eval_stats_kernel<<<blocks_for(C), kThreads, 0, l.stream>>>(
      fdata(running_mean), fdata(running_var), eps, fdata(mean), fdata(invstd), C);
  CUDA_CHECK_LAUNCH(l.stream, "batchnorm_eval_stats");
}

void batchnorm_backward(const TensorRef& grad_y, const TensorRef& x, const TensorRef& gamma,
                        const TensorRef& mean, const TensorRef& invstd, bool training, double,
                        const TensorRef& grad_x, double beta_x, const TensorRef& grad_gamma,
                        double beta_gamma, const TensorRef& grad_beta, double beta_beta) {
  Launch l(x);
  dispatch_storage(x.dtype(), [&](auto tag) {
    using S = decltype(tag);
    launch_backward<S, ReluMask::none>(grad_y, TensorRef(), x, gamma, TensorRef(), mean, invstd,
                                       training, grad_x, beta_x, grad_gamma, beta_gamma,
                                       grad_beta, beta_beta, TensorRef(), 0.0, l.stream,
                                       "batchnorm_backward");
  });
}

// ---- fused batch norm + (residual add) + ReLU --------------------------------------------

void batchnorm_stats(const TensorRef& x, const TensorRef& mean, const TensorRef& invstd,
                     const TensorRef& running_mean, const TensorRef& running_var, double momentum,
                     double eps) {
  if (x.numel() == 0) return;  // training refuses an empty batch (op layer): nothing to launch
  Launch l(x);
  dispatch_storage(x.dtype(), [&](auto tag) {
    using S = decltype(tag);
    launch_stats<S>(x, mean, invstd, running_mean, running_var, momentum, eps, l.stream,
                    "batchnorm_stats");
  });
}

void batchnorm_add_relu_forward(const TensorRef& x, const TensorRef& gamma, const TensorRef& beta,
                                const TensorRef& mean, const TensorRef& invstd,
                                const TensorRef& residual, const TensorRef& y) {
  if (x.numel() == 0) return;
  Launch l(x);
  dispatch_storage(x.dtype(), [&](auto tag) {
    using S = decltype(tag);
    const NormalizeOp<S, true> op{x.data<S>(), data_or_null<S>(residual), y.data<S>(),
                                  gamma.data<float>(), beta.data<float>(), mean.data<float>(),
                                  invstd.data<float>(), nullptr, 0.0};
    elementwise<S>(geo_of(x), op, l.stream, "batchnorm_add_relu_forward");
  });
}

void batchnorm_add_relu_backward(const TensorRef& grad_y, const TensorRef& y, const TensorRef& x,
                                 const TensorRef& gamma, const TensorRef& beta,
                                 const TensorRef& mean, const TensorRef& invstd, bool training,
                                 const TensorRef& grad_x, double beta_x,
                                 const TensorRef& grad_gamma, double beta_gamma,
                                 const TensorRef& grad_beta, double beta_beta,
                                 const TensorRef& grad_residual, double beta_residual) {
  Launch l(x);
  dispatch_storage(x.dtype(), [&](auto tag) {
    using S = decltype(tag);
    const auto run = [&](auto mask) {
      launch_backward<S, decltype(mask)::value>(
          grad_y, y, x, gamma, beta, mean, invstd, training, grad_x, beta_x, grad_gamma,
          beta_gamma, grad_beta, beta_beta, grad_residual, beta_residual, l.stream,
          "batchnorm_add_relu_backward");
    };
    if (y.defined())
      run(std::integral_constant<ReluMask, ReluMask::stored_y>{});
    else
      run(std::integral_constant<ReluMask, ReluMask::from_x>{});
  });
}

// ---- synchronized batch norm: the per-replica pieces; the caller all-reduces the sums ----
//
// The sums are plain (sum x, sum x²: replicas would need one common shift), in double.

void batchnorm_channel_sums(const TensorRef& x, const TensorRef& sums) {
  Launch l(x);
  dispatch_storage(x.dtype(), [&](auto tag) {
    using S = decltype(tag);
    const Geo d = geo_of(x);
    const StatsTerm<S> term{x.data<S>(), false};
    const SumsFinish finish{sums.data<double>(), d.C, nullptr, 0.f, nullptr, 0.f};
    reduce<S>(d, term, finish, x.device().index, l.stream, "batchnorm_channel_sums");
  });
}

void batchnorm_sync_stats(const TensorRef& sums, double count, double momentum, double eps,
                          const TensorRef& mean, const TensorRef& invstd,
                          const TensorRef& running_mean, const TensorRef& running_var) {
  const int64_t C = mean.numel();
  if (C == 0) return;
  Launch l(mean);
  sync_stats_kernel<<<blocks_for(C), kThreads, 0, l.stream>>>(
      sums.data<double>(), count, momentum, eps, fdata(mean), fdata(invstd), fdata(running_mean),
      fdata(running_var), C);
  CUDA_CHECK_LAUNCH(l.stream, "batchnorm_sync_stats");
}

void batchnorm_apply(const TensorRef& x, const TensorRef& gamma, const TensorRef& beta,
                     const TensorRef& mean, const TensorRef& invstd, const TensorRef& y) {
  if (x.numel() == 0) return;
  Launch l(x);
  dispatch_storage(x.dtype(), [&](auto tag) {
    using S = decltype(tag);
    const NormalizeOp<S, false> op{x.data<S>(), nullptr, y.data<S>(), gamma.data<float>(),
                                   beta.data<float>(), mean.data<float>(), invstd.data<float>(),
                                   nullptr, 0.0};
    elementwise<S>(geo_of(x), op, l.stream, "batchnorm_apply");
  });
}

void batchnorm_grad_sums(const TensorRef& grad_y, const TensorRef& x, const TensorRef& mean,
                         const TensorRef& invstd, const TensorRef& sums) {
  Launch l(x);
  dispatch_storage(x.dtype(), [&](auto tag) {
    using S = decltype(tag);
    const Geo d = geo_of(x);
    const GradTerm<S, ReluMask::none> term{grad_y.data<S>(), nullptr, x.data<S>(),
                                           mean.data<float>(), invstd.data<float>(), nullptr,
                                           nullptr};
    const SumsFinish finish{sums.data<double>(), d.C, nullptr, 0.f, nullptr, 0.f};
    reduce<S>(d, term, finish, x.device().index, l.stream, "batchnorm_grad_sums");
  });
}

void batchnorm_param_grads(const TensorRef& sums, const TensorRef& grad_gamma, double beta_gamma,
                           const TensorRef& grad_beta, double beta_beta) {
  const int64_t C = sums.numel() / 2;
  if (C == 0) return;
  Launch l(sums);
  param_grads_kernel<<<blocks_for(C), kThreads, 0, l.stream>>>(
      sums.data<double>(), data_or_null<float>(grad_gamma), float(beta_gamma),
      data_or_null<float>(grad_beta), float(beta_beta), C);
  CUDA_CHECK_LAUNCH(l.stream, "batchnorm_param_grads");
}

void batchnorm_grad_apply(const TensorRef& grad_y, const TensorRef& x, const TensorRef& gamma,
                          const TensorRef& mean, const TensorRef& invstd,
                          const TensorRef& global_sums, double count, const TensorRef& grad_x,
                          double beta_x) {
  if (x.numel() == 0) return;
  Launch l(x);
  dispatch_storage(x.dtype(), [&](auto tag) {
    using S = decltype(tag);
    const Geo d = geo_of(x);
    const GradApplyOp<S, ReluMask::none> op{
        grad_y.data<S>(), nullptr, x.data<S>(), gamma.data<float>(), nullptr, mean.data<float>(),
        invstd.data<float>(), global_sums.data<double>(), d.C, float(1.0 / count), true,
        grad_x.data<S>(), float(beta_x), nullptr, 0.f};
    elementwise<S>(d, op, l.stream, "batchnorm_grad_apply");
  });
}

}  // namespace unetcu::kernels::cuda
