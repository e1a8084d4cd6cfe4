#include "models/encoder_weights.h"

#include <sys/stat.h>

#include <cstring>
#include <set>

#include "engine/torch_file.h"

namespace unetcu {
namespace {

const std::string kPrefix = "encoder.";

[[noreturn]] void bad(const std::string& file, const std::string& why) {
  throw Error(str_cat("encoder weights '", file, "': ", why));
}

// The depth whose layers the file's names hold (torchvision's names), or "" when none fits.
std::string depth_of(const SafeTensors& t) {
  int blocks[4] = {};
  for (int l = 0; l < 4; ++l)
    while (t.count(str_cat("layer", l + 1, ".", blocks[l], ".conv1.weight"))) ++blocks[l];
  const bool bottleneck = t.count("layer1.0.conv3.weight") > 0;
  for (const auto& e : kEncoderNames) {
    const EncoderSpec& s = encoder_spec(e.value);
    if (s.bottleneck == bottleneck && std::equal(s.blocks, s.blocks + 4, blocks)) return e.name;
  }
  return "";
}

double value_at(const SafeTensor& t, size_t i) {
  if (t.dtype == "F64") {
    double v;
    std::memcpy(&v, t.data.data() + 8 * i, 8);
    return v;
  }
  float v;
  std::memcpy(&v, t.data.data() + 4 * i, 4);
  return v;
}

void set_value(SafeTensor& t, size_t i, double v) {
  if (t.dtype == "F64") {
    std::memcpy(t.data.data() + 8 * i, &v, 8);
  } else {
    const float f = float(v);
    std::memcpy(t.data.data() + 4 * i, &f, 4);
  }
}

}  // namespace

SafeTensor adapt_first_conv(const SafeTensor& w, int in_channels) {
  UNETCU_CHECK(w.shape.size() == 4 && w.shape[1] == 3 && (w.dtype == "F32" || w.dtype == "F64"),
               "the first convolution to adapt is not a float [O, 3, k, k] weight");
  UNETCU_CHECK(in_channels >= 1, "in_channels must be >= 1");
  const int64_t O = w.shape[0], K = w.shape[2] * w.shape[3];
  SafeTensor out{w.dtype, {O, in_channels, w.shape[2], w.shape[3]}, {}};
  out.data.resize(size_t(O * in_channels * K) * (w.dtype == "F64" ? 8 : 4));
  for (int64_t o = 0; o < O; ++o)
    for (int64_t c = 0; c < in_channels; ++c)
      for (int64_t k = 0; k < K; ++k) {
        double v;
        if (in_channels == 1) {  // the sum over the three input channels
          v = 0;
          for (int64_t s = 0; s < 3; ++s) v += value_at(w, size_t((o * 3 + s) * K + k));
        } else {  // channel c takes channel c % 3, scaled by 3 / N
          v = value_at(w, size_t((o * 3 + c % 3) * K + k)) * (3.0 / double(in_channels));
        }
        set_value(out, size_t((o * in_channels + c) * K + k), v);
      }
  return out;
}

SafeTensors read_encoder_weights(const std::string& file, const Module& model) {
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) bad(file, "no such file");
  if (!S_ISREG(st.st_mode)) bad(file, "is not a regular file");
  SafeTensors in = is_torch_file(file) ? read_torch_file(file) : read_safetensors(file);
  // SMP's names (an encoder.* entry) or torchvision's (none): to SMP's, the rest left out.
  bool smp = false;
  for (const auto& [name, t] : in) smp = smp || name.rfind(kPrefix, 0) == 0;
  SafeTensors tv;  // torchvision's names
  for (auto& [name, t] : in) {
    if (smp && name.rfind(kPrefix, 0) == 0) tv.emplace(name.substr(kPrefix.size()), std::move(t));
    if (!smp && name.rfind("fc.", 0) != 0) tv.emplace(name, std::move(t));
  }
  // The model's encoder: its depth from its own names, its input channels from its first
  // convolution.
  const std::vector<StateEntry> state = model.state();
  SafeTensors own;
  int64_t in_channels = 3;
  for (const StateEntry& e : state)
    if (e.name.rfind(kPrefix, 0) == 0) {
      own[e.name.substr(kPrefix.size())];
      if (e.name == "encoder.conv1.weight") in_channels = e.tensor.dim(1);
    }
  const std::string model_depth = depth_of(own);
  const std::string want = setting("encoder") + " " + model_depth;
  // A file of 3 input channels for a model of another count: adapted as SMP does.
  auto conv1 = tv.find("conv1.weight");
  if (conv1 != tv.end() && in_channels != 3 && conv1->second.shape.size() == 4 && conv1->second.shape[1] == 3 &&
      (conv1->second.dtype == "F32" || conv1->second.dtype == "F64"))
    conv1->second = adapt_first_conv(conv1->second, int(in_channels));
  SafeTensors out;
  for (const StateEntry& e : state) {
    if (e.name.rfind(kPrefix, 0) != 0) continue;
    const std::string name = e.name.substr(kPrefix.size());
    const auto it = tv.find(name);
    if (it == tv.end()) {
      if (e.counter) {  // num_batches_tracked: optional, 0 where absent
        SafeTensor zero{"I64", {}, std::vector<char>(8, 0)};
        out.emplace(e.name, zero);
        continue;
      }
      const std::string depth = depth_of(tv);
      bad(file, str_cat("has no tensor '", name, "', which ", want, " needs with shape ", shape_str(e.tensor.shape()),
                        depth.empty() || depth == model_depth
                            ? std::string()
                            : "; its layers are those of " + depth + " (" + setting("encoder") + " " + depth + ")"));
    }
    if (!e.counter && it->second.shape != e.tensor.shape()) {
      const std::string depth = depth_of(tv);
      bad(file, str_cat("tensor '", name, "' has shape ", shape_str(it->second.shape), ", ", want, " needs ",
                        shape_str(e.tensor.shape()),
                        depth.empty() || depth == model_depth
                            ? std::string()
                            : "; its layers are those of " + depth + " (" + setting("encoder") + " " + depth + ")"));
    }
    out.emplace(e.name, it->second);
  }
  return out;
}

void load_encoder_weights(Module& model, const std::string& file) {
  load_model_state(model, read_encoder_weights(file, model), file, kPrefix);
}

}  // namespace unetcu
