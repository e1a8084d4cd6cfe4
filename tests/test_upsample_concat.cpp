// upsample_nearest2x_concat (SMP's decoder input: torch.cat([F.interpolate(x, scale_factor=2,
// mode="nearest"), skip], dim=1) in one op) against the two ops it replaces,
// concat_channels({upsample_nearest2x(x), skip}). The forward is copies and the backward
// copies plus 2×2 sums added in the same order as upsample2x_backward, so everything is
// compared bit for bit, in float64 and float32, including a second backward that accumulates
// (beta 1) into the gradients of the first.
#include <cstring>

#include "engine/ops.h"
#include "testing.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {

// Same shape, dtype and bytes (bit for bit: -0 differs from 0, NaN from nothing).
bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw(), b.raw(), size_t(a.numel()) * dtype_size(a.dtype())) == 0;
}

struct Grads {
  Tensor y, gx, gs;
};

// Two forward/backward passes (the second accumulates) of f, returning the last output and
// the gradients of x and skip (either may not require one).
template <class F>
Grads run_twice(F f, const Tensor& x0, const Tensor& s0, bool x_grad, bool s_grad,
                const Tensor& r1, const Tensor& r2) {
  Tensor x = x0.clone().set_requires_grad(x_grad), s = s0.clone().set_requires_grad(s_grad);
  Grads out;
  for (const Tensor* r : {&r1, &r2}) {
    Tape tape;
    {
      TapeScope scope(tape);
      out.y = f(x, s);
    }
    tape.backward({out.y}, {*r});
  }
  if (x_grad) out.gx = x.grad();
  if (s_grad) out.gs = s.grad();
  return out;
}

Tensor fused(const Tensor& x, const Tensor& s) { return upsample_nearest2x_concat(x, s); }
Tensor unfused(const Tensor& x, const Tensor& s) {
  return concat_channels({upsample_nearest2x(x), s});
}

}  // namespace

TEST_CASE("upsample_nearest2x_concat equals concat of upsample, bit for bit, odd shapes") {
  Rng rng(17);
  int cases = 0;
  for (DType dt : {DType::F64, DType::F32})
    for (int64_t N = 1; N <= 3; ++N)
      for (int64_t Cx = 1; Cx <= 5; ++Cx)
        for (int64_t Cs = 1; Cs <= 5; ++Cs)
          for (auto [H, W] : {std::pair<int64_t, int64_t>{1, 1}, {1, 7}, {7, 1}, {2, 3}, {3, 5},
                              {5, 2}, {4, 6}, {7, 7}}) {
            CAPTURE(dtype_name(dt));
            CAPTURE(N);
            CAPTURE(Cx);
            CAPTURE(Cs);
            CAPTURE(H);
            CAPTURE(W);
            const Tensor x = random_tensor({N, Cx, H, W}, rng, -1, 1, dt);
            const Tensor s = random_tensor({N, Cs, 2 * H, 2 * W}, rng, -1, 1, dt);
            const Tensor r1 = random_tensor({N, Cx + Cs, 2 * H, 2 * W}, rng, -1, 1, dt);
            const Tensor r2 = random_tensor(r1.shape(), rng, -1, 1, dt);
            // Both gradients, then each alone (the other absent in the launcher).
            for (auto [xg, sg] : {std::pair{true, true}, {true, false}, {false, true}}) {
              const Grads a = run_twice(fused, x, s, xg, sg, r1, r2);
              const Grads b = run_twice(unfused, x, s, xg, sg, r1, r2);
              CHECK(same_bits(a.y, b.y));
              if (xg) CHECK(same_bits(a.gx, b.gx));
              if (sg) CHECK(same_bits(a.gs, b.gs));
            }
            ++cases;
          }
  CHECK(cases == 2 * 3 * 5 * 5 * 8);
}

TEST_CASE("upsample_nearest2x_concat against loops: upsampled x first, then skip, as torch.cat") {
  // Written out element by element, so a swapped channel order (skip first), a wrong source
  // pixel or a gradient that overwrites instead of accumulating each fail here. Cx != Cs and
  // distinct value ranges make a swap visible in shape and in values.
  Rng rng(18);
  const int64_t N = 2, Cx = 3, Cs = 2, H = 3, W = 5, OH = 2 * H, OW = 2 * W, C = Cx + Cs;
  const Tensor x = random_tensor({N, Cx, H, W}, rng, 1, 2);
  const Tensor s = random_tensor({N, Cs, OH, OW}, rng, -2, -1);
  const Tensor r1 = random_tensor({N, C, OH, OW}, rng);
  const Tensor r2 = random_tensor({N, C, OH, OW}, rng);
  const Grads g = run_twice(fused, x, s, true, true, r1, r2);
  REQUIRE(g.y.shape() == Shape{N, C, OH, OW});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          const double want = c < Cx ? x.at(((n * Cx + c) * H + oh / 2) * W + ow / 2)
                                     : s.at(((n * Cs + c - Cx) * OH + oh) * OW + ow);
          CHECK(g.y.at(((n * C + c) * OH + oh) * OW + ow) == want);
        }
  // Gradients: pass 1 written, pass 2 added to it; each 2×2 block summed top-left, top-right,
  // bottom-left, bottom-right, so the float64 sums are the same bits.
  auto block = [&](const Tensor& r, int64_t n, int64_t c, int64_t h, int64_t w) {
    auto at = [&](int64_t oh, int64_t ow) { return r.at(((n * C + c) * OH + oh) * OW + ow); };
    return at(2 * h, 2 * w) + at(2 * h, 2 * w + 1) + at(2 * h + 1, 2 * w) +
           at(2 * h + 1, 2 * w + 1);
  };
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < Cx; ++c)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t w = 0; w < W; ++w)
          CHECK(g.gx.at(((n * Cx + c) * H + h) * W + w) ==
                block(r1, n, c, h, w) + block(r2, n, c, h, w));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < Cs; ++c)
      for (int64_t q = 0; q < OH * OW; ++q) {
        const int64_t from = (n * C + Cx + c) * OH * OW + q;
        CHECK(g.gs.at((n * Cs + c) * OH * OW + q) == r1.at(from) + r2.at(from));
      }
}

TEST_CASE("upsample_nearest2x_concat: float64 gradient check and shape errors") {
  Rng rng(19);
  Tensor x = random_tensor({2, 3, 3, 5}, rng).set_requires_grad(true);
  Tensor s = random_tensor({2, 2, 6, 10}, rng).set_requires_grad(true);
  CHECK(gradcheck([](const std::vector<Tensor>& in) {
    return upsample_nearest2x_concat(in[0], in[1]);
  }, {x, s}) > 0);
  Tensor s_const = random_tensor({2, 4, 6, 10}, rng);  // no gradient wanted for skip
  CHECK(gradcheck([&](const std::vector<Tensor>& in) {
    return upsample_nearest2x_concat(in[0], s_const);
  }, {x}) > 0);
  CHECK_FALSE(s_const.grad().defined());

  CHECK_THROWS_WITH(upsample_nearest2x_concat(x, random_tensor({2, 2, 6, 9}, rng)),
                    doctest::Contains("is not the ×2 upsample"));
  CHECK_THROWS_WITH(upsample_nearest2x_concat(x, random_tensor({1, 2, 6, 10}, rng)),
                    doctest::Contains("is not the ×2 upsample"));
  CHECK_THROWS(upsample_nearest2x_concat(x, random_tensor({2, 2, 6, 10}, rng, -1, 1,
                                                          DType::F32)));
}
