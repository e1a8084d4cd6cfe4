// Element types and memory formats (runtime/dtype.h, bodies/bf16.h, engine/tensor.h):
// bfloat16 rounds to nearest even as CUDA and oneDNN do; an NHWC tensor keeps its elements
// where channels-last puts them while element access stays in logical order; convert changes
// dtype and format forward and back (its gradient summed in the source's dtype); the division
// by invariant integers the CUDA kernels index with equals / and %.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "engine/ops.h"
#include "engine/random.h"
#include "bodies/layout.h"
#include "engine/ops/op_util.h"
#include "testing.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {

float bf16_round(float f) { return float(bf16(f)); }

}  // namespace

TEST_CASE("bfloat16 rounds to nearest, ties to even") {
  CHECK(bf16_round(1.0f) == 1.0f);
  const float ulp = std::ldexp(1.0f, -7);  // spacing of bf16 in [1, 2)
  CHECK(bf16_round(1.0f + ulp / 2) == 1.0f);                 // tie: to the even mantissa 1.0
  CHECK(bf16_round(1.0f + 3 * ulp / 2) == 1.0f + 2 * ulp);   // tie: to the even one above
  CHECK(bf16_round(1.0f + ulp / 2 + ulp / 64) == 1.0f + ulp);  // above the tie: up
  CHECK(bf16_round(-1.0f - ulp / 4) == -1.0f);
  CHECK(std::isnan(bf16_round(std::numeric_limits<float>::quiet_NaN())));
  CHECK(std::isinf(bf16_round(std::numeric_limits<float>::infinity())));
  CHECK(std::isinf(bf16_round(std::numeric_limits<float>::max())));  // past bf16's largest
  CHECK(bf16_round(0.0f) == 0.0f);
  // From double: one rounding. 1 + ulp/2 + 2^-30 is past the tie, so it goes up; through
  // float (to nearest) it would land on the tie 1 + ulp/2 and then go down to even.
  const double past_tie = 1.0 + double(ulp) / 2 + std::ldexp(1.0, -30);
  CHECK(float(bf16(past_tie)) == 1.0f + ulp);
  CHECK(float(bf16(-past_tie)) == -1.0f - ulp);
  CHECK(float(bf16(1.0 + double(ulp) / 2)) == 1.0f);  // an exact tie: to even
  CHECK(std::isinf(float(bf16(1e39))));
  CHECK(std::signbit(bf16_round(-0.0f)));
  // Relative rounding error at most 2^-8, bf16's unit roundoff (8 significant bits), for
  // normal numbers.
  Rng rng(3);
  double worst = 0;
  for (int i = 0; i < 100000; ++i) {
    const float f = float(rng.uniform(0.1, 1) * std::pow(10.0, rng.uniform(-30, 30)));
    worst = std::max(worst, std::fabs(double(bf16_round(f)) - f) / std::fabs(f));
  }
  CHECK(worst <= std::ldexp(1.0, -8));
  CHECK(worst > std::ldexp(1.0, -9));  // and rounding does happen
}

TEST_CASE("a value is stored as a positive bfloat16 exactly when it exceeds stored_zero_bound") {
  // The fused batch norm's backward tests v > stored_zero_bound<bf16, float>() for "the
  // forward stored bf16(relu(v)) > 0" (bodies/batchnorm.h): every float from 0 to
  // 2^17 bits (all subnormals near the bound and the first normals), both signs, and random
  // bit patterns of every magnitude, infinities and NaN.
  const float bound = kernels::stored_zero_bound<bf16, float>();
  CHECK(bound > 0);
  CHECK(kernels::stored_zero_bound<float, float>() == 0);
  CHECK(kernels::stored_zero_bound<double, double>() == 0);
  const auto stored_positive = [](float v) { return float(bf16(v > 0 ? v : 0.0f)) > 0; };
  int64_t wrong = 0;
  const auto check_bits = [&](uint32_t u) {
    float v;
    std::memcpy(&v, &u, 4);
    if (stored_positive(v) != (v > bound)) ++wrong;
  };
  for (uint32_t u = 0; u <= 0x20000u; ++u) {
    check_bits(u);
    check_bits(u | 0x80000000u);
  }
  Rng rng(9);
  for (int i = 0; i < 1000000; ++i) check_bits(uint32_t(rng.next()));
  for (float v : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::max()})
    check_bits([&] { uint32_t u; std::memcpy(&u, &v, 4); return u; }());
  CHECK(wrong == 0);
  // The edge itself: bits 0x8000 is a tie between 0 and the smallest subnormal, to even (0).
  CHECK(float(bf16(bound)) == 0.0f);
  CHECK(float(bf16(std::nextafter(bound, 1.0f))) > 0.0f);
}

TEST_CASE("an NHWC tensor lays out channels last and reads in logical order") {
  Rng rng(5);
  const Shape s{2, 3, 4, 5};
  Tensor a = random_tensor(s, rng, -1, 1, DType::F32);
  Tensor b = a.to(MemoryFormat::NHWC);
  CHECK(b.format() == MemoryFormat::NHWC);
  CHECK(b.shape() == s);
  CHECK(a.to_vector() == b.to_vector());
  const float* p = b.data<float>();
  const float* q = a.data<float>();
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t c = 0; c < 3; ++c)
      for (int64_t h = 0; h < 4; ++h)
        for (int64_t w = 0; w < 5; ++w)
          REQUIRE(p[((n * 4 + h) * 5 + w) * 3 + c] == q[((n * 3 + c) * 4 + h) * 5 + w]);
  b.set(7, 42.0);
  CHECK(b.at(7) == 42.0);
  CHECK(b.to(MemoryFormat::NCHW).at(7) == 42.0);
  // Whole images of an NHWC tensor are rows; other views need the NCHW order.
  CHECK(b.rows(1, 2).to_vector() == a.rows(1, 2).to(MemoryFormat::NHWC).to_vector());
  CHECK_THROWS_WITH_AS(b.view({6, 20}), doctest::Contains("no NCHW order"), Error);
  Tensor one = Tensor::zeros({2, 1, 3, 3}, DType::F32, Device::cpu(), MemoryFormat::NHWC);
  CHECK(one.view({2, 9}).format() == MemoryFormat::NCHW);  // C == 1: same order
  CHECK_THROWS_WITH_AS(Tensor::empty({3, 4}, DType::F32, Device::cpu(), MemoryFormat::NHWC),
                       doctest::Contains("4-dimensional"), Error);
}

TEST_CASE("copy_ and to convert between every dtype and format") {
  Rng rng(9);
  const Shape s{2, 5, 3, 4};
  Tensor ref = random_tensor(s, rng, -3, 3, DType::F64);
  for (DType d : {DType::F32, DType::F64, DType::BF16})
    for (MemoryFormat f : {MemoryFormat::NCHW, MemoryFormat::NHWC}) {
      CAPTURE(dtype_name(d));
      CAPTURE(format_name(f));
      Tensor t = Tensor::empty(s, d, Device::cpu(), f);
      t.copy_(ref);
      Tensor back = t.to(DType::F64).to(MemoryFormat::NCHW);
      for (int64_t i = 0; i < ref.numel(); ++i) {
        const double want = d == DType::BF16 ? double(bf16(float(ref.at(i))))
                            : d == DType::F32 ? double(float(ref.at(i)))
                                              : ref.at(i);
        REQUIRE(back.at(i) == want);
        REQUIRE(t.at(i) == want);
      }
    }
}

TEST_CASE("convert: dtype and format forward, the gradient converted back") {
  Rng rng(11);
  const Shape s{2, 3, 4, 5};
  Tensor x = random_tensor(s, rng, -1, 1, DType::F64).set_requires_grad(true);
  const int checked2 = gradcheck(
      [](const std::vector<Tensor>& in) {
        return convert(convert(in[0], DType::F64, MemoryFormat::NHWC), DType::F64,
                       MemoryFormat::NCHW);
      },
      {x});
  CHECK(checked2 > 0);

  // A float32 parameter read as bfloat16 twice: its gradient is the float32 sum of the two
  // bfloat16 gradients.
  Tensor w = random_tensor(s, rng, -1, 1, DType::F32).set_requires_grad(true);
  Tensor g1 = random_tensor(s, rng, -1, 1, DType::BF16).to(MemoryFormat::NHWC);
  Tensor g2 = random_tensor(s, rng, -1, 1, DType::BF16);
  Tape tape;
  Tensor y1, y2;
  {
    TapeScope scope(tape);
    y1 = convert(w, DType::BF16, MemoryFormat::NHWC);
    y2 = convert(w, DType::BF16, MemoryFormat::NCHW);
  }
  CHECK(y1.dtype() == DType::BF16);
  CHECK(y1.format() == MemoryFormat::NHWC);
  tape.backward({y1, y2}, {g1, g2});
  REQUIRE(w.grad().defined());
  CHECK(w.grad().dtype() == DType::F32);
  for (int64_t i = 0; i < w.numel(); ++i)
    REQUIRE(w.grad().at(i) == double(float(g1.at(i)) + float(g2.at(i))));
  // Same dtype and format: x itself.
  CHECK(convert(w, DType::F32, MemoryFormat::NCHW).same_storage(w));
}

TEST_CASE("an op without a bfloat16 or NHWC kernel says so") {
  // Every op of the UNet takes both; the op layer's check stays for any op that does not.
  Tensor x = Tensor::zeros({1, 2, 4, 4}, DType::F32, Device::cpu(), MemoryFormat::NHWC);
  CHECK_THROWS_WITH_AS(ops_detail::check_backend("an_op", x), doctest::Contains("NHWC"), Error);
  Tensor h = Tensor::zeros({1, 2, 4, 4}, DType::BF16);
  CHECK_THROWS_WITH_AS(ops_detail::check_backend("an_op", h), doctest::Contains("bfloat16"), Error);
  ops_detail::check_backend("an_op", x, {false, true});
  ops_detail::check_backend("an_op", h, {true, false});
  CHECK(sigmoid(x).format() == MemoryFormat::NHWC);
  CHECK(sigmoid(h).dtype() == DType::BF16);
}

// The CUDA kernels' index math (bodies/divide.h): one multiply-high, an add and a shift
// must give n / d exactly for every n < 2^32 and every divisor up to 2^31. Checked at the
// numerators where an error would show first (multiples of d and their neighbours, up to
// 2^32 - 1), at random ones, and exhaustively over [0, 2^21) for a few divisors.
TEST_CASE("Div32 divides like / for numerators below 2^32 and divisors up to 2^31") {
  using kernels::Div32;
  Rng rng(17);
  std::vector<uint64_t> divisors;
  for (uint64_t d = 1; d <= 2048; ++d) divisors.push_back(d);
  for (int k = 11; k <= 31; ++k) {
    const uint64_t p = uint64_t(1) << k;
    for (uint64_t d : {p - 1, p, p + 1, p + p / 2, p - p / 3}) divisors.push_back(d);
  }
  for (int k = 0; k < 2000; ++k) divisors.push_back(1 + uint64_t(rng.uniform(0, 2147483647.0)));
  int64_t checked = 0;
  for (uint64_t d64 : divisors) {
    if (d64 > (uint64_t(1) << 31)) continue;
    const uint32_t d = uint32_t(d64);
    const Div32 div(d);
    auto check = [&](uint64_t n64) {
      if (n64 > 0xffffffffull) return;
      const uint32_t n = uint32_t(n64);
      if (div.div(n) != n / d || div.mod(n) != n % d) {
        FAIL_CHECK("Div32(" << d << ") of " << n << ": " << div.div(n) << " r " << div.mod(n));
      }
      ++checked;
    };
    for (uint64_t n : {uint64_t(0), uint64_t(1), d64 - 1, d64, d64 + 1, uint64_t(0x7fffffff), uint64_t(0x80000000),
                       uint64_t(0xfffffffe), uint64_t(0xffffffff)})
      check(n);
    const uint64_t top = 0xffffffffull / d64;
    for (uint64_t q : {uint64_t(1), uint64_t(2), top / 2, top - 1, top})
      for (int delta = -1; delta <= 1; ++delta) check(q * d64 + uint64_t(int64_t(delta)));
    for (int k = 0; k < 64; ++k) check(uint64_t(rng.uniform(0, 4294967295.0)));
  }
  for (uint32_t d : {3u, 7u, 641u, 1000u, 0x7fffffffu, 0x80000000u})
    for (uint32_t n = 0; n < (1u << 21); ++n) {
      const Div32 div(d);
      if (div.div(n) != n / d) FAIL_CHECK("Div32(" << d << ") of " << n);
      ++checked;
    }
  CHECK(checked > 1000000);
}

TEST_CASE("Dims4Div walks memory indices to coordinates as Dims4 does, 32- and 64-bit, both formats") {
  using namespace unetcu::kernels;
  Rng rng(23);
  for (int trial = 0; trial < 200; ++trial) {
    const Dims4 d{1 + int64_t(rng.uniform(0, 5)), 1 + int64_t(rng.uniform(0, 70)), 1 + int64_t(rng.uniform(0, 40)),
                  1 + int64_t(rng.uniform(0, 40)), trial % 2 == 1};
    const Dims4Div<uint32_t> d32(d);
    const Dims4Div<int64_t> d64(d);
    const int64_t numel = d.N * d.C * d.H * d.W;
    for (int k = 0; k < 50; ++k) {
      const int64_t i = std::min<int64_t>(numel - 1, int64_t(rng.uniform(0, double(numel))));
      int64_t n, c, h, w;
      coords_of(d, i, &n, &c, &h, &w);
      uint32_t n32, c32, h32, w32;
      coords_of(d32, uint32_t(i), &n32, &c32, &h32, &w32);
      int64_t n6, c6, h6, w6;
      coords_of(d64, i, &n6, &c6, &h6, &w6);
      REQUIRE(n32 == n);
      REQUIRE(c32 == c);
      REQUIRE(h32 == h);
      REQUIRE(w32 == w);
      REQUIRE((n6 == n && c6 == c && h6 == h && w6 == w));
      REQUIRE(offset_of(d32, n32, c32, h32, w32) == i);
      REQUIRE(offset_of(d64, n, c, h, w) == i);
      REQUIRE(channel_of(d32, uint32_t(i)) == channel_of(d, i));
      REQUIRE(channel_of(d64, i) == channel_of(d, i));
    }
  }
  CHECK(index_fits_32(0x7fffffff));
  CHECK(!index_fits_32(int64_t(1) << 31));
}
