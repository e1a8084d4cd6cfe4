// One pipeline schedule, shared by the pipeline in one process (parallel/pipeline.h) and the
// pipeline across processes (parallel/process_pipeline.h): the order of a stage's forwards and
// backwards (GPipe, 1F1B), what a stage keeps of a micro-batch between them (MicroBatch), and
// the stage's walk over its schedule (StageRun). The two pipelines differ only in how a tensor
// crosses a cut, which each says as a CutTransport.
#pragma once
#include <functional>
#include <map>
#include <vector>

#include "data/batch.h"
#include "engine/ops.h"
#include "engine/named.h"
#include "engine/tape.h"
#include "models/unet.h"

namespace unetcu {

enum class Schedule { GPipe, OneFOneB };
inline constexpr NamedValue<Schedule> kScheduleNames[] = {{"gpipe", Schedule::GPipe},
                                                          {"1f1b", Schedule::OneFOneB}};

// One stage's work on one micro-batch.
struct PipelineAction {
  enum Kind { Forward, Backward } kind;
  int micro_batch;
  bool operator==(const PipelineAction& o) const { return kind == o.kind && micro_batch == o.micro_batch; }
};
// The order in which stage `stage` of `stages` runs the forwards and backwards of
// `micro_batches` micro-batches: every micro-batch once forward, later once backward. GPipe:
// all forwards, then all backwards; 1F1B: a warm-up of S - s - 1 forwards on stage s, then
// one forward / one backward, then the remaining backwards (at most S - s micro-batches held).
std::vector<PipelineAction> stage_schedule(Schedule schedule, int stage, int stages, int micro_batches);

// The stage of each block of `model` cut before each of `cuts` (increasing block indices in
// 1..blocks-1; an error naming `what` otherwise).
std::vector<int> stages_of_blocks(const UNet& model, const std::vector<int>& cuts, const char* what);

// What a stage keeps of one micro-batch from its forward to its backward.
struct MicroBatch {
  Tape tape;
  std::map<int, Tensor> outputs;   // block -> output, made on this stage
  std::map<int, Tensor> received;  // block -> this stage's copy of another stage's output
  Tensor loss;                     // the last stage's, weighted by the micro-batch's share
};

// How a tensor crosses a cut: in one process a copy between the stages' devices, across
// processes a message. Called by stage s's thread for micro-batch m.
class CutTransport {
 public:
  virtual ~CutTransport() = default;
  // Before the forward: wait for what it reads from earlier stages, where that is needed.
  virtual void before_forward(int s, int m) = 0;
  // Stage s's copy of `block`'s output (made on an earlier stage), a leaf whose gradient goes
  // back; kept in the micro-batch's `received`.
  virtual Tensor receive(int s, int m, int block) = 0;
  // After the forward: the outputs later stages read are theirs to take.
  virtual void after_forward(int s, int m) = 0;
  // Before a stage's backward (not the last's): wait for the later stages' backwards.
  virtual void before_backward(int s, int m) = 0;
  // The sum of the gradients the later stages sent back for `block`'s output, in stage
  // order; undefined where none used it.
  virtual Tensor gradient(int s, int m, int block) = 0;
  // After the backward: the gradients of what stage s received go home.
  virtual void after_backward(int s, int m) = 0;
};

// Stage s's part of one step: its blocks' forwards and backwards of every micro-batch in the
// schedule's order, each micro-batch weighted by its share of the batch; the crossings are
// the transport's.
class StageRun {
 public:
  StageRun(const UNet& model, const std::vector<int>& stage_of_block, int stage, int stages, Schedule schedule,
           const std::vector<Batch>& micro_batches, LossKind loss, CutTransport& transport);
  void run();
  MicroBatch& micro_batch(int m) { return mb_[size_t(m)]; }
  int micro_batches() const { return int(mb_.size()); }
  int peak_live() const { return peak_live_; }  // the most micro-batches held at once

 private:
  void forward(int m);
  void backward(int m);
  const UNet& model_;
  const std::vector<int>& stage_of_block_;
  const int stage_, stages_;
  const Schedule schedule_;
  const std::vector<Batch>& inputs_;
  const LossKind loss_;
  CutTransport& transport_;
  std::vector<double> weight_;
  std::vector<MicroBatch> mb_;
  int live_ = 0, peak_live_ = 0;
};

// Stage `stage`'s blocks of one micro-batch, in block order, on the tape in scope: each block's
// inputs are the micro-batch's images, this stage's own outputs, or `remote(block)` (another
// stage's output, as this stage's copy); the outputs go into `outputs`. On the last stage
// (`masks` given) returns the micro-batch's loss weighted by `weight`, else an undefined
// tensor.
Tensor forward_stage(const UNet& model, const std::vector<int>& stage_of_block, int stage,
                     const Tensor& images, const Tensor* masks, LossKind loss, double weight,
                     std::map<int, Tensor>& outputs, const std::function<Tensor(int)>& remote);

// A stage's backward of one micro-batch from its seeds, on `tape`: each output of `outputs`
// (block -> tensor) whose `gradient_of(block)` is defined (the sum of the gradients of the
// later stages that read it, in stage order), or, where no later stage used any, the tape
// cleared. `outputs` is emptied first, and the seeds go as the backward consumes them, so
// neither outlives its use.
void backward_stage(Tape& tape, std::map<int, Tensor>& outputs, const std::function<Tensor(int)>& gradient_of);

}  // namespace unetcu
