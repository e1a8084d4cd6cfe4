// The test mains' working directory: a fresh folder of the process's own, removed at exit.
// ctest runs the cases in parallel (-j), each case its own process; cases write their scratch
// files (checkpoints, logs, traces) by relative names, so with a folder each no two collide.
#pragma once
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <system_error>

namespace unetcu::testing {

class ScratchDir {
 public:
  ScratchDir() {
    std::error_code ec;
    const std::filesystem::path base = std::filesystem::temp_directory_path(ec);
    std::string tmpl = (ec ? std::string("/tmp") : base.string()) + "/unetcu_test_XXXXXX";
    if (!mkdtemp(tmpl.data()) || chdir(tmpl.c_str()) != 0) {
      std::fprintf(stderr, "cannot make a scratch folder under %s: the cases write in the current one\n",
                   tmpl.c_str());
      return;
    }
    path_ = tmpl;
  }
  ~ScratchDir() {
    if (path_.empty()) return;
    std::error_code ec;
    std::filesystem::current_path(std::filesystem::temp_directory_path(ec), ec);
    std::filesystem::remove_all(path_, ec);
  }
  // The folder, or "" where it could not be made.
  const std::string& path() const { return path_; }

  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

 private:
  std::string path_;
};

}  // namespace unetcu::testing
