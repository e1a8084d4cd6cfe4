#include "engine/device.h"

#include <omp.h>

#include <cctype>

#include "engine/common.h"

namespace unetcu {

static bool parse_index(const std::string& s, int* out) {
  if (s.empty() || s.size() > 4) return false;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  *out = std::stoi(s);
  return true;
}

Device Device::parse(const std::string& s) {
  auto colon = s.find(':');
  std::string kind = s.substr(0, colon);
  int index = 0;
  if (colon != std::string::npos && !parse_index(s.substr(colon + 1), &index))
    throw Error("bad device '" + s + "' (expected cpu, cpu:N, cuda or cuda:N)");
  if (kind == "cpu") return cpu(index);
  if (kind == "cuda") return cuda(index);
  throw Error("bad device '" + s + "' (expected cpu, cpu:N, cuda or cuda:N)");
}

std::string Device::str() const {
  return std::string(is_cpu() ? "cpu" : "cuda") + ":" + std::to_string(index);
}

#ifndef UNETCU_WITH_CUDA
int cuda_device_count() { return 0; }
#endif

Device resolve_device(const std::string& spec, std::string* note) {
  const int gpus = cuda_device_count();
  if (spec == "auto") {
    // The CUDA op backend is a separate layer; until it is linked in, a visible GPU cannot
    // be used and the CPU reference backend runs.
    if (note) {
      *note = gpus > 0 ? str_cat(gpus, " GPU(s) visible, but this build has no CUDA op backend; "
                                       "using the CPU")
                       : "no GPU visible; using the CPU";
    }
    return Device::cpu(0);
  }
  Device d = Device::parse(spec);
  if (d.is_cuda()) {
    UNETCU_CHECK(gpus > 0, "device ", d.str(), " requested, but no GPU is visible");
    UNETCU_CHECK(d.index < gpus, "device ", d.str(), " requested, but only ", gpus,
                 " GPU(s) are visible");
    throw Error(str_cat("device ", d.str(), ": this build has no CUDA op backend"));
  }
  if (note) *note = "using " + d.str();
  return d;
}

void set_cpu_threads(int n) {
  UNETCU_CHECK(n >= 1, "thread count must be at least 1, got ", n);
  omp_set_num_threads(n);  // per host thread; OpenBLAS (OpenMP build) follows it
}

int cpu_threads() { return omp_get_max_threads(); }

}  // namespace unetcu
