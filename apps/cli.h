// Command-line helpers shared by the apps and benchmarks: each flag is parsed once, into a
// typed value, by the table or parser that owns its allowed values; a bad value ends parsing
// with "--flag: what was wrong (what is allowed)".
#pragma once
#include <CLI/CLI.hpp>

#include <optional>
#include <string>
#include <vector>

#include "runtime/device.h"
#include "engine/named.h"
#include "models/unet.h"

namespace unetcu::cli {

// Runs `parse` on the flag's text; an unetcu::Error becomes CLI11's validation error for it.
template <class F>
auto checked(const std::string& flag, F parse) {
  return [flag, parse](const std::string& text) {
    try {
      parse(text);
    } catch (const Error& e) {
      throw CLI::ValidationError(flag, e.what());
    }
  };
}

// --flag NAME for an enum, from its name table (the only list of its values).
template <class E, size_t N>
CLI::Option* add_enum(CLI::App& app, const std::string& flag, E& field,
                      const NamedValue<E> (&table)[N], const std::string& help) {
  std::string what = flag.substr(flag.find_first_not_of('-'));
  return app
      .add_option_function<std::string>(
          flag, checked(flag, [&field, &table, what](const std::string& s) {
            field = parse_named(table, what.c_str(), s);
          }),
          help + " (" + names_list(table) + ")")
      ->default_str(name_of(table, field));
}

// "cpu", "cpu:N", "cuda:N" or, where `allow_auto`, "auto" (nullopt).
std::optional<Device> parse_device(const std::string& s, bool allow_auto);
// "cpu:0,cpu:1,...": a comma-separated list (empty items skipped).
std::vector<Device> parse_device_list(const std::string& s);
// Cut points for model parallelism: block names (encoder.layer3 or its last part, layer3) or
// block indices, comma separated, in increasing order; each names the block a cut follows.
// Returns the first block of each later stage.
std::vector<int> parse_cuts(const std::string& spec);
// A whole number in 0..2^64-1, digits only (no sign: "-1" is refused, not wrapped).
uint64_t parse_uint64(const std::string& s);
// Positive integers, comma separated ("1,2,4").
std::vector<int> parse_int_list(const std::string& s);
// The block names of the UNet, in order (what --split accepts).
const std::vector<std::string>& unet_block_names();

}  // namespace unetcu::cli
