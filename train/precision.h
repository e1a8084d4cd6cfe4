// The arithmetic and memory order a run or a prediction asks for, shared by unet_train
// (train/run.h) and unet_predict (train/predict_files.h).
#pragma once
#include "engine/named.h"
#include "runtime/device.h"
#include "runtime/dtype.h"

namespace unetcu {

// Arithmetic: fp32; tf32 (GPUs: cuDNN may use TF32 tensor cores); bf16 (mixed precision on
// both backends: activations and their gradients stored in bfloat16 and computed in float32,
// convolutions with bfloat16 inputs and float32 accumulation; parameters, optimizer, batch-norm
// statistics and the loss in float32); auto: tf32 on GPUs, fp32 on the CPU.
enum class Precision { Auto, FP32, TF32, BF16 };
inline constexpr NamedValue<Precision> kPrecisionNames[] = {
    {"auto", Precision::Auto}, {"fp32", Precision::FP32}, {"tf32", Precision::TF32}, {"bf16", Precision::BF16}};

// Memory order of the activations: nchw, nhwc (channels-last) or auto (nchw).
enum class FormatChoice { Auto, NCHW, NHWC };
inline constexpr NamedValue<FormatChoice> kFormatNames[] = {
    {"auto", FormatChoice::Auto}, {"nchw", FormatChoice::NCHW}, {"nhwc", FormatChoice::NHWC}};
inline MemoryFormat memory_format_of(FormatChoice f) {
  return f == FormatChoice::NHWC ? MemoryFormat::NHWC : MemoryFormat::NCHW;
}

// The precision on device d, for unet_train and unet_predict alike: on a GPU cuDNN's TF32
// switch (on where `tf32` allows it, unless fp32), on the CPU tf32 refused.
void apply_precision(Precision precision, bool tf32, const Device& d);

}  // namespace unetcu
