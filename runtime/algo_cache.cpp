#include "runtime/algo_cache.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "runtime/common.h"

namespace unetcu {

const char* const kConvAlgoCacheHeader = "unetcu conv_algos v1";

namespace {

// Keeps the key one token per field: no spaces, tabs or line breaks from a device name.
std::string token(const std::string& s) {
  std::string out = s.empty() ? "_" : s;
  for (char& ch : out) {
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
                    ch == '.' || ch == '-' || ch == '_';
    if (!ok) ch = '_';
  }
  return out;
}

std::string choice_text(const ConvAlgoChoice& c) {
  return str_cat("algo=", c.algo, " math=", c.math_type, " det=", c.deterministic ? 1 : 0);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t at = s.find(sep, start);
    parts.push_back(s.substr(start, at == std::string::npos ? std::string::npos : at - start));
    if (at == std::string::npos) return parts;
    start = at + 1;
  }
}

// "name=<digits>" with a value in [0, limit).
bool parse_field(const std::string& tok, const char* name, int limit, int* value) {
  const std::string prefix = std::string(name) + "=";
  if (tok.compare(0, prefix.size(), prefix) != 0) return false;
  const std::string digits = tok.substr(prefix.size());
  if (digits.empty() || digits.size() > 4) return false;
  int v = 0;
  for (char ch : digits) {
    if (ch < '0' || ch > '9') return false;
    v = v * 10 + (ch - '0');
  }
  if (v >= limit) return false;
  *value = v;
  return true;
}

bool parse_choice(const std::string& text, ConvAlgoChoice* c) {
  const std::vector<std::string> t = split(text, ' ');
  int det = 0;
  // cuDNN has at most 8 algorithms per direction and 4 math types; a little room for more.
  if (t.size() != 3 || !parse_field(t[0], "algo", 64, &c->algo) ||
      !parse_field(t[1], "math", 16, &c->math_type) || !parse_field(t[2], "det", 2, &det))
    return false;
  c->deterministic = det == 1;
  return true;
}

// The value of field `name` in a key's text ("" when absent).
std::string key_field(const std::string& key, const std::string& name) {
  for (const std::string& tok : split(key, ' '))
    if (tok.size() > name.size() && tok.compare(0, name.size(), name) == 0 && tok[name.size()] == '=')
      return tok.substr(name.size() + 1);
  return "";
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

}  // namespace

std::string conv_algo_key_text(const ConvAlgoKey& k) {
  return str_cat("cudnn=", k.cudnn_version, " device=", token(k.device), " cc=", k.cc_major, ".",
                 k.cc_minor, " dir=", token(k.direction), " dtype=", token(k.dtype),
                 " tf32=", k.tf32 ? 1 : 0, " det=", k.deterministic ? 1 : 0, " x=", k.n, "x", k.c,
                 "x", k.h, "x", k.w, " w=", k.o, "x", k.c, "x", k.kh, "x", k.kw, " stride=", k.sh,
                 "x", k.sw, " pad=", k.ph, "x", k.pw);
}

// A provisional choice is written under its key with this suffix: a reader that does not know
// the mark (an older build sharing the file) takes it for another key, never matched.
const char* const kProvisionalMark = " provisional=1";

std::string format_conv_algo_cache(const ConvAlgoEntries& entries) {
  std::string out = std::string(kConvAlgoCacheHeader) + "\n";
  for (const auto& [key, choice] : entries)
    out += key + (choice.provisional ? kProvisionalMark : "") + "\t" + choice_text(choice) + "\n";
  return out;
}

bool parse_conv_algo_cache(const std::string& text, ConvAlgoEntries* entries, std::string* error) {
  entries->clear();
  auto fail = [&](const std::string& why) {
    entries->clear();
    *error = why;
    return false;
  };
  if (text.empty() || text.back() != '\n') return fail("not a complete file (no final line break)");
  std::vector<std::string> lines = split(text.substr(0, text.size() - 1), '\n');
  if (lines[0] != kConvAlgoCacheHeader)
    return fail(str_cat("first line is not \"", kConvAlgoCacheHeader, "\" (another format version?)"));
  for (size_t i = 1; i < lines.size(); ++i) {
    std::vector<std::string> kv = split(lines[i], '\t');
    ConvAlgoChoice c;
    if (kv.size() != 2 || kv[0].compare(0, 6, "cudnn=") != 0 || !parse_choice(kv[1], &c))
      return fail(str_cat("line ", i + 1, " is not \"<key>\\t algo=N math=N det=0|1\""));
    const size_t mark = std::strlen(kProvisionalMark);
    if (kv[0].size() > mark && kv[0].compare(kv[0].size() - mark, mark, kProvisionalMark) == 0) {
      kv[0].resize(kv[0].size() - mark);
      c.provisional = true;
    }
    const auto [it, added] = entries->emplace(kv[0], c);
    if (!added) {
      if (it->second.provisional == c.provisional) return fail(str_cat("line ", i + 1, " repeats a key"));
      if (it->second.provisional) it->second = c;  // a final choice wins over a provisional one
    }
  }
  return true;
}

std::string default_conv_algo_cache_path() {
  const std::string off = env("UNETCU_ALGO_CACHE");
  if (off == "0" || off == "off" || off == "no" || off == "false") return "";
  const std::string dir = env("UNETCU_CACHE_DIR");
  if (!dir.empty()) return dir + "/conv_algos.txt";
  const std::string xdg = env("XDG_CACHE_HOME");
  if (!xdg.empty() && xdg[0] == '/') return xdg + "/unetcu/conv_algos.txt";  // XDG: absolute only
  const std::string home = env("HOME");
  if (!home.empty()) return home + "/.cache/unetcu/conv_algos.txt";
  return "";
}

ConvAlgoCache::ConvAlgoCache(std::string path, Warn warn)
    : path_(std::move(path)), warn_(std::move(warn)) {}

void ConvAlgoCache::warn(const std::string& message) {
  if (warn_)
    warn_(message);
  else
    std::fprintf(stderr, "unetcu: %s\n", message.c_str());
}

ConvAlgoEntries ConvAlgoCache::read_file() {
  std::ifstream in(path_, std::ios::binary);
  if (!in) return {};  // none yet
  std::ostringstream text;
  text << in.rdbuf();
  ConvAlgoEntries entries;
  std::string error;
  if (!parse_conv_algo_cache(text.str(), &entries, &error)) {
    if (!loaded_)  // one warning per process, however often the file is read
      warn(str_cat("ignoring the convolution algorithm cache ", path_, ": ", error,
                   "; the algorithms are searched again and the file rewritten"));
    return {};
  }
  return entries;
}

std::optional<ConvAlgoChoice> ConvAlgoCache::find(const ConvAlgoKey& key) {
  if (!enabled()) return std::nullopt;
  std::lock_guard<std::mutex> lock(mu_);
  if (!loaded_) {
    entries_ = read_file();
    loaded_ = true;
  }
  auto it = entries_.find(conv_algo_key_text(key));
  if (it == entries_.end()) return std::nullopt;
  return it->second;
}

void ConvAlgoCache::store(const ConvAlgoKey& key, const ConvAlgoChoice& choice) {
  if (!enabled()) return;
  std::lock_guard<std::mutex> lock(mu_);
  const std::string k = conv_algo_key_text(key);
  if (write_failed_) {
    entries_[k] = choice;
    return;
  }
  // What is on disk now: another process may have added entries since this one read it.
  ConvAlgoEntries merged = read_file();
  loaded_ = true;
  for (const auto& [ek, ec] : entries_) merged.emplace(ek, ec);
  const auto existing = merged.find(k);
  if (choice.provisional && existing != merged.end() && !existing->second.provisional) {
    entries_ = merged;  // another process measured it alone meanwhile: that one stays
    return;
  }
  merged[k] = choice;
  // Entries of this device from another cuDNN version will never match again: drop them.
  const std::string device = key_field(k, "device"), cc = key_field(k, "cc");
  const std::string version = key_field(k, "cudnn");
  for (auto it = merged.begin(); it != merged.end();) {
    const bool stale = key_field(it->first, "device") == device &&
                       key_field(it->first, "cc") == cc && key_field(it->first, "cudnn") != version;
    it = stale ? merged.erase(it) : std::next(it);
  }
  entries_ = merged;

  // Written beside the file under a name no other writer uses, then renamed over it: rename
  // replaces the file in one step, so a reader sees the old file or the new one.
  static std::atomic<uint64_t> counter{0};
  const std::string tmp =
      str_cat(path_, ".tmp.", ::getpid(), ".",
              std::hash<std::thread::id>()(std::this_thread::get_id()) % 1000000, ".", counter++);
  std::error_code ec;
  const std::filesystem::path parent = std::filesystem::path(path_).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  bool ok = false;
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (out) {
      out << format_conv_algo_cache(merged);
      out.close();
      ok = !out.fail();
    }
  }
  const int saved_errno = errno;
  if (ok && std::rename(tmp.c_str(), path_.c_str()) == 0) return;
  const std::string why = std::strerror(ok ? errno : saved_errno);
  std::remove(tmp.c_str());
  write_failed_ = true;
  warn(str_cat("cannot write the convolution algorithm cache ", path_, " (", why,
               "); continuing without saving it (UNETCU_ALGO_CACHE=0 turns it off)"));
}

}  // namespace unetcu
