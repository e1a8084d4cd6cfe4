// Element types. float64 is the reference for gradient checks; float32 is what trains;
// bfloat16 is the storage of activations under mixed precision, computed in
// float32 (bodies/bf16.h).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "runtime/common.h"
#include "bodies/bf16.h"

namespace unetcu {

using kernels::bf16;

enum class DType : uint8_t { F32, F64, BF16 };

inline size_t dtype_size(DType d) { return d == DType::F32 ? 4 : d == DType::F64 ? 8 : 2; }
inline const char* dtype_name(DType d) {
  return d == DType::F32 ? "float32" : d == DType::F64 ? "float64" : "bfloat16";
}

// Memory order of a 4-dimensional tensor whose shape is [N, C, H, W]: NCHW (contiguous rows of
// W) or NHWC ("channels last": the C values of one pixel contiguous). Shapes are always written
// [N, C, H, W]; the format says only how the elements lie in memory. Tensors of other ranks
// are NCHW.
enum class MemoryFormat : uint8_t { NCHW, NHWC };
inline const char* format_name(MemoryFormat f) { return f == MemoryFormat::NCHW ? "NCHW" : "NHWC"; }

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<double>() { return DType::F64; }
template <> constexpr DType dtype_of<bf16>() { return DType::BF16; }

}  // namespace unetcu

// Runs the statement with T bound to the C++ type of the given DType: float32 or float64 (the
// types that compute); any other dtype ends in an error naming it.
#define UNETCU_DISPATCH_FLOAT(dtype, T, ...)                                       \
  do {                                                                             \
    switch (dtype) {                                                               \
      case ::unetcu::DType::F32: {                                                 \
        using T = float;                                                           \
        __VA_ARGS__;                                                               \
        break;                                                                     \
      }                                                                            \
      case ::unetcu::DType::F64: {                                                 \
        using T = double;                                                          \
        __VA_ARGS__;                                                               \
        break;                                                                     \
      }                                                                            \
      default:                                                                     \
        throw ::unetcu::Error(::unetcu::str_cat(                                   \
            "no ", ::unetcu::dtype_name(dtype), " kernel for this operation"));    \
    }                                                                              \
  } while (0)

// As UNETCU_DISPATCH_FLOAT, and bfloat16 too (T = bf16: a storage type; compute in acc_t<T>).
#define UNETCU_DISPATCH_STORAGE(dtype, T, ...) \
  do {                                         \
    if ((dtype) == ::unetcu::DType::BF16) {    \
      using T = ::unetcu::bf16;                \
      __VA_ARGS__;                             \
    } else {                                   \
      UNETCU_DISPATCH_FLOAT(dtype, T, __VA_ARGS__); \
    }                                          \
  } while (0)
