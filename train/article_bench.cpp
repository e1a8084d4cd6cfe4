#include "train/article_bench.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <iostream>
#include <sstream>

#include "kernels/cpu/cpu_select.h"
#include "train/step_timing.h"
#include "runtime/cuda_api.h"
#include "planning/perf_model.h"
#include "planning/split_search.h"
#include "parallel/dist.h"
#include "parallel/process_communicator.h"
#include "parallel/process_pipeline.h"

#include "data/synthetic.h"

namespace unetcu {

using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct Row {
  std::string method;
  std::vector<double> epochs = {};
  double model_epoch = 0;    // the performance model's prediction (planning/perf_model.h)
  double model_speedup = 0;
  std::string note = {};     // where the model is off by more than 15 %: what it cannot know
  double mean() const {
    double s = 0;
    for (double e : epochs) s += e;
    return s / double(epochs.size());
  }
  double stddev() const {
    if (epochs.size() < 2) return 0;
    double m = mean(), s = 0;
    for (double e : epochs) s += (e - m) * (e - m);
    return std::sqrt(s / double(epochs.size() - 1));
  }
};

// Runs `warmup` steps of the strategy on the batch, then `epochs` epochs of `steps` steps
// each; returns the epoch times.
std::vector<double> time_epochs(TrainingStrategy& strategy, const Batch& host, int warmup,
                                int epochs, int steps) {
  const PlacedBatch batch = strategy.place(host);
  for (int i = 0; i < warmup; ++i) strategy.step(batch);
  std::vector<double> out;
  for (int e = 0; e < epochs; ++e) {
    const auto t0 = Clock::now();
    for (int s = 0; s < steps; ++s) strategy.step(batch);
    out.push_back(since(t0));
  }
  return out;
}

std::string machine_description(const std::vector<Device>& devices) {
  // The model name with its family and model numbers: a virtual machine often shows only "AMD
  // EPYC", which names no generation. The first processor's block is enough.
  std::string cpu = "unknown CPU", family, model;
  std::ifstream info("/proc/cpuinfo");
  for (std::string line; std::getline(info, line) && !line.empty();) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, colon);
    key.erase(key.find_last_not_of(" \t") + 1);
    const std::string value = colon + 2 <= line.size() ? line.substr(colon + 2) : "";
    if (key == "model name") cpu = value;
    else if (key == "cpu family") family = value;
    else if (key == "model") model = value;
  }
  if (!family.empty() && !model.empty()) cpu += " (family " + family + ", model " + model + ")";
  std::string d;
  for (const Device& dev : devices)
    d += (d.empty() ? "" : ", ") + dev.str() + (dev.is_cuda() ? " (" + cuda::device_name(dev.index) + ")" : "");
  return cpu + ", " + std::to_string(sysconf(_SC_NPROCESSORS_ONLN)) + " cores; devices " + d;
}

void write_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << text;
    if (!f) throw Error("cannot write '" + path + "'");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw Error("cannot write '" + path + "'");
}

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char c : s) o += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
  return o + "\"";
}

// Table 2 from the rows (rows[0] the one-device baseline): each row's model speedup, and
// where the model's epoch is off by more than 15 % a note "model +N %: <what it cannot know>"
// (`why(row)`); then the rows as Markdown and CSV.
void table2(std::vector<Row>& rows, const std::function<std::string(const Row&)>& why, std::ostringstream& md,
            std::ostringstream& csv) {
  for (auto& r : rows) {
    r.model_speedup = rows[0].model_epoch / r.model_epoch;
    const double off = r.model_epoch / r.mean() - 1;
    if (std::fabs(off) <= 0.15) continue;
    char head[64];
    std::snprintf(head, sizeof head, "model %+.0f %%: ", 100 * off);
    r.note = head + why(r);
  }
  const double base = rows[0].mean();
  md << "| method | mean epoch (s) | std (s) | speedup | model epoch (s) | model speedup | model vs measured |\n"
        "|---|---|---|---|---|---|---|\n";
  csv << "method,mean_epoch_s,std_s,speedup,model_epoch_s,model_speedup,note\n";
  for (const auto& r : rows) {
    char line[512];
    std::snprintf(line, sizeof line, "| %s | %.3f | %.3f | %.2f | %.3f | %.2f | %s |\n", r.method.c_str(), r.mean(),
                  r.stddev(), base / r.mean(), r.model_epoch, r.model_speedup,
                  r.note.empty() ? "within 15 %" : r.note.c_str());
    md << line;
    csv << "\"" << r.method << "\"," << r.mean() << "," << r.stddev() << "," << base / r.mean() << ","
        << r.model_epoch << "," << r.model_speedup << ",\"" << r.note << "\"\n";
  }
}

// Under a launcher (mpirun, srun, torchrun's variables): one process per CPU device. Process 0
// times one device alone, then every process trains together: DP across processes (ring, ps,
// the transport's own all-reduce) and the pipeline with one stage per process at each split
// size; the model predicts each row from inputs measured first (per-block times on process 0
// alone; the slowdown of W devices sharing the machine and the step costs measured with W
// in-process CPU devices, the same cores and memory; the links between the processes timed
// over the process group). Only process 0 prints and writes.
struct ProcessBenchOptions {
  int image, batch, mp_batch, epoch_images, epochs, warmup, width_divisor, threads;
  std::vector<int> splits;
  std::string out_dir;
  bool bf16 = false;
  MemoryFormat format = MemoryFormat::NCHW;
  EncoderKind encoder = EncoderKind::ResNet34;
};

int bench_across_processes(const DistEnv& env, ProcessBenchOptions o) {
  // Processes waiting for process 0's solo runs yield their core instead of spinning in MPI.
  setenv("OMPI_MCA_mpi_yield_when_idle", "1", 0);
  init_process_group(env);
  std::shared_ptr<ProcessGroup> world = world_process_group(kDefaultCollectiveTimeout);
  // The others wait for process 0's solo runs on a group of their own, as long as those take.
  std::shared_ptr<ProcessGroup> patient = world_process_group(7 * 24 * 3600.0);
  const int W = world->size(), rank = world->rank();
  if (rank != 0 && !std::freopen("/dev/null", "w", stdout)) throw Error("cannot silence process output");
  if (o.threads <= 0) o.threads = std::max(1, int(sysconf(_SC_NPROCESSORS_ONLN)) / std::max(1, env.local_size));
  set_cpu_threads(o.threads);
  if (o.mp_batch == 0) o.mp_batch = o.batch * W;
  if (o.epoch_images == 0) o.epoch_images = 4 * o.batch * W;
  UNetConfig mc;
  mc.encoder = o.encoder;
  mc.width_divisor = o.width_divisor;
  mc.device = Device::cpu(0);
  mc.bf16_activations = o.bf16;
  mc.format = o.format;
  SyntheticSegmentation data(o.image, 1);
  const int max_batch = std::max(o.batch * W, o.mp_batch);
  data.enable_cache(max_batch);
  auto batch_of = [&](int lo, int n) {
    std::vector<int64_t> idx;
    for (int i = lo; i < lo + n; ++i) idx.push_back(i);
    return data.batch(idx);
  };
  const OptimizerFactory adam = optimizer_factory({});
  const int64_t deepest = int64_t(o.image / 32) * (o.image / 32);
  std::vector<Device> local;  // W CPU devices in process 0: the proxies for W processes
  for (int d = 0; d < W; ++d) local.push_back(Device::cpu(d));
  std::printf("%s\nprocesses: %d (%s, transport %s), %d threads each, on %s\n"
              "image %dx%d, %s width/%d, %s %s; single and DP batch %d per process, MP batch %d; epoch = %d images; "
              "%d timed epochs after %d warm-up steps\n\n",
              kernels::cpu::cpu_gemm_line().c_str(), W, env.launcher.c_str(), world->transport().c_str(),
              o.threads, machine_description({Device::cpu(0)}).c_str(), o.image, o.image, encoder_name(o.encoder),
              o.width_divisor,
              o.bf16 ? "bf16" : "float32", format_name(o.format), o.batch, o.mp_batch, o.epoch_images,
              o.epochs, o.warmup);
  std::fflush(stdout);

  // Process 0 alone: the model's inputs and the one-device baseline; the others wait.
  std::vector<BlockProfile> profile;
  StepCosts costs;
  double param_bytes = 0;
  std::vector<Row> rows;
  if (rank == 0) {
    std::vector<int> sizes = {o.batch, o.mp_batch};
    for (int s : o.splits) sizes.push_back(s);
    std::sort(sizes.begin(), sizes.end());
    sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
    sizes.erase(std::remove_if(sizes.begin(), sizes.end(), [&](int s) { return s * deepest < 2; }), sizes.end());
    UNet m(mc);
    m.train();
    param_bytes = double(m.parameter_count()) * 4;
    std::vector<Batch> sized;
    for (int s : sizes) sized.push_back(batch_of(0, s));
    profile = profile_blocks_by_batch(m, sized, LossKind::BCEDice, 2);
    measure_shared_slowdown(profile, mc, local, o.threads, batch_of(0, o.batch), LossKind::BCEDice, 2);
    costs = measure_step_costs(mc, local, o.threads, adam, LossKind::BCEDice, batch_of(0, o.batch), 3);
    set_cpu_threads(o.threads);
    SingleDeviceStrategy single(mc, {}, adam, LossKind::BCEDice);
    const int steps = std::max(1, o.epoch_images / o.batch);
    rows.push_back({"single (process 0 alone)", time_epochs(single, batch_of(0, o.batch), o.warmup, o.epochs, steps),
                    steps * single_step_seconds(profile, o.batch, costs), 1.0});
  }
  patient->barrier();
  set_cpu_threads(o.threads);

  // The links between the processes: all-reduces of 64 bytes and of the gradients' size, and a
  // ping-pong of 4 bytes and of the largest activation between processes 0 and 1.
  auto best_of = [](int n, const std::function<double()>& f) {
    double best = 1e30;
    for (int i = 0; i < n; ++i) best = std::min(best, f());
    return best;
  };
  double grads = param_bytes;
  world->broadcast(&grads, sizeof grads, 0);
  std::map<AllReduceAlgo, LinkModel> links;
  for (AllReduceAlgo algo : {AllReduceAlgo::Ring, AllReduceAlgo::ParameterServer, AllReduceAlgo::Mpi}) {
    auto comm = make_process_communicator(world->duplicate(), algo);
    Tensor small = Tensor::zeros({16}), large = Tensor::zeros({int64_t(grads / 4)});
    auto timed = [&](Tensor& t) {
      comm->barrier();
      const auto t0 = Clock::now();
      comm->all_reduce(t, ReduceOp::Average);
      double dt = since(t0);
      world->broadcast(&dt, sizeof dt, 0);  // process 0's time, everywhere
      return dt;
    };
    const double ts = best_of(5, [&] { return timed(small); });
    const double tl = best_of(3, [&] { return timed(large); });
    // The transport's own all-reduce is modelled as a ring with the link it shows.
    links[algo] = link_from_allreduce(ts, tl, grads, W,
                                      algo == AllReduceAlgo::ParameterServer ? algo : AllReduceAlgo::Ring);
  }
  double largest = 0;
  if (rank == 0)
    for (const auto& bl : profile) largest = std::max(largest, bl.output_bytes * o.mp_batch);
  world->broadcast(&largest, sizeof largest, 0);
  LinkModel mp_link;
  {
    std::vector<char> buf(size_t(std::max(4.0, largest)));
    auto ping = [&](size_t bytes) {
      world->barrier();
      const auto t0 = Clock::now();
      if (rank == 0) {
        world->send(buf.data(), bytes, 1, 5);
        world->recv(buf.data(), 4, 1, 6);
      } else if (rank == 1) {
        world->recv(buf.data(), bytes, 0, 5);
        world->send(buf.data(), 4, 0, 6);
      }
      double dt = since(t0);
      world->broadcast(&dt, sizeof dt, 0);
      return dt;
    };
    const double rtt_small = best_of(5, [&] { return ping(4); });
    const double rtt_large = best_of(3, [&] { return ping(buf.size()); });
    mp_link.latency = rtt_small / 2;
    mp_link.bandwidth = double(buf.size()) / std::max(1e-9, rtt_large - rtt_small);
  }
  std::printf("model inputs (measured now, before the runs): %zu blocks profiled on process 0 alone; "
              "shared slowdown and step costs with %d in-process CPU devices; links between the "
              "processes: ring all-reduce %.2f GB/s, %.1f us; ps %.2f GB/s, %.1f us; %s's own %.2f GB/s, "
              "%.1f us; stage transfers %.2f GB/s, %.1f us\n\n",
              profile.size(), W, links[AllReduceAlgo::Ring].bandwidth / 1e9, links[AllReduceAlgo::Ring].latency * 1e6,
              links[AllReduceAlgo::ParameterServer].bandwidth / 1e9,
              links[AllReduceAlgo::ParameterServer].latency * 1e6, world->transport().c_str(),
              links[AllReduceAlgo::Mpi].bandwidth / 1e9, links[AllReduceAlgo::Mpi].latency * 1e6,
              mp_link.bandwidth / 1e9, mp_link.latency * 1e6);
  std::fflush(stdout);

  // Every process together: DP across processes.
  for (AllReduceAlgo algo : {AllReduceAlgo::Ring, AllReduceAlgo::ParameterServer, AllReduceAlgo::Mpi}) {
    DataParallelOptions dpo;
    dpo.devices = {Device::cpu(0)};
    dpo.allreduce = algo;
    dpo.threads = o.threads;
    dpo.across_processes = true;
    dpo.process_group = world->duplicate();
    DataParallelStrategy dp(mc, dpo, adam, LossKind::BCEDice);
    const int steps = std::max(1, o.epoch_images / (o.batch * W));
    const auto times = time_epochs(dp, batch_of(rank * o.batch, o.batch), o.warmup, o.epochs, steps);
    const std::string name =
        algo == AllReduceAlgo::Mpi ? world->transport() + "'s own" : name_of(kAllReduceNames, algo);
    if (rank == 0)
      rows.push_back(
          {"DP " + name + " (" + std::to_string(W) + " processes x " + std::to_string(o.batch) + ")", times,
           steps * predict_dp(profile, param_bytes, W, o.batch, algo, links[algo], double(dpo.bucket_bytes), 0, costs)
                       .step_s});
  }
  // The pipeline, one stage per process, at the model's best cut for W stages.
  std::vector<int> cuts;
  if (rank == 0) cuts = predict_mp(profile, W, o.mp_batch, o.splits, Schedule::GPipe, mp_link).cuts;
  cuts.resize(size_t(W - 1));
  world->broadcast(cuts.data(), cuts.size() * sizeof(int), 0);
  std::string cut_names;
  {
    UNet names(mc);
    for (int c : cuts) cut_names += (cut_names.empty() ? "" : ", ") + names.blocks()[size_t(c - 1)].name;
  }
  for (int split : o.splits) {
    PipelineOptions po;
    po.devices = {Device::cpu(0)};
    po.cuts = cuts;
    po.split_size = split;
    po.threads = o.threads;
    po.pipeline_stages = W;
    DataParallelOptions replicas;
    replicas.process_group = world->duplicate();
    ProcessPipelineStrategy pipe(mc, po, replicas, adam, LossKind::BCEDice);
    const int steps = std::max(1, o.epoch_images / o.mp_batch);
    const auto times = time_epochs(pipe, batch_of(0, o.mp_batch), o.warmup, o.epochs, steps);
    if (rank == 0)
      rows.push_back(
          {"MP " + std::to_string(W) + " processes (after " + cut_names + ", split " + std::to_string(split) +
               ", batch " + std::to_string(o.mp_batch) + ")",
           times, steps * predict_pipeline_step(profile, cuts, o.mp_batch, split, Schedule::GPipe, mp_link, costs)});
  }
  if (rank != 0) return 0;
  std::ostringstream md, csv;
  table2(rows,
         [&](const Row& r) -> std::string {
           if (&r == &rows[0]) return "the step beside the blocks is not profiled";
           return r.method.rfind("DP", 0) == 0 ? "the processes' copies and waits beside the all-reduce's link"
                                               : "how the stage processes share the cores while they overlap";
         },
         md, csv);
  std::printf("Table 2 across processes: epoch time (%d images) and speedup over one device; the model's "
              "prediction from the inputs measured above beside it\n\n%s", o.epoch_images, md.str().c_str());
  if (::mkdir(o.out_dir.c_str(), 0755) != 0 && errno != EEXIST)
    throw Error(str_cat("cannot create ", setting("out"), " folder '", o.out_dir, "'"));
  write_file(o.out_dir + "/processes.md", md.str());
  write_file(o.out_dir + "/processes.csv", csv.str());
  std::printf("\nwritten: %s/processes.{md,csv}\n", o.out_dir.c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace

int run_article_bench(BenchConfig c) {
  UNETCU_CHECK(c.precision == "fp32" || c.precision == "bf16", setting("precision"), ": fp32 or bf16, got '",
               c.precision, "'");
  UNETCU_CHECK(c.memory_format == "nchw" || c.memory_format == "nhwc", setting("memory_format"),
               ": nchw or nhwc, got '", c.memory_format, "'");
  const bool bf16 = c.precision == "bf16";
  const MemoryFormat format = c.memory_format == "nhwc" ? MemoryFormat::NHWC : MemoryFormat::NCHW;
  // Started by a launcher: the benchmark across processes (one CPU device each).
  const DistEnv env = detect_dist(DistMode::Auto);
  if (env.multi()) {
    ProcessBenchOptions po{c.image_size,    c.batch_size, c.mp_batch, c.epoch_images, c.epochs, c.warmup,
                           c.width_divisor, c.threads,    {},         c.out,          bf16,     format,
                           c.encoder};
    UNETCU_CHECK(c.batch_size >= 1 && c.epochs >= 1 && c.warmup >= 0 && c.mp_batch >= 0, "bad sizes");
    UNETCU_CHECK(c.image_size >= 32 && c.image_size % 32 == 0, setting("image_size"), " must be a multiple of 32");
    const int mpb = c.mp_batch ? c.mp_batch : c.batch_size * env.world;
    const int64_t deepest = int64_t(c.image_size / 32) * (c.image_size / 32);
    if (c.split_sizes.empty()) {
      for (int s = 1; s < mpb; s *= 2) po.splits.push_back(s);
      po.splits.push_back(mpb);
    } else {
      po.splits = parse_int_list(c.split_sizes);
    }
    for (int s : po.splits) UNETCU_CHECK(s >= 1 && s <= mpb, setting("split_sizes"), ": ", s, " is outside 1..", mpb);
    po.splits.erase(std::remove_if(po.splits.begin(), po.splits.end(), [&](int s) { return s * deepest < 2; }),
                    po.splits.end());
    UNETCU_CHECK(!po.splits.empty(), "no usable split size");
    UNETCU_CHECK(c.batch_size * deepest >= 2, setting("batch_size"), " ", c.batch_size, " at ", c.image_size, "x",
                 c.image_size, " gives batch norm one value per channel");
    return bench_across_processes(env, po);
  }
  std::vector<Device> devices;
  try {
    devices = Device::parse_list(c.devices);
  } catch (const Error& e) {
    throw Error(str_cat(setting("devices"), ": ", e.what()));
  }
  for (size_t i = 0; i < devices.size(); ++i) {
    resolve_device(devices[i].str(), nullptr);
    for (size_t j = 0; j < i; ++j)
      UNETCU_CHECK(devices[i] != devices[j], setting("devices"), " lists ", devices[i].str(), " twice");
    UNETCU_CHECK(devices[i].kind == devices[0].kind, setting("devices"), " must be all CPU devices or all GPUs");
  }
  const int N = int(devices.size());
  UNETCU_CHECK(c.batch_size >= 1 && c.epochs >= 1 && c.mp_steps >= 1 && c.warmup >= 0, "bad sizes");
  if (c.mp_batch == 0) c.mp_batch = c.batch_size * N;
  if (c.epoch_images == 0) c.epoch_images = 4 * c.batch_size * N;
  std::vector<int> splits;
  if (c.split_sizes.empty()) {
    for (int s = 1; s < c.mp_batch; s *= 2) splits.push_back(s);
    splits.push_back(c.mp_batch);
  } else {
    try {
      splits = parse_int_list(c.split_sizes);
    } catch (const Error& e) {
      throw Error(str_cat(setting("split_sizes"), ": ", e.what()));
    }
  }
  for (int s : splits)
    UNETCU_CHECK(s >= 1 && s <= c.mp_batch, setting("split_sizes"), ": ", s, " is outside 1..", c.mp_batch);
  // Batch norm in training needs more than one value per channel at layer4 ((S/32)² per sample).
  const int64_t deepest = int64_t(c.image_size / 32) * (c.image_size / 32);
  const size_t before = splits.size();
  splits.erase(std::remove_if(splits.begin(), splits.end(), [&](int s) { return s * deepest < 2; }),
               splits.end());
  if (splits.size() != before)
    std::printf("split sizes giving batch norm one value per channel at %dx%d are left out\n", c.image_size,
                c.image_size);
  UNETCU_CHECK(!splits.empty(), "no usable split size");
  UNETCU_CHECK(c.batch_size * deepest >= 2, setting("batch_size"), " ", c.batch_size, " at ", c.image_size, "x",
               c.image_size, " gives batch norm one value per channel");
  if (c.threads <= 0) c.threads = std::max(1, int(sysconf(_SC_NPROCESSORS_ONLN)) / N);
  if (devices[0].is_cuda()) cuda::set_allow_tf32(true);
  if (::mkdir(c.out.c_str(), 0755) != 0 && errno != EEXIST)
    throw Error(str_cat("cannot create ", setting("out"), " folder '", c.out, "'"));
  write_file(c.out + "/.write_test", "");  // fail now, not after the whole benchmark
  std::remove((c.out + "/.write_test").c_str());

  UNetConfig mc;
  mc.encoder = c.encoder;
  mc.width_divisor = c.width_divisor;
  mc.bf16_activations = bf16;
  mc.format = format;
  SyntheticSegmentation data(c.image_size, 1);
  const int max_batch = std::max(c.batch_size * N, c.mp_batch);
  data.enable_cache(max_batch);
  std::vector<int64_t> idx;
  for (int i = 0; i < max_batch; ++i) idx.push_back(i);
  auto batch_of = [&](int lo, int n) {
    return data.batch(std::vector<int64_t>(idx.begin() + lo, idx.begin() + lo + n));
  };
  const OptimizerFactory adam = optimizer_factory({});
  const std::string machine = machine_description(devices);
  std::printf("%s\n", kernels::cpu::cpu_gemm_line().c_str());
  std::printf(
      "machine: %s\nimage %dx%d, %s width/%d, %s %s; single and DP batch %d per device, MP batch %d; "
      "epoch = %d images; %d timed epochs after %d warm-up steps; %d threads per CPU device\n\n",
      machine.c_str(), c.image_size, c.image_size, encoder_name(c.encoder), c.width_divisor, bf16 ? "bf16" : "float32", format_name(format),
      c.batch_size, c.mp_batch, c.epoch_images, c.epochs, c.warmup, c.threads);
  std::fflush(stdout);

  // The performance model's inputs, measured here before the timed runs: per-block times on
  // the first device at every micro-batch size the runs use, their slowdown when every
  // device computes at once, the optimizer, the DP buckets' zeroing and BN broadcast, and the
  // in-process links. Nothing is taken from the timed runs below.
  std::vector<int> profile_sizes = {c.batch_size, c.mp_batch};
  for (int s : splits) profile_sizes.push_back(s);
  for (int s = 1; s < max_batch; s *= 2) profile_sizes.push_back(s);
  std::sort(profile_sizes.begin(), profile_sizes.end());
  profile_sizes.erase(std::unique(profile_sizes.begin(), profile_sizes.end()), profile_sizes.end());
  profile_sizes.erase(std::remove_if(profile_sizes.begin(), profile_sizes.end(),
                                     [&](int s) { return s * deepest < 2 || s > max_batch; }),
                      profile_sizes.end());
  std::vector<BlockProfile> profile;
  {
    set_cpu_threads(c.threads);
    UNetConfig first = mc;
    first.device = devices[0];
    UNet m(first);
    m.train();
    std::vector<Batch> sized;
    for (int s : profile_sizes) sized.push_back(batch_of(0, s));
    profile = profile_blocks_by_batch(m, sized, LossKind::BCEDice, 2);
  }
  const bool cpu = devices[0].is_cpu();
  if (N > 1 && cpu)
    measure_shared_slowdown(profile, mc, devices, c.threads, batch_of(0, c.batch_size), LossKind::BCEDice, 2);
  double param_bytes = 0;
  param_bytes = double(UNet(mc).parameter_count()) * 4;
  const StepCosts costs =
      measure_step_costs(mc, devices, c.threads, adam, LossKind::BCEDice, batch_of(0, c.batch_size), 3);
  // Links: the in-process CPU ring and copies between CPU devices, timed; GPUs: not timed
  // here (LinkModel's defaults; unet_perfmodel has the GPU links).
  LinkModel ring_link{}, ps_link{}, mp_link{};
  const std::vector<Device> stages = {devices[0], N > 1 ? devices[1] : devices[0]};
  if (N > 1 && cpu) {
    ring_link = measure_allreduce_link(devices, AllReduceAlgo::Ring, param_bytes, 3);
    ps_link = measure_allreduce_link(devices, AllReduceAlgo::ParameterServer, param_bytes, 3);
  }
  if (cpu) {
    double largest = 0;  // the largest activation a micro-batch sends
    for (const auto& bl : profile) largest = std::max(largest, bl.output_bytes * c.mp_batch);
    mp_link = measure_transfer_link(stages[0], stages[1], largest, 5);
  }
  {
    double f = 0, b = 0, sw = 0;
    for (const auto& bl : profile) {
      f += c.batch_size * forward_per_sample(bl, c.batch_size);
      b += c.batch_size * backward_per_sample(bl, c.batch_size);
      sw += c.batch_size * (forward_per_sample(bl, c.batch_size) + backward_per_sample(bl, c.batch_size)) *
            bl.shared_slowdown;
    }
    std::string sizes;
    for (int s : profile_sizes) sizes += (sizes.empty() ? "" : ", ") + std::to_string(s);
    std::printf("model inputs (measured now, before the runs):\n"
                "  blocks at micro-batch %s; at %d: forward %.4f s + backward %.4f s per step alone\n"
                "  shared slowdown with %d devices computing at once: %.3fx (time-weighted over the blocks)\n"
                "  optimizer step %.4f s alone, %.3fx with every device stepping at once\n"
                "  DP per step: gradient buckets zeroed %.4f s, BN buffers broadcast %.4f s; the all-reduce %s\n"
                "  links: ring all-reduce %.2f GB/s, %.1f us; ps %.2f GB/s, %.1f us; stage copies %.2f GB/s, %.1f us\n"
                "  loader: none in these runs (each method's batch is placed once)\n\n",
                sizes.c_str(), c.batch_size, f, b, N, f + b > 0 ? sw / (f + b) : 1.0, costs.optimizer_s,
                costs.optimizer_slowdown, costs.grad_zero_s, costs.bn_broadcast_s,
                costs.comm_overlaps_compute ? "overlaps backward" : "shares the computing cores (adds to backward)",
                ring_link.bandwidth / 1e9, ring_link.latency * 1e6, ps_link.bandwidth / 1e9, ps_link.latency * 1e6,
                mp_link.bandwidth / 1e9, mp_link.latency * 1e6);
    std::fflush(stdout);
  }
  std::vector<Row> rows;
  {  // single device
    set_cpu_threads(c.threads);
    UNetConfig first = mc;
    first.device = devices[0];
    SingleDeviceStrategy single(first, {}, adam, LossKind::BCEDice);
    const int steps = std::max(1, c.epoch_images / c.batch_size);
    rows.push_back({"single (" + devices[0].str() + ")",
                    time_epochs(single, batch_of(0, c.batch_size), c.warmup, c.epochs, steps),
                    steps * single_step_seconds(profile, c.batch_size, costs), 1.0});
  }
  for (AllReduceAlgo algo : {AllReduceAlgo::Ring, AllReduceAlgo::ParameterServer}) {
    DataParallelOptions o;
    o.devices = devices;
    o.allreduce = algo;
    o.threads = c.threads;
    DataParallelStrategy dp(mc, o, adam, LossKind::BCEDice);
    // Replica r takes rows [r*batch, (r+1)*batch) of the global batch.
    const int steps = std::max(1, c.epoch_images / (c.batch_size * N));
    const auto pred = predict_dp(profile, param_bytes, N, c.batch_size, algo,
                                 algo == AllReduceAlgo::Ring ? ring_link : ps_link,
                                 double(o.bucket_bytes), 0, costs);
    rows.push_back({std::string("DP ") + name_of(kAllReduceNames, algo) + " (" +
                        std::to_string(N) + " x " + std::to_string(c.batch_size) + ")",
                    time_epochs(dp, batch_of(0, c.batch_size * N), c.warmup, c.epochs, steps), steps * pred.step_s});
  }
  // Table 1: every two-stage cut x split size, measured.
  const Batch mp_b = batch_of(0, c.mp_batch);
  std::vector<BlockProfile> names;
  for (const auto& bl : profile) names.push_back({bl.name, bl.inputs, 0, 0, 0});
  std::vector<PlanCandidate> plans;
  for (int cut = 1; cut < int(names.size()); ++cut)
    for (int split : splits) {
      PipelineOptions o;
      o.devices = stages;
      o.cuts = {cut};
      o.split_size = split;
      o.threads = c.threads;
      PipelineStrategy pipe(mc, o, adam, LossKind::BCEDice);
      plans.push_back({{cut}, split, 0, bench::median(bench::time_steps(pipe, mp_b, c.warmup, c.mp_steps))});
    }
  const PlanCandidate* best = &plans[0];
  for (const auto& p : plans)
    if (p.measured_s < best->measured_s) best = &p;
  {
    PipelineOptions o;
    o.devices = stages;
    o.cuts = best->cuts;
    o.split_size = best->split_size;
    o.threads = c.threads;
    PipelineStrategy pipe(mc, o, adam, LossKind::BCEDice);
    const int steps = std::max(1, c.epoch_images / c.mp_batch);
    rows.push_back({"MP best (after " + names[best->cuts[0] - 1].name + ", split " +
                        std::to_string(best->split_size) + ", batch " + std::to_string(c.mp_batch) + ")",
                    time_epochs(pipe, mp_b, c.warmup, c.epochs, steps),
                    steps * predict_pipeline_step(profile, best->cuts, c.mp_batch, best->split_size,
                                                  Schedule::GPipe, mp_link, costs)});
  }
  // The model's own choice of plan, against the measured best.
  const PlanCandidate* model_best = nullptr;
  for (auto& p : plans) {
    p.predicted_s = predict_pipeline_step(profile, p.cuts, c.mp_batch, p.split_size, Schedule::GPipe, mp_link, costs);
    if (!model_best || p.predicted_s < model_best->predicted_s) model_best = &p;
  }
  // Tables, as Markdown, CSV and JSON.
  const std::string table1 = plans_table(plans, names);
  std::ostringstream t1csv, t2md, t2csv, json;
  t1csv << "cut_after,split_size,step_s,model_step_s\n";
  for (const auto& p : plans)
    t1csv << names[p.cuts[0] - 1].name << "," << p.split_size << "," << p.measured_s << "," << p.predicted_s << "\n";
  // Speedups per epoch (the same images): predicted single over predicted method, measured
  // single over measured method; where the model is off, what it does not see.
  table2(rows,
         [&](const Row& r) -> std::string {
           if (&r == &rows[0]) return "the step beside the blocks (loss, allocator, scheduling) is not profiled";
           if (r.method.rfind("DP", 0) == 0)
             return costs.comm_overlaps_compute ? "how much of the all-reduce hides behind backward"
                                                : "how the OS shares the cores between compute and ring threads";
           return "how the stages' threads share the cores while they overlap";
         },
         t2md, t2csv);
  const double base = rows[0].mean();
  json << "{\n  \"machine\": " << json_str(machine) << ",\n  \"devices\": " << json_str(c.devices)
       << ",\n  \"image_size\": " << c.image_size << ",\n  \"encoder\": " << json_str(encoder_name(c.encoder))
       << ",\n  \"width_divisor\": " << c.width_divisor
       << ",\n  \"precision\": " << json_str(c.precision) << ",\n  \"memory_format\": " << json_str(c.memory_format)
       << ",\n  \"batch_size\": " << c.batch_size << ",\n  \"mp_batch\": " << c.mp_batch
       << ",\n  \"epoch_images\": " << c.epoch_images << ",\n  \"table1\": [";
  for (size_t i = 0; i < plans.size(); ++i)
    json << (i ? ", " : "") << "{\"cut_after\": " << json_str(names[plans[i].cuts[0] - 1].name)
         << ", \"split_size\": " << plans[i].split_size << ", \"step_s\": " << plans[i].measured_s
         << ", \"model_step_s\": " << plans[i].predicted_s << "}";
  json << "],\n  \"table2\": [";
  for (size_t i = 0; i < rows.size(); ++i)
    json << (i ? ", " : "") << "{\"method\": " << json_str(rows[i].method) << ", \"mean_epoch_s\": "
         << rows[i].mean() << ", \"std_s\": " << rows[i].stddev() << ", \"speedup\": " << base / rows[i].mean()
         << ", \"model_epoch_s\": " << rows[i].model_epoch << ", \"model_speedup\": " << rows[i].model_speedup
         << ", \"model_note\": " << json_str(rows[i].note) << "}";
  json << "]\n}\n";
  std::printf("Table 1: MP step time (s) for each cut and split_size, batch %d\n\n%s\n", c.mp_batch, table1.c_str());
  {
    int within = 0;
    std::vector<double> err;
    for (const auto& p : plans) {
      err.push_back(std::fabs(p.predicted_s / p.measured_s - 1));
      within += err.back() <= 0.15;
    }
    std::sort(err.begin(), err.end());
    std::printf("The model's Table 1 (model_step_s in table1.csv): %d of %zu cells within 15 %% of the "
                "measured step, median error %.0f %%; each cell is the median of only %d steps.\n",
                within, plans.size(), 100 * err[err.size() / 2], c.mp_steps);
    const double off = model_best->predicted_s / model_best->measured_s - 1;
    std::printf("The model's best plan: after %s, split %d: predicted %.3f s, measured %.3f s (%s); "
                "measured best %.3f s\n\n",
                names[model_best->cuts[0] - 1].name.c_str(), model_best->split_size, model_best->predicted_s,
                model_best->measured_s,
                std::fabs(off) <= 0.15 ? "within 15 %"
                                       : "off by more than 15 %: how the stages' threads share the cores "
                                         "while they overlap, and this cell's run-to-run spread",
                best->measured_s);
  }
  std::printf("Table 2: epoch time (%d images) and speedup over one device; the model's prediction "
              "from the inputs measured above beside it\n\n%s", c.epoch_images, t2md.str().c_str());
  write_file(c.out + "/table1.md", table1);
  write_file(c.out + "/table1.csv", t1csv.str());
  write_file(c.out + "/table2.md", t2md.str());
  write_file(c.out + "/table2.csv", t2csv.str());
  write_file(c.out + "/bench.json", json.str());
  std::printf("\nwritten: %s/{table1,table2}.{md,csv}, %s/bench.json\n", c.out.c_str(), c.out.c_str());
  std::fflush(stdout);
  if (c.plot) {
    UNETCU_CHECK(c.out.find('\'') == std::string::npos, setting("plot"), ": ", setting("out"),
                 " must not contain a quote");
    // The plots are an extra: without matplotlib the tables stand, and the run still succeeds.
    const std::string& script = c.plot_script;
    const std::string cmd = "/usr/bin/python3 -c 'import matplotlib' 2>/dev/null && /usr/bin/python3 '" +
                            script + "' bench '" + c.out + "/bench.json' --out-dir '" + c.out + "'";
    if (std::system(cmd.c_str()) != 0)
      std::printf("plots not drawn: %s needs /usr/bin/python3 with matplotlib (tools/setup.sh --plots)\n",
                  script.c_str());
  }
  return 0;
}

}  // namespace unetcu
