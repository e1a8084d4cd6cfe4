// The CUDA emulator's own checks (emulator/README.md), in the emulator build only:
// a block's barriers and warp shuffles give the block sum, a launch CUDA rejects fails, a
// synchronisation inside a stream capture invalidates it, and a stream's work is asynchronous
// to the host (an event is not reached while the stream is held); a capture over two streams
// keeps the dependencies its events make, replays independent work in another order than it
// was issued in, refuses to end with a stream not joined back, and once invalidated refuses
// every call into it.
#include <doctest/doctest.h>

#include <atomic>
#include <thread>

#include <cudnn.h>

#include <cmath>
#include <vector>

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

namespace {

// One convolution's descriptors for the emulated cuDNN's case below.
struct ConvCall {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  ConvCall(int n, int c, int h, int k, int r, int pad, int out_h) {
    REQUIRE(cudnnCreateTensorDescriptor(&x) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnCreateTensorDescriptor(&y) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnCreateFilterDescriptor(&w) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnCreateConvolutionDescriptor(&conv) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnSetTensor4dDescriptor(x, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, n, c, h, h) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnSetTensor4dDescriptor(y, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, n, k, out_h, out_h) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnSetFilter4dDescriptor(w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, k, c, r, r) == CUDNN_STATUS_SUCCESS);
    REQUIRE(cudnnSetConvolution2dDescriptor(conv, pad, pad, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION,
                                            CUDNN_DATA_FLOAT) == CUDNN_STATUS_SUCCESS);
  }
  ~ConvCall() {
    cudnnDestroyTensorDescriptor(x);
    cudnnDestroyTensorDescriptor(y);
    cudnnDestroyFilterDescriptor(w);
    cudnnDestroyConvolutionDescriptor(conv);
  }
};

std::vector<float> download(const float* p, size_t n, cudaStream_t s) {
  std::vector<float> v(n);
  REQUIRE(cudaMemcpyAsync(v.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost, s) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  return v;
}

}  // namespace

TEST_CASE("CUDA emulator: cuDNN's checks, tensor cores, atomics and the search") {
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  cudaStream_t s;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  cudnnHandle_t h;
  REQUIRE(cudnnCreate(&h) == CUDNN_STATUS_SUCCESS);
  REQUIRE(cudnnSetStream(h, s) == CUDNN_STATUS_SUCCESS);
  // x [4, 3, 8, 8], w [5, 3, 3, 3], padding 1: y [4, 5, 8, 8].
  const int N = 4, C = 3, H = 8, K = 5, R = 3;
  ConvCall call(N, C, H, K, R, 1, H);
  const size_t nx = size_t(N * C * H * H), nw = size_t(K * C * R * R), ny = size_t(N * K * H * H);
  std::vector<float> hx(nx), hw(nw);
  for (size_t i = 0; i < nx; ++i) hx[i] = 1.0f + float(i % 13) / 8192.0f;  // TF32 rounds these
  for (size_t i = 0; i < nw; ++i) hw[i] = 0.5f - float(i % 11) / 16384.0f;
  float *x, *w, *y, *ws;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&x), nx * 4) == cudaSuccess);
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&w), nw * 4) == cudaSuccess);
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&y), ny * 4) == cudaSuccess);
  const size_t ws_bytes = size_t(1) << 20;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&ws), ws_bytes) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(x, hx.data(), nx * 4, cudaMemcpyHostToDevice, s) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(w, hw.data(), nw * 4, cudaMemcpyHostToDevice, s) == cudaSuccess);
  const float one = 1, zero = 0;
  const auto forward = [&](cudnnConvolutionFwdAlgo_t algo, size_t bytes) {
    return cudnnConvolutionForward(h, &one, call.x, x, call.w, w, call.conv, algo, ws, bytes,
                                   &zero, call.y, y);
  };

  // beta = 0 does not read y: the NaN there is not in the result.
  REQUIRE(cudaMemsetAsync(y, 0xff, ny * 4, s) == cudaSuccess);
  REQUIRE(cudnnSetConvolutionMathType(call.conv, CUDNN_FMA_MATH) == CUDNN_STATUS_SUCCESS);
  REQUIRE(forward(CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, ws_bytes) == CUDNN_STATUS_SUCCESS);
  const std::vector<float> fma = download(y, ny, s);
  // y at the centre of image 0, output channel 0: every tap, summed in float64 here.
  double centre = 0;
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < R; ++q)
        centre += double(hx[size_t((c * H + 4 + r - 1) * H + 4 + q - 1)]) * hw[size_t((c * R + r) * R + q)];
  CHECK(std::fabs(fma[4 * H + 4] - centre) < 1e-5 * std::fabs(centre));

  // Tensor cores (any math type but FMA, on an algorithm that has them) round float to TF32.
  REQUIRE(cudnnSetConvolutionMathType(call.conv, CUDNN_DEFAULT_MATH) == CUDNN_STATUS_SUCCESS);
  REQUIRE(forward(CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, ws_bytes) == CUDNN_STATUS_SUCCESS);
  const std::vector<float> tf32 = download(y, ny, s);
  CHECK(std::fabs(tf32[4 * H + 4] - centre) > 2e-5 * std::fabs(centre));
  CHECK(std::fabs(tf32[4 * H + 4] - centre) < 2e-3 * std::fabs(centre));
  REQUIRE(forward(CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, 0) == CUDNN_STATUS_SUCCESS);
  CHECK(download(y, ny, s) == fma);  // no tensor cores there: float, in the same order

  // cuDNN's refusals: a workspace smaller than the algorithm needs, an algorithm that does not
  // take the shape, an output of the wrong size, a data type without its compute type, alpha
  // in device memory.
  size_t need = 0;
  REQUIRE(cudnnGetConvolutionForwardWorkspaceSize(h, call.x, call.w, call.conv, call.y,
                                                  CUDNN_CONVOLUTION_FWD_ALGO_GEMM, &need) ==
          CUDNN_STATUS_SUCCESS);
  CHECK(need > 0);
  CHECK(forward(CUDNN_CONVOLUTION_FWD_ALGO_GEMM, need - 1) == CUDNN_STATUS_BAD_PARAM_SIZE_INSUFFICIENT);
  CHECK(forward(CUDNN_CONVOLUTION_FWD_ALGO_DIRECT, ws_bytes) == CUDNN_STATUS_NOT_SUPPORTED);
  {
    ConvCall wrong(N, C, H, K, R, 0, H);  // no padding: the output is 6x6, not 8x8
    CHECK(cudnnConvolutionForward(h, &one, wrong.x, x, wrong.w, w, wrong.conv,
                                  CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, ws, ws_bytes, &zero,
                                  wrong.y, y) == CUDNN_STATUS_NOT_SUPPORTED_SHAPE);
    REQUIRE(cudnnSetConvolution2dDescriptor(wrong.conv, 1, 1, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION,
                                            CUDNN_DATA_DOUBLE) == CUDNN_STATUS_SUCCESS);
    CHECK(cudnnConvolutionForward(h, &one, wrong.x, x, wrong.w, w, wrong.conv,
                                  CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, ws, ws_bytes, &zero,
                                  call.y, y) == CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE);
  }
  CHECK(cudnnConvolutionForward(h, ws, call.x, x, call.w, w, call.conv,
                                CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, ws, ws_bytes, &zero,
                                call.y, y) == CUDNN_STATUS_BAD_PARAM);

  // The atomics algorithm adds its terms in another order each call: two runs of the
  // backward filter differ in their last bits; the deterministic one gives the same bits.
  float* dw;
  REQUIRE(cudaMalloc(reinterpret_cast<void**>(&dw), nw * 4) == cudaSuccess);
  const auto filter = [&](cudnnConvolutionBwdFilterAlgo_t algo) {
    REQUIRE(cudnnConvolutionBackwardFilter(h, &one, call.x, x, call.y, y, call.conv, algo, ws,
                                           ws_bytes, &zero, call.w, dw) == CUDNN_STATUS_SUCCESS);
    return download(dw, nw, s);
  };
  REQUIRE(cudnnSetConvolutionMathType(call.conv, CUDNN_FMA_MATH) == CUDNN_STATUS_SUCCESS);
  bool differ = false;
  const std::vector<float> first = filter(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0);
  for (int run = 0; run < 3 && !differ; ++run) differ = filter(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0) != first;
  CHECK(differ);
  CHECK(filter(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1) == filter(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1));

  // The search: every algorithm once per math type, those that ran first, fastest first; the
  // output left as NaN. Inside a capture it synchronises, and so invalidates the capture.
  REQUIRE(cudnnSetConvolutionMathType(call.conv, CUDNN_DEFAULT_MATH) == CUDNN_STATUS_SUCCESS);
  int max = 0, got = 0;
  REQUIRE(cudnnGetConvolutionForwardAlgorithmMaxCount(h, &max) == CUDNN_STATUS_SUCCESS);
  std::vector<cudnnConvolutionFwdAlgoPerf_t> res(static_cast<size_t>(max));
  REQUIRE(cudnnFindConvolutionForwardAlgorithmEx(h, call.x, x, call.w, w, call.conv, call.y, y, max,
                                                 &got, res.data(), ws, ws_bytes) == CUDNN_STATUS_SUCCESS);
  REQUIRE(got == CUDNN_CONVOLUTION_FWD_ALGO_COUNT + 1);  // one algorithm has tensor cores
  int ran = 0;
  while (ran < got && res[size_t(ran)].status == CUDNN_STATUS_SUCCESS) ++ran;
  CHECK(ran == got - 1);  // DIRECT is not implemented
  for (int i = 1; i < ran; ++i) CHECK(res[size_t(i - 1)].time <= res[size_t(i)].time);
  CHECK(res[0].algo == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM);
  CHECK(res[0].mathType == CUDNN_TENSOR_OP_MATH);
  CHECK(std::isnan(download(y, ny, s)[0]));
  REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  CHECK(cudnnFindConvolutionForwardAlgorithmEx(h, call.x, x, call.w, w, call.conv, call.y, y, max,
                                               &got, res.data(), ws, ws_bytes) ==
        CUDNN_STATUS_EXECUTION_FAILED_CUDART);
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(s, &graph) == cudaErrorStreamCaptureInvalidated);
  cudaGetLastError();

  cudnnDestroy(h);
  for (void* p : {static_cast<void*>(x), static_cast<void*>(w), static_cast<void*>(y),
                  static_cast<void*>(ws), static_cast<void*>(dw)})
    REQUIRE(cudaFree(p) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
}
