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
// dtypes and formats: x, w, y (and b) float32, or all bfloat16 (compute type float32, y
// rounded once by cuDNN). x and y NCHW or NHWC; cuDNN is given the filter in x's format (OHWI
// with NHWC, the layout its channels-last tensor-core kernels read): a w in the other format
// is converted for the call, and its gradient computed in x's format and converted into it.
// The bias of a float32 NCHW output is added by cuDNN as before; other bias adds and every
// bias gradient other than float32 NCHW run on the kernels below. A bfloat16 output with a
// bias is rounded twice, as PyTorch's CUDA path does: once by the convolution, once by the
// bias add (each kernel computes in float32 and rounds once on store).
//
// Gradient rule (cuDNN beta): the weight and bias gradients accumulate when a gradient
// exists (beta = 1) and are written otherwise (beta = 0); the same holds for the input
// gradient, which is written (beta = 0) unless the input already has one (e.g. a residual
// input read by both the block and its downsample conv).
#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "runtime/algo_cache.h"
#include "runtime/cuda_api.h"
#include "bodies/bf16.h"
#include "bodies/layout.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/conv_pick.h"
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

// One direction's algorithm. Each direction has its own convolution descriptor, set once to the
// math type its algorithm runs with: plans are shared by every stream of the device, and two
// streams may run the same plan at once, so nothing in a chosen plan changes afterwards.
template <class Algo>
struct Choice {
  ConvDesc conv;
  bool chosen = false;
  Algo algo{};
  cudnnMathType_t math = CUDNN_FMA_MATH;
  size_t workspace = 0;
  explicit Choice(const ConvGeometry& g) : conv(g.ph, g.pw, g.sh, g.sw) {}
};

struct Plan {
  Data data;
  TensorDesc x, y, bias;  // bias: float32 [1, O, 1, 1], for cudnnAddTensor on float32 NCHW
  FilterDesc w;
  Choice<cudnnConvolutionFwdAlgo_t> fwd;
  Choice<cudnnConvolutionBwdDataAlgo_t> bwd_data;
  Choice<cudnnConvolutionBwdFilterAlgo_t> bwd_filter;
  std::mutex search_mutex;  // each direction is chosen once, by its first caller
  Plan(const ConvGeometry& g, const Data& d)
      : data(d),
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

// The math type the search runs with.
cudnnMathType_t search_math(const Data& data, bool tf32) {
  if (data.bf16()) return CUDNN_TENSOR_OP_MATH;
  return tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
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

// Workspace the search may use: a quarter of the free memory, at most 1 GiB, fixed per device
// at its first search so that every later search reuses the same cached block. It comes from
// the caching allocator (cudaMalloc/cudaFree here would synchronise the device, with NCCL
// kernels possibly in flight) and is optional: when memory is short the search runs among
// the algorithms that need less.
size_t search_workspace_bytes(int device) {
  static std::mutex mu;
  static std::map<int, size_t> bytes;
  std::lock_guard<std::mutex> lock(mu);
  auto it = bytes.find(device);
  if (it != bytes.end()) return it->second;
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));  // on `device`: the launcher set it
  return bytes[device] = std::min<size_t>(free_b / 4, size_t(1) << 30);
}

// The direction's choice among the search results (conv_pick.h), for this plan's shape.
template <class D>
typename D::Perf pick(const typename D::Perf* results, int count, const Data& data, bool tf32,
                      bool deterministic, const ConvGeometry& g) {
  const std::string shape = str_cat(dtype_name(data.type), " ", format_name(data.format),
                                    " input ", g.N, "x", g.C, "x", g.H, "x", g.W, ", weight ", g.O,
                                    "x", g.C, "x", g.kh, "x", g.kw, " stride ", g.sh, "x", g.sw,
                                    " padding ", g.ph, "x", g.pw);
  return pick_result(results, count, tensor_cores_allowed(data, tf32), deterministic, D::kWhat,
                     shape);
}

// Chooses the direction's algorithm (once per plan): the on-disk cache, else the search.
template <class D>
void choose(Plan& p, cudnnHandle_t h, int device, const ConvGeometry& g, bool tf32,
            bool deterministic, const void* in1, const void* in2, void* out) {
  Choice<typename D::Algo>& c = D::choice(p);
  const Data& data = p.data;
  const ConvAlgoKey key = disk_key(D::kDirection, device, g, data, tf32, deterministic);
  if (const auto hit = disk_cache().find(key)) {
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
      return;
    }
  }
  CUDNN_CHECK(cudnnSetConvolutionMathType(c.conv.d, search_math(data, tf32)));
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
  std::vector<typename D::Perf> results(size_t(std::max(D::max_count(h), D::kCount)));
  int n = 0;
  D::find(h, p, in1, in2, out, results.data(), int(results.size()), &n, ws->get(),
          ws->get() ? got : 0);
  const typename D::Perf perf = pick<D>(results.data(), n, data, tf32, deterministic, g);
  c.algo = perf.algo;
  c.math = run_math(data, tf32, perf.mathType);
  CUDNN_CHECK(cudnnSetConvolutionMathType(c.conv.d, c.math));
  // The workspace for the math type it will run with (FMA where the search measured DEFAULT).
  size_t need = 0;
  c.workspace = D::workspace(h, p, c.algo, &need) == CUDNN_STATUS_SUCCESS
                    ? std::max(perf.memory, need)
                    : perf.memory;
  c.chosen = true;
  // A search that had to do without its workspace (memory was short) may have missed the
  // fastest algorithm: good for this process, not worth keeping for the next.
  if ((ws->get() && got == want) || want == 0)
    disk_cache().store(key, ConvAlgoChoice{int(perf.algo), int(perf.mathType),
                                           perf.determinism == CUDNN_DETERMINISTIC});
}

// The direction's choice, made by the first caller. The search writes its output: `out`, or
// with `scratch_bytes` a scratch buffer (a backward's real output may hold a gradient that
// must be accumulated into, not overwritten).
template <class D>
Choice<typename D::Algo>& chosen(Plan& p, cudnnHandle_t h, int device, const ConvGeometry& g,
                                 bool tf32, bool deterministic, const void* in1, const void* in2,
                                 void* out, size_t scratch_bytes = 0) {
  std::lock_guard<std::mutex> lock(p.search_mutex);
  Choice<typename D::Algo>& c = D::choice(p);
  if (!c.chosen) {
    // The search runs kernels and reads the free memory: not inside a graph capture, whose
    // warm-up steps choose every algorithm first. A new shape there is an error that says so.
    cudaStream_t stream = nullptr;
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    if (cudnnGetStream(h, &stream) == CUDNN_STATUS_SUCCESS &&
        cudaStreamIsCapturing(stream, &capturing) == cudaSuccess &&
        capturing != cudaStreamCaptureStatusNone)
      throw Error(str_cat("a ", D::kWhat, " of a shape not seen in the eager steps (input ", g.N,
                          "x", g.C, "x", g.H, "x", g.W, ", weight ", g.O, "x", g.C, "x", g.kh, "x",
                          g.kw, ") came up while capturing a CUDA graph: its algorithm must be "
                          "chosen before the capture"));
    unetcu::cuda::DeviceBuffer scratch(device, scratch_bytes);
    choose<D>(p, h, device, g, tf32, deterministic, in1, in2, scratch_bytes ? scratch.get() : out);
  }
  return c;  // not changed again: read without the lock from here on
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

bool float32_nchw(const Data& d) { return d.type == DType::F32 && d.format == MemoryFormat::NCHW; }

}  // namespace

void conv2d_forward(const TensorRef& x, const TensorRef& w, const TensorRef& b, const TensorRef& y,
                    const ConvGeometry& g) {
  Launch l(x);
  const int dev = x.device().index;
  const bool tf32 = unetcu::cuda::allow_tf32(), det = unetcu::cuda::deterministic();
  const Data data{x.dtype(), x.format()};
  Plan& p = plan_for(dev, g, data, tf32, det);
  const InFormat wx(w, x.format(), dev, true);  // the filter in x's format
  const float one = 1, zero = 0;
  {
    unetcu::cuda::CudnnLock h(dev);
    // The search writes y, which this call overwrites anyway.
    auto& c = chosen<Forward>(p, h.handle(), dev, g, tf32, det, x.raw(), wx.ref.raw(), y.raw());
    unetcu::cuda::DeviceBuffer ws(dev, c.workspace);
    CUDNN_CHECK(cudnnConvolutionForward(h.handle(), &one, p.x.d, x.raw(), p.w.d, wx.ref.raw(),
                                        c.conv.d, c.algo, ws.get(), c.workspace, &zero, p.y.d,
                                        y.raw()));
    if (b.defined() && float32_nchw(data))
      CUDNN_CHECK(cudnnAddTensor(h.handle(), &one, p.bias.d, b.raw(), &one, p.y.d, y.raw()));
  }
  if (b.defined() && !float32_nchw(data)) {
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

void conv2d_backward(const TensorRef& grad_y, const TensorRef& x, const TensorRef& w,
                     const TensorRef& grad_x, double beta_x, const TensorRef& grad_w, double beta_w,
                     const TensorRef& grad_b, double beta_b, const ConvGeometry& g) {
  Launch l(x);
  const int dev = x.device().index;
  const bool tf32 = unetcu::cuda::allow_tf32(), det = unetcu::cuda::deterministic();
  const Data data{x.dtype(), x.format()};
  Plan& p = plan_for(dev, g, data, tf32, det);
  // The filter, and the filter gradient, in x's format. A grad_w in the other format is
  // copied into x's format when it is accumulated into (beta_w = 1), cuDNN writes or
  // accumulates there (one rounding), and the result is copied back (a layout change only).
  const InFormat wx(grad_x.defined() ? w : TensorRef(), x.format(), dev, true);
  const InFormat gwx(grad_w, x.format(), dev, beta_w != 0);
  const bool gw_converted = gwx.copy != nullptr;
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
      auto& c = chosen<BackwardFilter>(p, h.handle(), dev, g, tf32, det, x.raw(), grad_y.raw(),
                                       nullptr, w.nbytes());
      unetcu::cuda::DeviceBuffer ws(dev, c.workspace);
      const float bw = float(beta_w);
      CUDNN_CHECK(cudnnConvolutionBackwardFilter(h.handle(), &one, p.x.d, x.raw(), p.y.d,
                                                 grad_y.raw(), c.conv.d, c.algo, ws.get(),
                                                 c.workspace, &bw, p.w.d, gwx.ref.raw()));
    }
    if (grad_x.defined()) {
      auto& c = chosen<BackwardData>(p, h.handle(), dev, g, tf32, det, wx.ref.raw(), grad_y.raw(),
                                     nullptr, x.nbytes());
      unetcu::cuda::DeviceBuffer ws(dev, c.workspace);
      const float bx = float(beta_x);
      CUDNN_CHECK(cudnnConvolutionBackwardData(h.handle(), &one, p.w.d, wx.ref.raw(), p.y.d,
                                               grad_y.raw(), c.conv.d, c.algo, ws.get(),
                                               c.workspace, &bx, p.x.d, grad_x.raw()));
    }
  }
  if (gw_converted) convert(gwx.ref, grad_w, 0);
  CUDA_CHECK_LAUNCH(l.stream, "conv2d_backward");
}

}  // namespace unetcu::kernels::cuda
