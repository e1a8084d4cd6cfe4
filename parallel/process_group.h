// The processes of a job, as a transport: point-to-point messages and a few collectives
// between ranks 0..size-1 of a group. What runs over it — the ring and ps all-reduce of data
// parallelism (parallel/process_communicator.h), the activations and gradients of a pipeline
// cut across processes (parallel/process_pipeline.h) — is written once against this interface:
//  - MPI (parallel/mpi_group.cpp): processes started by mpirun or srun --mpi; a group is a
//    duplicate (or split) of MPI_COMM_WORLD.
//  - Gloo (parallel/gloo_group.cpp, where built): processes started with torchrun's variables
//    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and no MPI launcher; TCP between the ranks.
//
// Rules every implementation keeps, and every caller may rely on:
//  - Messages from one rank to another with one tag arrive in the order they were sent.
//  - Sender and receiver agree on each message's size; a zero-byte message is not sent at all
//    (a zero-byte send or receive returns at once on both sides).
//  - Creating a group (world_process_group, split, duplicate) is collective: every rank of the
//    parent calls it, in the same order. Groups never match each other's messages.
//  - One thread at a time per group (a group per thread that communicates: gradients on the
//    communication thread, control on the compute thread, the pipeline's messages).
//  - A call that waits longer than the group's timeout ends the job with a message naming the
//    rank and the call (a rank stopped, stuck or gone), never a silent hang.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "runtime/dtype.h"

namespace unetcu {

class ProcessGroup {
 public:
  // A send in flight; wait() returns once its buffer may be reused.
  class Request {
   public:
    virtual ~Request() = default;
    virtual void wait() = 0;
  };

  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string transport() const = 0;  // "MPI" or "Gloo"

  virtual void send(const void* data, size_t bytes, int peer, int tag) = 0;
  // Returns at once; `data` must stay alive and unchanged until wait().
  virtual std::unique_ptr<Request> isend(const void* data, size_t bytes, int peer, int tag) = 0;
  virtual void recv(void* data, size_t bytes, int peer, int tag) = 0;
  // Both at once (a ring step: to the right, from the left).
  virtual void send_recv(const void* send_data, size_t send_bytes, int to, void* recv_data,
                         size_t recv_bytes, int from, int tag) = 0;
  virtual void broadcast(void* data, size_t bytes, int root) = 0;
  virtual void barrier() = 0;
  // The library's own all-reduce (sum) in place; dtype F32 or F64.
  virtual void all_reduce_sum(void* data, int64_t count, DType dtype) = 0;

  // The ranks that pass the same colour, in the order of their rank here.
  virtual std::shared_ptr<ProcessGroup> split(int colour) = 0;
  // The same ranks, a group of their own.
  virtual std::shared_ptr<ProcessGroup> duplicate() = 0;
  // Ends every process of the job with `code` (the message is printed before).
  [[noreturn]] virtual void abort(int code) = 0;
  // Seconds a call may wait before the job is ended.
  virtual double timeout() const = 0;
};

// A new group of every process of the job, over the transport init_process_group chose
// (parallel/dist.h); collective. Error when there is no process group.
std::shared_ptr<ProcessGroup> world_process_group(double timeout_s);

}  // namespace unetcu
