// Data parallelism over two GPUs through NCCL (parallel/nccl_communicator.cu): the collectives
// themselves, contract 4 (two replicas equal one GPU accumulating over the two shards), with
// synchronized batch norm (equal to one GPU on the whole batch), bfloat16 gradients, and the
// failure paths (a failing rank, a rank that never arrives). They need two GPUs: where fewer
// are visible they report themselves skipped (main.cpp); the CUDA emulator has two, and its
// NCCL (emulator/nccl.cpp) stops the run where the ranks disagree on a collective.
// The CPU twins are in tests/test_parallel.cpp.
#include <doctest/doctest.h>

#include <stdlib.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "data/synthetic.h"
#include "engine/optim.h"
#include "engine/tape.h"
#include "parallel/data_parallel.h"
#include "parallel/nccl_communicator.h"
#include "runtime/cuda_api.h"
#include "train/strategy.h"
#include "../steady_alloc.h"
#include "same_state.h"
#include "stream_gate.h"
#include "../small_models.h"

using namespace unetcu;
using unetcu::testing::same_bits;

namespace {

UNetConfig gpu_model() { return testing::small_unet(12, Device::cuda(0)); }

DataParallelOptions two_gpus() {
  DataParallelOptions o;
  o.devices = {Device::cuda(0), Device::cuda(1)};
  o.first_bucket_bytes = 4096;  // several buckets, each an NCCL all-reduce
  o.bucket_bytes = 64 << 10;
  return o;
}

std::unique_ptr<Optimizer> make_sgd(std::vector<Tensor> p) {
  SgdOptions o;
  o.lr = 0.1;
  o.momentum = 0.9;
  return std::make_unique<SGD>(std::move(p), o);
}

// Contract 6: every replica holds the same parameters, bit for bit.
bool replicas_identical(DataParallel& dp) {
  const auto a = dp.replica(0).parameters(), b = dp.replica(1).parameters();
  for (size_t i = 0; i < a.size(); ++i)
    if (!same_bits(a[i], b[i])) return false;
  return true;
}

// The largest |a - b| / max(|b|, 1e-3) over every element of two parameter lists.
double worst_rel(const std::vector<Tensor>& pa, const std::vector<Tensor>& pb) {
  double worst = 0;
  for (size_t i = 0; i < pa.size(); ++i) {
    const std::vector<double> a = pa[i].to_vector(), b = pb[i].to_vector();
    for (size_t k = 0; k < a.size(); ++k)
      worst = std::max(worst, std::isfinite(a[k]) ? std::fabs(a[k] - b[k]) / std::max(1e-3, std::fabs(b[k])) : INFINITY);
  }
  return worst;
}

// ||a - b|| / ||b|| over one tensor (an element near zero weighs as little as it counts).
double rel_l2(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_vector(), y = b.to_vector();
  double num = 0, den = 0;
  for (size_t k = 0; k < x.size(); ++k) {
    if (!std::isfinite(x[k])) return INFINITY;
    num += (x[k] - y[k]) * (x[k] - y[k]);
    den += y[k] * y[k];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

std::vector<Batch> shards(const SyntheticSegmentation& data, int step) {
  return {data.batch({4 * step, 4 * step + 1}), data.batch({4 * step + 2, 4 * step + 3})};
}

Tensor on_gpu(const Tensor& t, int d = 0) { return t.to(Device::cuda(d)); }

// Runs f(rank) on one thread per rank; rethrows the first error.
void on_ranks(int n, const std::function<void(int)>& f) {
  std::vector<std::thread> ts;
  std::vector<std::exception_ptr> errs{size_t(n)};
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        f(r);
      } catch (...) {
        errs[size_t(r)] = std::current_exception();
      }
    });
  for (auto& t : ts) t.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
}

}  // namespace

TEST_CASE("NCCL collectives over two GPUs: sums, averages, bfloat16, broadcast and reduce") {
  // Small integers (and halves), so every float32 and bfloat16 sum is exact.
  const int64_t n = 1000;
  const auto value = [](int r, int64_t i) { return double((r + 1) * 3 + (i % 11) - 5); };
  for (AllReduceAlgo algo : {AllReduceAlgo::Ring, AllReduceAlgo::ParameterServer}) {
    CAPTURE(int(algo));
    auto comms = make_nccl_communicators({0, 1}, algo);
    REQUIRE(comms.size() == 2);
    std::vector<std::vector<double>> sum(2), avg(2), low(2), bcast(2), red(2);
    on_ranks(2, [&](int r) {
      Communicator& c = *comms[size_t(r)];
      CHECK(c.rank() == r);
      CHECK(c.size() == 2);
      std::vector<double> v(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) v[size_t(i)] = value(r, i);
      Tensor s = on_gpu(Tensor::from_vector({n}, v).to(DType::F32), r);
      Tensor a = s.clone(), b = s.to(DType::BF16), x = s.clone(), y = s.clone();
      c.all_reduce(s, ReduceOp::Sum);
      c.all_reduce(a, ReduceOp::Average);
      c.all_reduce(b, ReduceOp::Sum);
      c.broadcast(x, 1);
      c.reduce(y, 0, ReduceOp::Sum);
      auto w = c.all_reduce_async(s, ReduceOp::Sum);  // twice the sum, on the communication stream
      w->wait();
      sum[size_t(r)] = s.to_vector();
      avg[size_t(r)] = a.to_vector();
      low[size_t(r)] = b.to_vector();
      bcast[size_t(r)] = x.to_vector();
      red[size_t(r)] = y.to_vector();
    });
    for (int r = 0; r < 2; ++r)
      for (int64_t i = 0; i < n; ++i) {
        const size_t k = size_t(i);
        const double total = value(0, i) + value(1, i);
        REQUIRE(sum[size_t(r)][k] == 2 * total);
        REQUIRE(avg[size_t(r)][k] == total / 2);
        REQUIRE(low[size_t(r)][k] == total);
        REQUIRE(bcast[size_t(r)][k] == value(1, i));
        REQUIRE(red[size_t(r)][k] == (r == 0 ? total : value(r, i)));  // only the root's changes
      }
  }
}

TEST_CASE("contract 4 on two GPUs: data parallelism equals one GPU accumulating over the two shards") {
  SyntheticSegmentation data(64, 21);
  for (AllReduceAlgo algo : {AllReduceAlgo::Ring, AllReduceAlgo::ParameterServer}) {
    CAPTURE(int(algo));
    DataParallelOptions o = two_gpus();
    o.allreduce = algo;
    DataParallel dp(gpu_model(), o, make_sgd);
    CHECK(dp.bucket_count() > 2);
    UNet single(gpu_model());
    auto opt = make_sgd(single.parameters());
    for (int step = 0; step < 2; ++step) {
      CAPTURE(step);
      const auto parts = shards(data, step);
      const std::vector<double> dp_losses = dp.step(parts, LossKind::BCEDice);
      opt->zero_grad();
      double single_loss = 0;
      for (const Batch& b : parts) {
        Tape tape;
        Tensor loss;
        {
          TapeScope s(tape);
          loss = scale(segmentation_loss(LossKind::BCEDice, single.forward(on_gpu(b.images)), on_gpu(b.masks)), 0.5);
        }
        single_loss += loss.item();
        tape.backward(loss);
      }
      opt->step();
      // The same kernels on both GPUs (deterministic algorithms): the shards' gradients are
      // the single GPU's, and the average of two adds them once, as its accumulation does; the
      // bound is float32 rounding.
      const double dp_mean = (dp_losses[0] + dp_losses[1]) / 2;
      CHECK(std::fabs(dp_mean - single_loss) <= 1e-5 * std::fabs(single_loss));
      CHECK(worst_rel(dp.replica(0).parameters(), single.parameters()) < 1e-5);
      CHECK(replicas_identical(dp));
    }
  }
}

TEST_CASE("synchronized batch norm on two GPUs: data parallelism over 2 x 2 equals one GPU on the batch of 4") {
  // BCE is a mean over pixels, so the mean of the replicas' losses is the whole batch's. Two
  // batch-norm implementations in float32 (the synchronized kernels, the single GPU's), whose
  // results differ by rounding: where a ReLU's input lies within that rounding of zero the two
  // runs branch differently (a few runs in ten), and every gradient before it moves by about
  // 1/sqrt(elements) of its norm (up to 2e-2 measured, float32 against float64). The forward
  // (loss, running statistics) and the head's gradient, after the last ReLU, hold to float32
  // rounding (1e-4 through the network); the other gradients, compared from the same
  // parameters, to that branch's bound (5e-2), which statistics of one shard instead of the
  // batch, or an unreduced gradient term, exceed many times over.
  SyntheticSegmentation data(64, 22);
  DataParallelOptions o = two_gpus();
  o.sync_bn = true;
  DataParallel dp(gpu_model(), o, make_sgd);
  UNet single(gpu_model());
  auto opt = make_sgd(single.parameters());
  std::vector<std::string> names;
  for (const StateEntry& e : single.state())
    if (e.is_parameter) names.push_back(e.name);
  REQUIRE(names.size() == single.parameters().size());
  for (int step = 0; step < 2; ++step) {
    CAPTURE(step);
    const auto parts = shards(data, step);
    const auto dp_losses = dp.step(parts, LossKind::BCE);
    const Batch whole = data.batch({4 * step, 4 * step + 1, 4 * step + 2, 4 * step + 3});
    opt->zero_grad();
    Tape tape;
    Tensor loss;
    {
      TapeScope s(tape);
      loss = segmentation_loss(LossKind::BCE, single.forward(on_gpu(whole.images)), on_gpu(whole.masks));
    }
    tape.backward(loss);
    CHECK(std::fabs((dp_losses[0] + dp_losses[1]) / 2 - loss.item()) <= 1e-4 * std::fabs(loss.item()));
    if (step == 0) {  // the same parameters: the gradients (after a step they differ by rounding)
      const auto pd = dp.replica(0).parameters(), ps = single.parameters();
      // Each tensor's error against its norm, or against the model's gradient RMS where its
      // norm is smaller (a batch-norm bias's gradient is a sum over the batch that may cancel).
      double sum2 = 0;
      int64_t count = 0;
      for (const Tensor& p : ps)
        for (double g : p.grad().to_vector()) sum2 += g * g, ++count;
      const double rms = std::sqrt(sum2 / double(count));
      double worst = 0;
      int heads = 0;
      for (size_t i = 0; i < ps.size(); ++i) {
        CAPTURE(names[i]);
        const std::vector<double> a = pd[i].grad().to_vector(), b = ps[i].grad().to_vector();
        double num = 0, den = 0;
        for (size_t k = 0; k < a.size(); ++k) num += (a[k] - b[k]) * (a[k] - b[k]), den += b[k] * b[k];
        const double e = std::sqrt(num) / std::max(std::sqrt(den), std::sqrt(double(a.size())) * rms);
        worst = std::max(worst, e);
        CHECK(e < 5e-2);
        if (names[i].rfind("segmentation_head", 0) == 0) {
          ++heads;
          CHECK(e < 1e-4);
        }
      }
      CHECK(heads == 2);  // its weight and bias
      MESSAGE("largest gradient error ", worst);
    }
    opt->step();
    CHECK(replicas_identical(dp));
  }
  // The running statistics: the whole batch's, on both replicas (the norm of each buffer's
  // error, as the one-rank case: a mean near zero carries the float32 error of its inputs'
  // magnitude, not its own).
  const auto s1 = dp.replica(1).state(), ss = single.state();
  REQUIRE(s1.size() == ss.size());
  for (size_t i = 0; i < ss.size(); ++i)
    if (!ss[i].is_parameter && ss[i].tensor.defined()) {
      CAPTURE(ss[i].name);
      CHECK(rel_l2(s1[i].tensor, ss[i].tensor) < 1e-4);
    }
}

// Two replicas' gradients g0, g1 (a single GPU's, on each shard) rounded to bfloat16, added in
// float32 and rounded, halved exactly: within 2u(1 + u)(|g0| + |g1|)/2 of the mean, u = 2^-8,
// plus float32 noise of the two runs (1e-5 of the tensor's largest gradient).
TEST_CASE("bfloat16 all-reduce on two GPUs: gradients within two roundings of the exact mean, replicas identical") {
  SyntheticSegmentation data(64, 23);
  const auto parts = shards(data, 0);
  std::vector<std::vector<std::vector<double>>> own;
  for (const Batch& b : parts) {
    UNet one(gpu_model());
    Tape tape;
    Tensor loss;
    {
      TapeScope s(tape);
      loss = segmentation_loss(LossKind::BCEDice, one.forward(on_gpu(b.images)), on_gpu(b.masks));
    }
    tape.backward(loss);
    std::vector<std::vector<double>> g;
    for (const Tensor& p : one.parameters()) g.push_back(p.grad().to_vector());
    own.push_back(std::move(g));
  }
  DataParallelOptions o = two_gpus();
  o.bf16_allreduce = true;
  DataParallel dp(gpu_model(), o, make_sgd);
  dp.step(parts, LossKind::BCEDice);
  const double u = std::ldexp(1.0, -8);
  int64_t bad = 0, checked = 0;
  const auto params = dp.replica(0).parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::vector<double> got = params[i].grad().to_vector();
    double top = 0;
    for (size_t k = 0; k < got.size(); ++k) top = std::max({top, std::fabs(own[0][i][k]), std::fabs(own[1][i][k])});
    for (size_t k = 0; k < got.size(); ++k, ++checked) {
      const double g0 = own[0][i][k], g1 = own[1][i][k];
      const double bound = 2 * u * (1 + u) * (std::fabs(g0) + std::fabs(g1)) / 2 + 1e-5 * top;
      const bool travelled_bf16 = double(bf16(got[k])) == got[k];
      bad += !(std::fabs(got[k] - (g0 + g1) / 2) <= bound && travelled_bf16);
    }
  }
  CHECK(checked > 1000);
  CHECK(bad == 0);
  dp.step(shards(data, 1), LossKind::BCEDice);
  CHECK(replicas_identical(dp));
}

TEST_CASE("data parallelism on two GPUs: a failing rank ends the step with its own error, no rank hangs") {
  SyntheticSegmentation data(64, 24);
  DataParallel dp(gpu_model(), two_gpus(), make_sgd);
  auto parts = shards(data, 0);
  // Rank 1's masks have the wrong shape: its loss fails after the forward, while rank 0 goes
  // on into backward and queues its buckets' all-reduces, which rank 1 never joins.
  parts[1].masks = Tensor::zeros({2, 1, 64, 32}, parts[1].masks.dtype());
  CHECK_THROWS_WITH(dp.step(parts, LossKind::BCE), doctest::Contains("shape mismatch"));
  // The group is aborted: a further step fails at once, with why.
  CHECK_THROWS_WITH(dp.step(shards(data, 1), LossKind::BCE), doctest::Contains("another rank failed"));
}

TEST_CASE("NCCL watchdog on two GPUs: a rank that never arrives times the group out, naming rank and collective") {
  auto comms = make_nccl_communicators({0, 1}, AllReduceAlgo::Ring, 0.5);
  Tensor t = Tensor::full({64}, 1.0, DType::F32, Device::cuda(0));
  comms[0]->all_reduce(t, ReduceOp::Sum);  // rank 1 never calls its part
  // The watchdog aborts the group within the timeout plus a poll; every later call says why.
  bool failed = false;
  for (int i = 0; i < 100 && !failed; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    try {
      comms[0]->all_reduce(t, ReduceOp::Sum);
    } catch (const Error& e) {
      failed = true;
      CHECK(std::string(e.what()).find("collective timed out: rank 0's all_reduce") != std::string::npos);
    }
  }
  CHECK(failed);
  Tensor t1 = Tensor::full({64}, 1.0, DType::F32, Device::cuda(1));
  CHECK_THROWS_WITH(comms[1]->broadcast(t1, 0), doctest::Contains("collective timed out"));
  cuda::synchronize(0);  // the aborted all-reduce has left the stream
}

// ---- CUDA graphs ------------------------------------------------------------------------------

namespace {

// Puts NCCL_COMM_ID back as it was, however the case ends.
struct CommIdGuard {
  CommIdGuard() {
    if (const char* v = std::getenv("NCCL_COMM_ID")) had = v;
  }
  ~CommIdGuard() {
    if (!had.empty()) setenv("NCCL_COMM_ID", had.c_str(), 1);
    else unsetenv("NCCL_COMM_ID");
  }
  std::string had;
};

UNetConfig graph_model(bool mixed) {
  UNetConfig c = gpu_model();
  c.bf16_activations = mixed;
  c.format = mixed ? MemoryFormat::NHWC : MemoryFormat::NCHW;
  return c;
}

// Both runs' replicas: parameters, batch-norm running statistics and their counts, the same bits.
void check_same_replicas(DataParallel& eager, DataParallel& graph) {
  for (int r = 0; r < eager.size(); ++r) {
    CAPTURE(r);
    testing::check_same_state(eager.replica(r), graph.replica(r));
  }
}

// One replica, eager and with graphs, over 5 steps of two samples (2 eager, the capture, 2
// replays): the same losses and state, bit for bit.
void check_one_replica_graph(DataParallel& eager, DataParallel& graph, const SyntheticSegmentation& data) {
  for (int k = 0; k < 5; ++k) {
    CAPTURE(k);
    const std::vector<Batch> parts = {data.batch({2 * (k % 2), 2 * (k % 2) + 1})};
    const auto le = eager.step(parts, LossKind::BCEDice), lg = graph.step(parts, LossKind::BCEDice);
    CHECK(std::memcmp(&le[0], &lg[0], sizeof(double)) == 0);
  }
  CHECK(graph.graph_replays() == 3);
  check_same_replicas(eager, graph);
}

}  // namespace

namespace {

// Each replica's step up to the optimizer, its NCCL all-reduces on the communication stream
// included, captured on its compute stream; replays pair up across the GPUs as the eager
// collectives do. Steps: 2 eager, the capture and its first replay, replays on new data, a
// short batch (eager) between replays.
struct GraphVariant {
  AllReduceAlgo algo;
  bool sync_bn, bf16_grads, mixed;
  int64_t accumulate_rows;
};

void dp_graph_equals_eager(const GraphVariant& v) {
  CAPTURE(int(v.algo));
  CAPTURE(v.sync_bn);
  CAPTURE(v.accumulate_rows);
  SyntheticSegmentation data(64, 25);
  const std::vector<int> order = {0, 1, 0, 1, -1, 0, 1};  // -1: one sample per replica
  DataParallelOptions o = two_gpus();
  o.allreduce = v.algo;
  o.sync_bn = v.sync_bn;
  o.bf16_allreduce = v.bf16_grads;
  o.accumulate_rows = v.accumulate_rows;
  DataParallelOptions og = o;
  og.cuda_graphs = true;
  DataParallel eager(graph_model(v.mixed), o, make_sgd), graph(graph_model(v.mixed), og, make_sgd);
  int64_t replays = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    CAPTURE(k);
    const std::vector<Batch> parts = order[k] < 0 ? std::vector<Batch>{data.batch({8}), data.batch({9})}
                                                   : shards(data, order[k]);
    const auto le = eager.step(parts, LossKind::BCEDice), lg = graph.step(parts, LossKind::BCEDice);
    for (int r = 0; r < 2; ++r) CHECK(std::memcmp(&le[size_t(r)], &lg[size_t(r)], sizeof(double)) == 0);
    CHECK(graph.graph_captured() == (k >= 2));
    if (k >= 2 && order[k] >= 0) ++replays;
    CHECK(graph.graph_replays() == replays);
  }
  CHECK(graph.uses_cuda_graphs());
  check_same_replicas(eager, graph);
  CHECK(replicas_identical(graph));
}

}  // namespace

// A case per variant, each under the per-test time bound on the emulator.
TEST_CASE("data parallelism on two GPUs replayed as a CUDA graph equals the eager step, bit for bit: ring, float32") {
  dp_graph_equals_eager({AllReduceAlgo::Ring, false, false, false, 0});
}
TEST_CASE("data parallelism on two GPUs replayed as a CUDA graph equals the eager step, bit for bit: ps, synchronized BN, bf16") {
  dp_graph_equals_eager({AllReduceAlgo::ParameterServer, true, true, true, 0});
}
// Accumulating: each replica's shard of 2 in chunks of 1, both chunks in the graph (with
// synchronized BN: each chunk's statistics collectives), the gradient all-reduces in the
// second's backward.
TEST_CASE("data parallelism on two GPUs replayed as a CUDA graph equals the eager step, bit for bit: accumulated chunks") {
  dp_graph_equals_eager({AllReduceAlgo::Ring, true, false, true, 1});
}

TEST_CASE("data parallelism with one GPU rank replayed as a CUDA graph equals the eager step, bit for bit") {
  // The in-process NCCL group of one (the two-GPU case above where one GPU is visible):
  // synchronized BN and bfloat16 gradients, so both groups' collectives are in the graph; then
  // the same with gradient accumulation.
  SyntheticSegmentation data(64, 29);
  DataParallelOptions o;
  o.devices = {Device::cuda(0)};
  o.first_bucket_bytes = 4096;
  o.bucket_bytes = 64 << 10;
  o.sync_bn = true;
  o.bf16_allreduce = true;
  DataParallelOptions og = o;
  og.cuda_graphs = true;
  DataParallel eager(graph_model(true), o, make_sgd), graph(graph_model(true), og, make_sgd);
  check_one_replica_graph(eager, graph, data);
  {
    // Accumulated chunks: shards of 2 in chunks of 1, both chunks' forwards and backwards in
    // the one graph.
    o.accumulate_rows = og.accumulate_rows = 1;
    DataParallel eager1(graph_model(true), o, make_sgd), graph1(graph_model(true), og, make_sgd);
    check_one_replica_graph(eager1, graph1, data);
  }
}

TEST_CASE("a data-parallel step on two GPUs replayed as a CUDA graph takes no GPU memory from the system") {
  SyntheticSegmentation data(64, 26);
  const Batch b = data.batch({0, 1, 2, 3});
  DataParallelOptions o = two_gpus();
  o.cuda_graphs = true;
  DataParallelStrategy s(graph_model(true), o, optimizer_factory({}), LossKind::BCEDice);
  CHECK(s.describe().find("CUDA graphs") != std::string::npos);
  CHECK(testing::system_allocations_after_warmup(s, b, 4, 5, [] {
          return cuda::device_memory_stats(0).system_allocations + cuda::device_memory_stats(1).system_allocations;
        }) == 0);
  CHECK(s.data_parallel().graph_captured());
}

#ifdef UNETCU_CUDA_EMU
TEST_CASE("a data-parallel capture refused on one GPU: both replicas go on eagerly, with the eager bits") {
  // The CUDA emulator refuses the N-th node of the captures on cuda:1 only
  // (UNETCU_EMU_FAIL_CAPTURE_AT, _DEVICE): rank 0's capture succeeds, rank 1's fails, and both
  // go on eagerly over new communicators (NCCL requires every rank's capture of a collective
  // to be alike, so the old ones are not used again); nothing captured may have run.
  struct Unset {
    ~Unset() {
      unsetenv("UNETCU_EMU_FAIL_CAPTURE_AT");
      unsetenv("UNETCU_EMU_FAIL_CAPTURE_DEVICE");
    }
  } unset;
  SyntheticSegmentation data(64, 27);
  setenv("UNETCU_EMU_FAIL_CAPTURE_DEVICE", "1", 1);
  for (const char* at : {"1", "60"}) {
    CAPTURE(at);
    setenv("UNETCU_EMU_FAIL_CAPTURE_AT", at, 1);
    DataParallelOptions o = two_gpus(), og = two_gpus();
    og.cuda_graphs = true;
    DataParallel eager(gpu_model(), o, make_sgd), graph(gpu_model(), og, make_sgd);
    for (int k = 0; k < 5; ++k) {
      CAPTURE(k);
      const auto parts = shards(data, k % 2);
      const auto le = eager.step(parts, LossKind::BCEDice), lg = graph.step(parts, LossKind::BCEDice);
      for (int r = 0; r < 2; ++r) CHECK(std::memcmp(&le[size_t(r)], &lg[size_t(r)], sizeof(double)) == 0);
    }
    CHECK(graph.graph_capture_failures() == 1);  // cuda:0's capture succeeded
    CHECK_FALSE(graph.graph_captured());
    CHECK_FALSE(graph.uses_cuda_graphs());
    CHECK(graph.graph_replays() == 0);
    check_same_replicas(eager, graph);
  }
}
#endif

TEST_CASE("data parallelism as one launched process replayed as a CUDA graph equals the eager step") {
  // The NCCL rank made for processes (NCCL_COMM_ID, a group of one): its capture agrees with
  // the other processes' through the control group.
  CommIdGuard keep;
  SyntheticSegmentation data(64, 28);
  DataParallelOptions o;
  o.devices = {Device::cuda(0)};
  o.across_processes = true;
  DataParallelOptions og = o;
  og.cuda_graphs = true;
  setenv("NCCL_COMM_ID", "127.0.0.1:29564", 1);  // a rendezvous of its own for each job
  DataParallel eager(gpu_model(), o, make_sgd);
  setenv("NCCL_COMM_ID", "127.0.0.1:29565", 1);
  DataParallel graph(gpu_model(), og, make_sgd);
  check_one_replica_graph(eager, graph, data);
}

namespace {

// Both GPUs' compute streams (this thread's) wait for their gates.
void hold_compute_streams(testing::StreamGate (&gates)[2], const cuda::Stream (&side)[2]) {
  for (int d = 0; d < 2; ++d) {
    gates[d].hold(side[d]);
    cuda::Event held(d);
    held.record(side[d].get());
    held.wait(d);
  }
}

}  // namespace

TEST_CASE("a data-parallel step on two GPUs returns before its work has run, its loss read late the waited step's") {
  // The epoch loop queues step s, places batch s+1 (its upload then runs beside step s) and
  // reads step s's loss after that, so the step itself may not wait for the GPUs. Here both
  // compute streams are held behind a gate while two steps are queued: a step that waited for
  // its work would return only once the safeguard opened the gates, after 120 s. Eagerly and
  // replayed as a CUDA graph (captured at the third step; the graph's loss tensor is rewritten
  // by each replay, so the second queued step must not change the first's loss).
  SyntheticSegmentation data(64, 31);
  const Batch a = data.batch({0, 1, 2, 3}), b = data.batch({4, 5, 6, 7});
  const std::vector<const Batch*> order = {&a, &b, &a, &b, &a};  // the last two queued held
  for (const bool graphs : {false, true}) {
    CAPTURE(graphs);
    DataParallelOptions o = two_gpus();
    o.cuda_graphs = graphs;
    DataParallelStrategy now(gpu_model(), o, optimizer_factory({}), LossKind::BCEDice);
    std::vector<double> want;
    for (const Batch* x : order) want.push_back(now.step(now.place(*x)));

    DataParallelStrategy late(gpu_model(), o, optimizer_factory({}), LossKind::BCEDice);
    // cuDNN's algorithm search and the capture wait for the devices: not held.
    for (size_t k = 0; k < 3; ++k) CHECK(late.step(late.place(*order[k])) == want[k]);
    const PlacedBatch third = late.place(*order[3]), fourth = late.place(*order[4]);
    testing::StreamGate gates[2];  // outlive the streams (their host functions)
    const cuda::Stream side[2] = {cuda::Stream(0), cuda::Stream(1)};
    testing::OpenAtExit open0{gates[0]}, open1{gates[1]};
    hold_compute_streams(gates, side);
    StepLoss l3, l4;
    bool returned_while_held = false;
    {
      testing::Safeguard safeguard({&gates[0], &gates[1]}, 120);
      l3 = late.step_async(third);
      l4 = late.step_async(fourth);
      returned_while_held = !gates[0].open && !gates[1].open;
    }
    CHECK(returned_while_held);
    CHECK(l3.get() == want[3]);  // the same kernels on the same data: the same bits
    CHECK(l4.get() == want[4]);
    testing::check_same_state(now.model(), late.model());
    if (graphs) CHECK(late.data_parallel().graph_replays() == 3);
  }
}

TEST_CASE("a data-parallel loss read late on two GPUs after the group was aborted throws the reason, not a number") {
  // A rank that fails (or the watchdog's timeout) aborts the communicators while a step's
  // collectives are still queued: they end without their results, and the loss copied behind
  // them is not the step's.
  SyntheticSegmentation data(64, 32);
  DataParallelStrategy s(gpu_model(), two_gpus(), optimizer_factory({}), LossKind::BCEDice);
  s.step(s.place(data.batch({0, 1, 2, 3})));
  const PlacedBatch next = s.place(data.batch({4, 5, 6, 7}));
  testing::StreamGate gates[2];
  const cuda::Stream side[2] = {cuda::Stream(0), cuda::Stream(1)};
  testing::OpenAtExit open0{gates[0]}, open1{gates[1]};
  hold_compute_streams(gates, side);
  StepLoss loss;
  {
    testing::Safeguard safeguard({&gates[0], &gates[1]}, 120);
    loss = s.step_async(next);
    // A failure on rank 1's thread: run() aborts every communicator and rethrows it.
    CHECK_THROWS_WITH_AS(s.data_parallel().run([](int r) {
      if (r == 1) throw Error("rank 1 stopped");
    }),
                         "rank 1 stopped", Error);
  }
  CHECK_THROWS_WITH_AS(loss.get(), doctest::Contains("collective aborted: another rank failed"), Error);
}
