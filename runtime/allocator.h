// Caching host allocator: tensor storage on CPU devices. A training step allocates the same
// sizes every time; keeping freed blocks (by size) avoids a fresh mmap and its page faults for
// every activation. Tensors and cache together are bounded by twice the peak bytes ever held in
// tensors (at least 256 MB): a pass that frees each activation once the next layer has read it
// (prediction) allocates more blocks in all than it ever holds at once. Blocks are 64-byte
// aligned. Thread-safe.
#pragma once
#include <cstddef>
#include <string>

namespace unetcu {

struct AllocatorStats {
  size_t current_bytes = 0;  // in tensors now
  size_t peak_bytes = 0;     // most ever in tensors at once, with the memory CUDA graphs keep
  size_t cached_bytes = 0;   // freed blocks kept for reuse
  // Blocks taken from the system (the cache had none to give): after a training step's first
  // run at a fixed shape, none (a step that still allocates from the system cannot be
  // captured in a CUDA graph and pays the system's cost every step).
  size_t system_allocations = 0;
};

class HostAllocator {
 public:
  // Returns a block of at least `bytes` for a tensor of CPU device `device` (cpu:N; -1: host
  // data, no device's); *capacity receives its real size (pass it and the device to free).
  // Past the memory limit of a device (set_memory_limit), throws an out-of-memory error naming
  // the device, the allocation, what its tensors hold and the limit.
  static void* allocate(size_t bytes, size_t* capacity, int device = 0);
  static void free(void* ptr, size_t capacity, int device = 0);
  static AllocatorStats stats();               // every CPU device together, and the cache
  static AllocatorStats device_stats(int device);  // cpu:N's tensors (current, peak)
  static void reset_peak();
  static void release_cache();  // returns every cached block to the system
};

// The most memory each device's tensors may hold at once (--max-memory), 0 for no limit: the
// CPU devices' tensors (the host cache is shared, not counted) and each GPU's blocks (tensors
// and the caching allocator's cache, as a GPU of that size holds them). An allocation past it
// is an out-of-memory error, as on a device of that size.
// `source` names where the limit came from, for the error (the program's flag), if anything.
void set_memory_limit(size_t bytes, const std::string& source = "");
size_t memory_limit();
// Where the limit came from, as set_memory_limit was given it.
std::string memory_limit_source();
// " (SOURCE)" for the limit's errors, or nothing.
std::string memory_limit_note();

// While one is alive on a thread, the CPU tensors the thread makes are host data (a loader's
// batches: make_batch, SyntheticSegmentation::batch), not a device's: counted under no CPU
// device and never refused by the memory limit, as on a GPU run, where they are host memory
// beside the device's.
class HostDataScope {
 public:
  HostDataScope();
  ~HostDataScope();
  HostDataScope(const HostDataScope&) = delete;
  HostDataScope& operator=(const HostDataScope&) = delete;
  static bool active();
};

}  // namespace unetcu
