#include "engine/module.h"

#include "engine/recompute.h"

#include <cmath>

namespace unetcu {

void Module::register_parameter(const std::string& name, Tensor* t) {
  t->set_requires_grad(true);
  own_.push_back({name, t, nullptr, true});
}
void Module::register_buffer(const std::string& name, Tensor* t) {
  own_.push_back({name, t, nullptr, false});
}
void Module::register_counter(const std::string& name, int64_t* c) {
  own_.push_back({name, nullptr, c, false});
}

void Module::collect(const std::string& prefix, std::vector<StateEntry>* out) const {
  for (const Own& o : own_)
    if (o.is_parameter) out->push_back({prefix + o.name, *o.tensor, nullptr, true});
  for (const Own& o : own_)
    if (!o.is_parameter)
      out->push_back({prefix + o.name, o.tensor ? *o.tensor : Tensor(), o.counter, false});
  for (const auto& [name, child] : children_) child->collect(prefix + name + ".", out);
}

std::vector<StateEntry> Module::state() const {
  std::vector<StateEntry> out;
  collect("", &out);
  return out;
}

std::vector<std::pair<std::string, Tensor>> Module::named_parameters() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const StateEntry& e : state())
    if (e.is_parameter) out.emplace_back(e.name, e.tensor);
  return out;
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (const StateEntry& e : state())
    if (e.is_parameter) out.push_back(e.tensor);
  return out;
}

int64_t Module::parameter_count() const {
  int64_t n = 0;
  for (const Tensor& p : parameters()) n += p.numel();
  return n;
}

void Module::move_to(Device device) {
  for (Own& o : own_) {
    if (!o.tensor || o.tensor->device() == device) continue;
    *o.tensor = o.tensor->to(device);
    if (o.is_parameter) o.tensor->set_requires_grad(true);
  }
  for (auto& c : children_) c.second->move_to(device);
}

void Module::train(bool on) {
  training_ = on;
  for (auto& c : children_) c.second->train(on);
}

Conv2d::Conv2d(int in, int out, int kernel, int stride, int padding, bool has_bias, Init init,
               Rng& rng, DType dtype, Device device)
    : stride_(stride), padding_(padding) {
  weight = Tensor::empty({out, in, kernel, kernel}, dtype);  // drawn on the host, then moved
  const double fan_in = double(in) * kernel * kernel, fan_out = double(out) * kernel * kernel;
  const int64_t n = weight.numel();
  UNETCU_DISPATCH_FLOAT(dtype, T, {
    T* w = weight.data<T>();
    for (int64_t i = 0; i < n; ++i) {
      double v = 0;
      switch (init) {
        case Init::KaimingNormalFanOut: v = rng.normal() * std::sqrt(2.0 / fan_out); break;
        case Init::KaimingUniformFanIn: v = rng.uniform(-1, 1) * std::sqrt(6.0 / fan_in); break;
        case Init::XavierUniform: v = rng.uniform(-1, 1) * std::sqrt(6.0 / (fan_in + fan_out)); break;
        case Init::PyTorchDefault: v = rng.uniform(-1, 1) / std::sqrt(fan_in); break;
      }
      w[i] = T(v);
    }
  });
  if (weight.device() != device) weight = weight.to(device);
  register_parameter("weight", &weight);
  if (has_bias) {
    bias = Tensor::zeros({out}, dtype);
    if (init == Init::PyTorchDefault)
      for (int i = 0; i < out; ++i) bias.set(i, rng.uniform(-1, 1) / std::sqrt(fan_in));
    if (bias.device() != device) bias = bias.to(device);
    register_parameter("bias", &bias);
  }
}

BatchNorm2d::BatchNorm2d(int channels, DType dtype, Device device, double momentum, double eps)
    : momentum_(momentum), eps_(eps) {
  weight = Tensor::full({channels}, 1.0, dtype, device);
  bias = Tensor::zeros({channels}, dtype, device);
  running_mean = Tensor::zeros({channels}, dtype, device);
  running_var = Tensor::full({channels}, 1.0, dtype, device);
  register_parameter("weight", &weight);
  register_parameter("bias", &bias);
  register_buffer("running_mean", &running_mean);
  register_buffer("running_var", &running_var);
  register_counter("num_batches_tracked", &num_batches_tracked);
}

Tensor Conv2d::forward(const Tensor& x) const {
  if (!x.defined() || (x.dtype() == weight.dtype() && x.format() == weight.format()))
    return conv2d(x, weight, bias, stride_, padding_);
  const Tensor w = convert(weight, x.dtype(), x.format());
  const Tensor b = bias.defined() ? convert(bias, x.dtype(), MemoryFormat::NCHW) : Tensor();
  return conv2d(x, w, b, stride_, padding_);
}

BatchNorm2d::Running BatchNorm2d::begin_forward() {
  if (!training_) return {running_mean, running_var};
  if (recomputing()) return {running_mean.clone(), running_var.clone()};
  ++num_batches_tracked;
  return {running_mean, running_var};
}

Tensor BatchNorm2d::forward(const Tensor& x) {
  Running r = begin_forward();
  return batch_norm2d(x, weight, bias, r.mean, r.var, training_, momentum_, eps_);
}

CapturedCounts::CapturedCounts(const Module& m) {
  for (const StateEntry& e : m.state())
    if (e.counter) before_.emplace_back(e.counter, *e.counter);
}

void CapturedCounts::undo() {
  added_.clear();
  for (auto& [counter, value] : before_) {
    if (*counter != value) added_.emplace_back(counter, *counter - value);
    *counter = value;
  }
}

void CapturedCounts::replay() const {
  for (const auto& [counter, delta] : added_) *counter += delta;
}

}  // namespace unetcu
