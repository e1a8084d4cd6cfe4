// Model (pipeline) parallelism: the UNet's block list cut into stages, each stage's blocks on
// its own device driven by its own host thread; a batch is split into micro-batches of
// split_size that flow through the stages so they work at the same time.
//
//  - A tensor that crosses a cut (the main path or a UNet skip) goes straight from the stage
//    that makes it to the stage that uses it: the consumer takes its own copy on its device
//    (a leaf of its tape), and the producer's backward starts from the sum of its consumers'
//    gradients, moved back to it. Nothing passes through the stages in between.
//  - Each (stage, micro-batch) has its own tape. Micro-batch m's loss is weighted by its share
//    of the batch; gradients accumulate over micro-batches; then each stage steps its own
//    optimizer on its own parameters. Batch norm uses each micro-batch's statistics.
//  - Schedules: GPipe (all forwards, then all backwards) and 1F1B (warm-up of S - s - 1
//    forwards on stage s, then one forward / one backward, then the remaining backwards).
//  - A stage waits for its inputs (and for its outputs' gradients) from the stages that make
//    them: the host thread until the producer has queued the work (a condition variable), and
//    on a GPU the consumer's stream until the producer's stream has done it (an event the
//    producer records), so no stage waits for the whole device. Each GPU stage has a stream of
//    its own; the step ends with each stage waiting for its stream.
#pragma once
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/cuda_api.h"
#include "engine/data.h"
#include "engine/optim.h"
#include "models/unet.h"
#include "parallel/data_parallel.h"
#include "parallel/worker_pool.h"

namespace unetcu {

enum class Schedule { GPipe, OneFOneB };
Schedule parse_schedule(const std::string& s);  // "gpipe" | "1f1b"

struct PipelineOptions {
  std::vector<Device> devices;   // one per stage; stages may share a device
  std::vector<int> cuts;         // first block of stages 1..S-1, increasing
  int split_size = 1;            // samples per micro-batch (the last may be smaller)
  Schedule schedule = Schedule::GPipe;
  int threads_per_stage = 0;     // CPU devices; 0: the cores shared out, at least 1
};

// Block index where a named cut starts ("layer3" -> the block after encoder.layer3, as in the
// article: encoder stem..layer3 on the first device, layer4 + decoder + head on the second),
// or a block name / index list "4,8".
std::vector<int> parse_cuts(const std::string& spec, const UNet& model);

// Parses "cpu:0,cpu:1" / "cuda:0,cuda:0": one device per stage; stages may share a device.
std::vector<Device> parse_stage_devices(const std::string& s);

struct Transfer {
  int from_stage, to_stage, block, micro_batch;
};

class Pipeline {
 public:
  Pipeline(const UNetConfig& model, const PipelineOptions& options,
           const OptimizerFactory& make_optimizer);
  ~Pipeline();

  // One optimizer step on a host batch; returns the batch loss (micro-batch losses weighted
  // by their share). Throws for split_size 0 or larger than the batch.
  double step(const Batch& batch, LossKind loss);

  UNet& model() { return *model_; }
  // Inference through the stages in the calling thread (no tape, no micro-batches): logits on
  // the last stage's device. Put the model in eval mode first for evaluation.
  Tensor infer(const Tensor& images);
  int stages() const { return int(options_.devices.size()); }
  // Of the last step: the most micro-batches whose activations a stage held at once.
  std::vector<int> peak_live_micro_batches() const { return peak_live_; }
  std::vector<Transfer> transfers() const;

 private:
  struct Impl;
  PipelineOptions options_;
  std::unique_ptr<UNet> model_;
  std::vector<std::unique_ptr<Optimizer>> optimizers_;  // one per stage
  std::vector<int> stage_of_block_;
  std::unique_ptr<WorkerPool> pool_;
  // GPU stages: a stream each, so stages sharing a GPU overlap (two streams on one GPU).
  std::vector<std::unique_ptr<cuda::Stream>> streams_;
  std::vector<int> peak_live_;
  mutable std::mutex transfers_mu_;
  std::vector<Transfer> transfers_;
};

}  // namespace unetcu
