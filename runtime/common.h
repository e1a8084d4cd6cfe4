// Errors and checks shared by the whole engine. Library code throws unetcu::Error;
// the apps turn it into one line on stderr and a non-zero exit.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace unetcu {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {
inline void append(std::ostringstream&) {}
template <class A, class... R>
void append(std::ostringstream& os, const A& a, const R&... r) {
  os << a;
  append(os, r...);
}
}  // namespace detail

// Builds a message from any streamable pieces: str_cat("bad size ", n).
template <class... A>
std::string str_cat(const A&... a) {
  std::ostringstream os;
  detail::append(os, a...);
  return os.str();
}

}  // namespace unetcu

// UNETCU_CHECK(cond, pieces...): throws unetcu::Error with the message when cond is false.
#define UNETCU_CHECK(cond, ...)                                            \
  do {                                                                     \
    if (!(cond)) throw ::unetcu::Error(::unetcu::str_cat(__VA_ARGS__));    \
  } while (0)
