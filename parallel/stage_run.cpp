#include "parallel/stage_run.h"

#include <algorithm>

namespace unetcu {

std::vector<PipelineAction> stage_schedule(Schedule schedule, int stage, int stages, int micro_batches) {
  UNETCU_CHECK(stages >= 1 && stage >= 0 && stage < stages && micro_batches >= 1,
               "pipeline schedule: stage ", stage, " of ", stages, " with ", micro_batches,
               " micro-batches");
  const int M = micro_batches;
  std::vector<PipelineAction> out;
  auto F = [&](int m) { out.push_back({PipelineAction::Forward, m}); };
  auto B = [&](int m) { out.push_back({PipelineAction::Backward, m}); };
  if (schedule == Schedule::GPipe) {
    for (int m = 0; m < M; ++m) F(m);
    for (int m = 0; m < M; ++m) B(m);
    return out;
  }
  // 1F1B: enough forwards in flight to keep the later stages busy, then alternate, so a stage
  // holds at most S - s micro-batches of activations.
  const int warm = std::min(stages - stage - 1, M);
  for (int m = 0; m < warm; ++m) F(m);
  for (int i = 0; i < M - warm; ++i) {
    F(warm + i);
    B(i);
  }
  for (int m = M - warm; m < M; ++m) B(m);
  return out;
}

std::vector<int> stages_of_blocks(const UNet& model, const std::vector<int>& cuts, const char* what) {
  const auto& blocks = model.blocks();
  for (size_t i = 0; i < cuts.size(); ++i)
    UNETCU_CHECK(cuts[i] > 0 && cuts[i] < int(blocks.size()) && (i == 0 || cuts[i] > cuts[i - 1]), what,
                 ": cuts must be increasing block indices in 1..", blocks.size() - 1);
  std::vector<int> stage_of_block(blocks.size(), 0);
  for (size_t b = 0; b < blocks.size(); ++b)
    for (int c : cuts)
      if (int(b) >= c) ++stage_of_block[b];
  return stage_of_block;
}

StageRun::StageRun(const UNet& model, const std::vector<int>& stage_of_block, int stage, int stages,
                   Schedule schedule, const std::vector<Batch>& micro_batches, LossKind loss,
                   CutTransport& transport)
    : model_(model), stage_of_block_(stage_of_block), stage_(stage), stages_(stages), schedule_(schedule),
      inputs_(micro_batches), loss_(loss), transport_(transport), mb_(micro_batches.size()) {
  int64_t total = 0;
  for (const Batch& b : micro_batches) total += b.size();
  for (const Batch& b : micro_batches) weight_.push_back(double(b.size()) / double(total));
}

void StageRun::run() {
  for (const PipelineAction& a : stage_schedule(schedule_, stage_, stages_, int(mb_.size()))) {
    if (a.kind == PipelineAction::Forward)
      forward(a.micro_batch);
    else
      backward(a.micro_batch);
  }
}

void StageRun::forward(int m) {
  transport_.before_forward(stage_, m);
  MicroBatch& me = mb_[size_t(m)];
  const Batch& in = inputs_[size_t(m)];
  {
    TapeScope scope(me.tape);
    // The images are placed on the first stage's device, the masks on the last's.
    me.loss = forward_stage(model_, stage_of_block_, stage_, in.images, stage_ == stages_ - 1 ? &in.masks : nullptr,
                            loss_, weight_[size_t(m)], me.outputs,
                            [&](int block) { return transport_.receive(stage_, m, block); });
  }
  peak_live_ = std::max(peak_live_, ++live_);
  transport_.after_forward(stage_, m);
}

void StageRun::backward(int m) {
  MicroBatch& me = mb_[size_t(m)];
  if (stage_ == stages_ - 1) {
    me.tape.backward(me.loss);
  } else {
    transport_.before_backward(stage_, m);
    backward_stage(me.tape, me.outputs, [&](int block) { return transport_.gradient(stage_, m, block); });
  }
  me.outputs.clear();
  --live_;
  transport_.after_backward(stage_, m);
}

void backward_stage(Tape& tape, std::map<int, Tensor>& outputs, const std::function<Tensor(int)>& gradient_of) {
  std::vector<Tensor> outs, grads;
  for (const auto& [b, out] : outputs) {
    Tensor g = gradient_of(b);
    if (!g.defined()) continue;
    outs.push_back(out);
    grads.push_back(std::move(g));
  }
  outputs.clear();  // the tape keeps what its backward reads
  if (outs.empty())
    tape.clear();
  else
    tape.backward(std::move(outs), std::move(grads));
}

Tensor forward_stage(const UNet& model, const std::vector<int>& stage_of_block, int stage,
                     const Tensor& images, const Tensor* masks, LossKind loss, double weight,
                     std::map<int, Tensor>& outputs, const std::function<Tensor(int)>& remote) {
  const auto& blocks = model.blocks();
  for (size_t b = 0; b < blocks.size(); ++b) {
    if (stage_of_block[b] != stage) continue;
    std::vector<Tensor> in;
    for (int i : blocks[b].inputs) {
      if (i < 0)
        in.push_back(images);
      else if (stage_of_block[i] == stage)
        in.push_back(outputs.at(i));
      else  // straight from the stage that made it
        in.push_back(remote(i));
    }
    outputs[int(b)] = model.run_block(b, in);
  }
  if (!masks) return Tensor();
  return scale(segmentation_loss(loss, outputs.at(int(blocks.size()) - 1), *masks), weight);
}

}  // namespace unetcu
