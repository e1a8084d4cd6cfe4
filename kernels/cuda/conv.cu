// CUDA convolution through cuDNN. For each (device, geometry, dtype, memory format, TF32
// setting, deterministic setting) the descriptors are built once and each direction's
// algorithm is chosen once, then kept: from the on-disk cache of earlier processes' choices
// (runtime/algo_cache.h), else by cudnnFind*AlgorithmEx (measured on the real shapes), whose
// choice is then added to that cache. The chosen algorithm's workspace comes from the caching
// device allocator for each call: no fixed per-layer cap.
//
// Which algorithms may be chosen:
//  - deterministic setting (cuda::set_deterministic: the CUDA tests, unet_train
//    --deterministic): only those cuDNN reports CUDNN_DETERMINISTIC, never the ones its header
//    marks non-deterministic (atomics in backward data/filter ALGO_0 and filter ALGO_3), and
//    no FFT or Winograd variant (their rounding differs most from the direct sum the CPU
//    reference computes). Two runs, two streams or two replicas then give the same bits.
//  - otherwise the fastest that ran.
//  - float32 with TF32 off: the search runs with CUDNN_FMA_MATH, the chosen algorithm must
//    report FMA (or default) math, and it runs with CUDNN_FMA_MATH; tensor-core results are
//    passed over rather than a silent loss of float32 precision.
//  - when the deterministic setting leaves nothing, a deterministic FFT or Winograd result
//    (never an atomics one) is taken, with a note on stderr: a run that can go on.
//  - bfloat16: tensor cores are what it is for (their bfloat16 products are exact in float32
//    and they sum in float32): the search runs with CUDNN_TENSOR_OP_MATH and the choice runs
//    with the math type it was measured with, whatever the TF32 setting.
//
// When nothing qualifies (tensor-core NHWC kernels want channel counts that are multiples of
// 8; the stem has 3 input channels, the head 1 output, a narrow model's decoder 2 or 4), the
// direction falls back, for that layer shape only, and one line on stderr names the model
// block and what the layer took:
//  1. the search again under the other math types (cuDNN may list only the descriptor's);
//  2. an NHWC layer in NCHW: its inputs converted for each call, its output converted back;
//  3. its channels padded with zeros to multiples of 8, in its own format (zero channels add
//     nothing to the sums); the output's leading channels taken.
// Nothing anywhere is an error listing every search's results. The emulator's cuDNN refuses
// unaligned channels on request (UNETCU_EMU_CUDNN_ALIGN8), so the suite runs both fallbacks.
//
// Searches are measured on this process's GPU time only when nothing else of it runs there: a
// choice made while another of its streams was busy (a second pipeline stage, NCCL, an upload),
// or with less workspace than the policy's (a quarter of the GPU's memory, at most 1 GiB)
// while an algorithm it could take needed more, is used for the run and kept on disk as
// provisional; a later process searches it again when it can do so alone.
//
// dtypes and formats: x, w, y (and b) float32, or all bfloat16 (compute type float32, y
// rounded once by cuDNN). x and y NCHW or NHWC; cuDNN is given the filter in x's format (OHWI
// with NHWC, the layout its channels-last tensor-core kernels read): a w in the other format
// is converted for the call, and its gradient computed in x's format and converted into it.
// The bias of a float32 NCHW output is added by cuDNN as before; other bias adds and every
// bias gradient other than float32 NCHW run on the kernels below. A bfloat16 output with a
// bias is rounded twice, as PyTorch's CUDA path does: once by the convolution, once by the
// bias add (each kernel computes in float32 and rounds once on store).
//
// Gradient rule (beta): the weight and bias gradients accumulate when a gradient exists
// (beta = 1) and are written otherwise (beta = 0); the same holds for the input gradient,
// which is written (beta = 0) unless the input already has one (e.g. a residual input read by
// both the block and its downsample conv). float32 gradients are blended by cuDNN. What the
// code relies on of cuDNN for bfloat16: only that a written (beta = 0) output is its float32
// result rounded once. Whether cuDNN rounds before it blends with beta = 1 is not documented,
// so a bfloat16 gradient is never accumulated by cuDNN: it writes a scratch, and the convert
// kernel adds that in float32 and rounds once (conv2d_backward).
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "runtime/algo_cache.h"
#include "runtime/cuda_api.h"
#include "runtime/device.h"
#include "bodies/bf16.h"
#include "bodies/layout.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/conv_pick.h"
#include "kernels/cuda/conv_reset.h"
#include "kernels/cuda/cudnn_util.cuh"
#include "kernels/launchers.h"

namespace unetcu::kernels::cuda {
namespace {

// What the tensors given to cuDNN are: their dtype (float32 or bfloat16) and the format of x,
// y and w alike.
struct Data {
  DType type;
  MemoryFormat format;
  bool bf16() const { return type == DType::BF16; }
  bool operator<(const Data& o) const {
    return std::tie(type, format) < std::tie(o.type, o.format);
  }
};

struct Key {
  int device;
  int64_t N, C, H, W, O;
  int kh, kw, sh, sw, ph, pw;
  Data data;
  bool tf32;
  bool deterministic;  // another setting may choose another algorithm
  bool operator<(const Key& o) const {
    return std::tie(device, N, C, H, W, O, kh, kw, sh, sw, ph, pw, data, tf32, deterministic) <
           std::tie(o.device, o.N, o.C, o.H, o.W, o.O, o.kh, o.kw, o.sh, o.sw, o.ph, o.pw, o.data,
                    o.tf32, o.deterministic);
  }
};

// How a direction runs when cuDNN has no usable algorithm for the layer as it is (the ladder in
// chosen() below): as it is; converted to NCHW for the call; or with its channels padded to
// multiples of 8 (zeros), in its own format.
enum class Route { Direct, Nchw, Padded };

struct Plan;

// One direction's algorithm. Each direction has its own convolution descriptor, set once to the
// math type its algorithm runs with: plans are shared by every stream of the device, and two
// streams may run the same plan at once, so nothing in a chosen plan changes afterwards.
template <class Algo>
struct Choice {
  ConvDesc conv;
  bool chosen = false;
  Route route = Route::Direct;
  Plan* via = nullptr;  // Nchw, Padded: the plan (NCHW, or padded geometry) that runs it
  Algo algo{};
  cudnnMathType_t math = CUDNN_FMA_MATH;
  size_t workspace = 0;
  explicit Choice(const ConvGeometry& g) : conv(g.ph, g.pw, g.sh, g.sw) {}
};

struct Plan {
  ConvGeometry g;
  Data data;
  std::string layer;      // the model block that made the plan (first of its shape), for notes
  TensorDesc x, y, bias;  // bias: float32 [1, O, 1, 1], for cudnnAddTensor on float32 NCHW
  FilterDesc w;
  Choice<cudnnConvolutionFwdAlgo_t> fwd;
  Choice<cudnnConvolutionBwdDataAlgo_t> bwd_data;
  Choice<cudnnConvolutionBwdFilterAlgo_t> bwd_filter;
  std::mutex search_mutex;  // each direction is chosen once, by its first caller
  unsigned noted = 0;       // the fallbacks a note has named (bits: 1 math, 2 NCHW, 4 padded)
  Plan(const ConvGeometry& geometry, const Data& d)
      : g(geometry),
        data(d),
        layer(current_block_name()),
        x(g.N, g.C, g.H, g.W, d.type, d.format),
        y(g.N, g.O, g.OH, g.OW, d.type, d.format),
        bias(1, g.O, 1, 1),
        w(g.O, g.C, g.kh, g.kw, d.type, d.format),
        fwd(g),
        bwd_data(g),
        bwd_filter(g) {}
};

std::mutex g_plans_mutex;
std::map<Key, std::unique_ptr<Plan>>& plans() {
  static auto* m = new std::map<Key, std::unique_ptr<Plan>>();
  return *m;
}

Plan& plan_for(int device, const ConvGeometry& g, const Data& data, bool tf32, bool deterministic) {
  const Key k{device, g.N, g.C, g.H, g.W, g.O, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, data, tf32,
              deterministic};
  std::lock_guard<std::mutex> lock(g_plans_mutex);
  auto& slot = plans()[k];
  if (!slot) slot = std::make_unique<Plan>(g, data);
  return *slot;
}

int64_t pad8(int64_t c) { return (c + 7) / 8 * 8; }

// The geometry with input and output channels padded to multiples of 8.
ConvGeometry padded_geometry(ConvGeometry g) {
  g.C = pad8(g.C);
  g.O = pad8(g.O);
  return g;
}

// ---- the directions, each with its cuDNN calls -----------------------------------------

// Find: runs every algorithm of the direction on (in1, in2) into out, within the workspace,
// listing up to `cap` results (max_count: how many it may list, an algorithm once per math
// type). Workspace: the size cuDNN asks for one algorithm.
struct Forward {
  using Algo = cudnnConvolutionFwdAlgo_t;
  using Perf = cudnnConvolutionFwdAlgoPerf_t;
  static constexpr int kCount = CUDNN_CONVOLUTION_FWD_ALGO_COUNT;
  static constexpr const char* kDirection = "fwd";
  static constexpr const char* kWhat = "forward convolution";
  static Choice<Algo>& choice(Plan& p) { return p.fwd; }
  // in1 = x, in2 = w, out = y
  static void find(cudnnHandle_t h, Plan& p, const void* in1, const void* in2, void* out,
                   Perf* res, int cap, int* n, void* ws, size_t ws_bytes) {
    CUDNN_CHECK(cudnnFindConvolutionForwardAlgorithmEx(h, p.x.d, in1, p.w.d, in2, p.fwd.conv.d,
                                                       p.y.d, out, cap, n, res, ws, ws_bytes));
  }
  static int max_count(cudnnHandle_t h) {
    int m = 0;
    return cudnnGetConvolutionForwardAlgorithmMaxCount(h, &m) == CUDNN_STATUS_SUCCESS ? m : 0;
  }
  static cudnnStatus_t workspace(cudnnHandle_t h, Plan& p, Algo a, size_t* bytes) {
    return cudnnGetConvolutionForwardWorkspaceSize(h, p.x.d, p.w.d, p.fwd.conv.d, p.y.d, a, bytes);
  }
};

struct BackwardData {
  using Algo = cudnnConvolutionBwdDataAlgo_t;
  using Perf = cudnnConvolutionBwdDataAlgoPerf_t;
  static constexpr int kCount = CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT;
  static constexpr const char* kDirection = "bwd_data";
  static constexpr const char* kWhat = "backward-data convolution";
  static Choice<Algo>& choice(Plan& p) { return p.bwd_data; }
  // in1 = w, in2 = dy, out = scratch dx
  static void find(cudnnHandle_t h, Plan& p, const void* in1, const void* in2, void* out,
                   Perf* res, int cap, int* n, void* ws, size_t ws_bytes) {
    CUDNN_CHECK(cudnnFindConvolutionBackwardDataAlgorithmEx(h, p.w.d, in1, p.y.d, in2,
                                                            p.bwd_data.conv.d, p.x.d, out, cap,
                                                            n, res, ws, ws_bytes));
  }
  static int max_count(cudnnHandle_t h) {
    int m = 0;
    return cudnnGetConvolutionBackwardDataAlgorithmMaxCount(h, &m) == CUDNN_STATUS_SUCCESS ? m : 0;
  }
  static cudnnStatus_t workspace(cudnnHandle_t h, Plan& p, Algo a, size_t* bytes) {
    return cudnnGetConvolutionBackwardDataWorkspaceSize(h, p.w.d, p.y.d, p.bwd_data.conv.d, p.x.d,
                                                        a, bytes);
  }
};

struct BackwardFilter {
  using Algo = cudnnConvolutionBwdFilterAlgo_t;
  using Perf = cudnnConvolutionBwdFilterAlgoPerf_t;
  static constexpr int kCount = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT;
  static constexpr const char* kDirection = "bwd_filter";
  static constexpr const char* kWhat = "backward-filter convolution";
  static Choice<Algo>& choice(Plan& p) { return p.bwd_filter; }
  // in1 = x, in2 = dy, out = scratch dw
  static void find(cudnnHandle_t h, Plan& p, const void* in1, const void* in2, void* out,
                   Perf* res, int cap, int* n, void* ws, size_t ws_bytes) {
    CUDNN_CHECK(cudnnFindConvolutionBackwardFilterAlgorithmEx(h, p.x.d, in1, p.y.d, in2,
                                                              p.bwd_filter.conv.d, p.w.d, out,
                                                              cap, n, res, ws, ws_bytes));
  }
  static int max_count(cudnnHandle_t h) {
    int m = 0;
    return cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(h, &m) == CUDNN_STATUS_SUCCESS ? m : 0;
  }
  static cudnnStatus_t workspace(cudnnHandle_t h, Plan& p, Algo a, size_t* bytes) {
    return cudnnGetConvolutionBackwardFilterWorkspaceSize(h, p.x.d, p.y.d, p.bwd_filter.conv.d,
                                                          p.w.d, a, bytes);
  }
};

// ---- choosing -------------------------------------------------------------------------


// Whether tensor-core math may run: float32 with TF32 on, and bfloat16 always.
bool tensor_cores_allowed(const Data& data, bool tf32) { return tf32 || data.bf16(); }

// The math type an algorithm runs with: float32 with TF32 off, always FMA (CUDNN_DEFAULT_MATH
// would let cuDNN use TF32 on Ampere and later); otherwise what the search measured.
cudnnMathType_t run_math(const Data& data, bool tf32, int measured) {
  return tensor_cores_allowed(data, tf32) ? cudnnMathType_t(measured) : CUDNN_FMA_MATH;
}

// The math types a search runs with, in order: the first is the usual one; the others are
// tried when it leaves no usable algorithm (cuDNN may list only the descriptor's math type).
// float32 with TF32 off has FMA alone: anything else could run TF32.
std::vector<cudnnMathType_t> search_maths(const Data& data, bool tf32) {
  if (data.bf16()) return {CUDNN_TENSOR_OP_MATH, CUDNN_DEFAULT_MATH, CUDNN_FMA_MATH};
  if (tf32) return {CUDNN_DEFAULT_MATH, CUDNN_TENSOR_OP_MATH, CUDNN_FMA_MATH};
  return {CUDNN_FMA_MATH};
}

const char* math_name(int m) {
  switch (m) {
    case CUDNN_DEFAULT_MATH: return "default";
    case CUDNN_TENSOR_OP_MATH: return "tensor-core";
    case CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION: return "tensor-core (conversion allowed)";
    case CUDNN_FMA_MATH: return "FMA";
  }
  return "unknown";
}

// The dtype field of the on-disk key: "f32" for float32 NCHW (the entries written before
// formats existed stay valid), "bf16" for bfloat16, ".nhwc" appended for channels last.
std::string dtype_key(const Data& data) {
  return str_cat(data.bf16() ? "bf16" : "f32", data.format == MemoryFormat::NHWC ? ".nhwc" : "");
}

ConvAlgoCache& disk_cache() {
  static auto* c = new ConvAlgoCache(default_conv_algo_cache_path());  // never destroyed
  return *c;
}

ConvAlgoKey disk_key(const char* direction, int device, const ConvGeometry& g, const Data& data,
                     bool tf32, bool deterministic) {
  const cudaDeviceProp& prop = unetcu::cuda::device_properties(device);
  ConvAlgoKey k;
  k.device = prop.name;
  k.cc_major = prop.major;
  k.cc_minor = prop.minor;
  k.cudnn_version = int(cudnnGetVersion());
  k.direction = direction;
  k.dtype = dtype_key(data);
  k.tf32 = tf32;
  k.deterministic = deterministic;
  k.n = g.N, k.c = g.C, k.h = g.H, k.w = g.W, k.o = g.O;
  k.kh = g.kh, k.kw = g.kw, k.sh = g.sh, k.sw = g.sw, k.ph = g.ph, k.pw = g.pw;
  return k;
}

// The search's workspace policy: a quarter of the device's memory, at most 1 GiB. Algorithms
// that need more are never chosen, on any run: choices made within the policy are final.
size_t workspace_policy_bytes(int device) {
  return std::min<size_t>(unetcu::cuda::device_properties(device).totalGlobalMem / 4,
                          size_t(1) << 30);
}

// Workspace the search may use: the policy's, or a quarter of the free memory when that is
// less, fixed per device at its first search so that every later search reuses the same
// cached block. It comes from the caching allocator (cudaMalloc/cudaFree here would
// synchronise the device, with NCCL kernels possibly in flight) and is optional: when memory is
// short the search runs among the algorithms that need less.
std::mutex g_workspace_mutex;
std::map<int, size_t> g_workspace_bytes;

size_t search_workspace_bytes(int device) {
  auto& bytes = g_workspace_bytes;
  std::lock_guard<std::mutex> lock(g_workspace_mutex);
  auto it = bytes.find(device);
  if (it != bytes.end()) return it->second;
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));  // on `device`: the launcher set it
  return bytes[device] = std::min<size_t>(free_b / 4, workspace_policy_bytes(device));
}

std::string shape_text(const ConvGeometry& g, const Data& data) {
  return str_cat(dtype_name(data.type), " ", format_name(data.format), " input ", g.N, "x", g.C,
                 "x", g.H, "x", g.W, ", weight ", g.O, "x", g.C, "x", g.kh, "x", g.kw, " stride ",
                 g.sh, "x", g.sw, " padding ", g.ph, "x", g.pw);
}

// Where a plan was made, for notes: "in encoder.layer2 (and every convolution of its shape)".
std::string layer_text(const Plan& p) {
  return p.layer.empty() ? std::string("a convolution")
                         : str_cat("the convolution in ", p.layer, " (and every one of its shape)");
}

// Whether an algorithm the choice could take (within the policy's workspace; under the
// deterministic setting, no atomics, FFT or Winograd) needs more workspace than `got`, the
// search's: then the search may have missed the fastest.
template <class D>
bool missed_for_workspace(cudnnHandle_t h, Plan& p, size_t got, size_t policy, bool deterministic) {
  for (int a = 0; a < D::kCount; ++a) {
    const auto algo = typename D::Algo(a);
    if (deterministic && (uses_atomics(algo) || fft_or_winograd(algo))) continue;
    size_t need = 0;
    if (D::workspace(h, p, algo, &need) == CUDNN_STATUS_SUCCESS && need > got && need <= policy)
      return true;
  }
  return false;
}

std::atomic<int> g_searches{0};  // cudnnFind* calls, for tests (conv_searches)

// Chooses the direction's algorithm for the plan as it is (format, channels): the on-disk
// cache, else the search, under each math type of search_maths in turn. False when nothing
// usable was found; *tried then says what each search returned.
//
// A choice the search made beside other work of this process on the device (another stream
// busy before or after it: a second pipeline stage, NCCL, an upload), or with less workspace
// than the policy's while an algorithm it could take needed more, is used for this run but
// written to the disk cache as provisional: a later process takes it only while it cannot
// search alone, and searches again when it can.
template <class D>
bool choose(Plan& p, cudnnHandle_t h, int device, bool tf32, bool deterministic, const void* in1,
            const void* in2, void* out, std::string* tried) {
  Choice<typename D::Algo>& c = D::choice(p);
  const Data& data = p.data;
  const ConvGeometry& g = p.g;
  const ConvAlgoKey key = disk_key(D::kDirection, device, g, data, tf32, deterministic);
  cudaStream_t stream = nullptr;
  CUDNN_CHECK(cudnnGetStream(h, &stream));
  const bool busy_before = unetcu::cuda::other_streams_busy(device, stream);
  if (const auto hit = disk_cache().find(key); hit && (!hit->provisional || busy_before)) {
    // Checked again, not trusted: the file may have been edited, or written by a cuDNN that
    // had other algorithms. Anything doubtful is searched instead.
    const auto algo = typename D::Algo(hit->algo);
    // Under the deterministic key an FFT or Winograd entry comes from a search that found
    // nothing else (pick's last resort): the same choice the search would make again.
    const bool fits = hit->algo >= 0 && hit->algo < D::kCount &&
                      (tensor_cores_allowed(data, tf32) || !tensor_op_math(hit->math_type)) &&
                      (!deterministic || (hit->deterministic && !uses_atomics(algo)));
    size_t ws = 0;
    const cudnnMathType_t math = run_math(data, tf32, hit->math_type);
    if (fits && cudnnSetConvolutionMathType(c.conv.d, math) == CUDNN_STATUS_SUCCESS &&
        D::workspace(h, p, algo, &ws) == CUDNN_STATUS_SUCCESS) {
      c.algo = algo;
      c.math = math;
      c.workspace = ws;
      c.chosen = true;
      return true;
    }
  }
  const size_t want = search_workspace_bytes(device);
  // Optional: when memory is short, half as much, down to 16 MiB, then none.
  size_t got = want;
  std::optional<unetcu::cuda::DeviceBuffer> ws;
  ws.emplace(device, got, /*optional=*/true);
  while (!ws->get() && got > (size_t(16) << 20)) {
    got /= 2;
    ws.reset();
    ws.emplace(device, got, /*optional=*/true);
  }
  if (!ws->get()) got = 0;
  const std::string shape = shape_text(g, data);
  const std::vector<cudnnMathType_t> maths = search_maths(data, tf32);
  std::vector<typename D::Perf> results(size_t(std::max(D::max_count(h), D::kCount)));
  for (cudnnMathType_t m : maths) {
    CUDNN_CHECK(cudnnSetConvolutionMathType(c.conv.d, m));
    int n = 0;
    ++g_searches;
    D::find(h, p, in1, in2, out, results.data(), int(results.size()), &n, ws->get(), got);
    const std::optional<typename D::Perf> perf = find_result(
        results.data(), n, tensor_cores_allowed(data, tf32), deterministic, D::kWhat, shape);
    if (!perf) {
      *tried += str_cat(tried->empty() ? "" : "; ", "searched with ", math_name(m), " math: ",
                        results_line(results.data(), n));
      continue;
    }
    c.algo = perf->algo;
    c.math = run_math(data, tf32, perf->mathType);
    CUDNN_CHECK(cudnnSetConvolutionMathType(c.conv.d, c.math));
    // The workspace for the math type it will run with (FMA where the search measured DEFAULT).
    size_t need = 0;
    c.workspace = D::workspace(h, p, c.algo, &need) == CUDNN_STATUS_SUCCESS
                      ? std::max(perf->memory, need)
                      : perf->memory;
    c.chosen = true;
    if (m != maths.front() && !(p.noted & 1)) {
      p.noted |= 1;
      std::fprintf(stderr, "unetcu: %s: cuDNN has no usable algorithm for %s under %s math; it "
                   "runs with %s math\n", layer_text(p).c_str(), shape.c_str(),
                   math_name(maths.front()), math_name(c.math));
    }
    const bool busy = busy_before || unetcu::cuda::other_streams_busy(device, stream);
    const size_t policy = workspace_policy_bytes(device);
    const bool capped = got < policy && missed_for_workspace<D>(h, p, got, policy, deterministic);
    disk_cache().store(key, ConvAlgoChoice{int(perf->algo), int(perf->mathType),
                                           perf->determinism == CUDNN_DETERMINISTIC,
                                           /*provisional=*/busy || capped});
    return true;
  }
  return false;
}

// A scratch buffer of `bytes` zeros on the current stream: inputs a search runs on when the
// real ones have another shape (padded channels). Their values only feed timings.
struct Zeros {
  unetcu::cuda::DeviceBuffer buffer;
  Zeros(int device, size_t bytes) : buffer(device, bytes) {
    if (bytes)
      CUDA_CHECK(cudaMemsetAsync(buffer.get(), 0, bytes, unetcu::cuda::current_stream(device)));
  }
};

// The bytes of the direction's two inputs and its output in a plan.
template <class D>
void role_bytes(const Plan& p, size_t* in1, size_t* in2, size_t* out) {
  const ConvGeometry& g = p.g;
  const size_t e = p.data.bf16() ? 2 : 4;
  const size_t x = size_t(g.N * g.C * g.H * g.W) * e, y = size_t(g.N * g.O * g.OH * g.OW) * e,
               w = size_t(g.O * g.C * g.kh * g.kw) * e;
  if constexpr (std::is_same_v<D, Forward>) *in1 = x, *in2 = w, *out = y;
  else if constexpr (std::is_same_v<D, BackwardData>) *in1 = w, *in2 = y, *out = x;
  else *in1 = x, *in2 = y, *out = w;
}

// The direction's choice, made by the first caller. The search writes a scratch output of the
// plan's size (a backward's real output may hold a gradient that must be accumulated into,
// not overwritten). When the layer as it is has no usable algorithm under any math type, the
// direction falls back, with one note on stderr naming the layer: to NCHW for the call (an
// NHWC layer), else to channels padded with zeros to multiples of 8 (tensor-core kernels'
// alignment). Nothing usable anywhere is an error listing every search's results.
template <class D>
Choice<typename D::Algo>& chosen(Plan& p, cudnnHandle_t h, int device, bool tf32,
                                 bool deterministic, const void* in1, const void* in2) {
  std::lock_guard<std::mutex> lock(p.search_mutex);
  Choice<typename D::Algo>& c = D::choice(p);
  if (c.chosen) return c;  // not changed again: read without the lock from here on
  // The search runs kernels and reads the free memory: not inside a graph capture, whose
  // warm-up steps choose every algorithm first. A new shape there is an error that says so.
  const ConvGeometry& g = p.g;
  cudaStream_t stream = nullptr;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudnnGetStream(h, &stream) == CUDNN_STATUS_SUCCESS &&
      cudaStreamIsCapturing(stream, &capturing) == cudaSuccess &&
      capturing != cudaStreamCaptureStatusNone)
    throw Error(str_cat("a ", D::kWhat, " of a shape not seen in the eager steps (input ", g.N,
                        "x", g.C, "x", g.H, "x", g.W, ", weight ", g.O, "x", g.C, "x", g.kh, "x",
                        g.kw, ") came up while capturing a CUDA graph: its algorithm must be "
                        "chosen before the capture"));
  size_t b1 = 0, b2 = 0, bo = 0;
  role_bytes<D>(p, &b1, &b2, &bo);
  std::string tried;
  {
    unetcu::cuda::DeviceBuffer out(device, bo);
    if (choose<D>(p, h, device, tf32, deterministic, in1, in2, out.get(), &tried)) return c;
  }
  const auto take = [&](Plan& q, Route route, const void* q1, const void* q2, size_t qo) {
    std::lock_guard<std::mutex> qlock(q.search_mutex);
    Choice<typename D::Algo>& qc = D::choice(q);
    std::string q_tried;
    if (qc.chosen && qc.route != Route::Direct) return false;  // that layer falls back itself
    if (!qc.chosen) {
      unetcu::cuda::DeviceBuffer out(device, qo);
      if (!choose<D>(q, h, device, tf32, deterministic, q1, q2, out.get(), &q_tried)) {
        tried += str_cat("; as ", route == Route::Nchw ? "NCHW" : "padded", ": ", q_tried);
        return false;
      }
    }
    c.route = route;
    c.via = &q;
    c.chosen = true;
    const unsigned bit = route == Route::Nchw ? 2 : 4;
    if (!(p.noted & bit)) {  // one line per layer shape and fallback, whichever direction
      p.noted |= bit;
      std::fprintf(stderr, "unetcu: %s: cuDNN has no usable algorithm for %s; it runs %s\n",
                   layer_text(p).c_str(), shape_text(g, p.data).c_str(),
                   route == Route::Nchw ? "in NCHW, converted for each call"
                                        : str_cat("with channels padded with zeros to ", q.g.C,
                                                  " in and ", q.g.O, " out").c_str());
    }
    return true;
  };
  // The same bytes in NCHW: the search may run on the inputs as they are (values only time).
  if (p.data.format == MemoryFormat::NHWC &&
      take(plan_for(device, g, Data{p.data.type, MemoryFormat::NCHW}, tf32, deterministic),
           Route::Nchw, in1, in2, bo))
    return c;
  const ConvGeometry pg = padded_geometry(g);
  if (pg.C != g.C || pg.O != g.O) {
    Plan& q = plan_for(device, pg, p.data, tf32, deterministic);
    size_t q1 = 0, q2 = 0, qo = 0;
    role_bytes<D>(q, &q1, &q2, &qo);
    const Zeros z1(device, q1), z2(device, q2);
    if (take(q, Route::Padded, z1.buffer.get(), z2.buffer.get(), qo)) return c;
  }
  throw Error(str_cat("cuDNN found no usable ", D::kWhat, " algorithm for ", shape_text(g, p.data),
                      deterministic ? " among the deterministic ones" : "",
                      tensor_cores_allowed(p.data, tf32) ? "" : " without tensor-core math",
                      ", in NCHW or with padded channels either (", tried, ")"));
}

// ---- bias: add and gradient for any dtype and format -----------------------------------

// y[i] += b[channel of i], in the compute type, rounded once.  y: [N, O, OH, OW] in d's format.
// Index type I: 32-bit with dividers where the tensor allows (bodies/divide.h).
template <class S, class I>
__global__ void bias_add_kernel(S* y, const S* b, Dims4Div<I> d, I n) {
  using A = acc_t<S>;
  GRID_STRIDE_I(I, i, n) y[i] = to_storage<S>(A(y[i]) + A(b[channel_of(d, i)]));
}

// Memory index of channel c of pixel p (p = (n*H + h)*W + w).
__device__ int64_t pixel_offset(const Dims4& d, int64_t p, int64_t c) {
  const int64_t hw = d.H * d.W;
  return d.nhwc ? p * d.C + c : ((p / hw) * d.C + c) * hw + p % hw;
}

// partial[c * chunks + k] = sum of gy over channel c and pixels [k*chunk, (k+1)*chunk): one
// block per (chunk k = blockIdx.x, channel c = blockIdx.y), summed in float32.
template <class S>
__global__ void bias_grad_partial_kernel(const S* gy, Dims4 d, int64_t chunk, int chunks,
                                         float* partial) {
  const int64_t c = blockIdx.y, pixels = d.N * d.H * d.W;
  const int64_t lo = int64_t(blockIdx.x) * chunk, hi = lo + chunk < pixels ? lo + chunk : pixels;
  float s = 0;
  for (int64_t p = lo + threadIdx.x; p < hi; p += blockDim.x)
    s += float(acc_t<S>(gy[pixel_offset(d, p, c)]));
  s = block_sum(s);
  if (threadIdx.x == 0) partial[c * chunks + blockIdx.x] = s;
}

// gb[c] = the chunks' partial sums added in chunk order: written, or added to gb in its
// compute type and rounded once (accumulate).
template <class S>
__global__ void bias_grad_finish_kernel(const float* partial, int chunks, int64_t C, S* gb,
                                        bool accumulate) {
  using A = acc_t<S>;
  GRID_STRIDE(c, C) {
    float s = 0;
    for (int k = 0; k < chunks; ++k) s += partial[c * chunks + k];
    gb[c] = to_storage<S>(accumulate ? A(gb[c]) + A(s) : A(s));
  }
}

// gb = sum of gy over n, h, w, written or accumulated by beta. Two passes with a fixed split
// (by the tensor's size only), no atomics: the same bits on every run and every GPU.
void bias_grad(const TensorRef& gy, const TensorRef& gb, double beta, cudaStream_t stream,
               int device) {
  const Dims4 d = gy.dims4();
  const int64_t pixels = d.N * d.H * d.W;
  const int chunks = int(std::clamp<int64_t>((pixels + 4095) / 4096, 1, 1024));
  const int64_t chunk = (pixels + chunks - 1) / chunks;
  UNETCU_CHECK(d.C <= 65535, "conv2d: bias gradient over ", d.C, " channels (at most 65535)");
  unetcu::cuda::DeviceBuffer partial(device, size_t(d.C) * size_t(chunks) * sizeof(float));
  float* part = static_cast<float*>(partial.get());
  UNETCU_DISPATCH_STORAGE(gy.dtype(), S, {
    bias_grad_partial_kernel<S><<<dim3(unsigned(chunks), unsigned(d.C)), kThreads, 0, stream>>>(
        gy.data<S>(), d, chunk, chunks, part);
    bias_grad_finish_kernel<S><<<blocks_for(d.C), kThreads, 0, stream>>>(part, chunks, d.C,
                                                                         gb.data<S>(), beta != 0);
  });
  // Checked here, before `partial` goes back to the allocator: a launch error is the thread's
  // last error only until the next CUDA call clears or replaces it.
  CUDA_CHECK_LAUNCH(stream, "conv2d bias gradient");
}

// t as cuDNN is given it, in `format`: t itself (or absent), or a copy in that format (device
// memory held for the launcher's call) holding t's values when copy_values.
struct InFormat {
  std::unique_ptr<unetcu::cuda::DeviceBuffer> copy;
  TensorRef ref;
  InFormat(const TensorRef& t, MemoryFormat format, int device, bool copy_values) : ref(t) {
    if (!t.defined() || t.format() == format) return;
    copy = std::make_unique<unetcu::cuda::DeviceBuffer>(device, t.nbytes());
    ref = TensorRef(copy->get(), t.dtype(), t.device(), t.shape(), format);
    if (copy_values) convert(t, ref, 0);
  }
};

// Device memory for a tensor of `shape` like t (dtype, device) in `format`, held for the call.
struct Scratch {
  unetcu::cuda::DeviceBuffer buffer;
  TensorRef ref;
  Scratch(const TensorRef& like, const Shape& shape, MemoryFormat format, int device)
      : buffer(device, size_t(shape[0] * shape[1] * shape[2] * shape[3]) * dtype_size(like.dtype())),
        ref(buffer.get(), like.dtype(), like.device(), shape, format) {}
};

// The first n rows (outermost dimension) of t: a view.
TensorRef rows(const TensorRef& t, int64_t n) {
  Shape s = t.shape();
  s[0] = n;
  return TensorRef(t.raw(), t.dtype(), t.device(), s, t.format());
}

// t [n, c, h, w] with zeros up to [n_to, c_to, h, w], in t's format (the padded route).
struct PaddedCopy : Scratch {
  PaddedCopy(const TensorRef& t, int64_t n_to, int64_t c_to, int device)
      : Scratch(t, {n_to, c_to, t.dim(2), t.dim(3)}, t.format(), device) {
    CUDA_CHECK(cudaMemsetAsync(ref.raw(), 0, ref.nbytes(), unetcu::cuda::current_stream(device)));
    concat_forward_part(t, rows(ref, t.dim(0)), 0);
  }
};

// dst (written, or accumulated by beta in float32 and rounded once) = src, where src is dst in
// any format, or dst with more rows and channels (the padded route: its leading ones count).
void put(const TensorRef& src, const TensorRef& dst, double beta, int device) {
  if (src.shape() == dst.shape()) {
    convert(src, dst, beta);
    return;
  }
  const TensorRef lead = rows(src, dst.dim(0));
  if (src.format() == dst.format()) {
    concat_backward_part(lead, dst, 0, beta);
    return;
  }
  Scratch tmp(dst, dst.shape(), src.format(), device);
  concat_backward_part(lead, tmp.ref, 0, 0);
  convert(tmp.ref, dst, beta);
}

bool float32_nchw(const Data& d) { return d.type == DType::F32 && d.format == MemoryFormat::NCHW; }

// Each direction on a plan whose choice for it runs directly, the output written (beta 0) or
// blended by cuDNN.
void run_forward(cudnnHandle_t h, Plan& q, const TensorRef& x, const TensorRef& w,
                 const TensorRef& y, int dev) {
  const auto& c = q.fwd;
  unetcu::cuda::DeviceBuffer ws(dev, c.workspace);
  const float one = 1, zero = 0;
  CUDNN_CHECK(cudnnConvolutionForward(h, &one, q.x.d, x.raw(), q.w.d, w.raw(), c.conv.d, c.algo,
                                      ws.get(), c.workspace, &zero, q.y.d, y.raw()));
}
void run_backward_filter(cudnnHandle_t h, Plan& q, const TensorRef& x, const TensorRef& gy,
                         const TensorRef& gw, float beta, int dev) {
  const auto& c = q.bwd_filter;
  unetcu::cuda::DeviceBuffer ws(dev, c.workspace);
  const float one = 1;
  CUDNN_CHECK(cudnnConvolutionBackwardFilter(h, &one, q.x.d, x.raw(), q.y.d, gy.raw(), c.conv.d,
                                             c.algo, ws.get(), c.workspace, &beta, q.w.d, gw.raw()));
}
void run_backward_data(cudnnHandle_t h, Plan& q, const TensorRef& w, const TensorRef& gy,
                       const TensorRef& gx, float beta, int dev) {
  const auto& c = q.bwd_data;
  unetcu::cuda::DeviceBuffer ws(dev, c.workspace);
  const float one = 1;
  CUDNN_CHECK(cudnnConvolutionBackwardData(h, &one, q.w.d, w.raw(), q.y.d, gy.raw(), c.conv.d,
                                           c.algo, ws.get(), c.workspace, &beta, q.x.d, gx.raw()));
}

}  // namespace

int conv_searches() { return g_searches.load(); }

void forget_conv_plans() {
  {
    std::lock_guard<std::mutex> lock(g_plans_mutex);
    plans().clear();
  }
  std::lock_guard<std::mutex> lock(g_workspace_mutex);
  g_workspace_bytes.clear();
}

void conv2d_forward(const TensorRef& x, const TensorRef& w, const TensorRef& b, const TensorRef& y,
                    const ConvGeometry& g) {
  Launch l(x);
  const int dev = x.device().index;
  const bool tf32 = unetcu::cuda::allow_tf32(), det = unetcu::cuda::deterministic();
  const Data data{x.dtype(), x.format()};
  Plan& p = plan_for(dev, g, data, tf32, det);
  const InFormat wx(w, x.format(), dev, true);  // the filter in x's format
  bool bias_added = false;
  {
    unetcu::cuda::CudnnLock h(dev);
    auto& c = chosen<Forward>(p, h.handle(), dev, tf32, det, x.raw(), wx.ref.raw());
    if (c.route == Route::Direct) {
      run_forward(h.handle(), p, x, wx.ref, y, dev);
      if (b.defined() && float32_nchw(data)) {
        const float one = 1;
        CUDNN_CHECK(cudnnAddTensor(h.handle(), &one, p.bias.d, b.raw(), &one, p.y.d, y.raw()));
        bias_added = true;
      }
    } else if (c.route == Route::Nchw) {
      const InFormat xn(x, MemoryFormat::NCHW, dev, true), wn(w, MemoryFormat::NCHW, dev, true);
      Scratch yn(y, y.shape(), MemoryFormat::NCHW, dev);
      run_forward(h.handle(), *c.via, xn.ref, wn.ref, yn.ref, dev);
      convert(yn.ref, y, 0);
    } else {
      const ConvGeometry& q = c.via->g;
      const PaddedCopy xp(x, g.N, q.C, dev), wp(wx.ref, q.O, q.C, dev);
      Scratch yp(y, {g.N, q.O, g.OH, g.OW}, y.format(), dev);
      run_forward(h.handle(), *c.via, xp.ref, wp.ref, yp.ref, dev);
      put(yp.ref, y, 0, dev);
    }
  }
  if (b.defined() && !bias_added) {
    const int64_t n = y.numel();
    UNETCU_DISPATCH_STORAGE(y.dtype(), S, {
      with_index_type(n, [&](auto index) {
        using I = decltype(index);
        bias_add_kernel<S, I><<<blocks_for(n), kThreads, 0, l.stream>>>(y.data<S>(), b.data<S>(),
                                                                        Dims4Div<I>(y.dims4()), I(n));
      });
    });
  }
  CUDA_CHECK_LAUNCH(l.stream, "conv2d_forward");
}

// Accumulation (beta = 1) into a bfloat16 gradient is never left to cuDNN: whether it rounds
// its result to bfloat16 before it blends (two roundings) or blends in float32 (one) is not
// documented, and the two differ. cuDNN writes into a scratch (beta = 0, rounded once) and
// the convert kernel adds that to the gradient in float32 and rounds once: the same two
// roundings, on every cuDNN, as PyTorch's autograd (a bfloat16 gradient summed with a
// bfloat16 gradient). float32 gradients are blended by cuDNN.
void conv2d_backward(const TensorRef& grad_y, const TensorRef& x, const TensorRef& w,
                     const TensorRef& grad_x, double beta_x, const TensorRef& grad_w, double beta_w,
                     const TensorRef& grad_b, double beta_b, const ConvGeometry& g) {
  Launch l(x);
  const int dev = x.device().index;
  const bool tf32 = unetcu::cuda::allow_tf32(), det = unetcu::cuda::deterministic();
  const Data data{x.dtype(), x.format()};
  Plan& p = plan_for(dev, g, data, tf32, det);
  const InFormat wx(grad_x.defined() ? w : TensorRef(), x.format(), dev, true);  // in x's format
  std::optional<InFormat> gyn;  // grad_y in NCHW, made once for the directions that run there
  const auto grad_y_nchw = [&]() -> const TensorRef& {
    if (!gyn) gyn.emplace(grad_y, MemoryFormat::NCHW, dev, true);
    return gyn->ref;
  };
  const float one = 1;
  {
    unetcu::cuda::CudnnLock h(dev);
    if (grad_b.defined()) {
      if (float32_nchw(data)) {
        const float bb = float(beta_b);
        CUDNN_CHECK(cudnnConvolutionBackwardBias(h.handle(), &one, p.y.d, grad_y.raw(), &bb,
                                                 p.bias.d, grad_b.raw()));
      } else {
        bias_grad(grad_y, grad_b, beta_b, l.stream, dev);
      }
    }
    if (grad_w.defined()) {
      auto& c = chosen<BackwardFilter>(p, h.handle(), dev, tf32, det, x.raw(), grad_y.raw());
      const Shape ws = {g.O, g.C, g.kh, g.kw};
      if (c.route == Route::Direct) {
        // cuDNN writes the filter gradient in x's format.
        if (grad_w.format() == x.format() && !(data.bf16() && beta_w != 0)) {
          run_backward_filter(h.handle(), p, x, grad_y, grad_w, float(beta_w), dev);
        } else {
          Scratch s(grad_w, ws, x.format(), dev);
          run_backward_filter(h.handle(), p, x, grad_y, s.ref, 0, dev);
          put(s.ref, grad_w, beta_w, dev);
        }
      } else if (c.route == Route::Nchw) {
        const InFormat xn(x, MemoryFormat::NCHW, dev, true);
        Scratch s(grad_w, ws, MemoryFormat::NCHW, dev);
        run_backward_filter(h.handle(), *c.via, xn.ref, grad_y_nchw(), s.ref, 0, dev);
        put(s.ref, grad_w, beta_w, dev);
      } else {
        const ConvGeometry& q = c.via->g;
        const PaddedCopy xp(x, g.N, q.C, dev), gyp(grad_y, g.N, q.O, dev);
        Scratch s(grad_w, {q.O, q.C, g.kh, g.kw}, x.format(), dev);
        run_backward_filter(h.handle(), *c.via, xp.ref, gyp.ref, s.ref, 0, dev);
        put(s.ref, grad_w, beta_w, dev);
      }
    }
    if (grad_x.defined()) {
      auto& c = chosen<BackwardData>(p, h.handle(), dev, tf32, det, wx.ref.raw(), grad_y.raw());
      if (c.route == Route::Direct) {
        if (!(data.bf16() && beta_x != 0)) {
          run_backward_data(h.handle(), p, wx.ref, grad_y, grad_x, float(beta_x), dev);
        } else {
          Scratch s(grad_x, grad_x.shape(), x.format(), dev);
          run_backward_data(h.handle(), p, wx.ref, grad_y, s.ref, 0, dev);
          put(s.ref, grad_x, beta_x, dev);
        }
      } else if (c.route == Route::Nchw) {
        const InFormat wn(w, MemoryFormat::NCHW, dev, true);
        Scratch s(grad_x, grad_x.shape(), MemoryFormat::NCHW, dev);
        run_backward_data(h.handle(), *c.via, wn.ref, grad_y_nchw(), s.ref, 0, dev);
        put(s.ref, grad_x, beta_x, dev);
      } else {
        const ConvGeometry& q = c.via->g;
        const PaddedCopy wp(wx.ref, q.O, q.C, dev), gyp(grad_y, g.N, q.O, dev);
        Scratch s(grad_x, {g.N, q.C, g.H, g.W}, x.format(), dev);
        run_backward_data(h.handle(), *c.via, wp.ref, gyp.ref, s.ref, 0, dev);
        put(s.ref, grad_x, beta_x, dev);
      }
    }
  }
  CUDA_CHECK_LAUNCH(l.stream, "conv2d_backward");
}

}  // namespace unetcu::kernels::cuda
