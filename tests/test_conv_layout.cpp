// conv2d in channels-last and bfloat16 on the CPU:
//  - NHWC activations and OHWI weights give what NCHW/OIHW give, forward and the three
//    gradients, written (first backward) and accumulated (second backward, beta = 1): float64
//    to 1e-12 (the same im2col arithmetic on converted copies), float32 to 1e-5 (oneDNN's nhwc
//    kernels sum in another order than its blocked ones; im2col on converted copies);
//  - bfloat16 against the float32 op on the same bfloat16-rounded inputs, element by element,
//    within the bound of one bfloat16 rounding of the output plus float32 accumulation, on
//    oneDNN's bfloat16 kernels and on the float32 fallbacks (oneDNN float32, im2col);
//  - float64 NHWC gradients against central finite differences;
//  - the direct path for few output channels (conv_narrow.h) against im2col + GEMM.
#include <cmath>

#include "engine/ops.h"
#include "kernels/cpu/conv_dnnl.h"
#include "kernels/cpu/conv_narrow.h"
#include "kernels/launchers.h"
#include "testing.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {

using kernels::cpu::CpuConvImpl;

struct ConvCase {
  Shape x, w;
  Conv2dOptions opt;
  bool bias;
};

// Geometries: stride 2 with padding, non-square kernel and mixed stride/padding, 1x1, the
// ResNet stem (7x7 stride 2 on 3 channels), the 1x1 stride-2 downsample, odd sizes, I != O,
// and channel counts where oneDNN's vector kernels (16 channels a register) take NHWC directly.
const std::vector<ConvCase> kCases = {
    {{2, 3, 7, 6}, {4, 3, 3, 3}, {2, 2, 1, 1}, true},
    {{3, 2, 5, 9}, {3, 2, 3, 2}, {1, 2, 0, 1}, false},
    {{2, 4, 5, 5}, {5, 4, 1, 1}, {1, 1, 0, 0}, true},
    {{2, 3, 19, 17}, {8, 3, 7, 7}, {2, 2, 3, 3}, false},
    {{2, 5, 9, 7}, {6, 5, 1, 1}, {2, 2, 0, 0}, false},
    {{2, 16, 11, 13}, {32, 16, 3, 3}, {1, 1, 1, 1}, true},
    {{3, 32, 9, 10}, {16, 32, 3, 3}, {2, 2, 1, 1}, false},
};

// The output and the gradients after each backward pass, as float64 NCHW copies. The second
// pass accumulates, with its output gradient scaled by kSecondScale (a power of two: exactly
// kSecondScale times the first pass's gradient) so that the accumulated sum is led by the new
// term, whose rounding then shows.
struct Pass {
  Tensor y, gx, gw, gb;
};
constexpr double kSecondScale = 64;

Tensor f64(const Tensor& t) { return t.defined() ? t.to(DType::F64).to(MemoryFormat::NCHW) : t; }

// conv2d on (x, w, b) in `dtype`, x in x_format and w in w_format, back-propagating gy (given
// float64 NCHW), then kSecondScale * gy. Checks that y and the gradients have the dtypes and formats the op
// promises.
std::vector<Pass> run(const Tensor& x64, const Tensor& w64, const Tensor& b64, const Tensor& gy64,
                      const Conv2dOptions& opt, DType dtype, MemoryFormat x_format,
                      MemoryFormat w_format) {
  Tensor x = x64.to(dtype).to(x_format).set_requires_grad(true);
  Tensor w = w64.to(dtype).to(w_format).set_requires_grad(true);
  Tensor b = b64.defined() ? b64.to(dtype).set_requires_grad(true) : Tensor();
  const Tensor gys[2] = {gy64.to(dtype).to(x_format), scale(gy64, kSecondScale).to(dtype).to(x_format)};
  std::vector<Pass> passes;
  for (int pass = 0; pass < 2; ++pass) {
    Tape tape;
    Tensor y;
    {
      TapeScope scope(tape);
      y = conv2d(x, w, b, opt);
    }
    CHECK(y.dtype() == dtype);
    CHECK(y.format() == x_format);
    tape.backward({y}, {gys[pass]});
    CHECK(x.grad().dtype() == dtype);
    CHECK(x.grad().format() == x_format);
    CHECK(w.grad().dtype() == dtype);
    CHECK(w.grad().format() == w_format);
    passes.push_back({f64(y), f64(x.grad()), f64(w.grad()), f64(b.defined() ? b.grad() : Tensor())});
  }
  return passes;
}

// ‖a − b‖ / ‖b‖ over all elements (logical order).
double rel_error(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  double num = 0, den = 0;
  for (int64_t i = 0; i < b.numel(); ++i) {
    num += std::pow(a.at(i) - b.at(i), 2);
    den += b.at(i) * b.at(i);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

void check_close(const std::vector<Pass>& got, const std::vector<Pass>& want, double tol) {
  for (size_t p = 0; p < want.size(); ++p) {
    CAPTURE(p);
    CHECK(rel_error(got[p].y, want[p].y) < tol);
    CHECK(rel_error(got[p].gx, want[p].gx) < tol);
    CHECK(rel_error(got[p].gw, want[p].gw) < tol);
    if (want[p].gb.defined()) CHECK(rel_error(got[p].gb, want[p].gb) < tol);
  }
}

// Restores the CPU convolution settings a test changes.
struct ConvSettings {
  CpuConvImpl impl = kernels::cpu::cpu_conv_impl();
  ~ConvSettings() {
    kernels::cpu::set_cpu_conv_impl(impl);
    kernels::cpu::set_onednn_bf16_allowed(true);
    kernels::cpu::set_narrow_conv_allowed(true);
  }
};

std::vector<CpuConvImpl> impls() {
  std::vector<CpuConvImpl> v = {CpuConvImpl::Im2col};
  if (kernels::cpu::onednn_built()) v.push_back(CpuConvImpl::OneDnn);
  return v;
}

Tensor abs_of(const Tensor& t) {
  Tensor a = t.clone();
  for (int64_t i = 0; i < a.numel(); ++i) a.set(i, std::fabs(a.at(i)));
  return a;
}

Tensor bf16_rounded(const Tensor& t64) { return t64.to(DType::BF16).to(DType::F64); }

// The largest |got − want| / bound over the elements; every element must stay within its bound.
double worst_ratio(const Tensor& got, const Tensor& want, const Tensor& bound) {
  double worst = 0;
  for (int64_t i = 0; i < want.numel(); ++i)
    worst = std::max(worst, std::fabs(got.at(i) - want.at(i)) / bound.at(i));
  return worst;
}

}  // namespace

TEST_CASE("conv2d NHWC and OHWI equal NCHW and OIHW in float64 and float32, forward and backward") {
  ConvSettings restore;
  Rng rng(71);
  const std::pair<MemoryFormat, MemoryFormat> layouts[] = {
      {MemoryFormat::NHWC, MemoryFormat::NHWC},  // what the model passes: w in x's format
      {MemoryFormat::NHWC, MemoryFormat::NCHW},
      {MemoryFormat::NCHW, MemoryFormat::NHWC}};
  for (const ConvCase& c : kCases) {
    CAPTURE(shape_str(c.x));
    CAPTURE(shape_str(c.w));
    const Tensor x = random_tensor(c.x, rng), w = random_tensor(c.w, rng);
    const Tensor b = c.bias ? random_tensor({c.w[0]}, rng) : Tensor();
    const Tensor gy = random_tensor(conv2d(x, w, b, c.opt).shape(), rng);
    for (DType dtype : {DType::F64, DType::F32}) {
      CAPTURE(dtype_name(dtype));
      // float64 always runs im2col; float32 on both CPU paths.
      for (CpuConvImpl impl : dtype == DType::F64 ? std::vector<CpuConvImpl>{CpuConvImpl::Im2col} : impls()) {
        CAPTURE(int(impl));
        if (dtype == DType::F32) kernels::cpu::set_cpu_conv_impl(impl);
        const std::vector<Pass> want =
            run(x, w, b, gy, c.opt, dtype, MemoryFormat::NCHW, MemoryFormat::NCHW);
        for (auto [xf, wf] : layouts) {
          CAPTURE(format_name(xf));
          CAPTURE(format_name(wf));
          check_close(run(x, w, b, gy, c.opt, dtype, xf, wf), want, dtype == DType::F64 ? 1e-12 : 1e-5);
        }
      }
    }
  }
}

TEST_CASE("conv2d bfloat16 equals the float32 op on the same bf16-rounded inputs within one rounding") {
  // got: the bfloat16 op; want: the float32 op on the same (bf16-rounded) x, w, b and output
  // gradient. Each element of both is a float32 sum of K products (K = C*kh*kw for y, at most
  // O*kh*kw for grad_x, N*OH*OW for grad_w and grad_b), whose error is at most
  // gamma_K * A ~ K 2^-24 A, A the same sum of absolute values (the convolution of |x| and |w|,
  // plus |b|; of |dy| with |w| or |x|), computed in float64. The bfloat16 op rounds its float32
  // result once to 8 significant bits: relative error at most u = 2^-8. So per element
  //   |got - want| <= u |want| + (1 + u) 2 K 2^-24 A.
  // The second backward accumulates (its output gradient scaled by kSecondScale): got2 =
  // bf16(float(got1) + s) with s the float32 sum, against want2 = got1 + kSecondScale times
  // want's first gradient (A scaled alike), which adds one float32 rounding of the sum
  // (2^-24 |want2|). A second rounding (of s before the sum) would show: s leads the sum.
  // The bound used, for every output: (u + 2^-22) |want| + 2.1 K 2^-24 A. Every element must
  // stay within it, and the worst element must come near it (above a quarter: a float32 result
  // that was never rounded to bfloat16 would stay near 2^-16 of it).
  ConvSettings restore;
  const double u = std::ldexp(1.0, -8), e32 = std::ldexp(1.0, -24);
  const std::vector<ConvCase> cases = {{{2, 16, 17, 13}, {16, 16, 3, 3}, {1, 1, 1, 1}, false},
                                       {{2, 3, 37, 30}, {16, 3, 7, 7}, {2, 2, 3, 3}, false},
                                       {{3, 16, 17, 13}, {32, 16, 3, 3}, {2, 2, 1, 1}, false},
                                       {{3, 16, 16, 12}, {32, 16, 1, 1}, {2, 2, 0, 0}, false},
                                       {{2, 16, 20, 18}, {1, 16, 3, 3}, {1, 1, 1, 1}, true},
                                       {{2, 5, 9, 7}, {6, 5, 3, 2}, {1, 2, 1, 0}, true}};
  const std::pair<MemoryFormat, MemoryFormat> layouts[] = {{MemoryFormat::NHWC, MemoryFormat::NHWC},
                                                           {MemoryFormat::NCHW, MemoryFormat::NCHW},
                                                           {MemoryFormat::NHWC, MemoryFormat::NCHW}};
  // The paths: oneDNN's bfloat16 kernels (where this CPU has them), the float32 fallback on
  // oneDNN (as on a CPU without bfloat16 kernels) and on im2col (no oneDNN).
  struct Path {
    const char* name;
    CpuConvImpl impl;
    bool bf16_kernels;
  };
  std::vector<Path> paths = {{"im2col", CpuConvImpl::Im2col, false}};
  if (kernels::cpu::onednn_built()) {
    paths.push_back({"oneDNN float32 fallback", CpuConvImpl::OneDnn, false});
    if (kernels::cpu::onednn_bf16_supported())
      paths.push_back({"oneDNN bfloat16", CpuConvImpl::OneDnn, true});
    else
      WARN_MESSAGE(false, "oneDNN has no bfloat16 kernels on this CPU: only the fallbacks are checked");
  }
  Rng rng(72);
  for (const ConvCase& c : cases) {
    CAPTURE(shape_str(c.x));
    CAPTURE(shape_str(c.w));
    const Tensor x = bf16_rounded(random_tensor(c.x, rng)), w = bf16_rounded(random_tensor(c.w, rng));
    const Tensor b = c.bias ? bf16_rounded(random_tensor({c.w[0]}, rng)) : Tensor();
    const Tensor gy = bf16_rounded(random_tensor(conv2d(x, w, b, c.opt).shape(), rng));
    // The absolute-value sums A, in float64.
    const std::vector<Pass> abs_sums = run(abs_of(x), abs_of(w), c.bias ? abs_of(b) : Tensor(),
                                           abs_of(gy), c.opt, DType::F64, MemoryFormat::NCHW,
                                           MemoryFormat::NCHW);
    const Shape& ys = abs_sums[0].y.shape();
    const double K_y = double(c.x[1] * c.w[2] * c.w[3]) + (c.bias ? 1 : 0);
    const double K_x = double(c.w[0] * c.w[2] * c.w[3]);
    const double K_w = double(ys[0] * ys[2] * ys[3]);
    auto bound = [&](const Tensor& want, const Tensor& A, double K) {
      Tensor r = Tensor::empty(want.shape(), DType::F64);
      for (int64_t i = 0; i < want.numel(); ++i)
        r.set(i, (u + 4 * e32) * std::fabs(want.at(i)) + 2.1 * K * e32 * A.at(i) + 1e-300);
      return r;
    };
    for (const Path& path : paths) {
      CAPTURE(path.name);
      kernels::cpu::set_cpu_conv_impl(path.impl);
      kernels::cpu::set_onednn_bf16_allowed(path.bf16_kernels);
      // want: the float32 op (NCHW) on the same values, on the same CPU path.
      const std::vector<Pass> want =
          run(x, w, b, gy, c.opt, DType::F32, MemoryFormat::NCHW, MemoryFormat::NCHW);
      for (auto [xf, wf] : layouts) {
        CAPTURE(format_name(xf));
        CAPTURE(format_name(wf));
        if (path.bf16_kernels && xf == wf) {
          // The bfloat16 kernels really run: oneDNN takes this case rather than declining it.
          const Tensor xb = x.to(DType::BF16).to(xf), wb = w.to(DType::BF16).to(wf);
          const Tensor bb = c.bias ? b.to(DType::BF16) : Tensor();
          Tensor yb = Tensor::empty(ys, DType::BF16, Device::cpu(), xf);
          kernels::ConvGeometry g{c.x[0], c.x[1], c.x[2], c.x[3], c.w[0], ys[2], ys[3],
                                  int(c.w[2]), int(c.w[3]), c.opt.stride_h, c.opt.stride_w,
                                  c.opt.pad_h, c.opt.pad_w};
          CHECK(kernels::cpu::onednn_conv2d_forward(xb, wb, bb, yb, g));
          const Tensor gyb = gy.to(DType::BF16).to(xf);
          Tensor gxb = Tensor::zeros(c.x, DType::BF16, Device::cpu(), xf);
          Tensor gwb = Tensor::zeros(c.w, DType::BF16, Device::cpu(), wf);
          for (double beta : {0.0, 1.0})  // grad_x in bfloat16, then in float32 and added
            CHECK(kernels::cpu::onednn_conv2d_backward(gyb, xb, wb, gxb, beta, gwb, beta, g));
        }
        const std::vector<Pass> got = run(x, w, b, gy, c.opt, DType::BF16, xf, wf);
        // Pass 1: written; pass 2: accumulated onto pass 1's bfloat16 gradient.
        for (int p = 0; p < 2; ++p) {
          CAPTURE(p);
          // want's second pass holds two of its own passes; its one-pass gradient is pass 1's.
          const double s = p == 0 ? 1 : kSecondScale;
          auto expected = [&](const Tensor& one_pass_want, const Tensor& prev_got) {
            Tensor e = scale(one_pass_want, s);
            if (p == 1)
              for (int64_t i = 0; i < e.numel(); ++i) e.set(i, e.at(i) + prev_got.at(i));
            return e;
          };
          const Tensor gx_want = expected(want[0].gx, got[0].gx);
          const Tensor gw_want = expected(want[0].gw, got[0].gw);
          const double rx =
              worst_ratio(got[p].gx, gx_want, bound(gx_want, scale(abs_sums[0].gx, s), K_x));
          const double rw =
              worst_ratio(got[p].gw, gw_want, bound(gw_want, scale(abs_sums[0].gw, s), K_w));
          CAPTURE(rx);
          CAPTURE(rw);
          CHECK(rx <= 1);
          CHECK(rw <= 1);
          CHECK(rx > 0.25);
          CHECK(rw > 0.25);
          if (c.bias) {
            const Tensor gb_want = expected(want[0].gb, got[0].gb);
            const double rb =
                worst_ratio(got[p].gb, gb_want, bound(gb_want, scale(abs_sums[0].gb, s), K_w));
            CAPTURE(rb);
            CHECK(rb <= 1);
          }
          const double ry = worst_ratio(got[p].y, want[p].y, bound(want[p].y, abs_sums[0].y, K_y));
          CAPTURE(ry);
          CHECK(ry <= 1);
          CHECK(ry > 0.25);
        }
      }
    }
  }
}

TEST_CASE("conv2d float64 NHWC gradients equal finite differences") {
  Rng rng(73);
  for (const ConvCase& c : kCases) {
    CAPTURE(shape_str(c.x));
    CAPTURE(shape_str(c.w));
    for (MemoryFormat wf : {MemoryFormat::NHWC, MemoryFormat::NCHW}) {
      CAPTURE(format_name(wf));
      Tensor x = random_tensor(c.x, rng).to(MemoryFormat::NHWC).set_requires_grad(true);
      Tensor w = random_tensor(c.w, rng).to(wf).set_requires_grad(true);
      Tensor b = c.bias ? random_tensor({c.w[0]}, rng).set_requires_grad(true) : Tensor();
      // The checker seeds backward with an NCHW tensor: the NHWC output is converted to NCHW
      // (exactly, an autograd op) first.
      GradcheckOptions go;
      go.max_checks_per_input = 30;
      gradcheck(
          [&](const std::vector<Tensor>& in) {
            return convert(conv2d(in[0], in[1], in[2], c.opt), DType::F64, MemoryFormat::NCHW);
          },
          {x, w, b}, go);
    }
  }
}

TEST_CASE("conv2d with few output channels runs directly and equals im2col + GEMM in both layouts") {
  // The direct path (kernels/cpu/conv_narrow.h) against the im2col + GEMM reference (the
  // direct path switched off): float64 to 1e-12 (sums of the same products in another order),
  // float32 to 1e-5 of the float64 reference; output, and the three gradients written and
  // then accumulated (beta = 1, run()'s second pass), with x and w in either layout. bfloat16
  // on this path is held to one rounding by the bfloat16 test above (its head-shaped case).
  ConvSettings restore;
  kernels::cpu::set_cpu_conv_impl(CpuConvImpl::Im2col);
  const std::vector<ConvCase> cases = {
      {{2, 16, 20, 18}, {1, 16, 3, 3}, {1, 1, 1, 1}, true},  // the segmentation head
      {{3, 5, 9, 7}, {2, 5, 3, 2}, {1, 1, 0, 1}, true},      // non-square kernel, mixed padding
      {{2, 3, 6, 11}, {4, 3, 1, 1}, {1, 1, 0, 0}, false},    // 1x1
      {{1, 4, 5, 6}, {3, 4, 5, 5}, {1, 1, 2, 2}, true},      // kernel as tall as the input
      {{2, 2, 4, 3}, {1, 2, 1, 1}, {1, 1, 1, 2}, true},      // border outputs of padding alone
      {{1, 3, 3, 4}, {2, 3, 3, 5}, {1, 1, 2, 3}, false},     // more padding than kernel
  };
  const std::pair<MemoryFormat, MemoryFormat> layouts[] = {{MemoryFormat::NCHW, MemoryFormat::NCHW},
                                                           {MemoryFormat::NHWC, MemoryFormat::NHWC},
                                                           {MemoryFormat::NHWC, MemoryFormat::NCHW},
                                                           {MemoryFormat::NCHW, MemoryFormat::NHWC}};
  Rng rng(74);
  for (const ConvCase& c : cases) {
    CAPTURE(shape_str(c.x));
    CAPTURE(shape_str(c.w));
    const Tensor x = random_tensor(c.x, rng), w = random_tensor(c.w, rng);
    const Tensor b = c.bias ? random_tensor({c.w[0]}, rng) : Tensor();
    const Tensor gy = random_tensor(conv2d(x, w, b, c.opt).shape(), rng);
    const Shape& ys = gy.shape();
    const kernels::ConvGeometry g{c.x[0], c.x[1], c.x[2], c.x[3], c.w[0], ys[2], ys[3],
                                  int(c.w[2]), int(c.w[3]), c.opt.stride_h, c.opt.stride_w,
                                  c.opt.pad_h, c.opt.pad_w};
    kernels::cpu::set_narrow_conv_allowed(false);
    CHECK_FALSE(kernels::cpu::narrow_conv_takes(g));
    const std::vector<Pass> want =
        run(x, w, b, gy, c.opt, DType::F64, MemoryFormat::NCHW, MemoryFormat::NCHW);
    kernels::cpu::set_narrow_conv_allowed(true);
    REQUIRE(kernels::cpu::narrow_conv_takes(g));
    for (DType dtype : {DType::F64, DType::F32}) {
      CAPTURE(dtype_name(dtype));
      for (auto [xf, wf] : layouts) {
        CAPTURE(format_name(xf));
        CAPTURE(format_name(wf));
        check_close(run(x, w, b, gy, c.opt, dtype, xf, wf), want, dtype == DType::F64 ? 1e-12 : 1e-5);
      }
    }
  }
  // Not taken: stride 2, or more output channels than kNarrowConvMaxOutputs.
  CHECK_FALSE(kernels::cpu::narrow_conv_takes({2, 16, 20, 18, 1, 10, 9, 3, 3, 2, 2, 1, 1}));
  CHECK_FALSE(kernels::cpu::narrow_conv_takes(
      {2, 16, 20, 18, kernels::cpu::kNarrowConvMaxOutputs + 1, 20, 18, 3, 3, 1, 1, 1, 1}));
}
