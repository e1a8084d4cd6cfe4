// The profiler: totals, conv FLOP counts, the Chrome trace.
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <map>
#include <set>

#include "data/synthetic.h"
#include "engine/profiler.h"
#include "engine/tape.h"
#include "models/unet.h"
#include "parallel/data_parallel.h"
#include "testing.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {
struct ProfilerOn {
  ProfilerOn() {
    Profiler::reset();
    Profiler::enable(true);
  }
  ~ProfilerOn() { Profiler::enable(false); }
};
}  // namespace

TEST_CASE("profiler: per-op and per-block totals are the sums of their ranges") {
  UNetConfig c;
  c.width_divisor = 16;
  UNet model(c);
  SyntheticSegmentation data(64, 1);
  const Batch b = data.batch({0, 1});
  {
    ProfilerOn on;
    Tape tape;
    Tensor loss;
    {
      TapeScope s(tape);
      loss = segmentation_loss(LossKind::BCEDice, model.forward(b.images), b.masks);
    }
    tape.backward(loss);
  }
  const auto recs = Profiler::records();
  REQUIRE(recs.size() > 100);
  std::map<std::string, double> us, flops;
  std::map<std::string, int64_t> calls;
  double all_ops = 0;
  for (const auto& r : recs) {
    if (r.category == "block") continue;
    us[r.name] += r.duration_us;
    flops[r.name] += r.flops;
    ++calls[r.name];
    all_ops += r.duration_us;
  }
  const auto ops = Profiler::totals_by_op(recs);
  CHECK(ops.size() == us.size());
  double sum_ops = 0;
  for (const auto& [name, t] : ops) {
    CAPTURE(name);
    CHECK(t.us == doctest::Approx(us[name]).epsilon(1e-12));
    CHECK(t.flops == flops[name]);
    CHECK(t.calls == calls[name]);
    sum_ops += t.us;
  }
  double sum_blocks = 0;
  for (const auto& [name, t] : Profiler::totals_by_block(recs)) sum_blocks += t.us;
  CHECK(sum_ops == doctest::Approx(all_ops).epsilon(1e-12));
  CHECK(sum_blocks == doctest::Approx(all_ops).epsilon(1e-12));
  // Forward and backward of every block appear, and each conv's backward was timed.
  const auto blocks = Profiler::totals_by_block(recs);
  CHECK(blocks.count("encoder.layer2 forward") == 1);
  CHECK(blocks.count("decoder.blocks.1 backward") == 1);
  CHECK(calls["conv2d.backward"] == calls["conv2d"]);
  CHECK(Profiler::summary().find("| conv2d |") != std::string::npos);
  // Off: nothing is recorded.
  Profiler::reset();
  model.forward(b.images);
  CHECK(Profiler::records().empty());
}

TEST_CASE("profiler: conv FLOPs match 2 N O OH OW C kh kw (+ bias) for odd shapes") {
  struct Case {
    Shape x, w;
    int stride, pad;
    bool bias;
  };
  const Case cases[] = {{{3, 5, 13, 9}, {7, 5, 3, 3}, 2, 1, true},
                        {{2, 3, 11, 17}, {4, 3, 7, 7}, 2, 3, false},
                        {{1, 6, 5, 7}, {2, 6, 1, 1}, 1, 0, true}};
  Rng rng(3);
  for (const Case& c : cases) {
    Tensor x = random_tensor(c.x, rng), w = random_tensor(c.w, rng);
    Tensor b = c.bias ? random_tensor({c.w[0]}, rng) : Tensor();
    {
      ProfilerOn on;
      conv2d(x, w, b, c.stride, c.pad);
    }
    const auto recs = Profiler::records();
    REQUIRE(recs.size() == 1);
    const int64_t OH = (c.x[2] + 2 * c.pad - c.w[2]) / c.stride + 1;
    const int64_t OW = (c.x[3] + 2 * c.pad - c.w[3]) / c.stride + 1;
    const double outputs = double(c.x[0] * c.w[0] * OH * OW);
    CHECK(recs[0].name == "conv2d");
    CHECK(recs[0].flops == 2 * outputs * double(c.w[1] * c.w[2] * c.w[3]) + (c.bias ? outputs : 0));
    CHECK(recs[0].bytes == double(x.nbytes() + w.nbytes() + (c.bias ? b.nbytes() : 0)) +
                               outputs * sizeof(double));
  }
}

TEST_CASE("profiler: the trace is valid JSON with one track per device thread and communication") {
  UNetConfig c;
  c.width_divisor = 16;
  DataParallelOptions o;
  o.devices = {Device::cpu(0), Device::cpu(1)};
  DataParallel dp(c, o, [](std::vector<Tensor> p) { return std::unique_ptr<Optimizer>(new Adam(std::move(p))); });
  SyntheticSegmentation data(64, 2);
  const std::vector<Batch> shards = {data.batch({0, 1}), data.batch({2, 3})};
  const std::string path = "profiler_test_trace.json";
  {
    ProfilerOn on;
    dp.step(shards, LossKind::BCE);
  }
  Profiler::write_trace(path);
  std::ifstream in(path);
  const nlohmann::json trace = nlohmann::json::parse(in);  // throws if not valid JSON
  std::remove(path.c_str());
  std::map<int, std::string> track_of;
  std::set<std::string> names;
  for (const auto& e : trace.at("traceEvents"))
    if (e.at("ph") == "M") {
      CHECK(track_of.count(e.at("tid").get<int>()) == 0);  // one name per track
      track_of[e.at("tid").get<int>()] = e.at("args").at("name").get<std::string>();
      CHECK(names.insert(track_of[e.at("tid").get<int>()]).second);  // one track per name
    }
  int comm = 0, ops = 0;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    REQUIRE(track_of.count(e.at("tid").get<int>()) == 1);
    CHECK(e.at("dur").get<double>() >= 0);
    comm += e.at("cat") == "comm";
    ops += e.at("cat") == "op";
  }
  CHECK(names.count("cpu:0 compute replica 0") == 1);
  CHECK(names.count("cpu:1 compute replica 1") == 1);
  CHECK(names.count("rank 0 comm") == 1);
  CHECK(names.count("rank 1 comm") == 1);
  CHECK(comm >= 2);
  CHECK(ops > 50);
}
