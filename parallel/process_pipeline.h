// Pipeline (model) parallelism across processes: one stage per process, and — data × pipeline —
// R replicas of an S-stage pipeline on S·R processes (process r·S + s holds stage s of replica r).
//
//  - Every process builds the whole UNet and every stage's optimizer (the layout of the
//    in-process pipeline, parallel/pipeline.h), and trains only its own stage's blocks.
//  - A tensor that crosses a cut (the main path or a UNet skip) is sent straight from the
//    process of the stage that makes it to each process of a later stage that reads it, when
//    the producer's forward of that micro-batch is done; the consumer's backward sends the
//    gradient of its copy back the same way, and the producer's backward starts from the sum
//    of its consumers' gradients, added in stage order as in one process. Sends do not wait
//    for the receiver (the schedules' data dependencies alone order the stages; no deadlock
//    whatever the sizes); each header message carries the tensor's shape. Over a
//    ProcessGroup (parallel/process_group.h): MPI or Gloo.
//  - The same schedules (stage_schedule: GPipe, 1F1B), the same micro-batch weights and the
//    same per-chunk arithmetic as in one process: one replica across processes gives the same
//    bits as the in-process pipeline on the same CPU thread counts.
//  - Data × pipeline: each replica trains on its shard of the global batch; after the last
//    backward the stage's gradients (one flat buffer) are averaged over the R processes that
//    hold that stage (ring, ps or the transport's all-reduce), then every replica steps the
//    same Adam on the same gradients. The whole equals one device accumulating the gradients
//    of every replica's micro-batches (each weighted by its share of the global batch).
//  - collect(): every process receives each stage's parameters, buffers, counters and
//    optimizer state from replica 0's process of that stage, so any process can evaluate the
//    whole model or write the checkpoint the in-process pipeline would (batch-norm running
//    statistics follow replica 0, as data parallelism's follow rank 0). Collective.
#pragma once
#include <memory>
#include <vector>

#include "data/batch.h"
#include "engine/optim.h"
#include "models/unet.h"
#include "parallel/communicator.h"
#include "parallel/pipeline.h"
#include "parallel/process_group.h"

namespace unetcu {


class ProcessPipeline {
 public:
  // `options`: its placement's one device holds this process's stage (a GPU's tensors cross
  // between the processes through host memory), with `threads` CPU threads (0: every core);
  // pipeline_stages: S (0: every process one stage), R = processes / S. `replicas`: how the R
  // replicas of each stage average its gradients (allreduce, bf16_allreduce) and over which
  // processes: every process of `process_group` (null: every process of the job), size S·R,
  // process r·S + s holding stage s of replica r.
  ProcessPipeline(const UNetConfig& model, const PipelineOptions& options, const DataParallelOptions& replicas,
                  const OptimizerFactory& make_optimizer);
  ~ProcessPipeline();

  int stage() const { return stage_; }
  int stages() const { return stages_; }
  int replica() const { return replica_; }
  int replicas() const { return replicas_; }

  // This replica's batch cut into micro-batches of split_size: the images on this process's
  // device when it is the first stage, the masks when it is the last (else views of the batch).
  std::vector<Batch> place(const Batch& batch) const;
  // The same with the waits for the uploads left out (`arrivals` gets them): this process's
  // stream must wait for each (Arrival::wait) before the step that reads them, and the copies
  // run beside what it does meanwhile.
  std::vector<Batch> place_ahead(const Batch& batch, std::vector<Arrival>* arrivals) const;
  // One optimizer step of this process's stage; every process returns the global batch's loss
  // (each replica's weighted micro-batch losses, averaged over the replicas).
  double step(const std::vector<Batch>& micro_batches, LossKind loss);

  // Every stage's state into this process (see above). Collective over every process.
  void collect();
  // OR of `mine` over every process (a decision every process must take together).
  bool any(bool mine);

  UNet& model() { return *model_; }
  const UNet& model() const { return *model_; }
  const std::vector<std::unique_ptr<Optimizer>>& optimizers() const { return optimizers_; }
  const PipelineOptions& options() const { return options_; }
  const DataParallelOptions& replica_options() const { return replicas_options_; }
  ProcessGroup& world() const { return *world_; }
  // Of the last step: the most micro-batches whose activations this stage held at once.
  int peak_live_micro_batches() const { return peak_live_; }

 private:
  class Run;
  PipelineOptions options_;
  DataParallelOptions replicas_options_;
  std::shared_ptr<ProcessGroup> world_;  // every process of the job
  int stages_ = 2, stage_ = 0, replica_ = 0, replicas_ = 1;
  std::unique_ptr<UNet> model_;
  std::vector<std::unique_ptr<Optimizer>> optimizers_;  // one per stage, as in one process
  std::vector<int> stage_of_block_;
  // Block -> the later stages that read its output, in stage order.
  std::vector<std::vector<int>> consumers_;
  std::shared_ptr<ProcessGroup> pipe_;  // this replica's S processes: rank s is stage s
  std::unique_ptr<Communicator> grads_;  // this stage's R processes (null when R = 1)
  std::shared_ptr<ProcessGroup> ctrl_;  // every process: collect(), any(), the loss
  std::vector<Tensor> stage_params_;
  int peak_live_ = 0;
};

}  // namespace unetcu
