#include "cli/parse.h"

#include "data/image_io.h"
#include "models/unet.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cerrno>
#include <cstdlib>
#include <sstream>

namespace unetcu::cli {

std::optional<Device> parse_device(const std::string& s, bool allow_auto) {
  if (allow_auto && s == "auto") return std::nullopt;
  return Device::parse(s);
}

std::vector<Device> parse_device_list(const std::string& s) { return Device::parse_list(s); }

void name_settings_as_flags() {
  set_setting_names([](const std::string& name) {
    std::string flag = "--" + name;
    std::replace(flag.begin(), flag.end(), '_', '-');
    return flag;
  });
}

const std::vector<std::string>& unet_block_names() { return UNet::block_names(); }

namespace {
// A block named by its name (encoder.layer3), the name's last part (layer3) or its index; -1
// when none is.
int block_index(const std::string& item) {
  const auto& blocks = unet_block_names();
  if (std::all_of(item.begin(), item.end(), ::isdigit) && !item.empty() && item.size() < 4) {
    const int b = std::stoi(item);
    return b < int(blocks.size()) ? b : -1;
  }
  int found = -1;
  for (size_t b = 0; b < blocks.size(); ++b) {
    const std::string& n = blocks[b];
    if (n == item || (n.size() > item.size() && n.compare(n.size() - item.size(), item.size(), item) == 0 &&
                      n[n.size() - item.size() - 1] == '.'))
      found = int(b);
  }
  return found;
}
}  // namespace

std::vector<bool> parse_recompute(const std::string& spec) {
  const auto& blocks = unet_block_names();
  if (spec == "none") return {};
  if (spec == "blocks") return std::vector<bool>(blocks.size(), true);
  std::vector<bool> on(blocks.size(), false);
  std::stringstream ss(spec);
  std::string item;
  bool any = false;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    const int b = block_index(item);
    UNETCU_CHECK(b >= 0, "'", item, "' is not a block of the model (none, blocks, or a list of "
                 "encoder.stem, encoder.layer1..4, decoder.blocks.0..4, segmentation_head, or "
                 "their index)");
    on[size_t(b)] = any = true;
  }
  UNETCU_CHECK(any, "no block given to recompute");
  return on;
}

std::vector<int> parse_cuts(const std::string& spec) {
  const auto& blocks = unet_block_names();
  std::vector<int> cuts;
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    const int after = block_index(item);
    UNETCU_CHECK(after >= 0 && after + 1 < int(blocks.size()), "'", item,
                 "' is not a block the model can be cut after (blocks: encoder.stem, "
                 "encoder.layer1..4, decoder.blocks.0..4, segmentation_head; or their index)");
    cuts.push_back(after + 1);
  }
  UNETCU_CHECK(!cuts.empty(), "no cut given");
  for (size_t i = 1; i < cuts.size(); ++i)
    UNETCU_CHECK(cuts[i] > cuts[i - 1], "cuts must be in increasing block order");
  return cuts;
}

uint64_t parse_uint64(const std::string& s) {
  UNETCU_CHECK(!s.empty() && s.size() <= 20 && std::all_of(s.begin(), s.end(), ::isdigit),
               "'", s, "' is not a whole number in 0..18446744073709551615");
  errno = 0;
  const unsigned long long v = std::strtoull(s.c_str(), nullptr, 10);
  UNETCU_CHECK(errno == 0, "'", s, "' is larger than 18446744073709551615");
  return uint64_t(v);
}

uint64_t parse_bytes(const std::string& s) {
  size_t digits = 0;
  while (digits < s.size() && std::isdigit(static_cast<unsigned char>(s[digits]))) ++digits;
  const std::string unit = s.substr(digits);
  const std::pair<const char*, int> units[] = {{"", 0},   {"K", 10},   {"KiB", 10}, {"M", 20},
                                               {"MiB", 20}, {"G", 30}, {"GiB", 30}, {"T", 40},
                                               {"TiB", 40}};
  int shift = -1;
  for (const auto& [name, bits] : units)
    if (unit == name) shift = bits;
  UNETCU_CHECK(digits > 0 && shift >= 0, "'", s, "' is not a size in bytes (a whole number, "
               "optionally followed by K, M, G or T: 1024, 1024^2, ...)");
  const uint64_t v = parse_uint64(s.substr(0, digits));
  UNETCU_CHECK(v > 0, "'", s, "' is not a size in bytes: 0");
  UNETCU_CHECK(v <= (UINT64_MAX >> shift), "'", s, "' is too large");
  return v << shift;
}

void parse_size(const std::string& s, int* width, int* height) { parse_image_size(s, width, height); }

std::vector<int> parse_int_list(const std::string& s) { return unetcu::parse_int_list(s); }

}  // namespace unetcu::cli
