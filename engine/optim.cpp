#include "engine/optim.h"

#include <algorithm>
#include <cmath>

#include "engine/profiler.h"
#include "kernels/launchers.h"

namespace unetcu {

Optimizer::Optimizer(std::vector<Tensor> params) : params_(std::move(params)) {
  for (const Tensor& p : params_)
    UNETCU_CHECK(p.requires_grad(), "optimizer given a tensor that does not require a gradient");
}

void Optimizer::zero_grad() {
  for (Tensor& p : params_) p.zero_grad();
}

static void check_grad(const Tensor& p, const Tensor& g) {
  UNETCU_CHECK(g.shape() == p.shape() && g.dtype() == p.dtype() && g.device() == p.device(),
               "optimizer: gradient ", shape_str(g.shape()), " does not match its parameter ",
               shape_str(p.shape()));
}

Adam::Adam(std::vector<Tensor> params, const AdamOptions& opt)
    : Optimizer(std::move(params)), opt_(opt) {
  UNETCU_CHECK(opt.lr >= 0 && opt.eps >= 0 && opt.beta1 >= 0 && opt.beta1 < 1 &&
                   opt.beta2 >= 0 && opt.beta2 < 1 && opt.weight_decay >= 0,
               "Adam: invalid hyper-parameters");
  lr_ = opt.lr;
  for (const Tensor& p : params_) {
    m_.push_back(Tensor::zeros(p.shape(), p.dtype(), p.device()));
    v_.push_back(Tensor::zeros(p.shape(), p.dtype(), p.device()));
  }
  steps_.assign(params_.size(), 0);
}

Optimizer::ParamState Adam::param_state(size_t i) {
  return {{{"m", m_.at(i)}, {"v", v_.at(i)}}, {{"step", &steps_.at(i)}}};
}

void Adam::step() {
  double n = 0, bytes = 0;
  for (const Tensor& p : params_) n += double(p.numel()), bytes += 7.0 * double(p.nbytes());
  ProfileRange range("adam", "op", 12 * n, bytes);
  // Every parameter in one pass per device and dtype (adam_update_many): on a GPU one launch
  // instead of one per parameter.
  std::vector<std::pair<std::pair<Device, DType>, std::vector<kernels::AdamTensor>>> groups;
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor g = params_[i].grad();
    if (!g.defined()) continue;
    check_grad(params_[i], g);
    const int64_t t = ++steps_[i];
    kernels::AdamStep s{lr_, opt_.beta1, opt_.beta2, opt_.eps, opt_.weight_decay,
                        1 - std::pow(opt_.beta1, double(t)), 1 - std::pow(opt_.beta2, double(t))};
    const std::pair<Device, DType> key{params_[i].device(), params_[i].dtype()};
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& gr) { return gr.first == key; });
    if (it == groups.end()) it = groups.insert(groups.end(), {key, {}});
    it->second.push_back({params_[i], g, m_[i], v_[i], s});
  }
  for (const auto& [key, tensors] : groups) UNETCU_LAUNCH(key.first, adam_update_many, tensors);
}

SGD::SGD(std::vector<Tensor> params, const SgdOptions& opt)
    : Optimizer(std::move(params)), opt_(opt) {
  UNETCU_CHECK(opt.lr >= 0 && opt.momentum >= 0 && opt.weight_decay >= 0,
               "SGD: invalid hyper-parameters");
  UNETCU_CHECK(!opt.nesterov || (opt.momentum > 0 && opt.dampening == 0),
               "SGD: nesterov needs momentum > 0 and dampening 0");
  lr_ = opt.lr;
  for (const Tensor& p : params_)
    // Without momentum the buffer is never read or written; the parameter stands in for it.
    buf_.push_back(opt.momentum != 0 ? Tensor::zeros(p.shape(), p.dtype(), p.device()) : p);
  started_.assign(params_.size(), 0);
}

Optimizer::ParamState SGD::param_state(size_t i) {
  ParamState s;
  if (opt_.momentum != 0) s.tensors.emplace_back("momentum", buf_.at(i));
  s.counters.emplace_back("started", &started_.at(i));
  return s;
}

void SGD::step() {
  double n = 0, bytes = 0;
  for (const Tensor& p : params_) n += double(p.numel()), bytes += 5.0 * double(p.nbytes());
  ProfileRange range("sgd", "op", 5 * n, bytes);
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor g = params_[i].grad();
    if (!g.defined()) continue;
    check_grad(params_[i], g);
    kernels::SgdStep s{lr_, opt_.momentum, opt_.dampening, opt_.weight_decay, opt_.nesterov,
                       !started_[i]};
    started_[i] = 1;
    UNETCU_LAUNCH(params_[i].device(), sgd_update, params_[i], g, buf_[i], s);
  }
}

OptimizerFactory optimizer_factory(const OptimizerConfig& c) {
  return [c](std::vector<Tensor> params) -> std::unique_ptr<Optimizer> {
    if (c.kind == OptimizerKind::Adam) {
      AdamOptions o;
      o.lr = c.lr;
      o.weight_decay = c.weight_decay;
      return std::make_unique<Adam>(std::move(params), o);
    }
    SgdOptions o;
    o.lr = c.lr;
    o.momentum = c.momentum;
    o.weight_decay = c.weight_decay;
    return std::make_unique<SGD>(std::move(params), o);
  };
}

}  // namespace unetcu
