// CPU optimizer updates over bodies/optim.h.
#include "kernels/launchers.h"
#include "kernels/cpu/parallel.h"
#include "bodies/optim.h"

#include <algorithm>
#include <vector>

namespace unetcu::kernels::cpu {

void adam_update(const TensorRef& p, const TensorRef& g, const TensorRef& m, const TensorRef& v,
                 const AdamStep& s) {
  const int64_t n = p.numel();
  UNETCU_DISPATCH_FLOAT(p.dtype(), T, {
    T* pp = p.data<T>();
    const T* gp = g.data<T>();
    T* mp = m.data<T>();
    T* vp = v.data<T>();
    const AdamCoeffs<T> c(s);
    parallel_for(n, [=](int64_t i) { kernels::adam_update(pp + i, gp[i], mp + i, vp + i, c); });
  });
}

void adam_update_many(const std::vector<AdamTensor>& tensors) {
  if (tensors.empty()) return;
  // Chunks of every tensor, one parallel loop over all of them: one thread team for the step
  // instead of one per parameter (most of the UNet's are too small to be worth a team).
  constexpr int64_t kChunk = 16384;
  struct Chunk {
    int tensor;
    int64_t lo, hi;
  };
  std::vector<Chunk> chunks;
  for (size_t t = 0; t < tensors.size(); ++t)
    for (int64_t lo = 0, n = tensors[t].p.numel(); lo < n; lo += kChunk)
      chunks.push_back({int(t), lo, std::min(lo + kChunk, n)});
  UNETCU_DISPATCH_FLOAT(tensors[0].p.dtype(), T, {
    std::vector<AdamCoeffs<T>> coeffs;
    for (const AdamTensor& a : tensors) coeffs.emplace_back(a.s);
    parallel_for(int64_t(chunks.size()), [&](int64_t k) {
      const Chunk& c = chunks[size_t(k)];
      const AdamTensor& a = tensors[size_t(c.tensor)];
      T* pp = a.p.data<T>();
      const T* gp = a.g.data<T>();
      T* mp = a.m.data<T>();
      T* vp = a.v.data<T>();
      const AdamCoeffs<T>& co = coeffs[size_t(c.tensor)];
      for (int64_t i = c.lo; i < c.hi; ++i) kernels::adam_update(pp + i, gp[i], mp + i, vp + i, co);
    }, 2);
  });
}

void sgd_update(const TensorRef& p, const TensorRef& g, const TensorRef& buf, const SgdStep& s) {
  const int64_t n = p.numel();
  UNETCU_DISPATCH_FLOAT(p.dtype(), T, {
    T* pp = p.data<T>();
    const T* gp = g.data<T>();
    T* bp = buf.data<T>();
    parallel_for(n, [&](int64_t i) { kernels::sgd_update(pp + i, gp[i], bp + i, s); });
  });
}

namespace {
// Chunks of kSquareSumChunk elements over every tensor: one parallel loop over all of them.
struct Chunk {
  size_t tensor;
  int64_t lo, hi;
};
std::vector<Chunk> chunks_of(const std::vector<TensorRef>& xs) {
  std::vector<Chunk> chunks;
  for (size_t t = 0; t < xs.size(); ++t)
    for (int64_t lo = 0, n = xs[t].numel(); lo < n; lo += kSquareSumChunk)
      chunks.push_back({t, lo, std::min(lo + kSquareSumChunk, n)});
  return chunks;
}
}  // namespace

void square_sum_many(const std::vector<TensorRef>& xs, const TensorRef& out) {
  const std::vector<Chunk> chunks = chunks_of(xs);
  // Each chunk's sum into its own slot, then the slots added in order: the same bits for any
  // number of threads.
  std::vector<double> partial(chunks.size(), 0.0);
  if (!chunks.empty()) {
    UNETCU_DISPATCH_FLOAT(xs[chunks[0].tensor].dtype(), T, {
      parallel_for(int64_t(chunks.size()), [&](int64_t k) {
        const Chunk& c = chunks[size_t(k)];
        const T* x = xs[c.tensor].data<T>();
        double acc = 0;
        for (int64_t i = c.lo; i < c.hi; ++i) acc += double(x[i]) * double(x[i]);
        partial[size_t(k)] = acc;
      }, 8);
    });
  }
  double sum = 0;
  for (double p : partial) sum += p;
  out.data<double>()[0] = sum;
}

void clip_stats_update(const TensorRef& square_sum, double max_norm, const TensorRef& stats) {
  kernels::clip_stats_update(square_sum.data<double>()[0], max_norm, stats.data<double>());
}

void clip_scale_many(const std::vector<TensorRef>& xs, const TensorRef& square_sum, double max_norm) {
  const double c = clip_coefficient(square_sum.data<double>()[0], max_norm);
  if (c == 1) return;  // x * 1 is x
  const std::vector<Chunk> chunks = chunks_of(xs);
  if (chunks.empty()) return;
  UNETCU_DISPATCH_FLOAT(xs[chunks[0].tensor].dtype(), T, {
    const T ct = T(c);
    parallel_for(int64_t(chunks.size()), [&](int64_t k) {
      const Chunk& ch = chunks[size_t(k)];
      T* x = xs[ch.tensor].data<T>();
      for (int64_t i = ch.lo; i < ch.hi; ++i) x[i] *= ct;
    }, 8);
  });
}

}  // namespace unetcu::kernels::cpu
