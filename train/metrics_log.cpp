#include "train/metrics_log.h"

#include <cerrno>
#include <cmath>
#include <cstring>

namespace unetcu {

namespace {

// The columns after kind, epoch and step, in order; step rows fill time, train_loss, img/s and lr.
// Epoch rows leave the gradient-norm columns empty without gradient clipping.
constexpr const char* kColumns[] = {"time_s",        "train_loss",   "val_loss",     "val_iou",
                                    "val_dice",      "images_per_s", "lr",           "peak_mem_mib",
                                    "loader_wait_s", "grad_norm",    "grad_norm_max", "clipped_fraction"};
constexpr int kNumColumns = int(sizeof(kColumns) / sizeof(kColumns[0]));

std::string num(double v) {
  if (!std::isfinite(v)) return "";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

}  // namespace

MetricsLog::MetricsLog(const std::string& path, bool append, const std::vector<std::string>& class_names)
    : jsonl_(ends_with(path, ".jsonl")), path_(path) {
  if (class_names.size() >= 2)
    for (const std::string& n : class_names) extra_.push_back("val_iou_" + n);
  if (path.empty()) return;
  f_ = std::fopen(path.c_str(), append ? "a" : "w");
  UNETCU_CHECK(f_, "cannot write the metrics file ", path, ": ", std::strerror(errno));
  std::string header = "kind,epoch,step";
  for (const char* c : kColumns) header += std::string(",") + c;
  for (const std::string& c : extra_) header += "," + c;
  std::fseek(f_, 0, SEEK_END);
  const long size = std::ftell(f_);  // -1 where it cannot seek (a terminal, a pipe): no header
  if (!jsonl_ && size == 0) {
    std::fprintf(f_, "%s\n", header.c_str());
    std::fflush(f_);
  } else if (!jsonl_ && append && size > 0) {
    // Rows appended under another header (a file of another program or version) would be
    // read into the wrong columns.
    std::FILE* in = std::fopen(path.c_str(), "r");
    const int open_error = errno;
    std::string first;
    for (int ch; in && (ch = std::fgetc(in)) != EOF && ch != '\n' && first.size() <= header.size();)
      first += char(ch);
    if (in) std::fclose(in);
    if (!first.empty() && first.back() == '\r') first.pop_back();  // written on Windows
    if (!in || first != header) {
      std::fclose(f_);
      f_ = nullptr;
      UNETCU_CHECK(in, "cannot read the metrics file ", path, " to append to it: ", std::strerror(open_error));
      UNETCU_CHECK(false, "the metrics file ", path, " has other columns than this run writes (written by "
                   "another version or program?): move it aside or name another file; this run writes ", header);
    }
  }
}

MetricsLog::~MetricsLog() {
  if (f_) std::fclose(f_);
}

void MetricsLog::row(const char* kind, int epoch, int64_t step, const std::string* fields,
                     const std::vector<double>& extra) {
  if (!f_) return;
  auto extra_field = [&](size_t i) { return i < extra.size() ? num(extra[i]) : std::string(); };
  if (jsonl_) {
    std::fprintf(f_, "{\"kind\": \"%s\", \"epoch\": %d", kind, epoch);
    if (step >= 0) std::fprintf(f_, ", \"step\": %lld", static_cast<long long>(step));
    for (int i = 0; i < kNumColumns; ++i)
      if (!fields[i].empty()) std::fprintf(f_, ", \"%s\": %s", kColumns[i], fields[i].c_str());
    for (size_t i = 0; i < extra_.size(); ++i)
      if (!extra_field(i).empty()) std::fprintf(f_, ", \"%s\": %s", extra_[i].c_str(), extra_field(i).c_str());
    std::fprintf(f_, "}\n");
  } else {
    std::fprintf(f_, "%s,%d,", kind, epoch);
    if (step >= 0) std::fprintf(f_, "%lld", static_cast<long long>(step));
    for (int i = 0; i < kNumColumns; ++i) std::fprintf(f_, ",%s", fields[i].c_str());
    for (size_t i = 0; i < extra_.size(); ++i) std::fprintf(f_, ",%s", extra_field(i).c_str());
    std::fprintf(f_, "\n");
  }
  UNETCU_CHECK(std::fflush(f_) == 0 && !std::ferror(f_), "cannot write the metrics file ", path_,
               ": ", std::strerror(errno));
}

void MetricsLog::epoch(const EpochStats& st, double lr) {
  const std::string fields[kNumColumns] = {
      num(st.seconds),        num(st.train_loss),
      num(st.val_loss),       num(st.val_iou),
      num(st.val_dice),       num(st.images_per_second),
      num(lr),
      // Device memory exists only on GPUs: empty for CPU runs.
      st.peak_device_bytes ? num(double(st.peak_device_bytes) / (1 << 20)) : std::string(),
      num(st.wait_seconds),
      num(st.grad_norm),      num(st.grad_norm_max),
      num(st.clipped_fraction)};
  row("epoch", st.epoch, -1, fields, st.val_class_iou);
}

void MetricsLog::step(int epoch, int64_t step, double loss, double seconds, int64_t images, double lr) {
  std::string fields[kNumColumns];
  fields[0] = num(seconds);
  fields[1] = num(loss);
  fields[5] = num(seconds > 0 ? double(images) / seconds : NAN);
  fields[6] = num(lr);
  row("step", epoch, step, fields, {});
}

}  // namespace unetcu
