// The CUDA emulator's own checks (runtime/cuda/emu/README.md), in the emulator build only:
// a block's barriers and warp shuffles give the block sum, a launch CUDA rejects fails, a
// synchronisation inside a stream capture invalidates it, and a stream's work is asynchronous
// to the host (an event is not reached while the stream is held).
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
