// Layers with parameters. A Module names its parameters, buffers and children so that the
// whole model's state reads like a PyTorch state_dict (same names, same order: a module's own
// parameters, then its own buffers, then each child's).
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/ops.h"
#include "engine/random.h"

namespace unetcu {

struct StateEntry {
  std::string name;
  Tensor tensor;                // parameters and floating-point buffers
  int64_t* counter = nullptr;   // integer buffers (BN num_batches_tracked); tensor undefined
  bool is_parameter = false;
};

class Module {
 public:
  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  std::vector<std::pair<std::string, Tensor>> named_parameters() const;
  std::vector<Tensor> parameters() const;
  std::vector<StateEntry> state() const;  // parameters, buffers and counters, state_dict order
  int64_t parameter_count() const;

  // Moves every parameter and buffer of this module and its children to `device` (pipeline
  // stages place their blocks this way). Gradients are dropped.
  void move_to(Device device);

  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

 protected:
  void register_parameter(const std::string& name, Tensor* t);
  void register_buffer(const std::string& name, Tensor* t);
  void register_counter(const std::string& name, int64_t* c);
  template <class M>
  M* add_child(const std::string& name, std::unique_ptr<M> m) {
    M* raw = m.get();
    children_.emplace_back(name, std::move(m));
    return raw;
  }
  bool training_ = true;

 private:
  void collect(const std::string& prefix, std::vector<StateEntry>* out) const;
  struct Own {
    std::string name;
    Tensor* tensor;
    int64_t* counter;
    bool is_parameter;
  };
  std::vector<Own> own_;
  std::vector<std::pair<std::string, std::unique_ptr<Module>>> children_;
};

// Weight initialisations of torchvision / segmentation_models_pytorch.
enum class Init {
  KaimingNormalFanOut,   // torchvision ResNet convs: N(0, sqrt(2 / (out*kh*kw)))
  KaimingUniformFanIn,   // SMP decoder convs: U(±sqrt(6 / (in*kh*kw)))
  XavierUniform,         // SMP segmentation head: U(±sqrt(6 / (fan_in + fan_out)))
  PyTorchDefault,        // nn.Conv2d default: U(±1/sqrt(fan_in)) for weight and bias
};

class Conv2d : public Module {
 public:
  Conv2d(int in, int out, int kernel, int stride, int padding, bool bias, Init init, Rng& rng,
         DType dtype, Device device = Device::cpu());
  // Follows its input's dtype and memory format: a bfloat16 (or NHWC) input reads the weight
  // and bias converted to it (convert records the cast, so their gradients arrive in the
  // parameters' own dtype), as PyTorch's autocast does.
  Tensor forward(const Tensor& x) const;
  Tensor weight, bias;  // bias undefined when the layer has none

 private:
  int stride_, padding_;
};

class BatchNorm2d : public Module {
 public:
  BatchNorm2d(int channels, DType dtype, Device device = Device::cpu(), double momentum = 0.1,
              double eps = 1e-5);
  Tensor forward(const Tensor& x);
  Tensor weight, bias, running_mean, running_var;
  int64_t num_batches_tracked = 0;

  // The running statistics a forward reads (evaluation) or updates (training), counting the
  // batch: the module's own, or copies while the forward is recomputed in a backward
  // (engine/recompute.h), so that a step updates and counts them once.
  struct Running {
    Tensor mean, var;
  };
  Running begin_forward();

 private:
  double momentum_, eps_;
};

// A module's host-side counters (batch norm's batch counts) across a CUDA graph capture, which
// runs none of the work it records: undo() puts them back as they were before it and keeps
// what it added; each replay of the graph adds that again.
class CapturedCounts {
 public:
  CapturedCounts() = default;
  explicit CapturedCounts(const Module& m);  // before the capture
  void undo();                               // after it, successful or not
  void replay() const;                       // at each launch
 private:
  std::vector<std::pair<int64_t*, int64_t>> before_, added_;
};

}  // namespace unetcu
