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
  virtual void step() = 0;
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
  std::vector<Tensor> params_;
  double lr_ = 1e-3;
};

struct AdamOptions {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
};

// torch.optim.Adam (weight decay is L2 added to the gradient, not decoupled).
class Adam : public Optimizer {
 public:
  Adam(std::vector<Tensor> params, const AdamOptions& opt = {});
  void step() override;
  const char* kind() const override { return "adam"; }
  ParamState param_state(size_t i) override;

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
  void step() override;
  const char* kind() const override { return "sgd"; }
  ParamState param_state(size_t i) override;

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
};
using OptimizerFactory = std::function<std::unique_ptr<Optimizer>(std::vector<Tensor>)>;
OptimizerFactory optimizer_factory(const OptimizerConfig& config);

}  // namespace unetcu
