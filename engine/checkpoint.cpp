#include "engine/checkpoint.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>

namespace unetcu {
namespace {

constexpr uint64_t kMaxHeaderBytes = uint64_t(100) << 20;

size_t dtype_bytes(const std::string& d) {
  if (d == "F32") return 4;
  if (d == "F64" || d == "I64") return 8;
  return 0;
}

std::string st_dtype(DType d) { return d == DType::F32 ? "F32" : "F64"; }

[[noreturn]] void bad(const std::string& file, const std::string& why) {
  throw Error("checkpoint '" + file + "': " + why);
}

}  // namespace

namespace {
// Writes the file to `path + ".tmp"` and flushes it to the disk; the caller renames it.
void write_safetensors_tmp(const std::string& path, const SafeTensors& tensors,
                           const std::map<std::string, std::string>& metadata);
void commit(const std::string& path) {
  if (std::rename((path + ".tmp").c_str(), path.c_str()) != 0) {
    std::remove((path + ".tmp").c_str());
    throw Error("cannot write checkpoint '" + path + "'");
  }
}
}  // namespace

void write_safetensors(const std::string& path, const SafeTensors& tensors,
                       const std::map<std::string, std::string>& metadata) {
  write_safetensors_tmp(path, tensors, metadata);
  commit(path);
}

namespace {
void write_safetensors_tmp(const std::string& path, const SafeTensors& tensors,
                           const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {  // std::map: names in sorted order, as safetensors
    header[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string text = header.dump();
  while (text.size() % 8) text += ' ';  // keeps the data 8-byte aligned
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw Error("cannot write checkpoint '" + path + "'");
    const uint64_t n = text.size();
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = (n >> (8 * i)) & 0xFF;  // little-endian
    f.write(reinterpret_cast<const char*>(len), 8);
    f.write(text.data(), std::streamsize(text.size()));
    for (const auto& [name, t] : tensors) f.write(t.data.data(), std::streamsize(t.data.size()));
    f.flush();
    if (!f) {
      f.close();
      std::remove(tmp.c_str());
      throw Error("cannot write checkpoint '" + path + "' (disk full?)");
    }
  }
  // On the disk before the rename, so a power cut leaves the old file or the new one.
  const int fd = ::open(tmp.c_str(), O_RDONLY);
  const bool synced = fd >= 0 && ::fsync(fd) == 0;
  if (fd >= 0) ::close(fd);
  if (!synced) {
    std::remove(tmp.c_str());
    throw Error("cannot write checkpoint '" + path + "' (fsync failed)");
  }
}
}  // namespace

SafeTensors read_safetensors(const std::string& path, std::map<std::string, std::string>* metadata) {
  std::ifstream f(path, std::ios::binary);
  if (!f) bad(path, "cannot be opened");
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (bytes.size() < 8) bad(path, "too short to hold a safetensors header");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(static_cast<unsigned char>(bytes[i])) << (8 * i);
  if (n > kMaxHeaderBytes || n > bytes.size() - 8)
    bad(path, "header length " + std::to_string(n) + " runs past the end of the file (" +
                  std::to_string(bytes.size()) + " bytes): truncated or not safetensors");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + std::ptrdiff_t(n));
  } catch (const std::exception& e) {
    bad(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) bad(path, "header is not a JSON object");
  const uint64_t data_begin = 8 + n, data_size = bytes.size() - data_begin;
  SafeTensors out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const auto& e = it.value();
    if (name == "__metadata__") {
      if (!e.is_object()) bad(path, "__metadata__ is not an object");
      if (metadata)
        for (auto m = e.begin(); m != e.end(); ++m)
          if (m.value().is_string()) (*metadata)[m.key()] = m.value().get<std::string>();
      continue;
    }
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets") ||
        !e["dtype"].is_string() || !e["shape"].is_array() || !e["data_offsets"].is_array() ||
        e["data_offsets"].size() != 2)
      bad(path, "entry '" + name + "' lacks a dtype, shape or data_offsets");
    SafeTensor t;
    t.dtype = e["dtype"].get<std::string>();
    const size_t es = dtype_bytes(t.dtype);
    if (!es) bad(path, "entry '" + name + "' has unsupported dtype " + t.dtype);
    uint64_t count = 1;
    constexpr uint64_t kMaxElements = uint64_t(1) << 40;
    for (const auto& d : e["shape"]) {
      if (!d.is_number_unsigned()) bad(path, "entry '" + name + "' has a bad dimension");
      const uint64_t v = d.get<uint64_t>();
      if (v != 0 && count > kMaxElements / v)  // checked before multiplying: no wrap-around
        bad(path, "entry '" + name + "' is impossibly large");
      t.shape.push_back(int64_t(v));
      count *= v;
    }
    if (!e["data_offsets"][0].is_number_unsigned() || !e["data_offsets"][1].is_number_unsigned())
      bad(path, "entry '" + name + "' has bad data_offsets");
    const uint64_t b = e["data_offsets"][0].get<uint64_t>(), end = e["data_offsets"][1].get<uint64_t>();
    if (b > end || end > data_size)
      bad(path, "entry '" + name + "' reads bytes [" + std::to_string(b) + ", " + std::to_string(end) +
                    ") of a " + std::to_string(data_size) + "-byte data section: truncated or corrupt");
    if (end - b != count * es)
      bad(path, "entry '" + name + "' has " + std::to_string(end - b) + " bytes for " +
                    std::to_string(count) + " " + t.dtype + " values");
    t.data.assign(bytes.begin() + std::ptrdiff_t(data_begin + b), bytes.begin() + std::ptrdiff_t(data_begin + end));
    out.emplace(name, std::move(t));
  }
  return out;
}

SafeTensors model_state(const Module& model) {
  SafeTensors out;
  for (const StateEntry& e : model.state()) {
    SafeTensor t;
    if (e.counter) {
      t.dtype = "I64";
      t.data.resize(8);
      std::memcpy(t.data.data(), e.counter, 8);
    } else {
      const Tensor host = e.tensor.device().is_cpu() ? e.tensor : e.tensor.to(Device::cpu());
      t.dtype = st_dtype(host.dtype());
      t.shape = host.shape();
      t.data.resize(host.nbytes());
      std::memcpy(t.data.data(), host.raw(), host.nbytes());
    }
    out.emplace(e.name, std::move(t));
  }
  return out;
}

void load_model_state(Module& model, const SafeTensors& tensors, const std::string& file,
                      const std::string& prefix) {
  const auto state = model.state();
  size_t used = 0;
  for (const StateEntry& e : state) {
    if (!prefix.empty() && e.name.rfind(prefix, 0) != 0) continue;
    auto it = tensors.find(e.name);
    if (it == tensors.end()) bad(file, "has no entry '" + e.name + "' that the model needs");
    const SafeTensor& t = it->second;
    ++used;
    if (e.counter) {
      if (t.dtype != "I64" || !t.shape.empty()) bad(file, "entry '" + e.name + "' should be an int64 scalar");
      std::memcpy(e.counter, t.data.data(), 8);
      continue;
    }
    Tensor dst = e.tensor;
    if (t.shape != dst.shape())
      bad(file, "entry '" + e.name + "' has shape " + shape_str(t.shape) + ", the model expects " +
                    shape_str(dst.shape()));
    if (t.dtype != "F32" && t.dtype != "F64") bad(file, "entry '" + e.name + "' is not floating point");
    const Tensor src = Tensor::empty(t.shape, t.dtype == "F32" ? DType::F32 : DType::F64);
    std::memcpy(src.raw(), t.data.data(), t.data.size());
    dst.copy_(src);  // converts dtype, moves to the model's device
  }
  if (prefix.empty() && used != tensors.size())
    for (const auto& [name, t] : tensors) {
      bool known = false;
      for (const StateEntry& e : state) known = known || e.name == name;
      if (!known) bad(file, "has entry '" + name + "' that the model does not have");
    }
  if (!prefix.empty() && used == 0) bad(file, "has no entries starting with '" + prefix + "'");
}

namespace {

// Each optimizer parameter's name in the model: the tensors are the model's own parameters.
std::vector<std::string> optimizer_param_names(const Module& model, const Optimizer& opt) {
  std::map<const TensorImpl*, std::string> names;
  for (const auto& [name, t] : model.named_parameters()) names[t.impl_ptr().get()] = name;
  std::vector<std::string> out;
  for (const Tensor& p : opt.params()) {
    auto it = names.find(p.impl_ptr().get());
    UNETCU_CHECK(it != names.end(), "checkpoint: the optimizer holds a tensor of shape ",
                 shape_str(p.shape()), " that is not a parameter of the model");
    out.push_back(it->second);
  }
  return out;
}

SafeTensor to_safetensor(const Tensor& tensor) {
  const Tensor host = tensor.device().is_cpu() ? tensor : tensor.to(Device::cpu());
  SafeTensor t{st_dtype(host.dtype()), host.shape(), std::vector<char>(host.nbytes())};
  std::memcpy(t.data.data(), host.raw(), host.nbytes());
  return t;
}

}  // namespace

void save_checkpoint(const std::string& path, const Module& model,
                     const std::vector<Optimizer*>& optimizers, int epoch) {
  // Both files are written in full before either replaces its predecessor, and both carry the
  // epoch, so a crash between the two renames is detected when resuming.
  const std::string ep = std::to_string(epoch);
  write_safetensors_tmp(path, model_state(model), {{"format", "pt"}, {"producer", "unetcu"}, {"epoch", ep}});
  SafeTensors train;
  std::map<std::string, std::string> meta{{"epoch", ep}, {"producer", "unetcu"}};
  for (Optimizer* opt : optimizers) {
    const std::vector<std::string> names = optimizer_param_names(model, *opt);
    const std::string kind = opt->kind();
    meta["optimizer"] = kind;
    for (size_t i = 0; i < names.size(); ++i) {
      const Optimizer::ParamState st = opt->param_state(i);
      for (const auto& [stat, tensor] : st.tensors)
        train.emplace(kind + "." + stat + "." + names[i], to_safetensor(tensor));
      for (const auto& [stat, counter] : st.counters) {
        SafeTensor t{"I64", {}, std::vector<char>(8)};
        std::memcpy(t.data.data(), counter, 8);
        train.emplace(kind + "." + stat + "." + names[i], std::move(t));
      }
    }
  }
  write_safetensors_tmp(path + ".train", train, meta);
  commit(path + ".train");
  commit(path);
}

int load_checkpoint(const std::string& path, Module& model,
                    const std::vector<Optimizer*>& optimizers) {
  std::map<std::string, std::string> model_meta;
  load_model_state(model, read_safetensors(path, &model_meta), path);
  const std::string train_path = path + ".train";
  std::ifstream probe(train_path);
  if (!probe) return 0;
  std::map<std::string, std::string> meta;
  const SafeTensors train = read_safetensors(train_path, &meta);
  int epoch = 0;
  try {
    epoch = std::stoi(meta.at("epoch"));
  } catch (const std::exception&) {
    bad(train_path, "has no epoch in its metadata");
  }
  if (model_meta.count("epoch") && model_meta["epoch"] != meta["epoch"])
    bad(train_path, "is from epoch " + meta["epoch"] + " but the model file from epoch " +
                        model_meta["epoch"] + " (an interrupted save?)");
  for (Optimizer* opt : optimizers) {
    const std::string kind = opt->kind();
    if (!meta.count("optimizer")) {
      for (const auto& [key, t] : train)
        if (key.rfind(kind + ".", 0) == 0 && std::isdigit(static_cast<unsigned char>(key.back())))
          bad(train_path, "keeps the optimizer state by parameter position (an older format) and "
                          "cannot resume; load its model file's weights only");
      bad(train_path, "holds no optimizer state; this run uses " + kind);
    }
    if (meta["optimizer"] != kind)
      bad(train_path, "holds " + meta["optimizer"] + " state; this run uses " + kind);
    const std::vector<std::string> names = optimizer_param_names(model, *opt);
    for (size_t i = 0; i < names.size(); ++i) {
      const Optimizer::ParamState st = opt->param_state(i);
      for (const auto& [stat, tensor] : st.tensors) {
        const std::string key = kind + "." + stat + "." + names[i];
        auto it = train.find(key);
        if (it == train.end()) bad(train_path, "has no optimizer entry '" + key + "'");
        if (it->second.shape != tensor.shape() || it->second.dtype != st_dtype(tensor.dtype()))
          bad(train_path, "optimizer entry '" + key + "' has shape " + shape_str(it->second.shape) +
                              " " + it->second.dtype + ", the parameter " + shape_str(tensor.shape()) +
                              " " + st_dtype(tensor.dtype()));
        Tensor src = Tensor::empty(tensor.shape(), tensor.dtype());
        std::memcpy(src.raw(), it->second.data.data(), it->second.data.size());
        Tensor dst = tensor;
        dst.copy_(src);
      }
      for (const auto& [stat, counter] : st.counters) {
        const std::string key = kind + "." + stat + "." + names[i];
        auto it = train.find(key);
        if (it == train.end() || it->second.dtype != "I64" || !it->second.shape.empty())
          bad(train_path, "has no optimizer counter '" + key + "'");
        std::memcpy(counter, it->second.data.data(), 8);
      }
    }
  }
  return epoch;
}

}  // namespace unetcu
