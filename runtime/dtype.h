// Element types. float64 is the reference for gradient checks; float32 is what trains.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "runtime/common.h"

namespace unetcu {

enum class DType : uint8_t { F32, F64 };

inline size_t dtype_size(DType d) { return d == DType::F32 ? 4 : 8; }
inline const char* dtype_name(DType d) { return d == DType::F32 ? "float32" : "float64"; }

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<double>() { return DType::F64; }

}  // namespace unetcu

// Runs the statement with T bound to the C++ type of the given DType.
#define UNETCU_DISPATCH_FLOAT(dtype, T, ...)            \
  do {                                                  \
    switch (dtype) {                                    \
      case ::unetcu::DType::F32: {                      \
        using T = float;                                \
        __VA_ARGS__;                                    \
        break;                                          \
      }                                                 \
      case ::unetcu::DType::F64: {                      \
        using T = double;                               \
        __VA_ARGS__;                                    \
        break;                                          \
      }                                                 \
    }                                                   \
  } while (0)
