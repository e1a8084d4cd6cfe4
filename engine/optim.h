// Optimizers with PyTorch semantics. A parameter without a gradient is skipped (as PyTorch
// skips p.grad is None). step() does not zero gradients; zero_grad() does.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/named.h"
#include "engine/tensor.h"

namespace unetcu {

class Optimizer {
 public:
  explicit Optimizer(std::vector<Tensor> params);
  virtual ~Optimizer() = default;
  // One update of every parameter that has a gradient, its gradients clipped first when
  // max_grad_norm() > 0 (by the norm of this optimizer's own gradients; infinite: measured).
  void step();
  // Gradient clipping, torch.nn.utils.clip_grad_norm_(params, max_norm) called before every
  // step: the gradients are multiplied by min(1, max_norm / (‖g‖ + 1e-6)), ‖g‖ the 2-norm of
  // all of them together. 0: none. Infinity: the norm is measured and recorded
  // (take_clip_stats) and the factor is 1 (NaN where the norm is infinite, as in PyTorch):
  // PyTorch's idiom for logging the norm.
  void set_max_grad_norm(double max_norm);
  double max_grad_norm() const { return max_grad_norm_; }
  // A model split over several optimizers (pipeline stages, in one process or several) clips
  // by the norm of all its gradients: each optimizer's grad_square_sum() (Σ g² of its own
  // gradients, float64 [1] on its parameters' device), added up, goes to step_clipped_by() of
  // every one of them in place of step().
  Tensor grad_square_sum() const;
  void step_clipped_by(const Tensor& square_sum);
  // What clipping saw since the last call (which starts the record anew): the steps clipped by
  // this optimizer, the mean and largest norm of their gradients before clipping (a pipeline
  // stage's: the whole model's), and how many of them the clip scaled down. Read on the host:
  // on a GPU once the steps are done (after the epoch's last loss was read).
  struct ClipStats {
    int64_t steps = 0, clipped = 0;
    double norm_mean = 0, norm_max = 0;
  };
  ClipStats take_clip_stats();
  void zero_grad();
  double lr() const { return lr_; }
  // "adam" / "sgd": checkpoints name the state with it, so another optimizer's state is
  // recognised as such.
  virtual const char* kind() const = 0;
  // Everything the optimizer keeps between steps for parameter i, for checkpoints (keyed by
  // the parameter's name there, so a checkpoint moves between strategies): named tensors
  // (moments) and integer counters, written and read in place.
  struct ParamState {
    std::vector<std::pair<std::string, Tensor>> tensors;
    std::vector<std::pair<std::string, int64_t*>> counters;
  };
  virtual ParamState param_state(size_t i) = 0;
  void set_lr(double lr) { lr_ = lr; }
  const std::vector<Tensor>& params() const { return params_; }

 protected:
  virtual void update() = 0;  // the step without clipping
  std::vector<Tensor> params_;
  double lr_ = 1e-3;

 private:
  std::vector<Tensor> grads() const;  // the gradients that are defined, checked against their parameters
  double max_grad_norm_ = 0;
  Tensor clip_stats_;        // float64 [3] on the parameters' device (clip_stats_update)
  int64_t clip_steps_ = 0;   // steps it holds
};

struct AdamOptions {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
};

// torch.optim.Adam (weight decay is L2 added to the gradient, not decoupled).
class Adam : public Optimizer {
 public:
  Adam(std::vector<Tensor> params, const AdamOptions& opt = {});
  const char* kind() const override { return "adam"; }
  ParamState param_state(size_t i) override;

 protected:
  void update() override;

 private:
  AdamOptions opt_;
  std::vector<Tensor> m_, v_;
  std::vector<int64_t> steps_;
};

struct SgdOptions {
  double lr = 1e-2, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false;
};

// torch.optim.SGD.
class SGD : public Optimizer {
 public:
  SGD(std::vector<Tensor> params, const SgdOptions& opt = {});
  const char* kind() const override { return "sgd"; }
  ParamState param_state(size_t i) override;

 protected:
  void update() override;

 private:
  SgdOptions opt_;
  std::vector<Tensor> buf_;
  std::vector<int64_t> started_;  // 0/1 per parameter
};

enum class OptimizerKind { Adam, SGD };
inline constexpr NamedValue<OptimizerKind> kOptimizerNames[] = {{"adam", OptimizerKind::Adam},
                                                                {"sgd", OptimizerKind::SGD}};

// What a training run's optimizer is; each replica or pipeline stage makes its own from it.
struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::Adam;
  double lr = 1e-3;
  double momentum = 0.9;     // SGD only
  double weight_decay = 0;
  // Gradient clipping by the total norm (Optimizer::set_max_grad_norm); 0 none, inf measured.
  double clip_grad_norm = 0;
  // A bad value: one line naming the setting (runtime/common.h setting()).
  void check() const;
};
using OptimizerFactory = std::function<std::unique_ptr<Optimizer>(std::vector<Tensor>)>;
OptimizerFactory optimizer_factory(const OptimizerConfig& config);

}  // namespace unetcu
