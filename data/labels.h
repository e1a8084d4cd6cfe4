// How mask files become training targets: the number of classes, the ignore index and, for
// RGB masks, a colour per class.
//
//   one class:   a pixel > 0 is foreground (1), else background (0);
//   C >= 2:      a grayscale PNG's value, or an indexed (palette) PNG's index, is the class;
//                an RGB mask is read through the colour table (--class-colors);
//   either:      the ignore index (the usual value is 255) becomes -1, which no loss or metric
//                counts (RGB masks: the colour table's "ignore" colours); a value >= C that is
//                not the ignore index is an error naming the file, the value and C.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace unetcu {

struct ClassColor {
  uint8_t r = 0, g = 0, b = 0;
  std::string name;
};

struct LabelRule {
  int classes = 1;
  int ignore_index = -1;            // -1: none
  std::vector<ClassColor> colors;   // empty: masks hold class values; else one per class
  std::vector<ClassColor> ignored;  // RGB masks: colours of ignored pixels (-1)
};

// --class-colors FILE: one line per class, in class order, "r,g,b" or "r,g,b,name" (names of
// letters, digits, _, - and .); blank lines and lines starting with # are skipped. A line
// named "ignore" is no class: its colour marks ignored pixels (-1) and goes to *ignored (where
// given; else it is an error). Throws naming the file and line.
std::vector<ClassColor> read_class_colors(const std::string& path, std::vector<ClassColor>* ignored = nullptr);

// The targets of one mask file at its own size (width * height floats, row-major).
std::vector<float> load_mask_targets(const std::string& path, const LabelRule& rule, int* width,
                                     int* height);

// Colours as a checkpoint records them, "r,g,b;r,g,b;...", and back; `what` names the text's
// source in the error for a colour that is not r,g,b in 0..255.
std::string colors_to_text(const std::vector<ClassColor>& colors);
std::vector<ClassColor> colors_from_text(const std::string& text, const std::string& what);

// The class names: the colour table's, else "0", "1", ...
std::vector<std::string> class_names(const LabelRule& rule);

}  // namespace unetcu
