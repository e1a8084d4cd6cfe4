// On a GPU: Adam over many tensors in one launch; DP as one launched process (an NCCL rank
// made for processes); and after warm-up a training step on one GPU takes no device memory from cudaMalloc
// (every block comes back from the device pool). Stages on several streams are not held to it:
// a block freed on one stream is handed to another only once its event has completed, which
// depends on timing. The CPU twin is tests/test_steady_alloc.cpp.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>

#include "parallel/data_parallel.h"

#include "engine/optim.h"
#include "engine/tape.h"
#include "runtime/cuda_api.h"
#include "../steady_alloc.h"
#include "../small_models.h"

using namespace unetcu;
using namespace unetcu::testing;

namespace {

UNetConfig gpu_model() { return small_unet(4, Device::cuda(0)); }

size_t device_system_allocations() { return cuda::device_memory_stats(0).system_allocations; }

}  // namespace

TEST_CASE("after warm-up a training step takes no GPU memory from the system") {
  SyntheticSegmentation data(64, 2);
  const Batch b = data.batch({0, 1, 2, 3});
  const OptimizerFactory adam = optimizer_factory({});
  for (bool mixed : {false, true}) {  // float32 NCHW; bf16 NHWC
    CAPTURE(mixed);
    UNetConfig cfg = gpu_model();
    cfg.bf16_activations = mixed;
    cfg.format = mixed ? MemoryFormat::NHWC : MemoryFormat::NCHW;
    SingleDeviceStrategy s(cfg, {}, adam, LossKind::BCEDice);
    CHECK(system_allocations_after_warmup(s, b, 2, 3, device_system_allocations) == 0);
  }
}

TEST_CASE("Adam over more tensors than one launch holds (300) equals the CPU step") {
  // adam_update_many: 256 tensors per launch, so 300 take two; sizes across the 4096-element
  // chunks. float32 on both; the GPU may contract multiply-adds (FMA), so the parameters agree
  // to float32 rounding (1e-6 relative) rather than in every bit.
  std::vector<Tensor> cpu, gpu;
  for (int k = 0; k < 300; ++k) {
    const int64_t n = 1 + (k * 977) % 9000;
    std::vector<double> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[size_t(i)] = std::sin(0.1 * double(i) + k);
    cpu.push_back(Tensor::from_vector({n}, v).set_requires_grad(true));
    gpu.push_back(Tensor::from_vector({n}, v).to(Device::cuda(0)).set_requires_grad(true));
  }
  AdamOptions o;
  o.weight_decay = 0.01;
  Adam oc(cpu, o), og(gpu, o);
  for (int step = 0; step < 2; ++step)
    for (auto [params, opt] : {std::pair{&cpu, &oc}, std::pair{&gpu, &og}}) {
      opt->zero_grad();
      for (size_t k = 0; k < params->size(); ++k) {
        Tape t;
        Tensor y;
        {
          TapeScope s(t);
          y = scale((*params)[k], 1.0 + 0.01 * double(k + step));
        }
        t.backward({y}, {Tensor::full((*params)[k].shape(), 0.5 - 0.003 * double(k), DType::F32,
                                      (*params)[k].device())});
      }
      opt->step();
    }
  double worst = 0;
  for (size_t k = 0; k < cpu.size(); ++k) {
    const Tensor back = gpu[k].to(Device::cpu());
    for (int64_t i = 0; i < back.numel(); ++i)
      worst = std::max(worst, std::fabs(back.at(i) - cpu[k].at(i)) / std::max(1e-3, std::fabs(cpu[k].at(i))));
  }
  CHECK(worst < 1e-6);
}

TEST_CASE("data parallelism as one launched process (NCCL_COMM_ID, a group of one) equals one GPU") {
  // The NCCL rank made for processes (make_nccl_process_communicators): its unique id from
  // NCCL's own rendezvous at NCCL_COMM_ID, the control group an ncclCommSplit of the gradient
  // group. One rank: the averaged gradients are the rank's own, so the step equals one GPU's.
  const char* had = std::getenv("NCCL_COMM_ID");
  setenv("NCCL_COMM_ID", "127.0.0.1:29563", 1);
  UNetConfig c = gpu_model();
  DataParallelOptions o;
  o.devices = {Device::cuda(0)};
  o.across_processes = true;
  o.process_rank = 0;
  o.process_count = 1;
  const OptimizerFactory sgd = optimizer_factory({OptimizerKind::SGD, 0.05, 0.9, 0});
  DataParallel dp(c, o, sgd);
  UNet single(c);
  auto opt = sgd(single.parameters());
  SyntheticSegmentation data(64, 3);
  for (int step = 0; step < 2; ++step) {
    const Batch b = data.batch({step * 2, step * 2 + 1});
    const double dp_loss = dp.step({b}, LossKind::BCEDice)[0];
    opt->zero_grad();
    Tape tape;
    Tensor loss;
    {
      TapeScope s(tape);
      loss = segmentation_loss(LossKind::BCEDice, single.forward(b.images.to(Device::cuda(0))),
                               b.masks.to(Device::cuda(0)));
    }
    tape.backward(loss);
    opt->step();
    // Same device and algorithms; the all-reduce of one rank returns its own values.
    CHECK(std::fabs(dp_loss - loss.item()) <= 1e-5 * std::fabs(loss.item()));
    const auto pa = dp.replica(0).parameters(), pb = single.parameters();
    double worst = 0;
    for (size_t i = 0; i < pa.size(); ++i) {
      const Tensor a = pa[i].to(Device::cpu()), b2 = pb[i].to(Device::cpu());
      for (int64_t k = 0; k < a.numel(); ++k)
        worst = std::max(worst, std::fabs(a.at(k) - b2.at(k)) / std::max(1e-3, std::fabs(b2.at(k))));
    }
    CHECK(worst < 1e-5);
  }
  if (had) setenv("NCCL_COMM_ID", had, 1); else unsetenv("NCCL_COMM_ID");
}
