// The device side of the CUDA emulator: thread coordinates, barriers, warp shuffles, atomics,
// and the launch that translate.py writes in place of `kernel<<<grid, block, shared, stream>>>`.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>

namespace unetcu_emu {

// The coordinates of the emulated thread that is running on this host thread.
struct Coords {
  uint3 thread{0, 0, 0};
  uint3 block{0, 0, 0};
  dim3 block_dim{1, 1, 1};
  dim3 grid_dim{1, 1, 1};
};
extern thread_local Coords t_coords;

// <<<grid, block, shared bytes, stream>>>
struct Config {
  dim3 grid, block;
  size_t shared = 0;
  cudaStream_t stream = nullptr;
  Config(dim3 g, dim3 b, size_t s = 0, cudaStream_t st = nullptr)
      : grid(g), block(b), shared(s), stream(st) {}
};

// Runs `body` once for every thread of the grid (or records it, inside a stream capture).
// `barriers`: the kernel uses __syncthreads or warp shuffles, so the threads of a block run as
// fibers; otherwise one after another, and a barrier call is an error. `pointers`: the
// kernel's pointer arguments, each checked to lie in the current device's memory.
void submit(const char* name, const Config& c, bool barriers, const void* const* pointers,
            int npointers, std::function<void()> body);

// Queues host work on a stream (or records it into the graph the stream is capturing): the
// emulated cuDNN's convolutions (cudnn.cpp). Fails, as a kernel launch would, on a stream of
// another device or inside a capture that refuses it.
cudaError_t enqueue(cudaStream_t stream, std::function<void()> work);

// For the emulated cuDNN and NCCL (cudnn.cpp, nccl.cpp): where `bytes` at p lie, a device
// (>= 0), pinned host memory (-1) or other host memory (-2), the run stopped, naming `what`,
// when they run past the end of their allocation; and the device a stream belongs to
// (nullptr: the current device's).
int memory_device(const void* p, size_t bytes, const char* what);
int stream_device(cudaStream_t stream);
// Stops the run with the emulator's message (a misuse a GPU would hang or corrupt on).
[[noreturn]] void stop(const std::string& what);

void syncthreads();
uint64_t shuffle_down(uint64_t bits, unsigned mask, unsigned delta, int width);

template <class T>
void collect_pointer(const void** out, int& n, const T& v) {
  if constexpr (std::is_pointer_v<T>) out[n++] = static_cast<const void*>(v);
}

template <bool Barriers, class K>
struct Launcher {
  const char* name;
  Config cfg;
  K kernel;
  template <class... A>
  void operator()(A... args) const {
    const void* pointers[sizeof...(A) + 1] = {};
    int n = 0;
    (collect_pointer(pointers, n, args), ...);
    submit(name, cfg, Barriers, pointers, n,
           [k = kernel, tup = std::make_tuple(args...)]() { std::apply(k, tup); });
  }
};

template <bool Barriers, class K>
Launcher<Barriers, K> launch(const char* name, const Config& cfg, K kernel) {
  return {name, cfg, kernel};
}

}  // namespace unetcu_emu

#define threadIdx (::unetcu_emu::t_coords.thread)
#define blockIdx (::unetcu_emu::t_coords.block)
#define blockDim (::unetcu_emu::t_coords.block_dim)
#define gridDim (::unetcu_emu::t_coords.grid_dim)
constexpr int warpSize = 32;

inline void __syncthreads() { ::unetcu_emu::syncthreads(); }

template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "emulated shuffle: 8 bytes at most");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = ::unetcu_emu::shuffle_down(bits, mask, delta, width);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

// One host thread runs a launch: a read-modify-write is atomic with respect to the grid.
template <class T>
T atomicAdd(T* address, T v) {
  const T old = *address;
  *address = old + v;
  return old;
}

// CUDA's global min and max for arithmetic types.
template <class T, class = std::enable_if_t<std::is_arithmetic_v<T>>>
inline T min(T a, T b) {
  return b < a ? b : a;
}
template <class T, class = std::enable_if_t<std::is_arithmetic_v<T>>>
inline T max(T a, T b) {
  return a < b ? b : a;
}
