// A performance model of data and model parallelism: from one device's per-block forward and
// backward times (per sample), activation sizes, parameter bytes and a link's bandwidth and
// latency, predict the step time and the per-epoch speedup over one device of
//  - DP with N replicas: compute of one replica's batch, plus the gradient all-reduce that
//    the buckets overlap with backward (ring: 2(N-1)/N·S/B + 2(N-1)·latency per bucket;
//    PS: 2(N-1)·S/B + 2·latency through rank 0), the last bucket's reduce left exposed;
//  - MP with S stages: the schedule simulated micro-batch by micro-batch (split_search.h);
//  - a loader that delivers at most `loader_images_per_s` (0: unlimited) caps every method;
//  - what a step costs beside the blocks (StepCosts, measured by measure_step_costs): the
//    optimizer step, zeroing DP's gradient buckets, the BN buffers' broadcast from rank 0, and
//    whether the all-reduce can overlap backward at all (not when it runs on the cores that
//    compute);
//  - devices that share a machine's cores and memory run slower together than alone
//    (BlockProfile::shared_slowdown, StepCosts::optimizer_slowdown: measured, 1 for GPUs);
//  - per-sample block times depend on the micro-batch (BlockProfile::by_batch): measured at
//    several sizes on CPUs, an under-fill curve for the FLOP-derived GPU profile (below).
// Speedup is per epoch: the same images, so DP's N·b images per step count N times.
#pragma once
#include <string>
#include <vector>

#include "engine/optim.h"
#include "planning/split_search.h"

namespace unetcu {

struct LinkPreset {
  const char* name;
  double bandwidth;  // bytes/s, one direction, achievable
  double latency;    // s per message
};
// Within a machine: PCIe 3.0 x16, PCIe 4.0 x16, PCIe 5.0 x16, NVLink 4 (H100/H200, per GPU).
// Across machines, one NIC per GPU: InfiniBand NDR (400 Gb/s) and HDR (200 Gb/s), 2 us per
// message (RDMA verbs through one switch, NCCL's own protocol overheads included); 100 GbE
// with RoCE, 5 us; 25 GbE over TCP, 25 us (the kernel's socket path). Bandwidths: the
// published link rates at about 80% efficiency.
const std::vector<LinkPreset>& link_presets();
LinkModel link_by_name(const std::string& name);  // a preset name, or "<GB/s>,<us>"

// What a training step costs beside the blocks' forward and backward, measured on the run's
// devices (measure_step_costs). All zero (the default): the blocks alone, as for a GPU
// profile derived from FLOPs.
struct StepCosts {
  double optimizer_s = 0;         // one optimizer step over every parameter, one device alone
  double optimizer_slowdown = 1;  // every device stepping at once, over alone
  double grad_zero_s = 0;         // DP: zeroing the gradient buckets before each step
  double bn_broadcast_s = 0;      // DP: BN running statistics broadcast from rank 0 each step
  // false: the all-reduce runs on the cores that compute (CPU devices using every core), so
  // it adds to backward instead of hiding behind it.
  bool comm_overlaps_compute = true;
};

struct DpPrediction {
  double compute_s, allreduce_s, step_s, speedup;
};
// Ring or PS all-reduce of `bytes` over N ranks (no overlap).
double allreduce_seconds(double bytes, int n, AllReduceAlgo algo, const LinkModel& link);
// The link a measured all-reduce implies: latency from a tiny all-reduce's time, bandwidth
// from a large one's (`bytes`), each solved from allreduce_seconds' formula for `algo`.
LinkModel link_from_allreduce(double small_s, double large_s, double bytes, int n, AllReduceAlgo algo);
// One DP step with batch b per replica; buckets of bucket_bytes overlap backward (when
// costs.comm_overlaps_compute). Block times at micro-batch b, slowed by shared_slowdown when
// n > 1.
DpPrediction predict_dp(const std::vector<BlockProfile>& blocks, double param_bytes, int n,
                        int batch_per_replica, AllReduceAlgo algo, const LinkModel& link,
                        double bucket_bytes = 25e6, double loader_images_per_s = 0,
                        const StepCosts& costs = {});

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

// One device's step on a batch (forward + backward of every block at that batch size, and the
// optimizer step).
double single_step_seconds(const std::vector<BlockProfile>& blocks, int batch, const StepCosts& costs = {});

// One pipeline step (predict_step) and then every stage's optimizer step on its own
// parameters (BlockProfile::param_bytes), the stages stepping at once.
double predict_pipeline_step(const std::vector<BlockProfile>& blocks, const std::vector<int>& cuts,
                             int batch, int split_size, Schedule schedule, const LinkModel& link,
                             const StepCosts& costs);

// How long `work` (seconds each, alone) takes when all start at once and k of the N run
// together at 1 / (1 + (slowdown - 1)(k - 1)/(N - 1)) of their speed alone.
double concurrent_seconds(std::vector<double> work, double slowdown);

// Per-block profile of the full UNet with `encoder` (the article's resnet34 by default)
// derived from FLOP counts: each block's forward at `flops_per_s` effective rate, backward at
// twice its forward; image size `size`.
std::vector<BlockProfile> flop_derived_profile(int size, double flops_per_s,
                                               EncoderKind encoder = EncoderKind::ResNet34);

// A GPU's under-fill: a convolution's implicit GEMM gives each thread block (CTA) a 128x64
// tile of the output, 8192 output elements, and an SM holds 2 such CTAs at once (256 threads
// each, limited by registers and shared memory for float32 tiles); a launch fills the GPU only
// when it has SMs x 2 x 8192 output elements. With fewer, e/(SMs x 16384) of the SMs work and
// the launch still takes one full wave: efficiency(e) = min(1, e / (SMs x 16384)). H200: 132
// SMs, so 2.16 M output elements saturate it (layer4 at 512² has 131 k per sample: 17
// samples); the RTX 2070 SUPER: 40 SMs, 0.66 M. A block's launches are taken at its output's
// size (channels x H x W x micro-batch); forward and backward follow the same curve.
struct GpuFill {
  int sms = 0;                       // 0: no under-fill (every size at the full rate)
  double elements_per_sm = 2 * 8192;  // output elements one SM holds in flight
  double saturating_elements() const { return sms * elements_per_sm; }
};
// The profile with by_batch at 1, 2, 4, ... samples until every block is saturated: per-sample
// time at m is the full-rate time / efficiency(m x the block's output elements per sample).
std::vector<BlockProfile> flop_derived_profile(int size, double flops_per_s, const GpuFill& fill,
                                               EncoderKind encoder = EncoderKind::ResNet34);

// Measures the StepCosts of data/model parallelism over `devices` (CPU devices, `threads`
// each): the optimizer alone and with every device stepping at once; zeroing one replica's
// gradient buckets (param bytes) with every replica doing it at once; rank 0's BN buffers
// broadcast over the in-process ring; comm_overlaps_compute false when threads x devices
// fill every core. On GPUs only the optimizer is measured (its slowdown stays 1).
StepCosts measure_step_costs(const UNetConfig& model, const std::vector<Device>& devices, int threads,
                             const OptimizerFactory& make_optimizer, LossKind loss, const Batch& batch,
                             int repeats);
// Times an all-reduce over the in-process CPU ring (`devices` CPU devices, `threads` each) of
// `bytes` and of 64 bytes, alone, and returns the link they imply for `algo`.
LinkModel measure_allreduce_link(const std::vector<Device>& devices, AllReduceAlgo algo, double bytes,
                                 int repeats);
// Times copies of `bytes` and of 4 bytes from devices[0] to devices[1] (a pipeline's
// activation transfer) and returns the link they imply.
LinkModel measure_transfer_link(const Device& from, const Device& to, double bytes, int repeats);

// The model's report: DP (ring and PS) and MP on N = 2, 4, 8 over the given link.
std::string perf_model_report(const std::vector<BlockProfile>& blocks, double param_bytes,
                              int dp_batch, int mp_batch, const LinkModel& link,
                              double loader_images_per_s);

}  // namespace unetcu
