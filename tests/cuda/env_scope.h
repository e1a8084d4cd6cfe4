// Sets an environment variable for a scope, then restores it (the emulator reads its settings
// at each call, on the calling thread). Shared by the CUDA suite's cases.
#pragma once
#include <cstdlib>
#include <string>

namespace unetcu::testing {

struct EnvScope {
  std::string name, previous;
  bool had = false;
  EnvScope(const char* n, const char* value) : name(n) {
    if (const char* v = std::getenv(n)) had = true, previous = v;
    setenv(n, value, 1);
  }
  ~EnvScope() {
    if (had)
      setenv(name.c_str(), previous.c_str(), 1);
    else
      unsetenv(name.c_str());
  }
  EnvScope(const EnvScope&) = delete;
  EnvScope& operator=(const EnvScope&) = delete;
};

}  // namespace unetcu::testing
