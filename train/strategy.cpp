#include "train/strategy.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ostream>

#include "engine/profiler.h"
#include "engine/tape.h"
#include "parallel/dist.h"
#include "planning/split_search.h"

namespace unetcu {

namespace {

// The first of a strategy's devices; none is the error `what`.
Device first_of(const std::vector<Device>& devices, const char* what) {
  UNETCU_CHECK(!devices.empty(), what);
  return devices[0];
}

// The tensor on `device`: itself when it is there already, else a copy (to a GPU: on its upload
// stream, asynchronous from pinned memory, overlapping with the work queued before; the device's
// current stream waits for it).
Tensor on(const Tensor& t, Device device) { return t.device() == device ? t : t.upload_to(device); }

}  // namespace

void TrainingStrategy::set_learning_rate(double lr) {
  for (Optimizer* o : optimizers()) o->set_lr(lr);
}

double TrainingStrategy::learning_rate() {
  const std::vector<Optimizer*> opts = optimizers();
  return opts.empty() ? NAN : opts[0]->lr();
}

// ---- one device -----------------------------------------------------------------------------

namespace {

// The model on the placement's one device (none given: the model's own).
UNetConfig on_device(UNetConfig model, const Placement& placement) {
  UNETCU_CHECK(placement.devices.size() <= 1, "one-device training takes one device, got ", placement.devices.size());
  if (!placement.devices.empty()) model.device = placement.devices[0];
  if (model.device.is_cpu() && placement.threads > 0) set_cpu_threads(placement.threads);
  return model;
}

}  // namespace

SingleDeviceStrategy::SingleDeviceStrategy(const UNetConfig& model, const Placement& placement,
                                           const OptimizerFactory& make_optimizer, LossKind loss)
    : TrainingStrategy(loss, {}, Device::cpu()), model_(std::make_unique<UNet>(on_device(model, placement))),
      optimizer_(make_optimizer(model_->parameters())), accumulate_rows_(placement.accumulate_rows),
      graph_(placement.cuda_graphs) {
  device_ = model_->config().device;
  devices_ = {device_};
  output_device_ = device_;
  UNETCU_CHECK(!placement.cuda_graphs || device_.is_cuda(), "CUDA graphs need a GPU; ", device_.str(),
               " runs eagerly");
  UNETCU_CHECK(accumulate_rows_ >= 0, "gradient accumulation: chunks of ", accumulate_rows_, " rows");
}

std::string SingleDeviceStrategy::describe() const {
  return "one device, " + device_.str() + (graph_.on() ? ", CUDA graphs" : "");
}

const std::vector<Tensor>* SingleDeviceStrategy::graph_step(const Batch& b) {
  if (!graph_.due(model_->is_training(), {b.images.shape(), b.masks.shape()})) return nullptr;
  if (!graph_.captured()) {
    // The captured backward writes every gradient; the eager steps' go back with the cache.
    optimizer_->zero_grad();
    GraphStep::release_cache(device_);
    try {
      graph_.capture(0, *model_, {b.images, b.masks}, {}, {optimizer_.get()},
                     [&](const std::vector<Tensor>& in) { return forward_backward(in[0], in[1]); });
    } catch (const std::exception& e) {
      graph_.fall_back("the training step", e.what());
      return nullptr;
    }
    graph_.set_captured();
  }
  GraphStep::Slot* c = &graph_.slot(0);
  c->inputs[0].copy_(b.images);
  c->inputs[1].copy_(b.masks);
  c->launch();
  graph_.count_replay();
  // An eager step in between (another shape) may have left gradients of its own: the
  // optimizer reads the graph's.
  c->use_gradients(*model_);
  return &c->outputs;
}

PlacedBatch SingleDeviceStrategy::place(Batch host) {
  PlacedBatch p{host, {{on(host.images, device_), on(host.masks, device_)}}, {}};
  return p;
}

StepLoss StepLoss::ready(double value) {
  StepLoss l;
  l.valid_ = true;
  l.value_ = value;
  return l;
}

StepLoss StepLoss::sum_of(const std::vector<Tensor>& losses) { return combine(losses, {}, 1.0); }

StepLoss StepLoss::mean_of(const std::vector<Tensor>& losses, std::function<void()> check) {
  return combine(losses, std::move(check), double(losses.size()));
}

StepLoss StepLoss::combine(const std::vector<Tensor>& losses, std::function<void()> check, double count) {
  UNETCU_CHECK(!losses.empty(), "a step loss needs at least one loss");
  StepLoss l;
  l.valid_ = true;
  l.check_ = std::move(check);
  l.count_ = count;
  for (const Tensor& loss : losses) {
    UNETCU_CHECK(loss.numel() == 1, "a step loss is one value, got ", loss.numel());
    if (!loss.device().is_cuda()) {
      UNETCU_CHECK(l.hosts_.empty(), "a step loss's CPU values come before its GPU values");
      l.value_ += loss.item() / l.count_;
      continue;
    }
    // Behind the step's kernels on the same stream: the copy reads the loss before any later
    // kernel can reuse its memory.
    Tensor host = Tensor::empty_pinned({1}, loss.dtype());
    l.done_.push_back(cuda::copy_to_host_async(host.raw(), loss.raw(), loss.device().index, loss.nbytes()));
    l.hosts_.push_back(std::move(host));
  }
  return l;
}

double StepLoss::get() const {
  UNETCU_CHECK(valid_, "no step loss to read");
  double mean = value_;
  for (size_t i = 0; i < hosts_.size(); ++i) {
    cuda::host_wait(done_[i]);
    mean += hosts_[i].item() / count_;
  }
  if (check_) check_();
  return mean;
}

std::vector<Tensor> SingleDeviceStrategy::forward_backward(const Tensor& images, const Tensor& masks) {
  optimizer_->zero_grad();
  const int64_t rows = images.dim(0);
  const int64_t chunk = accumulate_rows_ > 0 && accumulate_rows_ < rows ? accumulate_rows_ : rows;
  std::vector<Tensor> losses;
  for (int64_t lo = 0; lo < rows; lo += chunk) {
    const int64_t hi = std::min(lo + chunk, rows);
    Tape tape;
    TapeScope scope(tape);
    if (chunk == rows) {
      losses.push_back(segmentation_loss(loss_, model_->forward(images), masks));
    } else {
      // Gradient accumulation: each chunk's loss weighted by its share of the batch.
      losses.push_back(scale(segmentation_loss(loss_, model_->forward(images.rows(lo, hi)), masks.rows(lo, hi)),
                             double(hi - lo) / double(rows)));
    }
    tape.backward(losses.back());
  }
  return losses;
}

StepLoss SingleDeviceStrategy::step_async(const PlacedBatch& batch) {
  const Batch& b = batch.parts.at(0);
  const std::vector<Tensor>* captured = graph_step(b);
  const std::vector<Tensor> losses = captured ? *captured : forward_backward(b.images, b.masks);
  optimizer_->step();
  return StepLoss::sum_of(losses);
}

Tensor SingleDeviceStrategy::infer(const Tensor& images) { return model_->forward(on(images, device_)); }

// ---- data parallel --------------------------------------------------------------------------

DataParallelStrategy::DataParallelStrategy(const UNetConfig& model, const DataParallelOptions& options,
                                           const OptimizerFactory& make_optimizer, LossKind loss)
    : TrainingStrategy(loss, options.devices, first_of(options.devices, "data parallelism needs at least one device")),
      dp_(model, options, make_optimizer) {
  if (options.across_processes)
    layout_ = {dp_.global_size(), dp_.global_rank(), dp_.global_size(), dp_.global_rank(), dp_.global_size()};
  else
    layout_.replicas = dp_.global_size();
}

std::string DataParallelStrategy::describe() const {
  const auto& o = dp_.options();
  if (o.across_processes)
    return "data parallel across processes, " + std::to_string(dp_.global_size()) +
           " ranks (this one: rank " + std::to_string(dp_.global_rank()) + " on " + o.devices[0].str() +
           "), " + name_of(kAllReduceNames, o.allreduce) + (o.bf16_allreduce ? " bf16" : "") + " all-reduce over " +
           (o.devices[0].is_cuda() ? std::string("NCCL") : process_group_transport()) +
           (o.sync_bn ? ", synchronized BN" : "") + (o.cuda_graphs ? ", CUDA graphs" : "");
  return "data parallel, " + std::to_string(dp_.size()) + " replicas on " + device_list_str(o.devices) +
         ", " + name_of(kAllReduceNames, o.allreduce) + (o.bf16_allreduce ? " bf16" : "") + " all-reduce" +
         (o.sync_bn ? ", synchronized BN" : "") + (o.cuda_graphs ? ", CUDA graphs" : "");
}

PlacedBatch DataParallelStrategy::place(Batch host) {
  const int N = dp_.size();
  const int64_t n = host.size();
  UNETCU_CHECK(n % N == 0, "data parallelism: a batch of ", n, " samples does not split into ", N,
               " equal shards");
  const int64_t b = n / N;
  PlacedBatch p{host, {}, {}};
  for (int r = 0; r < N; ++r) {
    const Device d = dp_.options().devices[r];
    p.parts.push_back({on(host.images.rows(r * b, (r + 1) * b), d), on(host.masks.rows(r * b, (r + 1) * b), d)});
  }
  return p;
}

StepLoss DataParallelStrategy::step_async(const PlacedBatch& batch) {
  std::vector<Tensor> losses = dp_.step_async(batch.parts, loss_);
  // Across processes this process has one replica: its loss becomes every replica's mean,
  // a collective queued behind the step like the step's own.
  if (dp_.options().across_processes) losses = {dp_.average_across_processes(losses.at(0))};
  // A collective aborted meanwhile (a rank failed, the watchdog's timeout) leaves the copied
  // values undefined: the reason is the error, not the number.
  return StepLoss::mean_of(losses, [this] { dp_.check_communicators(); });
}

Tensor DataParallelStrategy::infer(const Tensor& images) {
  return dp_.replica(0).forward(on(images, output_device()));
}

void DataParallelStrategy::set_training(bool on_) {
  for (int r = 0; r < dp_.size(); ++r) dp_.replica(r).train(on_);
}

void DataParallelStrategy::set_learning_rate(double lr) {
  for (int r = 0; r < dp_.size(); ++r) dp_.optimizer(r).set_lr(lr);
}

// ---- pipeline -------------------------------------------------------------------------------

PipelineStrategy::PipelineStrategy(const UNetConfig& model, const PipelineOptions& options,
                                   const OptimizerFactory& make_optimizer, LossKind loss)
    : TrainingStrategy(loss, options.devices,
                       first_of(options.devices, "model parallelism needs at least two stages (devices)")),
      pipe_(model, options, make_optimizer) {
  output_device_ = options.devices.back();
}

std::string PipelineStrategy::describe() const {
  const auto& o = pipe_.options();
  std::string cuts;
  for (int c : o.cuts) cuts += (cuts.empty() ? "" : ", ") + pipe_.model().blocks()[c - 1].name;
  return "model parallel, " + std::to_string(o.devices.size()) + " stages on " + device_list_str(o.devices) +
         " (cut after " + cuts + "), micro-batches of " + std::to_string(o.split_size) + ", " +
         name_of(kScheduleNames, o.schedule) + " schedule; BN statistics per micro-batch" +
         (o.cuda_graphs ? "; CUDA graphs" : "");
}

PlacedBatch PipelineStrategy::place(Batch host) {
  auto arrivals = std::make_shared<std::vector<Pipeline::StageArrival>>();
  PlacedBatch p{host, pipe_.place_ahead(host, arrivals.get()), {}};
  p.arrive = [this, arrivals] { pipe_.arrive(*arrivals); };
  return p;
}

StepLoss PipelineStrategy::step_async(const PlacedBatch& batch) {
  if (batch.arrive) batch.arrive();
  const std::vector<Tensor> losses = pipe_.step_async(batch.parts, loss_);
  live_micro_batches_ = pipe_.peak_live_micro_batches();
  // Copied behind the last stage's work on its stream, before the next step can rewrite them.
  std::unique_ptr<cuda::StreamScope> on_last;
  if (const cuda::Stream* last = pipe_.stream(pipe_.stages() - 1)) on_last = std::make_unique<cuda::StreamScope>(*last);
  return StepLoss::sum_of(losses);
}

Module& PipelineStrategy::model() {
  pipe_.synchronize();
  return pipe_.model();
}

std::vector<Optimizer*> PipelineStrategy::optimizers() {
  pipe_.synchronize();
  std::vector<Optimizer*> out;
  for (const auto& o : pipe_.optimizers()) out.push_back(o.get());
  return out;
}

// The stage threads took their rates when they queued their optimizers' steps (before
// step_async returned): no wait for the streams.
void PipelineStrategy::set_learning_rate(double lr) {
  for (const auto& o : pipe_.optimizers()) o->set_lr(lr);
}

// ---- pipeline across processes -------------------------------------------------------------

ProcessPipelineStrategy::ProcessPipelineStrategy(const UNetConfig& model, const PipelineOptions& options,
                                                 const DataParallelOptions& replicas,
                                                 const OptimizerFactory& make_optimizer, LossKind loss)
    : TrainingStrategy(loss, options.devices,
                       first_of(options.devices, "a pipeline across processes takes one device per process"), {}, true),
      pipe_(model, options, replicas, make_optimizer) {
  layout_ = {pipe_.replicas(), pipe_.world().rank(), pipe_.world().size(), pipe_.replica(), pipe_.replicas()};
}

std::string ProcessPipelineStrategy::describe() const {
  const auto& o = pipe_.options();
  std::string cuts;
  for (int c : o.cuts) cuts += (cuts.empty() ? "" : ", ") + pipe_.model().blocks()[c - 1].name;
  std::string s = "model parallel across processes, " + std::to_string(pipe_.stages()) + " stages";
  if (pipe_.replicas() > 1) s += " x " + std::to_string(pipe_.replicas()) + " data-parallel replicas";
  s += " over " + pipe_.world().transport() + " (this one: stage " + std::to_string(pipe_.stage()) +
       (pipe_.replicas() > 1 ? " of replica " + std::to_string(pipe_.replica()) : "") + " on " +
       o.devices[0].str() + "), cut after " + cuts + ", micro-batches of " + std::to_string(o.split_size) +
       ", " + name_of(kScheduleNames, o.schedule) + " schedule; BN statistics per micro-batch";
  if (pipe_.replicas() > 1)
    s += std::string("; each stage's gradients averaged over its replicas by ") +
         name_of(kAllReduceNames, pipe_.replica_options().allreduce) +
         (pipe_.replica_options().bf16_allreduce ? " bf16" : "") + " all-reduce";
  return s;
}

PlacedBatch ProcessPipelineStrategy::place(Batch host) {
  auto arrivals = std::make_shared<std::vector<Arrival>>();
  PlacedBatch p{host, pipe_.place_ahead(host, arrivals.get()), {}};
  p.arrive = [arrivals] {
    for (const Arrival& a : *arrivals) a.wait();
  };
  return p;
}

StepLoss ProcessPipelineStrategy::step_async(const PlacedBatch& batch) {
  if (batch.arrive) batch.arrive();
  const double loss = pipe_.step(batch.parts, loss_);
  live_micro_batches_ = {pipe_.peak_live_micro_batches()};
  return StepLoss::ready(loss);
}

Tensor ProcessPipelineStrategy::infer(const Tensor& images) {
  return pipe_.model().forward(on(images, output_device()));
}

std::vector<Optimizer*> ProcessPipelineStrategy::optimizers() {
  std::vector<Optimizer*> out;
  for (const auto& o : pipe_.optimizers()) out.push_back(o.get());
  return out;
}

// ---- choosing one ---------------------------------------------------------------------------

namespace {

// Two stages: profile the blocks on the first stage's device, predict every cut x split size,
// run the best few for real, print the article's Table 1, return the fastest.
PipelineOptions search_split(const StrategyConfig& c, PipelineOptions o, const Batch& batch,
                             std::ostream& out) {
  o.search_split = false;
  UNETCU_CHECK(o.devices.size() == 2, "the split search cuts the model in two: give two stage devices");
  using Clock = std::chrono::steady_clock;
  const int B = int(batch.size());
  UNetConfig one = c.model;
  one.device = o.devices[0];
  UNet probe(one);
  probe.train();
  // Profiled with one stage's thread budget, the budget each stage will run with.
  const int saved_threads = cpu_threads();
  const int stage_threads = o.threads > 0 ? o.threads : std::max(1, saved_threads / int(o.devices.size()));
  std::vector<int> candidates, splits;
  for (int s = 1; s < B; s *= 2) candidates.push_back(s);
  candidates.push_back(B);
  if (c.mp.split_size) candidates = {c.mp.split_size};
  // Batch norm needs more than one value per channel at layer4 ((H/32)·(W/32) per sample): a
  // split size that makes a micro-batch too small for that is left out of the search.
  const int64_t deepest = (batch.images.dim(2) / 32) * (batch.images.dim(3) / 32);
  for (int s : candidates)
    if (int64_t(s) * deepest > 1 && (B % s == 0 || int64_t(B % s) * deepest > 1)) splits.push_back(s);
  UNETCU_CHECK(!splits.empty(), "the split search has no split size whose micro-batches batch norm "
               "can train at this image size");
  // Each block's time per sample at every candidate micro-batch size (small micro-batches
  // under-fill a device: the per-sample time depends on the size).
  const Batch on_dev = batch.images.device() == one.device
                           ? batch
                           : Batch{batch.images.to(one.device), batch.masks.to(one.device)};
  std::vector<Batch> sizes;
  for (int s : splits) sizes.push_back({on_dev.images.rows(0, s), on_dev.masks.rows(0, s)});
  if (o.devices[0].is_cpu()) set_cpu_threads(stage_threads);
  const auto blocks = profile_blocks_by_batch(probe, sizes, c.loss, 2);
  set_cpu_threads(saved_threads);
  auto plans = rank_plans(blocks, B, splits, o.schedule, LinkModel{});
  const size_t run = std::min<size_t>(3, plans.size());
  for (size_t k = 0; k < run; ++k) {
    PipelineOptions trial = o;
    trial.cuda_graphs = false;  // three steps each: the capture would be one of the timed
    trial.cuts = plans[k].cuts;
    trial.split_size = plans[k].split_size;
    PipelineStrategy pipe(c.model, trial, optimizer_factory(c.optimizer), c.loss);
    const PlacedBatch placed = pipe.place(batch);
    std::vector<double> t;
    for (int s = 0; s < 3; ++s) {
      const auto t0 = Clock::now();
      pipe.step(placed);
      if (s) t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());  // the first warms up
    }
    plans[k].measured_s = *std::min_element(t.begin(), t.end());
  }
  size_t best = 0;
  for (size_t k = 1; k < run; ++k)
    if (plans[k].measured_s < plans[best].measured_s) best = k;
  out << "split search (" << name_of(kScheduleNames, o.schedule) << ", batch " << B << "; the best "
      << run << " predictions run for real):\n"
      << plans_table(plans, blocks) << "chosen: cut after " << blocks[plans[best].cuts[0] - 1].name
      << ", split_size " << plans[best].split_size << "\n";
  o.cuts = plans[best].cuts;
  o.split_size = plans[best].split_size;
  return o;
}

}  // namespace

void StrategyConfig::check(int batch_size, const DistEnv& dist) const {
  optimizer.check();
  placed(dp, *this).check();
  UNETCU_CHECK(model.width_divisor >= 1 && model.width_divisor <= 64, setting("width_divisor"),
               " must be in 1..64, got ", model.width_divisor);
  UNETCU_CHECK(threads >= 0 && threads <= kMaxThreads, setting("threads"), " must be in 0..", kMaxThreads, ", got ",
               threads);
  UNETCU_CHECK(devices.size() <= 64, setting("devices"), " lists ", devices.size(), " devices; at most 64");
  for (const Device& d : devices)
    UNETCU_CHECK(d.kind == devices[0].kind, setting("devices"), " must be all CPU devices or all GPUs, got ",
                 device_list_str(devices));
  UNETCU_CHECK(mode != Mode::Single || devices.empty(), setting("devices"), " belongs to ", setting("mode"),
               " dp or mp");
  UNETCU_CHECK(mode == Mode::DP || !dp.sync_bn, setting("sync_bn"), " belongs to ", setting("mode"), " dp");
  UNETCU_CHECK(!dp.bf16_allreduce || mode == Mode::DP || mode == Mode::DPMP, setting("allreduce_precision"),
               " belongs to ", setting("mode"), " dp and dp+mp");
  UNETCU_CHECK(mode != Mode::DPMP || !cuda_graphs, setting("cuda_graphs"), " belongs to ", setting("mode"),
               " single, dp or mp (GPUs)");
  UNETCU_CHECK(!cuda_graphs || !across_processes || mode == Mode::DP, setting("cuda_graphs"),
               " under a launcher belongs to ", setting("mode"), " dp (one GPU replica per process); ",
               setting("mode"), " ", name_of(kModeNames, mode), " with graphs runs in one process: drop it, or give ",
               setting("dist"), " none");
  UNETCU_CHECK(mode == Mode::DPMP || mp.pipeline_stages == 0, setting("pipeline_stages"), " belongs to ",
               setting("mode"), " dp+mp");
  const auto each_once = [&] {
    for (size_t i = 0; i < devices.size(); ++i)
      for (size_t j = 0; j < i; ++j)
        UNETCU_CHECK(devices[i] != devices[j], setting("devices"), " lists ", devices[i].str(), " twice");
  };
  switch (mode) {
    case Mode::Single:
      break;
    case Mode::Auto:
      UNETCU_CHECK(!across_processes, setting("mode"), " auto chooses its plan in one process; under a launcher give ",
                   setting("mode"), " dp, mp or dp+mp (or ", setting("dist"), " none to ignore the launcher)");
      each_once();
      break;
    case Mode::DP:
      UNETCU_CHECK(!devices.empty() || across_processes, setting("mode"), " dp needs ", setting("devices"),
                   " (e.g. cpu:0,cpu:1), or a launcher (mpirun -np N, torchrun)");
      each_once();
      break;
    case Mode::DPMP:
      UNETCU_CHECK(across_processes, setting("mode"),
                   " dp+mp runs one stage per process: start stages x replicas processes with a launcher (mpirun, "
                   "srun, torchrun)");
      UNETCU_CHECK(mp.pipeline_stages >= 2, setting("mode"), " dp+mp needs ", setting("pipeline_stages"),
                   " (at least 2), got ", mp.pipeline_stages);
      UNETCU_CHECK(dist.world % mp.pipeline_stages == 0, setting("pipeline_stages"), " ", mp.pipeline_stages,
                   " does not divide the ", dist.world, " processes into replicas");
      [[fallthrough]];
    case Mode::MP:
      if (across_processes) {
        const int stages = mode == Mode::MP ? dist.world : mp.pipeline_stages;
        UNETCU_CHECK(!mp.search_split, setting("split"), " auto searches in one process; across processes give the "
                     "cuts (e.g. ", setting("split"), " layer3)");
        UNETCU_CHECK(int(mp.cuts.size()) + 1 == stages, setting("split"), " makes ", mp.cuts.size() + 1,
                     " stages but there are ", stages,
                     mode == Mode::MP ? " processes (one stage each)" : str_cat(" ", setting("pipeline_stages")));
        UNETCU_CHECK(devices.empty(), setting("devices"),
                     ": across processes each stage is this process's device (GPU local_rank, or the CPU)");
        UNETCU_CHECK(mp.split_size >= 0 && mp.split_size <= batch_size, setting("split_size"), " must be in 0..",
                     setting("batch_size"), " ", batch_size, ", got ", mp.split_size);
        break;
      }
      UNETCU_CHECK(!devices.empty(), setting("mode"), " mp needs ", setting("devices"),
                   " (one per stage, e.g. cpu:0,cpu:1)");
      UNETCU_CHECK(devices.size() >= 2, setting("mode"), " mp needs at least two stage devices, got ",
                   device_list_str(devices));
      UNETCU_CHECK(mp.split_size >= 0, setting("split_size"), " must be at least 1, got ", mp.split_size);
      UNETCU_CHECK(mp.split_size <= batch_size, setting("split_size"), " ", mp.split_size, " is larger than ",
                   setting("batch_size"), " ", batch_size);
      if (mp.search_split)
        UNETCU_CHECK(devices.size() == 2, setting("split"), " auto searches two-stage cuts: give two ",
                     setting("devices"));
      else
        UNETCU_CHECK(mp.cuts.size() + 1 == devices.size(), setting("split"), " makes ", mp.cuts.size() + 1,
                     " stages but ", setting("devices"), " lists ", devices.size());
      break;
  }
}

std::unique_ptr<TrainingStrategy> make_strategy(const StrategyConfig& c, const Batch* probe,
                                                std::ostream& out) {
  UNETCU_CHECK(!c.devices.empty(), "a training strategy needs at least one device");
  const OptimizerFactory make_optimizer = optimizer_factory(c.optimizer);
  switch (c.mode) {
    case Mode::Single:
      UNETCU_CHECK(c.devices.size() == 1, "one-device training takes one device, got ", c.devices.size());
      return std::make_unique<SingleDeviceStrategy>(c.model, c, make_optimizer, c.loss);
    case Mode::DP:
      return std::make_unique<DataParallelStrategy>(c.model, placed(c.dp, c), make_optimizer, c.loss);
    case Mode::DPMP:
    case Mode::MP: {
      if (c.across_processes) {
        UNETCU_CHECK(!c.mp.search_split, "the split search runs in one process (two stage devices); across "
                     "processes give the cuts");
        return std::make_unique<ProcessPipelineStrategy>(c.model, placed(c.mp, c), placed(c.dp, c), make_optimizer,
                                                         c.loss);
      }
      UNETCU_CHECK(c.mode == Mode::MP, "data x pipeline parallelism runs one stage per process: "
                   "start S x R processes (mpirun, srun, torchrun)");
      PipelineOptions o = placed(c.mp, c);
      if (o.search_split) {
        UNETCU_CHECK(probe, "the split search needs a probe batch");
        o = search_split(c, o, *probe, out);
      }
      UNETCU_CHECK(o.split_size >= 1, "model parallelism: the split size must be at least 1");
      return std::make_unique<PipelineStrategy>(c.model, o, make_optimizer, c.loss);
    }
    case Mode::Auto:
      throw Error("the automatic mode chooses its plan (train/auto_mode.h) before a strategy is made");
  }
  throw Error("unknown training mode");
}

}  // namespace unetcu
