#include "planning/auto_plan.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace unetcu {

namespace {

// The block times for a plan over `share` devices that share one machine's cores (1 for GPUs),
// with each recomputed block's forward run again in its backward.
std::vector<BlockProfile> plan_times(const std::vector<BlockProfile>& times, double share,
                                     const std::vector<bool>& recompute) {
  std::vector<BlockProfile> out = times;
  for (size_t k = 0; k < out.size(); ++k) {
    BlockProfile& b = out[k];
    const bool again = !recompute.empty() && recompute[k];
    b.forward_s *= share;
    b.backward_s = b.backward_s * share + (again ? b.forward_s : 0);
    for (BatchPoint& p : b.by_batch) {
      p.forward_s *= share;
      p.backward_s = p.backward_s * share + (again ? p.forward_s : 0);
    }
  }
  return out;
}

struct Fit {
  bool found = false;
  std::vector<bool> recompute;
  double peak = 0;
};

// The recompute set that adds the least forward time (blocks at micro-batch m) among those
// under the limit on every device of `plan`; none first.
Fit cheapest_fit(const MemoryProfile& memory, const std::vector<BlockProfile>& times, MemoryPlan plan,
                 double limit, int m) {
  const size_t n = memory.blocks.size();
  const auto peak_of = [&](const std::vector<bool>& set) {
    plan.recompute = set;
    return most_on_a_device(memory, plan);
  };
  Fit best;
  const double plain = peak_of({});
  if (plain <= limit) return {true, {}, plain};
  UNETCU_CHECK(n < 32, "auto plans: recompute sets over ", n, " blocks");
  double best_cost = 0;
  std::vector<bool> set(n);
  for (unsigned mask = 1; mask < (1u << n); ++mask) {
    double cost = 0;
    for (size_t k = 0; k < n; ++k)
      if ((set[k] = (mask >> k) & 1u)) cost += forward_per_sample(times[k], m);
    if (best.found && cost > best_cost) continue;
    const double peak = peak_of(set);
    if (peak > limit) continue;
    if (!best.found || cost < best_cost || (cost == best_cost && peak < best.peak)) {
      best = {true, set, peak};
      best_cost = cost;
    }
  }
  return best;
}

bool micro_ok(int64_t total, int64_t size, int min_samples) {
  const int64_t rest = total % size;
  return size >= min_samples && (rest == 0 || rest >= min_samples);
}

}  // namespace

std::vector<int> auto_batch_sizes(const AutoSearch& s) {
  std::vector<int> out;
  for (int b = 1; b < s.images; b *= 2) out.push_back(b);
  out.push_back(s.images);
  const int N = int(s.devices.size());
  if (N > 1 && s.images % N == 0) out.push_back(s.images / N);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  out.erase(std::remove_if(out.begin(), out.end(), [&](int b) { return b < s.min_samples; }), out.end());
  return out;
}

std::vector<AutoPlan> auto_plans(const MemoryProfile& memory, const std::vector<BlockProfile>& times,
                                 double param_bytes, const AutoSearch& s) {
  UNETCU_CHECK(!s.devices.empty() && s.images >= 1 && s.limit > 0, "auto plans: devices, a batch and a limit");
  UNETCU_CHECK(times.size() == memory.blocks.size(), "auto plans: a time and a memory profile of the same blocks");
  const int N = int(s.devices.size());
  const auto share = [&](int used) { return s.devices[0].is_cpu() ? double(used) : 1.0; };
  std::vector<AutoPlan> out;
  // One device, then DP over all: the whole batch (or shard) at once where some recompute set
  // fits; else the fewest chunks at which one does, and the next two chunk counts (should the
  // first not fit after all). Accumulation changes what batch norm sees: only where needed.
  for (const bool dp : {false, true}) {
    if (dp && (N < 2 || s.images % N != 0)) continue;
    const int replicas = dp ? N : 1, shard = s.images / replicas;
    int found = 0;
    for (int chunks = 1; chunks <= shard && found < 3; ++chunks) {
      if (shard % chunks != 0 || shard / chunks < s.min_samples) continue;
      const int b = shard / chunks;
      MemoryPlan plan;
      plan.kind = dp ? MemoryPlan::DataParallel : MemoryPlan::Single;
      plan.batch = b;
      plan.chunks = chunks;
      plan.devices = dp ? s.devices : std::vector<Device>{s.devices[0]};
      const Fit fit = cheapest_fit(memory, times, plan, s.limit, b);
      if (!fit.found) continue;
      plan.recompute = fit.recompute;
      const auto t = plan_times(times, share(replicas), fit.recompute);
      AutoPlan a;
      a.plan = plan;
      a.predicted_peak = fit.peak;
      if (dp) {  // every chunk's compute, one all-reduce of the accumulated gradients
        const DpPrediction d = predict_dp(t, param_bytes, N, b, s.allreduce, s.link);
        a.predicted_s = chunks * d.compute_s + (d.step_s - d.compute_s);
      } else {
        a.predicted_s = chunks * single_step_seconds(t, b);
      }
      out.push_back(a);
      if (chunks == 1) break;
      ++found;
    }
  }
  // A pipeline over all the devices (a stage has at least one block).
  if (N >= 2 && N <= int(times.size())) {
    std::vector<std::vector<int>> cut_sets;
    if (N == 2) {
      for (int c = 1; c < int(times.size()); ++c) cut_sets.push_back({c});
    } else {
      cut_sets.push_back(predict_mp(plan_times(times, share(N), {}), N, s.images, {s.images}, Schedule::GPipe,
                                    s.link).cuts);
    }
    std::vector<int> splits;
    for (int m = 1; m < s.images; m *= 2) splits.push_back(m);
    splits.push_back(s.images);
    for (const auto& cuts : cut_sets)
      for (int m : splits) {
        if (!micro_ok(s.images, m, s.min_samples)) continue;
        for (const Schedule schedule : {Schedule::GPipe, Schedule::OneFOneB}) {
          MemoryPlan plan;
          plan.kind = MemoryPlan::Pipeline;
          plan.batch = s.images;
          plan.devices = s.devices;
          plan.cuts = cuts;
          plan.split_size = m;
          plan.schedule = schedule;
          const Fit fit = cheapest_fit(memory, times, plan, s.limit, m);
          if (!fit.found) continue;
          plan.recompute = fit.recompute;
          AutoPlan a;
          a.plan = plan;
          a.predicted_peak = fit.peak;
          a.predicted_s = predict_step(plan_times(times, share(N), fit.recompute), cuts, s.images, m, schedule, s.link);
          out.push_back(a);
        }
      }
  }
  std::stable_sort(out.begin(), out.end(), [](const AutoPlan& a, const AutoPlan& b) { return a.predicted_s < b.predicted_s; });
  return out;
}

std::string AutoPlan::name(const std::vector<std::string>& block_names) const {
  std::ostringstream os;
  const MemoryPlan& p = plan;
  if (p.kind == MemoryPlan::Single) {
    os << "single (" << (p.devices.empty() ? std::string("one device") : p.devices[0].str()) << ")";
  } else if (p.kind == MemoryPlan::DataParallel) {
    os << "dp x" << p.devices.size();
  } else {
    os << "mp x" << p.devices.size() << ", cut after ";
    for (size_t i = 0; i < p.cuts.size(); ++i)
      os << (i ? "," : "") << block_names.at(size_t(p.cuts[i] - 1));
    os << ", split " << p.split_size << ", " << name_of(kScheduleNames, p.schedule);
  }
  const long n = std::count(p.recompute.begin(), p.recompute.end(), true);
  if (n == long(block_names.size()) && n > 0) {
    os << ", every block recomputed";
  } else if (n > 0) {
    os << ", recompute ";
    bool first = true;
    for (size_t k = 0; k < p.recompute.size(); ++k)
      if (p.recompute[k]) os << (first ? "" : ",") << block_names.at(k), first = false;
  }
  if (p.chunks > 1) os << ", " << p.chunks << " chunks of " << p.batch << " accumulated";
  return os.str();
}

std::string auto_table(const std::vector<AutoPlan>& plans, const std::vector<std::string>& block_names) {
  std::ostringstream os;
  const auto mib = [](double b) { return b / (1 << 20); };
  char cell[160];
  os << "| plan | predicted step (s) | measured step (s) | predicted peak (MiB) | measured peak (MiB) |\n"
     << "|---|---|---|---|---|\n";
  for (const AutoPlan& a : plans) {
    os << "| " << a.name(block_names) << " | ";
    std::snprintf(cell, sizeof cell, "%.3f", a.predicted_s);
    os << cell << " | ";
    if (!a.failed.empty())
      os << a.failed;
    else if (a.measured_s >= 0)
      std::snprintf(cell, sizeof cell, "%.3f", a.measured_s), os << cell;
    else
      os << "-";
    std::snprintf(cell, sizeof cell, " | %.1f | ", mib(a.predicted_peak));
    os << cell;
    if (a.measured_peak >= 0)
      std::snprintf(cell, sizeof cell, "%.1f", mib(a.measured_peak)), os << cell;
    else
      os << "-";
    os << " |\n";
  }
  return os.str();
}

}  // namespace unetcu
