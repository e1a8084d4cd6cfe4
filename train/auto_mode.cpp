#include "train/auto_mode.h"

#include <algorithm>
#include <chrono>
#include <ostream>

#include "runtime/allocator.h"
#include "runtime/cuda_api.h"

namespace unetcu {

namespace {

void reset_peaks(const std::vector<Device>& devices) {
  HostAllocator::reset_peak();
  for (const Device& d : devices)
    if (d.is_cuda()) cuda::reset_device_peak(d.index);
}

double peak_of(const std::vector<Device>& devices) {
  double most = 0;
  for (const Device& d : devices) {
    if (d.is_cuda()) cuda::synchronize(d.index);
    const AllocatorStats s = d.is_cuda() ? cuda::device_memory_stats(d.index) : HostAllocator::device_stats(d.index);
    most = std::max(most, double(s.peak_bytes));
  }
  return most;
}

// The strategy configuration of a plan.
StrategyConfig config_of(const StrategyConfig& base, const AutoPlan& a) {
  StrategyConfig c = base;
  const MemoryPlan& p = a.plan;
  c.devices = p.devices;
  c.model.recompute = p.recompute;
  c.mp.search_split = false;
  c.accumulate_rows = 0;
  if (p.kind == MemoryPlan::Pipeline) {
    c.mode = Mode::MP;
    c.mp.cuts = p.cuts;
    c.mp.split_size = p.split_size;
    c.mp.schedule = p.schedule;
  } else {
    c.mode = p.kind == MemoryPlan::DataParallel ? Mode::DP : Mode::Single;
    c.mp.cuts.clear();
    if (a.plan.chunks > 1) c.accumulate_rows = p.batch;
  }
  return c;
}

}  // namespace

AutoResult choose_auto_plan(const StrategyConfig& base, const std::function<Batch(int)>& batch_of, int images,
                            double limit, int min_samples, std::ostream& out) {
  using Clock = std::chrono::steady_clock;
  UNETCU_CHECK(!base.devices.empty(), "the plan search needs at least one device");
  UNETCU_CHECK(!base.cuda_graphs, "the plan search times and models eager steps, not CUDA graphs");
  AutoSearch search;
  search.devices = base.devices;
  search.images = images;
  search.limit = limit * (1 - kMemoryHeadroom);
  search.min_samples = min_samples;
  search.allreduce = base.dp.allreduce;
  const size_t saved_limit = memory_limit();
  const std::string saved_source = memory_limit_source();
  const auto restore = [&] { set_memory_limit(saved_limit, saved_source); };
  // The measurements run without the limit: they are not the run (and a batch that does not
  // fit is what they measure). On a GPU the time profile stays at sizes that fit it.
  set_memory_limit(0);
  MemoryProfile memory;
  std::vector<BlockProfile> times;
  double param_bytes = 0;
  std::vector<std::string> names;
  try {
    UNetConfig mc = base.model;
    mc.device = base.devices[0];
    mc.recompute.clear();
    UNet model(mc);
    for (const auto& b : model.blocks()) names.push_back(b.name);
    for (const Tensor& p : model.parameters()) param_bytes += double(p.nbytes());
    {
      auto optimizer = optimizer_factory(base.optimizer)(model.parameters());
      const int k = std::max(1, min_samples);
      memory = profile_memory(model, *optimizer, base.loss, batch_of(k), batch_of(2 * k));
    }
    // Block times at the sizes the plans use, as far as a plain step of that size fits the
    // limit (beyond, a block's time per sample is taken as at the largest size measured).
    std::vector<Batch> sizes;
    for (int b : auto_batch_sizes(search))
      if (sizes.empty() || predict_step_peak(memory, b, {}) <= limit) sizes.push_back(batch_of(b));
    model.train();
    times = profile_blocks_by_batch(model, sizes, base.loss, 1);
  } catch (...) {
    restore();
    throw;
  }
  restore();
  AutoResult r;
  r.plans = auto_plans(memory, times, param_bytes, search);
  const auto mib = [](double b) { return int64_t(b / (1 << 20) + 0.5); };
  UNETCU_CHECK(!r.plans.empty(), "no plan over ", device_list_str(base.devices), " fits a step of ", images,
               " images in ", mib(limit), " MiB per device, even with every block recomputed and the batch "
               "accumulated in chunks of ", std::max(1, min_samples), " image(s); one device needs about ",
               mib(predict_step_peak(memory, std::max(1, min_samples), std::vector<bool>(names.size(), true))),
               " MiB then");
  // The fastest prediction of each kind is timed; where it fails (out of memory: the model is
  // within about 10 %), the next of that kind, three at most.
  std::vector<size_t> timed;
  const Batch host = batch_of(images);
  std::ostream null_out(nullptr);
  const auto run = [&](size_t i) {
    AutoPlan& a = r.plans[i];
    timed.push_back(i);
    StrategyConfig c = config_of(base, a);
    c.cuda_graphs = false;  // three steps each: the capture would be one of the timed
    try {
      auto strategy = make_strategy(c, nullptr, null_out);
      const PlacedBatch placed = strategy->place(host);
      std::vector<double> t;
      reset_peaks(c.devices);
      for (int s = 0; s < 3; ++s) {
        const auto t0 = Clock::now();
        strategy->step(placed);
        if (s) t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      a.measured_s = *std::min_element(t.begin(), t.end());
      a.measured_peak = peak_of(c.devices);
    } catch (const std::exception& e) {
      const std::string what = e.what();
      a.failed = what.find("out of") != std::string::npos && what.find("memory") != std::string::npos
                     ? "out of memory"
                     : "failed: " + what.substr(0, 120);
    }
    return a.failed.empty();
  };
  for (const MemoryPlan::Kind kind : {MemoryPlan::Single, MemoryPlan::DataParallel, MemoryPlan::Pipeline}) {
    int tries = 0;
    for (size_t i = 0; i < r.plans.size() && tries < 3; ++i)
      if (r.plans[i].plan.kind == kind && (++tries, run(i))) break;
  }
  size_t best = r.plans.size();
  for (size_t i : timed)
    if (r.plans[i].failed.empty() && (best == r.plans.size() || r.plans[i].measured_s < r.plans[best].measured_s))
      best = i;
  // The table: the timed plans and the best predictions beside them.
  std::vector<AutoPlan> shown;
  for (size_t i = 0; i < r.plans.size(); ++i)
    if (i < 6 || std::find(timed.begin(), timed.end(), i) != timed.end()) shown.push_back(r.plans[i]);
  out << "mode auto: " << r.plans.size() << " plan(s) over " << device_list_str(base.devices) << " fit a step of "
      << images << " images in " << mib(limit) << " MiB per device (predicted, with " << int(kMemoryHeadroom * 100)
      << " % to spare); the fastest prediction of each kind ran 3 steps (the next where it failed):\n"
      << auto_table(shown, names);
  UNETCU_CHECK(best < r.plans.size(), "mode auto: every plan it ran failed (see the table above)");
  r.chosen = r.plans[best];
  r.strategy = config_of(base, r.chosen);
  r.strategy.cuda_graphs = base.cuda_graphs;
  r.batch_size = r.chosen.plan.batch;
  r.accumulate = r.chosen.plan.chunks;
  out << "chosen: " << r.chosen.name(names) << "\n";
  return r;
}

}  // namespace unetcu
