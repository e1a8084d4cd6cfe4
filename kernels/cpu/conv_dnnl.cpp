// Convolution on oneDNN; see conv_dnnl.h. Per (geometry, dtype, memory formats, thread count,
// bfloat16-input setting) and per host thread, one plan holds the primitive descriptors
// (forward, backward data, backward weights, the backward ones hinted by the forward's), their
// primitives and the reorders between the tensors as the engine holds them (nchw or nhwc,
// oihw or ohwi; float32 or bfloat16) and the layouts and types the primitives chose. Blocked
// copies and oneDNN's scratchpad live in the per-thread workspace (no allocation per call).
#include "kernels/cpu/conv_dnnl.h"

#include <omp.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "bodies/bf16.h"
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

std::atomic<bool> g_bf16_allowed{true};

}  // namespace

bool onednn_built() {
#ifdef UNETCU_HAVE_DNNL
  return true;
#else
  return false;
#endif
}

CpuConvImpl cpu_conv_impl() { return impl_ref(); }

void set_onednn_bf16_allowed(bool allowed) { g_bf16_allowed = allowed; }
bool onednn_bf16_usable() {
  return cpu_conv_impl() == CpuConvImpl::OneDnn && g_bf16_allowed && onednn_bf16_supported();
}

void set_cpu_conv_impl(CpuConvImpl impl) {
  UNETCU_CHECK(impl == CpuConvImpl::Im2col || onednn_built(),
               "this build has no oneDNN (install libdnnl-dev and rebuild)");
  impl_ref() = impl;
}

#ifndef UNETCU_HAVE_DNNL

bool onednn_bf16_supported() { return false; }

std::string cpu_conv_line() { return "im2col + GEMM"; }
bool onednn_conv2d_forward(const TensorRef&, const TensorRef&, const TensorRef&, const TensorRef&,
                           const ConvGeometry&) {
  return false;
}
bool onednn_conv2d_backward(const TensorRef&, const TensorRef&, const TensorRef&, const TensorRef&,
                            double, const TensorRef&, double, const ConvGeometry&) {
  return false;
}

#else

namespace {

using dnnl::memory;
using tag = dnnl::memory::format_tag;
using dtype = dnnl::memory::data_type;

const dnnl::engine& cpu_engine() {
  static const dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  return eng;
}

dnnl::stream& cpu_stream() {
  static thread_local dnnl::stream s(cpu_engine());
  return s;
}

// What the tensors of one convolution are: their dtype (float32 or bfloat16), x's format
// (also y's and the gradients'), and w's format.
struct Setup {
  DType type;
  bool x_nhwc, w_nhwc;

  dtype user_type() const { return type == DType::BF16 ? dtype::bf16 : dtype::f32; }
  // What the primitives read: activations, weights, output gradients.
  dtype input_type() const { return type == DType::BF16 ? dtype::bf16 : dtype::f32; }
  tag act_tag() const { return x_nhwc ? tag::nhwc : tag::nchw; }
  tag wei_tag() const { return w_nhwc ? tag::ohwi : tag::oihw; }
  // The layouts the primitives are asked for, best first: NHWC activations directly (no
  // reorder of the large tensors), else whatever oneDNN prefers (blocked).
  std::vector<tag> act_choices() const {
    return x_nhwc ? std::vector<tag>{tag::nhwc, tag::any} : std::vector<tag>{tag::any};
  }
  // float32 NCHW/OIHW: the case this file had first; its kernel choice is left as it was
  // (oneDNN's reference kernels included). Every other case skips the reference kernels,
  // which are far slower than the float32 NCHW fallback.
  bool legacy() const { return type == DType::F32 && !x_nhwc && !w_nhwc; }
};

bool is_reference(const dnnl::primitive_desc_base& pd) {
  return std::strncmp(pd.impl_info_str(), "ref", 3) == 0;
}

// An input tensor as the engine holds it and as a primitive reads it, with the reorder
// between them when they differ (layout, or float32 rounded to bfloat16).
struct Move {
  memory::desc user, inner;
  bool needed = false;
  dnnl::reorder prim;

  Move() = default;
  Move(const memory::desc& u, const memory::desc& in) : user(u), inner(in) {
    needed = u != in;
    if (!needed) return;
    const auto& e = cpu_engine();
    prim = dnnl::reorder(dnnl::reorder::primitive_desc(e, u, e, in));
  }

  // The input in the primitive's layout: the user's pointer, or a reordered copy in `slot`.
  void* in(const void* p, WorkspaceSlot slot) const {
    if (!needed) return const_cast<void*>(p);
    void* buf = workspace(slot, inner.get_size());
    memory src(user, cpu_engine(), const_cast<void*>(p)), dst(inner, cpu_engine(), buf);
    prim.execute(cpu_stream(), src, dst);
    return buf;
  }
};

// An output: what the primitive writes (inner) and the tensor (user). Written: straight into
// the tensor when the two agree, else through a reorder (which rounds a float32 result to a
// bfloat16 tensor once). Accumulated (beta 1): the primitive's float32 result is brought to
// the tensor's layout in float32 (stage), then added to the tensor in float32 and rounded
// once to its dtype.
struct OutMove {
  memory::desc user, inner, stage;
  bool to_user_needed = false, to_stage_needed = false;
  dnnl::reorder to_user, to_stage;

  OutMove() = default;
  OutMove(const memory::dims& dims, dtype user_type, tag user_tag, const memory::desc& in)
      : user(dims, user_type, user_tag), inner(in), stage(dims, dtype::f32, user_tag) {
    const auto& e = cpu_engine();
    to_user_needed = user != inner;
    if (to_user_needed) to_user = dnnl::reorder(dnnl::reorder::primitive_desc(e, inner, e, user));
    to_stage_needed = stage != inner;
    if (to_stage_needed && inner.data_type() == dtype::f32)
      to_stage = dnnl::reorder(dnnl::reorder::primitive_desc(e, inner, e, stage));
  }
};

struct Out {
  const OutMove& move;
  void* user;
  DType type;
  bool accumulate;
  void* target = nullptr;    // what the primitive writes
  float* staging = nullptr;  // the tensor's layout in float32, when accumulating

  Out(const OutMove& m, void* u, DType t, double beta, WorkspaceSlot inner_slot)
      : move(m), user(u), type(t), accumulate(beta != 0) {
    if (accumulate) {
      // The plans give an accumulated output a float32 primitive result (one rounding).
      UNETCU_CHECK(m.inner.data_type() == dtype::f32, "oneDNN convolution: an accumulated "
                   "output must be computed in float32");
      staging = static_cast<float*>(workspace(WorkspaceSlot::OnednnAccum, m.stage.get_size()));
      target = m.to_stage_needed ? workspace(inner_slot, m.inner.get_size()) : staging;
    } else {
      target = m.to_user_needed ? workspace(inner_slot, m.inner.get_size()) : user;
    }
  }

  void finish() {
    const auto& e = cpu_engine();
    if (!accumulate) {
      if (move.to_user_needed) {
        memory src(move.inner, e, target), dst(move.user, e, user);
        move.to_user.execute(cpu_stream(), src, dst);
      }
      return;
    }
    if (move.to_stage_needed) {
      memory src(move.inner, e, target), dst(move.stage, e, staging);
      move.to_stage.execute(cpu_stream(), src, dst);
    }
    const int64_t n = int64_t(move.stage.get_size() / sizeof(float));
    const float* s = staging;
    if (type == DType::BF16) {
      bf16* u = static_cast<bf16*>(user);
      parallel_for(n, [=](int64_t i) { u[i] = bf16(float(u[i]) + s[i]); });
    } else {
      float* u = static_cast<float*>(user);
      parallel_for(n, [=](int64_t i) { u[i] += s[i]; });
    }
  }
};

// Backward data, in one of two variants: grad_x computed in its own dtype, or in float32 (a
// bfloat16 grad_x that is accumulated).
struct BackwardData {
  bool made = false, ok = false;
  dnnl::convolution_backward_data::primitive_desc pd;
  dnnl::convolution_backward_data prim;
  Move dy, w;
  OutMove dx;
};

struct Plan {
  Setup setup{};
  bool ok = false;
  tag act = tag::any;  // the layout the forward was made with; the backward asks for it too
  dnnl::convolution_forward::primitive_desc fwd_pd;
  dnnl::convolution_forward fwd;
  Move fwd_src, fwd_w;
  OutMove fwd_dst;
  bool bias = false;
  // Backward, made on first use (validation never needs it).
  BackwardData bwd_d[2];
  bool bwd_w_made = false, bwd_w_ok = false;
  dnnl::convolution_backward_weights::primitive_desc bwd_w_pd;
  dnnl::convolution_backward_weights bwd_w;
  Move bwd_w_dy, bwd_w_x;
  OutMove bwd_w_dw;
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

Plan& plan_for(const ConvGeometry& g, bool bias, const Setup& s) {
  using Key = std::array<int64_t, 18>;
  static thread_local std::map<Key, std::unique_ptr<Plan>> plans;
  const Key key{g.N, g.C, g.H, g.W, g.O, g.OH, g.OW, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw,
                int64_t(bias), int64_t(omp_get_max_threads()), int64_t(s.type),
                int64_t(s.x_nhwc), int64_t(s.w_nhwc)};
  auto it = plans.find(key);
  if (it != plans.end()) return *it->second;
  auto plan = std::make_unique<Plan>();
  plan->setup = s;
  plan->bias = bias;
  if (geometry_fits(g)) {
    const Dims d(g);
    const dtype in_t = s.input_type(), out_t = s.user_type();
    const memory::desc bias_md = bias ? memory::desc({g.O}, dtype::f32, tag::x) : memory::desc();
    for (tag act : s.act_choices()) {
      try {
        dnnl::convolution_forward::desc desc(
            dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
            memory::desc(d.src, in_t, act), memory::desc(d.wei, in_t, tag::any), bias_md,
            memory::desc(d.dst, out_t, act), d.strides, d.pad_l, d.pad_r);
        dnnl::convolution_forward::primitive_desc pd(desc, user_scratchpad(), cpu_engine());
        if (!s.legacy() && is_reference(pd)) continue;
        plan->fwd_pd = pd;
        plan->fwd = dnnl::convolution_forward(pd);
        plan->fwd_src = Move(memory::desc(d.src, out_t, s.act_tag()), pd.src_desc());
        plan->fwd_w = Move(memory::desc(d.wei, out_t, s.wei_tag()), pd.weights_desc());
        plan->fwd_dst = OutMove(d.dst, out_t, s.act_tag(), pd.dst_desc());
        plan->act = act;
        plan->ok = true;
        break;
      } catch (const dnnl::error&) {
        // no oneDNN kernel for this layout: the next choice, or another path runs this case
      }
    }
  }
  return *plans.emplace(key, std::move(plan)).first->second;
}

// grad_x in float32 (variant 1) or in its own dtype (variant 0).
BackwardData& backward_data(Plan& p, const ConvGeometry& g, int variant) {
  BackwardData& b = p.bwd_d[variant];
  if (b.made) return b;
  b.made = true;
  if (!p.ok) return b;
  const Setup& s = p.setup;
  const Dims d(g);
  const dtype in_t = s.input_type(), user_t = s.user_type();
  const dtype dx_t = variant == 1 ? dtype::f32 : user_t;
  try {
    dnnl::convolution_backward_data::desc desc(
        dnnl::algorithm::convolution_direct, memory::desc(d.src, dx_t, p.act),
        memory::desc(d.wei, in_t, tag::any), memory::desc(d.dst, in_t, p.act), d.strides, d.pad_l,
        d.pad_r);
    b.pd = dnnl::convolution_backward_data::primitive_desc(desc, user_scratchpad(), cpu_engine(),
                                                           p.fwd_pd);
    if (!s.legacy() && is_reference(b.pd)) return b;
    b.prim = dnnl::convolution_backward_data(b.pd);
    b.dy = Move(memory::desc(d.dst, user_t, s.act_tag()), b.pd.diff_dst_desc());
    b.w = Move(memory::desc(d.wei, user_t, s.wei_tag()), b.pd.weights_desc());
    b.dx = OutMove(d.src, user_t, s.act_tag(), b.pd.diff_src_desc());
    b.ok = true;
  } catch (const dnnl::error&) {
    b.ok = false;
  }
  return b;
}

// grad_w is computed in float32 whatever w's dtype: a bfloat16 grad_w is rounded once, by the
// reorder into the tensor or after it is accumulated.
bool backward_weights(Plan& p, const ConvGeometry& g) {
  if (p.bwd_w_made) return p.bwd_w_ok;
  p.bwd_w_made = true;
  if (!p.ok) return false;
  const Setup& s = p.setup;
  const Dims d(g);
  const dtype in_t = s.input_type(), user_t = s.user_type();
  try {
    dnnl::convolution_backward_weights::desc desc(
        dnnl::algorithm::convolution_direct, memory::desc(d.src, in_t, p.act),
        memory::desc(d.wei, dtype::f32, tag::any), memory::desc(d.dst, in_t, p.act), d.strides,
        d.pad_l, d.pad_r);
    p.bwd_w_pd = dnnl::convolution_backward_weights::primitive_desc(desc, user_scratchpad(),
                                                                    cpu_engine(), p.fwd_pd);
    if (!s.legacy() && is_reference(p.bwd_w_pd)) return false;
    p.bwd_w = dnnl::convolution_backward_weights(p.bwd_w_pd);
    p.bwd_w_dy = Move(memory::desc(d.dst, user_t, s.act_tag()), p.bwd_w_pd.diff_dst_desc());
    p.bwd_w_x = Move(memory::desc(d.src, user_t, s.act_tag()), p.bwd_w_pd.src_desc());
    p.bwd_w_dw = OutMove(d.wei, user_t, s.wei_tag(), p.bwd_w_pd.diff_weights_desc());
    p.bwd_w_ok = true;
  } catch (const dnnl::error&) {
    p.bwd_w_ok = false;
  }
  return p.bwd_w_ok;
}

void* scratchpad(const dnnl::primitive_desc_base& pd) {
  return workspace(WorkspaceSlot::OnednnScratchpad, std::max<size_t>(pd.scratchpad_desc().get_size(), 64));
}

[[noreturn]] void fail(const dnnl::error& e, const char* what) {
  throw Error(str_cat("oneDNN ", what, " failed: ", e.what()));
}

Setup setup_of(const TensorRef& x, const TensorRef& w) {
  return Setup{x.dtype(), x.nhwc(), w.nhwc()};
}

// The bias as the primitives read it: float32 (a bfloat16 bias widened, exactly).
const float* bias_f32(const TensorRef& b) {
  if (b.dtype() == DType::F32) return b.data<float>();
  static thread_local std::vector<float> widened;
  const bf16* src = b.data<bf16>();
  widened.resize(size_t(b.numel()));
  for (int64_t i = 0; i < b.numel(); ++i) widened[size_t(i)] = float(src[i]);
  return widened.data();
}

}  // namespace

// Whether oneDNN has a bfloat16 convolution for this CPU: a small one is made once.
bool onednn_bf16_supported() {
  static const bool ok = [] {
    try {
      const memory::dims src{1, 16, 8, 8}, wei{16, 16, 3, 3}, dst{1, 16, 8, 8}, st{1, 1}, pad{1, 1};
      dnnl::convolution_forward::desc desc(
          dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
          memory::desc(src, dtype::bf16, tag::any), memory::desc(wei, dtype::bf16, tag::any),
          memory::desc(), memory::desc(dst, dtype::f32, tag::any), st, pad, pad);
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
  return str_cat("oneDNN ", v->major, ".", v->minor, ".", v->patch, " (", isa, ")");
}

bool onednn_conv2d_forward(const TensorRef& x, const TensorRef& w, const TensorRef& b,
                           const TensorRef& y, const ConvGeometry& g) {
  Plan& p = plan_for(g, b.defined(), setup_of(x, w));
  if (!p.ok) return false;
  try {
    Out dst(p.fwd_dst, y.raw(), y.dtype(), 0, WorkspaceSlot::OnednnDst);
    const auto& e = cpu_engine();
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, memory(p.fwd_pd.src_desc(), e, p.fwd_src.in(x.raw(), WorkspaceSlot::OnednnSrc))},
        {DNNL_ARG_WEIGHTS,
         memory(p.fwd_pd.weights_desc(), e, p.fwd_w.in(w.raw(), WorkspaceSlot::OnednnWeights))},
        {DNNL_ARG_DST, memory(p.fwd_pd.dst_desc(), e, dst.target)},
        {DNNL_ARG_SCRATCHPAD, memory(p.fwd_pd.scratchpad_desc(), e, scratchpad(p.fwd_pd))}};
    if (b.defined())
      args.emplace(DNNL_ARG_BIAS, memory(p.fwd_pd.bias_desc(), e, const_cast<float*>(bias_f32(b))));
    p.fwd.execute(cpu_stream(), args);
    dst.finish();
  } catch (const dnnl::error& err) {
    fail(err, "convolution forward");
  }
  return true;
}

bool onednn_conv2d_backward(const TensorRef& gy, const TensorRef& x, const TensorRef& w,
                            const TensorRef& gx, double beta_x, const TensorRef& gw,
                            double beta_w, const ConvGeometry& g) {
  Plan& p = plan_for(g, false, setup_of(x, w));
  // Every needed direction must have a kernel before anything is written: the caller's other
  // path then computes both gradients.
  BackwardData* bd = nullptr;
  if (gx.defined()) {
    bd = &backward_data(p, g, gx.dtype() == DType::BF16 && beta_x != 0 ? 1 : 0);
    if (!bd->ok) return false;
  }
  if (gw.defined() && !backward_weights(p, g)) return false;
  const auto& e = cpu_engine();
  try {
    void* dy_d = nullptr;
    if (bd) {
      dy_d = bd->dy.in(gy.raw(), WorkspaceSlot::OnednnDiffDst);
      Out dx(bd->dx, gx.raw(), gx.dtype(), beta_x, WorkspaceSlot::OnednnDst);
      bd->prim.execute(
          cpu_stream(),
          {{DNNL_ARG_DIFF_DST, memory(bd->pd.diff_dst_desc(), e, dy_d)},
           {DNNL_ARG_WEIGHTS,
            memory(bd->pd.weights_desc(), e, bd->w.in(w.raw(), WorkspaceSlot::OnednnWeights))},
           {DNNL_ARG_DIFF_SRC, memory(bd->pd.diff_src_desc(), e, dx.target)},
           {DNNL_ARG_SCRATCHPAD, memory(bd->pd.scratchpad_desc(), e, scratchpad(bd->pd))}});
      dx.finish();
    }
    if (gw.defined()) {
      // Both backward primitives may read dY in one layout: reordered once.
      const bool share_dy = bd && bd->pd.diff_dst_desc() == p.bwd_w_pd.diff_dst_desc();
      void* dy_w = share_dy ? dy_d : p.bwd_w_dy.in(gy.raw(), WorkspaceSlot::OnednnDiffDst);
      Out dw(p.bwd_w_dw, gw.raw(), gw.dtype(), beta_w, WorkspaceSlot::OnednnWeights);
      p.bwd_w.execute(
          cpu_stream(),
          {{DNNL_ARG_DIFF_DST, memory(p.bwd_w_pd.diff_dst_desc(), e, dy_w)},
           {DNNL_ARG_SRC, memory(p.bwd_w_pd.src_desc(), e, p.bwd_w_x.in(x.raw(), WorkspaceSlot::OnednnSrc))},
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
