// Optimizers with PyTorch semantics. A parameter without a gradient is skipped (as PyTorch
// skips p.grad is None). step() does not zero gradients; zero_grad() does.
#pragma once
#include <vector>

#include "engine/tensor.h"

namespace unetcu {

class Optimizer {
 public:
  explicit Optimizer(std::vector<Tensor> params);
  virtual ~Optimizer() = default;
  virtual void step() = 0;
  void zero_grad();
  double lr() const { return lr_; }
  // Everything the optimizer keeps between steps, per parameter index, for checkpoints:
  // named tensors (moments) and integer counters.
  virtual std::vector<std::pair<std::string, Tensor>> state_tensors() const = 0;
  virtual std::vector<std::pair<std::string, int64_t*>> state_counters() = 0;
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
  std::vector<std::pair<std::string, Tensor>> state_tensors() const override;
  std::vector<std::pair<std::string, int64_t*>> state_counters() override;

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
  std::vector<std::pair<std::string, Tensor>> state_tensors() const override;
  std::vector<std::pair<std::string, int64_t*>> state_counters() override;

 private:
  SgdOptions opt_;
  std::vector<Tensor> buf_;
  std::vector<int64_t> started_;  // 0/1 per parameter
};

}  // namespace unetcu
