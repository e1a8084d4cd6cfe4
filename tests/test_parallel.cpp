// Data parallelism on CPU devices: the ring/PS all-reduce, contracts 4 and 6 of the design,
// overlap of gradient buckets with backward.
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>

#include "cli/parse.h"
#include "data/synthetic.h"
#include "engine/optim.h"
#include "engine/tape.h"
#include "models/unet.h"
#include "parallel/communicator.h"
#include "parallel/data_parallel.h"
#include "testing.h"
#include "train/strategy.h"
#include "small_models.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {

// Runs f(rank) on one thread per rank.
void on_ranks(int n, const std::function<void(int)>& f) {
  std::vector<std::thread> ts;
  std::vector<std::exception_ptr> errs(n);
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        f(r);
      } catch (...) {
        errs[r] = std::current_exception();
      }
    });
  for (auto& t : ts) t.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
}

// Rank r's value at i: small integers, so float sums are exact.
double value(int r, int64_t i) { return double((r + 1) * 3 + (i % 11) - 5); }

}  // namespace

TEST_CASE("CPU all-reduce (ring and PS): exact sums and averages for N = 1..8, any length") {
  for (AllReduceAlgo algo : {AllReduceAlgo::Ring, AllReduceAlgo::ParameterServer}) {
    for (int N = 1; N <= 8; ++N) {
      for (int64_t L : {int64_t(1), int64_t(N > 1 ? N - 1 : 1), int64_t(N), int64_t(N + 1),
                        int64_t(7 * N + 3), int64_t(1000)}) {
        for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Average}) {
          CAPTURE(N);
          CAPTURE(L);
          CAPTURE(int(algo));
          auto comms = make_cpu_communicators(N, algo);
          std::vector<Tensor> bufs(N);
          for (int r = 0; r < N; ++r) {
            bufs[r] = Tensor::empty({L}, DType::F32);
            for (int64_t i = 0; i < L; ++i) bufs[r].set(i, value(r, i));
          }
          const bool async = L == 1000;  // the communication-thread path too
          on_ranks(N, [&](int r) {
            if (async)
              comms[r]->all_reduce_async(bufs[r], op)->wait();
            else
              comms[r]->all_reduce(bufs[r], op);
          });
          for (int r = 0; r < N; ++r)
            for (int64_t i = 0; i < L; ++i) {
              double sum = 0;
              for (int q = 0; q < N; ++q) sum += value(q, i);
              const float want = op == ReduceOp::Sum ? float(sum) : float(sum) / float(N);
              REQUIRE(float(bufs[r].at(i)) == want);
            }
        }
      }
    }
  }
}

TEST_CASE("CPU communicator: broadcast, reduce, barrier, mismatched sizes refused") {
  const int N = 3;
  auto comms = make_cpu_communicators(N, AllReduceAlgo::Ring);
  std::vector<Tensor> b(N);
  for (int r = 0; r < N; ++r) b[r] = Tensor::full({5}, double(r + 1), DType::F64);
  on_ranks(N, [&](int r) { comms[r]->broadcast(b[r], 2); });
  for (int r = 0; r < N; ++r) CHECK(b[r].to_vector() == std::vector<double>(5, 3.0));
  for (int r = 0; r < N; ++r) b[r].fill_(double(r + 1));
  on_ranks(N, [&](int r) {
    comms[r]->reduce(b[r], 1, ReduceOp::Sum);
    comms[r]->barrier();
  });
  CHECK(b[1].to_vector() == std::vector<double>(5, 6.0));
  CHECK(b[0].to_vector() == std::vector<double>(5, 1.0));  // non-roots untouched
  std::vector<Tensor> bad = {Tensor::zeros({4}), Tensor::zeros({5}), Tensor::zeros({4})};
  CHECK_THROWS_WITH(on_ranks(N, [&](int r) { comms[r]->all_reduce(bad[r], ReduceOp::Sum); }),
                    doctest::Contains("ranks disagree"));
}

// bfloat16 all-reduce, NCCL's arithmetic: each addition in float32 (relative error 2^-24),
// rounded to bfloat16 (2^-8). The owner of an element adds the N values in some order, each
// partial sum bounded by S = sum_r |x_r|, then divides: the mean is off by at most
// (N - 1)·u'·S/N + u'·S/N = u'·S with u' = 2^-8 + 2^-24, times (1 + u')^N for the errors
// carried along. A sum that missed or doubled a rank would be off by |x_r|, far more.
TEST_CASE(
    "CPU all-reduce in bfloat16 (ring and PS): the mean within one rounding of the sum of magnitudes, the same on "
    "every rank") {
  const double u = std::ldexp(1.0, -8) + std::ldexp(1.0, -24);
  Rng rng(5);
  for (AllReduceAlgo algo : {AllReduceAlgo::Ring, AllReduceAlgo::ParameterServer}) {
    for (int N : {2, 3, 4, 5}) {
      for (int64_t L : {int64_t(1), int64_t(N + 1), int64_t(1000)}) {
        CAPTURE(int(algo));
        CAPTURE(N);
        CAPTURE(L);
        auto comms = make_cpu_communicators(N, algo);
        std::vector<Tensor> bufs(N);
        for (int r = 0; r < N; ++r) bufs[r] = random_tensor({L}, rng, -1, 1, DType::BF16);
        std::vector<double> mean(size_t(L), 0.0), mag(size_t(L), 0.0);
        for (int r = 0; r < N; ++r)
          for (int64_t i = 0; i < L; ++i) {
            mean[size_t(i)] += bufs[r].at(i) / N;
            mag[size_t(i)] += std::fabs(bufs[r].at(i));
          }
        on_ranks(N, [&](int r) { comms[r]->all_reduce_async(bufs[r], ReduceOp::Average)->wait(); });
        double worst = 0;
        for (int64_t i = 0; i < L; ++i) {
          const double err = std::fabs(bufs[0].at(i) - mean[size_t(i)]);
          REQUIRE(err <= u * std::pow(1 + u, N) * mag[size_t(i)]);
          worst = std::max(worst, err / mag[size_t(i)]);
        }
        for (int r = 1; r < N; ++r) REQUIRE(std::memcmp(bufs[r].raw(), bufs[0].raw(), bufs[0].nbytes()) == 0);
        if (L == 1000) MESSAGE("bf16 mean of ", N, " ranks: worst error ", worst, " of the sum of magnitudes");
      }
    }
  }
}

namespace {

constexpr int kImage = 64;

UNetConfig small_model() {
  UNetConfig c;
  c.width_divisor = 16;
  c.dtype = DType::F64;
  c.seed = 3;
  return c;
}

// The global batch of step s: N shards of b samples each.
std::vector<Batch> shards_for(const SyntheticSegmentation& data, int step, int N, int b) {
  std::vector<Batch> out;
  for (int r = 0; r < N; ++r) {
    std::vector<int64_t> idx;
    for (int i = 0; i < b; ++i) idx.push_back(int64_t(step) * N * b + r * b + i);
    out.push_back(data.batch(idx, DType::F64));
  }
  return out;
}

Batch concat_batches(const std::vector<Batch>& parts) {
  std::vector<Tensor> im, ma;
  for (const Batch& p : parts) {
    im.push_back(p.images);
    ma.push_back(p.masks);
  }
  // Along the batch dimension: contiguous NCHW tensors stack by plain byte copies.
  auto stack = [](const std::vector<Tensor>& ts) {
    Shape s = ts[0].shape();
    s[0] = 0;
    for (const Tensor& t : ts) s[0] += t.dim(0);
    Tensor out = Tensor::empty(s, ts[0].dtype());
    size_t off = 0;
    for (const Tensor& t : ts) {
      std::memcpy(static_cast<char*>(out.raw()) + off, t.raw(), t.nbytes());
      off += t.nbytes();
    }
    return out;
  };
  return {stack(im), stack(ma)};
}

// SGD with momentum: the update is linear in the gradient, so the comparison sees the
// gradients' own agreement. (Adam divides by sqrt(v) + eps and turns 1e-12 differences of
// gradients near eps into 1e-9 differences of parameters.)
std::unique_ptr<Optimizer> make_sgd(std::vector<Tensor> p) {
  SgdOptions o;
  o.lr = 1e-1;
  o.momentum = 0.9;
  return std::make_unique<SGD>(std::move(p), o);
}

const auto make_adam = adam_lr_0_01;

bool replicas_identical(DataParallel& dp) {
  const auto p0 = dp.replica(0).parameters();
  for (int r = 1; r < dp.size(); ++r) {
    const auto pr = dp.replica(r).parameters();
    for (size_t i = 0; i < p0.size(); ++i)
      if (std::memcmp(p0[i].raw(), pr[i].raw(), p0[i].nbytes()) != 0) return false;
  }
  return true;
}

}  // namespace

// Tolerance of the DP-vs-one-device comparisons: the same float64 gradients, summed in another
// order (ring chunks, a 1/N weight before instead of after the backward), differ by ~1e-11
// relative after a backward through batch norms (whose centring cancels); after two SGD
// steps with lr 0.1 the parameters then differ by ~2e-12 (measured). 64×64 images keep 8
// values per channel at layer4: with 2 (32×32, batch 2) batch norm is so ill-conditioned that
// rounding grows to 1e-8.
constexpr double kParamTol = 1e-10;

TEST_CASE("contract 4: DP on N CPU devices equals one device accumulating over the N chunks") {
  for (int N : {2, 3}) {
    CAPTURE(N);
    const int b = 2;
    SyntheticSegmentation data(kImage, 9);
    DataParallelOptions o;
    for (int r = 0; r < N; ++r) o.devices.push_back(Device::cpu(r));
    o.first_bucket_bytes = 4096;  // several buckets even for this small model
    o.bucket_bytes = 64 << 10;
    DataParallel dp(small_model(), o, make_sgd);
    UNet single(small_model());
    auto opt = make_sgd(single.parameters());
    for (int step = 0; step < 2; ++step) {
      const auto shards = shards_for(data, step, N, b);
      const std::vector<double> dp_losses = dp.step(shards, LossKind::BCEDice);
      opt->zero_grad();
      double single_loss = 0;
      for (int r = 0; r < N; ++r) {
        Tape tape;
        Tensor loss;
        {
          TapeScope s(tape);
          loss = scale(segmentation_loss(LossKind::BCEDice, single.forward(shards[r].images),
                                         shards[r].masks), 1.0 / N);
        }
        single_loss += loss.item();
        tape.backward(loss);
      }
      opt->step();
      double dp_mean = 0;
      for (double l : dp_losses) dp_mean += l / N;
      CHECK(dp_mean == doctest::Approx(single_loss).epsilon(1e-12));
      CHECK(max_rel_param_diff(dp.replica(0), single) < kParamTol);
      CHECK(replicas_identical(dp));  // contract 6, after every step
    }
  }
}

TEST_CASE("gradient clipping in DP: each replica clips the averaged gradients, as one device clips the whole batch's") {
  const double max_norm = 0.05;
  auto clipped_sgd = [max_norm](std::vector<Tensor> p) {
    auto opt = make_sgd(std::move(p));
    opt->set_max_grad_norm(max_norm);
    return opt;
  };
  const int N = 2, b = 2;
  SyntheticSegmentation data(kImage, 9);
  DataParallelOptions o;
  for (int r = 0; r < N; ++r) o.devices.push_back(Device::cpu(r));
  DataParallel dp(small_model(), o, clipped_sgd);
  UNet single(small_model());
  auto opt = clipped_sgd(single.parameters());
  for (int step = 0; step < 2; ++step) {
    const auto shards = shards_for(data, step, N, b);
    dp.step(shards, LossKind::BCEDice);
    opt->zero_grad();
    for (int r = 0; r < N; ++r) {
      Tape tape;
      Tensor loss;
      {
        TapeScope s(tape);
        loss = scale(segmentation_loss(LossKind::BCEDice, single.forward(shards[r].images), shards[r].masks),
                     1.0 / N);
      }
      tape.backward(loss);
    }
    CHECK(std::sqrt(opt->grad_square_sum().item()) > 10 * max_norm);  // the clip is in force
    opt->step();
    CHECK(max_rel_param_diff(dp.replica(0), single) < kParamTol);
    CHECK(replicas_identical(dp));
  }
}

TEST_CASE(
    "gradient accumulation: N replicas of b rows equal fewer replicas of N·b/R rows in chunks of b, and one device") {
  // 4 chunks of 2 rows each step, run as 4 replicas, as 2 replicas accumulating 2 chunks (the
  // all-reduce after the second chunk's backward), as 1 replica accumulating 4, and as one
  // device accumulating 4: the same mean gradient, summed in another order (kParamTol).
  SyntheticSegmentation data(kImage, 9);
  auto dp_of = [](int N, int64_t accumulate_rows) {
    DataParallelOptions o;
    for (int r = 0; r < N; ++r) o.devices.push_back(Device::cpu(r));
    o.first_bucket_bytes = 4096;  // several buckets
    o.bucket_bytes = 64 << 10;
    o.accumulate_rows = accumulate_rows;
    return std::make_unique<DataParallel>(small_model(), o, make_sgd);
  };
  auto four = dp_of(4, 0), two = dp_of(2, 2), one = dp_of(1, 2);
  UNetConfig m = small_model();
  m.device = Device::cpu();
  SingleDeviceStrategy single(m, Placement{{}, 0, false, 2}, make_sgd, LossKind::BCEDice);
  for (int step = 0; step < 2; ++step) {
    CAPTURE(step);
    const double l4 = [&] {
      double mean = 0;
      for (double l : four->step(shards_for(data, step, 4, 2), LossKind::BCEDice)) mean += l / 4;
      return mean;
    }();
    double l2 = 0;
    for (double l : two->step(shards_for(data, step, 2, 4), LossKind::BCEDice)) l2 += l / 2;
    const double l1 = one->step(shards_for(data, step, 1, 8), LossKind::BCEDice)[0];
    const double ls = single.step(single.place(shards_for(data, step, 1, 8)[0]));
    CHECK(l2 == doctest::Approx(l4).epsilon(1e-12));
    CHECK(l1 == doctest::Approx(l4).epsilon(1e-12));
    CHECK(ls == doctest::Approx(l4).epsilon(1e-12));
    CHECK(max_rel_param_diff(two->replica(0), four->replica(0)) < kParamTol);
    CHECK(max_rel_param_diff(one->replica(0), four->replica(0)) < kParamTol);
    CHECK(max_rel_param_diff(single.unet(), four->replica(0)) < kParamTol);
    CHECK(replicas_identical(*two));
  }
  // Without the chunks the batch norms see 4 or 8 rows at once: another step.
  auto whole = dp_of(1, 0);
  whole->step(shards_for(data, 0, 1, 8), LossKind::BCEDice);
  auto fresh = dp_of(4, 0);
  fresh->step(shards_for(data, 0, 4, 2), LossKind::BCEDice);
  CHECK(max_rel_param_diff(whole->replica(0), fresh->replica(0)) > 1e-6);
}

namespace {
std::vector<Tensor> buffers_of(const Module& m) {
  std::vector<Tensor> out;
  for (const StateEntry& e : m.state())
    if (!e.is_parameter && e.tensor.defined()) out.push_back(e.tensor);
  return out;
}
}  // namespace

TEST_CASE("pack_buffers: the BN running statistics become views of one flat buffer, values kept, updates land in it") {
  UNet model(small_model());
  const std::vector<Tensor> buffers = buffers_of(model);
  REQUIRE(buffers.size() > 40);  // two per batch norm
  std::vector<std::vector<double>> before;
  for (const Tensor& b : buffers) before.push_back(b.to_vector());
  Tensor flat = pack_buffers(model);
  REQUIRE(flat.defined());
  std::vector<double> outside = flat.to_vector();  // the padding between slots
  const char* lo = static_cast<const char*>(flat.raw());
  for (size_t i = 0; i < buffers.size(); ++i) {
    CAPTURE(i);
    CHECK(buffers[i].same_storage(flat));
    CHECK(buffers[i].to_vector() == before[i]);
    const char* at = static_cast<const char*>(buffers[i].raw());
    REQUIRE(at >= lo);
    REQUIRE(at + buffers[i].nbytes() <= lo + flat.nbytes());
    CHECK((at - lo) % 256 == 0);
    const int64_t first = (at - lo) / int64_t(sizeof(double));
    for (int64_t k = 0; k < buffers[i].numel(); ++k) outside[size_t(first + k)] = 0;
  }
  for (double v : outside) REQUIRE(v == 0.0);
  // The module's own handles read and write the slots: a training forward's update lands in
  // the flat buffer, and a write to it reaches every buffer.
  const std::vector<double> flat_before = flat.to_vector();
  SyntheticSegmentation data(kImage, 4);
  model.train();
  model.forward(data.batch({0, 1}, DType::F64).images);
  CHECK(flat.to_vector() != flat_before);
  for (const Tensor& b : buffers_of(model)) CHECK(b.same_storage(flat));
  flat.fill_(0.5);
  for (const Tensor& b : buffers_of(model))
    for (double v : b.to_vector()) REQUIRE(v == 0.5);
}

TEST_CASE("data parallel: every step starts from rank 0's BN running statistics, broadcast in one buffer") {
  DataParallelOptions o;
  o.devices = {Device::cpu(0), Device::cpu(1), Device::cpu(2)};
  DataParallel dp(small_model(), o, make_sgd);
  for (int r = 0; r < dp.size(); ++r) {  // packed: all in one storage
    const std::vector<Tensor> b = buffers_of(dp.replica(r));
    for (const Tensor& t : b) REQUIRE(t.same_storage(b.front()));
  }
  // Replicas 1 and 2 drift; the same shard everywhere then leaves them equal to rank 0 only
  // if the step began by overwriting theirs with rank 0's.
  for (int r = 1; r < dp.size(); ++r)
    for (Tensor b : buffers_of(dp.replica(r))) b.fill_(7.0);
  SyntheticSegmentation data(kImage, 4);
  const Batch shard = data.batch({0, 1}, DType::F64);
  dp.step({shard, shard, shard}, LossKind::BCE);
  const std::vector<Tensor> b0 = buffers_of(dp.replica(0));
  for (int r = 1; r < dp.size(); ++r) {
    const std::vector<Tensor> br = buffers_of(dp.replica(r));
    REQUIRE(br.size() == b0.size());
    for (size_t i = 0; i < b0.size(); ++i) REQUIRE(br[i].to_vector() == b0[i].to_vector());
  }
  for (double v : b0.front().to_vector()) REQUIRE(v != 7.0);  // rank 0's own, not the drift
}

TEST_CASE("contract 4 with synchronized BN: DP on N x b equals one device on the whole batch") {
  // BCE is a mean over pixels, so the mean of the replicas' losses is the whole batch's loss
  // (Dice over a shard is not Dice over the batch, hence BCE here).
  for (int N : {2, 3}) {
  CAPTURE(N);
  const int b = 2;
  SyntheticSegmentation data(kImage, 10);
  DataParallelOptions o;
  for (int r = 0; r < N; ++r) o.devices.push_back(Device::cpu(r));
  o.sync_bn = true;
  DataParallel dp(small_model(), o, make_sgd);
  UNet single(small_model());
  auto opt = make_sgd(single.parameters());
  for (int step = 0; step < 2; ++step) {
    const auto shards = shards_for(data, step, N, b);
    const auto dp_losses = dp.step(shards, LossKind::BCE);
    const Batch whole = concat_batches(shards);
    opt->zero_grad();
    Tape tape;
    Tensor loss;
    {
      TapeScope s(tape);
      loss = segmentation_loss(LossKind::BCE, single.forward(whole.images), whole.masks);
    }
    tape.backward(loss);
    opt->step();
    double mean_loss = 0;
    for (double l : dp_losses) mean_loss += l / N;
    CHECK(mean_loss == doctest::Approx(loss.item()).epsilon(1e-12));
    CHECK(max_rel_param_diff(dp.replica(0), single) < kParamTol);
    CHECK(replicas_identical(dp));
  }
  // Running statistics: those of the whole batch, on every replica (synchronized BN takes the
  // variance as E[x²] - mean², the single device in two passes: 1e-12 apart, measured).
  const auto s0 = dp.replica(1).state(), ss = single.state();
  for (size_t i = 0; i < ss.size(); ++i)
    if (!ss[i].is_parameter && ss[i].tensor.defined()) {
      CAPTURE(ss[i].name);
      CHECK(max_abs_diff(s0[i].tensor, ss[i].tensor) < 1e-10);
    }
  }
}

TEST_CASE("ps and ring all-reduce give the same parameters") {
  SyntheticSegmentation data(kImage, 11);
  std::vector<std::unique_ptr<DataParallel>> runs;
  for (AllReduceAlgo algo : {AllReduceAlgo::Ring, AllReduceAlgo::ParameterServer}) {
    DataParallelOptions o;
    o.devices = {Device::cpu(0), Device::cpu(1)};
    o.allreduce = algo;
    runs.push_back(std::make_unique<DataParallel>(small_model(), o, make_adam));
    for (int step = 0; step < 2; ++step) runs.back()->step(shards_for(data, step, 2, 2), LossKind::BCEDice);
  }
  // Two ranks: a + b either way, so the results are bit-identical.
  const auto a = runs[0]->replica(0).parameters(), b = runs[1]->replica(0).parameters();
  for (size_t i = 0; i < a.size(); ++i) CHECK(std::memcmp(a[i].raw(), b[i].raw(), a[i].nbytes()) == 0);
}

// --allreduce-precision bf16 on two replicas: each replica's gradient g_r is rounded to
// bfloat16 (error u·|g_r|), the two are added in float32 and rounded (u·|g0 + g1|), and halved
// exactly: the mean is within 2u(1 + u)·(|g0| + |g1|)/2 of (g0 + g1)/2, u = 2^-8 (+ 2^-24 for
// the float32 addition). g_r comes from a one-replica run on shard r from the same start.
TEST_CASE(
    "data parallel with bfloat16 all-reduce: gradients within two roundings of the exact mean, replicas identical") {
  SyntheticSegmentation data(kImage, 13);
  const auto shards = shards_for(data, 0, 2, 2);
  auto grads_of = [](DataParallel& dp) {
    std::vector<std::vector<double>> out;
    for (const Tensor& p : dp.replica(0).parameters()) out.push_back(p.grad().to_vector());
    return out;
  };
  std::vector<std::vector<std::vector<double>>> own;  // g_r, one replica on shard r
  for (int r = 0; r < 2; ++r) {
    DataParallelOptions o;
    o.devices = {Device::cpu(0)};
    DataParallel one(small_model(), o, make_sgd);
    one.step({shards[size_t(r)]}, LossKind::BCEDice);
    own.push_back(grads_of(one));
  }
  DataParallelOptions o;
  o.devices = {Device::cpu(0), Device::cpu(1)};
  o.bf16_allreduce = true;
  o.first_bucket_bytes = 4096;  // several buckets
  o.bucket_bytes = 64 << 10;
  DataParallel dp(small_model(), o, make_sgd);
  dp.step(shards, LossKind::BCEDice);
  const auto got = grads_of(dp);
  const double u = std::ldexp(1.0, -8) + std::ldexp(1.0, -24);
  double err2 = 0, norm2 = 0;
  int64_t checked = 0;
  for (size_t i = 0; i < got.size(); ++i)
    for (size_t k = 0; k < got[i].size(); ++k) {
      const double g0 = own[0][i][k], g1 = own[1][i][k], mean = (g0 + g1) / 2,
                   mag = (std::fabs(g0) + std::fabs(g1)) / 2;
      // The float64 gradients of one replica in the two runs agree to ~1e-12 (another thread
      // count may order a reduction differently): far below the bfloat16 bound.
      REQUIRE(std::fabs(got[i][k] - mean) <= 2 * u * (1 + u) * mag + 1e-12 * mag + 1e-300);
      // The mean really travelled in bfloat16: it is a bfloat16 value, widened.
      REQUIRE(double(bf16(got[i][k])) == got[i][k]);
      err2 += (got[i][k] - mean) * (got[i][k] - mean);
      norm2 += mean * mean;
      ++checked;
    }
  CHECK(checked > 1000);
  MESSAGE("bf16 all-reduce, 2 replicas: relative L2 error of the mean gradient ", std::sqrt(err2 / norm2));
  for (int step = 1; step < 3; ++step) dp.step(shards_for(data, step, 2, 2), LossKind::BCEDice);
  CHECK(replicas_identical(dp));
}

TEST_CASE("data parallel: the MPI library's all-reduce is refused for bfloat16 gradients, by name") {
  DataParallelOptions o;
  o.devices = {Device::cpu(0)};
  o.allreduce = AllReduceAlgo::Mpi;
  o.bf16_allreduce = true;
  CHECK_THROWS_WITH(DataParallel(small_model(), o, make_sgd), doctest::Contains("no bfloat16 sum"));
}

TEST_CASE("gradient buckets: the first bucket's all-reduce starts before backward ends") {
  SyntheticSegmentation data(kImage, 12);
  DataParallelOptions o;
  o.devices = {Device::cpu(0), Device::cpu(1)};
  o.record_events = true;
  o.first_bucket_bytes = 4096;
  o.bucket_bytes = 64 << 10;
  DataParallel dp(small_model(), o, make_adam);
  REQUIRE(dp.bucket_count() > 2);
  dp.step(shards_for(data, 0, 2, 2), LossKind::BCE);
  const auto ev = dp.events();
  auto first = std::find(ev.begin(), ev.end(), "allreduce bucket 0");
  REQUIRE(first != ev.end());
  size_t last_backward = 0;
  for (size_t i = 0; i < ev.size(); ++i)
    if (ev[i].rfind("backward ", 0) == 0) last_backward = i;
  CHECK(size_t(first - ev.begin()) < last_backward);
  // Buckets are issued in order on the rank.
  int expect = 0;
  for (const auto& e : ev)
    if (e.rfind("allreduce bucket ", 0) == 0) CHECK(e == "allreduce bucket " + std::to_string(expect++));
  CHECK(size_t(expect) == dp.bucket_count());
}

TEST_CASE("device lists: parsed once, checked by the data-parallel runtime without naming a flag") {
  CHECK(cli::parse_device_list("cpu:0,cpu:1,cpu:2").size() == 3);
  CHECK_THROWS_WITH(cli::parse_device_list(""), doctest::Contains("empty"));
  CHECK_THROWS_WITH(cli::parse_device_list("cpu:0,gpu:1"), doctest::Contains("bad device 'gpu:1'"));
  DataParallelOptions o;
  o.devices = {Device::cpu(0), Device::cpu(0)};
  CHECK_THROWS_WITH(DataParallel(small_model(), o, make_sgd), doctest::Contains("given twice"));
  o.devices = {Device::cpu(0), Device::cuda(0)};
  CHECK_THROWS_WITH(DataParallel(small_model(), o, make_sgd), doctest::Contains("all on CPU devices or all on GPUs"));
  try {
    DataParallel(small_model(), o, make_sgd);
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("--") == std::string::npos);
  }
}

TEST_CASE("CPU communicator: async all-reduces queue up while another group runs, abort frees waiters") {
  const int N = 3;
  auto grads = make_cpu_communicators(N, AllReduceAlgo::Ring);
  auto ctrl = make_cpu_communicators(N, AllReduceAlgo::Ring);
  std::vector<std::vector<Tensor>> bufs(N);
  std::vector<Tensor> side(N);
  for (int r = 0; r < N; ++r) {
    for (int k = 0; k < 4; ++k) bufs[r].push_back(Tensor::full({37 + k}, double(r + k), DType::F64));
    side[r] = Tensor::full({5}, double(r), DType::F64);
  }
  on_ranks(N, [&](int r) {
    std::vector<std::unique_ptr<Work>> work;
    for (auto& b : bufs[r]) work.push_back(grads[r]->all_reduce_async(b, ReduceOp::Sum));
    ctrl[r]->broadcast(side[r], 1);  // meanwhile, on the compute thread, the other group
    ctrl[r]->all_reduce(side[r], ReduceOp::Average);
    for (auto& w : work) w->wait();
  });
  for (int r = 0; r < N; ++r) {
    for (int k = 0; k < 4; ++k)
      CHECK(bufs[r][k].to_vector() == std::vector<double>(size_t(37 + k), double(3 * k + 3)));
    CHECK(side[r].to_vector() == std::vector<double>(5, 1.0));
  }
  // A rank that never arrives: abort releases the others with an error.
  auto comms = make_cpu_communicators(2, AllReduceAlgo::Ring);
  Tensor t = Tensor::zeros({8});
  std::thread waiter([&] {
    CHECK_THROWS_WITH(comms[0]->all_reduce(t, ReduceOp::Sum), doctest::Contains("aborted"));
  });
  // Time for the waiter to block in the all-reduce (were it late, the abort would stop it on
  // entry: the test still passes, proving less).
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  comms[1]->abort();
  waiter.join();
}

TEST_CASE("collective watchdog: a rank that never arrives times the group out, naming rank and collective") {
  // Rank 1 never joins rank 0's all-reduce (stuck elsewhere, or gone). With a 0.2 s timeout rank
  // 0 leaves with an error naming itself and the collective; rank 1's next collective fails
  // with the same cause instead of starting one nobody will finish. Both algorithms.
  for (AllReduceAlgo algo : {AllReduceAlgo::Ring, AllReduceAlgo::ParameterServer}) {
    auto comms = make_cpu_communicators(2, algo, 0.2);
    Tensor t = Tensor::zeros({8});
    std::string first;
    std::thread rank0([&] {
      try {
        comms[0]->all_reduce(t, ReduceOp::Sum);
      } catch (const Error& e) {
        first = e.what();
      }
    });
    rank0.join();
    CHECK(first.find("timed out") != std::string::npos);
    CHECK(first.find("rank 0") != std::string::npos);
    CHECK(first.find("all_reduce") != std::string::npos);
    CHECK_THROWS_WITH(comms[1]->broadcast(t, 0), doctest::Contains("rank 0 waited 0.2 s in all_reduce"));
    // The async path reports it through wait().
    auto work = comms[1]->all_reduce_async(t, ReduceOp::Sum);
    CHECK_THROWS_WITH(work->wait(), doctest::Contains("timed out"));
  }
  CHECK_THROWS_WITH(make_cpu_communicators(2, AllReduceAlgo::Ring, 0), doctest::Contains("timeout"));
}

TEST_CASE("collective watchdog: of three ranks, the two waiting fail with one cause") {
  // Rank 2 never arrives; ranks 0 and 1 both end, with the message of whichever timed out first.
  auto comms = make_cpu_communicators(3, AllReduceAlgo::Ring, 0.1);
  Tensor a = Tensor::zeros({4}), b = Tensor::zeros({4});
  std::string e0, e1;
  std::thread r0([&] {
    try { comms[0]->all_reduce(a, ReduceOp::Average); } catch (const Error& e) { e0 = e.what(); }
  });
  std::thread r1([&] {
    try { comms[1]->all_reduce(b, ReduceOp::Average); } catch (const Error& e) { e1 = e.what(); }
  });
  r0.join();
  r1.join();
  CHECK(e0.find("timed out") != std::string::npos);
  CHECK(e1.find("timed out") != std::string::npos);
  CHECK(e0 == e1);  // one cause, reported by every rank
}

TEST_CASE("data parallel: a failing rank ends the step with its own error, no rank hangs") {
  SyntheticSegmentation data(kImage, 13);
  DataParallelOptions o;
  o.devices = {Device::cpu(0), Device::cpu(1)};
  DataParallel dp(small_model(), o, make_sgd);
  auto shards = shards_for(data, 0, 2, 2);
  // Rank 1 gets masks of the wrong shape: its loss fails after the forward, while rank 0 goes
  // on into backward and its gradient buckets.
  shards[1].masks = Tensor::zeros({2, 1, kImage, kImage / 2}, DType::F64);
  CHECK_THROWS_WITH(dp.step(shards, LossKind::BCE), doctest::Contains("shape mismatch"));
}
