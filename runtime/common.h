// Errors and checks shared by the whole engine. Library code throws unetcu::Error;
// the apps turn it into one line on stderr and a non-zero exit.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

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

// Positive whole numbers, comma separated ("1,2,4"; empty items skipped).
inline std::vector<int> parse_int_list(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) {
    if (item.empty()) continue;
    bool digits = item.size() < 10;
    for (char ch : item) digits = digits && ch >= '0' && ch <= '9';
    if (!digits) throw Error(str_cat("'", item, "' is not a positive whole number"));
    out.push_back(std::stoi(item));
  }
  if (out.empty()) throw Error("the list is empty");
  return out;
}

// A setting named in a message: setting("batch_size"). Libraries name a setting by its field
// in the configuration; the program that reads settings from its users says how they spell
// them (unet_train: setting("batch_size") is --batch-size), so an error names what the user
// typed while no library knows a flag.
using SettingNamer = std::string (*)(const std::string&);
inline SettingNamer& setting_namer() {
  static SettingNamer namer = nullptr;
  return namer;
}
inline void set_setting_names(SettingNamer namer) { setting_namer() = namer; }
inline std::string setting(const std::string& name) { return setting_namer() ? setting_namer()(name) : name; }

}  // namespace unetcu

// UNETCU_CHECK(cond, pieces...): throws unetcu::Error with the message when cond is false.
#define UNETCU_CHECK(cond, ...)                                            \
  do {                                                                     \
    if (!(cond)) throw ::unetcu::Error(::unetcu::str_cat(__VA_ARGS__));    \
  } while (0)
