#include "engine/checkpoint.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>

namespace unetcu {
namespace {

constexpr uint64_t kMaxHeaderBytes = uint64_t(100) << 20;
// Ranges of what a checkpoint may say about a run: anything outside is damage, not a run.
constexpr int64_t kMaxEpoch = 10000000;
constexpr int64_t kMaxStep = int64_t(1) << 40;
// The longest key or value of a run record (engine/checkpoint.h RunRecord).
constexpr size_t kMaxRunText = 64;
constexpr size_t kMaxSettingText = size_t(1) << 16;  // a setting's value: 256 class names fit
constexpr int64_t kMaxCounter = int64_t(1) << 50;

size_t dtype_bytes(const std::string& d) {
  if (d == "F32") return 4;
  if (d == "F64" || d == "I64") return 8;
  return 0;
}

std::string st_dtype(DType d) { return d == DType::F32 ? "F32" : "F64"; }

[[noreturn]] void bad(const std::string& file, const std::string& why) {
  throw Error("checkpoint '" + file + "': " + why);
}

// 64-bit FNV-1a of a tensor's bytes: stored in the metadata as "checksum.<name>", so a flipped
// bit or shifted data is found and the damaged tensor named.
std::string checksum(const std::vector<char>& bytes) {
  // FNV-1a over 8-byte little-endian words (then the tail bytes): a 100 MB model in ~0.05 s.
  uint64_t h = 1469598103934665603ull;
  const size_t words = bytes.size() / 8;
  for (size_t i = 0; i < words; ++i) {
    uint64_t w;
    std::memcpy(&w, bytes.data() + 8 * i, 8);
    h ^= w;
    h *= 1099511628211ull;
  }
  for (size_t i = words * 8; i < bytes.size(); ++i) {
    h ^= static_cast<unsigned char>(bytes[i]);
    h *= 1099511628211ull;
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

// Opens a regular file for reading; a FIFO, device or folder is refused before it is opened,
// so nothing blocks on it or reads it without end.
std::ifstream open_regular(const std::string& path, uint64_t* size) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) bad(path, "cannot be opened (no such file)");
  if (!S_ISREG(st.st_mode)) bad(path, "is not a regular file");
  std::ifstream f(path, std::ios::binary);
  if (!f) bad(path, "cannot be opened");
  *size = uint64_t(st.st_size);
  return f;
}

// Writes the file to `path + ".tmp"` and flushes it to the disk; the caller renames it.
void write_safetensors_tmp(const std::string& path, const SafeTensors& tensors,
                           std::map<std::string, std::string> metadata) {
  for (const auto& [name, t] : tensors)
    if (!metadata.count("checksum." + name)) metadata["checksum." + name] = checksum(t.data);
  nlohmann::json header = nlohmann::json::object();
  header["__metadata__"] = metadata;
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

SafeTensors read_safetensors(const std::string& path, std::map<std::string, std::string>* metadata) {
  uint64_t file_size = 0;
  std::ifstream f = open_regular(path, &file_size);
  // The header length and the header first; then only the byte ranges the header declares.
  if (file_size < 8) bad(path, "too short to hold a safetensors header");
  unsigned char len[8];
  f.read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(len[i]) << (8 * i);
  if (!f || n > kMaxHeaderBytes || n > file_size - 8)
    bad(path, "header length " + std::to_string(n) + " runs past the end of the file (" +
                  std::to_string(file_size) + " bytes): truncated or not safetensors");
  std::string text(n, '\0');
  f.read(text.data(), std::streamsize(n));
  if (!f) bad(path, "cannot read its header");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    bad(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) bad(path, "header is not a JSON object");
  const uint64_t data_begin = 8 + n, data_size = file_size - data_begin;
  std::map<std::string, std::string> meta;
  struct Range {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Range> ranges;
  SafeTensors out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const auto& e = it.value();
    if (name == "__metadata__") {
      if (!e.is_object()) bad(path, "__metadata__ is not an object");
      for (auto m = e.begin(); m != e.end(); ++m)
        if (m.value().is_string()) meta[m.key()] = m.value().get<std::string>();
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
    if (e["shape"].size() > 8) bad(path, "entry '" + name + "' has too many dimensions");
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
    ranges.push_back({b, end, name});
    out.emplace(name, std::move(t));
  }
  // The entries tile the data section exactly: no overlap, no gap, nothing after the last
  // (a header length that is off shifts every range and ends here).
  std::sort(ranges.begin(), ranges.end(), [](const Range& x, const Range& y) {
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  uint64_t at = 0;
  for (const Range& r : ranges) {
    if (r.begin < at) bad(path, "entry '" + r.name + "' overlaps another entry's bytes");
    if (r.begin > at) bad(path, "the bytes before entry '" + r.name + "' belong to no entry");
    at = r.end;
  }
  if (at != data_size)
    bad(path, "its entries cover " + std::to_string(at) + " of the " + std::to_string(data_size) +
                  " data bytes: the header length or the offsets are wrong");
  const bool checked = std::any_of(meta.begin(), meta.end(), [](const auto& m) {
    return m.first.rfind("checksum.", 0) == 0;
  });
  for (const Range& r : ranges) {  // in file order
    SafeTensor& t = out.at(r.name);
    t.data.resize(r.end - r.begin);
    f.seekg(std::streamoff(data_begin + r.begin));
    f.read(t.data.data(), std::streamsize(t.data.size()));
    if (!f) bad(path, "cannot read entry '" + r.name + "'");
    if (checked) {
      auto c = meta.find("checksum." + r.name);
      if (c == meta.end()) bad(path, "has no checksum for entry '" + r.name + "'");
      if (c->second != checksum(t.data))
        bad(path, "entry '" + r.name + "' is damaged (its bytes do not match their checksum)");
    }
  }
  if (metadata) *metadata = std::move(meta);
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

namespace {

int64_t read_i64(const SafeTensor& t) {
  int64_t v = 0;
  std::memcpy(&v, t.data.data(), 8);
  return v;
}

bool all_finite(const SafeTensor& t) {
  const size_t n = t.data.size() / dtype_bytes(t.dtype);
  if (t.dtype == "F32") {
    for (size_t i = 0; i < n; ++i) {
      float v;
      std::memcpy(&v, t.data.data() + 4 * i, 4);
      if (!std::isfinite(v)) return false;
    }
  } else if (t.dtype == "F64") {
    for (size_t i = 0; i < n; ++i) {
      double v;
      std::memcpy(&v, t.data.data() + 8 * i, 8);
      if (!std::isfinite(v)) return false;
    }
  }
  return true;
}

Tensor host_tensor(const SafeTensor& t) {
  const Tensor src = Tensor::empty(t.shape, t.dtype == "F32" ? DType::F32 : DType::F64);
  std::memcpy(src.raw(), t.data.data(), t.data.size());
  return src;
}

}  // namespace

void load_model_state(Module& model, const SafeTensors& tensors, const std::string& file,
                      const std::string& prefix) {
  const auto state = model.state();
  // Everything is checked before anything is written: a bad file leaves the model as it was.
  std::vector<std::pair<const StateEntry*, const SafeTensor*>> plan;
  for (const StateEntry& e : state) {
    if (!prefix.empty() && e.name.rfind(prefix, 0) != 0) continue;
    auto it = tensors.find(e.name);
    if (it == tensors.end()) bad(file, "has no entry '" + e.name + "' that the model needs");
    const SafeTensor& t = it->second;
    if (e.counter) {
      if (t.dtype != "I64" || !t.shape.empty()) bad(file, "entry '" + e.name + "' should be an int64 scalar");
      const int64_t v = read_i64(t);
      if (v < 0 || v > kMaxCounter) bad(file, "entry '" + e.name + "' holds an impossible count " + std::to_string(v));
    } else {
      if (t.shape != e.tensor.shape())
        bad(file, "entry '" + e.name + "' has shape " + shape_str(t.shape) + ", the model expects " +
                      shape_str(e.tensor.shape()));
      if (t.dtype != "F32" && t.dtype != "F64") bad(file, "entry '" + e.name + "' is not floating point");
      if (!all_finite(t)) bad(file, "entry '" + e.name + "' holds values that are not finite");
    }
    plan.emplace_back(&e, &t);
  }
  if (prefix.empty() && plan.size() != tensors.size())
    for (const auto& [name, t] : tensors) {
      bool known = false;
      for (const StateEntry& e : state) known = known || e.name == name;
      if (!known) bad(file, "has entry '" + name + "' that the model does not have");
    }
  if (!prefix.empty() && plan.empty()) bad(file, "has no entries starting with '" + prefix + "'");
  for (const auto& [e, t] : plan) {
    if (e->counter) {
      *e->counter = read_i64(*t);
    } else {
      Tensor dst = e->tensor;
      dst.copy_(host_tensor(*t));  // converts dtype, moves to the model's device
    }
  }
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

std::function<void(int)>& save_hook() {
  static std::function<void(int)> hook;
  return hook;
}
void reached(int stage) {
  if (save_hook()) save_hook()(stage);
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// The metadata value `key` of a checkpoint's model or .train file, checked to be a whole number
// in [lo, hi].
int64_t meta_int(const std::map<std::string, std::string>& meta, const std::string& key,
                 const std::string& file, int64_t lo, int64_t hi, bool required) {
  auto it = meta.find(key);
  if (it == meta.end()) {
    if (required) bad(file, "has no " + key + " in its metadata");
    return lo;
  }
  const std::string& v = it->second;
  if (v.empty() || v.size() > 18 || !std::all_of(v.begin() + (v[0] == '-'), v.end(), ::isdigit) ||
      v == "-")
    bad(file, "has a " + key + " that is not a number: '" + v + "'");
  const int64_t x = std::stoll(v);
  if (x < lo || x > hi)
    bad(file, "has " + key + " " + v + ", outside " + std::to_string(lo) + ".." + std::to_string(hi));
  return x;
}

}  // namespace

void set_checkpoint_save_hook(std::function<void(int)> hook) { save_hook() = std::move(hook); }

CheckpointSettings read_checkpoint_settings(const std::string& path) {
  std::map<std::string, std::string> meta;
  read_safetensors(path, &meta);
  CheckpointSettings out;
  for (const auto& [key, value] : meta)
    if (key != "format" && key != "producer" && key != "epoch" && key != "step" && key != "save_id" &&
        key.rfind("checksum.", 0) != 0)
      out[key] = value;
  return out;
}

void save_checkpoint(const std::string& path, const Module& model,
                     const std::vector<Optimizer*>& optimizers, int epoch, int64_t step,
                     const RunRecord& run, const CheckpointSettings& settings) {
  for (const auto& [key, value] : settings)
    UNETCU_CHECK(key != "format" && key != "producer" && key != "epoch" && key != "step" && key != "save_id" &&
                     key.rfind("checksum.", 0) != 0 && !key.empty() && key.size() <= kMaxRunText &&
                     value.size() <= kMaxSettingText,
                 "checkpoint: setting '", key, "' is reserved, empty or too long");
  UNETCU_CHECK(epoch >= 0 && epoch <= kMaxEpoch && step >= 0 && step <= kMaxStep,
               "checkpoint: epoch ", epoch, " step ", step, " out of range");
  for (const auto& [key, value] : run)
    UNETCU_CHECK(!key.empty() && key.size() <= kMaxRunText && value.size() <= kMaxRunText,
                 "checkpoint: run value '", key, "' is empty or too long");
  // Both files are written in full (to .tmp) before either replaces its predecessor; the
  // .train file goes first. Both carry the epoch, the step and a save id: a reader that finds
  // the new .train beside the old model (a crash between the renames) rolls the model forward
  // from its .tmp, which is complete and carries the same id.
  const std::string ep = std::to_string(epoch), st = std::to_string(step);
  // The save id is a checksum of what is saved (the model's tensors, the epoch and the step),
  // so the same run writes the same bytes every time (resume is compared byte for byte).
  const SafeTensors model_tensors = model_state(model);
  std::map<std::string, std::string> model_meta{
      {"format", "pt"}, {"producer", "unetcu"}, {"epoch", ep}, {"step", st}};
  std::string all = ep + "/" + st;
  for (const auto& [name, t] : model_tensors) {
    const std::string c = checksum(t.data);
    model_meta["checksum." + name] = c;
    all += name + c;
  }
  const std::string id = checksum(std::vector<char>(all.begin(), all.end()));
  model_meta["save_id"] = id;
  for (const auto& [key, value] : settings) model_meta[key] = value;
  write_safetensors_tmp(path, model_tensors, model_meta);
  reached(1);
  SafeTensors train;
  std::map<std::string, std::string> meta{
      {"epoch", ep}, {"step", st}, {"producer", "unetcu"}, {"save_id", id}};
  for (const auto& [key, value] : run) meta["run." + key] = value;
  for (Optimizer* opt : optimizers) {
    const std::vector<std::string> names = optimizer_param_names(model, *opt);
    const std::string kind = opt->kind();
    meta["optimizer"] = kind;
    for (size_t i = 0; i < names.size(); ++i) {
      const Optimizer::ParamState ps = opt->param_state(i);
      for (const auto& [stat, tensor] : ps.tensors)
        train.emplace(kind + "." + stat + "." + names[i], to_safetensor(tensor));
      for (const auto& [stat, counter] : ps.counters) {
        SafeTensor t{"I64", {}, std::vector<char>(8)};
        std::memcpy(t.data.data(), counter, 8);
        train.emplace(kind + "." + stat + "." + names[i], std::move(t));
      }
    }
  }
  write_safetensors_tmp(path + ".train", train, meta);
  reached(2);
  commit(path + ".train");
  reached(3);
  commit(path);
  reached(4);
}

int load_checkpoint(const std::string& path, Module& model,
                    const std::vector<Optimizer*>& optimizers, int64_t* step_out, RunRecord* run_out) {
  const std::string train_path = path + ".train";
  std::map<std::string, std::string> model_meta, meta;
  SafeTensors model_file = read_safetensors(path, &model_meta);
  if (run_out) run_out->clear();
  if (!exists(train_path)) {
    load_model_state(model, model_file, path);
    if (step_out) *step_out = 0;
    return 0;
  }
  const SafeTensors train = read_safetensors(train_path, &meta);
  const int epoch = int(meta_int(meta, "epoch", train_path, 0, kMaxEpoch, true));
  const int64_t step = meta_int(meta, "step", train_path, 0, kMaxStep, false);
  if (model_meta.count("save_id") && meta.count("save_id") && model_meta["save_id"] != meta["save_id"]) {
    // A save stopped between its two renames: the new .train is in place, the new model is
    // still complete in path.tmp. Roll it forward.
    std::map<std::string, std::string> tmp_meta;
    SafeTensors tmp;
    bool usable = false;
    if (exists(path + ".tmp")) {
      try {
        tmp = read_safetensors(path + ".tmp", &tmp_meta);
        usable = tmp_meta.count("save_id") && tmp_meta["save_id"] == meta["save_id"];
      } catch (const Error&) {
        usable = false;
      }
    }
    if (!usable)
      bad(train_path, "is from epoch " + meta["epoch"] + " but the model file from epoch " +
                          model_meta["epoch"] + " (an interrupted save?), and no complete model "
                          "from that save was found");
    if (std::rename((path + ".tmp").c_str(), path.c_str()) != 0)
      bad(path, "cannot complete the interrupted save (rename failed)");
    model_file = std::move(tmp);
    model_meta = std::move(tmp_meta);
  }
  if (model_meta.count("epoch") && model_meta["epoch"] != meta["epoch"])
    bad(train_path, "is from epoch " + meta["epoch"] + " but the model file from epoch " +
                        model_meta["epoch"] + " (an interrupted save?)");
  RunRecord run;
  for (const auto& [key, value] : meta)
    if (key.rfind("run.", 0) == 0) {
      if (key.size() == 4 || key.size() > 4 + kMaxRunText || value.size() > kMaxRunText)
        bad(train_path, "has a run value '" + key.substr(0, 40) + "' that is empty or too long");
      run[key.substr(4)] = value;
    }
  // Check the optimizer state completely before writing anything.
  struct Write {
    Tensor dst;
    const SafeTensor* src;
    int64_t* counter;
  };
  std::vector<Write> writes;
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
      const Optimizer::ParamState ps = opt->param_state(i);
      for (const auto& [stat, tensor] : ps.tensors) {
        const std::string key = kind + "." + stat + "." + names[i];
        auto it = train.find(key);
        if (it == train.end()) bad(train_path, "has no optimizer entry '" + key + "'");
        if (it->second.shape != tensor.shape() || it->second.dtype != st_dtype(tensor.dtype()))
          bad(train_path, "optimizer entry '" + key + "' has shape " + shape_str(it->second.shape) +
                              " " + it->second.dtype + ", the parameter " + shape_str(tensor.shape()) +
                              " " + st_dtype(tensor.dtype()));
        if (!all_finite(it->second)) bad(train_path, "optimizer entry '" + key + "' holds values that are not finite");
        writes.push_back({tensor, &it->second, nullptr});
      }
      for (const auto& [stat, counter] : ps.counters) {
        const std::string key = kind + "." + stat + "." + names[i];
        auto it = train.find(key);
        if (it == train.end() || it->second.dtype != "I64" || !it->second.shape.empty())
          bad(train_path, "has no optimizer counter '" + key + "'");
        const int64_t v = read_i64(it->second);
        if (v < 0 || v > kMaxCounter) bad(train_path, "optimizer counter '" + key + "' holds an impossible " + std::to_string(v));
        writes.push_back({Tensor(), &it->second, counter});
      }
    }
  }
  load_model_state(model, model_file, path);
  for (Write& w : writes) {
    if (w.counter)
      *w.counter = read_i64(*w.src);
    else
      w.dst.copy_(host_tensor(*w.src));
  }
  if (step_out) *step_out = step;
  if (run_out) *run_out = std::move(run);
  return epoch;
}

}  // namespace unetcu
