// Run under a launcher (mpirun -np S*R): R data-parallel replicas of an S-stage pipeline, one
// stage per process (parallel/process_pipeline.h), float64, two Adam steps; then process 0
// collects every stage and checks the contract: the same as one device accumulating the
// gradients of every replica's micro-batches, each weighted by its share of the global batch.
// Usage: dist_pipeline_check STAGES CUTS(block indices, comma separated) SPLIT BATCH_PER_REPLICA
// [1f1b] [clip=X] (clip: gradients clipped to total norm X, which must be in force: the one
// device's gradient norm above 10 X at every step). Exit 0 when it holds, 1 with the worst
// differences when it does not.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "data/synthetic.h"
#include "engine/optim.h"
#include "engine/tape.h"
#include "models/unet.h"
#include "parallel/dist.h"
#include "parallel/process_pipeline.h"
#include "small_models.h"

using namespace unetcu;

namespace {

UNetConfig model_config() { return testing::small_unet(21, Device::cpu(), DType::F64); }

double max_grad_norm = 0;

std::unique_ptr<Optimizer> adam(std::vector<Tensor> p) {
  AdamOptions o;
  o.lr = 1e-2;
  auto opt = std::make_unique<Adam>(std::move(p), o);
  opt->set_max_grad_norm(max_grad_norm);
  return opt;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    UNETCU_CHECK(argc >= 5, "usage: dist_pipeline_check STAGES CUTS SPLIT BATCH_PER_REPLICA [1f1b] [clip=X]");
    const int S = std::atoi(argv[1]);
    std::vector<int> cuts;
    std::stringstream cs(argv[2]);
    for (std::string t; std::getline(cs, t, ',');) cuts.push_back(std::atoi(t.c_str()));
    const int split = std::atoi(argv[3]), per_replica = std::atoi(argv[4]);
    bool one_f_one_b = false;
    for (int a = 5; a < argc; ++a) {
      const std::string arg = argv[a];
      if (arg == "1f1b")
        one_f_one_b = true;
      else if (arg.rfind("clip=", 0) == 0)
        max_grad_norm = std::atof(arg.c_str() + 5);
      else
        UNETCU_CHECK(false, "unknown argument ", arg);
    }
    UNETCU_CHECK(std::isfinite(max_grad_norm) && max_grad_norm >= 0, "clip=X needs a finite X >= 0 (one in force)");

    const DistEnv env = detect_dist(DistMode::Auto);
    UNETCU_CHECK(env.multi(), "start under a launcher (mpirun -np S*R)");
    init_process_group(env);
    set_cpu_threads(1);
    PipelineOptions o;
    o.devices = {Device::cpu(0)};
    o.cuts = cuts;
    o.split_size = split;
    o.schedule = one_f_one_b ? Schedule::OneFOneB : Schedule::GPipe;
    o.threads = 1;
    o.pipeline_stages = S;
    DataParallelOptions replicas;
    replicas.process_group = world_process_group(120);
    ProcessPipeline pipe(model_config(), o, replicas, adam);
    const int R = pipe.replicas();
    const int B = per_replica * R;  // the global batch

    SyntheticSegmentation data(64, 5);
    UNet single(model_config());
    auto opt = adam(single.parameters());
    double worst_loss = 0, least_norm = INFINITY;
    for (int step = 0; step < 2; ++step) {
      std::vector<int64_t> idx;
      for (int i = 0; i < B; ++i) idx.push_back(step * 100 + i);
      const Batch global = data.batch(idx, DType::F64);
      const Batch mine{global.images.rows(int64_t(pipe.replica()) * per_replica, int64_t(pipe.replica() + 1) * per_replica),
                       global.masks.rows(int64_t(pipe.replica()) * per_replica, int64_t(pipe.replica() + 1) * per_replica)};
      const double loss = pipe.step(pipe.place(mine), LossKind::BCEDice);
      if (env.rank != 0) continue;
      // One device: every replica's micro-batches, each weighted by its share of the global batch.
      opt->zero_grad();
      double ref = 0;
      for (int r = 0; r < R; ++r)
        for (int lo = r * per_replica; lo < (r + 1) * per_replica; lo += split) {
          const int hi = std::min(lo + split, (r + 1) * per_replica);
          Tape tape;
          Tensor l;
          {
            TapeScope scope(tape);
            l = scale(segmentation_loss(LossKind::BCEDice, single.forward(global.images.rows(lo, hi)),
                                        global.masks.rows(lo, hi)),
                      double(hi - lo) / B);
          }
          ref += l.item();
          tape.backward(l);
        }
      least_norm = std::min(least_norm, std::sqrt(opt->grad_square_sum().item()));
      opt->step();
      worst_loss = std::max(worst_loss, std::fabs(loss - ref) / std::fabs(ref));
    }
    pipe.collect();
    if (env.rank != 0) return 0;
    // Tolerances as contract 5 (tests/test_pipeline.cpp): the sums of a tensor's gradients
    // are added in another order (stage order, replicas' mean vs one sum), ~1e-16 relative,
    // grown by batch norm's cancellation and by Adam's division by sqrt(v) + eps to ~1e-8 in
    // the parameters after two steps: checked at 1e-7 relative (floor 1e-3); the loss, an
    // ordinary sum, at 1e-12.
    const auto pa = pipe.model().parameters(), pb = single.parameters();
    double worst = 0;
    for (size_t i = 0; i < pa.size(); ++i)
      for (int64_t k = 0; k < pa[i].numel(); ++k)
        worst = std::max(worst, std::fabs(pa[i].at(k) - pb[i].at(k)) / std::max(1e-3, std::fabs(pb[i].at(k))));
    // The parameters moved: a check that compares two untrained models would pass vacuously.
    UNet untouched(model_config());
    const auto pu = untouched.parameters();
    double moved = 0;
    for (size_t i = 0; i < pu.size(); ++i)
      for (int64_t k = 0; k < pu[i].numel(); ++k) moved = std::max(moved, std::fabs(pu[i].at(k) - pb[i].at(k)));
    std::printf("%d stages x %d replicas, split %d, batch %d per replica, %s: loss rel diff %.3g, "
                "parameter rel diff %.3g (moved %.3g)",
                S, R, split, per_replica, one_f_one_b ? "1f1b" : "gpipe", worst_loss, worst, moved);
    if (max_grad_norm > 0) std::printf(", clipped to norm %g (gradient norm at least %.3g)", max_grad_norm, least_norm);
    std::printf("\n");
    const bool ok = worst_loss <= 1e-12 && worst <= 1e-7 && moved > 1e-3 &&
                    (max_grad_norm == 0 || least_norm > 10 * max_grad_norm);
    std::printf("%s\n", ok ? "ok: equals one device accumulating" : "FAIL");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    abort_process_group(1);
    return 1;
  }
}
