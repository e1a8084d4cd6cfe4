// The autograd tape: what is recorded, accumulation, backward from given output gradients.
#include "engine/ops.h"
#include "testing.h"

using namespace unetcu;
using namespace unetcu::testing;

TEST_CASE("nothing is recorded without a tape or without an input that requires a gradient") {
  Tensor w = Tensor::full({2, 2}, 1.0, DType::F64).set_requires_grad(true);
  Tensor x = Tensor::full({2, 2}, 2.0, DType::F64);
  Tensor y = add(x, w);  // no active tape
  CHECK_FALSE(y.requires_grad());
  Tape tape;
  {
    TapeScope s(tape);
    Tensor z = add(x, x);
    CHECK_FALSE(z.requires_grad());
    CHECK(tape.size() == 0);
    Tensor u = add(x, w);
    CHECK(u.requires_grad());
    CHECK(tape.size() == 1);
    {
      NoGradScope ng;
      CHECK_FALSE(add(x, w).requires_grad());
    }
    CHECK(tape.size() == 1);
  }
}

TEST_CASE("parameters accumulate gradients over backward calls until zeroed") {
  Tensor w = Tensor::from_vector({3}, {1, 2, 3}, DType::F64).set_requires_grad(true);
  Tensor x = Tensor::from_vector({3}, {0.5, -1, 2}, DType::F64);
  auto run = [&] {
    Tape tape;
    Tensor y;
    {
      TapeScope s(tape);
      y = scale(add(x, w), 3.0);
    }
    tape.backward({y}, {Tensor::from_vector({3}, {1, 10, 100}, DType::F64)});
    CHECK(tape.size() == 0);  // backward consumes the tape
  };
  run();
  CHECK(w.grad().to_vector() == std::vector<double>{3, 30, 300});
  run();
  CHECK(w.grad().to_vector() == std::vector<double>{6, 60, 600});
  w.zero_grad();
  CHECK_FALSE(w.grad().defined());
  run();
  CHECK(w.grad().to_vector() == std::vector<double>{3, 30, 300});
}

TEST_CASE("backward from given gradients of several outputs (a pipeline stage)") {
  Rng rng(3);
  Tensor x = random_tensor({1, 2, 3, 3}, rng).set_requires_grad(true);
  Tensor w = random_tensor({2, 2, 1, 1}, rng).set_requires_grad(true);
  Tape tape;
  Tensor h, out, skip;
  {
    TapeScope s(tape);
    h = conv2d(x, w, Tensor());
    out = scale(h, 2.0);  // main output
    skip = sigmoid(h);    // a skip output consumed by another stage
  }
  Tensor g_out = random_tensor(out.shape(), rng), g_skip = random_tensor(skip.shape(), rng);
  tape.backward({out, skip}, {g_out, g_skip});
  // dL/dh = 2 g_out + g_skip * s(1-s), dL/dx = conv_transpose(dL/dh), here 1x1: W^T dL/dh.
  for (int64_t q = 0; q < 9; ++q)
    for (int c = 0; c < 2; ++c) {
      double expect = 0;
      for (int o = 0; o < 2; ++o) {
        const double sv = skip.at(o * 9 + q);
        const double gh = 2 * g_out.at(o * 9 + q) + g_skip.at(o * 9 + q) * sv * (1 - sv);
        expect += w.at(o * 2 + c) * gh;
      }
      CHECK(x.grad().at(c * 9 + q) == doctest::Approx(expect).epsilon(1e-12));
    }
}

TEST_CASE("a tensor used twice gets both gradient contributions") {
  Tensor x = Tensor::from_vector({2}, {1, -2}, DType::F64).set_requires_grad(true);
  Tape tape;
  Tensor y;
  {
    TapeScope s(tape);
    Tensor h = scale(x, 2.0);
    y = add(h, scale(h, 3.0));  // y = 2x + 6x
  }
  tape.backward({y}, {Tensor::full({2}, 1.0, DType::F64)});
  CHECK(x.grad().to_vector() == std::vector<double>{8, 8});
}

TEST_CASE("backward(loss) needs a one-element loss") {
  Tensor x = Tensor::zeros({2}).set_requires_grad(true);
  Tape tape;
  Tensor y;
  {
    TapeScope s(tape);
    y = scale(x, 1.0);
  }
  CHECK_THROWS_WITH(tape.backward(y), doctest::Contains("one-element loss"));
}

TEST_CASE("tensor basics: views share storage, dtype conversion, shape limits") {
  Tensor a = Tensor::from_vector({2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor v = a.view({3, 2});
  v.set(0, 10);
  CHECK(a.at(0) == 10);
  CHECK(a.same_storage(v));
  Tensor c = a.clone();
  c.set(1, -1);
  CHECK(a.at(1) == 2);
  Tensor d = a.to(DType::F64);
  CHECK(d.dtype() == DType::F64);
  CHECK(d.to_vector() == a.to_vector());
  CHECK_THROWS_WITH(Tensor::zeros({1, 1, 1, 1, 1}), doctest::Contains("at most 4"));
  CHECK_THROWS_WITH(a.view({4, 2}), doctest::Contains("cannot view"));
  CHECK(Device::parse("cpu:3").index == 3);
  CHECK(Device::parse("cuda").is_cuda());
  CHECK_THROWS_WITH(Device::parse("gpu:0"), doctest::Contains("bad device"));
  CHECK_THROWS_WITH(Device::parse("cpu:x"), doctest::Contains("bad device"));
}
