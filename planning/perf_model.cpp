#include "planning/perf_model.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <thread>
#include <unistd.h>

#include "engine/tape.h"
#include "parallel/communicator.h"
#include "parallel/data_parallel.h"
#include "parallel/worker_pool.h"
#include "runtime/cuda_api.h"

namespace unetcu {

const std::vector<LinkPreset>& link_presets() {
  static const std::vector<LinkPreset> p = {{"pcie3", 12.6e9, 10e-6},
                                            {"pcie4", 25.2e9, 8e-6},
                                            {"pcie5", 50.4e9, 6e-6},
                                            {"nvlink4", 360e9, 3e-6},
                                            {"ib-ndr", 40e9, 2e-6},     // 400 Gb/s = 50 GB/s
                                            {"ib-hdr", 20e9, 2e-6},     // 200 Gb/s = 25 GB/s
                                            {"eth-100g", 10e9, 5e-6},   // 12.5 GB/s, RoCE
                                            {"eth-25g", 2.5e9, 25e-6}};  // 3.125 GB/s, TCP
  return p;
}

LinkModel link_by_name(const std::string& name) {
  for (const auto& p : link_presets())
    if (name == p.name) return {p.bandwidth, p.latency};
  const auto comma = name.find(',');
  try {
    if (comma != std::string::npos)
      return {std::stod(name.substr(0, comma)) * 1e9, std::stod(name.substr(comma + 1)) * 1e-6};
  } catch (const std::exception&) {
  }
  std::string names;
  for (const auto& p : link_presets()) names += std::string(p.name) + ", ";
  throw Error("unknown link '" + name + "' (" + names + "or \"<GB/s>,<us>\")");
}

double allreduce_seconds(double bytes, int n, AllReduceAlgo algo, const LinkModel& link) {
  if (n <= 1) return 0;
  // Ring (and MPI's own all-reduce, a ring or better at these sizes): reduce-scatter +
  // all-gather, 2(N-1) steps of S/N.
  if (algo != AllReduceAlgo::ParameterServer)
    return 2.0 * (n - 1) / n * bytes / link.bandwidth + 2.0 * (n - 1) * link.latency;
  // PS: rank 0 receives N-1 buffers, then sends N-1 back, over its one link
  return 2.0 * (n - 1) * bytes / link.bandwidth + 2.0 * link.latency;
}

LinkModel link_from_allreduce(double small_s, double large_s, double bytes, int n, AllReduceAlgo algo) {
  UNETCU_CHECK(n >= 2 && bytes > 0 && small_s >= 0 && large_s >= 0,
               "link_from_allreduce: need two ranks, a size and two measured times");
  LinkModel l;
  const bool ps = algo == AllReduceAlgo::ParameterServer;
  // ring: t = 2(N-1)/N S/B + 2(N-1) L; ps: t = 2(N-1) S/B + 2 L (the small one: S ~ 0)
  l.latency = small_s / (ps ? 2.0 : 2.0 * (n - 1));
  // A large all-reduce no slower than the small one (timing noise on a loaded machine, where
  // the small one's wake-ups dominate): the bytes cost less than the timer resolves, taken as
  // 1 ps in all, as the other measured links clamp.
  const double per_byte = std::max(large_s - small_s, 1e-12) / bytes;
  l.bandwidth = (ps ? 2.0 * (n - 1) : 2.0 * (n - 1) / n) / per_byte;
  return l;
}

namespace {

// Forward and backward of every block on b samples, each at its per-sample time at b.
void block_seconds(const std::vector<BlockProfile>& blocks, int b, bool shared, double& f, double& bw) {
  f = bw = 0;
  for (const auto& bl : blocks) {
    const double s = shared ? bl.shared_slowdown : 1.0;
    f += b * forward_per_sample(bl, b) * s;
    bw += b * backward_per_sample(bl, b) * s;
  }
}

}  // namespace

double single_step_seconds(const std::vector<BlockProfile>& blocks, int batch, const StepCosts& costs) {
  double f, b;
  block_seconds(blocks, batch, false, f, b);
  return f + b + costs.optimizer_s;
}

double concurrent_seconds(std::vector<double> work, double slowdown) {
  // The shortest finish first; until then all still running share the slowdown.
  std::sort(work.begin(), work.end());
  const int N = int(work.size());
  double t = 0, done = 0;
  for (int i = 0; i < N; ++i) {
    const int k = N - i;  // running
    const double rate = 1.0 / (N > 1 ? 1 + (slowdown - 1) * (k - 1) / (N - 1) : 1.0);
    t += (work[i] - done) / rate;
    done = work[i];
  }
  return t;
}

DpPrediction predict_dp(const std::vector<BlockProfile>& blocks, double param_bytes, int n,
                        int batch, AllReduceAlgo algo, const LinkModel& link, double bucket_bytes,
                        double loader, const StepCosts& costs) {
  double tf, tb;
  block_seconds(blocks, batch, n > 1, tf, tb);
  const int k = std::max(1, int(std::ceil(param_bytes / bucket_bytes)));
  const double per_bucket = allreduce_seconds(param_bytes / k, n, algo, link);
  // The buckets become ready through backward; the communication runs one bucket after the
  // other and cannot finish before the last bucket (ready at the end) is reduced. On cores
  // that compute it cannot overlap: it adds.
  const double comm_end = costs.comm_overlaps_compute ? std::max(tb + per_bucket, tb / k + k * per_bucket)
                                                      : tb + k * per_bucket;
  const double extra = n > 1 ? costs.grad_zero_s + costs.bn_broadcast_s + costs.optimizer_s * costs.optimizer_slowdown
                             : costs.optimizer_s;
  double step = tf + (n > 1 ? comm_end : tb) + extra;
  double single = single_step_seconds(blocks, batch, costs);
  if (loader > 0) {
    step = std::max(step, double(n) * batch / loader);
    single = std::max(single, double(batch) / loader);
  }
  return {tf + tb, k * per_bucket, step, n * single / step};
}

double predict_pipeline_step(const std::vector<BlockProfile>& blocks, const std::vector<int>& cuts,
                             int batch, int split, Schedule schedule, const LinkModel& link,
                             const StepCosts& costs) {
  std::vector<double> share(cuts.size() + 1, 0);
  double total = 0;
  for (size_t b = 0; b < blocks.size(); ++b) {
    size_t s = 0;
    while (s < cuts.size() && int(b) >= cuts[s]) ++s;
    share[s] += blocks[b].param_bytes;
    total += blocks[b].param_bytes;
  }
  for (double& w : share) w = total > 0 ? costs.optimizer_s * w / total : 0;
  return predict_step(blocks, cuts, batch, split, schedule, link) +
         concurrent_seconds(share, costs.optimizer_slowdown);
}

MpPrediction predict_mp(const std::vector<BlockProfile>& blocks, int stages, int batch,
                        const std::vector<int>& split_sizes, Schedule schedule,
                        const LinkModel& link, double loader) {
  std::vector<std::vector<int>> cut_sets;
  if (stages == 2) {
    for (int c = 1; c < int(blocks.size()); ++c) cut_sets.push_back({c});
  } else {  // balanced by compute: cut where the running sum passes each 1/S share
    double total = 0;
    for (const auto& b : blocks) total += b.forward_s + b.backward_s;
    std::vector<int> cuts;
    double run = 0;
    for (int k = 0; k + 1 < int(blocks.size()) && int(cuts.size()) < stages - 1; ++k) {
      run += blocks[k].forward_s + blocks[k].backward_s;
      if (run >= total * (cuts.size() + 1) / stages) cuts.push_back(k + 1);
    }
    for (int k = int(blocks.size()) - 1; int(cuts.size()) < stages - 1; --k)
      if (std::find(cuts.begin(), cuts.end(), k) == cuts.end()) cuts.push_back(k);
    std::sort(cuts.begin(), cuts.end());
    cut_sets.push_back(cuts);
  }
  MpPrediction best{{}, 0, 1e300, 0};
  for (const auto& cuts : cut_sets)
    for (int split : split_sizes) {
      if (split < 1 || split > batch) continue;
      double t = predict_step(blocks, cuts, batch, split, schedule, link);
      if (loader > 0) t = std::max(t, double(batch) / loader);
      if (t < best.step_s) best = {cuts, split, t, 0};
    }
  double single = single_step_seconds(blocks, batch);
  if (loader > 0) single = std::max(single, double(batch) / loader);
  best.speedup = single / best.step_s;
  return best;
}

std::vector<BlockProfile> flop_derived_profile(int S, double rate, EncoderKind encoder) {
  return flop_derived_profile(S, rate, GpuFill{}, encoder);
}

std::vector<BlockProfile> flop_derived_profile(int S, double rate, const GpuFill& fill, EncoderKind encoder) {
  auto conv = [](double cin, double cout, double k, double out) { return 2 * cin * cout * k * k * out * out; };
  std::vector<BlockProfile> p(11);
  const char* names[11] = {"encoder.stem", "encoder.layer1", "encoder.layer2", "encoder.layer3",
                           "encoder.layer4", "decoder.blocks.0", "decoder.blocks.1",
                           "decoder.blocks.2", "decoder.blocks.3", "decoder.blocks.4",
                           "segmentation_head"};
  const std::vector<std::vector<int>> inputs = {{-1}, {0}, {1}, {2}, {3}, {4, 3}, {5, 2}, {6, 1}, {7, 0}, {8}, {9}};
  double flops[11] = {};
  double h = S / 2.0;
  flops[0] = conv(3, 64, 7, h);
  // The encoder's layers: BasicBlocks (two 3x3) or Bottlenecks (1x1, 3x3 with the stride,
  // 1x1 to 4x), the first block of a layer with a 1x1 downsample where the shape changes.
  const EncoderSpec& spec = encoder_spec(encoder);
  const std::vector<int> ch = encoder_channels(encoder, 1);  // stem, layer1..layer4
  for (int l = 0; l < 4; ++l) {
    const double planes = 64 << l, out = ch[l + 1], hout = S / double(4 << l);
    const double hin = l == 0 ? hout : 2 * hout;  // layer2..4 halve the size in their first block
    for (int i = 0; i < spec.blocks[l]; ++i) {
      const double ci = i == 0 ? ch[l] : out, hi = i == 0 ? hin : hout;
      if (spec.bottleneck)
        flops[1 + l] += conv(ci, planes, 1, hi) + conv(planes, planes, 3, hout) + conv(planes, out, 1, hout);
      else
        flops[1 + l] += conv(ci, out, 3, hout) + conv(out, out, 3, hout);
      if (i == 0 && (l > 0 || ci != out)) flops[1 + l] += conv(ci, out, 1, hout);
    }
  }
  const int dec[5] = {256, 128, 64, 32, 16}, skip[5] = {ch[3], ch[2], ch[1], ch[0], 0};
  int c = ch[4];
  h = S / 32.0;
  for (int i = 0; i < 5; ++i) {
    h *= 2;
    flops[5 + i] = conv(c + skip[i], dec[i], 3, h) + conv(dec[i], dec[i], 3, h);
    c = dec[i];
  }
  flops[10] = conv(16, 1, 3, S);
  const double out_ch[11] = {double(ch[0]), double(ch[1]), double(ch[2]), double(ch[3]), double(ch[4]), 256, 128, 64,
                             32, 16, 1};
  const double out_hw[11] = {S / 2.0, S / 4.0, S / 8.0, S / 16.0, S / 32.0, S / 16.0, S / 8.0, S / 4.0, S / 2.0, double(S), double(S)};
  for (int k = 0; k < 11; ++k)
    p[k] = {names[k], inputs[k], flops[k] / rate, 2 * flops[k] / rate, 4.0 * out_ch[k] * out_hw[k] * out_hw[k]};
  if (fill.sms <= 0) return p;
  // Powers of two until every block's launches fill the GPU; flat beyond.
  const double sat = fill.saturating_elements();
  for (int m = 1;; m *= 2) {
    bool all_full = true;
    for (int k = 0; k < 11; ++k) {
      const double e = m * out_ch[k] * out_hw[k] * out_hw[k];
      const double eff = std::min(1.0, e / sat);
      all_full = all_full && eff >= 1;
      p[k].by_batch.push_back({m, flops[k] / rate / eff, 2 * flops[k] / rate / eff});
    }
    if (all_full || m >= (1 << 24)) break;
  }
  return p;
}

std::string perf_model_report(const std::vector<BlockProfile>& blocks, double param_bytes,
                              int dp_batch, int mp_batch, const LinkModel& link, double loader) {
  std::ostringstream os;
  char line[256];
  std::snprintf(line, sizeof line, "one device: %.4f s per step of %d (DP), %.4f s per step of %d (MP)\n\n",
                single_step_seconds(blocks, dp_batch), dp_batch, single_step_seconds(blocks, mp_batch), mp_batch);
  os << line;
  os << "| N | DP ring step (s) | DP ring speedup | DP ps step (s) | DP ps speedup | MP GPipe best (cut, split) | MP step (s) | MP speedup | 1F1B speedup |\n"
     << "|---|---|---|---|---|---|---|---|---|\n";
  std::vector<int> splits;
  for (int s = 1; s <= mp_batch; ++s)
    if (mp_batch % s == 0 || s == mp_batch) splits.push_back(s);
  for (int n : {2, 4, 8}) {
    const auto ring = predict_dp(blocks, param_bytes, n, dp_batch, AllReduceAlgo::Ring, link, 25e6, loader);
    const auto ps = predict_dp(blocks, param_bytes, n, dp_batch, AllReduceAlgo::ParameterServer, link, 25e6, loader);
    const auto mp = predict_mp(blocks, n, mp_batch, splits, Schedule::GPipe, link, loader);
    const auto mp1 = predict_mp(blocks, n, mp_batch, splits, Schedule::OneFOneB, link, loader);
    std::string cuts;
    for (int c : mp.cuts) cuts += (cuts.empty() ? "" : "+") + blocks[c - 1].name;
    std::snprintf(line, sizeof line, "| %d | %.4f | %.2f | %.4f | %.2f | %s, %d | %.4f | %.2f | %.2f |\n", n,
                  ring.step_s, ring.speedup, ps.step_s, ps.speedup, cuts.c_str(), mp.split_size, mp.step_s,
                  mp.speedup, mp1.speedup);
    os << line;
  }
  return os.str();
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
void wait_for(const Device& d) {
  if (d.is_cuda()) cuda::synchronize(d.index);
}

}  // namespace

StepCosts measure_step_costs(const UNetConfig& model, const std::vector<Device>& devices, int threads,
                             const OptimizerFactory& make_optimizer, LossKind loss, const Batch& batch,
                             int repeats) {
  UNETCU_CHECK(!devices.empty() && repeats >= 1, "measure_step_costs: no device or no repeat");
  const int N = int(devices.size());
  const bool cpu = devices[0].is_cpu();
  std::vector<std::unique_ptr<UNet>> models(N);
  std::vector<std::unique_ptr<Optimizer>> opts(N);
  std::vector<Tensor> buckets(N);
  WorkerPool pool(devices, std::max(1, threads), "step costs");
  // Each device's model with gradients (one backward on `batch`), its optimizer, and a
  // buffer the size of its gradients (the DP buckets).
  pool.run([&](int r) {
    UNetConfig c = model;
    c.device = devices[r];
    models[r] = std::make_unique<UNet>(c);
    models[r]->train();
    Tape tape;
    Tensor l;
    {
      TapeScope scope(tape);
      l = segmentation_loss(loss, models[r]->forward(batch.images.to(devices[r])),
                            batch.masks.to(devices[r]));
    }
    tape.backward(l);
    opts[r] = make_optimizer(models[r]->parameters());
    buckets[r] = Tensor::zeros({int64_t(models[r]->parameter_count())}, DType::F32, devices[r]);
  });
  // Each rank's median time of f over the repeats (after one untimed), with `active` ranks.
  auto timed = [&](int active, const std::function<void(int)>& f) {
    std::vector<double> med(N, 0);
    pool.run([&](int r) {
      if (r >= active) return;
      std::vector<double> t;
      for (int i = 0; i <= repeats; ++i) {
        const auto t0 = Clock::now();
        f(r);
        wait_for(devices[r]);
        if (i) t.push_back(seconds_since(t0));
      }
      med[r] = median_of(t);
    });
    double mean = 0;
    for (int r = 0; r < active; ++r) mean += med[r] / active;
    return mean;
  };
  StepCosts c;
  auto step = [&](int r) { opts[r]->step(); };
  c.optimizer_s = timed(1, step);
  if (N > 1 && cpu) c.optimizer_slowdown = timed(N, step) / c.optimizer_s;
  if (N > 1) c.grad_zero_s = timed(N, [&](int r) { buckets[r].fill_(0.0); });
  if (N > 1 && cpu) {
    auto comms = make_cpu_communicators(N, AllReduceAlgo::Ring);
    std::vector<Tensor> packed(N);  // as DataParallel keeps them: one broadcast a step
    for (int r = 0; r < N; ++r) packed[r] = pack_buffers(*models[r]);
    c.bn_broadcast_s = timed(N, [&](int r) {
      if (packed[r].defined()) comms[r]->broadcast(packed[r], 0);
    });
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    c.comm_overlaps_compute = long(std::max(1, threads)) * N < cores;
  }
  return c;
}

LinkModel measure_allreduce_link(const std::vector<Device>& devices, AllReduceAlgo algo, double bytes,
                                 int repeats) {
  const int N = int(devices.size());
  UNETCU_CHECK(N >= 2 && devices[0].is_cpu(), "measure_allreduce_link: two or more CPU devices");
  auto comms = make_cpu_communicators(N, algo);
  WorkerPool pool(devices, 1, "link");
  std::vector<double> small(N), large(N);
  pool.run([&](int r) {
    Tensor a = Tensor::zeros({16}, DType::F32, devices[r]);
    Tensor b = Tensor::zeros({int64_t(bytes / 4)}, DType::F32, devices[r]);
    std::vector<double> ts, tl;
    for (int i = 0; i <= repeats; ++i) {
      comms[r]->barrier();
      auto t0 = Clock::now();
      comms[r]->all_reduce(a, ReduceOp::Average);
      if (i) ts.push_back(seconds_since(t0));
      comms[r]->barrier();
      t0 = Clock::now();
      comms[r]->all_reduce(b, ReduceOp::Average);
      if (i) tl.push_back(seconds_since(t0));
    }
    small[r] = median_of(ts);
    large[r] = median_of(tl);
  });
  double s = 0, l = 0;
  for (int r = 0; r < N; ++r) s = std::max(s, small[r]), l = std::max(l, large[r]);
  return link_from_allreduce(s, l, bytes, N, algo);
}

LinkModel measure_transfer_link(const Device& from, const Device& to, double bytes, int repeats) {
  const Tensor a = Tensor::zeros({1}, DType::F32, from);
  const Tensor b = Tensor::zeros({int64_t(bytes / 4)}, DType::F32, from);
  std::vector<double> ts, tl;
  for (int i = 0; i <= repeats; ++i) {
    auto t0 = Clock::now();
    Tensor x = a.to(to);
    wait_for(to);
    if (i) ts.push_back(seconds_since(t0));
    t0 = Clock::now();
    Tensor y = b.to(to);
    wait_for(to);
    if (i) tl.push_back(seconds_since(t0));
  }
  LinkModel l;
  l.latency = median_of(ts);
  l.bandwidth = bytes / std::max(1e-12, median_of(tl) - l.latency);
  return l;
}

}  // namespace unetcu
