// The choice among cuDNN's algorithm search results (kernels/cuda/conv_pick.h), on made-up
// results: host code over cuDNN's result types, so it runs without a GPU wherever the build
// has CUDA (in a build without it this file holds no test).
#ifdef UNETCU_WITH_CUDA
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "kernels/cuda/conv_pick.h"

using namespace unetcu;
using namespace unetcu::kernels::cuda;

namespace {

template <class Perf, class Algo>
Perf result(Algo algo, cudnnStatus_t status, cudnnMathType_t math, bool deterministic) {
  Perf r{};
  r.algo = algo;
  r.status = status;
  r.time = 1.0f;
  r.memory = 1024;
  r.determinism = deterministic ? CUDNN_DETERMINISTIC : CUDNN_NON_DETERMINISTIC;
  r.mathType = math;
  return r;
}

using FilterPerf = cudnnConvolutionBwdFilterAlgoPerf_t;
using DataPerf = cudnnConvolutionBwdDataAlgoPerf_t;
using FwdPerf = cudnnConvolutionFwdAlgoPerf_t;

FilterPerf filter(cudnnConvolutionBwdFilterAlgo_t a, cudnnStatus_t s, cudnnMathType_t m, bool det) {
  return result<FilterPerf>(a, s, m, det);
}
FwdPerf forward(cudnnConvolutionFwdAlgo_t a, cudnnMathType_t m, bool det) {
  return result<FwdPerf>(a, CUDNN_STATUS_SUCCESS, m, det);
}

constexpr const char* kWhat = "backward-filter convolution";

}  // namespace

TEST_CASE("cuDNN algorithm choice: the fastest result that ran, tensor-core math passed over without TF32") {
  const std::vector<FilterPerf> res = {
      filter(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT, CUDNN_STATUS_NOT_SUPPORTED, CUDNN_DEFAULT_MATH, true),
      filter(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1, CUDNN_STATUS_SUCCESS, CUDNN_TENSOR_OP_MATH, true),
      filter(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0, CUDNN_STATUS_SUCCESS, CUDNN_FMA_MATH, false),
      filter(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1, CUDNN_STATUS_SUCCESS, CUDNN_FMA_MATH, true)};
  const int n = int(res.size());
  // Tensor cores allowed (bf16, or TF32 on): the first that ran.
  CHECK(pick_result(res.data(), n, true, false, kWhat, "s").mathType == CUDNN_TENSOR_OP_MATH);
  // Float32 with TF32 off: the tensor-core result is passed over, not an error.
  const FilterPerf fp32 = pick_result(res.data(), n, false, false, kWhat, "s");
  CHECK(fp32.algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0);
  CHECK(fp32.mathType == CUDNN_FMA_MATH);
  // Deterministic: ALGO_0 accumulates with atomics (and is reported non-deterministic).
  const FilterPerf det = pick_result(res.data(), n, false, true, kWhat, "s");
  CHECK(det.algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1);
  CHECK(det.mathType == CUDNN_FMA_MATH);
}

TEST_CASE("cuDNN algorithm choice, deterministic: never atomics, FFT or Winograd only when nothing else qualifies") {
  // An atomics algorithm reported deterministic is still never taken.
  const std::vector<FilterPerf> atomics = {
      filter(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3, CUDNN_STATUS_SUCCESS, CUDNN_FMA_MATH, true),
      filter(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED, CUDNN_STATUS_SUCCESS,
             CUDNN_FMA_MATH, true),
      filter(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1, CUDNN_STATUS_SUCCESS, CUDNN_FMA_MATH, true)};
  CHECK(pick_result(atomics.data(), 3, false, true, kWhat, "s").algo ==
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1);
  // Without the direct algorithm, the deterministic Winograd one is the last resort...
  CHECK(pick_result(atomics.data(), 2, false, true, kWhat, "s").algo ==
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED);
  // ...and without the deterministic setting the fastest that ran is taken, atomics or not.
  CHECK(pick_result(atomics.data(), 3, false, false, kWhat, "s").algo ==
        CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3);

  const std::vector<FwdPerf> fwd = {
      forward(CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING, CUDNN_TENSOR_OP_MATH, true),
      forward(CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD, CUDNN_TENSOR_OP_MATH, true),
      forward(CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, CUDNN_TENSOR_OP_MATH, false),
      forward(CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, CUDNN_TENSOR_OP_MATH, true)};
  CHECK(pick_result(fwd.data(), 4, true, true, "forward convolution", "s").algo ==
        CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM);
  CHECK(pick_result(fwd.data(), 3, true, true, "forward convolution", "s").algo ==
        CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING);
  CHECK(pick_result(fwd.data(), 4, true, false, "forward convolution", "s").algo ==
        CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING);

  const std::vector<DataPerf> data = {result<DataPerf>(
      CUDNN_CONVOLUTION_BWD_DATA_ALGO_0, CUDNN_STATUS_SUCCESS, CUDNN_FMA_MATH, true)};
  CHECK_THROWS_AS(pick_result(data.data(), 1, false, true, "backward-data convolution", "s"), Error);
  CHECK(pick_result(data.data(), 1, false, false, "backward-data convolution", "s").algo ==
        CUDNN_CONVOLUTION_BWD_DATA_ALGO_0);
}

TEST_CASE("cuDNN algorithm choice: nothing usable is an error naming the shape and every result") {
  const std::vector<FilterPerf> res = {
      filter(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1, CUDNN_STATUS_ALLOC_FAILED, CUDNN_FMA_MATH, true),
      filter(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0, CUDNN_STATUS_SUCCESS, CUDNN_FMA_MATH, false)};
  std::string what;
  try {
    pick_result(res.data(), 2, false, true, kWhat, "bfloat16 NHWC input 2x3x19x17");
  } catch (const Error& e) {
    what = e.what();
  }
  CAPTURE(what);
  CHECK(what.find("cuDNN found no usable backward-filter convolution algorithm for bfloat16 NHWC "
                  "input 2x3x19x17 among the deterministic ones without tensor-core math") !=
        std::string::npos);
  CHECK(what.find("algo 1 ") != std::string::npos);  // every result, with its status
  CHECK(what.find("algo 0 ") != std::string::npos);
  CHECK(what.find(cudnnGetErrorString(CUDNN_STATUS_ALLOC_FAILED)) != std::string::npos);
  // No result at all (the search listed none).
  CHECK_THROWS_WITH_AS(pick_result(res.data(), 0, true, false, kWhat, "s"),
                       doctest::Contains("(search results: none)"), Error);
}

#endif  // UNETCU_WITH_CUDA
