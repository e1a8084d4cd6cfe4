// What happens around fit()'s loop (train/trainer.h), as PyTorch Lightning's callbacks: the
// progress bar and epoch line, the metrics file, checkpoints, early stopping, the clip record,
// interrupts and the profiler each live in train/callbacks/, and fit() calls them at fixed
// points, in the order of its list:
//
//   load_state      resuming: the callback's part of the checkpoint's run record
//   on_fit_start    after the resume, before the first epoch
//   on_epoch_start
//   on_step_loss    a step's loss was read (one step behind the queue, see fit())
//   on_step_end     a step was queued; a callback may ask for an interrupt here
//   on_interrupt    the run stops after this step (ctx.interrupted): save, then throw
//   on_train_epoch_end  the epoch's steps are done, before validation
//   on_validation_end   the epoch's figures are measured: complete or observe them
//   on_epoch_end    report, save and decide (ctx.stop ends the run after this epoch)
//   on_fit_end
//
// save_state adds a callback's record to every checkpoint's run record, so that a resumed
// run continues where the first one stopped.
#pragma once
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "engine/checkpoint.h"
#include "train/trainer.h"

namespace unetcu {

class Callback;

// Refuses, before any training, an output path that cannot be written: a missing or read-only
// folder, or a folder where the file should be. `what` names the file in the message.
void check_writable(const std::string& path, const char* what);

// The run as callbacks see it.
struct FitContext {
  FitContext(TrainingStrategy& s, const FitOptions& o, std::ostream& out_, bool lead_)
      : strategy(s), options(o), out(out_), lead(lead_) {}
  TrainingStrategy& strategy;
  const FitOptions& options;
  std::ostream& out;          // process 0's output; a null stream in the other processes
  bool lead;                  // process 0: prints and writes the files
  int first_epoch = 1;        // after a resume, the epoch it continues
  int64_t first_step = 0;     // > 0: a run stopped mid-epoch continues at this step
  int64_t steps = 0;          // optimizer steps per epoch
  int64_t total_steps = 0;    // over every epoch
  bool scheduled = false;     // the learning rate varies step by step
  int epoch = 0;              // the epoch in progress
  bool interrupted = false;   // set in on_step_end: the run stops after this step
  bool stop = false;          // set in on_epoch_end: the run ends after this epoch
  // What a failure leaves, as the end of its message: the checkpoint of the last good epoch.
  std::string kept;
  // What an interrupt leaves, for its message: set by the checkpoints.
  std::string interrupt_note = "no checkpoint was configured";
  std::vector<Callback*> callbacks;
  // The record every checkpoint of the run carries: the run's plan and every callback's.
  RunRecord record() const;
};

// A step whose loss was read: its 1-based number in the epoch, its loss and learning rate,
// and the epoch's time and images so far.
struct StepDone {
  int64_t step = 0;
  double loss = 0, lr = 0, seconds = 0;
  int64_t images = 0;
};

class Callback {
 public:
  virtual ~Callback() = default;
  // `resume_line` is the "resumed from ..." line being written: a callback may add to it.
  virtual void load_state(FitContext&, const RunRecord&, std::ostream& /*resume_line*/) {}
  virtual void save_state(RunRecord&) const {}
  virtual void on_fit_start(FitContext&) {}
  virtual void on_epoch_start(FitContext&) {}
  virtual void on_step_loss(FitContext&, const StepDone&) {}
  virtual void on_step_end(FitContext&, int64_t /*steps_done*/) {}
  virtual void on_interrupt(FitContext&, int64_t /*steps_done*/) {}
  virtual void on_train_epoch_end(FitContext&) {}
  virtual void on_validation_end(FitContext&, EpochStats&) {}
  virtual void on_epoch_end(FitContext&, const EpochStats&) {}
  virtual void on_fit_end(FitContext&, TrainResult&) {}
};

inline RunRecord FitContext::record() const {
  RunRecord r;
  for (const Callback* c : callbacks) c->save_state(r);
  r["steps_per_epoch"] = std::to_string(steps);
  r["total_steps"] = std::to_string(total_steps);
  return r;
}

}  // namespace unetcu
