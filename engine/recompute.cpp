#include "engine/recompute.h"

#include "engine/profiler.h"

namespace unetcu {

namespace {
thread_local int t_recomputing = 0;

struct RecomputeScope {
  RecomputeScope() { ++t_recomputing; }
  ~RecomputeScope() { --t_recomputing; }
};
}  // namespace

bool recomputing() { return t_recomputing > 0; }

std::vector<Tensor> checkpoint(const char* name, const PieceFn& fn,
                               const std::vector<Tensor>& inputs,
                               const std::vector<Tensor>& params) {
  std::vector<Tensor> all = inputs;
  all.insert(all.end(), params.begin(), params.end());
  if (!Tape::should_record(all)) return fn(inputs);
  std::vector<Tensor> outputs;
  {
    NoGradScope no_grad;  // nothing inside is kept
    outputs = fn(inputs);
  }
  const std::string block = BlockScope::current();
  const size_t n_in = inputs.size();
  Tape::record(name, all, outputs, [fn, inputs, n_in, block](BackwardContext& ctx) {
    // The inputs again, as leaves of a tape of their own. An input whose gradient the outer
    // tape already holds continues it in place: the same additions, in the same order, as
    // when the piece's own nodes were on the outer tape.
    std::vector<Tensor> leaves;
    std::vector<Tensor> fresh(n_in);  // outer buffers to fill once the inner pass is done
    for (size_t i = 0; i < n_in; ++i) {
      Tensor d = inputs[i].detach();
      if (ctx.needs_grad(int(i))) {
        d.set_requires_grad(true);
        double beta = 0;
        Tensor g = ctx.grad_input(int(i), &beta);
        if (beta != 0)
          d.impl().grad = g.impl_ptr();
        else
          fresh[i] = g;
      }
      leaves.push_back(d);
    }
    Tape inner;
    std::vector<Tensor> outs;
    {
      BlockScope scope(block);
      TapeScope recording(inner);
      RecomputeScope again;
      outs = fn(leaves);
    }
    std::vector<Tensor> seeds, grads;
    for (size_t k = 0; k < outs.size(); ++k)
      if (outs[k].requires_grad() && ctx.grad_output(int(k)).defined()) {
        seeds.push_back(outs[k]);
        grads.push_back(ctx.grad_output(int(k)));
      }
    inner.backward(std::move(seeds), std::move(grads));
    for (size_t i = 0; i < n_in; ++i) {
      if (!fresh[i].defined()) continue;
      const Tensor got = leaves[i].grad();
      if (got.defined())
        fresh[i].copy_(got);
      else  // the piece does not depend on this input
        fresh[i].copy_(Tensor::zeros(fresh[i].shape(), fresh[i].dtype(), fresh[i].device(),
                                     fresh[i].format()));
    }
  });
  return outputs;
}

}  // namespace unetcu
