#include "data/labels.h"

#include <cctype>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "data/image_io.h"
#include "runtime/common.h"

namespace unetcu {

std::vector<ClassColor> read_class_colors(const std::string& path, std::vector<ClassColor>* ignored) {
  check_regular_file(path, "the class colour table");
  std::ifstream f(path);
  UNETCU_CHECK(f, "cannot read the class colour table '", path, "'");
  std::vector<ClassColor> out;
  int line_no = 0;
  for (std::string line; std::getline(f, line);) {
    ++line_no;
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    std::stringstream ss(line);
    std::string field;
    std::vector<std::string> fields;
    while (std::getline(ss, field, ',')) fields.push_back(field);
    UNETCU_CHECK(fields.size() == 3 || fields.size() == 4, "class colour table '", path, "' line ", line_no,
                 ": expected r,g,b or r,g,b,name, got '", line, "'");
    int rgb[3];
    for (int c = 0; c < 3; ++c) {
      size_t used = 0;
      int v = -1;
      try {
        v = std::stoi(fields[size_t(c)], &used);
      } catch (...) {
        used = 0;
      }
      while (used < fields[size_t(c)].size() && fields[size_t(c)][used] == ' ') ++used;
      UNETCU_CHECK(used == fields[size_t(c)].size() && used > 0 && v >= 0 && v <= 255, "class colour table '",
                   path, "' line ", line_no, ": '", fields[size_t(c)], "' is not a value in 0..255");
      rgb[c] = v;
    }
    ClassColor cc{uint8_t(rgb[0]), uint8_t(rgb[1]), uint8_t(rgb[2]), fields.size() == 4 ? fields[3] : ""};
    while (!cc.name.empty() && cc.name.front() == ' ') cc.name.erase(cc.name.begin());
    for (char ch : cc.name)
      UNETCU_CHECK(std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '-' || ch == '.', "class colour table '",
                   path, "' line ", line_no, ": the name '", cc.name, "' may hold letters, digits, _, - and . only");
    std::vector<ClassColor> seen = out;
    if (ignored) seen.insert(seen.end(), ignored->begin(), ignored->end());
    for (const ClassColor& o : seen) {
      UNETCU_CHECK(o.r != cc.r || o.g != cc.g || o.b != cc.b, "class colour table '", path, "' line ", line_no,
                   ": colour ", rgb[0], ",", rgb[1], ",", rgb[2], " is listed twice");
      UNETCU_CHECK(cc.name.empty() || cc.name == "ignore" || o.name != cc.name, "class colour table '", path,
                   "' line ", line_no, ": the name '", cc.name, "' is listed twice");
    }
    if (cc.name == "ignore") {  // the colour of pixels no loss or metric counts, not a class
      UNETCU_CHECK(ignored, "class colour table '", path, "' line ", line_no, ": 'ignore' is not read here");
      ignored->push_back(cc);
      continue;
    }
    out.push_back(cc);
  }
  UNETCU_CHECK(!out.empty(), "class colour table '", path, "' has no colours");
  return out;
}

std::string colors_to_text(const std::vector<ClassColor>& colors) {
  std::string out;
  for (size_t i = 0; i < colors.size(); ++i)
    out += str_cat(i ? ";" : "", int(colors[i].r), ",", int(colors[i].g), ",", int(colors[i].b));
  return out;
}

std::vector<ClassColor> colors_from_text(const std::string& text, const std::string& what) {
  std::vector<ClassColor> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ';');) {
    int r = -1, g = -1, b = -1;
    UNETCU_CHECK(std::sscanf(item.c_str(), "%d,%d,%d", &r, &g, &b) == 3 && r >= 0 && r <= 255 && g >= 0 &&
                     g <= 255 && b >= 0 && b <= 255,
                 what, " records colour '", item, "', not r,g,b in 0..255");
    out.push_back({uint8_t(r), uint8_t(g), uint8_t(b), ""});
  }
  return out;
}

std::vector<std::string> class_names(const LabelRule& rule) {
  std::vector<std::string> out;
  for (int c = 0; c < rule.classes; ++c)
    out.push_back(size_t(c) < rule.colors.size() && !rule.colors[size_t(c)].name.empty() ? rule.colors[size_t(c)].name
                                                                                           : std::to_string(c));
  return out;
}

std::vector<float> load_mask_targets(const std::string& path, const LabelRule& rule, int* width, int* height) {
  const ImageInfo info = read_image_info(path);
  const bool rgb = info.channels >= 3 && !info.palette;
  std::vector<float> out;
  UNETCU_CHECK(!info.wide || rule.classes == 1, "mask '", path, "' is a 16-bit PNG; save class indices as an "
               "8-bit grayscale or indexed PNG");
  if (!rule.colors.empty() && (rgb || info.palette)) {  // colours to classes
    const Image img = load_image(path, 3);
    out.resize(size_t(img.width) * img.height);
    for (size_t q = 0; q < out.size(); ++q) {
      const uint8_t* p = &img.pixels[q * 3];
      int found = -1;
      const auto same = [&](const ClassColor& k) { return k.r == p[0] && k.g == p[1] && k.b == p[2]; };
      for (size_t c = 0; c < rule.colors.size() && found < 0; ++c)
        if (same(rule.colors[c])) found = int(c);
      bool ignored = false;
      for (const ClassColor& k : rule.ignored) ignored = ignored || same(k);
      UNETCU_CHECK(found >= 0 || ignored, "mask '", path, "': colour ", int(p[0]), ",", int(p[1]), ",", int(p[2]),
                   " at (", q % size_t(img.width), ", ", q / size_t(img.width),
                   ") is not in the class colour table");
      out[q] = ignored ? -1.f : float(found);
    }
    *width = img.width, *height = img.height;
    return out;
  }
  UNETCU_CHECK(!rgb || rule.classes == 1, "mask '", path, "' is an RGB image; with ", rule.classes,
               " classes give a class colour table (a line r,g,b per class), or save masks as "
               "8-bit grayscale or indexed PNGs holding the class index");
  // One class reads a palette PNG as its gray values (> 0 foreground), as it always has.
  const Image img = info.palette && rule.classes > 1 ? load_palette_indices(path) : load_image(path, 1);
  out.resize(size_t(img.width) * img.height);
  for (size_t q = 0; q < out.size(); ++q) {
    const int v = img.pixels[q];
    if (v == rule.ignore_index) {
      out[q] = -1.f;
    } else if (rule.classes == 1) {
      out[q] = v > 0 ? 1.f : 0.f;
    } else {
      UNETCU_CHECK(v < rule.classes, "mask '", path, "': pixel (", q % size_t(img.width), ", ",
                   q / size_t(img.width), ") holds ", v, ", not one of the ", rule.classes, " classes (0..",
                   rule.classes - 1, ")", rule.ignore_index >= 0 ? "" : " and no ignore index is set");
      out[q] = float(v);
    }
  }
  *width = img.width, *height = img.height;
  return out;
}

}  // namespace unetcu
