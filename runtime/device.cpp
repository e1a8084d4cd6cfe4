#include "runtime/device.h"

#include <omp.h>

#include <cctype>
#include <sstream>

#include "runtime/common.h"
#include "runtime/cuda_api.h"

namespace unetcu {

static bool parse_index(const std::string& s, int* out) {
  if (s.empty() || s.size() > 4) return false;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  *out = std::stoi(s);
  return true;
}

std::vector<Device> Device::parse_list(const std::string& s) {
  std::vector<Device> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(Device::parse(item));
  UNETCU_CHECK(!out.empty(), "the device list is empty");
  return out;
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

std::string device_list_str(const std::vector<Device>& devices) {
  std::string s;
  for (const Device& d : devices) s += (s.empty() ? "" : ",") + d.str();
  return s;
}

std::string Device::str() const {
  return std::string(is_cpu() ? "cpu" : "cuda") + ":" + std::to_string(index);
}

#ifndef UNETCU_WITH_CUDA
int cuda_device_count() { return 0; }  // the CUDA build's lives in runtime/cuda/runtime.cu
#endif

Device resolve_device(const std::string& spec, std::string* note) {
  const bool built = cuda::built();
  const int gpus = built ? cuda_device_count() : 0;
  if (spec == "auto") {
    if (gpus > 0) {
      if (note) *note = str_cat(gpus, " GPU(s) visible; using cuda:0 (", cuda::device_name(0), ")");
      return Device::cuda(0);
    }
    if (note) *note = built ? "no GPU visible; using the CPU" : "built without CUDA; using the CPU";
    return Device::cpu(0);
  }
  Device d = Device::parse(spec);
  if (d.is_cuda()) {
    UNETCU_CHECK(built, "device ", d.str(), " requested, but this build has no CUDA backend");
    UNETCU_CHECK(gpus > 0, "device ", d.str(), " requested, but no GPU is visible");
    UNETCU_CHECK(d.index < gpus, "device ", d.str(), " requested, but only ", gpus,
                 " GPU(s) are visible");
    if (note) *note = str_cat("using ", d.str(), " (", cuda::device_name(d.index), ")");
    return d;
  }
  if (note) *note = "using " + d.str();
  return d;
}

void set_cpu_threads(int n) {
  UNETCU_CHECK(n >= 1, "thread count must be at least 1, got ", n);
  omp_set_num_threads(n);  // per host thread; OpenBLAS (OpenMP build) follows it
}

int cpu_threads() { return omp_get_max_threads(); }

std::string& current_block_name() {
  thread_local std::string name;
  return name;
}

}  // namespace unetcu
