#include "train/monitor.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "runtime/common.h"

namespace unetcu {

namespace {

// "%.17g" gives back every double exactly through strtod.
std::string exact(double v) {
  char s[40];
  std::snprintf(s, sizeof s, "%.17g", v);
  return s;
}

[[noreturn]] void bad_record(const std::string& file, const std::string& what) {
  throw Error(str_cat(file, ": the training state's record of the monitored metric ", what));
}

double read_value(const std::map<std::string, std::string>& r, const std::string& key,
                  const std::string& file) {
  const auto it = r.find(key);
  if (it == r.end()) bad_record(file, "has no " + key);
  const std::string& s = it->second;
  char* end = nullptr;
  const double v = s.empty() || s.size() > 32 ? NAN : std::strtod(s.c_str(), &end);
  if (!std::isfinite(v) || end != s.c_str() + s.size())
    bad_record(file, "has a " + key + " that is not a finite number: '" + s + "'");
  return v;
}

int read_count(const std::map<std::string, std::string>& r, const std::string& key, int lo, int hi,
               const std::string& file) {
  const auto it = r.find(key);
  if (it == r.end()) bad_record(file, "has no " + key);
  const std::string& s = it->second;
  bool digits = !s.empty() && s.size() <= 9;
  for (char c : s) digits = digits && c >= '0' && c <= '9';
  const int v = digits ? std::atoi(s.c_str()) : -1;
  if (!digits || v < lo || v > hi)
    bad_record(file, str_cat("has ", key, " '", s, "', not a whole number in ", lo, "..", hi));
  return v;
}

}  // namespace

void MonitorOptions::check() const {
  UNETCU_CHECK(patience >= 0 && patience <= kMaxPatience, "early stopping: the patience must be in 0..",
               kMaxPatience, " epochs, got ", patience);
  UNETCU_CHECK(min_delta >= 0 && std::isfinite(min_delta),
               "early stopping: the smallest improvement must be a finite number >= 0, got ", min_delta);
}

MetricMonitor::MetricMonitor(MonitorOptions o) : o_(o) { o_.check(); }

const char* MetricMonitor::metric_name() const { return name_of(kMonitorNames, o_.metric); }

bool MetricMonitor::better(double a, double b, double delta) const {
  return o_.metric == MonitorKind::ValLoss ? a < b - delta : a > b + delta;
}

MetricMonitor::Verdict MetricMonitor::update(int epoch, double value) {
  UNETCU_CHECK(std::isfinite(value), "monitor: ", metric_name(), " of epoch ", epoch, " is not finite");
  Verdict v;
  if (!best_ || better(value, *best_, 0)) {
    best_ = value;
    best_epoch_ = epoch;
    v.best = true;
  }
  if (!reference_ || better(value, *reference_, o_.min_delta)) {
    reference_ = value;
    stale_ = 0;
  } else {
    ++stale_;
  }
  v.stop = o_.patience > 0 && stale_ >= o_.patience;
  return v;
}

std::map<std::string, std::string> MetricMonitor::record() const {
  if (!best_) return {};
  return {{"monitor", metric_name()},
          {"best", exact(*best_)},
          {"best_epoch", std::to_string(best_epoch_)},
          {"reference", exact(*reference_)},
          {"stale", std::to_string(stale_)}};
}

bool MetricMonitor::restore(const std::map<std::string, std::string>& r, int epoch, const std::string& file) {
  const auto it = r.find("monitor");
  if (it == r.end() || it->second != metric_name()) return false;
  const double best = read_value(r, "best", file), reference = read_value(r, "reference", file);
  // The record is that of the epochs before `epoch` (the checkpoint's): the best among them,
  // and at most all of them stale but the first.
  const int best_epoch = read_count(r, "best_epoch", 1, epoch, file);
  const int stale = read_count(r, "stale", 0, epoch - 1, file);
  // The reference moves only to a value better than itself, the best to any such value.
  if (better(reference, best, 0)) bad_record(file, "has a reference better than its best");
  // IoU and Dice are ratios, the losses (BCE, Dice, their sum) not negative.
  const bool loss = o_.metric == MonitorKind::ValLoss;
  for (double v : {best, reference})
    if (v < 0 || (!loss && v > 1))
      bad_record(file, str_cat("has a value no ", metric_name(), " takes: ", exact(v)));
  // When the reference moves, the best moves with it (a value past the reference by more than
  // the smallest improvement is past every value since): the best is no older than that epoch.
  if (best_epoch < epoch - stale)
    bad_record(file, str_cat("has best_epoch ", best_epoch, ", before epoch ", epoch - stale,
                             " when its reference last moved"));
  best_ = best;
  reference_ = reference;
  best_epoch_ = best_epoch;
  stale_ = stale;
  return true;
}

}  // namespace unetcu
