// The fuzzers' regression corpus, replayed on every test run: each file of
// tests/corpus/<target>/ goes through the same calls as its fuzz target (tests/fuzz/targets.h)
// and must end in success or unetcu::Error — never a crash, a sanitizer report or another
// exception type. Seeds (seed_*) must load: they are valid files of the current model and
// formats, there to lead the fuzzer into the deep paths. The hand-made train/bad_* files must
// be refused (each breaks something the .train reader or the record's restore checks).
// tools/fuzz.sh adds every crashing input it finds; tests/corpus/README.md lists the hand-made
// ones.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "tests/fuzz/targets.h"
#include "testing.h"

using namespace unetcu;
namespace fs = std::filesystem;

namespace {

// tests/corpus/known_findings.txt: inputs that still trip a sanitizer in code whose fix is
// pending elsewhere, one "<target>/<file> <reason>" a line ('#' comments). The replay skips
// them, saying why, and tools/fuzz.sh keeps them out of the fuzzers' start corpus; the line
// goes when the fix lands.
std::map<std::string, std::string> known_findings() {
  std::map<std::string, std::string> out;
  std::ifstream f(fs::path(UNETCU_SOURCE_DIR) / "tests" / "corpus" / "known_findings.txt");
  for (std::string line; std::getline(f, line);) {
    const size_t start = line.find_first_not_of(" \t");
    if (start == std::string::npos || line[start] == '#') continue;
    const size_t end = line.find_first_of(" \t", start);
    const size_t reason = end == std::string::npos ? end : line.find_first_not_of(" \t", end);
    out[line.substr(start, end - start)] = reason == std::string::npos ? "" : line.substr(reason);
  }
  return out;
}

std::vector<fs::path> corpus_files(const std::string& target) {
  const fs::path dir = fs::path(UNETCU_SOURCE_DIR) / "tests" / "corpus" / target;
  std::vector<fs::path> files;
  if (fs::is_directory(dir))
    for (const auto& e : fs::directory_iterator(dir))
      if (e.is_regular_file()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

void replay(const std::string& target) {
  const fuzz::Target& run = fuzz::targets().at(target);
  const std::vector<fs::path> files = corpus_files(target);
  REQUIRE_MESSAGE(!files.empty(), "no files in tests/corpus/", target);
  const std::map<std::string, std::string> known = known_findings();
  int loaded = 0, refused = 0, skipped = 0;
  for (const fs::path& file : files) {
    const std::string name = target + "/" + file.filename().string();
    CAPTURE(name);
    if (auto k = known.find(name); k != known.end()) {
      MESSAGE("skipped tests/corpus/", name, " (known finding, fix pending): ", k->second);
      ++skipped;
      continue;
    }
    const std::vector<uint8_t> bytes = fuzz::read_bytes(file.string());
    const bool seed = file.filename().string().rfind("seed_", 0) == 0;
    // Every hand-made breakage of a .train file or a torch.save archive is one the reader must
    // refuse.
    const bool must_refuse =
        (target == "train" || target == "torch" || target == "npy") && file.filename().string().rfind("bad_", 0) == 0;
    try {
      run(bytes.data(), bytes.size());
      ++loaded;
      if (must_refuse) FAIL_CHECK("a damaged training state loaded");
    } catch (const Error& e) {
      ++refused;
      // A seed that no longer loads leads the fuzzer nowhere: the model or a format changed.
      if (seed)
        FAIL_CHECK("seed refused (refresh with tools/fuzz.sh --update-seeds): ", e.what());
    } catch (const std::exception& e) {
      FAIL_CHECK("not a unetcu::Error: ", e.what());
    }
  }
  MESSAGE(target, ": ", files.size(), " files, ", loaded, " loaded, ", refused,
          " refused with unetcu::Error, ", skipped, " skipped");
}

}  // namespace

TEST_CASE("corpus: every safetensors input loads or is refused with unetcu::Error") {
  replay("safetensors");
}

TEST_CASE("corpus: every image input decodes and resizes or is refused with unetcu::Error") {
  replay("image");
}

TEST_CASE("corpus: every .train input resumes or is refused with unetcu::Error") {
  replay("train");
}

TEST_CASE("corpus: every torch.save input is read or refused with unetcu::Error") {
  replay("torch");
}

TEST_CASE("corpus: every .npy input is read or refused with unetcu::Error") {
  replay("npy");
}
