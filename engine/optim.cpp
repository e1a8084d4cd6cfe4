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

void Optimizer::set_max_grad_norm(double max_norm) {
  UNETCU_CHECK(max_norm >= 0 && !std::isnan(max_norm), "the largest gradient norm must be >= 0 (or infinite), got ",
               max_norm);
  max_grad_norm_ = max_norm;
}

std::vector<Tensor> Optimizer::grads() const {
  std::vector<Tensor> gs;
  for (const Tensor& p : params_) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    check_grad(p, g);
    UNETCU_CHECK(p.device() == params_[0].device() && p.dtype() == params_[0].dtype(),
                 "gradient clipping: an optimizer's parameters must share one device and dtype");
    gs.push_back(g);
  }
  return gs;
}

Tensor Optimizer::grad_square_sum() const {
  UNETCU_CHECK(!params_.empty(), "gradient clipping: the optimizer has no parameters");
  const std::vector<Tensor> gs = grads();
  double n = 0;
  for (const Tensor& g : gs) n += double(g.numel());
  ProfileRange range("grad_norm", "op", 2 * n, n * double(dtype_size(params_[0].dtype())));
  Tensor sum = Tensor::empty({1}, DType::F64, params_[0].device());
  UNETCU_LAUNCH(sum.device(), square_sum_many, std::vector<TensorRef>(gs.begin(), gs.end()), sum);
  return sum;
}

void Optimizer::step_clipped_by(const Tensor& square_sum) {
  UNETCU_CHECK(max_grad_norm_ > 0, "step_clipped_by needs a largest gradient norm");
  if (!params_.empty()) {
    UNETCU_CHECK(square_sum.numel() == 1 && square_sum.dtype() == DType::F64 &&
                     square_sum.device() == params_[0].device(),
                 "gradient clipping: the square sum must be one float64 on the parameters' device");
    const std::vector<Tensor> gs = grads();
    double n = 0;
    for (const Tensor& g : gs) n += double(g.numel());
    const double bytes = 2 * n * double(dtype_size(params_[0].dtype()));
    ProfileRange range("clip_grad_norm", "op", n, bytes);
    // An infinite max_norm scales too: by 1 for a finite norm, by NaN for an infinite one, as
    // PyTorch's clip_grad_norm_(params, inf).
    UNETCU_LAUNCH(square_sum.device(), clip_scale_many, std::vector<TensorRef>(gs.begin(), gs.end()),
                  square_sum, max_grad_norm_);
    // Made on the stream of the step that first updates it (a new record starts with a new one).
    if (!clip_stats_.defined()) clip_stats_ = Tensor::zeros({3}, DType::F64, square_sum.device());
    UNETCU_LAUNCH(square_sum.device(), clip_stats_update, square_sum, max_grad_norm_, clip_stats_);
    ++clip_steps_;
  }
  update();
}

Optimizer::ClipStats Optimizer::take_clip_stats() {
  ClipStats s;
  if (clip_steps_ > 0 && clip_stats_.defined()) {
    const std::vector<double> v = clip_stats_.to_vector();
    s.steps = clip_steps_;
    s.norm_mean = v[0] / double(clip_steps_);
    s.norm_max = v[1];
    s.clipped = int64_t(v[2]);
  }
  clip_stats_ = Tensor();
  clip_steps_ = 0;
  return s;
}

void Optimizer::step() {
  if (max_grad_norm_ > 0 && !params_.empty())
    step_clipped_by(grad_square_sum());
  else
    update();
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

void Adam::update() {
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

void SGD::update() {
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

void OptimizerConfig::check() const {
  UNETCU_CHECK(lr > 0 && std::isfinite(lr), setting("lr"), " must be a positive number, got ", lr);
  UNETCU_CHECK(weight_decay >= 0 && std::isfinite(weight_decay), setting("weight_decay"), " must be >= 0");
  UNETCU_CHECK(clip_grad_norm >= 0 && !std::isnan(clip_grad_norm), setting("clip_grad_norm"),
               " must be a number >= 0 (0: no clipping) or inf (the norm measured, never clipped), got ",
               clip_grad_norm);
  UNETCU_CHECK(momentum >= 0 && momentum < 1, setting("momentum"), " must be in [0, 1)");
}

OptimizerFactory optimizer_factory(const OptimizerConfig& c) {
  return [c](std::vector<Tensor> params) -> std::unique_ptr<Optimizer> {
    std::unique_ptr<Optimizer> opt;
    if (c.kind == OptimizerKind::Adam) {
      AdamOptions o;
      o.lr = c.lr;
      o.weight_decay = c.weight_decay;
      opt = std::make_unique<Adam>(std::move(params), o);
    } else {
      SgdOptions o;
      o.lr = c.lr;
      o.momentum = c.momentum;
      o.weight_decay = c.weight_decay;
      opt = std::make_unique<SGD>(std::move(params), o);
    }
    opt->set_max_grad_norm(c.clip_grad_norm);
    return opt;
  };
}

}  // namespace unetcu
