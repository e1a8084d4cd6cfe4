#include "data/image_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <system_error>

#include "runtime/common.h"

// While one image decodes, each allocation stb_image makes is capped by what an image of the
// header's size can need (set by decode_image, per thread: images load on several threads).
// Outside a decode the cap is off. A refusal makes stb fail with "outofmem", and the flag tells
// decode_image why.
static thread_local size_t t_stb_allocation_cap = SIZE_MAX;
static thread_local bool t_stb_allocation_refused = false;
static bool stb_allocation_allowed(size_t bytes) {
  if (bytes <= t_stb_allocation_cap) return true;
  t_stb_allocation_refused = true;
  return false;
}
static void* stb_capped_malloc(size_t bytes) { return stb_allocation_allowed(bytes) ? std::malloc(bytes) : nullptr; }
static void* stb_capped_realloc(void* p, size_t bytes) {
  return stb_allocation_allowed(bytes) ? std::realloc(p, bytes) : nullptr;
}

#define STB_IMAGE_IMPLEMENTATION
#define STBI_ONLY_PNG
#define STBI_ONLY_JPEG
#define STBI_ONLY_BMP
#define STBI_NO_STDIO  // files are read here (regular files only) and decoded from memory
#define STBI_MALLOC(bytes) stb_capped_malloc(bytes)
#define STBI_REALLOC(p, bytes) stb_capped_realloc(p, bytes)
#define STBI_FREE(p) std::free(p)
#include <stb_image.h>
#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb_image_write.h>

namespace unetcu {

namespace {

std::atomic<int64_t> g_max_image_pixels{kDefaultMaxImagePixels};

std::string errno_text(int e) { return std::error_code(e, std::generic_category()).message(); }

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a folder";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a plain file";
}

// The largest image file read: a 16-bit RGBA PNG stored uncompressed needs 8 bytes a pixel;
// 64 MiB more for metadata. stb takes the length as an int.
uint64_t max_image_file_bytes() {
  return std::min<uint64_t>(uint64_t(max_image_pixels()) * 8 + (uint64_t(64) << 20), INT_MAX);
}

struct FdCloser {
  int fd;
  ~FdCloser() { ::close(fd); }
};

// The first `limit` bytes of the file `path` (all of it for SIZE_MAX), an image or an array
// (`what`) of at most `max_bytes`; *file_size gets its length. A non-regular path is refused
// from stat() without opening it; the descriptor is checked again (O_NONBLOCK, so even a FIFO
// swapped in between cannot block the open).
std::vector<uint8_t> read_capped_file(const std::string& path, size_t limit, uint64_t* file_size,
                                      const std::string& what, uint64_t max_bytes) {
  check_regular_file(path, what);
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw Error(what + " '" + path + "' cannot be opened: " + errno_text(errno));
  FdCloser closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw Error(what + " '" + path + "' cannot be opened: " + errno_text(errno));
  if (!S_ISREG(st.st_mode))
    throw Error(what + " '" + path + "' is " + file_kind(st.st_mode) + ", not a regular file");
  *file_size = uint64_t(st.st_size);
  UNETCU_CHECK(*file_size <= max_bytes, what, " '", path, "' is ", *file_size, " bytes, more than an ", what,
               " within the limit of ", max_image_pixels(), " pixels needs (", max_bytes, " bytes)");
  std::vector<uint8_t> bytes(size_t(std::min<uint64_t>(limit, *file_size)));
  size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t r = ::read(fd, bytes.data() + got, bytes.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw Error("cannot read " + what + " '" + path + "': " + errno_text(errno));
    if (r == 0) break;  // shorter than stat said: what is there is the file
    got += size_t(r);
  }
  bytes.resize(got);
  return bytes;
}

std::vector<uint8_t> read_image_file(const std::string& path, size_t limit, uint64_t* file_size) {
  return read_capped_file(path, limit, file_size, "image", max_image_file_bytes());
}

// ---- JPEG structure -------------------------------------------------------------------------
// stb_image 2.27 (Debian's) builds a Huffman table from its 16 code counts before checking
// that they add up to at most 256, writing past the table's arrays. So every DHT segment stb
// can reach is checked first, and the walk follows the bytes exactly as stb's parser does:
// length-delimited segments; stray bytes between segments skipped only before the frame header
// (SOF); after a scan header (SOS) entropy-coded data up to the first FF xx that is neither a
// stuffed FF 00 nor a restart marker FF D0..D7 (FF fill bytes skipped). Where the walk and stb
// could part, stb refuses the file itself (or the walk refuses it first).

// stb takes the bytes for a JPEG when they start with FF, any FF fill bytes, then D8 (SOI).
bool looks_like_jpeg(const std::vector<uint8_t>& d) {
  size_t i = 1;
  if (d.empty() || d[0] != 0xFF) return false;
  while (i < d.size() && d[i] == 0xFF) ++i;
  return i < d.size() && d[i] == 0xD8;
}

// The tables of one DHT segment in d[p, end): each 1 byte class/id, 16 code counts, then as
// many symbol bytes as the counts add up to. Empty when they are sound.
std::string check_huffman_tables(const std::vector<uint8_t>& d, size_t p, size_t end) {
  while (p < end) {
    const size_t at = p;
    const int table_class = d[p] >> 4, table_id = d[p] & 15;
    if (table_class > 1 || table_id > 3)
      return str_cat("table at byte ", at, " has class ", table_class, " and id ", table_id,
                     " (at most 1 and 3)");
    if (end - p < 17) return str_cat("table at byte ", at, " is cut off by the end of its segment");
    int codes = 0;
    for (int i = 1; i <= 16; ++i) codes += d[p + i];
    if (codes > 256)
      return str_cat("table at byte ", at, " has ", codes, " codes, more than the 256 a table can hold");
    p += 17;
    if (end - p < size_t(codes))
      return str_cat("table at byte ", at, " is cut off by the end of its segment");
    p += size_t(codes);
  }
  return "";
}

// Walks the segments of a JPEG: the whole file up to EOI (DHT segments may also come between
// scans), or, for the header only, up to and including the frame header, which is all that
// stbi_info reads. Empty when sound; *truncated tells that the bytes ran out.
//
// *scan_bytes: the bytes of image data in the whole file's scans (for jpeg_data_covers).
std::string check_jpeg_segments(const std::vector<uint8_t>& d, bool whole, bool* truncated, uint64_t* scan_bytes) {
  const size_t n = d.size();
  auto cut = [&](const std::string& where) {
    *truncated = true;
    return "the file ends " + where + " (truncated?)";
  };
  auto marker_name = [](int m) {
    char s[8];
    std::snprintf(s, sizeof s, "FF%02X", m);
    return std::string(s);
  };
  size_t pos = 1;
  while (d[pos] == 0xFF) ++pos;  // looks_like_jpeg() found the D8 after these
  ++pos;
  bool frame = false;
  *scan_bytes = 0;
  for (;;) {
    if (pos >= n) return cut("before its end-of-image marker");
    if (d[pos] != 0xFF) {
      if (frame) return str_cat("expected a marker at byte ", pos);
      ++pos;  // padding between header segments, which stb skips too
      continue;
    }
    const size_t at = pos;
    while (pos < n && d[pos] == 0xFF) ++pos;
    if (pos >= n) return cut("inside a marker");
    const int m = d[pos++];
    if (m == 0xD9) return "";  // EOI
    if (m == 0x00 || m == 0x01 || m == 0xD8 || (m >= 0xD0 && m <= 0xD7))
      return str_cat("unexpected marker ", marker_name(m), " at byte ", at);
    if (n - pos < 2) return cut("inside the segment " + marker_name(m) + " at byte " + std::to_string(at));
    const size_t length = size_t(d[pos]) << 8 | d[pos + 1];  // counts itself, not the marker
    if (length < 2) return str_cat("segment ", marker_name(m), " at byte ", at, " has length ", length);
    if (n - pos < length) return cut("inside the segment " + marker_name(m) + " at byte " + std::to_string(at));
    if (m == 0xC4) {
      const std::string why = check_huffman_tables(d, pos + 2, pos + length);
      if (!why.empty()) return str_cat("Huffman table segment (DHT) at byte ", at, ": ", why);
    }
    pos += length;
    if (m == 0xC0 || m == 0xC1 || m == 0xC2) {  // the frame header (SOF) stb reads
      if (frame) return str_cat("a second frame header at byte ", at);
      frame = true;
      if (!whole) return "";
    } else if (m == 0xDA) {  // a scan: its entropy-coded data follows
      if (!frame) return str_cat("a scan at byte ", at, " before the frame header");
      const size_t data_start = pos;
      for (;;) {
        if (pos >= n) return cut("inside the image data");
        if (d[pos] != 0xFF) {
          ++pos;
          continue;
        }
        size_t q = pos + 1;
        while (q < n && d[q] == 0xFF) ++q;
        if (q >= n) return cut("inside the image data");
        if (d[q] == 0x00 || (d[q] >= 0xD0 && d[q] <= 0xD7)) {
          pos = q + 1;
          continue;
        }
        break;  // a marker: the next segment starts at pos
      }
      *scan_bytes += pos - data_start;
    }
  }
}

// Whether a whole JPEG's image data can cover its width x height: every 8x8 block of a
// full-resolution component has its DC coefficient coded at least once (in the sequential
// scan, or the first DC scan of a progressive image) with a Huffman code of at least one bit.
// Shorter data is a file cut short and closed with an EOI, which stb may decode as gray
// (a few hundred bytes claiming a 65-megapixel image took seconds to decode as one).
std::string jpeg_data_covers(uint64_t scan_bytes, int width, int height) {
  const uint64_t blocks = (uint64_t(width) + 7) / 8 * ((uint64_t(height) + 7) / 8);
  if (scan_bytes * 8 >= blocks) return "";
  return str_cat("its image data (", scan_bytes, " bytes) is too short for a ", width, "x", height,
                 " image, which needs at least one bit per 8x8 block (", blocks, " blocks): truncated?");
}

// ---- header and decode ------------------------------------------------------------------------

uint32_t le16(const std::vector<uint8_t>& d, size_t at) { return uint32_t(d[at]) | uint32_t(d[at + 1]) << 8; }
uint32_t le32(const std::vector<uint8_t>& d, size_t at) { return le16(d, at) | le16(d, at + 2) << 16; }

// The checks before any pixel is decoded, on the file's bytes (all of them when `whole`, else
// its first bytes; *need_more then asks for the whole file when a JPEG header runs past them).
ImageInfo checked_header(const std::string& path, const std::vector<uint8_t>& d, uint64_t file_size,
                         bool whole, bool* need_more) {
  *need_more = false;
  const bool jpeg = looks_like_jpeg(d);
  uint64_t scan_bytes = 0;
  if (jpeg) {
    bool truncated = false;
    const std::string why = check_jpeg_segments(d, whole, &truncated, &scan_bytes);
    if (truncated && d.size() < file_size) {
      *need_more = true;
      return {};
    }
    if (!why.empty()) throw Error("cannot read image '" + path + "': corrupt JPEG: " + why);
  }
  ImageInfo info;
  if (!stbi_info_from_memory(d.data(), int(d.size()), &info.width, &info.height, &info.channels)) {
    const std::string reason = stbi_failure_reason() ? stbi_failure_reason() : "";
    throw Error("cannot read image '" + path + "': " +
                (reason == "unknown image type" ? "not a PNG, JPEG or BMP image, or its header is corrupt"
                                                : reason));
  }
  const bool bmp = d.size() >= 30 && d[0] == 'B' && d[1] == 'M';
  // stbi_info gives a top-down BMP's height negative; stb cannot negate the most negative one.
  UNETCU_CHECK(info.height != INT_MIN, "cannot read image '", path, "': its height is out of range");
  if (bmp) info.height = std::abs(info.height);
  const bool png = d.size() > 25 && d[0] == 0x89 && d[1] == 'P' && d[12] == 'I' && d[13] == 'H';
  info.palette = png && d[25] == 3;
  info.wide = png && d[24] == 16;
  const int64_t pixels = int64_t(info.width) * info.height;
  UNETCU_CHECK(info.width > 0 && info.height > 0, "cannot read image '", path, "': its header says ",
               info.width, "x", info.height);
  UNETCU_CHECK(pixels <= max_image_pixels(), "image '", path, "' is ", info.width, "x", info.height,
               " (", pixels, " pixels), more than the limit of ", max_image_pixels(),
               " pixels set for images");
  if (jpeg && whole) {
    const std::string why = jpeg_data_covers(scan_bytes, info.width, info.height);
    if (!why.empty()) throw Error("cannot read image '" + path + "': corrupt JPEG: " + why);
  }
  if (bmp) {
    // stb reads zeros past the end of a short BMP: a black image instead of an error. Each
    // row is padded to 4 bytes, after the 14-byte file header and the info header.
    const uint64_t header = le32(d, 14), bits = header == 12 ? le16(d, 24) : le16(d, 28);
    const uint64_t row = (uint64_t(info.width) * bits + 31) / 32 * 4;
    const uint64_t need = 14 + header + row * uint64_t(info.height);
    UNETCU_CHECK(file_size >= need, "cannot read image '", path, "': truncated BMP: ", info.width, "x",
                 info.height, " at ", bits, " bits per pixel needs at least ", need, " bytes, the file has ",
                 file_size);
  }
  return info;
}

Image decode_image(const std::string& path, const std::vector<uint8_t>& bytes, const ImageInfo& info,
                   int channels) {
  // The most any one allocation of a legitimate decode takes: stb pads a JPEG's components to
  // whole blocks (< 32 pixels each way) and keeps progressive coefficients as shorts; a PNG
  // inflates to at most 8 bytes a pixel plus a filter byte a row, doubled for an interlaced
  // image's guess; its compressed data is gathered in a buffer up to twice the file.
  const uint64_t cap = 16 * (uint64_t(info.width) + 32) * (uint64_t(info.height) + 32) +
                       2 * uint64_t(bytes.size()) + (uint64_t(1) << 20);
  struct CapWhileDecoding {
    explicit CapWhileDecoding(uint64_t bytes) {
      t_stb_allocation_cap = size_t(std::min<uint64_t>(bytes, SIZE_MAX));
      t_stb_allocation_refused = false;
    }
    ~CapWhileDecoding() { t_stb_allocation_cap = SIZE_MAX; }
  } capped(cap);
  int w = 0, h = 0, stored = 0;
  std::unique_ptr<stbi_uc, void (*)(void*)> data(
      stbi_load_from_memory(bytes.data(), int(bytes.size()), &w, &h, &stored, channels), stbi_image_free);
  if (!data && t_stb_allocation_refused)
    throw Error(str_cat("cannot read image '", path, "': decoding it needs more memory than a ", info.width,
                        "x", info.height, " image can (a decompression bomb?)"));
  if (!data) {
    const char* reason = stbi_failure_reason();
    throw Error("cannot read image '" + path + "': " + (reason ? reason : "stb_image failed"));
  }
  UNETCU_CHECK(w == info.width && h == info.height, "cannot read image '", path, "': its header says ",
               info.width, "x", info.height, " but it decodes to ", w, "x", h);
  Image img;
  img.width = w, img.height = h, img.channels = channels;
  img.pixels.assign(data.get(), data.get() + size_t(w) * h * channels);
  return img;
}

constexpr size_t kHeaderBytes = 64 << 10;  // enough for the headers of nearly every image file

// Writes through `write(tmp)` to a temporary name beside `path`, then renames it.
template <class Write>
void write_through_temporary(const std::string& path, Write write) {
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  if (!write(tmp.c_str()) || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw Error("cannot write '" + path + "'");
  }
}

}  // namespace

namespace {

// ---- NumPy .npy ---------------------------------------------------------------------------
// "\x93NUMPY", a version byte pair, the header's length (2 bytes in version 1, 4 after), and
// the header: a Python dict literal {'descr': '<u2', 'fortran_order': False, 'shape': (H, W, N), }.
struct NpyHeader {
  int width = 0, height = 0, channels = 1, item = 1;
  char kind = 'u';  // 'u' unsigned integer, 'f' float
  size_t data_at = 0;
};

NpyHeader parse_npy(const std::string& path, const std::vector<uint8_t>& d, uint64_t file_size) {
  const auto bad = [&](const std::string& why) -> NpyHeader {
    throw Error("cannot read array '" + path + "': " + why);
  };
  if (d.size() < 10 || std::string(d.begin(), d.begin() + 6) != "\x93NUMPY") return bad("not a .npy file");
  const int major = d[6];
  if (major < 1 || major > 3) return bad("unknown .npy version " + std::to_string(major));
  const size_t len_bytes = major == 1 ? 2 : 4, start = 8 + len_bytes;
  if (d.size() < start) return bad("truncated header");
  size_t len = 0;
  for (size_t k = 0; k < len_bytes; ++k) len |= size_t(d[8 + k]) << (8 * k);
  if (len > 65536 || start + len > d.size()) return bad("truncated or oversized header");
  const std::string h(d.begin() + std::ptrdiff_t(start), d.begin() + std::ptrdiff_t(start + len));
  NpyHeader out;
  out.data_at = start + len;
  const auto value_of = [&](const std::string& key) {
    const size_t at = h.find("'" + key + "'");
    if (at == std::string::npos) bad("its header has no '" + key + "'");
    const size_t colon = h.find(':', at);
    if (colon == std::string::npos) bad("its header is malformed");
    return h.substr(colon + 1);
  };
  const std::string descr = value_of("descr");
  const size_t q0 = descr.find_first_of("'\""), q1 = q0 == std::string::npos ? q0 : descr.find(descr[q0], q0 + 1);
  if (q1 == std::string::npos) bad("its header's descr is malformed");
  const std::string type = descr.substr(q0 + 1, q1 - q0 - 1);
  if (type == "|u1" || type == "u1") out.kind = 'u', out.item = 1;
  else if (type == "<u2") out.kind = 'u', out.item = 2;
  else if (type == "<f4") out.kind = 'f', out.item = 4;
  else bad("element type '" + type + "': uint8, uint16 or float32 (little-endian) are read");
  if (value_of("fortran_order").find("True") < value_of("fortran_order").find_first_of(",}"))
    bad("it is in Fortran order; save it in C order (numpy.ascontiguousarray)");
  const std::string shape = value_of("shape");
  const size_t open = shape.find('('), close = shape.find(')');
  if (open == std::string::npos || close == std::string::npos || close < open) bad("its header's shape is malformed");
  std::vector<int64_t> dims;
  std::string num;
  for (size_t k = open + 1; k <= close; ++k) {
    const char c = shape[k];
    if (std::isdigit(static_cast<unsigned char>(c))) {
      num += c;
      if (num.size() > 9) bad("a dimension is too large");
    } else if (c == ',' || c == ')') {
      if (!num.empty()) dims.push_back(std::stoll(num));
      num.clear();
    } else if (c != ' ' && c != 'L') {
      bad("its header's shape is malformed");
    }
  }
  if (dims.size() != 2 && dims.size() != 3) bad("its shape has " + std::to_string(dims.size()) + " dimensions, not H x W or H x W x N");
  if (dims[0] < 1 || dims[1] < 1 || (dims.size() == 3 && (dims[2] < 1 || dims[2] > 64)))
    bad("its shape is empty or has more than 64 channels");
  out.height = int(dims[0]), out.width = int(dims[1]), out.channels = dims.size() == 3 ? int(dims[2]) : 1;
  const int64_t pixels = int64_t(out.width) * out.height;
  UNETCU_CHECK(pixels <= max_image_pixels(), "array '", path, "' is ", out.width, "x", out.height, " (", pixels,
               " pixels), more than the limit of ", max_image_pixels(), " pixels set for images");
  const uint64_t need = out.data_at + uint64_t(pixels) * uint64_t(out.channels) * uint64_t(out.item);
  if (file_size != need)
    bad(str_cat("its data is ", file_size - std::min<uint64_t>(file_size, out.data_at), " bytes, its header says ",
                need - out.data_at));
  return out;
}

// The largest .npy file read: the pixel limit at 64 channels of float32, and the header.
uint64_t max_npy_file_bytes() { return uint64_t(max_image_pixels()) * 64 * 4 + 65536 + 16; }

std::vector<uint8_t> read_npy_file(const std::string& path, size_t limit, uint64_t* file_size) {
  return read_capped_file(path, limit, file_size, "array", max_npy_file_bytes());
}

ImageValues load_npy(const std::string& path, int channels) {
  uint64_t file_size = 0;
  const std::vector<uint8_t> d = read_npy_file(path, SIZE_MAX, &file_size);
  const NpyHeader h = parse_npy(path, d, d.size());
  UNETCU_CHECK(h.channels == channels, "array '", path, "' has ", h.channels, " channel", h.channels == 1 ? "" : "s",
               ", not the ", channels, " of ", setting("in_channels"), " (arrays are never converted)");
  ImageValues out;
  out.width = h.width, out.height = h.height, out.channels = h.channels;
  out.divisor = h.kind == 'f' ? 1.f : h.item == 2 ? 65535.f : 255.f;
  const size_t n = size_t(h.width) * h.height * h.channels;
  out.values.resize(n);
  const uint8_t* p = d.data() + h.data_at;
  for (size_t i = 0; i < n; ++i) {
    if (h.item == 1) {
      out.values[i] = float(p[i]);
    } else if (h.item == 2) {
      out.values[i] = float(uint16_t(p[2 * i] | p[2 * i + 1] << 8));
    } else {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      UNETCU_CHECK(std::isfinite(v), "array '", path, "' holds a value that is not finite");
      out.values[i] = v;
    }
  }
  return out;
}

}  // namespace

void set_max_image_pixels(int64_t pixels) {
  UNETCU_CHECK(pixels >= 1, "the image pixel limit must be at least 1, got ", pixels);
  g_max_image_pixels.store(pixels);
}

int64_t max_image_pixels() { return g_max_image_pixels.load(); }

void check_regular_file(const std::string& path, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw Error(what + " '" + path + "' cannot be opened: " + errno_text(errno));
  if (!S_ISREG(st.st_mode)) throw Error(what + " '" + path + "' is " + file_kind(st.st_mode) + ", not a regular file");
}

ImageInfo read_image_info(const std::string& path) {
  uint64_t file_size = 0;
  if (is_npy_path(path)) {
    const std::vector<uint8_t> head = read_npy_file(path, 65536 + 16, &file_size);
    const NpyHeader h = parse_npy(path, head, file_size);
    ImageInfo info;
    info.width = h.width, info.height = h.height, info.channels = h.channels;
    return info;
  }
  bool need_more = false;
  const std::vector<uint8_t> head = read_image_file(path, kHeaderBytes, &file_size);
  const ImageInfo info = checked_header(path, head, file_size, false, &need_more);
  if (!need_more) return info;
  const std::vector<uint8_t> all = read_image_file(path, SIZE_MAX, &file_size);
  return checked_header(path, all, all.size(), false, &need_more);
}

bool is_npy_path(const std::string& path) {
  return path.size() > 4 && path.compare(path.size() - 4, 4, ".npy") == 0;
}

bool is_image_path(const std::string& path) {
  std::string e = std::filesystem::path(path).extension().string();
  std::transform(e.begin(), e.end(), e.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return e == ".png" || e == ".jpg" || e == ".jpeg" || e == ".bmp" || e == ".npy";
}

ImageValues load_image_values(const std::string& path, int channels) {
  UNETCU_CHECK(channels >= 1 && channels <= 64, "load_image_values: 1 to 64 channels");
  if (is_npy_path(path)) return load_npy(path, channels);
  uint64_t file_size = 0;
  bool need_more = false;
  const std::vector<uint8_t> bytes = read_image_file(path, SIZE_MAX, &file_size);
  const ImageInfo info = checked_header(path, bytes, bytes.size(), true, &need_more);
  // The file's own channels: 1 gray, 2 gray + alpha, 3 RGB, 4 RGBA (an indexed PNG: RGB).
  UNETCU_CHECK(channels == 3 || info.channels == channels, "image '", path, "' has ", info.channels, " channel",
               info.channels == 1 ? "" : "s", ", not the ", channels,
               " of ", setting("in_channels"), " (images are never converted to another count)");
  UNETCU_CHECK(channels <= 4, "image '", path, "' cannot hold ", channels, " channels: a .npy array can");
  ImageValues out;
  if (!info.wide) {
    const Image img = decode_image(path, bytes, info, channels);
    out.width = img.width, out.height = img.height, out.channels = channels;
    out.values.assign(img.pixels.begin(), img.pixels.end());
    return out;
  }
  // 16 bits a sample: scaled from 65535, not cut to the high byte.
  const uint64_t cap = 16 * (uint64_t(info.width) + 32) * (uint64_t(info.height) + 32) + 2 * uint64_t(bytes.size()) +
                       (uint64_t(1) << 20);
  t_stb_allocation_cap = size_t(std::min<uint64_t>(cap, SIZE_MAX));
  t_stb_allocation_refused = false;
  int w = 0, h = 0, stored = 0;
  std::unique_ptr<stbi_us, void (*)(void*)> px(
      stbi_load_16_from_memory(bytes.data(), int(bytes.size()), &w, &h, &stored, channels), stbi_image_free);
  t_stb_allocation_cap = SIZE_MAX;
  if (!px) {
    const char* reason = stbi_failure_reason();
    throw Error("cannot read image '" + path + "': " + (reason ? reason : "stb_image failed"));
  }
  UNETCU_CHECK(w == info.width && h == info.height, "cannot read image '", path, "': its header says ", info.width,
               "x", info.height, " but it decodes to ", w, "x", h);
  out.width = w, out.height = h, out.channels = channels, out.divisor = 65535.f;
  out.values.assign(px.get(), px.get() + size_t(w) * h * channels);
  return out;
}

Image load_image(const std::string& path, int channels) {
  UNETCU_CHECK(channels == 1 || channels == 3, "load_image: 1 or 3 channels");
  uint64_t file_size = 0;
  bool need_more = false;
  const std::vector<uint8_t> bytes = read_image_file(path, SIZE_MAX, &file_size);
  const ImageInfo info = checked_header(path, bytes, bytes.size(), true, &need_more);
  return decode_image(path, bytes, info, channels);
}

static uint32_t be32(const std::vector<uint8_t>& d, size_t at) {
  return uint32_t(d[at]) << 24 | uint32_t(d[at + 1]) << 16 | uint32_t(d[at + 2]) << 8 | d[at + 3];
}

Image load_palette_indices(const std::string& path) {
  uint64_t file_size = 0;
  bool need_more = false;
  const std::vector<uint8_t> d = read_image_file(path, SIZE_MAX, &file_size);
  const ImageInfo info = checked_header(path, d, d.size(), true, &need_more);
  UNETCU_CHECK(info.palette, "image '", path, "' is not an indexed (palette) PNG");
  const int depth = d[24];
  UNETCU_CHECK(d[28] == 0, "cannot read image '", path, "': interlaced indexed PNGs are not read; save it "
               "without interlacing");
  UNETCU_CHECK(depth == 1 || depth == 2 || depth == 4 || depth == 8, "cannot read image '", path,
               "': bit depth ", depth, " for an indexed PNG");
  std::vector<uint8_t> z;  // the IDAT chunks' zlib stream
  for (size_t at = 8; at + 8 <= d.size();) {
    const uint64_t len = be32(d, at);
    UNETCU_CHECK(at + 12 + len <= d.size(), "cannot read image '", path, "': truncated PNG chunk");
    if (std::equal(d.begin() + long(at) + 4, d.begin() + long(at) + 8, "IEND")) break;  // what follows is no PNG
    if (std::equal(d.begin() + long(at) + 4, d.begin() + long(at) + 8, "IDAT"))
      z.insert(z.end(), d.begin() + long(at) + 8, d.begin() + long(at + 8 + len));
    at += 12 + len;
  }
  const int W = info.width, H = info.height;
  const size_t row = (size_t(W) * size_t(depth) + 7) / 8, need = (row + 1) * size_t(H);
  int got = 0;
  t_stb_allocation_cap = 2 * need + (size_t(1) << 20);  // no inflating past what the size needs
  std::unique_ptr<char, void (*)(void*)> raw(
      stbi_zlib_decode_malloc_guesssize_headerflag(reinterpret_cast<const char*>(z.data()), int(z.size()),
                                                   int(std::min<size_t>(need, INT_MAX)), &got, 1),
      stbi_image_free);
  t_stb_allocation_cap = SIZE_MAX;
  UNETCU_CHECK(raw && size_t(got) >= need, "cannot read image '", path, "': corrupt PNG data");
  const uint8_t* in = reinterpret_cast<const uint8_t*>(raw.get());
  std::vector<uint8_t> prev(row, 0), cur(row);
  Image img;
  img.width = W, img.height = H, img.channels = 1;
  img.pixels.resize(size_t(W) * H);
  for (int y = 0; y < H; ++y) {  // the five PNG filters, one byte per "pixel" for indices
    const uint8_t f = in[size_t(y) * (row + 1)];
    const uint8_t* src = in + size_t(y) * (row + 1) + 1;
    UNETCU_CHECK(f <= 4, "cannot read image '", path, "': corrupt PNG filter ", int(f));
    for (size_t i = 0; i < row; ++i) {
      const int a = i ? cur[i - 1] : 0, b = prev[i], c = i ? prev[i - 1] : 0;
      int p = src[i];
      if (f == 1) p += a;
      else if (f == 2) p += b;
      else if (f == 3) p += (a + b) / 2;
      else if (f == 4) {
        const int pa = std::abs(b - c), pb = std::abs(a - c), pc = std::abs(a + b - 2 * c);
        p += pa <= pb && pa <= pc ? a : pb <= pc ? b : c;
      }
      cur[i] = uint8_t(p);
    }
    for (int x = 0; x < W; ++x) {
      const size_t bit = size_t(x) * size_t(depth);
      img.pixels[size_t(y) * W + x] =
          uint8_t((cur[bit / 8] >> (8 - depth - int(bit % 8))) & ((1 << depth) - 1));
    }
    std::swap(prev, cur);
  }
  return img;
}

void save_png(const std::string& path, const Image& image) {
  write_through_temporary(path, [&](const char* tmp) {
    return stbi_write_png(tmp, image.width, image.height, image.channels, image.pixels.data(),
                          image.width * image.channels);
  });
}

namespace {

uint32_t crc32(const uint8_t* p, size_t n, uint32_t crc = 0) {
  static uint32_t table[256];
  static const bool made = [] {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      table[i] = c;
    }
    return true;
  }();
  (void)made;
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

void put_be32(std::vector<uint8_t>& out, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) out.push_back(uint8_t(v >> s));
}

// One PNG chunk: length, type, data, CRC of type and data.
void put_chunk(std::vector<uint8_t>& out, const char type[4], const uint8_t* data, size_t n) {
  put_be32(out, uint32_t(n));
  const size_t start = out.size();
  out.insert(out.end(), type, type + 4);
  out.insert(out.end(), data, data + n);
  put_be32(out, crc32(out.data() + start, n + 4));
}

// The bytes to `path`, through a temporary file beside it.
void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  write_through_temporary(path, [&](const char* tmp) {
    std::FILE* f = std::fopen(tmp, "wb");
    if (!f) return false;
    const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
    return std::fclose(f) == 0 && ok;
  });
}

}  // namespace

void save_png16(const std::string& path, int width, int height, const std::vector<uint16_t>& gray) {
  UNETCU_CHECK(width >= 1 && height >= 1 && gray.size() == size_t(width) * size_t(height),
               "save_png16: ", gray.size(), " samples for a ", width, "x", height, " image");
  // Rows of big-endian samples, each after its filter byte (0: none), deflated by stb's zlib.
  std::vector<uint8_t> raw;
  raw.reserve(size_t(height) * (size_t(width) * 2 + 1));
  for (int y = 0; y < height; ++y) {
    raw.push_back(0);
    for (int x = 0; x < width; ++x) {
      const uint16_t v = gray[size_t(y) * width + x];
      raw.push_back(uint8_t(v >> 8));
      raw.push_back(uint8_t(v & 0xFF));
    }
  }
  int zlen = 0;
  std::unique_ptr<unsigned char, void (*)(void*)> z(
      stbi_zlib_compress(raw.data(), int(raw.size()), &zlen, 8), [](void* q) { STBIW_FREE(q); });
  UNETCU_CHECK(z != nullptr, "cannot compress '", path, "'");
  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  std::vector<uint8_t> ihdr;
  put_be32(ihdr, uint32_t(width));
  put_be32(ihdr, uint32_t(height));
  ihdr.insert(ihdr.end(), {16, 0, 0, 0, 0});  // 16 bits, grayscale, deflate, filter 0, no interlace
  put_chunk(png, "IHDR", ihdr.data(), ihdr.size());
  put_chunk(png, "IDAT", z.get(), size_t(zlen));
  put_chunk(png, "IEND", nullptr, 0);
  write_bytes(path, png);
}

void save_png_indexed(const std::string& path, int width, int height, const std::vector<uint8_t>& indices,
                      const std::vector<std::array<uint8_t, 3>>& palette) {
  UNETCU_CHECK(width >= 1 && height >= 1 && indices.size() == size_t(width) * size_t(height),
               "save_png_indexed: ", indices.size(), " indices for a ", width, "x", height, " image");
  UNETCU_CHECK(!palette.empty() && palette.size() <= 256, "save_png_indexed: ", palette.size(), " colours");
  // Row y filtered with PNG filter y % 5 (none, sub, up, average, Paeth): any reader must undo all five.
  std::vector<uint8_t> raw;
  const size_t W = size_t(width);
  for (int y = 0; y < height; ++y) {
    const int f = y % 5;
    raw.push_back(uint8_t(f));
    const uint8_t* cur = &indices[size_t(y) * W];
    const uint8_t* up = y ? &indices[size_t(y - 1) * W] : nullptr;
    for (size_t x = 0; x < W; ++x) {
      const int a = x ? cur[x - 1] : 0, b = up ? up[x] : 0, c = x && up ? up[x - 1] : 0;
      int pred = 0;
      if (f == 1) pred = a;
      else if (f == 2) pred = b;
      else if (f == 3) pred = (a + b) / 2;
      else if (f == 4) {
        const int pa = std::abs(b - c), pb = std::abs(a - c), pc = std::abs(a + b - 2 * c);
        pred = pa <= pb && pa <= pc ? a : pb <= pc ? b : c;
      }
      raw.push_back(uint8_t(cur[x] - pred));
    }
  }
  int zlen = 0;
  std::unique_ptr<unsigned char, void (*)(void*)> z(
      stbi_zlib_compress(raw.data(), int(raw.size()), &zlen, 8), [](void* q) { STBIW_FREE(q); });
  UNETCU_CHECK(z != nullptr, "cannot compress '", path, "'");
  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  std::vector<uint8_t> ihdr, plte;
  put_be32(ihdr, uint32_t(width));
  put_be32(ihdr, uint32_t(height));
  ihdr.insert(ihdr.end(), {8, 3, 0, 0, 0});  // 8 bits, indexed, deflate, filter 0, no interlace
  for (const auto& rgb : palette) plte.insert(plte.end(), rgb.begin(), rgb.end());
  put_chunk(png, "IHDR", ihdr.data(), ihdr.size());
  put_chunk(png, "PLTE", plte.data(), plte.size());
  put_chunk(png, "IDAT", z.get(), size_t(zlen));
  put_chunk(png, "IEND", nullptr, 0);
  write_bytes(path, png);
}

std::vector<uint16_t> load_png16(const std::string& path, int* width, int* height) {
  uint64_t file_size = 0;
  const std::vector<uint8_t> bytes = read_image_file(path, SIZE_MAX, &file_size);
  int w = 0, h = 0, stored = 0;
  std::unique_ptr<stbi_us, void (*)(void*)> px(
      stbi_load_16_from_memory(bytes.data(), int(bytes.size()), &w, &h, &stored, 1), stbi_image_free);
  UNETCU_CHECK(px != nullptr, "image '", path, "' cannot be decoded: ", stbi_failure_reason());
  *width = w;
  *height = h;
  return std::vector<uint16_t>(px.get(), px.get() + size_t(w) * size_t(h));
}

void save_image(const std::string& path, const Image& image) {
  const auto dot = path.rfind('.');
  std::string ext = dot == std::string::npos ? "" : path.substr(dot + 1);
  for (char& c : ext) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (ext == "png") return save_png(path, image);
  if (ext != "bmp") throw Error("cannot write '" + path + "': PNG or BMP only (by the extension)");
  write_through_temporary(path, [&](const char* tmp) {
    return stbi_write_bmp(tmp, image.width, image.height, image.channels, image.pixels.data());
  });
}

void parse_image_size(const std::string& s, int* width, int* height) {
  const size_t x = s.find_first_of("xX");
  auto side = [&](const std::string& t) {
    UNETCU_CHECK(!t.empty() && t.size() <= 18 && std::all_of(t.begin(), t.end(), ::isdigit),
                 "'", s, "' is not a size S or WxH");
    const long long v = std::stoll(t);
    UNETCU_CHECK(v > 0, "'", s, "' is not a size S or WxH: a side of 0");
    return int(std::min<long long>(v, INT_MAX));  // too large: refused by the range checks
  };
  if (x == std::string::npos) {
    *width = 0, *height = side(s);
  } else {
    *width = side(s.substr(0, x)), *height = side(s.substr(x + 1));
  }
}

}  // namespace unetcu
