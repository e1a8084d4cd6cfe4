#include "planning/perf_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace unetcu {

const std::vector<LinkPreset>& link_presets() {
  static const std::vector<LinkPreset> p = {{"pcie3", 12.6e9, 10e-6},
                                            {"pcie4", 25.2e9, 8e-6},
                                            {"pcie5", 50.4e9, 6e-6},
                                            {"nvlink4", 360e9, 3e-6}};
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
  throw Error("unknown link '" + name + "' (pcie3, pcie4, pcie5, nvlink4, or \"<GB/s>,<us>\")");
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

double single_step_seconds(const std::vector<BlockProfile>& blocks, int batch) {
  double t = 0;
  for (const auto& b : blocks) t += b.forward_s + b.backward_s;
  return t * batch;
}

DpPrediction predict_dp(const std::vector<BlockProfile>& blocks, double param_bytes, int n,
                        int batch, AllReduceAlgo algo, const LinkModel& link, double bucket_bytes,
                        double loader) {
  double f = 0, b = 0;
  for (const auto& bl : blocks) f += bl.forward_s, b += bl.backward_s;
  const double tf = f * batch, tb = b * batch;
  const int k = std::max(1, int(std::ceil(param_bytes / bucket_bytes)));
  const double per_bucket = allreduce_seconds(param_bytes / k, n, algo, link);
  // The buckets become ready through backward; the communication runs one bucket after the
  // other and cannot finish before the last bucket (ready at the end) is reduced.
  const double comm_end = std::max(tb + per_bucket, tb / k + k * per_bucket);
  double step = tf + (n > 1 ? comm_end : tb);
  double single = single_step_seconds(blocks, batch);
  if (loader > 0) {
    step = std::max(step, double(n) * batch / loader);
    single = std::max(single, double(batch) / loader);
  }
  return {tf + tb, k * per_bucket, step, n * single / step};
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

std::vector<BlockProfile> flop_derived_profile(int S, double rate) {
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
  const int cin[4] = {64, 64, 128, 256}, cout[4] = {64, 128, 256, 512}, count[4] = {3, 4, 6, 3};
  h = S / 4.0;
  for (int l = 0; l < 4; ++l) {
    if (l > 0) h /= 2;
    for (int i = 0; i < count[l]; ++i) {
      const double ci = i == 0 ? cin[l] : cout[l];
      flops[1 + l] += conv(ci, cout[l], 3, h) + conv(cout[l], cout[l], 3, h);
      if (i == 0 && l > 0) flops[1 + l] += conv(ci, cout[l], 1, h);
    }
  }
  const int dec[5] = {256, 128, 64, 32, 16}, skip[5] = {256, 128, 64, 64, 0};
  int c = 512;
  h = S / 32.0;
  for (int i = 0; i < 5; ++i) {
    h *= 2;
    flops[5 + i] = conv(c + skip[i], dec[i], 3, h) + conv(dec[i], dec[i], 3, h);
    c = dec[i];
  }
  flops[10] = conv(16, 1, 3, S);
  const double out_ch[11] = {64, 64, 128, 256, 512, 256, 128, 64, 32, 16, 1};
  const double out_hw[11] = {S / 2.0, S / 4.0, S / 8.0, S / 16.0, S / 32.0, S / 16.0, S / 8.0, S / 4.0, S / 2.0, double(S), double(S)};
  for (int k = 0; k < 11; ++k)
    p[k] = {names[k], inputs[k], flops[k] / rate, 2 * flops[k] / rate, 4.0 * out_ch[k] * out_hw[k] * out_hw[k]};
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

}  // namespace unetcu
