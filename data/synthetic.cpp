#include "data/synthetic.h"

#include "runtime/allocator.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/random.h"
#include "kernels/cpu/parallel.h"

namespace unetcu {

SyntheticSegmentation::SyntheticSegmentation(int width, int height, uint64_t seed, int classes)
    : width_(width), height_(height), seed_(seed), classes_(classes) {
  UNETCU_CHECK(width > 0 && width % 32 == 0 && height > 0 && height % 32 == 0,
               "image size must be a positive multiple of 32, got ", width, "x", height);
  UNETCU_CHECK(classes >= 1 && classes <= 4, "the synthetic set has 1 to 4 classes (background and up to three "
               "kinds of shapes), got ", classes);
}

namespace {

struct Shape2D {
  int kind;  // 0 ellipse, 1 rotated rectangle, 2 triangle
  double cx, cy, a, b, cos_t, sin_t;
  double tx[3], ty[3];
  float color[3];
  double noise;

  bool contains(double x, double y) const {
    if (kind == 2) {  // same side of all three edges
      double s[3];
      for (int e = 0; e < 3; ++e) {
        const int f = (e + 1) % 3;
        s[e] = (tx[f] - tx[e]) * (y - ty[e]) - (ty[f] - ty[e]) * (x - tx[e]);
      }
      return (s[0] >= 0 && s[1] >= 0 && s[2] >= 0) || (s[0] <= 0 && s[1] <= 0 && s[2] <= 0);
    }
    const double dx = x - cx, dy = y - cy;
    const double u = dx * cos_t + dy * sin_t, v = -dx * sin_t + dy * cos_t;
    if (kind == 0) return (u * u) / (a * a) + (v * v) / (b * b) <= 1.0;
    return std::fabs(u) <= a && std::fabs(v) <= b;
  }
};

}  // namespace

void SyntheticSegmentation::render(int64_t index, float* image, float* mask) const {
  Rng rng(Rng::mix(seed_, uint64_t(index)));
  const int W = width_, H = height_, S = std::min(W, H);  // S scales the shapes and textures
  const size_t plane = size_t(W) * H;
  // Kinds of shapes drawn: all three for one or two classes, else one per foreground class.
  const uint64_t kinds = classes_ <= 2 ? 3 : uint64_t(classes_ - 1);

  // Background: a base colour, two sinusoidal gratings and pixel noise.
  float bg[3];
  for (float& c : bg) c = float(rng.uniform(0.15, 0.85));
  double fx[2], fy[2], ph[2], amp[2];
  for (int k = 0; k < 2; ++k) {
    const double freq = rng.uniform(2.0, 10.0) * 6.283185307179586 / S;
    const double ang = rng.uniform(0, 3.141592653589793);
    fx[k] = freq * std::cos(ang);
    fy[k] = freq * std::sin(ang);
    ph[k] = rng.uniform(0, 6.283185307179586);
    amp[k] = rng.uniform(0.04, 0.12);
  }
  const double bg_noise = rng.uniform(0.02, 0.08);

  // 1..3 shapes whose colour differs clearly from the background.
  const int count = 1 + int(rng.below(3));
  std::vector<Shape2D> shapes(count);
  for (Shape2D& s : shapes) {
    s.kind = int(rng.below(kinds));
    s.cx = rng.uniform(0.15, 0.85) * W;
    s.cy = rng.uniform(0.15, 0.85) * H;
    s.a = rng.uniform(0.08, 0.25) * S;
    s.b = rng.uniform(0.08, 0.25) * S;
    const double t = rng.uniform(0, 3.141592653589793);
    s.cos_t = std::cos(t);
    s.sin_t = std::sin(t);
    for (int v = 0; v < 3; ++v) {
      const double r = rng.uniform(0.08, 0.3) * S, ang = rng.uniform(0, 6.283185307179586);
      s.tx[v] = s.cx + r * std::cos(ang);
      s.ty[v] = s.cy + r * std::sin(ang);
    }
    for (int attempt = 0; attempt < 100; ++attempt) {
      double dist2 = 0;
      for (int c = 0; c < 3; ++c) {
        s.color[c] = float(rng.uniform(0.0, 1.0));
        dist2 += (s.color[c] - bg[c]) * (s.color[c] - bg[c]);
      }
      if (dist2 > 0.35 * 0.35) break;
    }
    s.noise = rng.uniform(0.01, 0.06);
    // Several kinds: each kind's colour leans to its own tint (red, blue, green), as the
    // classes of real data differ in look as well as in form.
    if (classes_ >= 3) {
      static constexpr float kTint[3][3] = {{0.9f, 0.15f, 0.15f}, {0.15f, 0.3f, 0.9f}, {0.15f, 0.85f, 0.25f}};
      for (int c = 0; c < 3; ++c) s.color[c] = 0.35f * s.color[c] + 0.65f * kTint[s.kind][c];
    }
  }

  for (int y = 0; y < H; ++y)
    for (int x = 0; x < W; ++x) {
      const size_t p = size_t(y) * W + x;
      int inside = -1;  // the last shape drawn wins
      for (int k = count - 1; k >= 0 && inside < 0; --k)
        if (shapes[k].contains(x + 0.5, y + 0.5)) inside = k;
      const double tex = amp[0] * std::sin(fx[0] * x + fy[0] * y + ph[0]) +
                         amp[1] * std::sin(fx[1] * x + fy[1] * y + ph[1]);
      for (int c = 0; c < 3; ++c) {
        double v = inside >= 0 ? shapes[inside].color[c] + shapes[inside].noise * rng.normal()
                               : bg[c] + tex + bg_noise * rng.normal();
        image[c * plane + p] = float(std::clamp(v, 0.0, 1.0));
      }
      mask[p] = inside < 0 ? 0.0f : classes_ <= 2 ? 1.0f : float(shapes[inside].kind + 1);
    }
}

Batch SyntheticSegmentation::batch(const std::vector<int64_t>& indices, DType dtype,
                                   Device device, bool pinned) const {
  const int64_t B = int64_t(indices.size()), H = height_, W = width_;
  UNETCU_CHECK(B > 0, "empty batch");
  UNETCU_CHECK(device.is_cpu(), "synthetic batches are made on a CPU device");
  const HostDataScope host_data;  // a loader's batch: host memory, no device's
  Batch out = pinned ? Batch{Tensor::empty_pinned({B, 3, H, W}, dtype),
                             Tensor::empty_pinned({B, 1, H, W}, dtype)}
                     : Batch{Tensor::empty({B, 3, H, W}, dtype, device),
                             Tensor::empty({B, 1, H, W}, dtype, device)};
  const size_t plane = size_t(W) * H;
  kernels::cpu::parallel_for(B, [&](int64_t b) {
    std::vector<float> img(3 * plane), msk(plane);
    sample(indices[b], img.data(), msk.data());
    store_normalized(img.data(), msk.data(), out, b);
  }, 1);
  return out;
}

void store_normalized(const float* img, const float* msk, Batch& out, int64_t b, const Normalization& norm) {
  const size_t plane = size_t(out.masks.dim(2)) * size_t(out.masks.dim(3));
  const int C = int(out.images.dim(1));
  UNETCU_CHECK(norm.channels() == C, "a normalisation of ", norm.channels(), " channels for images of ", C);
  UNETCU_DISPATCH_FLOAT(out.images.dtype(), T, {
    T* ip = out.images.data<T>() + b * C * plane;
    T* mp = out.masks.data<T>() + b * plane;
    for (int c = 0; c < C; ++c)
      for (size_t q = 0; q < plane; ++q)
        ip[c * plane + q] = T((img[c * plane + q] - norm.mean[size_t(c)]) / norm.std[size_t(c)]);
    for (size_t q = 0; q < plane; ++q) mp[q] = T(msk[q]);
  });
}

void SyntheticSegmentation::sample(int64_t index, float* image, float* mask) const {
  const size_t plane = size_t(width_) * height_;
  if (index >= 0 && index < int64_t(cache_.size())) {
    std::vector<float>& c = cache_[size_t(index)];
    if (c.empty()) {
      c.resize(4 * plane);
      render(index, c.data(), c.data() + 3 * plane);
    }
    std::memcpy(image, c.data(), 3 * plane * sizeof(float));
    std::memcpy(mask, c.data() + 3 * plane, plane * sizeof(float));
    return;
  }
  render(index, image, mask);
}

void SyntheticSegmentation::enable_cache(int64_t count) {
  cache_.assign(size_t(std::max<int64_t>(count, 0)), {});
}

std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int epoch) {
  std::vector<int64_t> perm(n);
  for (int64_t i = 0; i < n; ++i) perm[i] = i;
  Rng rng(Rng::mix(seed ^ 0x5EEDu, uint64_t(epoch)));
  for (int64_t i = n - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
  return perm;
}

}  // namespace unetcu
