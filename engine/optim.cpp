#include "engine/optim.h"

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

std::vector<std::pair<std::string, Tensor>> Adam::state_tensors() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (size_t i = 0; i < m_.size(); ++i) {
    out.emplace_back("adam.m." + std::to_string(i), m_[i]);
    out.emplace_back("adam.v." + std::to_string(i), v_[i]);
  }
  return out;
}

std::vector<std::pair<std::string, int64_t*>> Adam::state_counters() {
  std::vector<std::pair<std::string, int64_t*>> out;
  for (size_t i = 0; i < steps_.size(); ++i) out.emplace_back("adam.step." + std::to_string(i), &steps_[i]);
  return out;
}

void Adam::step() {
  double n = 0, bytes = 0;
  for (const Tensor& p : params_) n += double(p.numel()), bytes += 7.0 * double(p.nbytes());
  ProfileRange range("adam", "op", 12 * n, bytes);
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor g = params_[i].grad();
    if (!g.defined()) continue;
    check_grad(params_[i], g);
    const int64_t t = ++steps_[i];
    kernels::AdamStep s{lr_, opt_.beta1, opt_.beta2, opt_.eps, opt_.weight_decay,
                        1 - std::pow(opt_.beta1, double(t)), 1 - std::pow(opt_.beta2, double(t))};
    UNETCU_LAUNCH(params_[i].device(), adam_update, params_[i], g, m_[i], v_[i], s);
  }
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

std::vector<std::pair<std::string, Tensor>> SGD::state_tensors() const {
  std::vector<std::pair<std::string, Tensor>> out;
  if (opt_.momentum != 0)
    for (size_t i = 0; i < buf_.size(); ++i) out.emplace_back("sgd.momentum." + std::to_string(i), buf_[i]);
  return out;
}

std::vector<std::pair<std::string, int64_t*>> SGD::state_counters() {
  std::vector<std::pair<std::string, int64_t*>> out;
  for (size_t i = 0; i < started_.size(); ++i) out.emplace_back("sgd.started." + std::to_string(i), &started_[i]);
  return out;
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

}  // namespace unetcu
