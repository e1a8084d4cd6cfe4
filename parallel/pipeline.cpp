#include "parallel/pipeline.h"

#include <omp.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <map>
#include <set>
#include <sstream>

#include "engine/profiler.h"
#include "engine/tape.h"

namespace unetcu {

Schedule parse_schedule(const std::string& s) {
  if (s == "gpipe") return Schedule::GPipe;
  if (s == "1f1b") return Schedule::OneFOneB;
  throw Error("unknown --schedule '" + s + "' (expected gpipe or 1f1b)");
}

std::vector<Device> parse_stage_devices(const std::string& s) {
  std::vector<Device> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(Device::parse(item));
  UNETCU_CHECK(out.size() >= 2, "--mode mp needs at least two stage devices, got '", s, "'");
  for (const Device& d : out)
    UNETCU_CHECK(d.kind == out[0].kind, "--devices must be all CPU devices or all GPUs, got ", s);
  return out;
}

std::vector<int> parse_cuts(const std::string& spec, const UNet& model) {
  const auto& blocks = model.blocks();
  std::vector<int> cuts;
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    int after = -1;
    if (std::all_of(item.begin(), item.end(), ::isdigit)) {
      after = std::stoi(item);
    } else {
      for (size_t b = 0; b < blocks.size(); ++b) {
        const std::string& n = blocks[b].name;
        if (n == item || (n.size() > item.size() && n.compare(n.size() - item.size(), item.size(), item) == 0 &&
                          n[n.size() - item.size() - 1] == '.'))
          after = int(b);
      }
    }
    UNETCU_CHECK(after >= 0 && after + 1 < int(blocks.size()), "--split: '", item,
                 "' is not a block the model can be cut after (blocks: encoder.stem, "
                 "encoder.layer1..4, decoder.blocks.0..4, segmentation_head; or their index)");
    cuts.push_back(after + 1);
  }
  UNETCU_CHECK(!cuts.empty(), "--split is empty");
  for (size_t i = 1; i < cuts.size(); ++i)
    UNETCU_CHECK(cuts[i] > cuts[i - 1], "--split: cuts must be in increasing block order");
  return cuts;
}

namespace {

// Rows [lo, hi) of a host NCHW tensor, as a new tensor.
Tensor slice_rows(const Tensor& t, int64_t lo, int64_t hi) {
  Shape s = t.shape();
  s[0] = hi - lo;
  Tensor out = Tensor::empty(s, t.dtype());
  const size_t row = t.nbytes() / size_t(t.dim(0));
  std::memcpy(out.raw(), static_cast<const char*>(t.raw()) + row * lo, row * size_t(hi - lo));
  return out;
}

}  // namespace

struct Pipeline::Impl {};

Pipeline::Pipeline(const UNetConfig& model_cfg, const PipelineOptions& options,
                   const OptimizerFactory& make_optimizer)
    : options_(options) {
  const int S = int(options.devices.size());
  UNETCU_CHECK(S >= 2, "model parallelism needs at least two stages (devices)");
  UNETCU_CHECK(int(options.cuts.size()) == S - 1, "model parallelism: ", S, " devices need ", S - 1,
               " cuts, got ", options.cuts.size());
  UNetConfig cfg = model_cfg;
  cfg.device = options.devices[0];
  model_ = std::make_unique<UNet>(cfg);
  const auto& blocks = model_->blocks();
  stage_of_block_.assign(blocks.size(), 0);
  for (size_t b = 0; b < blocks.size(); ++b)
    for (int c : options.cuts)
      if (int(b) >= c) ++stage_of_block_[b];
  for (int c : options.cuts)
    UNETCU_CHECK(c > 0 && c < int(blocks.size()), "model parallelism: cut ", c, " out of range");
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
  if (options_.threads_per_stage <= 0)
    options_.threads_per_stage = std::max(1, omp_get_num_procs() / S);
  pool_ = std::make_unique<WorkerPool>(options.devices, options_.threads_per_stage, "compute stage");
  for (int s = 0; s < S; ++s)
    streams_.push_back(options.devices[s].is_cuda()
                           ? std::make_unique<cuda::Stream>(options.devices[s].index)
                           : nullptr);
}

Pipeline::~Pipeline() = default;

Tensor Pipeline::infer(const Tensor& images) {
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

double Pipeline::step(const Batch& batch, LossKind loss_kind) {
  const int64_t B = batch.images.dim(0);
  const int split = options_.split_size;
  UNETCU_CHECK(split >= 1, "--split-size must be at least 1, got ", split);
  UNETCU_CHECK(split <= B, "--split-size ", split, " is larger than the batch of ", B);
  UNETCU_CHECK(batch.images.device().is_cpu(), "the pipeline takes host batches");
  const int M = int((B + split - 1) / split);
  const int S = stages();
  const auto& blocks = model_->blocks();

  struct MicroBatch {
    Tape tape;
    std::map<int, Tensor> outputs;   // block -> output, made on this stage
    std::map<int, Tensor> received;  // block -> this stage's copy of another stage's output
    Tensor loss;
  };
  std::vector<std::vector<MicroBatch>> mb(S);
  for (auto& v : mb) v = std::vector<MicroBatch>(M);
  std::vector<std::vector<char>> fwd_done(S, std::vector<char>(M, 0)), bwd_done = fwd_done;
  // GPU stages: the point of the producer's stream where (stage, micro-batch) was done.
  std::vector<std::vector<cuda::Event>> fwd_event(S, std::vector<cuda::Event>(M)),
      bwd_event = fwd_event;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Tensor> images(M), masks(M);
  std::vector<double> weight(M);
  for (int m = 0; m < M; ++m) {
    const int64_t lo = int64_t(m) * split, hi = std::min<int64_t>(lo + split, B);
    images[m] = slice_rows(batch.images, lo, hi);
    masks[m] = slice_rows(batch.masks, lo, hi);
    weight[m] = double(hi - lo) / double(B);
  }
  peak_live_.assign(S, 0);
  {
    std::lock_guard<std::mutex> lock(transfers_mu_);
    transfers_.clear();
  }
  bool failed = false;  // a stage threw: the others stop waiting for it
  auto wait_for = [&](auto pred) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return failed || pred(); });
    if (failed) throw Error("pipeline step aborted: another stage failed");
  };
  auto mark = [&](std::vector<std::vector<char>>& flags, int s, int m) {
    {
      std::lock_guard<std::mutex> lock(mu);
      flags[s][m] = 1;
    }
    cv.notify_all();
  };

  std::exception_ptr first_error;
  auto stage_body = [&](int s) {
    const Device dev = options_.devices[s];
    std::unique_ptr<cuda::StreamScope> on_stream;
    if (dev.is_cuda()) on_stream = std::make_unique<cuda::StreamScope>(*streams_[s]);
    // Consumers' copies whose gradients this stage read: on a GPU their memory belongs to the
    // consumer's stream, which could hand it out again before this stream has read it, so
    // they live until this stage's stream is synchronised at the end of the step.
    std::vector<Tensor> keep_alive;
    // Marks (stage, m) done: records where its stream is, then tells the host threads.
    auto finish = [&](std::vector<std::vector<char>>& flags,
                      std::vector<std::vector<cuda::Event>>& events, int m) {
      if (dev.is_cuda()) events[s][m] = cuda::Event::record(dev.index);
      mark(flags, s, m);
    };
    // Makes this stage's stream wait for another stage's (stage, m) work.
    auto after = [&](const std::vector<std::vector<cuda::Event>>& events, int p, int m) {
      if (dev.is_cuda()) events[p][m].wait(dev.index);
    };
    optimizers_[s]->zero_grad();
    int live = 0;
    auto forward = [&](int m) {
      wait_for([&] {
        for (int p = 0; p < s; ++p)
          if (!fwd_done[p][m]) return false;
        return true;
      });
      MicroBatch& me = mb[s][m];
      {
        TapeScope scope(me.tape);
        for (size_t b = 0; b < blocks.size(); ++b) {
          if (stage_of_block_[b] != s) continue;
          std::vector<Tensor> in;
          for (int i : blocks[b].inputs) {
            if (i < 0) {
              in.push_back(images[m].to(dev));
            } else if (stage_of_block_[i] == s) {
              in.push_back(me.outputs.at(i));
            } else {  // straight from the stage that made it
              Tensor copy;
              {
                std::lock_guard<std::mutex> lock(mu);
                auto it = me.received.find(i);
                if (it != me.received.end()) copy = it->second;
              }
              if (!copy.defined()) {
                const int p = stage_of_block_[i];
                after(fwd_event, p, m);
                copy = mb[p][m].outputs.at(i).detach().to(dev);
                copy.set_requires_grad(true);
                {
                  std::lock_guard<std::mutex> lock(mu);
                  me.received.emplace(i, copy);
                }
                std::lock_guard<std::mutex> lock(transfers_mu_);
                transfers_.push_back({p, s, i, m});
              }
              in.push_back(copy);
            }
          }
          BlockScope block_scope(blocks[b].name);
          ProfileRange range(blocks[b].name, "block");
          me.outputs[int(b)] = blocks[b].forward(in);
        }
        if (s == S - 1)
          me.loss = scale(segmentation_loss(loss_kind, me.outputs.at(int(blocks.size()) - 1),
                                            masks[m].to(dev)),
                          weight[m]);
      }
      peak_live_[s] = std::max(peak_live_[s], ++live);
      finish(fwd_done, fwd_event, m);
    };
    auto backward = [&](int m) {
      MicroBatch& me = mb[s][m];
      if (s == S - 1) {
        me.tape.backward(me.loss);
      } else {
        wait_for([&] {
          for (int c = s + 1; c < S; ++c)
            if (!bwd_done[c][m]) return false;
          return true;
        });
        // The later stages' backward of m is done on their streams: their gradients (and
        // their reads of this stage's outputs) are complete before this stream goes on.
        for (int c = s + 1; c < S; ++c) after(bwd_event, c, m);
        // Seeds: each output some later stage used, with the sum of their gradients.
        std::vector<Tensor> outs, grads;
        for (auto& [b, out] : me.outputs) {
          Tensor sum;
          for (int c = s + 1; c < S; ++c) {
            Tensor copy;
            {  // another producer stage may be taking its own copies from the same map
              std::lock_guard<std::mutex> lock(mu);
              auto it = mb[c][m].received.find(b);
              if (it == mb[c][m].received.end()) continue;
              copy = it->second;
              mb[c][m].received.erase(it);  // its gradient comes home now
            }
            if (!copy.grad().defined()) continue;
            if (dev.is_cuda()) keep_alive.push_back(copy);
            Tensor g = copy.grad().to(dev);
            sum = sum.defined() ? add(sum, g) : g;
          }
          if (sum.defined()) {
            outs.push_back(out);
            grads.push_back(sum);
          }
        }
        if (outs.empty())
          me.tape.clear();
        else
          me.tape.backward(outs, grads);
      }
      me.outputs.clear();
      --live;
      finish(bwd_done, bwd_event, m);
    };
    if (options_.schedule == Schedule::GPipe) {
      for (int m = 0; m < M; ++m) forward(m);
      for (int m = 0; m < M; ++m) backward(m);
    } else {
      const int warm = std::min(S - s - 1, M);
      for (int m = 0; m < warm; ++m) forward(m);
      for (int i = 0; i < M - warm; ++i) {
        forward(warm + i);
        backward(i);
      }
      for (int m = M - warm; m < M; ++m) backward(m);
    }
    if (dev.is_cuda()) cuda::synchronize(dev.index);  // the end of the step: this stage's stream
    keep_alive.clear();
  };
  try {
    pool_->run([&](int s) {
      try {
        stage_body(s);
      } catch (...) {
        {
          std::lock_guard<std::mutex> lock(mu);
          if (!failed) first_error = std::current_exception();
          failed = true;
        }
        cv.notify_all();
        throw;
      }
    });
  } catch (...) {
    if (first_error) std::rethrow_exception(first_error);
    throw;
  }
  // All backwards are done: every stage steps its own parameters.
  pool_->run([&](int s) {
    std::unique_ptr<cuda::StreamScope> on_stream;
    if (streams_[s]) on_stream = std::make_unique<cuda::StreamScope>(*streams_[s]);
    optimizers_[s]->step();
    if (streams_[s]) cuda::synchronize(options_.devices[s].index);
  });
  double loss = 0;
  for (int m = 0; m < M; ++m) loss += mb[S - 1][m].loss.item();
  return loss;
}

}  // namespace unetcu
