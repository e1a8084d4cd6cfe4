#include "engine/checkpoint.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

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

void save_checkpoint(const std::string& path, const Module& model, const Optimizer* optimizer,
                     int epoch) {
  // Both files are written in full before either replaces its predecessor, and both carry the
  // epoch, so a crash between the two renames is detected when resuming.
  const std::string ep = std::to_string(epoch);
  write_safetensors_tmp(path, model_state(model), {{"format", "pt"}, {"producer", "unetcu"}, {"epoch", ep}});
  SafeTensors train;
  if (optimizer) {
    auto* opt = const_cast<Optimizer*>(optimizer);  // counters are read, not changed
    for (const auto& [name, tensor] : optimizer->state_tensors()) {
      const Tensor host = tensor.device().is_cpu() ? tensor : tensor.to(Device::cpu());
      SafeTensor t{st_dtype(host.dtype()), host.shape(), std::vector<char>(host.nbytes())};
      std::memcpy(t.data.data(), host.raw(), host.nbytes());
      train.emplace(name, std::move(t));
    }
    for (const auto& [name, counter] : opt->state_counters()) {
      SafeTensor t{"I64", {}, std::vector<char>(8)};
      std::memcpy(t.data.data(), counter, 8);
      train.emplace(name, std::move(t));
    }
  }
  write_safetensors_tmp(path + ".train", train, {{"epoch", ep}, {"producer", "unetcu"}});
  commit(path + ".train");
  commit(path);
}

int load_checkpoint(const std::string& path, Module& model, Optimizer* optimizer) {
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
  if (optimizer) {
    for (const auto& [name, tensor] : optimizer->state_tensors()) {
      auto it = train.find(name);
      if (it == train.end()) bad(train_path, "has no optimizer entry '" + name + "' (another optimizer?)");
      if (it->second.shape != tensor.shape() || it->second.dtype != st_dtype(tensor.dtype()))
        bad(train_path, "optimizer entry '" + name + "' does not match the model");
      Tensor src = Tensor::empty(tensor.shape(), tensor.dtype());
      std::memcpy(src.raw(), it->second.data.data(), it->second.data.size());
      Tensor dst = tensor;
      dst.copy_(src);
    }
    for (const auto& [name, counter] : optimizer->state_counters()) {
      auto it = train.find(name);
      if (it == train.end() || it->second.dtype != "I64" || !it->second.shape.empty())
        bad(train_path, "has no optimizer counter '" + name + "'");
      std::memcpy(counter, it->second.data.data(), 8);
    }
  }
  return epoch;
}

}  // namespace unetcu
