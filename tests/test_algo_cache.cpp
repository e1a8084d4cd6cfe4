// The on-disk cache of cuDNN convolution algorithm choices (runtime/algo_cache.h): its key,
// file format, invalidation and writers racing, all without a GPU.
#include <doctest/doctest.h>

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "runtime/algo_cache.h"

using namespace unetcu;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name)
      : path(fs::temp_directory_path() / ("unetcu_" + name + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

std::string read(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

ConvAlgoKey h200_key() {
  ConvAlgoKey k;
  k.device = "NVIDIA H200";
  k.cc_major = 9;
  k.cc_minor = 0;
  k.cudnn_version = 91900;
  k.direction = "fwd";
  k.dtype = "f32";
  k.tf32 = false;
  k.deterministic = true;
  k.n = 64, k.c = 3, k.h = 512, k.w = 512, k.o = 64, k.kh = 7, k.kw = 7;
  k.sh = 2, k.sw = 2, k.ph = 3, k.pw = 3;
  return k;
}

// Collects warnings instead of printing them.
struct Warnings {
  std::vector<std::string> lines;
  ConvAlgoCache::Warn sink() {
    return [this](const std::string& m) { lines.push_back(m); };
  }
};

// Sets an environment variable for the scope, restoring the old value after.
struct EnvVar {
  std::string name;
  bool had;
  std::string old;
  EnvVar(const char* n, const char* value) : name(n) {
    const char* o = std::getenv(n);
    had = o != nullptr;
    if (had) old = o;
    if (value)
      ::setenv(n, value, 1);
    else
      ::unsetenv(n);
  }
  ~EnvVar() {
    if (had)
      ::setenv(name.c_str(), old.c_str(), 1);
    else
      ::unsetenv(name.c_str());
  }
};

}  // namespace

TEST_CASE("the algorithm cache key names device, cuDNN, direction, math mode, setting and shape") {
  ConvAlgoKey k = h200_key();
  CHECK(conv_algo_key_text(k) ==
        "cudnn=91900 device=NVIDIA_H200 cc=9.0 dir=fwd dtype=f32 tf32=0 det=1 x=64x3x512x512 "
        "w=64x3x7x7 stride=2x2 pad=3x3");
  // Every field tells keys apart.
  const std::string base = conv_algo_key_text(k);
  auto differs = [&](auto change) {
    ConvAlgoKey o = h200_key();
    change(o);
    return conv_algo_key_text(o) != base;
  };
  CHECK(differs([](ConvAlgoKey& o) { o.device = "NVIDIA A100"; }));
  CHECK(differs([](ConvAlgoKey& o) { o.cc_minor = 1; }));
  CHECK(differs([](ConvAlgoKey& o) { o.cudnn_version = 91901; }));
  CHECK(differs([](ConvAlgoKey& o) { o.direction = "bwd_data"; }));
  CHECK(differs([](ConvAlgoKey& o) { o.dtype = "bf16"; }));
  CHECK(differs([](ConvAlgoKey& o) { o.tf32 = true; }));
  CHECK(differs([](ConvAlgoKey& o) { o.deterministic = false; }));
  CHECK(differs([](ConvAlgoKey& o) { o.n = 32; }));
  CHECK(differs([](ConvAlgoKey& o) { o.pw = 1; }));
  // A device name cannot break the line format.
  k.device = "GPU\twith\nodd name";
  CHECK(conv_algo_key_text(k).find_first_of("\t\n") == std::string::npos);
}

TEST_CASE("the algorithm cache file round-trips, and anything else is refused whole") {
  ConvAlgoEntries e;
  e[conv_algo_key_text(h200_key())] = ConvAlgoChoice{1, 3, true};
  ConvAlgoKey other = h200_key();
  other.direction = "bwd_filter";
  e[conv_algo_key_text(other)] = ConvAlgoChoice{5, 0, false};
  other.direction = "bwd_data";
  e[conv_algo_key_text(other)] = ConvAlgoChoice{1, 1, true, /*provisional=*/true};
  const std::string text = format_conv_algo_cache(e);
  CHECK(text.find(" pad=3x3 provisional=1\talgo=1 math=1 det=1\n") != std::string::npos);
  CHECK(text.find(" pad=3x3\talgo=5 math=0 det=0\n") != std::string::npos);  // final: as before
  CHECK(text.rfind(std::string(kConvAlgoCacheHeader) + "\n", 0) == 0);
  ConvAlgoEntries back;
  std::string error;
  REQUIRE(parse_conv_algo_cache(text, &back, &error));
  CHECK(back == e);

  const std::string line1 = conv_algo_key_text(h200_key()) + "\talgo=1 math=3 det=1\n";
  const std::string header = std::string(kConvAlgoCacheHeader) + "\n";
  const std::string provisional_line_bad = "cudnn=1 x provisional=1\talgo=1 math=3 det=1\n";
  for (const std::string& bad :
       {std::string(), std::string("garbage"), header.substr(0, header.size() - 1),
        std::string("unetcu conv_algos v0\n") + line1,            // another format version
        header + line1.substr(0, line1.size() - 1),              // cut before the line break
        header + line1 + line1,                                  // a key twice
        header + "cudnn=1 x\talgo=1 math=3\n",                   // a field missing
        header + "cudnn=1 x\talgo=1 math=3 det=2\n",             // det not 0/1
        header + "cudnn=1 x\talgo=1 math=3 det=1 provisional=1\n",  // the mark is the key's
        header + provisional_line_bad + provisional_line_bad,         // a provisional key twice
        header + "cudnn=1 x\talgo=-1 math=3 det=1\n",            // negative
        header + "cudnn=1 x\talgo=99 math=3 det=1\n",            // no such algorithm
        header + "cudnn=1 x algo=1 math=3 det=1\n",              // no tab
        header + "\n",                                           // an empty line
        header + "device=x\talgo=1 math=3 det=1\n"}) {           // not a key
    CAPTURE(bad);
    ConvAlgoEntries out;
    out["stale"] = ConvAlgoChoice{};
    CHECK_FALSE(parse_conv_algo_cache(bad, &out, &error));
    CHECK(out.empty());
    CHECK_FALSE(error.empty());
  }
  // A final choice and a provisional one of the same key: the final one is kept.
  const std::string provisional_line =
      conv_algo_key_text(h200_key()) + " provisional=1\talgo=0 math=1 det=1\n";
  for (const std::string& both : {header + line1 + provisional_line, header + provisional_line + line1}) {
    REQUIRE(parse_conv_algo_cache(both, &back, &error));
    CHECK(back.size() == 1);
    CHECK(back[conv_algo_key_text(h200_key())] == ConvAlgoChoice{1, 3, true});
  }
  // An empty cache is a header alone.
  REQUIRE(parse_conv_algo_cache(header, &back, &error));
  CHECK(back.empty());
}

TEST_CASE("a provisional algorithm choice never replaces a final one, and a final one replaces it") {
  TempDir dir("algo_cache_provisional");
  const fs::path file = dir.path / "conv_algos.txt";
  Warnings w;
  const ConvAlgoChoice final_choice{6, 3, true}, provisional{1, 3, true, true};
  {
    ConvAlgoCache first(file.string(), w.sink());
    first.store(h200_key(), provisional);
    CHECK(first.find(h200_key()) == provisional);
    first.store(h200_key(), final_choice);  // searched again alone
    CHECK(first.find(h200_key()) == final_choice);
  }
  ConvAlgoCache later(file.string(), w.sink());
  CHECK(later.find(h200_key()) == final_choice);
  {
    // Another process measured it alone meanwhile; this one's busy search does not undo that.
    ConvAlgoCache busy(file.string(), w.sink());
    ConvAlgoKey k = h200_key();
    k.direction = "bwd_data";
    busy.store(k, ConvAlgoChoice{0, 3, true, true});
    busy.store(h200_key(), provisional);
    CHECK(busy.find(h200_key()) == final_choice);
    CHECK(busy.find(k) == ConvAlgoChoice{0, 3, true, true});
  }
  CHECK(ConvAlgoCache(file.string(), w.sink()).find(h200_key()) == final_choice);
  CHECK(w.lines.empty());
}

TEST_CASE("the algorithm cache stores, finds in a new process, and follows the environment") {
  TempDir dir("algo_cache_store");
  const fs::path file = dir.path / "sub" / "conv_algos.txt";  // the folder is made on write
  Warnings w;
  {
    ConvAlgoCache first(file.string(), w.sink());
    CHECK_FALSE(first.find(h200_key()));
    first.store(h200_key(), ConvAlgoChoice{6, 3, true});
    CHECK(first.find(h200_key()) == ConvAlgoChoice{6, 3, true});
  }
  ConvAlgoCache second(file.string(), w.sink());  // a later process
  CHECK(second.find(h200_key()) == ConvAlgoChoice{6, 3, true});
  CHECK(w.lines.empty());
  // No temporary file is left beside it.
  int files = 0;
  for (const auto& f : fs::directory_iterator(file.parent_path())) files += f.is_regular_file();
  CHECK(files == 1);

  // Disabled: nothing found, nothing written.
  ConvAlgoCache off("", w.sink());
  CHECK_FALSE(off.enabled());
  off.store(h200_key(), ConvAlgoChoice{});
  CHECK_FALSE(off.find(h200_key()));

  {
    EnvVar a("UNETCU_ALGO_CACHE", nullptr), b("UNETCU_CACHE_DIR", "/some/dir"),
        c("XDG_CACHE_HOME", "/xdg"), d("HOME", "/home/u");
    CHECK(default_conv_algo_cache_path() == "/some/dir/conv_algos.txt");
    EnvVar b2("UNETCU_CACHE_DIR", nullptr);
    CHECK(default_conv_algo_cache_path() == "/xdg/unetcu/conv_algos.txt");
    EnvVar c2("XDG_CACHE_HOME", "relative");  // the XDG rule: relative paths are ignored
    CHECK(default_conv_algo_cache_path() == "/home/u/.cache/unetcu/conv_algos.txt");
    EnvVar e("UNETCU_ALGO_CACHE", "0");
    CHECK(default_conv_algo_cache_path().empty());
  }
}

TEST_CASE("a changed cuDNN version or device does not reuse a choice, and stale entries are dropped") {
  TempDir dir("algo_cache_invalidate");
  const fs::path file = dir.path / "conv_algos.txt";
  Warnings w;
  ConvAlgoKey old_cudnn = h200_key();
  old_cudnn.cudnn_version = 90100;
  ConvAlgoKey other_gpu = h200_key();
  other_gpu.device = "NVIDIA GeForce RTX 2070 SUPER";
  other_gpu.cc_major = 7;
  other_gpu.cc_minor = 5;
  other_gpu.cudnn_version = 90100;
  {
    ConvAlgoCache c(file.string(), w.sink());
    c.store(old_cudnn, ConvAlgoChoice{1, 3, true});
    c.store(other_gpu, ConvAlgoChoice{0, 3, true});
  }
  ConvAlgoCache now(file.string(), w.sink());
  CHECK_FALSE(now.find(h200_key()));  // same GPU and shape, new cuDNN: searched again
  ConvAlgoKey a100 = old_cudnn;
  a100.device = "NVIDIA A100-SXM4-80GB";
  a100.cc_minor = 0;
  a100.cc_major = 8;
  CHECK_FALSE(now.find(a100));  // same cuDNN and shape, another GPU
  now.store(h200_key(), ConvAlgoChoice{2, 3, true});
  ConvAlgoEntries on_disk;
  std::string error;
  REQUIRE(parse_conv_algo_cache(read(file), &on_disk, &error));
  CHECK(on_disk.count(conv_algo_key_text(h200_key())) == 1);
  CHECK(on_disk.count(conv_algo_key_text(old_cudnn)) == 0);  // this GPU's old cuDNN: dropped
  CHECK(on_disk.count(conv_algo_key_text(other_gpu)) == 1);  // another GPU's: kept
  CHECK(w.lines.empty());
}

TEST_CASE("a damaged or foreign algorithm cache is ignored with one warning and rewritten") {
  TempDir dir("algo_cache_corrupt");
  const fs::path file = dir.path / "conv_algos.txt";
  for (const std::string& bad : {std::string("\x01\x02 not a cache at all"),
                                 std::string("unetcu conv_algos v999\nwhatever\n"),
                                 std::string(kConvAlgoCacheHeader) + "\ncudnn=1\talgo=1\n"}) {
    CAPTURE(bad);
    write(file, bad);
    Warnings w;
    ConvAlgoCache c(file.string(), w.sink());
    CHECK_FALSE(c.find(h200_key()));
    CHECK_FALSE(c.find(h200_key()));
    REQUIRE(w.lines.size() == 1);  // one line, once
    CHECK(w.lines[0].find(file.string()) != std::string::npos);
    CHECK(w.lines[0].find('\n') == std::string::npos);
    c.store(h200_key(), ConvAlgoChoice{1, 3, true});
    CHECK(w.lines.size() == 1);
    ConvAlgoEntries e;
    std::string error;
    CHECK(parse_conv_algo_cache(read(file), &e, &error));
    CHECK(e.size() == 1);
  }
  // A cache that cannot be written (its folder is a file): one warning, never an error.
  write(dir.path / "not_a_dir", "x");
  Warnings w;
  ConvAlgoCache c((dir.path / "not_a_dir" / "conv_algos.txt").string(), w.sink());
  c.store(h200_key(), ConvAlgoChoice{1, 3, true});
  c.store(h200_key(), ConvAlgoChoice{1, 3, true});
  CHECK(w.lines.size() == 1);
  CHECK(c.find(h200_key()) == ConvAlgoChoice{1, 3, true});  // still used in this process
}

TEST_CASE("writers racing on the algorithm cache never leave a damaged or partial file") {
  // Several caches (as several processes of a data-parallel run would) store different keys
  // at once while a reader parses the file over and over. A writer that wrote the file in
  // place would let the reader see a cut file; temporary file + rename never does.
  TempDir dir("algo_cache_race");
  const fs::path file = dir.path / "conv_algos.txt";
  constexpr int kWriters = 4, kStores = 40;
  std::atomic<bool> done{false};
  std::atomic<int> reads{0}, bad_reads{0};
  std::thread reader([&] {
    // Until the writers are done, and once after: a reader starved while they wrote still
    // reads (the finished file, whole).
    for (bool last = false; !last;) {
      last = done;
      const std::string text = read(file);
      if (text.empty()) continue;  // not written yet
      ConvAlgoEntries e;
      std::string error;
      if (!parse_conv_algo_cache(text, &e, &error)) ++bad_reads;
      ++reads;
    }
  });
  std::vector<std::thread> writers;
  std::atomic<int> warnings{0};
  for (int t = 0; t < kWriters; ++t)
    writers.emplace_back([&, t] {
      ConvAlgoCache c(file.string(), [&](const std::string&) { ++warnings; });
      for (int i = 0; i < kStores; ++i) {
        ConvAlgoKey k = h200_key();
        k.n = 1000 * t + i;
        c.store(k, ConvAlgoChoice{i % 8, 3, true});
      }
    });
  for (auto& th : writers) th.join();
  done = true;
  reader.join();
  CHECK(bad_reads == 0);
  CHECK(warnings == 0);
  CHECK(reads > 0);
  ConvAlgoEntries e;
  std::string error;
  REQUIRE(parse_conv_algo_cache(read(file), &e, &error));
  // Each writer's last store re-read the file and added its own entries, so at least the last
  // writer's are all there (others' may have been replaced in between: they are then searched
  // again, never wrong).
  CHECK(e.size() >= size_t(kStores));
  for (const auto& f : fs::directory_iterator(dir.path)) CHECK(f.path() == file);  // no temp left
}
