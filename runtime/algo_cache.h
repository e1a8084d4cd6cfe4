// The convolution algorithms chosen by cuDNN's search, kept on disk so that a process does not
// search again (seconds per shape at batch 64) for shapes an earlier process has measured.
// Plain C++ (no CUDA types): kernels/cuda/conv.cu fills in the key and the choice, and the
// tests cover the format, the round trip, invalidation and concurrent writers on the CPU.
//
// The file: `$UNETCU_CACHE_DIR/conv_algos.txt`, else
// `${XDG_CACHE_HOME:-$HOME/.cache}/unetcu/conv_algos.txt`; `UNETCU_ALGO_CACHE=0` turns it off.
// A header line (the format's version), then one line per entry: the key, a tab, the choice.
// A provisional choice's key ends in " provisional=1" (a build that does not know the mark
// reads it as another key and never uses it); a final choice of the same key wins over it.
// A file that is not in this format (damaged, or written by another version of the format) is
// ignored with a one-line warning and replaced on the next write. Writes go to a temporary
// file in the same folder that is then renamed over the file, so a reader (another process of
// a data-parallel run) sees the old file or the new one, never half of one.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>

namespace unetcu {

// Everything a measured choice depends on. Another device, cuDNN version, math mode or
// deterministic setting is another key, so a changed cuDNN or GPU never reuses a stale choice.
struct ConvAlgoKey {
  std::string device;     // the GPU's name, e.g. "NVIDIA H200"
  int cc_major = 0, cc_minor = 0;  // compute capability
  int cudnn_version = 0;  // cudnnGetVersion()
  std::string direction;  // "fwd", "bwd_data" or "bwd_filter"
  std::string dtype;      // "f32", "f32.nhwc", "bf16" or "bf16.nhwc"
  bool tf32 = false;      // tensor-core TF32 allowed
  bool deterministic = false;
  int64_t n = 0, c = 0, h = 0, w = 0;  // input
  int64_t o = 0, kh = 0, kw = 0;       // output channels, kernel
  int64_t sh = 1, sw = 1, ph = 0, pw = 0;
};

// The choice: cuDNN's algorithm and math type enum values, and whether cuDNN reported the
// algorithm deterministic. The workspace size is asked of cuDNN again when a choice is used.
// A provisional choice was measured beside other work, or with less workspace than the
// policy's: a later process searches again when it can search alone (kernels/cuda/conv.cu).
struct ConvAlgoChoice {
  int algo = 0;
  int math_type = 0;
  bool deterministic = false;
  bool provisional = false;
  bool operator==(const ConvAlgoChoice& o) const {
    return algo == o.algo && math_type == o.math_type && deterministic == o.deterministic &&
           provisional == o.provisional;
  }
};

using ConvAlgoEntries = std::map<std::string, ConvAlgoChoice>;  // key text -> choice

// The key as one line of text without tabs, e.g. "cudnn=91900 device=NVIDIA_H200 cc=9.0
// dir=fwd dtype=f32 tf32=0 det=1 x=64x3x512x512 w=64x3x7x7 stride=2x2 pad=3x3". Characters
// of the device name other than letters, digits, '.', '-' and '_' become '_'.
std::string conv_algo_key_text(const ConvAlgoKey& key);

// The whole file's text, and its parser: false (with *error saying why) for anything that is
// not exactly this format, in which case *entries is left empty.
extern const char* const kConvAlgoCacheHeader;
std::string format_conv_algo_cache(const ConvAlgoEntries& entries);
bool parse_conv_algo_cache(const std::string& text, ConvAlgoEntries* entries, std::string* error);

// Where the cache lives, from the environment; empty when it is turned off (or no home is set).
std::string default_conv_algo_cache_path();

class ConvAlgoCache {
 public:
  using Warn = std::function<void(const std::string&)>;
  // `path` empty: disabled (find finds nothing, store stores nothing). `warn` receives each
  // one-line warning (default: stderr, prefixed "unetcu: ").
  explicit ConvAlgoCache(std::string path, Warn warn = {});

  // The file is read on the first find.
  std::optional<ConvAlgoChoice> find(const ConvAlgoKey& key);
  // Adds the entry and writes the file: what is on disk now (other processes may have added
  // entries), plus this entry, less the entries of this key's device measured with another
  // cuDNN version. A provisional choice never replaces a final one. Never throws: a file that
  // cannot be written is a warning, and later stores
  // do not try again.
  void store(const ConvAlgoKey& key, const ConvAlgoChoice& choice);

  const std::string& path() const { return path_; }
  bool enabled() const { return !path_.empty(); }

 private:
  ConvAlgoEntries read_file();  // empty (with a warning) when missing-but-damaged
  void warn(const std::string& message);

  std::string path_;
  Warn warn_;
  std::mutex mu_;
  bool loaded_ = false;
  bool write_failed_ = false;
  ConvAlgoEntries entries_;
};

}  // namespace unetcu
