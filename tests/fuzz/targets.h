// What each fuzz target does with one input, written once: the libFuzzer programs
// (tests/fuzz/fuzz_*.cpp) and the corpus replay of the ordinary test suite
// (tests/test_corpus.cpp) both call these, so a crash the fuzzer finds is replayed through
// exactly the calls that found it.
//
// Each target writes the bytes to a file in a private scratch directory and goes through the
// project's own readers. A unetcu::Error is an accepted outcome and is thrown on to the caller
// (the fuzzer programs swallow it, the replay counts it); anything else — a crash, a sanitizer
// report, another exception type, a hang — is a finding.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "data/dataset.h"
#include "data/image_io.h"
#include "engine/checkpoint.h"
#include "engine/optim.h"
#include "engine/torch_file.h"
#include "models/unet.h"
#include "runtime/common.h"
#include "train/monitor.h"

// The UBSan options of the fuzz programs, built in so that running one by hand on an input
// reports what tools/fuzz.sh does (UBSAN_OPTIONS still overrides): every report fatal except
// the known third-party ones listed in ubsan_suppressions.txt.
#if defined(UNETCU_SOURCE_DIR)
#define UNETCU_FUZZ_UBSAN_DEFAULTS                                                       \
  extern "C" const char* __ubsan_default_options() {                                    \
    return "halt_on_error=1:print_stacktrace=1:suppressions=" UNETCU_SOURCE_DIR         \
           "/tests/fuzz/ubsan_suppressions.txt";                                        \
  }
#endif

namespace unetcu::fuzz {

// A directory of this process's own (mkdtemp under $TMPDIR or /tmp), removed at exit.
inline const std::string& scratch_dir() {
  struct Dir {
    std::string path;
    Dir() {
      const char* tmp = std::getenv("TMPDIR");
      std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/unetcu-fuzz-XXXXXX";
      std::vector<char> buf(pattern.begin(), pattern.end());
      buf.push_back('\0');
      if (!mkdtemp(buf.data())) throw std::runtime_error("fuzz: cannot create a scratch directory");
      path = buf.data();
    }
    ~Dir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Dir dir;
  return dir.path;
}

inline void write_bytes(const std::string& path, const uint8_t* data, size_t size) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data), std::streamsize(size));
  if (!f) throw std::runtime_error("fuzz: cannot write " + path);
}

inline std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// The small model every checkpoint target loads into: the real topology, channels / 64, so its
// state has all 278 names of Unet('resnet34') at ~100 KB.
inline UNetConfig fuzz_model_config() {
  UNetConfig c;
  c.width_divisor = 64;
  c.seed = 1;
  return c;
}

// (a) The safetensors reader: read_safetensors, then load_model_state into the small UNet.
inline void run_safetensors(const uint8_t* data, size_t size) {
  static UNet model(fuzz_model_config());
  const std::string path = scratch_dir() + "/input.safetensors";
  write_bytes(path, data, size);
  std::map<std::string, std::string> metadata;
  const SafeTensors tensors = read_safetensors(path, &metadata);
  load_model_state(model, tensors, path);
}

// (b) The image decoder through the data set's load and resize path: the image as RGB and the
// same file as a mask (gray), each resized to the training size as FolderDataset::load does.
// Each input is decoded on a thread of its own: stb_image keeps its failure reason in a
// thread_local that nothing resets, so on a fresh thread every input meets the decoder as a
// program's first image does, whatever inputs came before it (the replay runs many in one
// process; a reason left unset by one decoder path is a finding only on a fresh thread).
inline constexpr int kFuzzImageSize = 32;
inline void run_image(const uint8_t* data, size_t size) {
  const std::string path = scratch_dir() + "/input.img";
  write_bytes(path, data, size);
  std::exception_ptr failure;
  std::thread decoder([&] {
    try {
      const int S = kFuzzImageSize;
      std::vector<float> image(size_t(3) * S * S), mask(size_t(S) * S);
      const Image rgb = load_image(path, 3);
      resize_bilinear(rgb, S, image.data());
      const Image gray = load_image(path, 1);
      resize_nearest_mask(gray, S, mask.data());
    } catch (...) {
      failure = std::current_exception();
    }
  });
  decoder.join();
  if (failure) std::rethrow_exception(failure);
}

// (c) The training-state reader: a valid model file (and an Adam optimizer over the model's
// parameters) written once; the input is its `<file>.train`; load_checkpoint reads both, and
// the run's record of its monitored metric goes into a MetricMonitor, as fit() does on resume.
struct TrainFixture {
  UNet model{fuzz_model_config()};
  Adam adam{model.parameters()};
  std::string path = scratch_dir() + "/model.safetensors";
  TrainFixture() { save_checkpoint(path, model, {&adam}, 1); }
};
inline TrainFixture& train_fixture() {
  static TrainFixture f;
  return f;
}
inline void run_train(const uint8_t* data, size_t size) {
  TrainFixture& f = train_fixture();
  write_bytes(f.path + ".train", data, size);
  RunRecord record;
  const int epoch = load_checkpoint(f.path, f.model, {&f.adam}, nullptr, &record);
  MetricMonitor monitor(MonitorOptions{});
  monitor.restore(record, epoch, f.path + ".train");
}

// (d) The torch.save reader (--encoder-weights FILE.pth): the zip archive through libzip and
// data.pkl through the restricted unpickler, every tensor copied out of its storage; then
// each float tensor's values summed, so that every byte read is used.
inline void run_torch(const uint8_t* data, size_t size) {
  const SafeTensors tensors = read_torch_bytes(data, size, "input.pth");
  volatile double sum = 0;
  for (const auto& [name, t] : tensors)
    if (t.dtype == "F32")
      for (size_t i = 0; i + 4 <= t.data.size(); i += 4) {
        float v;
        std::memcpy(&v, t.data.data() + i, 4);
        sum = sum + double(v);
      }
}

// (e) The .npy reader (--in-channels, image folders of arrays): the header alone, then the
// array at the channel count its header gives, and at another count (always refused).
inline void run_npy(const uint8_t* data, size_t size) {
  const std::string path = scratch_dir() + "/input.npy";
  write_bytes(path, data, size);
  const ImageInfo info = read_image_info(path);
  const ImageValues v = load_image_values(path, info.channels);
  if (v.values.size() != size_t(v.width) * v.height * v.channels) throw std::runtime_error("npy: wrong size");
  try {
    load_image_values(path, v.channels == 1 ? 2 : 1);
  } catch (const Error&) {
    return;  // the refusal expected
  }
  throw std::runtime_error("npy: an array read at a channel count it does not hold");
}

// The targets by name; the name is also the folder of the corpus: tests/corpus/<name>/.
using Target = std::function<void(const uint8_t*, size_t)>;
inline const std::map<std::string, Target>& targets() {
  static const std::map<std::string, Target> all{
      {"safetensors", run_safetensors}, {"image", run_image}, {"train", run_train}, {"torch", run_torch},
      {"npy", run_npy}};
  return all;
}

}  // namespace unetcu::fuzz
