#include "parallel/pipeline.h"

#include <omp.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <map>

#include "engine/profiler.h"
#include "engine/tape.h"

namespace unetcu {

Pipeline::Pipeline(const UNetConfig& model_cfg, const PipelineOptions& options,
                   const OptimizerFactory& make_optimizer)
    : options_(options), graph_(options.cuda_graphs) {
  const int S = int(options.devices.size());
  UNETCU_CHECK(S >= 2, "model parallelism needs at least two stages (devices)");
  UNETCU_CHECK(int(options.cuts.size()) == S - 1, "model parallelism: ", S, " stages need ", S - 1,
               " cuts, got ", options.cuts.size());
  for (const Device& d : options.devices)
    UNETCU_CHECK(d.kind == options.devices[0].kind,
                 "model parallelism: the stages must be all on CPU devices or all on GPUs");
  // Activations and gradients cross between the stages' GPUs (the UNet's skips from any stage
  // to any later one): straight over the interconnect where the GPUs allow peer access, else
  // the driver stages the copies through host memory.
  for (size_t a = 0; a < options.devices.size(); ++a)
    for (size_t b = a + 1; b < options.devices.size(); ++b)
      if (options.devices[a].is_cuda() && options.devices[b].is_cuda())
        cuda::enable_peer_access(options.devices[a].index, options.devices[b].index);
  UNETCU_CHECK(options.split_size >= 1, "model parallelism: the split size must be at least 1, got ",
               options.split_size);
  UNETCU_CHECK(!options.cuda_graphs || options.devices[0].is_cuda(),
               "CUDA graphs need GPU stages; ", device_list_str(options.devices), " run eagerly");
  UNetConfig cfg = model_cfg;
  cfg.device = options.devices[0];
  model_ = std::make_unique<UNet>(cfg);
  const auto& blocks = model_->blocks();
  stage_of_block_ = stages_of_blocks(*model_, options.cuts, "model parallelism");
  // Place each block's modules on its stage's device, then give each stage its optimizer.
  std::vector<std::vector<Tensor>> stage_params(S);
  for (size_t b = 0; b < blocks.size(); ++b)
    for (Module* m : blocks[b].modules) {
      m->move_to(options.devices[stage_of_block_[b]]);
      for (const Tensor& p : m->parameters()) stage_params[stage_of_block_[b]].push_back(p);
    }
  for (int s = 0; s < S; ++s) {
    UNETCU_CHECK(!stage_params[s].empty(), "model parallelism: stage ", s, " has no blocks");
    optimizers_.push_back(make_optimizer(stage_params[s]));
  }
  if (options_.threads <= 0)
    options_.threads = std::max(1, omp_get_num_procs() / S);
  pool_ = std::make_unique<WorkerPool>(options.devices, options_.threads, "compute stage");
  for (int s = 0; s < S; ++s)
    streams_.push_back(options.devices[s].is_cuda()
                           ? std::make_unique<cuda::Stream>(options.devices[s].index)
                           : nullptr);
  parameters_placed();
}

void Pipeline::parameters_placed() {
  // The parameters were copied to the GPUs on this thread's stream; the stages read them on
  // their own streams.
  for (const Device& d : options_.devices)
    if (d.is_cuda()) cuda::synchronize(d.index);
}

Pipeline::~Pipeline() {
  // The steps still queued read the model's and optimizers' memory, given back below.
  try {
    synchronize();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "warning: a pipeline's queued step failed as it was destroyed: %s\n", e.what());
  }
}

std::vector<Batch> Pipeline::place(const Batch& batch) {
  std::vector<StageArrival> arrivals;
  std::vector<Batch> out = place_ahead(batch, &arrivals);
  arrive(arrivals);
  return out;
}

void Pipeline::arrive(const std::vector<StageArrival>& arrivals) {
  for (const StageArrival& a : arrivals) {
    const auto& stream = streams_.at(size_t(a.stage));
    std::unique_ptr<cuda::StreamScope> on_stream;
    if (stream) on_stream = std::make_unique<cuda::StreamScope>(*stream);
    a.arrival.wait();
  }
}

std::vector<Batch> Pipeline::place_ahead(const Batch& batch, std::vector<StageArrival>* arrivals) {
  const int64_t B = batch.size();
  UNETCU_CHECK(B >= 1, "model parallelism: an empty batch");
  // An epoch's smaller last batch may be smaller than the split size: one micro-batch then.
  const int64_t split = std::min<int64_t>(options_.split_size, B);
  const int S = stages();
  // The copies run on the devices' upload streams (Tensor::upload_ahead), beside the stages'
  // work; the stage's own stream waits for them when arrive() is called.
  auto upload = [&](const Tensor& t, int s) {
    const Device dev = options_.devices[s];
    if (t.device() == dev) return t;  // a view of the batch: its caller keeps it until the step is done
    Arrival a = t.upload_ahead(dev);
    arrivals->push_back({s, a});
    return a.tensor;
  };
  std::vector<Batch> out;
  for (int64_t lo = 0; lo < B; lo += split) {
    const int64_t hi = std::min<int64_t>(lo + split, B);
    out.push_back({upload(batch.images.rows(lo, hi), 0), upload(batch.masks.rows(lo, hi), S - 1)});
  }
  return out;
}

Tensor Pipeline::infer(const Tensor& images) {
  synchronize();  // the parameters the last step_async() updates on the stages' streams
  // In micro-batches of the split size: no more of the batch on a stage at once than a
  // training step puts there.
  const int64_t n = images.dim(0), m = std::max(1, options_.split_size);
  if (n <= m) return infer_micro_batch(images);
  Tensor out;
  for (int64_t r = 0; r < n; r += m) {
    const Tensor part = infer_micro_batch(images.rows(r, std::min(n, r + m)));
    if (!out.defined()) {
      Shape s = part.shape();
      s[0] = n;
      out = Tensor::empty(s, part.dtype(), part.device(), part.format());
    }
    out.rows(r, r + part.dim(0)).copy_(part);
  }
  return out;
}

Tensor Pipeline::infer_micro_batch(const Tensor& images) {
  const auto& blocks = model_->blocks();
  std::vector<Tensor> outs(blocks.size());
  for (size_t b = 0; b < blocks.size(); ++b) {
    const Device dev = options_.devices[stage_of_block_[b]];
    std::vector<Tensor> in;
    for (int i : blocks[b].inputs) {
      const Tensor& t = i < 0 ? images : outs[i];
      in.push_back(t.device() == dev ? t : t.to(dev));
    }
    outs[b] = blocks[b].forward(in);
  }
  return outs.back();
}

std::vector<Transfer> Pipeline::transfers() const {
  std::lock_guard<std::mutex> lock(transfers_mu_);
  return transfers_;
}

// One step's execution: every stage thread walks its schedule (StageRun); a tensor crosses a
// cut as a copy to the consumer's device, taken when the producer's forward is done, and its
// gradient comes back once the consumer's backward is.
class Pipeline::Run : public CutTransport {
 public:
  // Queued eagerly or into a CUDA graph over the stages' streams (Pipeline::graph_step): the
  // same calls, and nothing here waits for a stream.
  Run(Pipeline& p, const std::vector<Batch>& micro_batches, LossKind loss)
      : p_(p), S_(p.stages()), M_(int(micro_batches.size())), fwd_done_(S_, std::vector<char>(M_, 0)),
        bwd_done_(fwd_done_), fwd_event_(S_, std::vector<cuda::Event>(M_)), bwd_event_(fwd_event_) {
    for (int s = 0; s < S_; ++s)
      stages_.push_back(std::make_unique<StageRun>(*p.model_, p.stage_of_block_, s, S_, p.options_.schedule,
                                                   micro_batches, loss, *this));
  }

  // Stage s's whole step, on its own thread.
  void stage(int s) {
    std::unique_ptr<cuda::StreamScope> on_stream;
    if (p_.options_.devices[s].is_cuda()) on_stream = std::make_unique<cuda::StreamScope>(*p_.streams_[s]);
    p_.optimizers_[s]->zero_grad();
    stages_[s]->run();
    p_.peak_live_[s] = std::max(p_.peak_live_[s], stages_[s]->peak_live());
    // Nothing waits for the stream here: what this step's tensors held is handed out again
    // in stream order when the Run is destroyed (each block waits for every stream that used
    // it), and the next step's work on this stream follows this one's.
  }

  // A stage threw: the others stop waiting for it.
  void fail() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      failed_ = true;
    }
    cv_.notify_all();
  }

  // Each micro-batch's weighted loss, on the last stage's device.
  std::vector<Tensor> losses() const {
    std::vector<Tensor> out;
    for (int m = 0; m < M_; ++m) out.push_back(stages_[S_ - 1]->micro_batch(m).loss);
    return out;
  }

  void before_forward(int s, int m) override {
    wait_for([&] {
      for (int p = 0; p < s; ++p)
        if (!fwd_done_[p][m]) return false;
      return true;
    });
  }

  // This stage's copy of `block`'s output for micro-batch m, taken once from its producer.
  Tensor receive(int s, int m, int block) override {
    MicroBatch& me = stages_[s]->micro_batch(m);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = me.received.find(block);
      if (it != me.received.end()) return it->second;
    }
    const int p = p_.stage_of_block_[block];
    const Device dev = p_.options_.devices[s];
    after(dev, fwd_event_, p, m);
    // Ordered after the producer's event, recorded on the producer's stream (not on whatever
    // stream this thread has on the producer's device).
    Tensor copy = stages_[p]->micro_batch(m).outputs.at(block).detach().to_after(dev, fwd_event_[p][m]);
    copy.set_requires_grad(true);
    {
      std::lock_guard<std::mutex> lock(mu_);
      me.received.emplace(block, copy);
    }
    std::lock_guard<std::mutex> lock(p_.transfers_mu_);
    p_.transfers_.push_back({p, s, block, m});
    return copy;
  }

  void after_forward(int s, int m) override { finish(s, fwd_done_, fwd_event_, m); }

  void before_backward(int s, int m) override {
    wait_for([&] {
      for (int c = s + 1; c < S_; ++c)
        if (!bwd_done_[c][m]) return false;
      return true;
    });
    // The later stages' backward of m is done on their streams: their gradients (and
    // their reads of this stage's outputs) are complete before this stream goes on.
    for (int c = s + 1; c < S_; ++c) after(p_.options_.devices[s], bwd_event_, c, m);
  }

  // The sum of the later stages' gradients of `block`'s output, in stage order.
  Tensor gradient(int s, int m, int block) override {
    Tensor sum;
    for (int c = s + 1; c < S_; ++c) {
      Tensor copy;
      {  // another producer stage may be taking its own copies from the same map
        std::lock_guard<std::mutex> lock(mu_);
        auto& received = stages_[c]->micro_batch(m).received;
        auto it = received.find(block);
        if (it == received.end()) continue;
        copy = it->second;
        received.erase(it);  // its gradient comes home now
      }
      if (!copy.grad().defined()) continue;
      // The consumer's gradient is read on this stage's stream; the copy records that
      // stream as a user of its memory, so the consumer's stream does not hand it out again
      // before this stream has read it (cuda::copy_after).
      Tensor g = copy.grad().to_after(p_.options_.devices[s], bwd_event_[c][m]);
      sum = sum.defined() ? add(sum, g) : g;
    }
    return sum;
  }

  // The producers take the gradients of this stage's copies themselves (gradient()).
  void after_backward(int s, int m) override { finish(s, bwd_done_, bwd_event_, m); }

 private:
  using Flags = std::vector<std::vector<char>>;
  using Events = std::vector<std::vector<cuda::Event>>;

  template <class Pred>
  void wait_for(Pred pred) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return failed_ || pred(); });
    if (failed_) throw Error("pipeline step aborted: another stage failed");
  }
  // Marks (s, m) done: records where the stage's stream is, then tells the host threads.
  void finish(int s, Flags& flags, Events& events, int m) {
    const Device dev = p_.options_.devices[s];
    if (dev.is_cuda()) events[s][m] = cuda::Event::record(dev.index);
    {
      std::lock_guard<std::mutex> lock(mu_);
      flags[s][m] = 1;
    }
    cv_.notify_all();
  }
  // Makes this stage's stream (on `dev`) wait for another stage's (p, m) work.
  static void after(const Device& dev, const Events& events, int p, int m) {
    if (dev.is_cuda()) events[p][m].wait(dev.index);
  }

  Pipeline& p_;
  const int S_, M_;
  std::vector<std::unique_ptr<StageRun>> stages_;
  Flags fwd_done_, bwd_done_;
  // GPU stages: the point of the producer's stream where (stage, micro-batch) was done.
  Events fwd_event_, bwd_event_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool failed_ = false;
};

// Every stage's thread runs its part of `run`; the first error any of them threw is rethrown.
void Pipeline::run_stages(Run& run) {
  std::exception_ptr first_error;
  std::mutex error_mu;
  try {
    pool_->run([&](int s) {
      try {
        run.stage(s);
      } catch (...) {
        {
          std::lock_guard<std::mutex> lock(error_mu);
          if (!first_error) first_error = std::current_exception();
        }
        run.fail();
        throw;
      }
    });
  } catch (...) {
    if (first_error) std::rethrow_exception(first_error);
    throw;
  }
}

// All backwards are queued: every stage steps its own parameters on its stream. Gradient
// clipping takes the norm of the whole model's gradients: each stage's square sum is read on
// the host (on a GPU a wait for that stage's backward), the parts are added in stage order and
// every stage clips by the total, as a process per stage does (ProcessPipeline::step).
void Pipeline::step_optimizers() {
  const bool clip = optimizers_[0]->max_grad_norm() > 0 && stages() > 1;
  std::vector<double> part(size_t(stages()), 0.0);
  if (clip) {
    pool_->run([&](int s) {
      std::unique_ptr<cuda::StreamScope> on_stream;
      if (streams_[s]) on_stream = std::make_unique<cuda::StreamScope>(*streams_[s]);
      part[size_t(s)] = optimizers_[s]->grad_square_sum().item();
    });
  }
  double total = 0;
  for (double v : part) total += v;
  pool_->run([&](int s) {
    std::unique_ptr<cuda::StreamScope> on_stream;
    if (streams_[s]) on_stream = std::make_unique<cuda::StreamScope>(*streams_[s]);
    if (clip)
      optimizers_[s]->step_clipped_by(Tensor::full({1}, total, DType::F64, options_.devices[s]));
    else
      optimizers_[s]->step();
  });
}

void Pipeline::join_into(int stage) {
  std::vector<cuda::Event> tails;
  for (int s = 0; s < stages(); ++s) {
    if (s == stage || !streams_[s]) continue;
    cuda::StreamScope on_stage(*streams_[s]);
    tails.push_back(cuda::Event::record(options_.devices[s].index));
  }
  cuda::StreamScope on_target(*streams_[stage]);
  for (const cuda::Event& e : tails) e.wait(options_.devices[stage].index);
}

void Pipeline::join_last_stage() {
  if (!streams_[stages() - 1]) {  // a CPU last stage: its losses are read at once, so all of it is done
    synchronize();
    return;
  }
  join_into(stages() - 1);
}

void Pipeline::synchronize() {
  if (!in_flight_) return;
  for (size_t s = 0; s < streams_.size(); ++s) {
    if (!streams_[s]) continue;
    cuda::StreamScope on_stream(*streams_[s]);
    cuda::synchronize(options_.devices[s].index);
  }
  in_flight_ = false;
}

double Pipeline::step(const std::vector<Batch>& micro_batches, LossKind loss_kind) {
  const std::vector<Tensor> losses = step_async(micro_batches, loss_kind);
  synchronize();
  double l = 0;
  for (const Tensor& t : losses) l += t.item();
  return l;
}

std::vector<Tensor> Pipeline::step_async(const std::vector<Batch>& micro_batches, LossKind loss_kind) {
  UNETCU_CHECK(!micro_batches.empty(), "model parallelism: a step needs at least one micro-batch");
  const int S = stages();
  for (const Batch& b : micro_batches)
    UNETCU_CHECK(b.images.device() == options_.devices[0] && b.masks.device() == options_.devices[S - 1],
                 "model parallelism: micro-batches must be placed (images on ", options_.devices[0].str(),
                 ", masks on ", options_.devices[S - 1].str(), ")");
  std::vector<Tensor> losses;
  if (graph_step(micro_batches, loss_kind, &losses)) {
    join_last_stage();
    return losses;
  }
  peak_live_.assign(S, 0);
  {
    std::lock_guard<std::mutex> lock(transfers_mu_);
    transfers_.clear();
  }
  Run run(*this, micro_batches, loss_kind);
  // Set first: a stage that throws may have queued work already.
  for (const auto& st : streams_) in_flight_ = in_flight_ || st != nullptr;
  run_stages(run);
  step_optimizers();
  join_last_stage();
  return run.losses();
}

// ---- CUDA graphs ------------------------------------------------------------------------------

namespace {

// A step's graph key: each micro-batch's images and masks shapes, in turn, and the loss.
std::vector<Shape> graph_key(const std::vector<Batch>& micro_batches, LossKind loss) {
  std::vector<Shape> out;
  for (const Batch& b : micro_batches) {
    out.push_back(b.images.shape());
    out.push_back(b.masks.shape());
  }
  out.push_back({int64_t(loss)});
  return out;
}

}  // namespace

bool Pipeline::graph_step(const std::vector<Batch>& micro_batches, LossKind loss_kind,
                          std::vector<Tensor>* losses) {
  if (!graph_.due(model_->is_training(), graph_key(micro_batches, loss_kind))) return false;
  const int S = stages();
  if (!graph_.captured()) {
    // The steps before are done: this thread clears the gradients (the captured backwards
    // write every one first, beta 0) and gives the caches back.
    synchronize();
    std::vector<Optimizer*> opts;
    for (auto& o : optimizers_) opts.push_back(o.get());
    for (Optimizer* o : opts) o->zero_grad();
    for (const Device& d : options_.devices) GraphStep::release_cache(d);
    peak_live_.assign(S, 0);
    {
      std::lock_guard<std::mutex> lock(transfers_mu_);
      transfers_.clear();
    }
    std::vector<const cuda::Stream*> streams;
    for (const auto& st : streams_) streams.push_back(st.get());
    std::vector<Tensor> like;
    for (const Batch& b : micro_batches) {
      like.push_back(b.images);
      like.push_back(b.masks);
    }
    try {
      graph_.capture(0, *model_, like, streams, opts, [&](const std::vector<Tensor>& in) {
        std::vector<Batch> inputs;
        for (size_t m = 0; m < in.size(); m += 2) inputs.push_back({in[m], in[m + 1]});
        Run run(*this, inputs, loss_kind);
        run_stages(run);
        return run.losses();
      });
    } catch (const std::exception& e) {
      // Each stage's thread queued work into the capture: an error a failed call left there
      // must not be taken for the next eager launch's.
      pool_->run([](int) { cuda::clear_last_error(); });
      options_.cuda_graphs = false;
      graph_.fall_back("the pipeline's step", e.what());
      return false;
    }
    graph_.set_captured();
    captured_peak_live_ = peak_live_;
    captured_transfers_ = transfers();
  }
  GraphStep::Slot& c = graph_.slot(0);
  // The micro-batches were placed on their stages' streams: the images on the first's, the
  // masks on the last's. Each copy follows its upload there. The launch on the first stage's
  // stream (the graph's origin) follows what every stage's stream has queued: the masks' copy
  // on the last, and on each the step before (its optimizer, the reads of its losses, which
  // this replay rewrites).
  cuda::Stream& origin = *streams_[0];
  {
    cuda::StreamScope on_last(*streams_[S - 1]);
    for (size_t m = 0; m < micro_batches.size(); ++m) c.inputs[2 * m + 1].copy_(micro_batches[m].masks);
  }
  join_into(0);
  {
    cuda::StreamScope on_origin(origin);
    for (size_t m = 0; m < micro_batches.size(); ++m) c.inputs[2 * m].copy_(micro_batches[m].images);
    in_flight_ = true;
    c.launch();  // the graph, and the batch counts it adds
    graph_.count_replay();
    // The optimizers step on their stages' streams, after all of the graph.
    const cuda::Event replayed = cuda::Event::record(options_.devices[0].index);
    for (int s = 1; s < S; ++s) {
      cuda::StreamScope on_stage(*streams_[s]);
      replayed.wait(options_.devices[s].index);
    }
  }
  // An eager step in between (another shape) may have left gradients of its own: the
  // optimizers read the graph's.
  c.use_gradients(*model_);
  peak_live_ = captured_peak_live_;
  {
    std::lock_guard<std::mutex> lock(transfers_mu_);
    transfers_ = captured_transfers_;
  }
  step_optimizers();
  *losses = c.outputs;
  return true;
}

}  // namespace unetcu
