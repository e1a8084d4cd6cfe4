// Command-line helpers shared by the apps and benchmarks: each flag is parsed once, into a
// typed value, by the table or parser that owns its allowed values; a bad value ends parsing
// with "--flag: what was wrong (what is allowed)". The parsers alone, without CLI11 (whose
// header costs about 4 s of compile time in every file that includes it), are cli/parse.h.
#pragma once
#include <CLI/CLI.hpp>

#include <optional>
#include <string>

#include "cli/parse.h"
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

// --flag VALUE into an optional, which stays empty unless the flag is given (where "not given"
// means something else than any value: the checkpoint's, or "belongs to another setting").
template <class T>
CLI::Option* add_optional(CLI::App& app, const std::string& flag, std::optional<T>& field, const std::string& help) {
  return app.add_option_function<T>(flag, [&field](const T& v) { field = v; }, help);
}

}  // namespace unetcu::cli
