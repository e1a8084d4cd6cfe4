// On a GPU: conv2d in channels-last and bfloat16 against the CPU float64 op.
//  - float32 with NHWC activations and OHWI (or OIHW) weights, TF32 off: forward and the
//    three gradients, written and accumulated, within 1e-5 of float64 (‖cuda − cpu‖ / ‖cpu‖;
//    float32 sums of at most a few thousand terms), as tests/cuda/test_cuda_ops.cpp holds
//    NCHW float32;
//  - bfloat16 (NHWC and NCHW) against float64 on the same bfloat16-rounded inputs, element by
//    element, within the bound of bfloat16's rounding and float32 accumulation (below);
//  - the algorithm choices of each dtype and format are kept on disk under keys of their own.
// Device blocks are poisoned with NaN, so an element a kernel forgets to write fails.
#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <fstream>
#include <sstream>

#include "engine/ops.h"
#include "engine/random.h"
#include "engine/tape.h"
#include "runtime/algo_cache.h"
#include "runtime/cuda_api.h"
#include "env_scope.h"

using namespace unetcu;
using unetcu::testing::EnvScope;

namespace {

const Device kGpu = Device::cuda(0);

uint64_t fresh_seed() {
  return uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
}

struct Setup {
  Setup() {
    cuda::set_poison_allocations(true);
    cuda::set_allow_tf32(false);
    cuda::set_deterministic(true);
  }
};

Tensor random64(const Shape& s, Rng& rng) {
  Tensor t = Tensor::empty(s, DType::F64);
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, double(float(rng.uniform(-1, 1))));
  return t;
}

Tensor bf16_rounded(const Tensor& t64) { return t64.to(DType::BF16).to(DType::F64); }

Tensor abs_of(const Tensor& t) {
  Tensor a = t.clone();
  for (int64_t i = 0; i < a.numel(); ++i) a.set(i, std::fabs(a.at(i)));
  return a;
}

double rel(const Tensor& got, const Tensor& want) {
  const std::vector<double> a = got.to_vector(), b = want.to_vector();  // logical order
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// The bias gradient of each output channel is a float32 sum of N x OH x OW output-gradient
// terms, whose rounding error scales with the sum of their magnitudes, not with the sum:
// with one output channel the sum of a thousand random terms may cancel to a small fraction
// of them. So each channel's error is held to 1e-5 of that channel's sum of |gy| (times
// 1 + kSecondScale after the accumulating second pass, whose gradient is that multiple of the
// first's), the same 1e-5 the norm checks hold.
bool bias_grad_within(const Tensor& got, const Tensor& want, const Tensor& gy64, double passes_scale) {
  const int64_t N = gy64.dim(0), O = gy64.dim(1), HW = gy64.dim(2) * gy64.dim(3);
  const std::vector<double> a = got.to_vector(), b = want.to_vector(), g = gy64.to_vector();  // logical order
  REQUIRE(int64_t(a.size()) == O);
  bool ok = true;
  for (int64_t o = 0; o < O; ++o) {
    double magnitude = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t q = 0; q < HW; ++q) magnitude += std::fabs(g[size_t((n * O + o) * HW + q)]);
    const double err = std::fabs(a[size_t(o)] - b[size_t(o)]);
    if (!(err <= 1e-5 * passes_scale * magnitude)) {
      INFO("channel ", o, ": ", a[size_t(o)], " against ", b[size_t(o)], ", sum of |gy| ", magnitude);
      CHECK(err <= 1e-5 * passes_scale * magnitude);
      ok = false;
    }
  }
  return ok;
}

struct ConvCase {
  Shape x, w;
  Conv2dOptions o;
  bool bias;
};

// The output and each gradient after each of two backward passes, as float64 host tensors in
// NCHW. The second pass accumulates, its output gradient scaled by kSecondScale (a power of
// two: exactly that multiple of the first pass's gradient), so that the new term leads the
// accumulated sum and a second rounding of it would show.
struct Pass {
  Tensor y, gx, gw, gb;
};
constexpr double kSecondScale = 64;

Tensor host64(const Tensor& t) {
  return t.defined() ? t.to(Device::cpu()).to(DType::F64).to(MemoryFormat::NCHW) : t;
}

std::vector<Pass> run(const ConvCase& c, const Tensor& x64, const Tensor& w64, const Tensor& b64,
                      const Tensor& gy64, Device device, DType dtype, MemoryFormat xf,
                      MemoryFormat wf) {
  Tensor x = x64.to(dtype).to(xf).to(device).set_requires_grad(true);
  Tensor w = w64.to(dtype).to(wf).to(device).set_requires_grad(true);
  Tensor b = c.bias ? b64.to(dtype).to(device).set_requires_grad(true) : Tensor();
  const Tensor gys[2] = {gy64.to(dtype).to(xf).to(device),
                         scale(gy64, kSecondScale).to(dtype).to(xf).to(device)};
  std::vector<Pass> out;
  for (int pass = 0; pass < 2; ++pass) {
    Tape tape;
    Tensor y;
    {
      TapeScope s(tape);
      y = conv2d(x, w, b, c.o);
    }
    CHECK(y.device() == device);
    CHECK(y.dtype() == dtype);
    CHECK(y.format() == xf);
    tape.backward({y}, {gys[pass]});
    CHECK(x.grad().format() == xf);
    CHECK(w.grad().format() == wf);
    out.push_back({host64(y), host64(x.grad()), host64(w.grad()), host64(c.bias ? b.grad() : Tensor())});
  }
  return out;
}

const std::pair<MemoryFormat, MemoryFormat> kLayouts[] = {
    {MemoryFormat::NHWC, MemoryFormat::NHWC},  // what the model passes
    {MemoryFormat::NHWC, MemoryFormat::NCHW},  // w converted for cuDNN
    {MemoryFormat::NCHW, MemoryFormat::NHWC}};

const ConvCase kCases[] = {{{2, 3, 33, 31}, {8, 3, 7, 7}, {2, 2, 3, 3}, false},
                           {{2, 16, 17, 19}, {24, 16, 3, 3}, {1, 1, 1, 1}, true},
                           {{3, 8, 16, 16}, {16, 8, 3, 3}, {2, 2, 1, 1}, false},
                           {{2, 8, 15, 15}, {4, 8, 1, 1}, {2, 2, 0, 0}, false},
                           {{1, 16, 32, 32}, {1, 16, 3, 3}, {1, 1, 1, 1}, true},
                           {{2, 5, 9, 7}, {6, 5, 3, 2}, {1, 2, 1, 0}, true}};

double worst_ratio(const Tensor& got, const Tensor& want, const Tensor& bound) {
  double worst = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double e = std::fabs(got.at(i) - want.at(i));
    if (!std::isfinite(e)) return INFINITY;
    worst = std::max(worst, e / bound.at(i));
  }
  return worst;
}

}  // namespace

TEST_CASE("CUDA conv2d NHWC float32 equals the CPU float64 conv (TF32 off), forward and backward") {
  Setup setup;
  const uint64_t seed = fresh_seed();
  CAPTURE(seed);
  Rng rng(seed);
  for (const ConvCase& c : kCases) {
    CAPTURE(shape_str(c.x));
    CAPTURE(shape_str(c.w));
    const Tensor x = random64(c.x, rng), w = random64(c.w, rng);
    const Tensor b = c.bias ? random64({c.w[0]}, rng) : Tensor();
    const Tensor gy = random64(conv2d(x, w, b, c.o).shape(), rng);
    const std::vector<Pass> want = run(c, x, w, b, gy, Device::cpu(), DType::F64,
                                       MemoryFormat::NCHW, MemoryFormat::NCHW);
    for (auto [xf, wf] : kLayouts) {
      CAPTURE(format_name(xf));
      CAPTURE(format_name(wf));
      const std::vector<Pass> got = run(c, x, w, b, gy, kGpu, DType::F32, xf, wf);
      for (int p = 0; p < 2; ++p) {
        CAPTURE(p);
        CHECK(rel(got[p].y, want[p].y) < 1e-5);
        CHECK(rel(got[p].gx, want[p].gx) < 1e-5);
        CHECK(rel(got[p].gw, want[p].gw) < 1e-5);
        if (c.bias) CHECK(bias_grad_within(got[p].gb, want[p].gb, gy, p == 0 ? 1 : 1 + kSecondScale));
      }
    }
  }
}

namespace {

// The bfloat16 case below, for every case of kCases with its batch grown by `extra_batch`
// (another shape: a plan of its own, chosen afresh under the emulator's settings of the case).
void bf16_within_bound(int extra_batch) {
  // want: the CPU float64 op on the same bfloat16-rounded x, w, b and output gradient (exact
  // to ~1e-16). got: cuDNN in bfloat16 (float32 compute, tensor cores allowed: bfloat16
  // products are exact in float32) and the bias kernels. Per element, with u = 2^-8 (the unit
  // roundoff of bfloat16's 8 significant bits) and A the same sum over absolute values
  // (float64 on the CPU), K its number of terms (C*kh*kw for y, at most O*kh*kw for grad_x,
  // N*OH*OW for grad_w and grad_b):
  //  - float32 accumulation: at most K 2^-24 A (doubled, 2.1 K 2^-24 A, for the order and
  //    rounding of tensor-core sums);
  //  - the output rounded once: u |want|; with a bias, the convolution c is rounded, then
  //    c + b: u |want| + u (|want| + |b|) (as PyTorch's CUDA path, two roundings);
  //  - the second backward (output gradient scaled by kSecondScale) accumulates onto the
  //    first pass's bfloat16 gradient: want2 = got1 + kSecondScale times want's first gradient
  //    (A scaled alike). The input and weight gradients' own part c2 is rounded once to
  //    bfloat16 by cuDNN, then added in float32 and rounded once (conv.cu: never left to
  //    cuDNN's blend): within u |want2| + 1.01 u |c2| + 2^-24 |want2|. The bias kernel adds
  //    its float32 sum and rounds once: u |want2| + 2^-24 |want2|.
  // Every element within (u + 2^-22) |want| (+ 1.01 u (|want| + |b|) with a bias) +
  // 2.1 K 2^-24 A; the worst output element beyond a quarter of it (a float32 result never
  // rounded to bfloat16 would stay near 2^-16 of it).
  Setup setup;
  const uint64_t seed = fresh_seed();
  CAPTURE(seed);
  Rng rng(seed);
  const double u = std::ldexp(1.0, -8), e32 = std::ldexp(1.0, -24);
  const std::pair<MemoryFormat, MemoryFormat> layouts[] = {
      {MemoryFormat::NHWC, MemoryFormat::NHWC},
      {MemoryFormat::NHWC, MemoryFormat::NCHW},
      {MemoryFormat::NCHW, MemoryFormat::NCHW}};
  for (ConvCase c : kCases) {
    c.x[0] += extra_batch;
    CAPTURE(shape_str(c.x));
    CAPTURE(shape_str(c.w));
    const Tensor x = bf16_rounded(random64(c.x, rng)), w = bf16_rounded(random64(c.w, rng));
    const Tensor b = c.bias ? bf16_rounded(random64({c.w[0]}, rng)) : Tensor();
    const Tensor gy = bf16_rounded(random64(conv2d(x, w, b, c.o).shape(), rng));
    const std::vector<Pass> want = run(c, x, w, b, gy, Device::cpu(), DType::F64,
                                       MemoryFormat::NCHW, MemoryFormat::NCHW);
    const std::vector<Pass> A = run(c, abs_of(x), abs_of(w), c.bias ? abs_of(b) : Tensor(),
                                    abs_of(gy), Device::cpu(), DType::F64, MemoryFormat::NCHW,
                                    MemoryFormat::NCHW);
    const Shape ys = want[0].y.shape();
    const double K_y = double(c.x[1] * c.w[2] * c.w[3]) + (c.bias ? 1 : 0);
    const double K_x = double(c.w[0] * c.w[2] * c.w[3]);
    const double K_w = double(ys[0] * ys[2] * ys[3]);
    // own: the pass's own gradient c2, rounded before it is added (second pass), else none.
    auto bound = [&](const Tensor& expected, const Tensor& sums, double K, bool biased,
                     const Tensor& own = Tensor()) {
      Tensor r = Tensor::empty(expected.shape(), DType::F64);
      const int64_t plane = biased ? ys[2] * ys[3] : 1;
      for (int64_t i = 0; i < expected.numel(); ++i) {
        const double e = std::fabs(expected.at(i));
        double v = (u + 4 * e32) * e + 2.1 * K * e32 * sums.at(i) + 1e-300;
        if (own.defined()) v += 1.01 * u * std::fabs(own.at(i));
        if (biased) v += 1.01 * u * (e + std::fabs(b.at((i / plane) % ys[1])));
        r.set(i, v);
      }
      return r;
    };
    for (auto [xf, wf] : layouts) {
      CAPTURE(format_name(xf));
      CAPTURE(format_name(wf));
      const std::vector<Pass> got = run(c, x, w, b, gy, kGpu, DType::BF16, xf, wf);
      for (int p = 0; p < 2; ++p) {
        CAPTURE(p);
        // want's second pass holds two of its own passes; its one-pass gradient is pass 1's.
        const double sc = p == 0 ? 1 : kSecondScale;
        auto expected = [&](const Tensor& one_pass, const Tensor& prev_got) {
          Tensor e = scale(one_pass, sc);
          if (p == 1)
            for (int64_t i = 0; i < e.numel(); ++i) e.set(i, e.at(i) + prev_got.at(i));
          return e;
        };
        const double ry = worst_ratio(got[p].y, want[p].y, bound(want[p].y, A[0].y, K_y, c.bias));
        const Tensor gx_want = expected(want[0].gx, got[0].gx);
        const Tensor gw_want = expected(want[0].gw, got[0].gw);
        const auto own = [&](const Tensor& one_pass) { return p == 1 ? scale(one_pass, sc) : Tensor(); };
        const double rx = worst_ratio(got[p].gx, gx_want,
                                      bound(gx_want, scale(A[0].gx, sc), K_x, false, own(want[0].gx)));
        const double rw = worst_ratio(got[p].gw, gw_want,
                                      bound(gw_want, scale(A[0].gw, sc), K_w, false, own(want[0].gw)));
        CAPTURE(ry);
        CAPTURE(rx);
        CAPTURE(rw);
        CHECK(ry <= 1);
        CHECK(rx <= 1);
        CHECK(rw <= 1);
        CHECK(ry > (c.bias ? 0.1 : 0.25));  // a bias widens the bound (two roundings)
        if (c.bias) {
          const Tensor gb_want = expected(want[0].gb, got[0].gb);
          const double rb =
              worst_ratio(got[p].gb, gb_want, bound(gb_want, scale(A[0].gb, sc), K_w, false));
          CAPTURE(rb);
          CHECK(rb <= 1);
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("CUDA conv2d bfloat16 equals the CPU float64 conv on bf16-rounded inputs within its bound") {
  bf16_within_bound(0);
}

namespace {

// What the process writes to stderr for a scope, kept in a temporary file.
class StderrCapture {
 public:
  StderrCapture() {
    std::fflush(stderr);
    saved_ = dup(2);
    file_ = std::tmpfile();
    if (saved_ >= 0 && file_) dup2(fileno(file_), 2);
  }
  std::string text() {
    std::fflush(stderr);
    std::string out;
    if (!file_) return out;
    std::rewind(file_);
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, file_)) > 0;) out.append(buf, n);
    return out;
  }
  ~StderrCapture() {
    std::fflush(stderr);
    if (saved_ >= 0) {
      dup2(saved_, 2);
      close(saved_);
    }
    if (file_) std::fclose(file_);
  }

 private:
  int saved_ = -1;
  std::FILE* file_ = nullptr;
};

#ifdef UNETCU_CUDA_EMU
constexpr bool kEmulated = true;
#else
constexpr bool kEmulated = false;  // a real cuDNN ignores the emulator's settings
#endif

}  // namespace

// The emulator's cuDNN made to refuse what real tensor-core kernels may (emulator/README.md):
// every shape of kCases with a channel count that is not a multiple of 8 loses its NHWC
// algorithms, and the layer runs in NCHW, with a note naming it; the rest run as they are.
// Either way the results keep the bfloat16 bound (the conversions copy exactly).
TEST_CASE("CUDA conv2d bfloat16 with no NHWC algorithm for unaligned channels runs them in NCHW, within its bound") {
  const EnvScope align("UNETCU_EMU_CUDNN_ALIGN8", "nhwc");
  StderrCapture err;
  bf16_within_bound(1);
  const std::string notes = err.text();
  CAPTURE(notes);
  if (kEmulated) {
    CHECK(notes.find("bfloat16 NHWC input 3x3x33x31, weight 8x3x7x7") != std::string::npos);
    CHECK(notes.find("it runs in NCHW") != std::string::npos);
    CHECK(notes.find("padded") == std::string::npos);
    CHECK(notes.find("input 3x16x17x19") == std::string::npos);  // aligned: as it is
  }
}

TEST_CASE("CUDA conv2d bfloat16 with no algorithm for unaligned channels in any format pads them, within its bound") {
  const EnvScope align("UNETCU_EMU_CUDNN_ALIGN8", "all");
  StderrCapture err;
  bf16_within_bound(2);
  const std::string notes = err.text();
  CAPTURE(notes);
  if (kEmulated) {
    CHECK(notes.find("with channels padded with zeros to 8 in and 8 out") != std::string::npos);
    CHECK(notes.find("with channels padded with zeros to 16 in and 8 out") != std::string::npos);
    CHECK(notes.find("input 5x8x16x16") == std::string::npos);  // aligned: as it is
    CHECK(notes.find("it runs in NCHW") == std::string::npos);
  }
}

// conv.cu accumulates bfloat16 gradients itself (cuDNN writes, the convert kernel adds): a cuDNN
// that rounds before it blends gives the same bits as one that blends in float32.
TEST_CASE("CUDA conv2d bfloat16 gradients accumulated into do not depend on cuDNN's blend") {
  Setup setup;
  const uint64_t seed = fresh_seed();
  CAPTURE(seed);
  Rng rng(seed);
  for (ConvCase c : kCases) {
    CAPTURE(shape_str(c.x));
    const Tensor x = random64(c.x, rng), w = random64(c.w, rng);
    const Tensor b = c.bias ? random64({c.w[0]}, rng) : Tensor();
    const Tensor gy = random64(conv2d(x, w, b, c.o).shape(), rng);
    for (auto [xf, wf] : kLayouts) {
      const std::vector<Pass> blended = run(c, x, w, b, gy, kGpu, DType::BF16, xf, wf);
      std::vector<Pass> rounded;
      {
        const EnvScope twice("UNETCU_EMU_CUDNN_ROUND_BEFORE_BLEND", "1");
        rounded = run(c, x, w, b, gy, kGpu, DType::BF16, xf, wf);
      }
      CHECK(blended[1].gx.to_vector() == rounded[1].gx.to_vector());
      CHECK(blended[1].gw.to_vector() == rounded[1].gw.to_vector());
    }
  }
}

TEST_CASE("CUDA conv2d keeps its algorithm choices per dtype and format") {
  Setup setup;
  Rng rng(fresh_seed());
  const ConvCase c{{2, 16, 13, 11}, {16, 16, 3, 3}, {1, 1, 1, 1}, false};
  const Tensor x = random64(c.x, rng), w = random64(c.w, rng);
  const Tensor gy = random64(conv2d(x, w, Tensor(), c.o).shape(), rng);
  for (DType dtype : {DType::F32, DType::BF16})
    for (MemoryFormat f : {MemoryFormat::NCHW, MemoryFormat::NHWC})
      run(c, x, w, Tensor(), gy, kGpu, dtype, f, f);
  const std::string path = default_conv_algo_cache_path();
  if (path.empty()) return;  // turned off by the environment
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  ConvAlgoEntries entries;
  std::string error;
  REQUIRE(parse_conv_algo_cache(text.str(), &entries, &error));
  for (const char* dtype : {"dtype=f32 ", "dtype=f32.nhwc ", "dtype=bf16 ", "dtype=bf16.nhwc "}) {
    CAPTURE(dtype);
    int found = 0;
    for (const auto& [key, choice] : entries)
      if (key.find("x=2x16x13x11 w=16x16x3x3") != std::string::npos &&
          key.find(dtype) != std::string::npos)
        ++found;
    CHECK(found == 3);  // forward, backward data, backward filter
  }
}
