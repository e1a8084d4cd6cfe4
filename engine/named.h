// Names of enum values, written once in a table beside each enum: the command line parses
// with the table, messages and logs print from it, and the help lists it.
#pragma once
#include <cstddef>
#include <string>

#include "runtime/common.h"

namespace unetcu {

template <class E>
struct NamedValue {
  const char* name;
  E value;
};

// "a, b or c".
template <class E, size_t N>
std::string names_list(const NamedValue<E> (&table)[N]) {
  std::string out;
  for (size_t i = 0; i < N; ++i) out += std::string(i == 0 ? "" : i + 1 == N ? " or " : ", ") + table[i].name;
  return out;
}

template <class E, size_t N>
const char* name_of(const NamedValue<E> (&table)[N], E value) {
  for (const auto& e : table)
    if (e.value == value) return e.name;
  return "?";
}

// The value named `s`; an Error naming `what` and the allowed names otherwise.
template <class E, size_t N>
E parse_named(const NamedValue<E> (&table)[N], const char* what, const std::string& s) {
  for (const auto& e : table)
    if (s == e.name) return e.value;
  throw Error(str_cat("unknown ", what, " '", s, "' (expected ", names_list(table), ")"));
}

}  // namespace unetcu
