// Caching host allocator: tensor storage on CPU devices. A training step allocates the same
// sizes every time; keeping freed blocks (by size) avoids a fresh mmap and its page faults for
// every activation. Tensors and cache together are bounded by twice the peak bytes ever held in
// tensors (at least 256 MB): a pass that frees each activation once the next layer has read it
// (prediction) allocates more blocks in all than it ever holds at once. Blocks are 64-byte
// aligned. Thread-safe.
#pragma once
#include <cstddef>

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
  // Returns a block of at least `bytes`; *capacity receives its real size (pass it to free).
  static void* allocate(size_t bytes, size_t* capacity);
  static void free(void* ptr, size_t capacity);
  static AllocatorStats stats();
  static void reset_peak();
  static void release_cache();  // returns every cached block to the system
};

}  // namespace unetcu
