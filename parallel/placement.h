// Where a training strategy's work runs and how: the part of the options that every strategy
// takes (one device, data parallel, a pipeline in one process or across processes). The
// strategies' own options (DataParallelOptions, PipelineOptions) extend it, so a run's
// placement is set once and handed to whichever strategy it builds.
#pragma once
#include <cstdint>
#include <vector>

#include "runtime/device.h"

namespace unetcu {

constexpr int kMaxThreads = 1024;  // the most threads per device a user may ask for

struct Placement {
  std::vector<Device> devices;  // one device: one; DP: one per replica; a pipeline: one per stage
  int threads = 0;              // CPU devices: threads each (0: the cores shared out, at least 1)
  // GPUs: capture the step into a CUDA graph and replay it (one device; DP: each replica's; a
  // pipeline in one process: every stage's, over their streams), with every accumulated chunk
  // or micro-batch of the step.
  bool cuda_graphs = false;
  // One device and DP: gradient accumulation, a batch (DP: a replica's shard) run in chunks of
  // this many rows (the last may be smaller), each chunk's loss weighted by its share, the
  // gradients added before the one optimizer step; 0: at once. Pipelines accumulate over their
  // micro-batches already.
  int64_t accumulate_rows = 0;
  // One process of a job of several (DP: one replica each; a pipeline: one stage each): this
  // process's rank of their count.
  bool across_processes = false;
  int process_rank = 0, process_count = 1;
};

}  // namespace unetcu
