// Contract 1: every op's backward equals central finite differences of its forward (CPU,
// float64), on random inputs of odd shapes; conv and BN forward also against loop references;
// float32 forward against float64.
#include "engine/ops.h"
#include "kernels/cpu/conv_dnnl.h"
#include "kernels/launchers.h"
#include "testing.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {

// Straightforward 7-loop convolution.
Tensor conv_reference(const Tensor& x, const Tensor& w, const Tensor& b, Conv2dOptions o) {
  const int64_t N = x.dim(0), C = x.dim(1), H = x.dim(2), W = x.dim(3);
  const int64_t O = w.dim(0), KH = w.dim(2), KW = w.dim(3);
  const int64_t OH = (H + 2 * o.pad_h - KH) / o.stride_h + 1;
  const int64_t OW = (W + 2 * o.pad_w - KW) / o.stride_w + 1;
  Tensor y = Tensor::zeros({N, O, OH, OW}, DType::F64);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t oc = 0; oc < O; ++oc)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          double s = b.defined() ? b.at(oc) : 0.0;
          for (int64_t c = 0; c < C; ++c)
            for (int64_t i = 0; i < KH; ++i)
              for (int64_t j = 0; j < KW; ++j) {
                const int64_t ih = oh * o.stride_h - o.pad_h + i, iw = ow * o.stride_w - o.pad_w + j;
                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                s += x.at(((n * C + c) * H + ih) * W + iw) * w.at(((oc * C + c) * KH + i) * KW + j);
              }
          y.set(((n * O + oc) * OH + oh) * OW + ow, s);
        }
  return y;
}

// Loop reference of the conv backward for output gradient gy: gx, gw, gb.
void conv_backward_reference(const Tensor& x, const Tensor& w, const Tensor& gy, Conv2dOptions o,
                             Tensor* gx, Tensor* gw, Tensor* gb) {
  const int64_t N = x.dim(0), C = x.dim(1), H = x.dim(2), W = x.dim(3);
  const int64_t O = w.dim(0), KH = w.dim(2), KW = w.dim(3), OH = gy.dim(2), OW = gy.dim(3);
  *gx = Tensor::zeros(x.shape(), DType::F64);
  *gw = Tensor::zeros(w.shape(), DType::F64);
  *gb = Tensor::zeros({O}, DType::F64);
  double* dx = gx->data<double>();
  double* dw = gw->data<double>();
  double* db = gb->data<double>();
  const double* xp = x.data<double>();
  const double* wp = w.data<double>();
  const double* g = gy.data<double>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t oc = 0; oc < O; ++oc)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          const double d = g[((n * O + oc) * OH + oh) * OW + ow];
          db[oc] += d;
          for (int64_t c = 0; c < C; ++c)
            for (int64_t i = 0; i < KH; ++i)
              for (int64_t j = 0; j < KW; ++j) {
                const int64_t ih = oh * o.stride_h - o.pad_h + i, iw = ow * o.stride_w - o.pad_w + j;
                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                const int64_t xi = ((n * C + c) * H + ih) * W + iw, wi = ((oc * C + c) * KH + i) * KW + j;
                dx[xi] += d * wp[wi];
                dw[wi] += d * xp[xi];
              }
        }
}

double rel_error(const Tensor& a, const Tensor& b) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < b.numel(); ++i) {
    num += std::pow(a.at(i) - b.at(i), 2);
    den += b.at(i) * b.at(i);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

struct ConvCase {
  Shape x, w;
  Conv2dOptions opt;
  bool bias;
};

}  // namespace

TEST_CASE("conv2d forward equals the loop reference and backward equals finite differences") {
  const ConvCase cases[] = {
      {{2, 3, 7, 6}, {4, 3, 3, 3}, {2, 2, 1, 1}, true},   // stride 2, padding, odd sizes
      {{3, 2, 5, 9}, {3, 2, 3, 2}, {1, 2, 0, 1}, false},  // non-square kernel, mixed stride/pad
      {{2, 4, 5, 5}, {5, 4, 1, 1}, {1, 1, 0, 0}, true},   // 1x1, batched column matrix
      {{2, 3, 9, 8}, {2, 3, 7, 7}, {2, 2, 3, 3}, false},  // ResNet stem geometry
      {{2, 3, 5, 7}, {4, 3, 1, 1}, {2, 2, 0, 0}, false},  // 1x1 stride 2 (downsample)
  };
  Rng rng(1);
  for (const ConvCase& c : cases) {
    CAPTURE(shape_str(c.x));
    CAPTURE(shape_str(c.w));
    Tensor x = random_tensor(c.x, rng).set_requires_grad(true);
    Tensor w = random_tensor(c.w, rng).set_requires_grad(true);
    Tensor b = c.bias ? random_tensor({c.w[0]}, rng).set_requires_grad(true) : Tensor();
    CHECK(max_abs_diff(conv2d(x, w, b, c.opt), conv_reference(x, w, b, c.opt)) < 1e-12);
    gradcheck([&](const std::vector<Tensor>& in) { return conv2d(in[0], in[1], in[2], c.opt); },
              {x, w, b});
  }
}

TEST_CASE("conv2d banded strategy: bands of output rows on several threads") {
  // Large planes take the banded path: each thread builds its band's column matrix; input
  // gradients of neighbouring bands overlap and are accumulated in two phases. Every output
  // and gradient element is compared with the loop reference.
  const int saved = cpu_threads();
  set_cpu_threads(3);  // an odd team, whatever the machine has
  struct Case {
    Shape x, w;
    Conv2dOptions opt;
  };
  const Case cases[] = {{{2, 64, 35, 33}, {5, 64, 3, 3}, {1, 1, 1, 1}},    // 3x3 bands
                        {{2, 64, 12, 300}, {3, 64, 3, 3}, {1, 1, 1, 1}},   // bands of the minimum 3 rows
                        {{2, 32, 30, 300}, {4, 32, 7, 7}, {2, 2, 3, 3}},   // 7x7 stride 2, minimum 4 rows
                        {{3, 3, 140, 69}, {4, 3, 7, 7}, {2, 2, 3, 3}},     // the stem
                        {{3, 64, 140, 33}, {3, 64, 1, 1}, {1, 1, 0, 0}}};  // 1x1 direct bands
  Rng rng(21);
  for (const Case& c : cases) {
    CAPTURE(shape_str(c.x));
    CAPTURE(shape_str(c.w));
    kernels::ConvGeometry g{c.x[0], c.x[1], c.x[2], c.x[3], c.w[0], 0, 0, int(c.w[2]), int(c.w[3]),
                            c.opt.stride_h, c.opt.stride_w, c.opt.pad_h, c.opt.pad_w};
    g.OH = kernels::window_out_size(g.H, g.kh, g.sh, g.ph, 1);
    g.OW = kernels::window_out_size(g.W, g.kw, g.sw, g.pw, 1);
    REQUIRE(kernels::cpu::conv2d_uses_bands(g, DType::F64));
    Tensor x = random_tensor(c.x, rng).set_requires_grad(true);
    Tensor w = random_tensor(c.w, rng).set_requires_grad(true);
    Tensor b = random_tensor({c.w[0]}, rng).set_requires_grad(true);
    Tensor ref_y = conv_reference(x, w, b, c.opt);
    Tensor gy = random_tensor(ref_y.shape(), rng);
    Tensor rgx, rgw, rgb;
    conv_backward_reference(x, w, gy, c.opt, &rgx, &rgw, &rgb);
    for (int pass = 1; pass <= 2; ++pass) {  // the second pass accumulates (beta = 1)
      Tape tape;
      Tensor y;
      {
        TapeScope s(tape);
        y = conv2d(x, w, b, c.opt);
      }
      CHECK(rel_error(y, ref_y) < 1e-13);
      tape.backward({y}, {gy});
      CHECK(rel_error(x.grad(), scale(rgx, pass)) < 1e-13);
      CHECK(rel_error(w.grad(), scale(rgw, pass)) < 1e-13);
      CHECK(rel_error(b.grad(), scale(rgb, pass)) < 1e-13);
    }
  }
  set_cpu_threads(saved);
}

TEST_CASE("conv2d float32: oneDNN and im2col against the float64 reference") {
  // Every convolution shape of the UNet-ResNet34 (stem 7x7/2 on 3 channels, 3x3/1, 3x3/2,
  // 1x1/2 downsample, the head's 3x3 with bias to one channel) at small odd sizes, forward and
  // backward, written (pass 1) and accumulated (pass 2, beta = 1). float32 sums of at most a
  // few hundred products: relative error ~1e-7, checked at 1e-5.
  const std::vector<ConvCase> cases = {{{2, 3, 37, 30}, {16, 3, 7, 7}, {2, 2, 3, 3}, false},
                                       {{2, 16, 17, 13}, {16, 16, 3, 3}, {1, 1, 1, 1}, false},
                                       {{3, 16, 17, 13}, {32, 16, 3, 3}, {2, 2, 1, 1}, false},
                                       {{3, 16, 16, 12}, {32, 16, 1, 1}, {2, 2, 0, 0}, false},
                                       {{2, 40, 9, 9}, {24, 40, 1, 1}, {1, 1, 0, 0}, true},
                                       {{2, 16, 20, 18}, {1, 16, 3, 3}, {1, 1, 1, 1}, true}};
  const kernels::cpu::CpuConvImpl saved = kernels::cpu::cpu_conv_impl();
  std::vector<kernels::cpu::CpuConvImpl> impls = {kernels::cpu::CpuConvImpl::Im2col};
  if (kernels::cpu::onednn_built())
    impls.push_back(kernels::cpu::CpuConvImpl::OneDnn);
  else
    WARN_MESSAGE(false, "this build has no oneDNN: only im2col is checked in float32");
  Rng rng(33);
  for (const ConvCase& c : cases) {
    CAPTURE(shape_str(c.x));
    CAPTURE(shape_str(c.w));
    Tensor x = random_tensor(c.x, rng), w = random_tensor(c.w, rng);
    Tensor b = c.bias ? random_tensor({c.w[0]}, rng) : Tensor();
    Tensor ref_y = conv_reference(x, w, b, c.opt);
    Tensor gy = random_tensor(ref_y.shape(), rng);
    Tensor rgx, rgw, rgb;
    conv_backward_reference(x, w, gy, c.opt, &rgx, &rgw, &rgb);
    for (auto impl : impls) {
      CAPTURE(int(impl));
      kernels::cpu::set_cpu_conv_impl(impl);
      Tensor x32 = x.to(DType::F32).set_requires_grad(true);
      Tensor w32 = w.to(DType::F32).set_requires_grad(true);
      Tensor b32 = c.bias ? b.to(DType::F32).set_requires_grad(true) : Tensor();
      for (int pass = 1; pass <= 2; ++pass) {
        Tape tape;
        Tensor y;
        {
          TapeScope s(tape);
          y = conv2d(x32, w32, b32, c.opt);
        }
        CHECK(rel_error(y.to(DType::F64), ref_y) < 1e-5);
        tape.backward({y}, {gy.to(DType::F32)});
        CHECK(rel_error(x32.grad().to(DType::F64), scale(rgx, pass)) < 1e-5);
        CHECK(rel_error(w32.grad().to(DType::F64), scale(rgw, pass)) < 1e-5);
        if (c.bias) CHECK(rel_error(b32.grad().to(DType::F64), scale(rgb, pass)) < 1e-5);
      }
    }
  }
  kernels::cpu::set_cpu_conv_impl(saved);
}

TEST_CASE("conv2d on large planes (one sample per GEMM, 1x1 direct path)") {
  Rng rng(2);
  for (Conv2dOptions opt : {Conv2dOptions{1, 1, 0, 0}, Conv2dOptions{1, 1, 1, 1}}) {
    const int k = opt.pad_h ? 3 : 1;
    Tensor x = random_tensor({2, 2, 66, 65}, rng).set_requires_grad(true);
    Tensor w = random_tensor({3, 2, k, k}, rng).set_requires_grad(true);
    Tensor b = random_tensor({3}, rng).set_requires_grad(true);
    CHECK(max_abs_diff(conv2d(x, w, b, opt), conv_reference(x, w, b, opt)) < 1e-12);
    GradcheckOptions go;
    go.max_checks_per_input = 25;
    gradcheck([&](const std::vector<Tensor>& in) { return conv2d(in[0], in[1], in[2], opt); },
              {x, w, b}, go);
  }
}

TEST_CASE("batch_norm2d training: forward against loops, running statistics, gradients") {
  Rng rng(3);
  Tensor x = random_tensor({3, 4, 5, 3}, rng, -2, 3).set_requires_grad(true);
  Tensor gamma = random_tensor({4}, rng, 0.5, 1.5).set_requires_grad(true);
  Tensor beta = random_tensor({4}, rng).set_requires_grad(true);
  Tensor rm = Tensor::zeros({4}, DType::F64), rv = Tensor::full({4}, 1.0, DType::F64);
  Tensor y = batch_norm2d(x, gamma, beta, rm, rv, true, 0.1, 1e-5);
  const int64_t M = 3 * 5 * 3;
  for (int64_t c = 0; c < 4; ++c) {
    double mean = 0, var = 0;
    for (int64_t n = 0; n < 3; ++n)
      for (int64_t q = 0; q < 15; ++q) mean += x.at((n * 4 + c) * 15 + q);
    mean /= M;
    for (int64_t n = 0; n < 3; ++n)
      for (int64_t q = 0; q < 15; ++q) var += std::pow(x.at((n * 4 + c) * 15 + q) - mean, 2);
    var /= M;
    for (int64_t n = 0; n < 3; ++n)
      for (int64_t q = 0; q < 15; ++q) {
        const int64_t i = (n * 4 + c) * 15 + q;
        CHECK(std::fabs(y.at(i) - ((x.at(i) - mean) / std::sqrt(var + 1e-5) * gamma.at(c) +
                                   beta.at(c))) < 1e-12);
      }
    CHECK(std::fabs(rm.at(c) - 0.1 * mean) < 1e-14);
    CHECK(std::fabs(rv.at(c) - (0.9 + 0.1 * var * M / (M - 1))) < 1e-14);  // unbiased
  }
  gradcheck([&](const std::vector<Tensor>& in) {
    return batch_norm2d(in[0], in[1], in[2], rm, rv, true);
  }, {x, gamma, beta});
}

TEST_CASE("batch_norm2d eval uses the running statistics, gradients") {
  Rng rng(4);
  Tensor x = random_tensor({2, 3, 3, 5}, rng).set_requires_grad(true);
  Tensor gamma = random_tensor({3}, rng, 0.5, 1.5).set_requires_grad(true);
  Tensor beta = random_tensor({3}, rng).set_requires_grad(true);
  Tensor rm = random_tensor({3}, rng), rv = random_tensor({3}, rng, 0.5, 2);
  Tensor rm0 = rm.clone(), rv0 = rv.clone();
  Tensor y = batch_norm2d(x, gamma, beta, rm, rv, false);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const int64_t c = (i / 15) % 3;
    CHECK(std::fabs(y.at(i) - ((x.at(i) - rm.at(c)) / std::sqrt(rv.at(c) + 1e-5) * gamma.at(c) +
                               beta.at(c))) < 1e-12);
  }
  CHECK(max_abs_diff(rm, rm0) == 0);  // eval never touches the running statistics
  CHECK(max_abs_diff(rv, rv0) == 0);
  gradcheck([&](const std::vector<Tensor>& in) {
    return batch_norm2d(in[0], in[1], in[2], rm, rv, false);
  }, {x, gamma, beta});
}

TEST_CASE("relu, sigmoid, add, scale gradients") {
  Rng rng(5);
  // relu: keep inputs away from the kink at 0 so x ± h never crosses it.
  Tensor x = random_tensor({2, 3, 5, 3}, rng);
  for (int64_t i = 0; i < x.numel(); ++i) x.set(i, x.at(i) + (x.at(i) >= 0 ? 0.05 : -0.05));
  x.set_requires_grad(true);
  gradcheck([](const std::vector<Tensor>& in) { return relu(in[0]); }, {x});
  Tensor r = relu(x);
  for (int64_t i = 0; i < x.numel(); ++i) CHECK(r.at(i) == std::max(0.0, x.at(i)));

  Tensor s = random_tensor({3, 2, 3, 3}, rng, -4, 4).set_requires_grad(true);
  gradcheck([](const std::vector<Tensor>& in) { return sigmoid(in[0]); }, {s});
  Tensor a = random_tensor({2, 3, 4, 5}, rng).set_requires_grad(true);
  Tensor b = random_tensor({2, 3, 4, 5}, rng).set_requires_grad(true);
  gradcheck([](const std::vector<Tensor>& in) { return add(in[0], in[1]); }, {a, b});
  gradcheck([](const std::vector<Tensor>& in) { return add(in[0], in[0]); }, {a});  // same input twice
  gradcheck([](const std::vector<Tensor>& in) { return scale(in[0], -2.5); }, {a});
}

TEST_CASE("max_pool2d: ResNet's 3x3/2 pad 1 and general windows, forward and gradients") {
  struct Case {
    Shape x;
    Pool2dOptions o;
  };
  const Case cases[] = {{{2, 3, 9, 8}, Pool2dOptions::square(3, 2, 1)},
                        {{2, 2, 6, 7}, Pool2dOptions::square(2, 2, 0)},
                        {{1, 3, 7, 9}, Pool2dOptions{3, 2, 1, 2, 1, 0}},
                        // Column strides 1 and 3: the CPU's other interior paths.
                        {{2, 2, 7, 9}, Pool2dOptions{2, 3, 2, 1, 0, 1}},
                        {{1, 2, 8, 11}, Pool2dOptions{2, 2, 2, 3, 0, 1}}};
  Rng rng(6);
  for (const Case& c : cases) {
    // Distinct values (a shuffled ramp): no ties, and every gap is far above h.
    Tensor x = Tensor::empty(c.x, DType::F64);
    std::vector<int64_t> perm(x.numel());
    for (int64_t i = 0; i < x.numel(); ++i) perm[i] = i;
    for (int64_t i = x.numel() - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
    for (int64_t i = 0; i < x.numel(); ++i) x.set(i, 0.01 * double(perm[i]) - 1.0);
    x.set_requires_grad(true);
    Tensor y = max_pool2d(x, c.o);
    // Reference: max over the window, padding excluded.
    const int64_t H = c.x[2], W = c.x[3], OH = y.dim(2), OW = y.dim(3);
    for (int64_t p = 0; p < c.x[0] * c.x[1]; ++p)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          double m = -1e300;
          for (int i = 0; i < c.o.kernel_h; ++i)
            for (int j = 0; j < c.o.kernel_w; ++j) {
              const int64_t ih = oh * c.o.stride_h - c.o.pad_h + i, iw = ow * c.o.stride_w - c.o.pad_w + j;
              if (ih >= 0 && ih < H && iw >= 0 && iw < W) m = std::max(m, x.at(p * H * W + ih * W + iw));
            }
          CHECK(y.at((p * OH + oh) * OW + ow) == m);
        }
    gradcheck([&](const std::vector<Tensor>& in) { return max_pool2d(in[0], c.o); }, {x});
  }
}

TEST_CASE("max_pool2d ties and NaN: the first maximum in window order wins, a NaN beats all") {
  // Values from {0, 1, 2} make ties everywhere, on the border and in the interior (where the
  // CPU takes its branch-free path); two NaNs, one inside and one on the border. Reference:
  // loops with the same rule; backward with dY = 1 puts each output's 1 on its winner.
  for (DType dt : {DType::F64, DType::F32}) {
    CAPTURE(dtype_name(dt));
    const Shape shape{2, 2, 9, 11};
    Tensor x = Tensor::empty(shape, dt);
    Rng rng(61);
    for (int64_t i = 0; i < x.numel(); ++i) x.set(i, double(rng.below(3)));
    x.set(4 * 11 + 5, NAN);        // interior of plane 0
    x.set(99 + 8 * 11 + 10, NAN);  // last corner of plane 1
    x.set_requires_grad(true);
    const Pool2dOptions o = Pool2dOptions::square(3, 2, 1);
    Tape tape;
    Tensor y;
    {
      TapeScope sc(tape);
      y = max_pool2d(x, o);
    }
    tape.backward({y}, {Tensor::full(y.shape(), 1.0, dt)});
    const int64_t H = shape[2], W = shape[3], OH = y.dim(2), OW = y.dim(3);
    std::vector<double> want_gx(x.numel(), 0.0);
    for (int64_t p = 0; p < shape[0] * shape[1]; ++p)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          int64_t best = -1;
          for (int i = 0; i < 3; ++i)
            for (int j = 0; j < 3; ++j) {
              const int64_t ih = oh * 2 - 1 + i, iw = ow * 2 - 1 + j;
              if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
              const int64_t k = p * H * W + ih * W + iw;
              const double v = x.at(k), b = best < 0 ? 0 : x.at(best);
              if (best < 0 || v > b || (std::isnan(v) && !std::isnan(b))) best = k;
            }
          const double got = y.at((p * OH + oh) * OW + ow);
          if (std::isnan(x.at(best)))
            CHECK(std::isnan(got));
          else
            CHECK(got == x.at(best));
          want_gx[best] += 1;
        }
    for (int64_t i = 0; i < x.numel(); ++i) CHECK(x.grad().at(i) == want_gx[i]);
  }
}

TEST_CASE("upsample_nearest2x and concat_channels: forward and gradients") {
  Rng rng(7);
  Tensor x = random_tensor({2, 3, 3, 5}, rng).set_requires_grad(true);
  Tensor y = upsample_nearest2x(x);
  REQUIRE(y.shape() == Shape{2, 3, 6, 10});
  for (int64_t p = 0; p < 6; ++p)
    for (int64_t h = 0; h < 6; ++h)
      for (int64_t w = 0; w < 10; ++w)
        CHECK(y.at((p * 6 + h) * 10 + w) == x.at((p * 3 + h / 2) * 5 + w / 2));
  gradcheck([](const std::vector<Tensor>& in) { return upsample_nearest2x(in[0]); }, {x});

  Tensor a = random_tensor({2, 2, 3, 3}, rng).set_requires_grad(true);
  Tensor b = random_tensor({2, 3, 3, 3}, rng);  // no gradient wanted for this one
  Tensor c = random_tensor({2, 1, 3, 3}, rng).set_requires_grad(true);
  Tensor cat = concat_channels({a, b, c});
  REQUIRE(cat.shape() == Shape{2, 6, 3, 3});
  CHECK(cat.at(0) == a.at(0));
  CHECK(cat.at(2 * 9) == b.at(0));
  CHECK(cat.at(5 * 9 + 4) == c.at(4));
  CHECK(cat.at(6 * 9 + 2 * 9) == b.at(27));  // sample 1, channel 2 is b's channel 0
  gradcheck([&](const std::vector<Tensor>& in) { return concat_channels({in[0], b, in[1]}); },
            {a, c});
}

TEST_CASE("losses: BCE-with-logits, soft Dice, their sum, values and gradients") {
  Rng rng(8);
  Tensor x = random_tensor({2, 1, 5, 3}, rng, -3, 3).set_requires_grad(true);
  Tensor t = Tensor::empty({2, 1, 5, 3}, DType::F64);
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, rng.uniform() < 0.4 ? 1.0 : 0.0);
  // Values against the textbook formulas.
  double bce = 0, inter = 0, ps = 0, ts = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double p = 1 / (1 + std::exp(-x.at(i)));
    bce += -(t.at(i) * std::log(p) + (1 - t.at(i)) * std::log(1 - p));
    inter += p * t.at(i), ps += p, ts += t.at(i);
  }
  bce /= double(x.numel());
  CHECK(std::fabs(bce_with_logits(x, t).item() - bce) < 1e-12);
  CHECK(std::fabs(dice_loss(x, t).item() - (1 - (2 * inter + 1) / (ps + ts + 1))) < 1e-12);
  CHECK(std::fabs(segmentation_loss(LossKind::BCEDice, x, t).item() -
                  (bce + 1 - (2 * inter + 1) / (ps + ts + 1))) < 1e-12);
  for (LossKind k : {LossKind::BCE, LossKind::Dice, LossKind::BCEDice}) {
    CAPTURE(loss_kind_name(k));
    gradcheck([&](const std::vector<Tensor>& in) { return segmentation_loss(k, in[0], t); }, {x});
  }
  gradcheck([&](const std::vector<Tensor>& in) { return dice_loss(in[0], t, 0.0); }, {x});
}

TEST_CASE("losses skip ignored pixels: binary losses equal the losses over the counted elements") {
  Rng rng(81);
  Tensor x = random_tensor({2, 1, 5, 3}, rng, -3, 3).set_requires_grad(true);
  Tensor t = Tensor::empty({2, 1, 5, 3}, DType::F64);
  std::vector<double> kept_x, kept_t;
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double u = rng.uniform();
    t.set(i, u < 0.2 ? -1.0 : u < 0.6 ? 1.0 : 0.0);
    if (t.at(i) >= 0) kept_x.push_back(x.at(i)), kept_t.push_back(t.at(i));
  }
  REQUIRE(kept_x.size() < size_t(t.numel()));
  const int64_t k = int64_t(kept_x.size());
  Tensor xk = Tensor::from_vector({k}, kept_x, DType::F64), tk = Tensor::from_vector({k}, kept_t, DType::F64);
  for (LossKind kind : {LossKind::BCE, LossKind::Dice, LossKind::BCEDice}) {
    CAPTURE(loss_kind_name(kind));
    CHECK(std::fabs(segmentation_loss(kind, x, t).item() - segmentation_loss(kind, xk, tk).item()) < 1e-14);
    gradcheck([&](const std::vector<Tensor>& in) { return segmentation_loss(kind, in[0], t); }, {x});
    // An ignored element's gradient is 0.
    Tape tape;
    Tensor loss;
    {
      TapeScope sc(tape);
      loss = segmentation_loss(kind, x, t);
    }
    x.zero_grad();
    tape.backward(loss);
    for (int64_t i = 0; i < t.numel(); ++i)
      if (t.at(i) < 0) CHECK(x.grad().at(i) == 0.0);
  }
  // Every element ignored: the loss and its gradient are 0.
  CHECK(bce_with_logits(x, Tensor::full({2, 1, 5, 3}, -1.0, DType::F64)).item() == 0.0);
}

// nn.CrossEntropyLoss(ignore_index) and SMP's multiclass DiceLoss (smooth 0, eps 1e-7), written
// out per pixel in float64.
static void multiclass_reference(const Tensor& x, const Tensor& t, double* ce, double* dice) {
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3);
  std::vector<double> inter(C, 0), ps(C, 0), ts(C, 0);
  double sum = 0, count = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t q = 0; q < HW; ++q) {
      const double tv = t.at(n * HW + q);
      if (tv < 0) continue;
      double z = 0;
      for (int64_t c = 0; c < C; ++c) z += std::exp(x.at((n * C + c) * HW + q));
      const int64_t k = int64_t(tv);
      sum += std::log(z) - x.at((n * C + k) * HW + q), count += 1;
      for (int64_t c = 0; c < C; ++c) {
        const double p = std::exp(x.at((n * C + c) * HW + q)) / z;
        ps[c] += p, inter[c] += c == k ? p : 0, ts[c] += c == k;
      }
    }
  *ce = sum / count;
  *dice = 0;
  for (int64_t c = 0; c < C; ++c)
    if (ts[c] > 0) *dice += 1 - 2 * inter[c] / std::max(ps[c] + ts[c], 1e-7);
  *dice /= double(C);
}

TEST_CASE("multiclass losses: cross-entropy and SMP's Dice, ignored pixels, an absent class, gradients") {
  Rng rng(82);
  const int64_t C = 4;
  Tensor x = random_tensor({2, C, 5, 3}, rng, -3, 3).set_requires_grad(true);
  Tensor t = Tensor::empty({2, 1, 5, 3}, DType::F64);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double u = rng.uniform();
    t.set(i, u < 0.15 ? -1.0 : double(int64_t(rng.uniform() * 3)));  // class 3 never appears
  }
  double ce, dice;
  multiclass_reference(x, t, &ce, &dice);
  CHECK(std::fabs(cross_entropy(x, t).item() - ce) < 1e-13);
  CHECK(std::fabs(multiclass_dice_loss(x, t).item() - dice) < 1e-13);
  CHECK(std::fabs(segmentation_loss(LossKind::BCEDice, x, t).item() - (ce + dice)) < 1e-13);
  CHECK(std::fabs(segmentation_loss(LossKind::BCE, x, t).item() - ce) < 1e-13);
  CHECK(std::fabs(segmentation_loss(LossKind::Dice, x, t).item() - dice) < 1e-13);
  for (LossKind k : {LossKind::BCE, LossKind::Dice, LossKind::BCEDice}) {
    CAPTURE(loss_kind_name(k, int(C)));
    CHECK(gradcheck([&](const std::vector<Tensor>& in) { return segmentation_loss(k, in[0], t); }, {x}) > 0);
  }
  CHECK(gradcheck([&](const std::vector<Tensor>& in) { return multiclass_dice_loss(in[0], t, 1.0); }, {x}) > 0);
  // Ignored pixels get no gradient in any class.
  Tape tape;
  Tensor loss;
  {
    TapeScope sc(tape);
    loss = segmentation_loss(LossKind::BCEDice, x, t);
  }
  x.zero_grad();
  tape.backward(loss);
  const int64_t HW = 15;
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t q = 0; q < HW; ++q)
      if (t.at(n * HW + q) < 0)
        for (int64_t c = 0; c < C; ++c) CHECK(x.grad().at((n * C + c) * HW + q) == 0.0);
  CHECK(std::string(loss_kind_name(LossKind::BCEDice, 3)) == "ce+dice");
  CHECK(std::string(loss_kind_name(LossKind::BCEDice, 1)) == "bce+dice");
  CHECK(parse_named(kLossNames, "loss", "ce") == LossKind::BCE);
  CHECK_THROWS_WITH(cross_entropy(x, Tensor::zeros({2, C, 5, 3}, DType::F64)),
                    doctest::Contains("must be [N, 1, H, W] class indices"));
  CHECK_THROWS_WITH(bce_with_logits(x, t), doctest::Contains("this loss is for one (binary)"));
}

TEST_CASE("BCE with logits stays finite at |x| = 100") {
  for (DType dt : {DType::F32, DType::F64}) {
    Tensor x = Tensor::from_vector({4}, {100, -100, 100, -100}, dt).set_requires_grad(true);
    Tensor t = Tensor::from_vector({4}, {1, 0, 0, 1}, dt);
    Tape tape;
    Tensor loss;
    {
      TapeScope s(tape);
      loss = bce_with_logits(x, t);
    }
    // Two exact hits (loss ~ e^-100) and two misses of 100 each: mean 50.
    CHECK(std::isfinite(loss.item()));
    CHECK(loss.item() == doctest::Approx(50.0).epsilon(1e-6));
    tape.backward(loss);
    const std::vector<double> g = x.grad().to_vector();
    const std::vector<double> expect = {0, 0, 0.25, -0.25};  // (sigmoid(x) - t) / 4
    for (int i = 0; i < 4; ++i) CHECK(g[i] == doctest::Approx(expect[i]).epsilon(1e-6));
  }
}

TEST_CASE("float32 ops agree with float64 to float32 precision") {
  Rng rng(9);
  Tensor x = random_tensor({2, 3, 9, 7}, rng), w = random_tensor({4, 3, 3, 3}, rng);
  Tensor b = random_tensor({4}, rng), g = random_tensor({3}, rng, 0.5, 1.5), bt = random_tensor({3}, rng);
  auto f32 = [](const Tensor& t) { return t.to(DType::F32); };
  auto close = [](const Tensor& a32, const Tensor& a64, double tol) {
    Tensor a = a32.to(DType::F64);
    double scale = 0;
    for (int64_t i = 0; i < a64.numel(); ++i) scale = std::max(scale, std::fabs(a64.at(i)));
    CHECK(max_abs_diff(a, a64) <= tol * std::max(1.0, scale));
  };
  // float32 epsilon is 6e-8; sums of up to 27 products accumulate ~1e-6 relative.
  close(conv2d(f32(x), f32(w), f32(b), 2, 1), conv2d(x, w, b, 2, 1), 1e-5);
  Tensor rm32 = Tensor::zeros({3}), rv32 = Tensor::full({3}, 1.0);
  Tensor rm64 = Tensor::zeros({3}, DType::F64), rv64 = Tensor::full({3}, 1.0, DType::F64);
  close(batch_norm2d(f32(x), f32(g), f32(bt), rm32, rv32, true), batch_norm2d(x, g, bt, rm64, rv64, true), 1e-5);
  close(rm32, rm64, 1e-6);
  close(rv32, rv64, 1e-6);
  close(relu(f32(x)), relu(x), 1e-7);
  close(sigmoid(f32(x)), sigmoid(x), 1e-7);
  close(max_pool2d(f32(x), Pool2dOptions::square(3, 2, 1)), max_pool2d(x, Pool2dOptions::square(3, 2, 1)), 1e-7);
  close(upsample_nearest2x(f32(x)), upsample_nearest2x(x), 1e-7);
  Tensor t = Tensor::empty({2, 1, 9, 7}, DType::F64);  // class indices of the 3 channels
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, double(int64_t(rng.uniform() * 3)));
  close(segmentation_loss(LossKind::BCEDice, f32(x), f32(t)), segmentation_loss(LossKind::BCEDice, x, t), 1e-6);
  const Tensor x1 = random_tensor({2, 1, 9, 7}, rng);  // one channel: 0/1 targets
  Tensor t1 = Tensor::empty(x1.shape(), DType::F64);
  for (int64_t i = 0; i < t1.numel(); ++i) t1.set(i, rng.uniform() < 0.5);
  close(segmentation_loss(LossKind::BCEDice, f32(x1), f32(t1)), segmentation_loss(LossKind::BCEDice, x1, t1), 1e-6);
}

TEST_CASE("bad inputs are refused with a clear message") {
  Tensor a = Tensor::zeros({1, 2, 4, 4}), b = Tensor::zeros({1, 2, 4, 4}, DType::F64);
  CHECK_THROWS_WITH(add(a, b), doctest::Contains("dtype mismatch"));
  CHECK_THROWS_WITH(add(a, Tensor::zeros({1, 2, 4, 5})), doctest::Contains("shape mismatch"));
  CHECK_THROWS_WITH(conv2d(a, Tensor::zeros({3, 5, 3, 3}), Tensor()),
                    doctest::Contains("expects 5"));
  CHECK_THROWS_WITH(conv2d(a, Tensor::zeros({3, 2, 9, 9}), Tensor()),
                    doctest::Contains("smaller than the kernel"));
  CHECK_THROWS_WITH(bce_with_logits(Tensor::zeros({1, 1, 4, 4}), Tensor::zeros({1, 1, 4, 5})),
                    doctest::Contains("shape mismatch"));
  CHECK_THROWS_WITH(concat_channels({a, Tensor::zeros({1, 2, 3, 4})}),
                    doctest::Contains("differ outside the channel"));
  Tensor rm = Tensor::zeros({2}), rv = Tensor::full({2}, 1.0);
  CHECK_THROWS_WITH(batch_norm2d(Tensor::zeros({1, 2, 1, 1}), Tensor::full({2}, 1.0),
                                 Tensor::zeros({2}), rm, rv, true),
                    doctest::Contains("more than one value per channel"));
  CHECK_THROWS_WITH(parse_named(kLossNames, "loss", "focal"),
                    doctest::Contains("unknown loss 'focal' (expected bce, dice, bce+dice, ce or ce+dice)"));
  CHECK(parse_named(kLossNames, "loss", "bce+dice") == LossKind::BCEDice);
  CHECK_THROWS_WITH(a.data<double>(), doctest::Contains("read as float64"));
}
