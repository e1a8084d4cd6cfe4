// The CUDA emulator's own checks (runtime/cuda/emu/README.md), in the emulator build only:
// a block's barriers and warp shuffles give the block sum, a launch CUDA rejects fails, a
// synchronisation inside a stream capture invalidates it, and a stream's work is asynchronous
// to the host (an event is not reached while the stream is held); a capture over two streams
// keeps the dependencies its events make, replays independent work in another order than it
// was issued in, refuses to end with a stream not joined back, and once invalidated refuses
// every call into it.
#include <doctest/doctest.h>

#include <atomic>
#include <thread>

#include "kernels/cuda/common.cuh"

namespace {

__global__ void block_sums_kernel(const double* x, double* out) {
  const double s = unetcu::kernels::cuda::block_sum(x[blockIdx.x * blockDim.x + threadIdx.x]);
  if (threadIdx.x == 0) out[blockIdx.x] = s;
}

__global__ void nothing_kernel() {}

void gate(void* open) {
  while (!static_cast<std::atomic<bool>*>(open)->load()) std::this_thread::yield();
}

}  // namespace

TEST_CASE("CUDA emulator: block sums through barriers and shuffles, rejected launches, captures, asynchronous streams") {
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  cudaStream_t s;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  const int blocks = 3, threads = 256;
  double host[blocks * threads], sums[blocks];
  for (int i = 0; i < blocks * threads; ++i) host[i] = double(i % 7) - 2.5;
  double *x, *out;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&x), sizeof host) == cudaSuccess);
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&out), sizeof sums) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(x, host, sizeof host, cudaMemcpyHostToDevice, s) == cudaSuccess);
  block_sums_kernel<<<blocks, threads, 0, s>>>(x, out);
  CHECK(cudaGetLastError() == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(sums, out, sizeof sums, cudaMemcpyDeviceToHost, s) == cudaSuccess);
  for (int b = 0; b < blocks; ++b) {
    double want = 0;
    for (int t = 0; t < threads; ++t) want += host[b * threads + t];
    CHECK(sums[b] == want);
  }

  nothing_kernel<<<dim3(1, 70000), 32, 0, s>>>();  // grid.y above 65535
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  nothing_kernel<<<1, 2048, 0, s>>>();  // more than 1024 threads a block
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);

  REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed) == cudaSuccess);
  CHECK(cudaStreamSynchronize(s) == cudaErrorStreamCaptureUnsupported);
  cudaGraph_t g = nullptr;
  CHECK(cudaStreamEndCapture(s, &g) == cudaErrorStreamCaptureInvalidated);
  CHECK(g == nullptr);
  cudaGetLastError();

  std::atomic<bool> open{false};
  cudaEvent_t e;
  REQUIRE(cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess);
  REQUIRE(cudaLaunchHostFunc(s, gate, &open) == cudaSuccess);
  REQUIRE(cudaEventRecord(e, s) == cudaSuccess);
  CHECK(cudaEventQuery(e) == cudaErrorNotReady);
  cudaGetLastError();
  open = true;
  CHECK(cudaEventSynchronize(e) == cudaSuccess);
  CHECK(cudaEventQuery(e) == cudaSuccess);
  CHECK(cudaEventDestroy(e) == cudaSuccess);
  CHECK(cudaStreamDestroy(s) == cudaSuccess);
  CHECK(cudaFree(x) == cudaSuccess);
  CHECK(cudaFree(out) == cudaSuccess);
}

TEST_CASE("CUDA emulator: a capture over two streams, forked and joined by events") {
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  cudaStream_t s0, s1;
  REQUIRE(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking) == cudaSuccess);
  cudaEvent_t fork, join;
  REQUIRE(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming) == cudaSuccess);
  REQUIRE(cudaEventCreateWithFlags(&join, cudaEventDisableTiming) == cudaSuccess);
  unsigned char* cell;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&cell), 1) == cudaSuccess);
  // Writes 1 on s0, then 2 on s1, the second after an event of the first when `ordered`;
  // returns the replay's result.
  auto run = [&](bool ordered) {
    cudaStreamCaptureStatus status;
    REQUIRE(cudaStreamBeginCapture(s0, cudaStreamCaptureModeRelaxed) == cudaSuccess);
    REQUIRE(cudaEventRecord(fork, s0) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(s1, fork, 0) == cudaSuccess);
    CHECK(cudaStreamIsCapturing(s1, &status) == cudaSuccess);
    CHECK(status == cudaStreamCaptureStatusActive);
    REQUIRE(cudaMemsetAsync(cell, 1, 1, s0) == cudaSuccess);
    if (ordered) {
      REQUIRE(cudaEventRecord(fork, s0) == cudaSuccess);
      REQUIRE(cudaStreamWaitEvent(s1, fork, 0) == cudaSuccess);
    }
    REQUIRE(cudaMemsetAsync(cell, 2, 1, s1) == cudaSuccess);
    REQUIRE(cudaEventRecord(join, s1) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(s0, join, 0) == cudaSuccess);
    cudaGraph_t g = nullptr;
    REQUIRE(cudaStreamEndCapture(s0, &g) == cudaSuccess);
    CHECK(cudaStreamIsCapturing(s1, &status) == cudaSuccess);
    CHECK(status == cudaStreamCaptureStatusNone);
    cudaGraphExec_t exec;
    REQUIRE(cudaGraphInstantiate(&exec, g, 0) == cudaSuccess);
    REQUIRE(cudaMemsetAsync(cell, 0, 1, s0) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, s0) == cudaSuccess);
    unsigned char out = 9;
    REQUIRE(cudaMemcpyAsync(&out, cell, 1, cudaMemcpyDeviceToHost, s0) == cudaSuccess);
    CHECK(cudaGraphExecDestroy(exec) == cudaSuccess);
    CHECK(cudaGraphDestroy(g) == cudaSuccess);
    return int(out);
  };
  CHECK(run(true) == 2);   // the event orders them: s0's write, then s1's
  CHECK(run(false) == 1);  // no dependency: the replay ran them in the other order

  // A fork never joined back: the capture cannot end, and both streams leave it.
  REQUIRE(cudaStreamBeginCapture(s0, cudaStreamCaptureModeRelaxed) == cudaSuccess);
  REQUIRE(cudaEventRecord(fork, s0) == cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(s1, fork, 0) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(cell, 2, 1, s1) == cudaSuccess);
  cudaGraph_t g = nullptr;
  CHECK(cudaStreamEndCapture(s0, &g) == cudaErrorStreamCaptureUnjoined);
  CHECK(g == nullptr);
  cudaGetLastError();
  cudaStreamCaptureStatus status;
  CHECK(cudaStreamIsCapturing(s1, &status) == cudaSuccess);
  CHECK(status == cudaStreamCaptureStatusNone);
  // Ending it on the joined stream instead of its origin is refused too.
  REQUIRE(cudaStreamBeginCapture(s0, cudaStreamCaptureModeRelaxed) == cudaSuccess);
  REQUIRE(cudaEventRecord(fork, s0) == cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(s1, fork, 0) == cudaSuccess);
  CHECK(cudaStreamEndCapture(s1, &g) == cudaErrorStreamCaptureUnmatched);
  cudaGetLastError();
  REQUIRE(cudaEventRecord(join, s1) == cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(s0, join, 0) == cudaSuccess);
  CHECK(cudaStreamEndCapture(s0, &g) == cudaSuccess);
  CHECK(cudaGraphDestroy(g) == cudaSuccess);

  // An event recorded inside a capture that has ended stands for nothing a stream could wait for.
  CHECK(cudaStreamWaitEvent(s1, join, 0) == cudaErrorStreamCaptureIsolation);
  cudaGetLastError();

  // A capture invalidated through a joined stream: every later call into it fails, the origin
  // reports it invalidated, and it ends so, with both streams out of it.
  REQUIRE(cudaStreamBeginCapture(s0, cudaStreamCaptureModeRelaxed) == cudaSuccess);
  REQUIRE(cudaEventRecord(fork, s0) == cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(s1, fork, 0) == cudaSuccess);
  CHECK(cudaStreamSynchronize(s1) == cudaErrorStreamCaptureUnsupported);
  CHECK(cudaMemsetAsync(cell, 1, 1, s0) == cudaErrorStreamCaptureInvalidated);
  CHECK(cudaStreamIsCapturing(s0, &status) == cudaSuccess);
  CHECK(status == cudaStreamCaptureStatusInvalidated);
  CHECK(cudaStreamEndCapture(s0, &g) == cudaErrorStreamCaptureInvalidated);
  CHECK(g == nullptr);
  cudaGetLastError();
  CHECK(cudaStreamIsCapturing(s1, &status) == cudaSuccess);
  CHECK(status == cudaStreamCaptureStatusNone);

  CHECK(cudaEventDestroy(fork) == cudaSuccess);
  CHECK(cudaEventDestroy(join) == cudaSuccess);
  CHECK(cudaStreamDestroy(s0) == cudaSuccess);
  CHECK(cudaStreamDestroy(s1) == cudaSuccess);
  CHECK(cudaFree(cell) == cudaSuccess);
}
