// CUDA optimizer updates over bodies/optim.h (the bodies the CPU backend runs).
#include "kernels/cuda/common.cuh"
#include "kernels/launchers.h"
#include "bodies/optim.h"

namespace unetcu::kernels::cuda {
namespace {

__global__ void adam_kernel(float* p, const float* g, float* m, float* v, AdamCoeffs<float> c,
                            int64_t n) {
  GRID_STRIDE(i, n) adam_update(p + i, g[i], m + i, v + i, c);
}

__global__ void sgd_kernel(float* p, const float* g, float* buf, SgdStep s, int64_t n) {
  GRID_STRIDE(i, n) sgd_update(p + i, g[i], buf + i, s);
}

// Up to kAdamBatch tensors in one launch, passed by value (about 21 KB of kernel parameters:
// CUDA 12.1+ allows 32 KB on sm_70 and later). Block b works on chunk b - start[t] of the
// tensor t whose range of blocks holds b.
constexpr int kAdamBatch = 256;
constexpr int64_t kAdamChunk = 4096;  // elements per block
struct AdamBatch {
  int count;
  int64_t start[kAdamBatch + 1];  // first block of each tensor; start[count] = the grid
  float* p[kAdamBatch];
  const float* g[kAdamBatch];
  float* m[kAdamBatch];
  float* v[kAdamBatch];
  int64_t n[kAdamBatch];
  AdamCoeffs<float> c[kAdamBatch];
};

// In a launch over many tensors (start[t]: the first block of tensor t of `count`, n[t] its
// elements, `chunk` elements per block): the tensor t with start[t] <= this block < start[t + 1]
// and the block's elements [first, end) of it.
__device__ inline void block_range(const int64_t* start, const int64_t* n, int count, int64_t chunk, int* t,
                                   int64_t* first, int64_t* end) {
  const int64_t block = blockIdx.x;
  int lo = 0, hi = count;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (start[mid] <= block) lo = mid; else hi = mid;
  }
  *t = lo;
  *first = (block - start[lo]) * chunk;
  *end = min(*first + chunk, n[lo]);
}

__global__ void adam_many_kernel(UNETCU_GRID_PARAM(AdamBatch) b) {
  int t;
  int64_t first, end;
  block_range(b.start, b.n, b.count, kAdamChunk, &t, &first, &end);
  for (int64_t i = first + threadIdx.x; i < end; i += blockDim.x)
    adam_update(b.p[t] + i, b.g[t][i], b.m[t] + i, b.v[t] + i, b.c[t]);
}

// Up to kAdamBatch tensors of a gradient-clipping pass in one launch: block b works on chunk
// b - start[t] (kSquareSumChunk elements) of the tensor t whose range of blocks holds b.
struct ClipBatch {
  int count;
  int64_t start[kAdamBatch + 1];
  float* x[kAdamBatch];
  int64_t n[kAdamBatch];
};

// The tensor and element range of this block.
__device__ inline void clip_chunk(const ClipBatch& b, int* t, int64_t* first, int64_t* end) {
  block_range(b.start, b.n, b.count, kSquareSumChunk, t, first, end);
}

// partials[offset + block] = the chunk's sum of squares.
__global__ void square_sum_kernel(UNETCU_GRID_PARAM(ClipBatch) b, double* partials, int64_t offset) {
  int t;
  int64_t first, end;
  clip_chunk(b, &t, &first, &end);
  double acc = 0;
  for (int64_t i = first + threadIdx.x; i < end; i += blockDim.x) {
    const double v = b.x[t][i];
    acc += v * v;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partials[offset + blockIdx.x] = acc;
}

// One block: out[0] = the partials' sum, in a fixed order.
__global__ void sum_square_partials_kernel(const double* partials, int64_t count, double* out) {
  double acc = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) out[0] = acc;
}

__global__ void clip_scale_kernel(UNETCU_GRID_PARAM(ClipBatch) b, const double* square_sum,
                                  double max_norm) {
  const double c = clip_coefficient(square_sum[0], max_norm);
  if (c == 1) return;  // x * 1 is x
  const float cf = float(c);
  int t;
  int64_t first, end;
  clip_chunk(b, &t, &first, &end);
  for (int64_t i = first + threadIdx.x; i < end; i += blockDim.x) b.x[t][i] *= cf;
}

__global__ void clip_stats_kernel(const double* square_sum, double max_norm, double* stats) {
  kernels::clip_stats_update(square_sum[0], max_norm, stats);
}

// The tensors in launches of at most kAdamBatch, f(batch, blocks) for each.
template <class F> void for_clip_batches(const std::vector<TensorRef>& xs, F&& f) {
  for (size_t at = 0; at < xs.size(); at += kAdamBatch) {
    ClipBatch b;
    b.count = int(std::min<size_t>(kAdamBatch, xs.size() - at));
    int64_t blocks = 0;
    for (int k = 0; k < b.count; ++k) {
      const TensorRef& x = xs[at + size_t(k)];
      b.start[k] = blocks;
      b.x[k] = fdata(x);
      b.n[k] = x.numel();
      blocks += std::max<int64_t>(1, (b.n[k] + kSquareSumChunk - 1) / kSquareSumChunk);
    }
    b.start[b.count] = blocks;
    f(b, blocks);
  }
}

}  // namespace

void square_sum_many(const std::vector<TensorRef>& xs, const TensorRef& out) {
  Launch l(out);
  int64_t total = 0;
  for_clip_batches(xs, [&](const ClipBatch&, int64_t blocks) { total += blocks; });
  unetcu::cuda::DeviceBuffer partials(out.device().index, size_t(std::max<int64_t>(total, 1)) * sizeof(double));
  double* pp = static_cast<double*>(partials.get());
  int64_t offset = 0;
  for_clip_batches(xs, [&](const ClipBatch& b, int64_t blocks) {
    square_sum_kernel<<<unsigned(blocks), kThreads, 0, l.stream>>>(b, pp, offset);
    CUDA_CHECK_LAUNCH(l.stream, "square_sum_many");
    offset += blocks;
  });
  sum_square_partials_kernel<<<1, kThreads, 0, l.stream>>>(pp, total, out.data<double>());
  CUDA_CHECK_LAUNCH(l.stream, "square_sum_many (sum)");
}

void clip_stats_update(const TensorRef& square_sum, double max_norm, const TensorRef& stats) {
  Launch l(square_sum);
  clip_stats_kernel<<<1, 1, 0, l.stream>>>(square_sum.data<double>(), max_norm, stats.data<double>());
  CUDA_CHECK_LAUNCH(l.stream, "clip_stats_update");
}

void clip_scale_many(const std::vector<TensorRef>& xs, const TensorRef& square_sum, double max_norm) {
  Launch l(square_sum);
  for_clip_batches(xs, [&](const ClipBatch& b, int64_t blocks) {
    clip_scale_kernel<<<unsigned(blocks), kThreads, 0, l.stream>>>(b, square_sum.data<double>(), max_norm);
    CUDA_CHECK_LAUNCH(l.stream, "clip_scale_many");
  });
}

void adam_update_many(const std::vector<AdamTensor>& tensors) {
  if (tensors.empty()) return;
  Launch l(tensors[0].p);
  for (size_t at = 0; at < tensors.size(); at += kAdamBatch) {
    AdamBatch b;
    b.count = int(std::min<size_t>(kAdamBatch, tensors.size() - at));
    int64_t blocks = 0;
    for (int k = 0; k < b.count; ++k) {
      const AdamTensor& a = tensors[at + size_t(k)];
      b.start[k] = blocks;
      b.p[k] = fdata(a.p);
      b.g[k] = fdata(a.g);
      b.m[k] = fdata(a.m);
      b.v[k] = fdata(a.v);
      b.n[k] = a.p.numel();
      b.c[k] = AdamCoeffs<float>(a.s);
      blocks += std::max<int64_t>(1, (b.n[k] + kAdamChunk - 1) / kAdamChunk);
    }
    b.start[b.count] = blocks;
    adam_many_kernel<<<unsigned(blocks), kThreads, 0, l.stream>>>(b);
    CUDA_CHECK_LAUNCH(l.stream, "adam_update_many");
  }
}

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
