// Per-thread scratch memory for CPU kernels: grows to the largest request and is reused, so a
// training step does not allocate (and page-fault in) fresh column buffers for every conv.
// Contents are uninitialised. One buffer per slot per thread; a kernel must not hold a slot
// across a call to another kernel that uses the same slot.
#pragma once
#include <cstddef>
#include <cstdlib>
#include <memory>

#include "runtime/common.h"

namespace unetcu::kernels::cpu {

enum class WorkspaceSlot {
  Columns, Scratch,  // im2col (conv.cpp)
  OnednnSrc, OnednnWeights, OnednnDst, OnednnDiffDst, OnednnScratchpad, OnednnAccum,  // conv_dnnl.cpp
  Count
};

inline void* workspace(WorkspaceSlot slot, size_t bytes) {
  struct Buffer {
    void* ptr = nullptr;
    size_t bytes = 0;
    ~Buffer() { std::free(ptr); }
  };
  static thread_local Buffer buffers[int(WorkspaceSlot::Count)];
  Buffer& b = buffers[int(slot)];
  if (b.bytes < bytes) {
    std::free(b.ptr);
    b.bytes = 0;
    b.ptr = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!b.ptr) throw Error(str_cat("out of host memory for a ", bytes, "-byte kernel workspace"));
    b.bytes = bytes;
  }
  return b.ptr;
}

template <class T>
T* workspace(WorkspaceSlot slot, size_t count) {
  return static_cast<T*>(workspace(slot, count * sizeof(T)));
}

}  // namespace unetcu::kernels::cpu
