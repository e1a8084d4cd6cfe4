// Float32 convolution on oneDNN; see conv_dnnl.h. Per (geometry, thread count) and per host
// thread, one plan holds the three primitive descriptors (forward, backward data, backward
// weights, the backward ones hinted by the forward's), their primitives and the reorders
// between the engine's NCHW / OIHW tensors and the layouts the primitives chose. Blocked copies
// and oneDNN's scratchpad live in the per-thread workspace (no allocation per call).
#include "kernels/cpu/conv_dnnl.h"

#include <omp.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/workspace.h"
#include "runtime/common.h"

#ifdef UNETCU_HAVE_DNNL
#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace unetcu::kernels::cpu {

namespace {

CpuConvImpl initial_impl() {
  const char* env = std::getenv("UNETCU_CPU_CONV");
  if (env && std::strcmp(env, "im2col") == 0) return CpuConvImpl::Im2col;
  return onednn_built() ? CpuConvImpl::OneDnn : CpuConvImpl::Im2col;
}

CpuConvImpl& impl_ref() {
  static CpuConvImpl impl = initial_impl();
  return impl;
}

}  // namespace

bool onednn_built() {
#ifdef UNETCU_HAVE_DNNL
  return true;
#else
  return false;
#endif
}

CpuConvImpl cpu_conv_impl() { return impl_ref(); }

namespace {
std::atomic<bool> g_bf16{false};
}  // namespace

bool onednn_bf16_supported();  // below, where oneDNN is included

void set_cpu_conv_bf16(bool on) {
  UNETCU_CHECK(!on || onednn_built(), "bfloat16 convolutions on the CPU need oneDNN (install libdnnl-dev "
                                      "and rebuild)");
  UNETCU_CHECK(!on || onednn_bf16_supported(), "this CPU has no bfloat16 convolution kernels in oneDNN "
               "(they need AVX-512)");
  g_bf16 = on;
}
bool cpu_conv_bf16() { return g_bf16; }

void set_cpu_conv_impl(CpuConvImpl impl) {
  UNETCU_CHECK(impl == CpuConvImpl::Im2col || onednn_built(),
               "this build has no oneDNN (install libdnnl-dev and rebuild)");
  impl_ref() = impl;
}

#ifndef UNETCU_HAVE_DNNL

bool onednn_bf16_supported() { return false; }

std::string cpu_conv_line() { return "im2col + GEMM"; }
bool onednn_conv2d_forward(const float*, const float*, const float*, float*, const ConvGeometry&) {
  return false;
}
bool onednn_conv2d_backward(const float*, const float*, const float*, float*, float, float*, float,
                            const ConvGeometry&) {
  return false;
}

#else

namespace {

using dnnl::memory;
using tag = dnnl::memory::format_tag;
constexpr auto f32 = dnnl::memory::data_type::f32;
constexpr auto bf16 = dnnl::memory::data_type::bf16;

const dnnl::engine& cpu_engine() {
  static const dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  return eng;
}

dnnl::stream& cpu_stream() {
  static thread_local dnnl::stream s(cpu_engine());
  return s;
}

// A tensor in the engine's layout and in the layout a primitive wants, with the reorder
// between them when they differ (into the primitive's layout for inputs, out of it for outputs).
struct Move {
  memory::desc user, inner;
  bool needed = false;
  dnnl::reorder prim;

  Move() = default;
  Move(const memory::desc& u, const memory::desc& in, bool input) : user(u), inner(in) {
    needed = u != in;
    if (!needed) return;
    const auto& e = cpu_engine();
    prim = input ? dnnl::reorder(dnnl::reorder::primitive_desc(e, u, e, in))
                 : dnnl::reorder(dnnl::reorder::primitive_desc(e, in, e, u));
  }

  // The input in the primitive's layout: the user's pointer, or a reordered copy in `slot`.
  float* in(const float* p, WorkspaceSlot slot) const {
    if (!needed) return const_cast<float*>(p);
    float* buf = static_cast<float*>(workspace(slot, inner.get_size()));
    memory src(user, cpu_engine(), const_cast<float*>(p)), dst(inner, cpu_engine(), buf);
    prim.execute(cpu_stream(), src, dst);
    return buf;
  }
};

// Where a primitive writes an output, and how it gets to the user's tensor: straight (layout
// equal, written), reordered, or through a user-layout buffer that is then added (beta 1).
struct Out {
  const Move& move;
  float* user;
  float beta;
  float* target = nullptr;    // what the primitive writes
  float* staging = nullptr;   // user layout, when accumulating

  Out(const Move& m, float* u, float b, WorkspaceSlot inner_slot) : move(m), user(u), beta(b) {
    if (beta != 0) staging = static_cast<float*>(workspace(WorkspaceSlot::OnednnAccum, m.user.get_size()));
    if (move.needed)
      target = static_cast<float*>(workspace(inner_slot, m.inner.get_size()));
    else
      target = staging ? staging : user;
  }

  void finish() {
    float* dst = staging ? staging : user;
    if (move.needed) {
      memory src(move.inner, cpu_engine(), target), out(move.user, cpu_engine(), dst);
      move.prim.execute(cpu_stream(), src, out);
    }
    if (staging) {
      const int64_t n = int64_t(move.user.get_size() / sizeof(float));
      float* u = user;
      const float* s = staging;
      parallel_for(n, [=](int64_t i) { u[i] += s[i]; });
    }
  }
};

struct Plan {
  bool ok = false;
  dnnl::convolution_forward::primitive_desc fwd_pd;
  dnnl::convolution_forward fwd;
  Move fwd_src, fwd_w, fwd_dst;
  bool bias = false;
  // Backward, made on first use (validation never needs it).
  bool bwd_made = false, bwd_ok = false;
  dnnl::convolution_backward_data::primitive_desc bwd_d_pd;
  dnnl::convolution_backward_data bwd_d;
  Move bwd_d_dy, bwd_d_w, bwd_d_dx;
  dnnl::convolution_backward_weights::primitive_desc bwd_w_pd;
  dnnl::convolution_backward_weights bwd_w;
  Move bwd_w_dy, bwd_w_x, bwd_w_dw;
  bool share_dy = false;  // both backward primitives read dY in one layout
  bool bf16 = false;      // inputs rounded to bfloat16 (set_cpu_conv_bf16)
};

struct Dims {
  memory::dims src, wei, dst, strides, pad_l, pad_r;
  explicit Dims(const ConvGeometry& g)
      : src{g.N, g.C, g.H, g.W},
        wei{g.O, g.C, g.kh, g.kw},
        dst{g.N, g.O, g.OH, g.OW},
        strides{g.sh, g.sw},
        pad_l{g.ph, g.pw},
        pad_r{g.ph, g.pw} {}
  memory::desc any(const memory::dims& d, memory::data_type t = f32) const { return memory::desc(d, t, tag::any); }
};

dnnl::primitive_attr user_scratchpad() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

// PyTorch's output-size rule with symmetric padding; oneDNN checks the same with its floor.
bool geometry_fits(const ConvGeometry& g) {
  return g.OH == (g.H + 2 * g.ph - g.kh) / g.sh + 1 && g.OW == (g.W + 2 * g.pw - g.kw) / g.sw + 1;
}

Plan& plan_for(const ConvGeometry& g, bool bias) {
  using Key = std::array<int64_t, 16>;
  static thread_local std::map<Key, std::unique_ptr<Plan>> plans;
  const bool half = cpu_conv_bf16();
  const Key key{g.N, g.C, g.H, g.W, g.O, g.OH, g.OW, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw,
                int64_t(bias), int64_t(omp_get_max_threads()), int64_t(half)};
  auto it = plans.find(key);
  if (it != plans.end()) return *it->second;
  auto plan = std::make_unique<Plan>();
  plan->bias = bias;
  plan->bf16 = half;
  if (geometry_fits(g)) {
    const Dims d(g);
    // Mixed precision: inputs in bf16 (the Moves round the float32 tensors), output float32.
    const auto in_t = half ? bf16 : f32;
    try {
      const memory::desc bias_md = bias ? memory::desc({g.O}, f32, tag::x) : memory::desc();
      dnnl::convolution_forward::desc desc(dnnl::prop_kind::forward_training,
                                           dnnl::algorithm::convolution_direct, d.any(d.src, in_t),
                                           d.any(d.wei, in_t), bias_md, d.any(d.dst), d.strides,
                                           d.pad_l, d.pad_r);
      plan->fwd_pd = dnnl::convolution_forward::primitive_desc(desc, user_scratchpad(), cpu_engine());
      plan->fwd = dnnl::convolution_forward(plan->fwd_pd);
      plan->fwd_src = Move(memory::desc(d.src, f32, tag::nchw), plan->fwd_pd.src_desc(), true);
      plan->fwd_w = Move(memory::desc(d.wei, f32, tag::oihw), plan->fwd_pd.weights_desc(), true);
      plan->fwd_dst = Move(memory::desc(d.dst, f32, tag::nchw), plan->fwd_pd.dst_desc(), false);
      plan->ok = true;
    } catch (const dnnl::error&) {
      plan->ok = false;  // no oneDNN kernel: im2col runs this geometry
    }
  }
  return *plans.emplace(key, std::move(plan)).first->second;
}

void make_backward(Plan& p, const ConvGeometry& g) {
  p.bwd_made = true;
  if (!p.ok) return;
  const Dims d(g);
  const auto in_t = p.bf16 ? bf16 : f32;  // what the primitives read: weights, dY, X
  try {
    dnnl::convolution_backward_data::desc dd(dnnl::algorithm::convolution_direct, d.any(d.src),
                                             d.any(d.wei, in_t), d.any(d.dst, in_t), d.strides, d.pad_l,
                                             d.pad_r);
    p.bwd_d_pd = dnnl::convolution_backward_data::primitive_desc(dd, user_scratchpad(),
                                                                 cpu_engine(), p.fwd_pd);
    p.bwd_d = dnnl::convolution_backward_data(p.bwd_d_pd);
    dnnl::convolution_backward_weights::desc wd(dnnl::algorithm::convolution_direct,
                                                d.any(d.src, in_t), d.any(d.wei), d.any(d.dst, in_t),
                                                d.strides, d.pad_l, d.pad_r);
    p.bwd_w_pd = dnnl::convolution_backward_weights::primitive_desc(wd, user_scratchpad(),
                                                                    cpu_engine(), p.fwd_pd);
    p.bwd_w = dnnl::convolution_backward_weights(p.bwd_w_pd);
    const memory::desc src(d.src, f32, tag::nchw), wei(d.wei, f32, tag::oihw),
        dst(d.dst, f32, tag::nchw);
    p.bwd_d_dy = Move(dst, p.bwd_d_pd.diff_dst_desc(), true);
    p.bwd_d_w = Move(wei, p.bwd_d_pd.weights_desc(), true);
    p.bwd_d_dx = Move(src, p.bwd_d_pd.diff_src_desc(), false);
    p.bwd_w_dy = Move(dst, p.bwd_w_pd.diff_dst_desc(), true);
    p.bwd_w_x = Move(src, p.bwd_w_pd.src_desc(), true);
    p.bwd_w_dw = Move(wei, p.bwd_w_pd.diff_weights_desc(), false);
    p.share_dy = p.bwd_d_pd.diff_dst_desc() == p.bwd_w_pd.diff_dst_desc();
    p.bwd_ok = true;
  } catch (const dnnl::error&) {
    p.bwd_ok = false;
  }
}

void* scratchpad(const dnnl::primitive_desc_base& pd) {
  return workspace(WorkspaceSlot::OnednnScratchpad, std::max<size_t>(pd.scratchpad_desc().get_size(), 64));
}

[[noreturn]] void fail(const dnnl::error& e, const char* what) {
  throw Error(str_cat("oneDNN ", what, " failed: ", e.what()));
}

}  // namespace

// Whether oneDNN has a bfloat16 convolution for this CPU: a small one is made once.
bool onednn_bf16_supported() {
  static const bool ok = [] {
    try {
      const memory::dims src{1, 16, 8, 8}, wei{16, 16, 3, 3}, dst{1, 16, 8, 8}, st{1, 1}, pad{1, 1};
      dnnl::convolution_forward::desc desc(
          dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
          memory::desc(src, bf16, tag::any), memory::desc(wei, bf16, tag::any), memory::desc(),
          memory::desc(dst, f32, tag::any), st, pad, pad);
      dnnl::convolution_forward::primitive_desc pd(desc, cpu_engine());
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return ok;
}

std::string cpu_conv_line() {
  if (cpu_conv_impl() == CpuConvImpl::Im2col) return "im2col + GEMM";
  const dnnl_version_t* v = dnnl_version();
  const char* isa = "no vector ISA";
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::sse41: isa = "sse41"; break;
    case dnnl::cpu_isa::avx: isa = "avx"; break;
    case dnnl::cpu_isa::avx2: isa = "avx2"; break;
    case dnnl::cpu_isa::avx2_vnni: isa = "avx2_vnni"; break;
    case dnnl::cpu_isa::avx512_core: isa = "avx512_core"; break;
    case dnnl::cpu_isa::avx512_core_vnni: isa = "avx512_core_vnni"; break;
    case dnnl::cpu_isa::avx512_core_bf16: isa = "avx512_core_bf16"; break;
    case dnnl::cpu_isa::avx512_core_amx: isa = "avx512_core_amx"; break;
    default: break;
  }
  return str_cat("oneDNN ", v->major, ".", v->minor, ".", v->patch, " (", isa, ")",
                 cpu_conv_bf16() ? ", bfloat16 inputs, float32 accumulation" : "");
}

bool onednn_conv2d_forward(const float* x, const float* w, const float* b, float* y,
                           const ConvGeometry& g) {
  Plan& p = plan_for(g, b != nullptr);
  if (!p.ok) return false;
  try {
    Out dst(p.fwd_dst, y, 0.f, WorkspaceSlot::OnednnDst);
    const auto& e = cpu_engine();
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, memory(p.fwd_pd.src_desc(), e, p.fwd_src.in(x, WorkspaceSlot::OnednnSrc))},
        {DNNL_ARG_WEIGHTS,
         memory(p.fwd_pd.weights_desc(), e, p.fwd_w.in(w, WorkspaceSlot::OnednnWeights))},
        {DNNL_ARG_DST, memory(p.fwd_pd.dst_desc(), e, dst.target)},
        {DNNL_ARG_SCRATCHPAD, memory(p.fwd_pd.scratchpad_desc(), e, scratchpad(p.fwd_pd))}};
    if (b) args.emplace(DNNL_ARG_BIAS, memory(p.fwd_pd.bias_desc(), e, const_cast<float*>(b)));
    p.fwd.execute(cpu_stream(), args);
    dst.finish();
  } catch (const dnnl::error& err) {
    fail(err, "convolution forward");
  }
  return true;
}

bool onednn_conv2d_backward(const float* gy, const float* x, const float* w, float* gx,
                            float beta_x, float* gw, float beta_w, const ConvGeometry& g) {
  Plan& p = plan_for(g, false);
  if (!p.bwd_made) make_backward(p, g);
  if (!p.bwd_ok) return false;
  const auto& e = cpu_engine();
  try {
    float* dy_d = nullptr;
    if (gx) {
      dy_d = p.bwd_d_dy.in(gy, WorkspaceSlot::OnednnDiffDst);
      Out dx(p.bwd_d_dx, gx, beta_x, WorkspaceSlot::OnednnDst);
      p.bwd_d.execute(
          cpu_stream(),
          {{DNNL_ARG_DIFF_DST, memory(p.bwd_d_pd.diff_dst_desc(), e, dy_d)},
           {DNNL_ARG_WEIGHTS,
            memory(p.bwd_d_pd.weights_desc(), e, p.bwd_d_w.in(w, WorkspaceSlot::OnednnWeights))},
           {DNNL_ARG_DIFF_SRC, memory(p.bwd_d_pd.diff_src_desc(), e, dx.target)},
           {DNNL_ARG_SCRATCHPAD, memory(p.bwd_d_pd.scratchpad_desc(), e, scratchpad(p.bwd_d_pd))}});
      dx.finish();
    }
    if (gw) {
      float* dy_w = (dy_d && p.share_dy) ? dy_d : p.bwd_w_dy.in(gy, WorkspaceSlot::OnednnDiffDst);
      Out dw(p.bwd_w_dw, gw, beta_w, WorkspaceSlot::OnednnWeights);
      p.bwd_w.execute(
          cpu_stream(),
          {{DNNL_ARG_DIFF_DST, memory(p.bwd_w_pd.diff_dst_desc(), e, dy_w)},
           {DNNL_ARG_SRC, memory(p.bwd_w_pd.src_desc(), e, p.bwd_w_x.in(x, WorkspaceSlot::OnednnSrc))},
           {DNNL_ARG_DIFF_WEIGHTS, memory(p.bwd_w_pd.diff_weights_desc(), e, dw.target)},
           {DNNL_ARG_SCRATCHPAD, memory(p.bwd_w_pd.scratchpad_desc(), e, scratchpad(p.bwd_w_pd))}});
      dw.finish();
    }
  } catch (const dnnl::error& err) {
    fail(err, "convolution backward");
  }
  return true;
}

#endif  // UNETCU_HAVE_DNNL

}  // namespace unetcu::kernels::cpu
