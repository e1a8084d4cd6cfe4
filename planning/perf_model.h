// A performance model of data and model parallelism: from one device's per-block forward and
// backward times (per sample), activation sizes, parameter bytes and a link's bandwidth and
// latency, predict the step time and the per-epoch speedup over one device of
//  - DP with N replicas: compute of one replica's batch, plus the gradient all-reduce that
//    the buckets overlap with backward (ring: 2(N-1)/N·S/B + 2(N-1)·latency per bucket;
//    PS: 2(N-1)·S/B + 2·latency through rank 0), the last bucket's reduce left exposed;
//  - MP with S stages: the schedule simulated micro-batch by micro-batch (split_search.h);
//  - a loader that delivers at most `loader_images_per_s` (0: unlimited) caps every method.
// Speedup is per epoch: the same images, so DP's N·b images per step count N times.
#pragma once
#include <string>
#include <vector>

#include "planning/split_search.h"

namespace unetcu {

struct LinkPreset {
  const char* name;
  double bandwidth;  // bytes/s, one direction, achievable
  double latency;    // s per message
};
// PCIe 3.0 x16, PCIe 4.0 x16, PCIe 5.0 x16, NVLink 4 (H100/H200, per GPU): leads from the
// published link rates at about 80% efficiency.
const std::vector<LinkPreset>& link_presets();
LinkModel link_by_name(const std::string& name);  // a preset name, or "<GB/s>,<us>"

struct DpPrediction {
  double compute_s, allreduce_s, step_s, speedup;
};
// Ring or PS all-reduce of `bytes` over N ranks (no overlap).
double allreduce_seconds(double bytes, int n, AllReduceAlgo algo, const LinkModel& link);
// One DP step with batch b per replica; buckets of bucket_bytes overlap backward.
DpPrediction predict_dp(const std::vector<BlockProfile>& blocks, double param_bytes, int n,
                        int batch_per_replica, AllReduceAlgo algo, const LinkModel& link,
                        double bucket_bytes = 25e6, double loader_images_per_s = 0);

struct MpPrediction {
  std::vector<int> cuts;
  int split_size;
  double step_s, speedup;
};
// The best cut into `stages` contiguous stages (evenly balanced by compute, then refined over
// every single cut for two stages) and split size for a batch; speedup against one device on
// the same batch.
MpPrediction predict_mp(const std::vector<BlockProfile>& blocks, int stages, int batch,
                        const std::vector<int>& split_sizes, Schedule schedule,
                        const LinkModel& link, double loader_images_per_s = 0);

// One device's step on a batch (forward + backward of every block).
double single_step_seconds(const std::vector<BlockProfile>& blocks, int batch);

// Per-block profile of the full UNet-ResNet34 derived from FLOP counts: each block's forward
// at `flops_per_s` effective rate, backward at twice its forward; image size `size`.
std::vector<BlockProfile> flop_derived_profile(int size, double flops_per_s);

// The model's report: DP (ring and PS) and MP on N = 2, 4, 8 over the given link.
std::string perf_model_report(const std::vector<BlockProfile>& blocks, double param_bytes,
                              int dp_batch, int mp_batch, const LinkModel& link,
                              double loader_images_per_s);

}  // namespace unetcu
