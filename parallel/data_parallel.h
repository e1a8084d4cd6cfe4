// Data parallelism: one UNet replica per device, each driven by its own host thread and fed
// its own shard of every global batch; gradients are averaged across replicas by all-reduce
// in buckets that start while backward is still running; then every replica takes the same
// optimizer step, so replicas stay identical (contract 6).
//
//  - Start: parameters and BN buffers are broadcast from rank 0.
//  - Each step (without --sync-bn): BN running statistics are broadcast from rank 0 first, as
//    PyTorch DDP does, so they follow rank 0: one collective, since each replica keeps them
//    packed in one buffer (pack_buffers; one per buffer was ~90 for the UNet).
//  - Buckets: parameters in reverse order of registration (≈ reverse order of use in forward,
//    so backward finishes them first), a small first bucket (1 MB) then 25 MB buckets. Each
//    bucket is one flat buffer and the gradients of its parameters are views into it, so
//    backward accumulates straight into the buffer (zeroed before each step) and the bucket is
//    all-reduced (average) in place as soon as its last gradient is final, in bucket order on
//    every rank: no copy in or out.
//  - bf16_allreduce: the buckets travel as bfloat16 copies (see the option).
//  - --sync-bn: batch-norm statistics are all-reduced over the replicas (a second
//    communicator group, so it never interleaves with the gradient buckets).
//  - cuda_graphs (GPUs): after two eager steps at the first shard shape, every replica captures
//    its step up to the optimizer — the buffers' broadcast, forward, loss, backward and the
//    buckets' NCCL all-reduces on the communication stream — into one CUDA graph on its compute
//    stream, and replays it each step at that shape (the shard copied into the graph's inputs
//    first); the optimizer steps eagerly. The replicas capture together and agree: where any
//    capture fails, all go on eagerly (one warning) over new communicators (in one process;
//    across processes that is an error: NCCL requires every rank's capture to be alike). Other shapes and profiled steps run
//    eagerly; record_events logs the capture's order, not the replays'.
#pragma once
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "data/batch.h"
#include "engine/graph_step.h"
#include "engine/optim.h"
#include "models/unet.h"
#include "parallel/communicator.h"
#include "parallel/placement.h"
#include "parallel/process_group.h"
#include "parallel/worker_pool.h"

namespace unetcu {

// The placement's devices hold one replica each, with `threads` each on CPU devices;
// across_processes: one replica in this process (devices: its one device), one rank of a job of
// several processes, the communicators spanning the processes (parallel/process_communicator.h)
// of `process_group` (null: every process of the job); GPU ranks: NCCL communicators whose
// unique id comes over this group, or from NCCL's own rendezvous (NCCL_COMM_ID,
// parallel/nccl_communicator.h) without any. accumulate_rows: the all-reduce overlaps the last
// chunk's backward only; with cuda_graphs every chunk is in the one graph.
struct DataParallelOptions : Placement {
  AllReduceAlgo allreduce = AllReduceAlgo::Ring;
  bool sync_bn = false;
  // Gradients all-reduced in bfloat16 (PyTorch DDP's bf16_compress_hook): each bucket is
  // rounded to a bfloat16 copy, summed (additions in
  // float32, every partial sum rounded to bfloat16), widened back into the float32 bucket and
  // divided by N there, before the optimizer step. Half the bytes on the wire; the mean of N
  // replicas is off by at most 2^-8 (1 + 2^-8)^N times the mean of their magnitudes. Not with
  // the MPI library's own all-reduce (it has no bfloat16 sum).
  bool bf16_allreduce = false;
  size_t bucket_bytes = size_t(25) << 20;
  size_t first_bucket_bytes = size_t(1) << 20;
  bool record_events = false;   // keep an ordered log of backward nodes and bucket launches
  double collective_timeout = kDefaultCollectiveTimeout;  // seconds; then every rank fails
  std::shared_ptr<ProcessGroup> process_group;
  // A bad value of a setting the user gives: one line naming it (runtime/common.h setting()).
  void check() const;
};

// Moves the model's floating-point buffers (BN running statistics) into one flat tensor on
// their device and returns it: each buffer becomes a view of its slot, for every handle of it
// (the module's own included), so one collective moves them all. Slots start 256 bytes apart
// at least, as the gradients in their buckets; the padding stays zero. Undefined for a model
// without buffers; an error where its buffers differ in dtype or device.
Tensor pack_buffers(const Module& model);

class DataParallel {
 public:
  DataParallel(const UNetConfig& model, const DataParallelOptions& options,
               const OptimizerFactory& make_optimizer);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  int size() const;  // replicas in this process
  // This process's first replica's rank among all replicas, and their number (across
  // processes when options().across_processes).
  int global_rank() const;
  int global_size() const;
  // The mean of `value` over every process's replicas (each process passes its own mean).
  double average_across_processes(double value);
  // The same for a one-element loss on replica 0's device, on that device (float32 on a GPU,
  // float64 on the CPU; a GPU's collective is queued behind the step, not waited for).
  Tensor average_across_processes(const Tensor& value);
  UNet& replica(int rank);
  // Throws the reason when a communicator was aborted (a rank failed, or a collective timed
  // out): the collectives queued before then end without their results.
  void check_communicators() const;
  const DataParallelOptions& options() const { return options_; }

  // One optimizer step on a global batch: shards[r] goes to replica r (taken as it is when it
  // is on the replica's device already, copied there otherwise). Returns each replica's loss
  // (its shard's mean).
  std::vector<double> step(const std::vector<Batch>& shards, LossKind loss);
  // The same step, not waited for: each replica's loss tensor on its device. On GPUs the step's
  // work (collectives and optimizer included) is queued on the devices' streams and may still
  // run when this returns; step() reads the losses at once. A replayed CUDA graph's loss tensor
  // is rewritten by the next replay: copy it behind the step (StepLoss does) before the next.
  // Read after a wait on the host, a GPU loss is valid only if check_communicators() passes.
  std::vector<Tensor> step_async(const std::vector<Batch>& shards, LossKind loss);

  Optimizer& optimizer(int rank);
  // Makes every replica equal to rank 0: parameters, buffers, counters and optimizer state
  // (at the start, and after rank 0 has been loaded from a checkpoint).
  void replicate_rank0();

  // Runs f(rank) on every replica's thread and waits for all; rethrows the first error.
  void run(const std::function<void(int)>& f);

  // Rank 0's event log of the last step (with record_events): "backward <op>",
  // "allreduce bucket <k>", in the order they happened.
  std::vector<std::string> events() const;
  size_t bucket_count() const;
  // Rank r's gradient buckets: the flat buffers its parameters' gradients are views into.
  std::vector<Tensor> buckets(int rank) const;
  // cuda_graphs: whether the step is captured (replayed at its shape), and the steps replayed.
  bool graph_captured() const { return graph_.captured(); }
  int64_t graph_replays() const { return graph_.replays(); }
  // cuda_graphs and not fallen back to eager steps.
  bool uses_cuda_graphs() const { return graph_.on(); }
  // This process's replicas whose capture failed (then all went on eagerly).
  int graph_capture_failures() const { return graph_capture_failures_; }

 private:
  struct Replica;
  // Replica r's step up to the optimizer on its device's images and masks: forward, loss,
  // backward, the buckets all-reduced into its gradients. Returns the loss (on the device).
  Tensor forward_backward(int r, const Tensor& images, const Tensor& masks, LossKind loss);
  // cuda_graphs: whether this step replays the graph, capturing it first when it is time.
  bool graph_step_ready(const std::vector<Batch>& shards, LossKind loss);
  // Makes the replicas' communicator groups (releasing any they had).
  void connect();
  int graph_capture_failures_ = 0;
  DataParallelOptions options_;
  std::vector<std::unique_ptr<Replica>> replicas_;
  std::unique_ptr<WorkerPool> pool_;
  mutable std::mutex events_mu_;
  std::vector<std::string> events_;
  // cuda_graphs: each replica's captured step (a slot each). Last, so that the graphs go
  // before the communicators (NCCL's persistent resources are theirs).
  GraphStep graph_;
};

}  // namespace unetcu
