// Which result of a cuDNN algorithm search a convolution direction takes (kernels/cuda/conv.cu).
// Host code over cuDNN's result types only: no GPU is needed to run it, so the rules are tested
// on the CPU (tests/test_conv_pick.cpp) with made-up search results.
//
// Rules, over the results in cuDNN's order (fastest first):
//  - only results that ran (CUDNN_STATUS_SUCCESS);
//  - without tensor cores allowed (float32 with TF32 off), no tensor-core math type: such a
//    result is passed over, not an error;
//  - deterministic: only results cuDNN reports CUDNN_DETERMINISTIC, never the algorithms its
//    header marks as accumulating with atomics, and no FFT or Winograd variant (their rounding
//    differs most from the direct sum) while any other result qualifies; when none does, a
//    deterministic FFT or Winograd result is taken, with a note on stderr;
//  - nothing usable: none (find_result; conv.cu then falls back), or an error naming the
//    direction, the shape and every result (pick_result).
#pragma once
#include <cudnn.h>

#include <cstdio>
#include <optional>
#include <string>

#include "runtime/common.h"

namespace unetcu::kernels::cuda {

// The algorithms cuDNN's header marks non-deterministic (they accumulate with atomics).
inline bool uses_atomics(cudnnConvolutionFwdAlgo_t) { return false; }
inline bool uses_atomics(cudnnConvolutionBwdDataAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_0;
}
inline bool uses_atomics(cudnnConvolutionBwdFilterAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 || a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3;
}

// FFT and Winograd variants.
inline bool fft_or_winograd(cudnnConvolutionFwdAlgo_t a) {
  return a == CUDNN_CONVOLUTION_FWD_ALGO_FFT || a == CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD ||
         a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED;
}
inline bool fft_or_winograd(cudnnConvolutionBwdDataAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT ||
         a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD ||
         a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED;
}
inline bool fft_or_winograd(cudnnConvolutionBwdFilterAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT ||
         a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD ||
         a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED;
}

inline bool tensor_op_math(int math) {
  return math == CUDNN_TENSOR_OP_MATH || math == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION;
}

// Every result of a search, for an error message: algorithm, status, math type, determinism,
// workspace, time.
template <class Perf>
std::string results_line(const Perf* results, int count) {
  std::string s;
  for (int i = 0; i < count; ++i) {
    const Perf& r = results[i];
    s += str_cat(i ? "; " : "", "algo ", int(r.algo), " ", cudnnGetErrorString(r.status), " math ",
                 int(r.mathType), r.determinism == CUDNN_DETERMINISTIC ? " deterministic" : "",
                 " ", r.memory, " B ", r.time, " ms");
  }
  return s.empty() ? "none" : s;
}

// The result to take among `count` results (the rules above), or none. `what` names the
// direction ("forward convolution"), `shape` the convolution, for the note.
template <class Perf>
std::optional<Perf> find_result(const Perf* results, int count, bool tensor_cores_allowed,
                                bool deterministic, const char* what, const std::string& shape) {
  const auto first = [&](bool allow_fft_winograd) -> const Perf* {
    for (int i = 0; i < count; ++i) {
      const Perf& r = results[i];
      if (r.status != CUDNN_STATUS_SUCCESS) continue;
      if (!tensor_cores_allowed && tensor_op_math(r.mathType)) continue;
      if (deterministic && (r.determinism != CUDNN_DETERMINISTIC || uses_atomics(r.algo) ||
                            (!allow_fft_winograd && fft_or_winograd(r.algo))))
        continue;
      return &r;
    }
    return nullptr;
  };
  const Perf* chosen = first(false);
  if (!chosen && deterministic && (chosen = first(true)))
    std::fprintf(stderr,
                 "unetcu: no deterministic %s algorithm without FFT or Winograd for %s; using "
                 "deterministic algorithm %d (its rounding differs)\n",
                 what, shape.c_str(), int(chosen->algo));
  if (!chosen) return std::nullopt;
  return *chosen;
}

// find_result, or an error naming the direction, the shape and every result.
template <class Perf>
Perf pick_result(const Perf* results, int count, bool tensor_cores_allowed, bool deterministic,
                 const char* what, const std::string& shape) {
  if (const auto r = find_result(results, count, tensor_cores_allowed, deterministic, what, shape))
    return *r;
  throw Error(str_cat("cuDNN found no usable ", what, " algorithm for ", shape,
                      deterministic ? " among the deterministic ones" : "",
                      tensor_cores_allowed ? "" : " without tensor-core math",
                      " (search results: ", results_line(results, count), ")"));
}

}  // namespace unetcu::kernels::cuda
