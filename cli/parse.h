// The flag values' parsers (devices, cuts, numbers), without CLI11: cli/cli.h builds the
// command lines on them; tests and benchmarks that only parse include this.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "runtime/device.h"

namespace unetcu::cli {

// "cpu", "cpu:N", "cuda:N" or, where `allow_auto`, "auto" (nullopt).
std::optional<Device> parse_device(const std::string& s, bool allow_auto);
// "cpu:0,cpu:1,...": a comma-separated list (empty items skipped).
std::vector<Device> parse_device_list(const std::string& s);
// Cut points for model parallelism: block names (encoder.layer3 or its last part, layer3) or
// block indices, comma separated, in increasing order; each names the block a cut follows.
// Returns the first block of each later stage.
std::vector<int> parse_cuts(const std::string& spec);
// Blocks whose activations are recomputed: "none" (empty), "blocks" (every one), or block
// names or indices, comma separated, as for parse_cuts. One flag per block.
std::vector<bool> parse_recompute(const std::string& spec);
// A whole number in 0..2^64-1, digits only (no sign: "-1" is refused, not wrapped).
uint64_t parse_uint64(const std::string& s);
// A positive size in bytes: digits, optionally followed by K, M, G or T (or KiB, MiB, GiB,
// TiB): powers of 1024.
uint64_t parse_bytes(const std::string& s);
// An image size: "S" (width 0: square) or "WxH" (positive whole numbers).
void parse_size(const std::string& s, int* width, int* height);
// Positive integers, comma separated ("1,2,4").
std::vector<int> parse_int_list(const std::string& s);
// Settings named in messages (runtime/common.h setting()) as the flags that set them: a
// setting's name is its flag's without the dashes, '_' for '-' (batch_size: --batch-size).
void name_settings_as_flags();
// The block names of the UNet, in order (what --split accepts).
const std::vector<std::string>& unet_block_names();

}  // namespace unetcu::cli
