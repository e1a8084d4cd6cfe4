// On a GPU: upsample_nearest2x_concat equals the CPU op bit for bit in float32, forward and
// both gradients over two backward passes (the second accumulates). The op is copies and
// 2×2 sums added in one fixed order (no products, so nothing to contract into an FMA), so
// the GPU must give the CPU's bits. Device blocks are poisoned with NaN, so an element a
// kernel forgets to write fails; shapes include more planes and rows than one grid axis
// holds (65535), which exercises the grid-stride loops.
#include <doctest/doctest.h>

#include <cstring>

#include "engine/ops.h"
#include "engine/random.h"
#include "engine/tape.h"
#include "runtime/cuda_api.h"

using namespace unetcu;

namespace {

const Device kGpu = Device::cuda(0);

Tensor random32(const Shape& s, Rng& rng) {
  Tensor t = Tensor::empty(s, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, rng.uniform(-1, 1));
  return t;
}

bool same_bits(const Tensor& gpu, const Tensor& cpu) {
  const Tensor h = gpu.to(Device::cpu());
  return h.shape() == cpu.shape() && h.dtype() == cpu.dtype() &&
         std::memcmp(h.raw(), cpu.raw(), cpu.nbytes()) == 0;
}

void check_case(const Shape& xs, int64_t Cs, bool x_grad, bool s_grad, Rng& rng) {
  CAPTURE(xs[0]);
  CAPTURE(xs[1]);
  CAPTURE(xs[2]);
  CAPTURE(xs[3]);
  CAPTURE(Cs);
  CAPTURE(x_grad);
  CAPTURE(s_grad);
  const Shape ss = {xs[0], Cs, 2 * xs[2], 2 * xs[3]};
  const Tensor x = random32(xs, rng), s = random32(ss, rng);
  Tensor xc = x.clone().set_requires_grad(x_grad), sc = s.clone().set_requires_grad(s_grad);
  Tensor xg = x.to(kGpu).set_requires_grad(x_grad), sg = s.to(kGpu).set_requires_grad(s_grad);
  for (int pass = 0; pass < 2; ++pass) {
    CAPTURE(pass);
    Tape tc, tg;
    Tensor yc, yg;
    {
      TapeScope scope(tc);
      yc = upsample_nearest2x_concat(xc, sc);
    }
    {
      TapeScope scope(tg);
      yg = upsample_nearest2x_concat(xg, sg);
    }
    CHECK(yg.device() == kGpu);
    CHECK(same_bits(yg, yc));
    const Tensor r = random32(yc.shape(), rng);
    tc.backward({yc}, {r});
    tg.backward({yg}, {r.to(kGpu)});
    if (x_grad) CHECK(same_bits(xg.grad(), xc.grad()));
    if (s_grad) CHECK(same_bits(sg.grad(), sc.grad()));
  }
}

}  // namespace

TEST_CASE("CUDA upsample_nearest2x_concat equals the CPU op bit for bit") {
  cuda::set_poison_allocations(true);
  Rng rng(23);
  for (int64_t N = 1; N <= 3; ++N)
    for (int64_t Cx : {1, 3, 5})
      for (int64_t Cs : {1, 2, 5})
        for (auto [H, W] : {std::pair<int64_t, int64_t>{1, 1}, {1, 7}, {7, 1}, {3, 5}, {7, 7},
                            {5, 200}})
          check_case({N, Cx, H, W}, Cs, true, true, rng);
  check_case({2, 3, 4, 5}, 2, true, false, rng);
  check_case({2, 3, 4, 5}, 2, false, true, rng);
  check_case({1, 40000, 1, 1}, 30000, true, true, rng);  // 70000 planes
  check_case({1, 1, 40000, 1}, 1, true, true, rng);      // 80000 output rows
}
