// The training-strategy seam: one interface over one-device training, data parallelism and
// pipeline (model) parallelism. The epoch loop (train/trainer.h), the benchmarks and the split
// search drive every strategy through it, so a training step is written once per strategy
// and nowhere else.
//
//   host batch (loader, pinned for GPUs) --place--> parts on the input devices --step--> loss
//
// place() uploads a batch (on a GPU from pinned memory on the device's upload stream, so the
// copy runs beside the step before: see places_ahead); step() runs forward, loss, backward and
// the optimizer step and returns the batch's mean loss; step_async() the same with the loss
// read later, so that on GPUs the host queues the next step before the device has finished.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "data/batch.h"
#include "engine/graph_step.h"
#include "engine/module.h"
#include "engine/named.h"
#include "runtime/cuda_api.h"
#include "engine/ops.h"
#include "engine/optim.h"
#include "models/unet.h"
#include "parallel/communicator.h"
#include "parallel/dist.h"
#include "parallel/placement.h"
#include "parallel/pipeline.h"
#include "parallel/process_pipeline.h"

namespace unetcu {

// A global batch placed where a strategy's step reads it.
struct PlacedBatch {
  Batch host;                // the loader's batch: alive until the copies from it are done
  std::vector<Batch> parts;  // one device: the batch; DP: each replica's shard; MP: each
                             // micro-batch (images on the first stage, masks on the last)
  // Placed ahead (TrainingStrategy::places_ahead): makes the streams that read the parts wait
  // for their uploads; the step calls it first.
  std::function<void()> arrive;
  int64_t size() const { return host.size(); }
};

// A step's loss, read when it is needed. On a GPU the value is copied into pinned host memory
// behind the step's kernels and read one step later by the epoch loop, so the host queues
// step s+1 before it waits for step s (a read right after each step would stall the host on
// every step and leave the GPU idle while it queues the next). On the CPU it is ready at once.
class StepLoss {
 public:
  StepLoss() = default;
  static StepLoss ready(double value);
  // The mean of one-element losses (a replica's each, on its device; the mean taken in this
  // order, as l0/N + l1/N + ...): a GPU's copied behind the work queued on the calling
  // thread's current stream of its device, a CPU's read at once.
  // `check` runs after the waits (it throws where the values are not to be trusted).
  static StepLoss mean_of(const std::vector<Tensor>& losses, std::function<void()> check = {});
  // The sum of one-element losses (a pipeline's weighted micro-batch losses), likewise.
  static StepLoss sum_of(const std::vector<Tensor>& losses);
  bool valid() const { return valid_; }
  double get() const;  // waits for the copies still in flight

 private:
  // Σ loss / count, in the losses' order.
  static StepLoss combine(const std::vector<Tensor>& losses, std::function<void()> check, double count);
  bool valid_ = false;
  double value_ = 0;                 // the CPU losses' part of the mean
  std::vector<Tensor> hosts_;        // one-element pinned tensors the GPUs' copies land in
  std::vector<cuda::Event> done_;    // their copies' events
  double count_ = 1;                 // what each loss is divided by: N for a mean, 1 for a sum
  std::function<void()> check_;
};

// How a strategy's work is shared among the processes of a job, and what each reads.
struct ProcessLayout {
  int replicas = 1;       // into how many equal shards the sampler cuts each global batch
  int process_rank = 0;   // this process of process_count (several: only process 0 prints,
  int process_count = 1;  // writes checkpoints and metrics)
  int shard_rank = 0;     // which shard of each global batch this process reads, of shard_count
  int shard_count = 1;    // (DP across processes: its rank of all; dp+mp: its replica of all)
};

class TrainingStrategy {
 public:
  virtual ~TrainingStrategy() = default;
  // One line for the log: the devices and how the work is shared.
  virtual std::string describe() const = 0;
  // Every device the strategy computes on (peak memory, GPU checks); the logits come out on
  // output_device().
  const std::vector<Device>& devices() const { return devices_; }
  Device output_device() const { return output_device_; }
  const ProcessLayout& layout() const { return layout_; }
  // Several processes each holding part of the model (a pipeline across processes): afterwards
  // model() and optimizers() hold every part's current state in this process. Collective:
  // every process calls it at the same point (before validation and checkpoints).
  virtual void collect_state() {}
  // True on every process when `mine` is true on any (a decision every process must take at
  // the same step, such as stopping on an interrupt).
  virtual bool any_process(bool mine) { return mine; }

  // Uploads a host batch to where step() reads it.
  virtual PlacedBatch place(Batch host) = 0;
  // Whether the epoch loop places batch s+1 before step s (a pipeline across processes, whose
  // step returns only once its stage has exchanged its work, on GPUs mostly done): place() leaves
  // the streams' waits for the uploads to the step that reads them (PlacedBatch::arrive), and
  // the copies run beside step s. The others return from a GPU step once it is queued and place
  // batch s+1 after it.
  bool places_ahead() const { return places_ahead_; }
  // One optimizer step, its loss read later (see StepLoss): the batch's mean loss (DP: the
  // mean over the replicas').
  virtual StepLoss step_async(const PlacedBatch& batch) = 0;
  // The same step, its loss read at once.
  double step(const PlacedBatch& batch) { return step_async(batch).get(); }
  LossKind loss_kind() const { return loss_; }

  // Forward without a tape, in the mode set by set_training: logits on output_device().
  virtual Tensor infer(const Tensor& images) = 0;
  virtual void set_training(bool on) = 0;

  // For checkpoints: the model with segmentation_models_pytorch's names (MP: the one model
  // whose blocks live on the stages' devices) and the optimizers whose state is saved (DP:
  // rank 0's; MP: each stage's), every one of their parameters a parameter of model().
  virtual Module& model() = 0;
  virtual std::vector<Optimizer*> optimizers() = 0;
  // The learning rate of the next optimizer step, in every optimizer that steps (DP: every
  // replica's; MP: every stage's), without waiting for the steps queued before (each took
  // its rate when it was queued).
  virtual void set_learning_rate(double lr);
  // The rate the next optimizer step takes (the first optimizer's that steps), also without
  // waiting: what the metrics file logs.
  virtual double learning_rate();
  // After model() / optimizers() were loaded: make every replica agree with them.
  virtual void state_loaded() {}

  // MP: the most micro-batches each stage held during the last step; empty otherwise.
  const std::vector<int>& live_micro_batches() const { return live_micro_batches_; }

 protected:
  TrainingStrategy(LossKind loss, std::vector<Device> devices, Device output_device, ProcessLayout layout = {},
                   bool places_ahead = false)
      : loss_(loss), devices_(std::move(devices)), output_device_(output_device), layout_(layout),
        places_ahead_(places_ahead) {}
  LossKind loss_;
  std::vector<Device> devices_;
  Device output_device_;
  ProcessLayout layout_;
  bool places_ahead_ = false;
  std::vector<int> live_micro_batches_;  // a pipeline's, after each step
};

// One model on one device: the placement's one device, its threads (CPU) and accumulate_rows;
// cuda_graphs (GPUs): after two eager steps at the first batch's shape, forward, loss and
// backward at that shape are captured into one CUDA graph and replayed each step (the batch
// copied into the graph's input tensors first); the optimizer step stays eager (its step count
// is a host value). Other batch shapes (a short last batch), steps in eval mode and profiled
// steps run eagerly; a capture that fails says why once and training goes on eagerly.
// Gradient accumulation (accumulate_rows > 0): a batch of more rows runs forward and backward
// in chunks of that many rows (the last may be smaller), each chunk's loss weighted by its
// share of the batch, the gradients accumulated before the one optimizer step; batch norm uses
// each chunk's statistics. With cuda_graphs every chunk's forward and backward is in the one
// graph (their activations share the graph's memory, a chunk's freed before the next).
class SingleDeviceStrategy : public TrainingStrategy {
 public:
  SingleDeviceStrategy(const UNetConfig& model, const Placement& placement, const OptimizerFactory& make_optimizer,
                       LossKind loss);
  std::string describe() const override;
  PlacedBatch place(Batch host) override;
  StepLoss step_async(const PlacedBatch& batch) override;
  Tensor infer(const Tensor& images) override;
  void set_training(bool on) override { model_->train(on); }
  Module& model() override { return *model_; }
  std::vector<Optimizer*> optimizers() override { return {optimizer_.get()}; }
  UNet& unet() { return *model_; }
  bool graph_captured() const { return graph_.captured(); }  // cuda_graphs: replaying now

 private:
  Device device_;
  std::unique_ptr<UNet> model_;
  std::unique_ptr<Optimizer> optimizer_;
  int64_t accumulate_rows_ = 0;
  GraphStep graph_;  // cuda_graphs: the captured step at the first batch's shape
  // The chunks' losses of the replayed step, or null: run eagerly.
  const std::vector<Tensor>* graph_step(const Batch& b);
  // Gradients zeroed, then forward, loss and backward of each chunk: the chunks' losses.
  std::vector<Tensor> forward_backward(const Tensor& images, const Tensor& masks);
};

// A replica per device, gradients averaged by all-reduce (parallel/data_parallel.h). A global
// batch of N·b samples: replica r takes rows [r·b, (r+1)·b).
class DataParallelStrategy : public TrainingStrategy {
 public:
  DataParallelStrategy(const UNetConfig& model, const DataParallelOptions& options,
                       const OptimizerFactory& make_optimizer, LossKind loss);
  std::string describe() const override;
  PlacedBatch place(Batch host) override;
  // On GPUs the host does not wait for the step: the epoch loop places the next batch, whose
  // upload runs beside it, and reads this loss one step later.
  StepLoss step_async(const PlacedBatch& batch) override;
  Tensor infer(const Tensor& images) override;
  void set_training(bool on) override;
  Module& model() override { return dp_.replica(0); }
  std::vector<Optimizer*> optimizers() override { return {&dp_.optimizer(0)}; }
  void set_learning_rate(double lr) override;
  void state_loaded() override { dp_.replicate_rank0(); }
  bool any_process(bool mine) override { return dp_.average_across_processes(mine ? 1.0 : 0.0) > 0; }
  DataParallel& data_parallel() { return dp_; }

 private:
  DataParallel dp_;
};

// The model cut into stages on devices, the batch into micro-batches (parallel/pipeline.h).
class PipelineStrategy : public TrainingStrategy {
 public:
  PipelineStrategy(const UNetConfig& model, const PipelineOptions& options,
                   const OptimizerFactory& make_optimizer, LossKind loss);
  std::string describe() const override;
  PlacedBatch place(Batch host) override;
  // Its steps are queued (Pipeline::step_async), so the next batch is placed after each.
  StepLoss step_async(const PlacedBatch& batch) override;
  Tensor infer(const Tensor& images) override { return pipe_.infer(images); }
  // The model's and optimizers' state, once the steps queued have run.
  void set_training(bool on) override { model().train(on); }
  Module& model() override;
  std::vector<Optimizer*> optimizers() override;
  void set_learning_rate(double lr) override;
  double learning_rate() override { return pipe_.optimizers().at(0)->lr(); }
  void state_loaded() override { pipe_.parameters_placed(); }
  Pipeline& pipeline() { return pipe_; }

 private:
  Pipeline pipe_;
};

// One stage of a pipeline per process; R replicas of an S-stage pipeline on S·R processes
// (parallel/process_pipeline.h), the replicas averaging each stage's gradients as `replicas`
// says.
class ProcessPipelineStrategy : public TrainingStrategy {
 public:
  ProcessPipelineStrategy(const UNetConfig& model, const PipelineOptions& options,
                          const DataParallelOptions& replicas, const OptimizerFactory& make_optimizer,
                          LossKind loss);
  std::string describe() const override;
  PlacedBatch place(Batch host) override;
  // Returns once this stage has exchanged its work: the loss is read at once.
  StepLoss step_async(const PlacedBatch& batch) override;
  // The whole model in this process, after collect_state().
  Tensor infer(const Tensor& images) override;
  void set_training(bool on) override { pipe_.model().train(on); }
  Module& model() override { return pipe_.model(); }
  std::vector<Optimizer*> optimizers() override;
  void collect_state() override { pipe_.collect(); }
  bool any_process(bool mine) override { return pipe_.any(mine); }
  ProcessPipeline& pipeline() { return pipe_; }

 private:
  ProcessPipeline pipe_;
};

// --- choosing a strategy ---------------------------------------------------------------------

// As --mode names them. DPMP: R data-parallel replicas of an S-stage pipeline, one stage per
// process. Auto: the fastest plan that fits (train/auto_mode.h), chosen before the strategy is
// made.
enum class Mode { Single, DP, MP, DPMP, Auto };
inline constexpr NamedValue<Mode> kModeNames[] = {
    {"single", Mode::Single}, {"dp", Mode::DP}, {"mp", Mode::MP}, {"dp+mp", Mode::DPMP}, {"auto", Mode::Auto}};

// A run's strategy: its placement (devices, threads, CUDA graphs, accumulation, processes)
// and each kind's own options, filled directly by the flags. make_strategy hands the placement
// to the options of the strategy it builds (placed()); the placement parts of `dp` and `mp`
// are not read.
struct StrategyConfig : Placement {
  Mode mode = Mode::Single;
  UNetConfig model;             // its device is set per replica / stage
  OptimizerConfig optimizer;
  LossKind loss = LossKind::BCEDice;
  DataParallelOptions dp;       // --mode dp; dp+mp: how the replicas of each stage average
  // --mode mp and dp+mp; split_size 0: the whole batch (a run sets it to its batch size).
  PipelineOptions mp = [] {
    PipelineOptions o;
    o.split_size = 0;
    return o;
  }();
  // One line naming the setting (runtime/common.h setting()) for a configuration no strategy
  // can train: the options' own checks and those across them, before any work. `batch_size`:
  // the images per replica and forward; `dist`: the job this process is one of (with
  // across_processes).
  void check(int batch_size, const DistEnv& dist) const;
};

// The options `o` with the run's placement.
template <class Options>
Options placed(Options o, const Placement& placement) {
  static_cast<Placement&>(o) = placement;
  return o;
}

// Builds the strategy. With mp.search_split, `probe` (a host batch of the training batch size)
// is timed on the first stage's device, the split search's table goes to `out` and the fastest
// plan is taken.
std::unique_ptr<TrainingStrategy> make_strategy(const StrategyConfig& config, const Batch* probe,
                                                std::ostream& out);

}  // namespace unetcu
