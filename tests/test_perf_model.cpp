// The performance model's terms (planning/perf_model.h, planning/split_search.h), each against
// its arithmetic: per-sample block times by micro-batch size, the shared slowdown of devices
// that compute at once, the optimizer and per-step costs, links implied by measured
// all-reduces, and the GPU under-fill curve. No timing: every input is made up or derived.
#include <doctest/doctest.h>

#include <cmath>

#include "planning/perf_model.h"
#include "planning/split_search.h"

using namespace unetcu;

namespace {

LinkModel free_link() {
  LinkModel l;
  l.latency = 0;
  l.bandwidth = 1e300;
  return l;
}

// Two one-block stages (the second reads the first), per-sample forward f and backward b.
std::vector<BlockProfile> two_blocks(double f, double b) {
  return {{"s0", {-1}, f, b, 0}, {"s1", {0}, f, b, 0}};
}

}  // namespace

TEST_CASE("per-sample block time: linear between measured micro-batch sizes, flat outside") {
  BlockProfile p{"b", {-1}, 0, 0, 0};
  p.by_batch = {{1, 4.0, 8.0}, {4, 1.0, 2.0}, {8, 0.5, 1.5}};
  CHECK(forward_per_sample(p, 0.5) == 4.0);  // below the smallest: the smallest's
  CHECK(forward_per_sample(p, 1) == 4.0);
  CHECK(forward_per_sample(p, 2) == doctest::Approx(3.0).epsilon(1e-15));  // 4 + (1/3)(1 - 4)
  CHECK(backward_per_sample(p, 3) == doctest::Approx(4.0).epsilon(1e-15));  // 8 + (2/3)(2 - 8)
  CHECK(forward_per_sample(p, 4) == 1.0);
  CHECK(forward_per_sample(p, 6) == doctest::Approx(0.75).epsilon(1e-15));
  CHECK(forward_per_sample(p, 64) == 0.5);  // beyond the largest: flat
  CHECK(backward_per_sample(p, 64) == 1.5);
  // No measured sizes: forward_s/backward_s at every size.
  BlockProfile q{"q", {-1}, 2.0, 3.0, 0};
  CHECK(forward_per_sample(q, 1) == 2.0);
  CHECK(backward_per_sample(q, 100) == 3.0);
}

TEST_CASE("the pipeline simulation takes each micro-batch at its own size's per-sample time") {
  // One stage: the step is the sum over micro-batches of m x (f(m) + b(m)).
  auto blocks = two_blocks(0, 0);
  for (auto& b : blocks) b.by_batch = {{1, 3e-3, 6e-3}, {4, 1e-3, 2e-3}};
  // batch 6, split 4: micro-batches of 4 and 2; f(2) = 3e-3 - (1/3) 2e-3, b(2) = 2 f(2).
  const double f2 = 3e-3 - 2e-3 / 3, f4 = 1e-3;
  const double one_stage = 2 * (4 * 3 * f4 + 2 * 3 * f2);  // two blocks
  CHECK(predict_step(blocks, {}, 6, 4, Schedule::GPipe, free_link()) == doctest::Approx(one_stage).epsilon(1e-12));
  // Two equal stages, M equal micro-batches of m: GPipe takes (M+1)(F + B), F and B one
  // stage's time for one micro-batch at m.
  for (int m : {1, 2, 4}) {
    const double F = m * forward_per_sample(blocks[0], m), B = m * backward_per_sample(blocks[0], m);
    CAPTURE(m);
    CHECK(predict_step(blocks, {1}, 8, m, Schedule::GPipe, free_link()) ==
          doctest::Approx((8 / m + 1) * (F + B)).epsilon(1e-12));
  }
  // Measured per-sample times falling with the micro-batch make split 4 beat split 1 here,
  // where flat times would make split 1 (the smallest bubble) the best.
  CHECK(predict_step(blocks, {1}, 8, 4, Schedule::GPipe, free_link()) <
        predict_step(blocks, {1}, 8, 1, Schedule::GPipe, free_link()));
  auto flat = two_blocks(1e-3, 2e-3);
  CHECK(predict_step(flat, {1}, 8, 1, Schedule::GPipe, free_link()) <
        predict_step(flat, {1}, 8, 4, Schedule::GPipe, free_link()));
}

TEST_CASE("shared slowdown 1 and no step costs reproduce the model without them") {
  const auto blocks = flop_derived_profile(256, 5e12);
  LinkModel link;
  link.bandwidth = 10e9;
  link.latency = 5e-6;
  const double P = 97.7e6, bucket = 25e6;
  for (int n : {1, 2, 4, 8})
    for (int batch : {1, 8})
      for (AllReduceAlgo algo : {AllReduceAlgo::Ring, AllReduceAlgo::ParameterServer}) {
        // The model as it was before slowdowns and step costs, written out.
        double f = 0, b = 0;
        for (const auto& bl : blocks) f += bl.forward_s, b += bl.backward_s;
        const double tf = f * batch, tb = b * batch;
        const int k = int(std::ceil(P / bucket));
        const double per_bucket = allreduce_seconds(P / k, n, algo, link);
        const double step = tf + (n > 1 ? std::max(tb + per_bucket, tb / k + k * per_bucket) : tb);
        const auto p = predict_dp(blocks, P, n, batch, algo, link, bucket);
        CAPTURE(n);
        CAPTURE(batch);
        CHECK(p.step_s == doctest::Approx(step).epsilon(1e-14));
        CHECK(p.speedup == doctest::Approx(n * (tf + tb) / step).epsilon(1e-14));
        CHECK(single_step_seconds(blocks, batch) == doctest::Approx(tf + tb).epsilon(1e-14));
      }
}

TEST_CASE("devices that compute at once: DP compute scales by the slowdown, MP only where stages overlap") {
  auto blocks = flop_derived_profile(128, 2e12);
  double f = 0, b = 0;
  for (const auto& bl : blocks) f += bl.forward_s, b += bl.backward_s;
  const double d = 1.25;
  for (auto& bl : blocks) bl.shared_slowdown = d;
  StepCosts costs;
  costs.comm_overlaps_compute = false;
  LinkModel link;
  const double P = 1e8;
  const auto p = predict_dp(blocks, P, 2, 4, AllReduceAlgo::Ring, link, 25e6, 0, costs);
  CHECK(p.compute_s == doctest::Approx(4 * (f + b) * d).epsilon(1e-14));
  // Not overlapped: backward and then every bucket.
  CHECK(p.step_s == doctest::Approx(4 * (f + b) * d + allreduce_seconds(P / 4, 2, AllReduceAlgo::Ring, link) * 4)
                        .epsilon(1e-14));
  // One replica computes alone: no slowdown.
  CHECK(predict_dp(blocks, P, 1, 4, AllReduceAlgo::Ring, link, 25e6, 0, costs).step_s ==
        doctest::Approx(4 * (f + b)).epsilon(1e-14));

  // Two equal one-block stages, M micro-batches, GPipe, free transfers: the first forward and
  // the last run alone, the M-1 in between overlap and take d times longer; backward alike:
  // 2F + (M-1) d F + 2B + (M-1) d B.
  for (double slow : {1.0, 1.5})
    for (int M : {1, 2, 5}) {
      auto two = two_blocks(1e-3, 2e-3);
      for (auto& bl : two) bl.shared_slowdown = slow;
      const double F = 1e-3, B = 2e-3;
      CAPTURE(slow);
      CAPTURE(M);
      CHECK(predict_step(two, {1}, M, 1, Schedule::GPipe, free_link()) ==
            doctest::Approx(2 * F + (M - 1) * slow * F + 2 * B + (M - 1) * slow * B).epsilon(1e-12));
    }
}

TEST_CASE("the optimizer and per-step costs: single, DP and the pipeline's stages") {
  auto blocks = two_blocks(1e-3, 2e-3);
  blocks[0].param_bytes = 1e6;
  blocks[1].param_bytes = 3e6;
  StepCosts c;
  c.optimizer_s = 0.1;
  c.optimizer_slowdown = 1.5;
  c.grad_zero_s = 0.01;
  c.bn_broadcast_s = 0.002;
  CHECK(single_step_seconds(blocks, 4, c) == doctest::Approx(4 * 2 * 3e-3 + 0.1).epsilon(1e-14));
  LinkModel link;
  const double P = 4e6;
  const auto dp = predict_dp(blocks, P, 2, 4, AllReduceAlgo::Ring, link, 25e6, 0, c);
  const auto dp0 = predict_dp(blocks, P, 2, 4, AllReduceAlgo::Ring, link, 25e6, 0, StepCosts{});
  CHECK(dp.step_s - dp0.step_s == doctest::Approx(0.1 * 1.5 + 0.01 + 0.002).epsilon(1e-12));
  // Stages step their own parameters at once: 0.025 s and 0.075 s of work alone; together
  // until the first is done (0.025 x 1.5), then the second alone (0.05).
  CHECK(concurrent_seconds({0.025, 0.075}, 1.5) == doctest::Approx(0.025 * 1.5 + 0.05).epsilon(1e-14));
  CHECK(concurrent_seconds({0.2}, 3.0) == 0.2);
  CHECK(predict_pipeline_step(blocks, {1}, 4, 2, Schedule::GPipe, free_link(), c) ==
        doctest::Approx(predict_step(blocks, {1}, 4, 2, Schedule::GPipe, free_link()) + 0.025 * 1.5 + 0.05)
            .epsilon(1e-12));
}

TEST_CASE("a link solved from two measured all-reduces gives those all-reduces back") {
  for (AllReduceAlgo algo : {AllReduceAlgo::Ring, AllReduceAlgo::ParameterServer})
    for (int n : {2, 3, 8}) {
      LinkModel truth;
      truth.bandwidth = 7.5e9;
      truth.latency = 40e-6;
      const double S = 97.7e6;
      const LinkModel l = link_from_allreduce(allreduce_seconds(0, n, algo, truth),
                                              allreduce_seconds(S, n, algo, truth), S, n, algo);
      CAPTURE(n);
      CHECK(l.bandwidth == doctest::Approx(truth.bandwidth).epsilon(1e-9));
      CHECK(l.latency == doctest::Approx(truth.latency).epsilon(1e-12));
    }
  CHECK_THROWS(link_from_allreduce(1e-4, 1e-3, 1e6, 1, AllReduceAlgo::Ring));
  // Timing noise: the large all-reduce measured no slower than the small one. The latency is
  // the small one's, the bytes nearly free (1 ps in all), never a negative or infinite figure.
  const LinkModel noisy = link_from_allreduce(1e-3, 1e-4, 1e6, 2, AllReduceAlgo::Ring);
  CHECK(noisy.latency == doctest::Approx(0.5e-3));
  CHECK(std::isfinite(noisy.bandwidth));
  CHECK(noisy.bandwidth == doctest::Approx(1e6 / 1e-12));
}

TEST_CASE("GPU under-fill: small micro-batches leave SMs idle, so the best split is not 1") {
  const double rate = 67e12 * 0.5;
  GpuFill h200;
  h200.sms = 132;
  CHECK(h200.saturating_elements() == 132 * 16384.0);
  const auto full = flop_derived_profile(512, rate);
  const auto under = flop_derived_profile(512, rate, h200);
  REQUIRE(under.size() == full.size());
  // layer4 at 512²: 512 channels x 16 x 16 = 131072 output elements per sample.
  const double e1 = 512.0 * 16 * 16;
  for (int m : {1, 4, 16}) {
    CAPTURE(m);
    CHECK(forward_per_sample(under[4], m) ==
          doctest::Approx(full[4].forward_s / std::min(1.0, m * e1 / h200.saturating_elements())).epsilon(1e-12));
  }
  // Saturated from 17 samples on: flat at the full rate.
  CHECK(forward_per_sample(under[4], 64) == doctest::Approx(full[4].forward_s).epsilon(1e-12));
  CHECK(backward_per_sample(under[4], 1000) == doctest::Approx(full[4].backward_s).epsilon(1e-12));
  // The segmentation head's output (1 x 512 x 512) fills 0.26 M of 2.16 M at one sample.
  CHECK(forward_per_sample(under[10], 1) > 8 * full[10].forward_s);

  std::vector<int> splits;
  for (int s = 1; s <= 64; s *= 2) splits.push_back(s);
  const LinkModel link = link_by_name("nvlink4");
  for (int stages : {2, 4}) {
    CAPTURE(stages);
    CHECK(predict_mp(under, stages, 64, splits, Schedule::GPipe, link).split_size > 1);
    // Without the curve, the smallest micro-batch (the smallest bubble) wins: the old answer.
    CHECK(predict_mp(full, stages, 64, splits, Schedule::GPipe, link).split_size == 1);
  }
}

TEST_CASE("link presets across machines") {
  CHECK(link_by_name("ib-ndr").bandwidth == 40e9);
  CHECK(link_by_name("ib-hdr").bandwidth == 20e9);
  CHECK(link_by_name("eth-100g").bandwidth == 10e9);
  CHECK(link_by_name("eth-25g").bandwidth == 2.5e9);
  CHECK(link_by_name("eth-25g").latency > link_by_name("ib-ndr").latency);
  CHECK_THROWS_WITH(link_by_name("ib-xdr"), doctest::Contains("ib-ndr"));
  // The same DP over a slower link never scales better.
  const auto blocks = flop_derived_profile(512, 33.5e12, GpuFill{132});
  for (int n : {8, 64})
    CHECK(predict_dp(blocks, 97.7e6, n, 14, AllReduceAlgo::Ring, link_by_name("eth-25g")).speedup <
          predict_dp(blocks, 97.7e6, n, 14, AllReduceAlgo::Ring, link_by_name("ib-ndr")).speedup);
}

TEST_CASE("the FLOP-derived profile of each encoder: its convolutions' multiply-adds, torchvision's figures") {
  // The encoder's blocks (stem, layer1..layer4) at 224x224, forward at a rate of one FLOP per
  // second: 2 x the multiply-adds of their convolutions. torchvision's model tables give each
  // ResNet's GFLOPS (multiply-adds, with the 1000-way fc layer: 0.5 M or 2 M, below their
  // rounding) to 3 significant figures: 1.81, 3.66, 4.09, 7.80 and 11.51.
  const std::pair<EncoderKind, double> published[] = {{EncoderKind::ResNet18, 1.81e9},
                                                      {EncoderKind::ResNet34, 3.66e9},
                                                      {EncoderKind::ResNet50, 4.09e9},
                                                      {EncoderKind::ResNet101, 7.80e9},
                                                      {EncoderKind::ResNet152, 11.51e9}};
  for (const auto& [encoder, macs] : published) {
    CAPTURE(encoder_name(encoder));
    const auto blocks = flop_derived_profile(224, 1.0, encoder);
    REQUIRE(blocks.size() == 11);
    double flops = 0;
    for (int b = 0; b < 5; ++b) flops += blocks[b].forward_s;
    CHECK(flops / 2 == doctest::Approx(macs).epsilon(0.006));
    // The decoder's first block takes layer4's channels and layer3's as its skip.
    const int c = encoder_channels(encoder, 1)[4], skip = encoder_channels(encoder, 1)[3];
    const double h = 224 / 16.0;
    CHECK(blocks[5].forward_s == doctest::Approx(2 * 9 * h * h * (double(c + skip) * 256 + 256.0 * 256)));
  }
}
