// Model (pipeline) parallelism on CPU devices: contract 5, skip routing, live activations.
#include "cli/parse.h"
#include "data/synthetic.h"
#include "engine/optim.h"
#include "engine/tape.h"
#include "models/unet.h"
#include "parallel/pipeline.h"
#include "planning/perf_model.h"
#include "planning/split_search.h"
#include "testing.h"
#include "small_models.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {

UNetConfig pipe_model() { return small_unet(21, Device::cpu(), DType::F64); }
const auto adam = adam_lr_0_01;
const auto max_rel_diff = max_rel_param_diff;

Batch rows(const Batch& b, int64_t lo, int64_t hi) {
  std::vector<int64_t> keep;
  Batch out{Tensor::empty({hi - lo, 3, b.images.dim(2), b.images.dim(3)}, b.images.dtype()),
            Tensor::empty({hi - lo, 1, b.masks.dim(2), b.masks.dim(3)}, b.masks.dtype())};
  const int64_t ri = b.images.numel() / b.images.dim(0), rm = b.masks.numel() / b.masks.dim(0);
  for (int64_t i = 0; i < (hi - lo) * ri; ++i) out.images.set(i, b.images.at(lo * ri + i));
  for (int64_t i = 0; i < (hi - lo) * rm; ++i) out.masks.set(i, b.masks.at(lo * rm + i));
  return out;
}

}  // namespace

TEST_CASE("contract 5: MP with 2 and 3 stages equals one device accumulating over the micro-batches") {
  // Identical per-chunk arithmetic; only the order in which a tensor's gradients from several
  // consumers are summed differs (stage order vs tape order): ~1e-16, grown by the batch norms'
  // cancellation to ~1e-12 in the gradients (checked at 1e-10 of the largest gradient), and
  // by Adam, which divides by sqrt(v) + eps, to up to 2.3e-8 in the parameters (measured):
  // parameters are checked at 1e-7.
  SyntheticSegmentation data(64, 5);
  struct Case {
    std::string cuts;
    int stages, split, batch;
  };
  const Case cases[] = {{"layer3", 2, 2, 4},                       // the article's cut, divides
                        {"layer3", 2, 2, 5},                       // does not divide
                        {"decoder.blocks.1", 2, 3, 5},             // a cut in the decoder
                        {"layer1,decoder.blocks.2", 3, 2, 6},      // three stages, skips cross two cuts
                        {"layer2,decoder.blocks.0", 3, 4, 5}};
  for (const Case& c : cases)
    for (Schedule sched : {Schedule::GPipe, Schedule::OneFOneB}) {
      CAPTURE(c.cuts);
      CAPTURE(c.split);
      CAPTURE(c.batch);
      CAPTURE(int(sched));
      PipelineOptions o;
      for (int s = 0; s < c.stages; ++s) o.devices.push_back(Device::cpu(s));
      o.cuts = cli::parse_cuts(c.cuts);
      o.split_size = c.split;
      o.schedule = sched;
      Pipeline pipe(pipe_model(), o, adam);
      UNet single(pipe_model());
      auto opt = adam(single.parameters());
      for (int step = 0; step < 2; ++step) {
        std::vector<int64_t> idx;
        for (int i = 0; i < c.batch; ++i) idx.push_back(step * 100 + i);
        const Batch b = data.batch(idx, DType::F64);
        const double mp_loss = pipe.step(b, LossKind::BCEDice);
        opt->zero_grad();
        double loss = 0;
        for (int64_t lo = 0; lo < c.batch; lo += c.split) {
          const int64_t hi = std::min<int64_t>(lo + c.split, c.batch);
          const Batch part = rows(b, lo, hi);
          Tape tape;
          Tensor l;
          {
            TapeScope s(tape);
            l = scale(segmentation_loss(LossKind::BCEDice, single.forward(part.images), part.masks),
                      double(hi - lo) / c.batch);
          }
          loss += l.item();
          tape.backward(l);
        }
        opt->step();
        CHECK(mp_loss == doctest::Approx(loss).epsilon(1e-12));
        // Gradients, against the model's largest (some tensors' gradients cancel to ~1e-7).
        const auto gp = pipe.model().parameters(), gs = single.parameters();
        double scale_ = 0, worst = 0;
        for (size_t i = 0; i < gs.size(); ++i) {
          for (int64_t k = 0; k < gs[i].numel(); ++k) scale_ = std::max(scale_, std::fabs(gs[i].grad().at(k)));
          worst = std::max(worst, max_abs_diff(gp[i].grad(), gs[i].grad()));
        }
        CHECK(worst <= 1e-10 * scale_);
        CHECK(max_rel_diff(pipe.model(), single) < 1e-7);
      }
      const auto live = pipe.peak_live_micro_batches();
      const int M = (c.batch + c.split - 1) / c.split;
      for (int s = 0; s < c.stages; ++s) {
        CAPTURE(s);
        if (sched == Schedule::GPipe)
          CHECK(live[s] == M);  // GPipe holds every micro-batch
        else
          CHECK(live[s] <= std::min(c.stages, M));  // 1F1B: at most S
      }
    }
}

TEST_CASE("gradient clipping in MP: every stage clips by the whole model's norm, as one device does") {
  // SGD (linear in the gradient): the gradients' ~1e-12 agreement (contract 5) carries to the
  // parameters. A stage clipping by its own norm would differ by the ratio of the norms.
  SyntheticSegmentation data(64, 5);
  auto sgd = [](double max_norm) {
    return [max_norm](std::vector<Tensor> p) -> std::unique_ptr<Optimizer> {
      SgdOptions o;
      o.lr = 0.1;
      o.momentum = 0.9;
      auto opt = std::make_unique<SGD>(std::move(p), o);
      opt->set_max_grad_norm(max_norm);
      return opt;
    };
  };
  for (const char* cuts : {"layer3", "layer1,decoder.blocks.2"}) {
    CAPTURE(cuts);
    PipelineOptions o;
    o.cuts = cli::parse_cuts(cuts);
    for (size_t s = 0; s <= o.cuts.size(); ++s) o.devices.push_back(Device::cpu(int(s)));
    o.split_size = 2;
    const double max_norm = 0.05;
    Pipeline pipe(pipe_model(), o, sgd(max_norm));
    UNet single(pipe_model());
    auto opt = sgd(max_norm)(single.parameters());
    for (int step = 0; step < 2; ++step) {
      std::vector<int64_t> idx;
      for (int i = 0; i < 4; ++i) idx.push_back(step * 100 + i);
      const Batch b = data.batch(idx, DType::F64);
      pipe.step(b, LossKind::BCEDice);
      opt->zero_grad();
      for (int64_t lo = 0; lo < 4; lo += 2) {
        const Batch part = rows(b, lo, lo + 2);
        Tape tape;
        Tensor l;
        {
          TapeScope s(tape);
          l = scale(segmentation_loss(LossKind::BCEDice, single.forward(part.images), part.masks), 0.5);
        }
        tape.backward(l);
      }
      // The clip is in force: the gradients' norm is far above the largest allowed.
      CHECK(std::sqrt(opt->grad_square_sum().item()) > 10 * max_norm);
      opt->step();
      CHECK(max_rel_diff(pipe.model(), single) < 1e-10);
    }
    // Every stage recorded the whole model's norms, those one device saw.
    const Optimizer::ClipStats want = opt->take_clip_stats();
    CHECK(want.steps == 2);
    CHECK(want.clipped == 2);
    for (const auto& stage : pipe.optimizers()) {
      const Optimizer::ClipStats got = stage->take_clip_stats();
      CHECK(got.steps == 2);
      CHECK(got.clipped == 2);
      CHECK(got.norm_mean == doctest::Approx(want.norm_mean).epsilon(1e-10));
      CHECK(got.norm_max == doctest::Approx(want.norm_max).epsilon(1e-10));
    }
  }
}

TEST_CASE("a skip made on stage 0 and used on stage 2 goes straight there") {
  PipelineOptions o;
  o.devices = {Device::cpu(0), Device::cpu(1), Device::cpu(2)};
  o.cuts = cli::parse_cuts("layer1,decoder.blocks.2");  // stage 0: stem, layer1
  o.split_size = 2;
  Pipeline pipe(pipe_model(), o, adam);
  SyntheticSegmentation data(64, 6);
  pipe.step(data.batch({0, 1, 2, 3}, DType::F64), LossKind::BCE);
  int direct = 0;
  for (const Transfer& t : pipe.transfers()) {
    CAPTURE(t.block);
    CAPTURE(t.from_stage);
    CAPTURE(t.to_stage);
    if (t.block == 0 || t.block == 1) {
      // The stem's output (block 0) is read by decoder.blocks.3 (stage 2); layer1's by layer2
      // (stage 1) and decoder.blocks.2 (stage 2): each copy comes from stage 0 itself.
      CHECK(t.from_stage == 0);
      if (t.block == 0) {
        CHECK(t.to_stage == 2);
        ++direct;
      }
    }
  }
  CHECK(direct == 2);  // once per micro-batch
}

TEST_CASE("pipeline: bad split sizes and cuts are refused, a short batch is one micro-batch") {
  PipelineOptions o;
  o.devices = {Device::cpu(0), Device::cpu(1)};
  o.cuts = cli::parse_cuts("layer3");
  CHECK(o.cuts == std::vector<int>{4});
  SyntheticSegmentation data(64, 7);
  const Batch b = data.batch({0, 1}, DType::F64);
  o.split_size = 3;
  Pipeline big(pipe_model(), o, adam);
  // A batch smaller than the split size (an epoch's last) is one micro-batch.
  CHECK(big.place(b).size() == 1);
  CHECK(std::isfinite(big.step(b, LossKind::BCE)));
  CHECK(big.peak_live_micro_batches() == std::vector<int>{1, 1});
  o.split_size = 0;
  CHECK_THROWS_WITH(Pipeline(pipe_model(), o, adam), doctest::Contains("at least 1"));
  CHECK_THROWS_WITH(cli::parse_cuts("layer9"), doctest::Contains("not a block"));
  CHECK_THROWS_WITH(cli::parse_cuts("layer3,layer1"), doctest::Contains("increasing"));
  CHECK_THROWS_WITH(cli::parse_cuts("segmentation_head"), doctest::Contains("not a block"));
}

TEST_CASE("the split search picks the cut a brute-force timing of every cut picks (synthetic costs)") {
  // Eleven blocks with made-up per-sample times, free transfers. For two stages and M equal
  // micro-batches GPipe takes F0 + F1 + (M-1) max(F0, F1) + B0 + B1 + (M-1) max(B0, B1),
  // with F/B a stage's per-micro-batch forward/backward time: the brute force below.
  UNet probe(pipe_model());
  std::vector<BlockProfile> blocks;
  const double f[] = {3, 5, 4, 6, 2, 7, 5, 4, 3, 6, 1}, b[] = {6, 9, 8, 12, 5, 13, 9, 8, 7, 11, 2};
  for (size_t k = 0; k < probe.blocks().size(); ++k)
    blocks.push_back({probe.blocks()[k].name, probe.blocks()[k].inputs, f[k] * 1e-3, b[k] * 1e-3, 0});
  LinkModel free_link;
  free_link.latency = 0;
  free_link.bandwidth = 1e300;
  const int batch = 12;
  for (int split : {1, 2, 3, 4, 6, 12}) {
    CAPTURE(split);
    const int M = batch / split;
    double best = 1e300;
    std::vector<double> brute(blocks.size(), 0);
    for (int c = 1; c < int(blocks.size()); ++c) {
      double F0 = 0, F1 = 0, B0 = 0, B1 = 0;
      for (int k = 0; k < int(blocks.size()); ++k) {
        (k < c ? F0 : F1) += blocks[k].forward_s * split;
        (k < c ? B0 : B1) += blocks[k].backward_s * split;
      }
      const double t = F0 + F1 + (M - 1) * std::max(F0, F1) + B0 + B1 + (M - 1) * std::max(B0, B1);
      CHECK(predict_step(blocks, {c}, batch, split, Schedule::GPipe, free_link) == doctest::Approx(t).epsilon(1e-12));
      brute[c] = t;
      best = std::min(best, t);
    }
    const auto plans = rank_plans(blocks, batch, {split}, Schedule::GPipe, free_link);
    REQUIRE(!plans.empty());
    // The chosen cut is a brute-force minimum (with one micro-batch every cut ties).
    CHECK(brute[plans[0].cuts[0]] == doctest::Approx(best).epsilon(1e-12));
    if (split == 2) CHECK(plans[0].cuts[0] == 5);  // the unique minimum for this table
  }
  // Transfers cost time: a slow link makes the prediction longer, never shorter.
  LinkModel slow;
  slow.bandwidth = 1e6;
  for (auto& bl : blocks) bl.output_bytes = 1e4;
  CHECK(predict_step(blocks, {4}, batch, 2, Schedule::OneFOneB, slow) >
        predict_step(blocks, {4}, batch, 2, Schedule::OneFOneB, free_link));
  CHECK(plans_table(rank_plans(blocks, batch, {2, 4}, Schedule::GPipe, free_link), blocks).find("**") !=
        std::string::npos);
}

TEST_CASE("performance model: ring all-reduce time and the GPipe bubble, exactly") {
  LinkModel link;
  link.bandwidth = 10e9;
  link.latency = 5e-6;
  for (int n : {2, 3, 4, 8}) {
    const double S = 97.7e6;
    CHECK(allreduce_seconds(S, n, AllReduceAlgo::Ring, link) ==
          doctest::Approx(2.0 * (n - 1) / n * S / link.bandwidth + 2.0 * (n - 1) * link.latency).epsilon(1e-15));
    CHECK(allreduce_seconds(S, n, AllReduceAlgo::ParameterServer, link) ==
          doctest::Approx(2.0 * (n - 1) * S / link.bandwidth + 2 * link.latency).epsilon(1e-15));
  }
  CHECK(allreduce_seconds(1e6, 1, AllReduceAlgo::Ring, link) == 0);
  // S equal stages of one block each, free transfers: GPipe idles (S-1)/(M+S-1) of the time.
  LinkModel free_link;
  free_link.latency = 0;
  free_link.bandwidth = 1e300;
  for (int S : {2, 3, 4})
    for (int M : {1, 2, 5, 8}) {
      std::vector<BlockProfile> blocks;
      for (int k = 0; k < S; ++k) blocks.push_back({"b" + std::to_string(k), {k - 1}, 1e-3, 2e-3, 0});
      std::vector<int> cuts;
      for (int k = 1; k < S; ++k) cuts.push_back(k);
      const double t = predict_step(blocks, cuts, M, 1, Schedule::GPipe, free_link);
      const double busy = M * 3e-3;  // one stage's work
      CAPTURE(S);
      CAPTURE(M);
      CHECK(1 - busy / t == doctest::Approx(double(S - 1) / (M + S - 1)).epsilon(1e-12));
    }
  // DP with one replica costs what one device costs; a loader cap binds every method.
  const auto blocks = flop_derived_profile(256, 5e12);
  CHECK(predict_dp(blocks, 1e8, 1, 8, AllReduceAlgo::Ring, link).speedup == doctest::Approx(1.0));
  CHECK(predict_dp(blocks, 1e8, 4, 8, AllReduceAlgo::Ring, link, 25e6, 10.0).speedup ==
        doctest::Approx(1.0).epsilon(1e-9));
  CHECK(link_by_name("pcie3").bandwidth > 1e9);
  CHECK_THROWS_WITH(link_by_name("carrier pigeon"), doctest::Contains("unknown link"));
}
