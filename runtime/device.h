// Devices: "cpu" / "cpu:N" (virtual CPU devices, each with its own thread budget, so that
// data and model parallelism run on a machine without a GPU) and "cuda:N".
#pragma once
#include <string>
#include <vector>

namespace unetcu {

enum class DeviceKind : uint8_t { CPU, CUDA };

struct Device {
  DeviceKind kind = DeviceKind::CPU;
  int index = 0;

  static Device cpu(int i = 0) { return {DeviceKind::CPU, i}; }
  static Device cuda(int i = 0) { return {DeviceKind::CUDA, i}; }
  // Parses "cpu", "cpu:N", "cuda", "cuda:N". Throws unetcu::Error on anything else.
  static Device parse(const std::string& s);
  // "cpu:0,cpu:1,...": a comma-separated list (empty items skipped).
  static std::vector<Device> parse_list(const std::string& s);

  bool is_cpu() const { return kind == DeviceKind::CPU; }
  bool is_cuda() const { return kind == DeviceKind::CUDA; }
  std::string str() const;
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

// "cpu:0,cpu:1": a device list as the command line writes it.
std::string device_list_str(const std::vector<Device>& devices);

// Number of visible CUDA GPUs. Any error from the CUDA runtime (no driver, no device,
// a build without CUDA) means zero: "no GPU" is a normal answer, never a crash.
int cuda_device_count();

// Resolves "auto" (cuda:0 when a GPU is visible and the build has the CUDA backend, else the
// CPU) and validates an explicit device. `note` receives a one-line explanation of the choice.
Device resolve_device(const std::string& spec, std::string* note);

// Thread budget of the CPU backend for the calling host thread (OpenMP and OpenBLAS follow it).
void set_cpu_threads(int n);
int cpu_threads();

// The model block the calling thread is running ("encoder.layer2"; empty outside one). Set by
// the engine's BlockScope; kernels name it in their one-off notes (a convolution that falls back).
std::string& current_block_name();

}  // namespace unetcu
