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
//  - The order in which a stage runs its forwards and backwards is the schedule both pipelines
//    share (parallel/stage_run.h: GPipe, 1F1B); this one crosses a cut by copying between the
//    stages' devices.
//  - A stage waits for its inputs (and for its outputs' gradients) from the stages that make
//    them: the host thread until the producer has queued the work (a condition variable), and
//    on a GPU the consumer's stream until the producer's stream has done it (an event the
//    producer records), so no stage waits for the whole device. Each GPU stage has a stream of
//    its own. step() ends with the host waiting for every stage's stream; step_async() returns
//    once the stages' threads have queued the step, so the host queues the next one while the
//    GPUs run.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "data/batch.h"
#include "runtime/cuda_api.h"
#include "engine/named.h"
#include "engine/optim.h"
#include "engine/tape.h"
#include "models/unet.h"
#include "parallel/placement.h"
#include "parallel/stage_run.h"
#include "parallel/data_parallel.h"
#include "parallel/worker_pool.h"

namespace unetcu {

// The placement's devices hold one stage each in one process (stages may share a device),
// with `threads` each on CPU devices; across processes its one device holds this process's
// stage. cuda_graphs (GPU stages, in one process): after two eager steps at the first step's
// micro-batch shapes, the forwards and backwards of every stage and micro-batch at those shapes
// are captured into one CUDA graph over the stages' streams and replayed each step (the
// micro-batches copied into the graph's input tensors first); the optimizers step eagerly.
// Other shapes (a short last batch), eval mode and profiled steps run eagerly; a capture that
// fails says why once and the pipeline goes on eagerly.
struct PipelineOptions : Placement {
  std::vector<int> cuts;         // the first block of stages 1..S-1, increasing
  bool search_split = false;     // two stages: the cut and the split size searched (make_strategy)
  int split_size = 1;            // samples per micro-batch (the last may be smaller)
  Schedule schedule = Schedule::GPipe;
  int pipeline_stages = 0;       // across processes: stages per pipeline (0: one per process)
};

struct Transfer {
  int from_stage, to_stage, block, micro_batch;
};

class Pipeline {
 public:
  Pipeline(const UNetConfig& model, const PipelineOptions& options,
           const OptimizerFactory& make_optimizer);
  ~Pipeline();

  // The batch cut into micro-batches of split_size: images uploaded to the first stage's
  // device and masks to the last stage's, each on its stage's stream, so a step can be given
  // its input ahead of time. A batch smaller than the split size is one micro-batch.
  std::vector<Batch> place(const Batch& batch);
  // An upload placed ahead, and the stage whose stream reads it.
  struct StageArrival {
    int stage;
    Arrival arrival;
  };
  // place() with the stages' waits for the uploads left out (`arrivals` gets them): the copies
  // run beside what the stages do meanwhile (the step before, when the epoch loop places a
  // batch ahead of it), and arrive() makes each stage's stream wait for its own before the step
  // that reads them.
  std::vector<Batch> place_ahead(const Batch& batch, std::vector<StageArrival>* arrivals);
  void arrive(const std::vector<StageArrival>& arrivals);
  // One optimizer step on placed micro-batches; returns the batch loss (micro-batch losses
  // weighted by their share), every stage's stream waited for.
  double step(const std::vector<Batch>& micro_batches, LossKind loss);
  double step(const Batch& batch, LossKind loss) { return step(place(batch), loss); }
  // The same step, queued: on GPUs it returns once every stage's thread has queued its work
  // (forwards, backwards, optimizer), with each micro-batch's weighted loss on the last
  // stage's device (their sum is the batch loss), written on stream(stages() - 1), which then
  // follows every stage's work of the step (a read of them finds it all done); replayed as a
  // CUDA graph, the same tensors every step, so read them (or queue their copy on that stream)
  // before the next step. A next step_async() is ordered after this one on the streams.
  // Anything else that reads or writes the model's or the optimizers' state from this thread
  // calls synchronize() first (infer() does).
  std::vector<Tensor> step_async(const std::vector<Batch>& micro_batches, LossKind loss);
  // Waits for every GPU stage's stream: the steps queued by step_async() are done.
  void synchronize();
  // Stage s's stream (null for a CPU stage).
  const cuda::Stream* stream(int s) const { return streams_.at(size_t(s)).get(); }

  UNet& model() { return *model_; }
  const UNet& model() const { return *model_; }
  // Call after writing the model's or optimizers' state from this thread (a checkpoint):
  // on GPUs, waits for those copies, which the stages' streams do not wait for.
  void parameters_placed();
  const std::vector<std::unique_ptr<Optimizer>>& optimizers() const { return optimizers_; }
  const PipelineOptions& options() const { return options_; }
  // Inference through the stages in the calling thread (no tape), in micro-batches of the
  // split size: logits on the last stage's device. Put the model in eval mode first for
  // evaluation (in training mode batch norm would take each micro-batch's statistics).
  Tensor infer(const Tensor& images);
  int stages() const { return int(options_.devices.size()); }
  // Of the last step: the most micro-batches whose activations a stage held at once.
  std::vector<int> peak_live_micro_batches() const { return peak_live_; }
  std::vector<Transfer> transfers() const;
  bool graph_captured() const { return graph_.captured(); }  // cuda_graphs: replaying now
  int64_t graph_replays() const { return graph_.replays(); }   // steps run as the graph

 private:
  Tensor infer_micro_batch(const Tensor& images);
  class Run;  // one step's execution
  void run_stages(Run& run);
  // The step queued as the graph, *losses its micro-batches' losses; or false: run it eagerly.
  bool graph_step(const std::vector<Batch>& micro_batches, LossKind loss, std::vector<Tensor>* losses);
  void step_optimizers();
  // Stage `stage`'s stream (a GPU stage's) waits for what every other stage's has queued.
  void join_into(int stage);
  // join_into the last stage (step_async's end); a CPU last stage waits for all of them.
  void join_last_stage();
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
  // cuda_graphs: the captured step at the first step's micro-batch shapes, with what its
  // schedule held and moved.
  GraphStep graph_;
  std::vector<int> captured_peak_live_;
  std::vector<Transfer> captured_transfers_;
  bool in_flight_ = false;  // GPU stages: a step_async() not yet waited for
};

}  // namespace unetcu
